"""The policy losses, one row each: everything PPO needs to know about `policy_loss`.

A row says which loss aggregation its papers use (the first is `loss_aggregation`'s default for it), which
clip keys it reads and what they resolve to when null, whether it needs one advantage per response, whether
the sampler correction (the sampler's recorded log-probs) weighs its token losses, whether its defaults take
the plain update, and its token-loss function. The config (`llm_rlhf.ppo.config`) and the update
(`llm_rlhf.ppo.update`) read the row and never the name. The math is pure functions, each citing its paper:
gspo's, cispo's and sapo's token losses below; ppo_clip's in `ppo_math`, where PPO's plain loss is built on it:

    loss      aggregation (papers)                     clip keys read              null clip  per response
    ppo_clip  token_mean, seq_mean_token_mean,         cliprange_low/high,         cliprange  no
              token_sum_norm (PPO/DAPO, GRPO, Dr. GRPO) dual_clip
    gspo      seq_mean_token_mean                      cliprange_low/high          3e-4/4e-4  yes
    cispo     token_mean                               cliprange_high              cliprange  no
    sapo      seq_mean_token_mean                      none (tau 1.0 / 1.05)       -          no

Why two update paths (`Config.plain_policy_loss`, `PPOUpdate.policy_terms`): with every key of the family at
its default, ppo_clip with a symmetric clip and token_mean, the trainer computes the loss with the arithmetic
PPO used before the family existed, `ppo_math.policy_loss` (a masked mean per micro-batch, weighted by its
share of the minibatch's tokens). The family's path (`loss_math.aggregate_loss`: a sum over the rows divided
by the global normaliser) is the same math but another order of float operations, so taking it for the
defaults would change the weights of every default run in the last bits; the plain path keeps them
bit-identical (the recorded hashes of `benchmarks/behaviour_hashes.py`). Only a row with `plain` may take it.

Adding a policy loss: its pure function below with its tests against a worked example (as in
tests/rl/test_loss_family.py), one `PolicyLoss` row with an adapter in the style of `_gspo`, and its row in
the option table of docs/guides/policy-losses.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm_rlhf.rl import loss_math, ppo_math

CLIP_KEYS = ("cliprange_low", "cliprange_high", "dual_clip")  # the config keys a row may read (`clip_keys`)
AGGREGATIONS = loss_math.LOSS_AGGREGATIONS


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss's function may read of a micro-batch. logprobs (with grad), old_logprobs,
    advantages: (b, R); response_mask: (b, R) bool, the loss mask. cliprange_low, cliprange_high: eps_low and
    eps_high resolved (`Config.clip_low`, `Config.clip_high`); dual_clip: c or None."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    cliprange_low: float
    cliprange_high: float
    dual_clip: float | None


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss.

    name: the value of `policy_loss`. description: one line for --help and errors. aggregations: the loss
    aggregations its papers use; the first is `loss_aggregation`'s default (null) for it, and an explicit
    other one is accepted with a note at the start of the run. clip_keys: which of `CLIP_KEYS` it reads; set
    to another value than null, the others are a ConfigError. clip_defaults: (eps_low, eps_high) when
    cliprange_low / cliprange_high are null; None = cliprange. response_advantages: it needs one advantage per
    response (a sequence-level ratio): only for an estimator whose `Estimator.response_advantages` is true.
    sampler_correction: the sampler correction's weights (from the sampler's recorded log-probs q,
    `sampler_correction`) multiply its token losses. plain: with a symmetric clip, token_mean and no other key
    of the family it is PPO's loss as computed before the family existed, which the trainer computes with that
    arithmetic (the module's docstring says why). token_losses: the function, per-token losses (b, R) and
    their `ppo_math.TokenLossStats`."""

    name: str
    description: str
    aggregations: tuple[str, ...]
    clip_keys: tuple[str, ...]
    clip_defaults: tuple[float | None, float | None]
    response_advantages: bool
    sampler_correction: bool
    plain: bool
    token_losses: Callable[[LossInputs], tuple[torch.Tensor, ppo_math.TokenLossStats]]

    @property
    def aggregation(self) -> str:
        """`loss_aggregation` when null: its paper's."""
        return self.aggregations[0]


