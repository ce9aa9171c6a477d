"""The RLHF/PPO equations, one small pure function each, to be read against the papers.

Every function takes keyword-only tensors named after the glossary and returns tensors; the caller
turns them into metrics. Shapes: B sequences, T positions, V vocabulary.

    query, response   token ids of the prompt and of the sampled continuation
    logprobs          (B, T) log pi_theta(y_t | s_t) of the sampled tokens (old or current policy)
    ref_logprobs      (B, T) log pi_ref(y_t | s_t) under the frozen reference (the SFT model)
    values            (B, T) V_psi(s_t) from the value head
    scores            (B,)   one reward-model scalar per sequence
    rewards           (B, T) per-token reward after KL shaping
    advantages        (B, T) GAE advantages;  returns (B, T) = advantages + values
                      (critic-free estimators give one advantage per sequence, (B,), until `token_advantages`)
    response_mask     (B, T) bool, True on response tokens that count (not query, not padding)
    kl_coef           beta, weight of the KL penalty
    cliprange         epsilon of the clipped policy objective
    cliprange_value   epsilon_v of the clipped value objective
    vf_coef           c1, weight of the value loss in the total loss (used by the caller)
    gamma, lam        discount and GAE lambda
    samples_per_prompt  k, responses sampled per prompt; a rollout of P prompts holds B = P * k rows, each
                      prompt's k responses in consecutive rows (row = prompt_index * k + sample_index)

Masks are booleans and every masked reduction goes through `masked_sum` / `masked_mean`; values at
masked-out positions never reach a result (outputs hold 0 there).

Only torch is imported, so this module can be reviewed and tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------
# Log-probabilities and entropy from logits
# ---------------------------------------------------------------------------------------------


def logprobs_from_logits(
    *, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each chosen token: log softmax(logits / temperature)[labels].

    The temperature must be the one used for sampling, otherwise the ratio pi_theta / pi_old and the
    KL to the reference are measured for a different distribution than the one that produced the
    tokens (Huang et al. 2023, "The N implementation details of RLHF with PPO": scale the logits by the
    sampling temperature).

    logits: (B, T, V) float; labels: (B, T) long, where position t of `logits` predicts `labels[:, t]`
    (the caller does the shift). Returns (B, T).
    """
    if temperature != 1.0:
        logits = logits / temperature  # (B, T, V); skipped at 1.0 to avoid a copy of the logits
    logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return logp.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)  # (B, T)


