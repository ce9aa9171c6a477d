"""The policy-loss family of 2025-26 as pure functions: per-token losses, their aggregation over a minibatch,
the sampler's importance corrections, the overlong penalty and truncation mask of DAPO, and dynamic sampling's
choice of groups. Shapes and names follow `llm_rlhf.rl.ppo_math` (B sequences, T positions; masks are booleans).

Only torch and `ppo_math`'s masked reductions are imported, so this module can be reviewed and tested on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llm_rlhf.rl.ppo_math import masked_mean, masked_sum, scores_by_prompt

# ---------------------------------------------------------------------------------------------
# The policy-loss family of 2025-26 (DAPO, GSPO, CISPO, SAPO and their kin): per-token losses, their aggregation, sampler correction,
# overlong shaping, dynamic sampling
# ---------------------------------------------------------------------------------------------
#
# The token losses (PPO's clip below, the others in `llm_rlhf.rl.policy_losses`) are (B, T), 0 off the
# mask; `aggregate_loss` turns them into the minibatch's scalar. A caller composes them as
#
#     token_losses, stats = ppo_clip_token_losses(...)        # or gspo_, cispo_, sapo_token_losses
#     token_losses = token_losses * weights                   # sampler_correction_weights (optional)
#     loss = aggregate_loss(token_losses=..., loss_mask=..., aggregation=..., normaliser=N)
#
# with N = the sum of `loss_normaliser` over the whole minibatch (every micro-batch, every process).
# Which token loss, with which clip keys and aggregation: a row of `llm_rlhf.rl.policy_losses`.

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "token_sum_norm")
SAMPLER_CORRECTIONS = ("tis", "mis")


def loss_normaliser(*, loss_mask: torch.Tensor, aggregation: str, max_new_tokens: int) -> torch.Tensor:
    """This part of a minibatch's share of the normaliser N of `aggregate_loss`, a scalar:

        token_mean            sum_{b,t} m_b,t                 the loss tokens
        seq_mean_token_mean   sum_b [any_t m_b,t]             the sequences with at least one loss token
        token_sum_norm        B * max_new_tokens              the constant B * L of Dr. GRPO

    The caller sums it over every micro-batch of the minibatch on every process (`accelerator.reduce`) and
    gives the total to each micro-batch's `aggregate_loss`. `max_new_tokens` (L) is the configured length,
    not the width of the (trimmed) tensors; for episodes the caller gives their budget, max_episode_tokens
    (`ppo.config.Config.response_width`). loss_mask: (B, T) bool (the response mask, less masked-out
    truncated responses).
    """
    if aggregation == "token_mean":
        return loss_mask.sum()
    if aggregation == "seq_mean_token_mean":
        return loss_mask.any(dim=-1).sum()
    if aggregation == "token_sum_norm":
        return torch.tensor(loss_mask.shape[0] * max_new_tokens, device=loss_mask.device)
    raise ValueError(
        f"unknown loss aggregation {aggregation!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}"
    )


def aggregate_loss(
    *,
    token_losses: torch.Tensor,
    loss_mask: torch.Tensor,
    aggregation: str,
    normaliser: torch.Tensor | float,
) -> torch.Tensor:
    """The minibatch loss from per-token losses l_b,t, by `aggregation`, N the *global* normaliser
    (`loss_normaliser` summed over the whole minibatch: every micro-batch, every process):

        token_mean            L = sum_{b,t} m l / N,   N = loss tokens       (each token weighs the same; PPO)
        seq_mean_token_mean   L = sum_b (sum_t m l / sum_t m) / N,  N = sequences   (GRPO, Shao et al. 2024;
                                  GSPO's mean over responses)
        token_sum_norm        L = sum_{b,t} m l / N,   N = B * L constant    (Dr. GRPO, Liu et al. 2025: no
                                  length bias, the same scale for every batch)

    Every term is a sum over rows divided by a global N, so the sum over micro-batches (and processes) of each
    part's `aggregate_loss` equals the loss of the whole minibatch: gradient accumulation and data
    parallelism change only the float rounding. Under DDP, which averages gradients over P processes, each
    process back-propagates P times its part. A normaliser of 0 (nothing counts) gives a loss of 0.
    The loop it replaces, for one whole minibatch:

        if aggregation == "seq_mean_token_mean":
            L = sum(sum(l[b][t] for t in tokens(b)) / len(tokens(b)) for b in rows if tokens(b)) / N
        else:
            L = sum(l[b][t] for b in rows for t in tokens(b)) / N

    For every estimator. token_losses: (B, T); loss_mask: (B, T) bool. Returns a scalar.
    """
    if aggregation in ("token_mean", "token_sum_norm"):
        total = masked_sum(token_losses, loss_mask)  # ()
    elif aggregation == "seq_mean_token_mean":
        total = masked_mean(token_losses, loss_mask, dim=-1).sum()  # () sum of the rows' token means
    else:
        raise ValueError(
            f"unknown loss aggregation {aggregation!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}"
        )
    return total / torch.as_tensor(normaliser, device=total.device).clamp(min=1)


@dataclass(frozen=True)
class SamplerCorrectionStats:
    """Detached diagnostics of `sampler_correction_weights`.

    corrected:       (B, T) bool, True where the weight was truncated at C (TIS) or masked to 0 (MIS).
    mean_weight:     scalar, masked mean of the weights.
    corrected_frac:  scalar, masked mean of `corrected` (the fraction of tokens truncated or masked).
    """

    corrected: torch.Tensor
    mean_weight: torch.Tensor
    corrected_frac: torch.Tensor


def sampler_correction_weights(
    *,
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    correction: str,
    cap: float,
) -> tuple[torch.Tensor, SamplerCorrectionStats]:
    """Per-token importance weight from the sampler q to the old policy, for when the sampler is not the
    trainer (bfloat16 sampling, another engine): the tokens come from q, while PPO's ratio is taken against
    pi_old (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):

        d_t = log pi_old(y_t) - log q(y_t)
        tis   w_t = min(exp(d_t), C)                          truncated importance sampling
        mis   w_t = 1 if 1/C <= exp(d_t) <= C else 0          masked: a token the two disagree on is dropped

    The weights carry no gradient; the caller multiplies the token losses by them before `aggregate_loss`
    (the normaliser is unchanged: a masked token still counts, with weight 0).
    Worked example, d = (0.1, -0.2, 0.9), C = 2: tis w = (1.10517, 0.81873, 2.0), mis w = (1, 1, 0).

    For every estimator and every policy loss. old_logprobs, sampler_logprobs: (B, T); response_mask: (B, T)
    bool. Returns (weights (B, T), 0 off the mask; SamplerCorrectionStats). Raises ValueError for a cap
    below 1 or an unknown correction.
    """
    if not cap >= 1.0:
        raise ValueError(f"the sampler correction's cap must be >= 1 (got {cap})")
    with torch.no_grad():
        ratio = torch.exp(old_logprobs - sampler_logprobs)  # (B, T) pi_old / q
        if correction == "tis":
            corrected = ratio > cap  # (B, T)
            weights = torch.clamp(ratio, max=cap)  # (B, T)
        elif correction == "mis":
            corrected = (ratio < 1.0 / cap) | (ratio > cap)  # (B, T)
            weights = (~corrected).to(ratio.dtype)  # (B, T)
        else:
            raise ValueError(
                f"unknown sampler correction {correction!r}; expected one of {', '.join(SAMPLER_CORRECTIONS)}"
            )
        corrected = corrected & response_mask
        weights = torch.where(response_mask, weights, 0)  # (B, T)
        stats = SamplerCorrectionStats(
            corrected=corrected,
            mean_weight=masked_mean(weights, response_mask),
            corrected_frac=masked_mean(corrected.to(weights.dtype), response_mask),
        )
    return weights, stats


def spread_about_one(*, mean: float, mean_sq_dev: float) -> float:
    """The standard deviation of weights w from two token means that add up over any split of the tokens,
    E[w] and E[(w - 1)^2] (what a minibatch's micro-batches and processes can average exactly):

        std = sqrt( E[(w - 1)^2] - (E[w] - 1)^2 )      (0 where rounding makes it negative)

    Taken about 1, where importance weights sit, so weights within 1e-3 of 1 keep their digits in float32.
    Example: w = (0.5, 1.0, 1.5): E[w] = 1, E[(w - 1)^2] = 1/6, std = sqrt(1/6) = 0.40825.
    """
    return math.sqrt(max(mean_sq_dev - (mean - 1.0) ** 2, 0.0))


def overlong_penalty(
    *,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    max_new_tokens: int,
    overlong_buffer: int,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, sec. 3.4, eq. 13), added to the scores: 0 up to the
    buffer, then a linear ramp to -penalty at max_new_tokens (L_max), and -penalty for a truncated response:

        start = L_max - buffer
        p(y)  = 0                                     |y| <= start
              = -penalty * (|y| - start) / buffer      start < |y| <= L_max
              = -penalty                              truncated (no EOS nor stop string)

    |y| counts the response's tokens, its EOS included (`tokens_mask.sum(-1)`; an episode's policy and
    environment tokens, with L_max its max_episode_tokens: `ppo.config.Config.response_width`). buffer = 0 penalises only
    the truncated responses. Worked example, L_max 20, buffer 4: |y| <= 16 -> 0; 18 -> -0.5; 20 ending with
    EOS -> -1; truncated -> -1.

    For every estimator (it changes the scores, before any advantage). lengths: (B,) integer; truncated:
    (B,) bool. Returns (B,) float. Raises ValueError unless 0 <= overlong_buffer <= max_new_tokens.
    """
    if not 0 <= overlong_buffer <= max_new_tokens:
        raise ValueError(
            f"overlong_buffer must be in [0, max_new_tokens = {max_new_tokens}] (got {overlong_buffer})"
        )
    start = max_new_tokens - overlong_buffer
    over = (lengths - start).clamp(min=0).to(torch.get_default_dtype())  # (B,) tokens into the buffer
    ramp = over / overlong_buffer if overlong_buffer > 0 else torch.zeros_like(over)  # (B,) in [0, 1]
    return -penalty * torch.where(truncated, 1.0, ramp.clamp(max=1.0))  # (B,)


def mask_truncated(*, response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The loss mask without the truncated responses (DAPO, Yu et al. 2025, sec. 3.4, "overlong filtering"):
    a response cut at max_new_tokens is not known to be wrong, so it teaches nothing either way.

        response_mask[b]   T T T T        T T F F
        truncated[b]       True           False
        result[b]          F F F F        T T F F

    Pass the result to the loss functions, `loss_normaliser` and `aggregate_loss` (masked responses leave the
    token and sequence counts; the constant B * L stays). For every estimator. response_mask: (B, T) bool;
    truncated: (B,) bool. Returns (B, T) bool.
    """
    return response_mask & ~truncated.unsqueeze(-1)  # (B, T)


def tied_groups(*, scores: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """True for each prompt whose k responses all have the same score (DAPO, Yu et al. 2025, sec. 3.2,
    "dynamic sampling"): with a group baseline every advantage of such a group is 0, so it carries no
    signal. Exact equality: verifier scores (0 / 1) tie, a reward model's continuous scores rarely do.

        scores    1 1 1 1 | 0 1 0 0         k = 4
        result    True      False

    For the group-baseline estimators (grpo, dr_grpo, rloo); pass the verifier's verdicts where the task has
    one, else the scores before any shaping (a length penalty or a KL in the reward would untie groups whose
    answers are equally right: `RolloutCollector.collect_untied`). scores: (B,), groups in consecutive rows
    (`scores_by_prompt`). Returns (P,) bool.
    """
    grouped = scores_by_prompt(scores=scores, samples_per_prompt=samples_per_prompt)  # (P, k)
    return (grouped == grouped[:, :1]).all(dim=1)  # (P,)


def select_groups(*, tied: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Which of P sampled groups a dynamic-sampling step trains on: the first `num_groups` untied groups; when
    fewer are untied (the cap on sampling rounds was hit), filled up with the first tied ones, so every step
    (and every process) trains on the same number of groups. In rollout order:

        tied      F T F T T F     num_groups 2 -> [0, 2];   num_groups 4 -> [0, 1, 2, 5]

    The loop it replaces: `kept = [p for p in range(P) if not tied[p]][:n]`,
    `kept += [p for p in range(P) if tied[p]][: n - len(kept)]`, sorted.
    tied: (P,) bool (`tied_groups` over every round's groups, concatenated). Returns (num_groups,) long, the
    group indices, ascending. Raises ValueError when P < num_groups.
    """
    P = tied.shape[0]
    if P < num_groups:
        raise ValueError(f"select_groups needs at least num_groups = {num_groups} groups, got {P}")
    order = torch.argsort(tied.to(torch.int8), stable=True)  # (P,) untied first, each kind in rollout order
    return order[:num_groups].sort().values  # (num_groups,)


def group_rows(*, groups: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """The rows of the given groups: group p holds rows p * k .. p * k + k - 1 (`scores_by_prompt`).

        groups [0, 2], k = 2  ->  rows [0, 1, 4, 5]

    groups: (G,) long. Returns (G * k,) long."""
    k = samples_per_prompt
    return (groups.unsqueeze(-1) * k + torch.arange(k, device=groups.device)).reshape(-1)  # (G * k,)