# ---------------------------------------------------------------------------------------------
# The token losses of the family besides PPO's clip (`ppo_math.ppo_clip_token_losses`, which PPO's plain
# loss `ppo_math.policy_loss` is built on): per-token losses (B, T) for `loss_math.aggregate_loss`
# ---------------------------------------------------------------------------------------------


def gspo_token_losses(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_low: float = 3e-4,
    cliprange_high: float = 4e-4,
) -> tuple[torch.Tensor, ppo_math.TokenLossStats]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7 and the GSPO-token form):
    one length-normalised ratio per response, clipped per response:

        s_i    = exp( (1/|y_i|) * sum_t log(pi_theta(y_t) / pi_old(y_t)) )          (B,)
        s_i,t  = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t))      value s_i, d s_i,t / d log pi(y_t) = s_i
        l_i,t  = -min(s_i,t * A_i, clip(s_i,t, 1 - eps_low, 1 + eps_high) * A_i)

    Every token of response i carries the value of its response's loss, so `loss_math.aggregate_loss` with
    "seq_mean_token_mean" is GSPO's objective, the mean over responses of -min(s_i A_i, clip(s_i) A_i), and
    its gradient (1/G) * sum_i (1/|y_i|) * sum_t -A_i * s_i * grad log pi(y_t) = (1/G) * sum_i -A_i * grad s_i.
    A clipped response contributes a constant (gradient 0 on all its tokens). The ratios of a sequence stay
    near 1 (a mean of log-ratios), hence the small clip range of the paper: 3e-4 below, 4e-4 above.

    Worked example (tests/rl/test_loss_family.py): s_a = 1.0816654 (A = 1), s_b = 0.9904902 (A = -0.5);
    losses a: -1.0004, b: 0.49985, both clipped; mean over responses -0.250275.

    For per-response advantages (grpo, dr_grpo, rloo, remax: one A_i spread over the response with
    `ppo_math.token_advantages`); not for gae or reinforce_pp, whose advantages vary along the response (it
    would then be GSPO-token with per-token advantages, which the sequence clip was not designed around).
    logprobs (with grad), old_logprobs, advantages: (B, T); response_mask: (B, T) bool. A row with no response
    token has s = 1 and loss 0. Returns (token losses (B, T), 0 off the mask; TokenLossStats, whose ratio and
    clip flags are the response's on each of its tokens).
    """
    log_ratio = logprobs - old_logprobs  # (B, T)
    log_seq_ratio = ppo_math.masked_mean(log_ratio, response_mask, dim=-1)  # (B,) log s_i
    # log s_i,t = sg(log s_i) + log pi(y_t) - sg(log pi(y_t)): the value is log s_i exactly (x - x = 0)
    log_token_ratio = log_seq_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()  # (B, T)
    ratio = torch.exp(log_token_ratio)  # (B, T) s_i,t
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)  # (B, T)
    losses = torch.maximum(unclipped, clipped)  # (B, T)
    with torch.no_grad():
        is_clipped = (clipped > unclipped) & response_mask  # (B, T), the same on every token of a response
        stats = ppo_math.TokenLossStats(
            ratio=ratio.detach(),
            clipped_high=is_clipped & (advantages > 0),
            clipped_low=is_clipped & (advantages < 0),
            dual_clipped=torch.zeros_like(response_mask),
        )
    return torch.where(response_mask, losses, 0), stats


def cispo_token_losses(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_high: float,
) -> tuple[torch.Tensor, ppo_math.TokenLossStats]:
    """CISPO (MiniMax 2025, "MiniMax-M1", sec. 3.1, eq. 4-5 with no lower bound): a REINFORCE term weighted by
    the clipped, stop-gradient importance ratio:

        rho_t = exp(log pi_theta(y_t) - log pi_old(y_t))
        l_t   = -sg(min(rho_t, 1 + eps_high)) * A_t * log pi_theta(y_t)
        d l_t / d log pi_theta(y_t) = -min(rho_t, 1 + eps_high) * A_t

    Unlike PPO's clip, which zeroes the gradient of a clipped token, only the weight is truncated: every
    token keeps a gradient (the rare tokens PPO clips are often the ones a reasoning chain turns on). At
    rho = 1 the gradient is PPO's. The value of l_t depends on log pi itself and is no objective to read;
    its gradient is what matters.

    Worked example (tests/rl/test_loss_family.py), eps_high = 0.28, token-mean over the 6 tokens:
    d loss / d log pi = a: (-0.21333, -0.15), b: (0.091667, 0.058333, 0.083333, 0.104167).

    For every advantage estimator (per-token or per-response advantages).
    logprobs (with grad), old_logprobs, advantages: (B, T); response_mask: (B, T) bool.
    Returns (token losses (B, T), 0 off the mask; TokenLossStats: clipped_high where the weight is truncated).
    """
    ratio = torch.exp(logprobs - old_logprobs).detach()  # (B, T) no gradient through the weight
    weight = torch.clamp(ratio, max=1.0 + cliprange_high)  # (B, T)
    losses = -weight * advantages * logprobs  # (B, T)
    with torch.no_grad():
        stats = ppo_math.TokenLossStats(
            ratio=ratio,
            clipped_high=(ratio > 1.0 + cliprange_high) & response_mask,
            clipped_low=torch.zeros_like(response_mask),
            dual_clipped=torch.zeros_like(response_mask),
        )
    return torch.where(response_mask, losses, 0), stats


def sapo_token_losses(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, ppo_math.TokenLossStats]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): no hard clip; the ratio passes
    through a soft, sigmoid gate whose temperature depends on the sign of the advantage:

        rho_t = exp(log pi_theta(y_t) - log pi_old(y_t))
        tau_t = tau_pos where A_t > 0, tau_neg otherwise
        f(rho) = (4 / tau) * sigmoid(tau * (rho - 1))
        l_t   = -f(rho_t) * A_t
        d l_t / d log pi_theta(y_t) = -A_t * rho_t * 4 * s * (1 - s),   s = sigmoid(tau_t * (rho_t - 1))

    d f / d rho = 4 s (1 - s) is 1 at rho = 1 (the plain policy gradient there) and fades smoothly as the
    token goes off-policy, instead of PPO's step to 0 at the clip; tau_neg > tau_pos fades the negative
    advantages faster (the paper: a negative update raises the logits of every other token of the
    vocabulary, the less stable side).
    The value of l_t at rho = 1 is -2 A_t / tau_t, not -A_t: the gate's gradient, not its value, is PPO's.

    Worked example (tests/rl/test_loss_family.py), rho = (1.2, 0.9, 1.0), A = (1.0, -0.5, 2.0):
    l = (-2.199336, 0.902427, -4.0), d l / d log pi = (-1.188080, 0.448762, -2.0); far off-policy, A = 1:
    rho = 2 -> -1.572895, rho = 3 -> -1.259923.

    For every advantage estimator (per-token or per-response advantages).
    logprobs (with grad), old_logprobs, advantages: (B, T); response_mask: (B, T) bool.
    Returns (token losses (B, T), 0 off the mask; TokenLossStats: no flag is ever set, nothing is clipped).
    """
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    tau = torch.where(
        advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg)
    )  # (B, T)
    gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))  # (B, T) f(rho)
    losses = -gate * advantages  # (B, T)
    with torch.no_grad():
        never = torch.zeros_like(response_mask)
        stats = ppo_math.TokenLossStats(
            ratio=ratio.detach(), clipped_high=never, clipped_low=never, dual_clipped=never
        )
    return torch.where(response_mask, losses, 0), stats


