"""The advantage estimators, one row each: everything PPO needs to know about `advantage_estimator`.

A row says whether the estimator trains a value function, how many samples of a prompt it needs, where its
KL goes by default, whether it samples a greedy baseline, what its advantages are divided by, which config
keys it does not read, whether its advantage is one number per response, what the policy-loss family
(`llm_rlhf.rl.policy_losses`) may combine it with, and its advantage function. The config
(`llm_rlhf.ppo.config`), the trainer (`llm_rlhf.ppo.trainer`), the command (`llm_rlhf.stages.ppo`) and the
report read the row and never the name. The math is pure functions: the
group baselines of grpo, dr_grpo, rloo, remax and pass_at_k below, GAE and REINFORCE++'s returns in `ppo_math` with
PPO's other equations; the adapters here only hand them a rollout's tensors:

    estimator     critic  k >= 1  KL in   greedy  divided by       (papers: each row's description)
    gae           yes     1       reward  no      batch std        GAE over the values, whitened
    grpo          no      2       loss    no      group std        score - group mean, / group std
    dr_grpo       no      2       loss    no      -                score - group mean
    rloo          no      2       reward  no      -                score - mean of the group's others
    reinforce_pp  no      1       reward  no      batch std        gamma = 1 returns, whitened
    remax         no      1       reward  yes     -                score - greedy response's score
    pass_at_k     no      2       loss    no      group std        grpo over each response's pass@k weight

Adding an estimator: its pure function below with its tests, one `Estimator` row with an adapter in the
style of `_gae`, and its row in the tests of tests/rl/test_estimators.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm_rlhf.rl import ppo_math
from llm_rlhf.rl.loss_math import SAMPLER_CORRECTIONS


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator's advantage function may read of a rollout, this process's part of it.

    rewards: (B, R) the per-token rewards (`ppo_math.shaped_rewards`: the score at the last response token,
    -kl_coef * KL_t per token when the KL is in the reward). response_mask: (B, R) bool. values: (B, R) the
    old values, None without a value function. baseline: (P,) the greedy responses' sequence rewards of a
    greedy-baseline estimator, else None. samples_per_prompt: k, each prompt's group in k consecutive rows
    (B = P * k). reduce_sum: sums a tensor over every process (None with one), for statistics of the global
    batch."""

    rewards: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None
    baseline: torch.Tensor | None
    samples_per_prompt: int
    gamma: float
    lam: float
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None
    pass_k: int = 1