def entropy_from_logits(*, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the categorical distribution softmax(z), z = logits / temperature.

        H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v

    Logits of -inf (`mask_eos_logits`) are tokens of probability 0, which add 0 to the sum (p_v z_v is
    0 * -inf = nan, so z_v is read as 0 there; that also keeps nan out of the gradient).

    logits: (B, T, V). Returns (B, T).
    """
    if temperature != 1.0:
        logits = logits / temperature  # (B, T, V)
    probs = torch.softmax(logits, dim=-1)  # (B, T, V)
    finite = torch.where(torch.isneginf(logits), 0, logits)  # (B, T, V): 0 * 0 where p_v = 0
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)  # (B, T)


def mask_eos_logits(*, logits: torch.Tensor, eos_token_id: int, min_new_tokens: int) -> torch.Tensor:
    """The logits sampling uses under `min_new_tokens`: EOS cannot be drawn before response token
    `min_new_tokens` (transformers' MinNewTokensLengthLogitsProcessor, which `rollout.sample` applies):

        z'_{t,v} = -inf   if v == eos_token_id and t < min_new_tokens
        z'_{t,v} = z_{t,v}  otherwise

    The log-probs of the sampled tokens must come from z' in every log-prob computation (policy, old policy,
    reference, evaluation's KL), or the ratio and the KL describe another distribution than the one the
    tokens were drawn from; the same mask on the policy and the reference keeps KL = 0 and ratio = 1 at the
    first step. Only EOS is masked, as transformers does: a pad token distinct from EOS is an ordinary token.

    logits: (B, T, V), position t predicts response token t (the caller does the shift). Returns (B, T, V),
    `logits` itself when min_new_tokens is 0. Differentiable (the masked entries get no gradient).
    """
    if min_new_tokens <= 0:
        return logits
    T, V = logits.shape[-2:]
    early = torch.arange(T, device=logits.device) < min_new_tokens  # (T,) positions t < min_new_tokens
    is_eos = torch.arange(V, device=logits.device) == eos_token_id  # (V,)
    return logits.masked_fill(early[:, None] & is_eos[None, :], -math.inf)  # (B, T, V)


# ---------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum of x over the positions where mask is True (over `dim`, or over everything).

    x: any shape; mask: bool, same shape. Masked-out entries are dropped with `torch.where`, so NaN
    or inf there cannot leak into the sum.
    """
    return torch.where(mask, x, 0).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """mean of x over the positions where mask is True: masked_sum(x) / count(mask).

    An empty selection (a row with no True when `dim` is given) has mean 0, not NaN: count is
    clamped to 1, so an all-padding minibatch contributes a zero loss instead of poisoning the step.
    """
    count = mask.sum(dim=dim).clamp(min=1)
    return masked_sum(x, mask, dim=dim) / count


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the entries of x selected by mask (all of them together), a scalar.

        var = sum_mask (x - mean)^2 / (n - 1)     (n instead of n - 1 if not unbiased)

    Matches `torch.var(x[mask], unbiased=unbiased)`. Raises ValueError for fewer than two selected
    entries (one if not unbiased), where the variance is undefined.
    """
    count = int(mask.sum())
    if count < (2 if unbiased else 1):
        raise ValueError(f"masked_var needs at least {2 if unbiased else 1} selected entries, got {count}")
    centered = x - masked_mean(x, mask)
    return masked_sum(centered**2, mask) / (count - 1 if unbiased else count)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Whiten the selected entries of x to mean 0 and (unbiased) std 1, as done for the advantages.

        n = sum(mask);  mean = sum_mask x / n;  var = sum_mask (x - mean)^2 / (n - 1)
        x' = (x - mean) / sqrt(var + 1e-8)          (+ mean again if not shift_mean)

    Mean and variance are over all selected entries of the batch (lm-human-preferences `whiten`).
    With several processes each holding part of the batch, `reduce_sum` sums a tensor over all of them
    (e.g. `accelerator.reduce(t, "sum")`): the three sums above become global, which is whitening the
    global batch; None = this process's batch is the whole batch. Raises ValueError for n < 2.
    x, mask: (B, T). Returns (B, T) with 0 at masked-out positions.
    """
    total = reduce_sum if reduce_sum is not None else (lambda t: t)
    n = total(mask.sum())  # ()
    if int(n) < 2:
        raise ValueError(f"masked_whiten needs at least 2 selected entries, got {int(n)}")
    mean = total(masked_sum(x, mask)) / n  # ()
    var = total(masked_sum((x - mean) ** 2, mask)) / (n - 1)  # ()
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0)


# ---------------------------------------------------------------------------------------------
# The response mask
# ---------------------------------------------------------------------------------------------


def response_mask_from_tokens(
    *, response: torch.Tensor, eos_token_id: int, stops: torch.Tensor | None = None
) -> torch.Tensor:
    """True up to and including the first end token; everything after it is padding. An end token is an
    EOS, or a token marked in `stops` (the token completing a stop string, `rollout.stop_string_ends`).
    The end token counts: it is a sampled action, and the score lands on it (the last True, see
    `shaped_rewards`).

        position        0     1     2     3     4
        response        r     r    EOS   pad   pad      (pad may be EOS itself, as for GPT-2)
        response_mask   T     T     T     F     F

        response        r    "\n"  r    EOS   pad      stop_strings ["\n"]: stops = F T F F F
        response_mask   T     T     F     F     F

    A row without an end token (truncated at max_new_tokens) is all True. The loop it replaces:
    `[[not any(is_end[b, :t]) for t in range(R)] for b in range(B)]`, is_end = (response == eos) | stops.

    response: (B, R) token ids; stops: (B, R) bool or None (no stop strings) -> (B, R) bool.
    """
    is_end = response == eos_token_id  # (B, R)
    if stops is not None:
        is_end = is_end | stops
    is_end = is_end.int()
    ends_before = is_end.cumsum(-1) - is_end  # (B, R) end tokens strictly before t
    return ends_before == 0


# ---------------------------------------------------------------------------------------------
# KL penalty and reward shaping
# ---------------------------------------------------------------------------------------------


def kl_penalty(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.

    With log p = logprobs, log q = ref_logprobs and r = q / p (Schulman 2020, "Approximating KL
    divergence", http://joschu.net/blog/kl-approx.html):

        "k1"   log p - log q                      unbiased, can be negative per token (SPEC default)
        "k3"   (r - 1) - log r                    unbiased, always >= 0, lower variance
        "abs"  |log p - log q|
        "mse"  1/2 (log p - log q)^2              the "k2" estimator

    logprobs, ref_logprobs: (B, T). Returns (B, T); the caller masks it.
    """
    log_ratio = logprobs - ref_logprobs  # (B, T) log p - log q
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # r - 1 - log r with log r = -log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "mse":
        return 0.5 * log_ratio**2
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of 'k1', 'k3', 'abs', 'mse'")


def sequence_kl(*, kl: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """KL of each whole response: sum_t KL_t over its response tokens. kl, response_mask: (B, T) -> (B,).

    The batch mean of this is the `objective/kl` metric and the KL the adaptive controller tracks.
    """
    return masked_sum(kl, response_mask, dim=-1)


def clip_scores(*, scores: torch.Tensor, score_clip: float) -> torch.Tensor:
    """Clip reward-model scores to [-score_clip, score_clip], a guard against RM outliers. (B,) -> (B,)."""
    return scores.clamp(min=-score_clip, max=score_clip)


def shaped_rewards(
    *,
    scores: torch.Tensor,
    kl: torch.Tensor,
    kl_coef: float | torch.Tensor,
    response_mask: torch.Tensor,
    eos_penalty: float | None = None,
    ended_with_eos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token augmented reward (Ziegler et al. 2019, eq. 2; Stiennon et al. 2020, eq. 2).

        non_score_reward_t = -kl_coef * KL_t                        on response tokens, 0 elsewhere
        rewards_t          = non_score_reward_t + [t == last response token] * score

    Layout of one row (query left-padded, response right-padded); the score lands on the last True
    of response_mask, wherever the padding puts it:

        position        0     1     2     3     4     5     6     7
        token          pad    q     q     q     r     r     r    pad
        response_mask   F     F     F     F     T     T     T     F
        rewards         0     0     0     0   -bKL  -bKL  -bKL+score  0

    The same holds for response-only tensors (T = response length), where the row is `r r r pad`.
    A row whose response_mask is all False gets no score and all-zero rewards.

    EOS trick (Ziegler et al. 2019; Huang et al. 2023, "The N implementation details of RLHF with
    PPO"; `penalty_reward_value` in lm-human-preferences): when `eos_penalty` is given, the score of every sequence that
    did not end with EOS (`ended_with_eos` False) is replaced by the fixed `eos_penalty` (e.g. -1.0),
    so truncated rambling is never rewarded. Clip raw scores first with `clip_scores` if wanted.

    scores: (B,); kl: (B, T) per-token KL (see `kl_penalty`); response_mask: (B, T) bool;
    ended_with_eos: (B,) bool. Returns (rewards, non_score_reward), both (B, T).
    """
    if (eos_penalty is None) != (ended_with_eos is None):
        raise ValueError("eos_penalty and ended_with_eos must be given together")
    if eos_penalty is not None:
        scores = torch.where(ended_with_eos, scores, eos_penalty)  # (B,)

    non_score_reward = torch.where(response_mask, -kl_coef * kl, 0)  # (B, T)
    T = response_mask.shape[-1]
    last = T - 1 - response_mask.int().flip(-1).argmax(dim=-1)  # (B,) index of the last True
    positions = torch.arange(T, device=response_mask.device)  # (T,)
    is_last = (positions == last.unsqueeze(-1)) & response_mask.any(dim=-1, keepdim=True)  # (B, T)
    rewards = non_score_reward + torch.where(is_last, scores.unsqueeze(-1), 0)  # (B, T)
    return rewards, non_score_reward


# ---------------------------------------------------------------------------------------------
# Generalised advantage estimation
# ---------------------------------------------------------------------------------------------


def compute_gae(
    *,
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation", eq. 16), working backwards over each response:

        delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last response token := 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                             (the value-function target, "returns")

    Only positions where response_mask is True take part, as if the others were not there: padding
    after the response cannot leak into the recursion. The vectorised loop below (T steps over all B
    rows at once) equals this naive double loop, which `tests/test_ppo_math.py` checks:

        for b in range(B):
            next_value = next_advantage = 0.0
            for t in reversed([t for t in range(T) if response_mask[b, t]]):
                delta = rewards[b, t] + gamma * next_value - values[b, t]
                next_advantage = advantages[b, t] = delta + gamma * lam * next_advantage
                next_value = values[b, t]
                returns[b, t] = advantages[b, t] + values[b, t]

    To bootstrap a truncated (not terminated) episode, add gamma * V(s_T) to its last reward.

    rewards, values: (B, T) float; response_mask: (B, T) bool.
    Returns (advantages, returns), both (B, T), 0 at masked-out positions.
    """
    B, T = rewards.shape
    next_value = values.new_zeros(B)  # (B,) V_{t+1}, 0 after the last response token
    next_advantage = values.new_zeros(B)  # (B,) A_{t+1}
    advantages_reversed = []
    for t in reversed(range(T)):
        m = response_mask[:, t]  # (B,)
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        advantage = delta + gamma * lam * next_advantage  # (B,)
        advantages_reversed.append(torch.where(m, advantage, 0))
        # A masked-out position is skipped: the carry passes through it unchanged.
        next_value = torch.where(m, values[:, t], next_value)
        next_advantage = torch.where(m, advantage, next_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (B, T)
    returns = torch.where(response_mask, advantages + values, 0)  # (B, T)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# Critic-free estimators
# ---------------------------------------------------------------------------------------------

def scores_by_prompt(*, scores: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """The rollout's scores as one row per prompt: row p holds the k responses of prompt p.

        sequence b = p * k + i   (prompt p, sample i)   ->   grouped[p, i]

        scores    r0 r1 r2 r3 | r4 r5 r6 r7          k = 4, B = 8
        grouped   [[r0, r1, r2, r3],
                   [r4, r5, r6, r7]]

    Every group statistic (mean, std, leave-one-out mean) is taken along dim 1, so a group is exactly the
    k consecutive rows its prompt was sampled into; the caller gives each process whole groups, which makes
    the statistics independent of the number of processes. scores: (B,) -> (P, k). Raises ValueError when
    k does not divide B.
    """
    if scores.dim() != 1:
        raise ValueError(
            f"scores must be one value per sequence, shape (B,); got shape {tuple(scores.shape)}"
        )
    B, k = scores.shape[0], samples_per_prompt
    if k < 1 or B % k != 0:
        raise ValueError(
            f"samples_per_prompt = {k} does not divide the batch of {B} sequences into whole groups"
        )
    return scores.reshape(B // k, k)  # (P, k)


def _require_a_group(name: str, samples_per_prompt: int) -> None:
    if samples_per_prompt < 2:
        raise ValueError(
            f"{name} needs samples_per_prompt >= 2 (got {samples_per_prompt}): "
            "a group of one response has no baseline"
        )


def grpo_advantages(
    *, scores: torch.Tensor, samples_per_prompt: int, scale_by_std: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantage of each sequence (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2, the
    outcome-supervision form), scores r_1..r_k of one prompt's group:

        A_i = (r_i - mean(r)) / (std(r) + eps)       std with n - 1 (Bessel), eps = 1e-4
        A_i =  r_i - mean(r)                         scale_by_std=False: Dr. GRPO (Liu et al. 2025,
                                                     "Understanding R1-Zero-Like Training")

    Dr. GRPO drops the division because it up-weights the groups whose scores barely differ (too easy or
    too hard prompts). A group of equal scores gets A = 0 either way. The vectorised form equals the loop

        for p in range(P):
            r = scores[p * k : (p + 1) * k]
            mean = sum(r) / k
            std = sqrt(sum((r_j - mean) ** 2 for r_j in r) / (k - 1))
            for i in range(k):
                advantages[p * k + i] = (r[i] - mean) / (std + eps)  if scale_by_std else  r[i] - mean

    SPEC example, k = 4, r = (1, 0, 0, 3): GRPO (0, -0.7071, -0.7071, 1.4142), Dr. GRPO (0, -1, -1, 2).
    scores: (B,), B = P * k, groups in consecutive rows (`scores_by_prompt`). Returns (B,); spread it over
    the response with `token_advantages`. Raises ValueError for samples_per_prompt < 2.
    """
    _require_a_group("grpo_advantages", samples_per_prompt)
    grouped = scores_by_prompt(scores=scores, samples_per_prompt=samples_per_prompt)  # (P, k)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (P, k)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, correction=1, keepdim=True) + eps)  # (P, k)
    return centered.reshape(-1)  # (B,)


def rloo_advantages(*, scores: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantage (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for
    free"; Ahmadian et al. 2024, "Back to Basics"): the baseline of sample i is the mean score of
    the other k - 1 samples of its prompt, which does not depend on sample i, so the gradient stays
    unbiased:

        A_i = r_i - 1/(k - 1) * sum_{j != i} r_j   (= k/(k - 1) * (r_i - mean(r)))

    The loop it replaces:

        for p in range(P):
            r = scores[p * k : (p + 1) * k]
            for i in range(k):
                advantages[p * k + i] = r[i] - sum(r[j] for j in range(k) if j != i) / (k - 1)

    SPEC example, k = 4, r = (1, 0, 0, 3): A = (0, -1.3333, -1.3333, 2.6667).
    scores: (B,), B = P * k, groups in consecutive rows (`scores_by_prompt`). Returns (B,).
    Raises ValueError for samples_per_prompt < 2.
    """
    _require_a_group("rloo_advantages", samples_per_prompt)
    grouped = scores_by_prompt(scores=scores, samples_per_prompt=samples_per_prompt)  # (P, k)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (samples_per_prompt - 1)  # (P, k) leave-one-out
    return (grouped - others).reshape(-1)  # (B,)


def remax_advantages(
    *, scores: torch.Tensor, baseline_scores: torch.Tensor, samples_per_prompt: int
) -> torch.Tensor:
    """ReMax advantage (Li et al. 2023, "ReMax"): the baseline of a sampled response is the
    score of the greedy response to the same prompt, generated and scored only for this:

        A_{p,i} = r(y_{p,i}) - r(greedy_p)

        for p in range(P):
            for i in range(k):
                advantages[p * k + i] = scores[p * k + i] - baseline_scores[p]

    One greedy response per prompt, so one baseline score per prompt; with k = 1 (ReMax as published)
    P = B. scores: (B,), B = P * k, groups in consecutive rows (`scores_by_prompt`); baseline_scores: (P,).
    Returns (B,).
    """
    grouped = scores_by_prompt(scores=scores, samples_per_prompt=samples_per_prompt)  # (P, k)
    if baseline_scores.shape != grouped.shape[:1]:
        raise ValueError(
            f"baseline_scores must hold one greedy score per prompt, shape ({grouped.shape[0]},); "
            f"got shape {tuple(baseline_scores.shape)}"
        )
    return (grouped - baseline_scores.unsqueeze(1)).reshape(-1)  # (B,)


def token_advantages(*, advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Spread one advantage per sequence over its response: every response token of sequence b gets
    A_b (the whole response is one action, rewarded once), every other position 0.

        advantages[b]      A_b
        response_mask[b]   F  F  T    T    T    F          (query | response | pad)
        result[b]          0  0  A_b  A_b  A_b  0

    advantages: (B,); response_mask: (B, T) bool. Returns (B, T).
    """
    return torch.where(response_mask, advantages.unsqueeze(-1), 0)  # (B, T)


def reinforce_pp_advantages(
    *,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++"): the discounted return with gamma = 1 of the per-token
    rewards (KL-shaped, `shaped_rewards`), whitened over the whole batch instead of a critic's baseline:

        G_t = sum_{t' >= t, response} r_t'                  (reverse cumulative sum over the response)
        A_t = (G_t - mean(G)) / std(G)                      mean, unbiased std over all response tokens

    The whitening is `masked_whiten`, with its `reduce_sum` for several processes (then the statistics are
    those of the global batch). The cumulative sum equals the loop

        for b in range(B):
            running = 0.0
            for t in reversed([t for t in range(T) if response_mask[b, t]]):
                running = returns[b, t] = rewards[b, t] + running

    SPEC example, the 3-token response with beta = 0.1: rewards (-0.06, 0.15, 5.00) -> returns
    (5.09, 5.15, 5.00) -> advantages, whitened alone, (0.1325, 0.9272, -1.0596).
    rewards: (B, T) float; response_mask: (B, T) bool. Returns (advantages, returns), both (B, T),
    0 at masked-out positions. Raises ValueError for fewer than 2 response tokens in the batch.
    """
    kept = torch.where(response_mask, rewards, 0)  # (B, T) padding adds nothing to a sum
    returns = kept.flip(-1).cumsum(-1).flip(-1)  # (B, T) G_t = sum_{t' >= t} r_t'
    returns = torch.where(response_mask, returns, 0)  # (B, T)
    advantages = masked_whiten(returns, response_mask, reduce_sum=reduce_sum)  # (B, T)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# PPO losses
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossStats:
    """Detached diagnostics of `policy_loss`.

    ratio:    (B, T) rho_t = exp(logprobs - old_logprobs); a caller-side guard can skip a minibatch
              when it explodes.
    clipped:  (B, T) bool, True where the clipped term is the binding one (gradient 0 there).
    clipfrac: scalar, masked mean of `clipped` (`policy/clipfrac`).
    approxkl: scalar, 1/2 * masked mean of (logprobs - old_logprobs)^2 (`policy/approxkl`, as in
              lm-human-preferences and TRL).
    """

    ratio: torch.Tensor
    clipped: torch.Tensor
    clipfrac: torch.Tensor
    approxkl: torch.Tensor


def policy_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO clipped surrogate loss (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7):

        rho_t = exp(log pi_theta(y_t|s_t) - log pi_old(y_t|s_t))
        L     = -masked_mean( min(rho_t * A_t, clip(rho_t, 1 - eps, 1 + eps) * A_t) )

    written as max of the negated terms. Where the clipped term is the smaller objective the token
    contributes a constant, so its gradient is exactly 0.

    logprobs (with grad), old_logprobs, advantages: (B, T); response_mask: (B, T) bool.
    Returns (loss scalar, PolicyLossStats).
    """
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)  # (B, T)
    loss = masked_mean(torch.maximum(unclipped, clipped), response_mask)
    with torch.no_grad():
        is_clipped = clipped > unclipped  # (B, T)
        stats = PolicyLossStats(
            ratio=ratio.detach(),
            clipped=is_clipped & response_mask,
            clipfrac=masked_mean(is_clipped.to(ratio.dtype), response_mask),
            approxkl=0.5 * masked_mean(log_ratio**2, response_mask),
        )
    return loss, stats


def kl_loss(
    *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """The KL to the reference as a loss term instead of a reward penalty (GRPO, Shao et al. 2024, eq. 4):

        k3_t = exp(log q_t - log p_t) - (log q_t - log p_t) - 1      (`kl_penalty`, estimator "k3")
        L_KL = kl_coef * masked_mean(k3_t)                            over the response tokens

    with p the current policy (gradient through `logprobs`) and q the frozen reference, so
    dk3_t / dlog p_t = 1 - exp(log q_t - log p_t): it pulls log p_t down where the policy is above the
    reference and up where it is below. Added to the policy loss, with the same token-level mean.
    SPEC example, log p = (-0.9, -2.5), log q = (-1.5, -1.0): k3 = (0.14881, 1.98169).
    logprobs (with grad), ref_logprobs: (B, T); response_mask: (B, T) bool. Returns a scalar.
    """
    k3 = kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, estimator="k3")  # (B, T)
    return kl_coef * masked_mean(k3, response_mask)


@dataclass(frozen=True)
class ValueLossStats:
    """Detached diagnostics of `value_loss`.

    clipped:  (B, T) bool, True where the clipped squared error is the larger one.
    clipfrac: scalar, masked mean of `clipped` (`val/clipfrac`).
    """

    clipped: torch.Tensor
    clipfrac: torch.Tensor


def value_loss(
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, ValueLossStats]:
    """Clipped value loss (OpenAI baselines ppo2; Huang et al. 2022, "The 37 implementation details of
    PPO", detail 9; lm-human-preferences `train_policy.py`):

        V_clip = V_old + clip(V - V_old, -eps_v, +eps_v)
        L_V    = 1/2 * masked_mean( max((V - R)^2, (V_clip - R)^2) )

    values (with grad), old_values (from the rollout), returns: (B, T); response_mask: (B, T) bool.
    Returns (loss scalar, ValueLossStats).
    """
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped = (values - returns) ** 2  # (B, T)
    clipped = (values_clipped - returns) ** 2  # (B, T)
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), response_mask)
    with torch.no_grad():
        is_clipped = clipped > unclipped  # (B, T)
        stats = ValueLossStats(
            clipped=is_clipped & response_mask,
            clipfrac=masked_mean(is_clipped.to(values.dtype), response_mask),
        )
    return loss, stats


def explained_variance(
    *,
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] over the masked entries (`val/explained_variance`), a scalar.

    1 is a perfect critic, 0 no better than a constant, negative worse. NaN when Var[R] = 0. Population
    variances, var(x) = sum_mask (x - mean)^2 / n. `reduce_sum` as in `masked_whiten`: with several
    processes the sums are global, which is the explained variance of the global batch.
    values, returns: (B, T); mask: (B, T) bool.
    """
    total = reduce_sum if reduce_sum is not None else (lambda t: t)
    n = total(mask.sum()).clamp(min=1)  # ()

    def var(x):
        mean = total(masked_sum(x, mask)) / n  # ()
        return total(masked_sum((x - mean) ** 2, mask)) / n  # ()

    var_returns, var_residual = var(returns), var(returns - values)
    return torch.where(var_returns == 0, math.nan, 1.0 - var_residual / var_returns)


# ---------------------------------------------------------------------------------------------
# Reward model
# ---------------------------------------------------------------------------------------------


def bradley_terry_loss(
    *,
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Pairwise reward-model loss (Bradley & Terry 1952; Stiennon et al. 2020, eq. 1; Ouyang et al.
    2022, eq. 1), with the optional margin of Touvron et al. 2023 (Llama 2, eq. 2):

        L = -mean( log sigmoid(r(x, y_w) - r(x, y_l) - margin) )

    `logsigmoid` keeps large score gaps finite. chosen_scores, rejected_scores, margin: (B,).
    Returns a scalar.
    """
    diff = chosen_scores - rejected_scores  # (B,)
    if margin is not None:
        diff = diff - margin
    return -torch.nn.functional.logsigmoid(diff).mean()


def ranking_to_pairs(ranked: list) -> list[tuple]:
    """Expand a ranking, best first, into its K(K-1)/2 (chosen, rejected) pairs (Ouyang et al. 2022,
    sec. 3.5). ["B", "A", "D", "C"] -> [(B, A), (B, D), (B, C), (A, D), (A, C), (D, C)].
    Works on items or indices alike.
    """
    return [(ranked[i], ranked[j]) for i in range(len(ranked)) for j in range(i + 1, len(ranked))]


# ---------------------------------------------------------------------------------------------
# Reward-model ensembles
# ---------------------------------------------------------------------------------------------

ENSEMBLE_COMBINES = ("mean", "min", "uncertainty")


def member_disagreement(*, member_scores: torch.Tensor) -> torch.Tensor:
    """How much K reward models disagree on each sequence: the population std across the members,

        std_k(s) = sqrt( (1/K) * sum_k (s_k - mean_k(s))^2 )

    Population (1/K), not sample (1/(K-1)): it describes the K members at hand rather than estimating the
    spread of some larger population of reward models, it is defined for K = 1 (0, so one member is an
    ensemble that never disagrees) and its square is the intra-ensemble variance of Coste et al. (2024).
    member_scores: (K, B) -> (B,).
    """
    return member_scores.std(dim=0, correction=0)  # (B,)


def combine_member_scores(
    *, member_scores: torch.Tensor, combine: str, uncertainty_coef: float = 1.0
) -> torch.Tensor:
    """One score per sequence from the scores of K reward models (Coste et al. 2024, "Reward Model
    Ensembles Help Mitigate Overoptimization", sec. 3), s_k the k-th member's (normalised) score:

        mean          scores = (1/K) * sum_k s_k
        min           scores = min_k s_k                                   worst-case optimisation (WCO)
        uncertainty   scores = mean_k(s) - uncertainty_coef * std_k(s)     uncertainty-weighted (UWO)

    std_k is `member_disagreement` (population std). Coste et al. penalise the variance; the std is in score
    units, so the same lambda means the same thing whatever the scale of the scores. With K = 1 every mode
    returns the member's score exactly (mean of one value, min of one value, std 0).
    Hand example, two members on two sequences, s = [[1, 0], [3, 0]] (K=2, B=2), lambda = 1:
    mean [2, 0], min [1, 0], std [1, 0], uncertainty [1, 0].
    member_scores: (K, B) -> (B,).
    """
    if combine == "mean":
        return member_scores.mean(dim=0)  # (B,)
    if combine == "min":
        return member_scores.min(dim=0).values  # (B,)
    if combine == "uncertainty":
        std = member_disagreement(member_scores=member_scores)  # (B,)
        return member_scores.mean(dim=0) - uncertainty_coef * std  # (B,)
    raise ValueError(f"unknown ensemble combine {combine!r}; expected one of {', '.join(ENSEMBLE_COMBINES)}")


# ---------------------------------------------------------------------------------------------
# KL coefficient controllers
# ---------------------------------------------------------------------------------------------


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", sec. 2.2; lm-human-preferences `train_policy.py`):

        e    = clip(KL_observed / KL_target - 1, -0.2, 0.2)
        beta = beta * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon  # in episodes

    def update(self, current_kl: float, n_steps: int) -> None:
        """current_kl: observed KL per sequence of the last rollout batch; n_steps: its episodes."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """A constant KL coefficient with the interface of `AdaptiveKLController`."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing: beta stays fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


# --- best-of-n and the over-optimisation law ---------------------------------------------------


def best_of_n_kl(n: int) -> float:
    """KL(pi_bon || pi_ref) = log n - (n - 1) / n: best-of-n sampling against the policy it samples from, for a
    reward with no ties (Stiennon et al. 2020, appendix G.3; Gao et al. 2022, sec. 2). With ties it is an
    upper bound (Beirami et al. 2024); `best_of_n_empirical_kl` measures it on samples."""
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    return math.log(n) - (n - 1) / n


def best_of_n_weights(*, rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Unbiased best-of-n weights from N >= n samples of each prompt (Gao et al. 2022, appendix: every
    n-subset of the N samples is one draw of best-of-n).

    The sample of rank k (1 = lowest reward of its row) is the best of a uniformly random n-subset with
    probability  w_k = C(k - 1, n - 1) / C(N, n);  sum_k w_k f(y_k) is an unbiased estimate of E[f(best of n)].
    Samples with tied rewards share their weights equally (which of them best-of-n keeps is arbitrary).
    rewards: (B, N). Returns (B, N) weights, each row summing to 1, in the samples' own order.
    """
    B, N = rewards.shape
    if not 1 <= n <= N:
        raise ValueError(f"best-of-{n} needs 1 <= n <= N = {N} samples per prompt")
    k = torch.arange(1, N + 1, dtype=torch.float64)  # ranks
    log_w = (  # log C(k - 1, n - 1) - log C(N, n), -inf where k < n
        torch.lgamma(k) - math.lgamma(n) - torch.lgamma(k - n + 1).where(k >= n, torch.tensor(math.inf))
    ) - (math.lgamma(N + 1) - math.lgamma(n + 1) - math.lgamma(N - n + 1))
    by_rank = log_w.exp()  # (N,)
    order = rewards.double().argsort(dim=1, stable=True)  # (B, N) sample index of each rank
    weights = torch.zeros(B, N, dtype=torch.float64).scatter(1, order, by_rank.expand(B, N))  # (B, N)
    same = rewards.unsqueeze(2) == rewards.unsqueeze(1)  # (B, N, N) tied pairs, the diagonal included
    return (same.double() @ weights.unsqueeze(2)).squeeze(2) / same.sum(2)  # tie-group means: (B, N)


def best_of_n_empirical_kl(*, rewards: torch.Tensor, n: int) -> torch.Tensor:
    """KL(bon || ref) measured on samples: best-of-n drawn (with replacement) from the empirical
    distribution of each row's N samples, exact for that distribution. Per distinct reward value v:

        p_v = F(v) - F(v-)    (the share of samples scoring v),    q_v = F(v)^n - F(v-)^n,
        KL  = sum_v q_v log(q_v / p_v).

    With N distinct rewards it is within 0.05 nats of `best_of_n_kl` up to n = N = 64; samples that tie
    (identical responses, e.g. an immediate EOS) make it smaller. rewards: (B, N). Returns (B,).
    """
    B, N = rewards.shape
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    r = rewards.double()
    below_or_equal = (r.unsqueeze(1) <= r.unsqueeze(2)).double().mean(2)  # (B, N) F(v) at each sample's v
    below = (r.unsqueeze(1) < r.unsqueeze(2)).double().mean(2)  # (B, N) F(v-)
    p = below_or_equal - below  # (B, N) p_v, repeated once per sample of value v
    q = below_or_equal.pow(n) - below.pow(n)  # (B, N) q_v
    # Each value v appears N * p_v times in the row, so weight each sample's term by 1 / (N * p_v).
    terms = torch.where(q > 0, q * (q / p).log(), torch.zeros_like(q)) / (N * p)  # (B, N)
    return terms.sum(1)  # (B,)


def gao_bon_law(d: torch.Tensor, *, alpha: float, beta: float) -> torch.Tensor:
    """Gold reward of best-of-n against d = sqrt(KL): R(d) = d (alpha - beta d) (Gao et al. 2022, eq. 1)."""
    return d * (alpha - beta * d)


def gao_rl_law(d: torch.Tensor, *, alpha: float, beta: float) -> torch.Tensor:
    """Gold reward of RL against d = sqrt(KL): R(d) = d (alpha - beta log d) (Gao et al. 2022, eq. 2)."""
    return d * (alpha - beta * torch.log(d))


@dataclass
class LawFit:
    """A least-squares fit of one of Gao et al.'s forms: coefficients, their standard errors, the RMS
    residual and the number of points."""

    alpha: float
    beta: float
    alpha_stderr: float
    beta_stderr: float
    rmse: float
    num_points: int


def fit_gao_law(*, d: torch.Tensor, gain: torch.Tensor, form: str) -> LawFit:
    """Fit alpha, beta of `gao_bon_law` (form "bon") or `gao_rl_law` (form "rl") to points (d_i, gain_i),
    where d = sqrt(KL to the initial policy) and gain = gold score - the initial policy's gold score
    (both laws pass through R(0) = 0). Both forms are linear in (alpha, beta):

        gain = alpha * d - beta * g(d),    g(d) = d^2 (bon)  or  d log d (rl),

    so ordinary least squares on the design [d, -g(d)] gives them; stderr = sqrt(diag(s^2 (X^T X)^-1)) with
    s^2 = RSS / (m - 2). d, gain: (m,), d > 0, m >= 3 points.
    """
    if form not in ("bon", "rl"):
        raise ValueError(f"form must be 'bon' or 'rl' (got {form!r})")
    d, gain = d.double(), gain.double()
    if d.shape != gain.shape or d.dim() != 1 or d.numel() < 3 or bool((d <= 0).any()):
        raise ValueError("need at least 3 points with d > 0, as two 1-d tensors of one length")
    g = d * d if form == "bon" else d * torch.log(d)  # (m,)
    X = torch.stack([d, -g], dim=1)  # (m, 2)
    xtx_inv = torch.linalg.inv(X.T @ X)  # (2, 2)
    coef = xtx_inv @ X.T @ gain  # (2,) alpha, beta
    residual = gain - X @ coef  # (m,)
    m = d.numel()
    s2 = float(residual.pow(2).sum()) / (m - 2)
    stderr = (s2 * torch.diagonal(xtx_inv)).sqrt()  # (2,)
    return LawFit(
        alpha=float(coef[0]),
        beta=float(coef[1]),
        alpha_stderr=float(stderr[0]),
        beta_stderr=float(stderr[1]),
        rmse=float(residual.pow(2).mean().sqrt()),
        num_points=m,
    )