# ---------------------------------------------------------------------------------------------
# The rows: each loss's adapter from a micro-batch's tensors, then its facts
# ---------------------------------------------------------------------------------------------


def _tokens(x: LossInputs) -> dict[str, torch.Tensor]:
    return dict(
        logprobs=x.logprobs,
        old_logprobs=x.old_logprobs,
        advantages=x.advantages,
        response_mask=x.response_mask,
    )


def _ppo_clip(x: LossInputs):
    return ppo_math.ppo_clip_token_losses(
        **_tokens(x), cliprange_low=x.cliprange_low, cliprange_high=x.cliprange_high, dual_clip=x.dual_clip
    )


def _gspo(x: LossInputs):
    return gspo_token_losses(**_tokens(x), cliprange_low=x.cliprange_low, cliprange_high=x.cliprange_high)


def _cispo(x: LossInputs):
    return cispo_token_losses(**_tokens(x), cliprange_high=x.cliprange_high)


SAPO_TAU = (1.0, 1.05)  # Gao et al. 2025: (tau_pos, tau_neg), the gate's temperatures for A > 0 and A < 0


def _sapo(x: LossInputs):
    return sapo_token_losses(**_tokens(x), tau_pos=SAPO_TAU[0], tau_neg=SAPO_TAU[1])