# (advantages (B, R), returns the value loss fits (B, R) or None without a value function)
Advantages = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator.

    name: the value of `advantage_estimator`. description: one line for --help and the report.
    critic: trains a value function (the policy's value head, or a critic with value_model 'reward'); the
    others build none. min_samples_per_prompt: the smallest group k it accepts (2: its baseline is the
    group's other samples). kl_in_loss: where the KL goes when `kl_in_loss` is null: True = kl_coef * k3 per
    token in the loss, False = -kl_coef * KL_t in the per-token rewards. greedy_baseline: one greedy
    response per prompt is sampled and scored as the baseline (`AdvantageInputs.baseline`). std_scaling:
    what the advantages are divided by: 'batch' (whitened over the global batch), 'group' (the group's std)
    or 'none'. ignored_keys: config keys it does not read; set to another value than their default they are
    a ConfigError. response_advantages: its advantage is one number per response, the same on each token (a
    baseline of the sequence reward), which a policy loss with a sequence-level ratio needs
    (`PolicyLoss.response_advantages`, `llm_rlhf.rl.policy_losses`: gspo). corrections, dynamic_sampling: what
    else the policy-loss family may combine it with: the sampler corrections ('tis', 'mis') apply
    to every estimator, and dropping the groups whose scores tie needs a group baseline. advantages: the
    advantage function."""

    name: str
    description: str
    critic: bool
    min_samples_per_prompt: int
    kl_in_loss: bool
    greedy_baseline: bool
    std_scaling: str
    ignored_keys: tuple[str, ...]
    response_advantages: bool
    corrections: tuple[str, ...]
    dynamic_sampling: bool
    advantages: Callable[[AdvantageInputs], Advantages]


# The keys of the value function and of GAE: read by an estimator with a critic only.
CRITIC_KEYS = ("lam", "vf_coef", "cliprange_value", "whiten_rewards", "value_model")
# The k of pass@k: read by pass_at_k only.
PASS_K_KEYS = ("pass_k",)
# Every critic-free estimator's sequence reward or return is the undiscounted sum of the rewards.
CRITIC_FREE_IGNORED = ("gamma", *CRITIC_KEYS, *PASS_K_KEYS)

# ---------------------------------------------------------------------------------------------
# The baselines of the critic-free estimators: one advantage per sequence from the scores of its group
# (GRPO, Dr. GRPO, RLOO, ReMax); the rollout's groups are `ppo_math.scores_by_prompt`'s rows
# ---------------------------------------------------------------------------------------------


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

    Worked example (tests/rl/test_ppo_math.py), k = 4, r = (1, 0, 0, 3): GRPO (0, -0.7071, -0.7071, 1.4142),
    Dr. GRPO (0, -1, -1, 2).
    scores: (B,), B = P * k, groups in consecutive rows (`ppo_math.scores_by_prompt`). Returns (B,); spread it
    over the response with `ppo_math.token_advantages`. Raises ValueError for samples_per_prompt < 2.
    """
    _require_a_group("grpo_advantages", samples_per_prompt)
    grouped = ppo_math.scores_by_prompt(scores=scores, samples_per_prompt=samples_per_prompt)  # (P, k)
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

    Worked example (tests/rl/test_ppo_math.py), k = 4, r = (1, 0, 0, 3): A = (0, -1.3333, -1.3333, 2.6667).
    scores: (B,), B = P * k, groups in consecutive rows (`ppo_math.scores_by_prompt`). Returns (B,).
    Raises ValueError for samples_per_prompt < 2.
    """
    _require_a_group("rloo_advantages", samples_per_prompt)
    grouped = ppo_math.scores_by_prompt(scores=scores, samples_per_prompt=samples_per_prompt)  # (P, k)
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
    P = B. scores: (B,), B = P * k, groups in consecutive rows (`ppo_math.scores_by_prompt`);
    baseline_scores: (P,). Returns (B,).
    """
    grouped = ppo_math.scores_by_prompt(scores=scores, samples_per_prompt=samples_per_prompt)  # (P, k)
    if baseline_scores.shape != grouped.shape[:1]:
        raise ValueError(
            f"baseline_scores must hold one greedy score per prompt, shape ({grouped.shape[0]},); "
            f"got shape {tuple(baseline_scores.shape)}"
        )
    return (grouped - baseline_scores.unsqueeze(1)).reshape(-1)  # (B,)


def _require_k_below_n(name: str, k: int, samples_per_prompt: int) -> None:
    _require_a_group(name, samples_per_prompt)
    if not 1 <= k < samples_per_prompt:
        raise ValueError(
            f"{name} needs 1 <= k < samples_per_prompt; got k = {k}, samples_per_prompt = "
            f"{samples_per_prompt} (at k = n the group's mean weight is every sample's weight)"
        )


def pass_at_k_weights(*, n: int, k: int) -> torch.Tensor:
    """W (n, n), float64: the weight of each sorted score in each sample's share of the pass@k gradient,

        W[i, i] = C(i, k - 1) / C(n, k)          W[i, j] = C(j - 1, k - 2) / C(n, k) for j > i, else 0

    with 0-based ranks in ascending order of the scores (C(a, b) = 0 for b < 0 or b > a). Row i is sample
    i's rank counted in the C(n, k) subsets of k samples: of the C(n - 1, k - 1) subsets holding it, C(i, k -
    1) have it as their maximum and C(j - 1, k - 2) have the sample of rank j > i as theirs. Raises
    ValueError unless 1 <= k <= n."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n; got k = {k}, n = {n}")

    def comb(a: int, b: int) -> int:
        return math.comb(a, b) if 0 <= b <= a else 0

    subsets = math.comb(n, k)
    weights = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        weights[i, i] = comb(i, k - 1) / subsets
        for j in range(i + 1, n):
            weights[i, j] = comb(j - 1, k - 2) / subsets
    return weights


def pass_at_k_advantages(*, scores: torch.Tensor, samples_per_prompt: int, k: int) -> torch.Tensor:
    """Pass@k advantage of each sequence (Walder & Karkhanis 2025, "Pass@K Policy Optimization", sec. 3):
    each sample's weight in the unbiased estimator of the gradient of pass@k (for graded scores: of maxg@k,
    the expected best score of k samples), minus its group's mean weight. Of one prompt's n samples with
    scores sorted ascending, r_(0) <= ... <= r_(n-1) (ties in any order: equal scores get equal weights),

        s_(i) = [C(i, k-1) r_(i) + sum_{j > i} C(j-1, k-2) r_(j)] / C(n, k)     (`pass_at_k_weights`)
        A_i   = s_i - mean_j(s_j)

    s_i averages, over the C(n, k) subsets of k samples, the subset's best score wherever sample i is in it,
    so sum_i s_i grad log p(y_i) is an unbiased estimate of grad maxg@k. With verdicts (1 or 0) and c correct:
    s = k/n for a correct sample, (k/n) * (1 - C(n-c-1, k-1) / C(n-1, k-1)) for a wrong one, and the mean of
    s is (k/n) * pass@k, pass@k = 1 - C(n-c, k) / C(n, k) (Chen et al. 2021): a wrong answer is pushed down
    the less, the more right answers its group holds.

    The group mean as the baseline holds the sample itself, but here it costs no bias, only scale: A equals
    (n - k)/n times the leave-two-out advantage, (1/(n-1)) sum_{j != i} (k/n) E_T[max(r_i, T) - max(r_j, T)]
    over the subsets T of k - 1 of the other n - 2 samples, whose baseline does not depend on sample i
    (unbiased) and whose advantages sum to 0 (tests/rl/test_group_advantages.py checks both, and the expected
    gradient by enumeration). Hence k < n: at k = n the factor is 0. For k = 1, A = (r - mean(r)) / n, Dr.
    GRPO's advantage over n. With verdicts, A is k/n times the analytic advantage of Chen et al. 2025
    ("Pass@k Training for Adaptively Balancing Exploration and Exploitation") before its division by the std.

    Worked example (tests/rl/test_group_advantages.py), n = 4, c = 2, k = 2: s = 1/2 (correct), 1/3 (wrong),
    mean 5/12 = (k/n) * pass@2 with pass@2 = 5/6, A = +1/12 and -1/12.
    scores: (B,), B = P * n, groups in consecutive rows (`ppo_math.scores_by_prompt`). Returns (B,) in
    scores' dtype. Raises ValueError unless 1 <= k < samples_per_prompt.
    """
    _require_k_below_n("pass_at_k_advantages", k, samples_per_prompt)
    shares = pass_at_k_shares(scores=scores, samples_per_prompt=samples_per_prompt, k=k)  # (P, n)
    return (shares - shares.mean(dim=1, keepdim=True)).reshape(-1).to(scores.dtype)  # (B,)


def pass_at_k_shares(*, scores: torch.Tensor, samples_per_prompt: int, k: int) -> torch.Tensor:
    """s (P, n), float64: each sample's weight in the pass@k gradient (`pass_at_k_advantages`), its group's
    least score taken off first (each row of `pass_at_k_weights` sums to C(n-1, k-1) / C(n, k) = k/n, so every
    s moves by the same k/n * min and the differences between them do not; a group of equal scores gets s = 0
    exactly), and equal scores given one weight, equal in rounding too."""
    grouped = ppo_math.scores_by_prompt(scores=scores, samples_per_prompt=samples_per_prompt)  # (P, n)
    weights = pass_at_k_weights(n=samples_per_prompt, k=k)  # (n, n) ranks x ranks
    grouped = grouped.double() - grouped.double().amin(dim=1, keepdim=True)  # (P, n)
    ranked, order = grouped.sort(dim=1)  # (P, n) ascending, and each rank's sample
    shares = torch.empty_like(ranked).scatter_(1, order, ranked @ weights.T)  # (P, n) s_i, in sample order
    tied = grouped.unsqueeze(2) == grouped.unsqueeze(1)  # (P, n, n) samples of equal scores
    return (tied * shares.unsqueeze(1)).sum(dim=2) / tied.sum(dim=2)  # (P, n)


# ---------------------------------------------------------------------------------------------
# The rows: each estimator's adapter from a rollout's tensors, then its facts
# ---------------------------------------------------------------------------------------------


def _gae(x: AdvantageInputs) -> Advantages:
    """GAE over the values (`ppo_math.compute_gae`), the advantages whitened over the global batch."""
    advantages, returns = ppo_math.compute_gae(
        rewards=x.rewards, values=x.values, response_mask=x.response_mask, gamma=x.gamma, lam=x.lam
    )  # (B, R) each
    return ppo_math.masked_whiten(advantages, x.response_mask, reduce_sum=x.reduce_sum), returns


def _reinforce_pp(x: AdvantageInputs) -> Advantages:
    """gamma = 1 returns of the per-token rewards, whitened over the global batch; no value function."""
    advantages, _ = ppo_math.reinforce_pp_advantages(
        rewards=x.rewards, response_mask=x.response_mask, reduce_sum=x.reduce_sum
    )  # (B, R)
    return advantages, None


def _sequence_rewards(x: AdvantageInputs) -> torch.Tensor:
    """r = sum_t rewards_t, one per response (B,): the score, minus beta * KL when the KL is in the reward.
    The estimators of one advantage per response (grpo, dr_grpo, rloo, remax) baseline it against the
    response's group or its greedy response."""
    return ppo_math.masked_sum(x.rewards, x.response_mask, dim=-1)  # (B,)


def _on_every_token(x: AdvantageInputs, advantages: torch.Tensor) -> Advantages:
    """One advantage per response (B,) on each of its tokens (B, R); no value function.

    Not whitened: each is already a baselined advantage, used as is by GRPO (Shao et al. 2024, sec. 4.1.2:
    the group-normalised reward is the advantage of every token), Dr. GRPO (Liu et al. 2025, which also drops
    GRPO's std), RLOO (Ahmadian et al. 2024) and ReMax (Li et al. 2023). Whitening over the batch would also
    mix every group's statistics with the others'. The groups are this process's consecutive rows, taken
    over the whole rollout, so neither the number of processes nor the micro-batches change them."""
    return ppo_math.token_advantages(advantages=advantages, response_mask=x.response_mask), None  # (B, R)


def _grpo(x: AdvantageInputs) -> Advantages:
    scores, k = _sequence_rewards(x), x.samples_per_prompt
    return _on_every_token(x, grpo_advantages(scores=scores, samples_per_prompt=k))


def _dr_grpo(x: AdvantageInputs) -> Advantages:
    scores, k = _sequence_rewards(x), x.samples_per_prompt
    return _on_every_token(x, grpo_advantages(scores=scores, samples_per_prompt=k, scale_by_std=False))


def _rloo(x: AdvantageInputs) -> Advantages:
    scores, k = _sequence_rewards(x), x.samples_per_prompt
    return _on_every_token(x, rloo_advantages(scores=scores, samples_per_prompt=k))


def _remax(x: AdvantageInputs) -> Advantages:
    scores, k = _sequence_rewards(x), x.samples_per_prompt
    advantages = remax_advantages(scores=scores, baseline_scores=x.baseline, samples_per_prompt=k)
    return _on_every_token(x, advantages)


def _pass_at_k(x: AdvantageInputs) -> Advantages:
    """The pass@k weights s of each group (`pass_at_k_shares`, the rewards PKPO transforms the scores into)
    through GRPO's group normalisation, (s - mean(s)) / (std(s) + eps): `pass_at_k_advantages` over its group's
    std, so that the advantages are of GRPO's size whatever k and n (unnormalised they are small: +-1/12 for a
    group of 4 with 2 right at k = 2, where Dr. GRPO's are +-1/2, and the KL term of the loss outweighs them)."""
    scores, n = _sequence_rewards(x), x.samples_per_prompt
    _require_k_below_n("pass_at_k", x.pass_k, n)
    shares = pass_at_k_shares(scores=scores, samples_per_prompt=n, k=x.pass_k).reshape(-1)  # (B,)
    advantages = grpo_advantages(scores=shares, samples_per_prompt=n).to(scores.dtype)  # (B,)
    return _on_every_token(x, advantages)


ROWS = (
    Estimator(
        name="gae",
        description="a value head or critic, GAE over its values, advantages whitened",
        critic=True,
        min_samples_per_prompt=1,
        kl_in_loss=False,  # Ziegler et al. 2019
        greedy_baseline=False,
        std_scaling="batch",
        ignored_keys=PASS_K_KEYS,
        response_advantages=False,
        corrections=SAMPLER_CORRECTIONS,
        dynamic_sampling=False,
        advantages=_gae,
    ),
    Estimator(
        name="grpo",
        description="score minus its group's mean, over the group's std; Shao et al. 2024",
        critic=False,
        min_samples_per_prompt=2,
        kl_in_loss=True,  # Shao et al. 2024, eq. 3
        greedy_baseline=False,
        std_scaling="group",
        ignored_keys=CRITIC_FREE_IGNORED,
        response_advantages=True,
        corrections=SAMPLER_CORRECTIONS,
        dynamic_sampling=True,
        advantages=_grpo,
    ),
    Estimator(
        name="dr_grpo",
        description="grpo without the division by the std; Liu et al. 2025",
        critic=False,
        min_samples_per_prompt=2,
        kl_in_loss=True,  # as GRPO
        greedy_baseline=False,
        std_scaling="none",
        ignored_keys=CRITIC_FREE_IGNORED,
        response_advantages=True,
        corrections=SAMPLER_CORRECTIONS,
        dynamic_sampling=True,
        advantages=_dr_grpo,
    ),
    Estimator(
        name="rloo",
        description="score minus the mean of the group's other samples; Ahmadian et al. 2024",
        critic=False,
        min_samples_per_prompt=2,
        kl_in_loss=False,  # Ahmadian et al. 2024 put it in the reward
        greedy_baseline=False,
        std_scaling="none",
        ignored_keys=CRITIC_FREE_IGNORED,
        response_advantages=True,
        corrections=SAMPLER_CORRECTIONS,
        dynamic_sampling=True,
        advantages=_rloo,
    ),
    Estimator(
        name="reinforce_pp",
        description="gamma = 1 returns of the per-token rewards, whitened over the global batch; Hu 2025",
        critic=False,
        min_samples_per_prompt=1,
        kl_in_loss=False,  # Hu 2025: a per-token KL in the reward
        greedy_baseline=False,
        std_scaling="batch",
        ignored_keys=CRITIC_FREE_IGNORED,
        response_advantages=False,  # per-token advantages: no sequence-level ratio
        corrections=SAMPLER_CORRECTIONS,
        dynamic_sampling=False,
        advantages=_reinforce_pp,
    ),
    Estimator(
        name="remax",
        description="score minus the score of a greedy response to the same prompt; Li et al. 2023",
        critic=False,
        min_samples_per_prompt=1,
        kl_in_loss=False,  # Li et al. 2023 put it in the reward
        greedy_baseline=True,
        std_scaling="none",
        ignored_keys=CRITIC_FREE_IGNORED,
        response_advantages=True,
        corrections=SAMPLER_CORRECTIONS,
        dynamic_sampling=False,  # its baseline is the greedy response, not the group
        advantages=_remax,
    ),
    Estimator(
        name="pass_at_k",
        description="grpo's normalisation of each response's weight in the pass@k gradient (k = pass_k); "
        "Walder & Karkhanis 2025",
        critic=False,
        min_samples_per_prompt=2,
        kl_in_loss=True,  # a group baseline as GRPO's, with its KL in the loss
        greedy_baseline=False,
        std_scaling="group",
        ignored_keys=("gamma", *CRITIC_KEYS),
        response_advantages=True,
        corrections=SAMPLER_CORRECTIONS,
        dynamic_sampling=True,
        advantages=_pass_at_k,
    ),
)
ESTIMATORS: dict[str, Estimator] = {row.name: row for row in ROWS}
ADVANTAGE_ESTIMATORS = tuple(ESTIMATORS)  # the accepted values of `advantage_estimator`, in table order
DEFAULT_ESTIMATOR = "gae"  # the config's default, and what a run's config from before the key existed used


def help_text() -> str:
    """The estimators as --help lists them: "'gae' (a value head or critic, ...), 'grpo' (...), ..."."""
    return ", ".join(f"'{row.name}' ({row.description})" for row in ROWS)


def names(rows) -> str:
    """'grpo, dr_grpo and rloo': the names of some rows, for help texts and errors."""
    listed = [row.name for row in rows]
    return listed[0] if len(listed) == 1 else f"{', '.join(listed[:-1])} and {listed[-1]}"
