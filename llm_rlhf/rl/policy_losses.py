"""The policy losses, one row each: everything PPO needs to know about `policy_loss` (issue 50).

A row says which loss aggregation its papers use (the first is `loss_aggregation`'s default for it), which
clip keys it reads and what they resolve to when null, whether it needs one advantage per response, whether
the sampler correction (the sampler's recorded log-probs) weighs its token losses, whether its defaults take
the plain update, and its token-loss function. The config (`ppo_config`) and the trainer (`ppo`) read the row
and never the name; the math is the pure functions of `ppo_math` (SPEC "The policy-loss family of 2025-26"):

    loss      aggregation (papers)                     clip keys read              null clip  per response
    ppo_clip  token_mean, seq_mean_token_mean,         cliprange_low/high,         cliprange  no
              token_sum_norm (PPO/DAPO, GRPO, Dr. GRPO) dual_clip
    gspo      seq_mean_token_mean                      cliprange_low/high          3e-4/4e-4  yes
    cispo     token_mean                               cliprange_high              cliprange  no
    sapo      seq_mean_token_mean                      none (tau 1.0 / 1.05)       -          no

Why two update paths (`Config.plain_policy_loss`, `PPOTrainer.policy_terms`): with every key of the family at
its default, ppo_clip with a symmetric clip and token_mean, the trainer computes the loss of every run before
issue 37 with its arithmetic, `ppo_math.policy_loss` (a masked mean per micro-batch, weighted by its share of
the minibatch's tokens). The family's path (`aggregate_loss`: a sum over the rows divided by the global
normaliser) is the same math but another order of float operations, so taking it for the defaults would
change the weights of every default run in the last bits; the plain path keeps them bit-identical (issue 36's
and issue 50's hashes, `benchmarks/behaviour_hashes.py`). Only a row with `plain` may take it.

Adding a policy loss: its pure function in `ppo_math` with its tests against the SPEC's worked example, one
`PolicyLoss` row below with an adapter in the style of `_gspo`, and its row in the README's option table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm_rlhf.rl import ppo_math

CLIP_KEYS = ("cliprange_low", "cliprange_high", "dual_clip")  # the config keys a row may read (`clip_keys`)
AGGREGATIONS = ppo_math.LOSS_AGGREGATIONS


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
    of the family it is PPO's loss of every run before issue 37, which the trainer computes with that
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
    return ppo_math.gspo_token_losses(
        **_tokens(x), cliprange_low=x.cliprange_low, cliprange_high=x.cliprange_high
    )


def _cispo(x: LossInputs):
    return ppo_math.cispo_token_losses(**_tokens(x), cliprange_high=x.cliprange_high)


SAPO_TAU = (1.0, 1.05)  # Gao et al. 2025: (tau_pos, tau_neg), the gate's temperatures for A > 0 and A < 0


def _sapo(x: LossInputs):
    return ppo_math.sapo_token_losses(**_tokens(x), tau_pos=SAPO_TAU[0], tau_neg=SAPO_TAU[1])


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