ROWS = (
    PolicyLoss(
        name="ppo_clip",
        description="PPO's clip, with clip-higher (DAPO) and the dual clip; Schulman et al. 2017",
        aggregations=AGGREGATIONS,  # PPO and DAPO; GRPO's original (Shao et al. 2024); Dr. GRPO (Liu et al.)
        clip_keys=CLIP_KEYS,
        clip_defaults=(None, None),
        response_advantages=False,
        sampler_correction=True,
        plain=True,
        token_losses=_ppo_clip,
    ),
    PolicyLoss(
        name="gspo",
        description="one length-normalised ratio per response, clipped per response; Zheng et al. 2025",
        aggregations=("seq_mean_token_mean",),  # GSPO's objective: the mean over responses
        clip_keys=("cliprange_low", "cliprange_high"),
        clip_defaults=(3e-4, 4e-4),  # the paper's, for a ratio that stays near 1 (a mean of log-ratios)
        response_advantages=True,
        sampler_correction=True,
        plain=False,
        token_losses=_gspo,
    ),
    PolicyLoss(
        name="cispo",
        description="a REINFORCE term weighted by the ratio truncated at 1 + cliprange_high, stop-gradient: "
        "clipped tokens keep their gradient; MiniMax 2025",
        aggregations=("token_mean",),  # MiniMax-M1, eq. 4: normalised by the group's total tokens
        clip_keys=("cliprange_high",),
        clip_defaults=(None, None),
        response_advantages=False,
        sampler_correction=True,
        plain=False,
        token_losses=_cispo,
    ),
    PolicyLoss(
        name="sapo",
        description=f"no hard clip: a sigmoid gate of the ratio, tau {SAPO_TAU[0]:g} where A > 0 and "
        f"{SAPO_TAU[1]:g} where A < 0, fades the gradient off-policy; Gao et al. 2025",
        aggregations=("seq_mean_token_mean",),  # Gao et al. 2025: GRPO's mean over responses of token means
        clip_keys=(),
        clip_defaults=(None, None),
        response_advantages=False,
        sampler_correction=True,
        plain=False,
        token_losses=_sapo,
    ),
)
LOSSES: dict[str, PolicyLoss] = {row.name: row for row in ROWS}
POLICY_LOSSES = tuple(LOSSES)  # the accepted values of `policy_loss`, in table order
DEFAULT_LOSS = "ppo_clip"  # the config's default, and what a run's config from before the key existed used


def help_text(response_estimators: str) -> str:
    """The losses as --help lists them: "'ppo_clip' (PPO's clip, ...), 'gspo' (...; grpo, ... only), ...";
    `response_estimators` names the estimators that give one advantage per response."""
    return ", ".join(
        f"'{row.name}' ({row.description}"
        + (f"; {response_estimators} only" if row.response_advantages else "")
        + f"; loss_aggregation {row.aggregation})"
        for row in ROWS
    )
