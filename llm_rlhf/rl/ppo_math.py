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
# KL penalty and reward shaping
# ---------------------------------------------------------------------------------------------


def kl_penalty(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.

    With log p = logprobs, log q = ref_logprobs and r = q / p (Schulman 2020, "Approximating KL
    divergence", http://joschu.net/blog/kl-approx.html):

        "k1"   log p - log q                      unbiased, can be negative per token (the default)
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


def distill_kl(
    *, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """On-policy distillation's per-token signal: the one-sample estimate of the reverse KL to the teacher at
    each sampled token (Agarwal et al. 2024, GKD; Gu et al. 2024, MiniLLM), 0 outside the response:

        d_t = log pi_theta(y_t|s_t) - log pi_teacher(y_t|s_t),    y_t ~ pi_theta(.|s_t)

    Its expectation over y_t is KL(pi_theta(.|s_t) || pi_teacher(.|s_t)), the full-vocabulary reverse KL that
    TRL's DistillationTrainer differentiates at beta = 1, and the policy gradient of a reward -d_t (d_t held
    fixed) has that KL's gradient as its expectation: E[grad log pi(y) * d(y)] = grad KL, since
    E[grad log pi(y)] = 0. PPO adds -distill_coef * d_t to the per-token rewards, where the KL penalty to the
    reference goes, so each estimator credits it as it credits that penalty.

    logprobs, teacher_logprobs: (B, T) at the sampled tokens; response_mask: (B, T) bool. Returns (B, T).
    Worked example: log pi_theta = log 0.5, log pi_teacher = log 0.25 -> d = log 2 = 0.693.
    """
    return torch.where(response_mask, logprobs - teacher_logprobs, 0.0)  # (B, T)


def topk_divergence(
    *, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float = 0.0
) -> torch.Tensor:
    """On-policy distillation's divergence as a loss term, per token, over the teacher's top-k tokens j at each
    sampled prefix s_t (p_t = pi_teacher(.|s_t), p_s = pi_theta(.|s_t), both at those k ids):

        beta = 0       forward KL      sum_j p_t(j) (log p_t(j) - log p_s(j))
        0 < beta < 1   generalised JSD beta * sum_j p_t(j) (log p_t(j) - log m(j))
                                       + (1 - beta) * sum_j p_s(j) (log p_s(j) - log m(j)),
                                       m = (1 - beta) p_s + beta p_t

    TRL's DistillationTrainer's divergence (its `beta`; the mixture as it writes it), exact when k is the whole
    vocabulary; with k < V the sums leave out the tokens outside the teacher's top k (NeMo-RL's top-k form).
    A token j of probability 0 (an EOS masked before min_new_tokens) adds 0.

    student_logprobs, teacher_logprobs: (B, T, k). Returns (B, T); the caller masks it.
    Worked example, k = 2, beta = 0: p_t = (0.5, 0.5), p_s = (0.25, 0.75) -> 0.5 log 2 + 0.5 log(2/3) = 0.1438.
    """

    def kl_part(logp: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        terms = logp.exp() * (logp - log_q)  # (B, T, k)
        return torch.where(torch.isneginf(logp), 0.0, terms).sum(-1)  # (B, T)

    if beta == 0.0:
        return kl_part(teacher_logprobs, student_logprobs)
    log_m = torch.logaddexp(student_logprobs + math.log(1 - beta), teacher_logprobs + math.log(beta))
    return beta * kl_part(teacher_logprobs, log_m) + (1 - beta) * kl_part(student_logprobs, log_m)


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
    rows at once) equals this naive double loop, which `tests/rl/test_ppo_math.py` checks:

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

    Worked example, the 3-token response with beta = 0.1: rewards (-0.06, 0.15, 5.00) -> returns
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
class TokenLossStats:
    """Detached diagnostics of `ppo_clip_token_losses` and `policy_losses`' `gspo_token_losses`,
    `cispo_token_losses` and `sapo_token_losses`, all (B, T); the flags are False off the response mask; the
    caller reduces them (`masked_mean`) into metrics.

    ratio:         the ratio each token's loss uses: rho_t = pi_theta / pi_old (GSPO: its response's s_i),
                   at every position (reduce it with the mask).
    clipped_high:  True where the upper clip binds (rho > 1 + eps_high with A > 0; CISPO: the weight is
                   truncated at 1 + eps_high, whatever the sign of A).
    clipped_low:   True where the lower clip binds (rho < 1 - eps_low with A < 0; never for CISPO).
    dual_clipped:  True where the dual clip binds (ppo_clip with dual_clip; False otherwise).

    For ppo_clip and gspo the gradient is 0 wherever one of the three is True; CISPO keeps the gradient of
    every token, and SAPO clips none (its flags are all False).
    `policy/clipfrac` = masked_mean(clipped_high | clipped_low).
    """

    ratio: torch.Tensor
    clipped_high: torch.Tensor
    clipped_low: torch.Tensor
    dual_clipped: torch.Tensor

    @property
    def clipped(self) -> torch.Tensor:
        """(B, T) bool: either clip binds."""
        return self.clipped_high | self.clipped_low


def ppo_clip_token_losses(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, TokenLossStats]:
    """Per-token PPO clipped loss with clip-higher (DAPO, Yu et al. 2025, sec. 3.1) and the dual clip
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5):

        rho_t = exp(log pi_theta(y_t) - log pi_old(y_t))
        l_t   = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)
        l_t   = min(l_t, -c * A_t)      where A_t < 0, with dual_clip c > 1 (None = off)

    eps_low = eps_high is PPO's symmetric clip (`policy_loss`). A larger eps_high lets the probability of
    an unlikely token with a positive advantage grow further before its gradient stops (DAPO's remedy for
    entropy collapse). The dual clip bounds the loss of a negative advantage at a ratio above c, where the
    plain loss -rho * A grows without limit. Wherever a clip binds, the token's loss is a constant:
    gradient 0.

    Worked example, eps_low 0.2, eps_high 0.28: rho = (1.3, 0.9), A = 1 -> l = (-1.28, -0.9) (-1.2 on the
    first with a symmetric 0.2); rho = (1.1, 0.7, 1.0, 1.25), A = -0.5 -> l = (0.55, 0.4, 0.5, 0.625),
    the second clipped. Dual clip c = 3, A = -0.5, rho = 4: l = 2.0, dual-clipped 1.5.

    For every advantage estimator (per-token gae and reinforce_pp advantages, or a per-response one spread
    with `token_advantages`).
    logprobs (with grad), old_logprobs, advantages: (B, T); response_mask: (B, T) bool.
    Returns (token losses (B, T), 0 off the mask; TokenLossStats). Raises ValueError for dual_clip <= 1.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip})")
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)  # (B, T)
    losses = torch.maximum(unclipped, clipped)  # (B, T)
    if dual_clip is not None:
        bound = -dual_clip * advantages  # (B, T), positive where A < 0
        losses = torch.where(advantages < 0, torch.minimum(losses, bound), losses)  # (B, T)
    with torch.no_grad():
        is_clipped = (clipped > unclipped) & response_mask  # (B, T)
        dual = (
            (advantages < 0) & (bound < torch.maximum(unclipped, clipped)) & response_mask
            if dual_clip is not None
            else torch.zeros_like(response_mask)
        )  # (B, T)
        stats = TokenLossStats(
            ratio=ratio.detach(),
            clipped_high=is_clipped & (advantages > 0),
            clipped_low=is_clipped & (advantages < 0),
            dual_clipped=dual,
        )
    return torch.where(response_mask, losses, 0), stats


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
    contributes a constant, so its gradient is exactly 0. It is the token-mean `aggregate_loss` of
    `ppo_clip_token_losses` with eps_low = eps_high = cliprange and no dual clip.

    logprobs (with grad), old_logprobs, advantages: (B, T); response_mask: (B, T) bool.
    Returns (loss scalar, PolicyLossStats).
    """
    token_losses, token_stats = ppo_clip_token_losses(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        cliprange_low=cliprange,
        cliprange_high=cliprange,
    )  # (B, T)
    loss = masked_mean(token_losses, response_mask)
    with torch.no_grad():
        ratio = token_stats.ratio  # (B, T)
        stats = PolicyLossStats(
            ratio=ratio,
            clipped=token_stats.clipped,
            clipfrac=masked_mean(token_stats.clipped.to(ratio.dtype), response_mask),
            approxkl=0.5 * masked_mean((logprobs - old_logprobs) ** 2, response_mask),
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
    Worked example, log p = (-0.9, -2.5), log q = (-1.5, -1.0): k3 = (0.14881, 1.98169).

    The same kl_coef is another penalty here than in the reward. k3's value estimates the per-token reverse
    KL(pi_theta || pi_ref), as the reward's k1 does, but its expected gradient over y_t ~ pi_theta is
    sum_y (p(y) - q(y)) grad log p(y) = grad KL(pi_ref || pi_theta) at s_t: the forward KL, whose gradient
    equals the reverse KL's only to first order near pi_ref (tests/rl/test_ppo_math.py), averaged over the
    minibatch's tokens. In the reward, -kl_coef * k1_t enters the returns and the policy gradient follows the
    reverse KL of the whole response (summed over its tokens).
    Not clamped (verl and OpenRLHF clamp k3 to [-10, 10]): k3 >= 0, so only the upper bound could bind
    (log q_t - log p_t > 2.6), and a clamp has zero gradient there: it would switch off the pull on exactly the
    tokens the policy has pushed furthest below the reference, where the forward KL pulls hardest. The size of
    an update is bounded by max_grad_norm, and a non-finite loss stops the step (`NonFiniteError`).
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
