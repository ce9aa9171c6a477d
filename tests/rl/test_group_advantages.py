"""The group-relative advantages of the critic-free estimators (`llm_rlhf.rl.estimators`: GRPO, Dr. GRPO,
RLOO, ReMax, pass@k) against their worked example and the naive loops of their docstrings: a prompt's samples
are consecutive rows, a constant added to a group changes nothing, Dr. GRPO keeps the scale GRPO divides out,
pass@k's advantage is an unbiased gradient of pass@k up to its stated scale, and the layout errors. (The estimators through the PPO stage: tests/rl/test_estimators.py.)"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from helpers import F64, FOUR_DECIMALS, TIGHT, t64

from llm_rlhf.rl.estimators import (
    ESTIMATORS,
    AdvantageInputs,
    grpo_advantages,
    pass_at_k_advantages,
    remax_advantages,
    rloo_advantages,
)
from llm_rlhf.rl.loss_math import (
    group_rows,
    select_groups,
    tied_groups,
)
from llm_rlhf.rl.ppo_math import scores_by_prompt

EXAMPLE_GROUP = [
    1.0,
    0.0,
    0.0,
    3.0,
]  # the worked example of the critic-free estimators: one prompt's k = 4 scores


GROUP_ESTIMATORS = {  # name -> advantages(scores, k), the group-relative ones
    "grpo": lambda scores, k: grpo_advantages(scores=scores, samples_per_prompt=k),
    "dr_grpo": lambda scores, k: grpo_advantages(scores=scores, samples_per_prompt=k, scale_by_std=False),
    "rloo": lambda scores, k: rloo_advantages(scores=scores, samples_per_prompt=k),
    "pass_at_k": lambda scores, k: pass_at_k_advantages(scores=scores, samples_per_prompt=k, k=k // 2),
}  # pass_at_k with pass_k = n // 2 in these tests


def naive_group_advantages(scores: list[float], k: int, estimator: str, eps: float = 1e-4) -> torch.Tensor:
    """The loops of the `grpo_advantages` and `rloo_advantages` docstrings, and pass@k's weights as the
    average over every subset (pass_k = k // 2), in plain python floats."""
    advantages = [0.0] * len(scores)
    for p in range(len(scores) // k):
        r = scores[p * k : (p + 1) * k]
        mean = sum(r) / k
        std = math.sqrt(sum((r_j - mean) ** 2 for r_j in r) / (k - 1))
        for i in range(k):
            if estimator == "grpo":
                advantages[p * k + i] = (r[i] - mean) / (std + eps)
            elif estimator == "dr_grpo":
                advantages[p * k + i] = r[i] - mean
            elif estimator == "pass_at_k":  # each subset of k // 2 samples' best, wherever sample i is in it
                subsets = list(itertools.combinations(range(k), k // 2))
                share = [
                    sum(max(r[j] for j in s) for s in subsets if m in s) / len(subsets) for m in range(k)
                ]
                advantages[p * k + i] = share[i] - sum(share) / k
            else:
                advantages[p * k + i] = r[i] - sum(r[j] for j in range(k) if j != i) / (k - 1)
    return t64(advantages)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        pytest.param("dr_grpo", [0.0, -1.0, -1.0, 2.0], id="dr_grpo"),
        pytest.param("rloo", [0.0, -1.3333, -1.3333, 2.6667], id="rloo"),
    ],
)
def test_worked_example_group_advantages(estimator, expected):
    advantages = GROUP_ESTIMATORS[estimator](t64(EXAMPLE_GROUP), 4)
    torch.testing.assert_close(advantages, t64(expected), **FOUR_DECIMALS)


def test_worked_example_grpo():
    """The worked example's GRPO values are (r - mean) / std, std = sqrt(2) with n - 1; with the formula's eps = 1e-4 in
    the denominator the last one rounds to 1.4141 instead of 1.4142, so the 4-decimal check is at eps = 0
    and the default eps is checked against the closed form."""
    scores = t64(EXAMPLE_GROUP)
    eps_free = grpo_advantages(scores=scores, samples_per_prompt=4, eps=0.0)
    torch.testing.assert_close(eps_free, t64([0.0, -0.7071, -0.7071, 1.4142]), **FOUR_DECIMALS)

    advantages = grpo_advantages(scores=scores, samples_per_prompt=4)  # eps = 1e-4
    torch.testing.assert_close(advantages, t64([0.0, -1.0, -1.0, 2.0]) / (math.sqrt(2.0) + 1e-4), **TIGHT)


@pytest.mark.parametrize("estimator", sorted(GROUP_ESTIMATORS))
@pytest.mark.parametrize(("num_prompts", "k"), [(1, 2), (5, 3), (7, 4), (3, 8)])
def test_group_advantages_match_naive_loops(estimator, num_prompts, k):
    generator = torch.Generator().manual_seed(num_prompts * 10 + k)
    scores = torch.randn(num_prompts * k, generator=generator, dtype=F64) * 3 + 1
    scores[:k] = 0.5  # one group where every response scored the same: all advantages 0, not NaN
    advantages = GROUP_ESTIMATORS[estimator](scores, k)
    expected = naive_group_advantages(scores.tolist(), k, estimator)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    assert not advantages[:k].any()


def test_group_advantages_in_float32():
    scores = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.5])
    for name, estimator in GROUP_ESTIMATORS.items():
        advantages = estimator(scores, 3)
        assert advantages.dtype == torch.float32 and advantages.shape == (6,), name
        torch.testing.assert_close(
            advantages, naive_group_advantages(scores.tolist(), 3, name).float(), msg=name
        )


@pytest.mark.parametrize("estimator", sorted(GROUP_ESTIMATORS))
def test_groups_are_consecutive_rows(estimator):
    """A permutation inside each group permutes the advantages; moving rows between groups changes them,
    so advantages taken over the wrong responses are caught."""
    generator = torch.Generator().manual_seed(0)
    k, num_prompts = 4, 3
    scores = torch.randn(num_prompts * k, generator=generator, dtype=F64)
    advantages = GROUP_ESTIMATORS[estimator](scores, k)

    within = torch.cat([p * k + torch.randperm(k, generator=generator) for p in range(num_prompts)])
    torch.testing.assert_close(GROUP_ESTIMATORS[estimator](scores[within], k), advantages[within], **TIGHT)

    # Rows read column-wise (sample 0 of every prompt, then sample 1, ...): every new group mixes prompts.
    across = torch.arange(num_prompts * k).view(num_prompts, k).T.reshape(-1)  # (B,)
    regrouped = GROUP_ESTIMATORS[estimator](scores[across], k)
    assert not torch.allclose(regrouped, advantages[across])

    # The same scores read as 4 prompts of 3 samples are other groups, with other advantages.
    assert not torch.allclose(GROUP_ESTIMATORS[estimator](scores, 3), advantages)


@pytest.mark.parametrize("estimator", sorted(GROUP_ESTIMATORS))
def test_group_advantages_ignore_a_constant_added_to_a_group(estimator):
    generator = torch.Generator().manual_seed(1)
    k, num_prompts = 4, 5
    scores = torch.randn(num_prompts * k, generator=generator, dtype=F64)
    shift = (torch.randn(num_prompts, generator=generator, dtype=F64) * 10).repeat_interleave(
        k
    )  # one per group
    torch.testing.assert_close(
        GROUP_ESTIMATORS[estimator](scores + shift, k),
        GROUP_ESTIMATORS[estimator](scores, k),
        rtol=0,
        atol=1e-12,
    )


def test_dr_grpo_keeps_the_scale_that_grpo_divides_out():
    """Scaling a group's scores by c scales Dr. GRPO's advantages by c; GRPO's are (r - mean) / (std + eps),
    so they stay put up to eps, and are Dr. GRPO's divided by each group's std + eps."""
    generator = torch.Generator().manual_seed(2)
    k, num_prompts = 4, 3
    scores = torch.randn(num_prompts * k, generator=generator, dtype=F64)
    dr_grpo = grpo_advantages(scores=scores, samples_per_prompt=k, scale_by_std=False)
    grpo = grpo_advantages(scores=scores, samples_per_prompt=k)

    torch.testing.assert_close(
        grpo_advantages(scores=7.0 * scores, samples_per_prompt=k, scale_by_std=False), 7.0 * dr_grpo, **TIGHT
    )
    torch.testing.assert_close(
        grpo_advantages(scores=7.0 * scores, samples_per_prompt=k), grpo, rtol=1e-3, atol=0
    )
    torch.testing.assert_close(
        grpo_advantages(scores=7.0 * scores, samples_per_prompt=k, eps=0.0),
        grpo_advantages(scores=scores, samples_per_prompt=k, eps=0.0),
        rtol=0,
        atol=1e-12,
    )
    std = scores.view(num_prompts, k).std(dim=1).repeat_interleave(k)  # (B,) each row's group std, n - 1
    torch.testing.assert_close(grpo, dr_grpo / (std + 1e-4), **TIGHT)


def test_rloo_is_grpo_centering_scaled_by_k_over_k_minus_one():
    generator = torch.Generator().manual_seed(3)
    for k in (2, 3, 5):
        scores = torch.randn(4 * k, generator=generator, dtype=F64)
        centered = grpo_advantages(scores=scores, samples_per_prompt=k, scale_by_std=False)
        torch.testing.assert_close(
            rloo_advantages(scores=scores, samples_per_prompt=k), k / (k - 1) * centered, rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("estimator", sorted(GROUP_ESTIMATORS))
@pytest.mark.parametrize("k", [1, 0])
def test_group_estimators_need_two_samples_per_prompt(estimator, k):
    with pytest.raises(ValueError, match=r"samples_per_prompt >= 2 \(got -?\d+\)"):
        GROUP_ESTIMATORS[estimator](t64([1.0, 2.0, 3.0, 4.0]), k)


# --- pass@k ---------------------------------------------------------------------------------------------


def test_worked_example_pass_at_k():
    """n = 4 responses, c = 2 correct, k = 2: the weights k/n = 1/2 (correct) and (k/n)(1 - C(1, 1)/C(3, 1)) =
    1/3 (wrong), their mean 5/12 = (k/n) * pass@2 with pass@2 = 1 - C(2, 2)/C(4, 2) = 5/6; A = +-1/12."""
    advantages = pass_at_k_advantages(scores=t64([1.0, 0.0, 1.0, 0.0]), samples_per_prompt=4, k=2)
    torch.testing.assert_close(advantages, t64([1.0, -1.0, 1.0, -1.0]) / 12, **TIGHT)
    assert 2 / 4 - 5 / 12 == pytest.approx(1 / 12) and 1 / 3 - (2 / 4) * (1 - 1 / 6) == pytest.approx(-1 / 12)


@pytest.mark.parametrize(("n", "k"), [(4, 1), (4, 3), (6, 2), (8, 3), (8, 7)])
def test_pass_at_k_with_verdicts_is_the_closed_form(n, k):
    """With verdicts: s = k/n for a correct sample, (k/n)(1 - C(n-c-1, k-1)/C(n-1, k-1)) for a wrong one; the
    group's mean weight is (k/n) * (1 - C(n-c, k)/C(n, k)) (Chen et al. 2021's pass@k); every c from 0 to n."""
    for c in range(n + 1):
        verdicts = t64([1.0] * c + [0.0] * (n - c))
        right, wrong = (
            k / n,
            k / n * (1 - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)) if c < n else 0,
        )
        shares = t64([right] * c + [wrong] * (n - c))
        pass_at_k = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert shares.mean().item() == pytest.approx(k / n * pass_at_k, abs=1e-12)
        advantages = pass_at_k_advantages(scores=verdicts, samples_per_prompt=n, k=k)
        torch.testing.assert_close(advantages, shares - shares.mean(), **TIGHT)


def leave_two_out(r: list[float], k: int) -> list[float]:
    """(1/(n-1)) sum_{j != i} (k/n) E_T[max(r_i, T) - max(r_j, T)], T over the subsets of k - 1 of the other
    n - 2 samples: a baseline that does not depend on sample i, and advantages that sum to 0."""
    n, out = len(r), []
    for i in range(n):
        total = 0.0
        for j in (j for j in range(n) if j != i):
            rest = [m for m in range(n) if m not in (i, j)]
            subsets = list(itertools.combinations(rest, k - 1))
            gap = sum(max([r[i], *(r[t] for t in s)]) - max([r[j], *(r[t] for t in s)]) for s in subsets)
            total += k / n * gap / len(subsets)
        out.append(total / (n - 1))
    return out


@pytest.mark.parametrize(("n", "k"), [(4, 2), (5, 1), (6, 3), (7, 6)])
def test_pass_at_k_is_the_unbiased_leave_two_out_advantage_times_n_minus_k_over_n(n, k):
    """Graded scores with ties: the advantages are (n - k)/n times the leave-two-out advantages (whose baseline
    leaves sample i out, so the gradient stays unbiased) and, like them, sum to 0 in each group."""
    generator = torch.Generator().manual_seed(n * 10 + k)
    scores = torch.rand(3 * n, generator=generator, dtype=F64).round(decimals=1)  # ties
    advantages = pass_at_k_advantages(scores=scores, samples_per_prompt=n, k=k)
    expected = [a for g in scores.view(3, n).tolist() for a in leave_two_out(g, k)]
    torch.testing.assert_close(advantages, (n - k) / n * t64(expected), **TIGHT)
    torch.testing.assert_close(advantages.view(3, n).sum(dim=1), torch.zeros(3, dtype=F64), **TIGHT)


def test_pass_at_k_expected_gradient_is_the_gradient_of_the_expected_best_of_k():
    """A policy over 3 answers with scores 0, 0.4 and 1, groups of n = 3: E[sum_i A_i grad log p(y_i)] over all
    27 groups equals (n - k)/n * grad E[max of k samples] (maxg@k; pass@k for verdicts), exactly, for k = 1, 2."""
    logits = torch.tensor([0.3, -0.2, 0.1], dtype=F64, requires_grad=True)
    value, n = t64([0.0, 0.4, 1.0]), 3
    for k in (1, 2):
        probs = logits.softmax(0)
        best_of_k = sum(
            math.prod(probs[a] for a in draw) * max(value[a] for a in draw)
            for draw in itertools.product(range(3), repeat=k)
        )
        (expected,) = torch.autograd.grad(best_of_k, logits)
        estimate = torch.zeros(3, dtype=F64)
        for group in itertools.product(range(3), repeat=n):
            weight = math.prod(probs[a].item() for a in group)
            advantages = pass_at_k_advantages(scores=value[list(group)], samples_per_prompt=n, k=k)
            log_p = logits.log_softmax(0)[list(group)]
            (grad,) = torch.autograd.grad((advantages * log_p).sum(), logits)
            estimate += weight * grad
        torch.testing.assert_close(estimate, (n - k) / n * expected, **TIGHT)


def test_the_pass_at_k_row_is_grpo_over_the_pass_at_k_weights():
    """The estimator row: each group's weights s through GRPO's normalisation, (s - mean(s)) / (std(s) + 1e-4) =
    `pass_at_k_advantages` over its group's std; the worked example gives +-(1/12) / sqrt(1/108) = +-sqrt(3)/2
    (up to eps); a group solved at pass@2 (3 of 4 right: every weight k/n) gets 0; k >= n is refused."""
    row = ESTIMATORS["pass_at_k"]
    verdicts = t64([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])  # two prompts x 4
    mask = torch.ones(8, 3, dtype=torch.bool)
    rewards = torch.zeros(8, 3, dtype=F64)
    rewards[:, -1] = verdicts
    x = AdvantageInputs(
        rewards, mask, None, None, samples_per_prompt=4, gamma=1.0, lam=1.0, reduce_sum=None, pass_k=2
    )
    advantages, returns = row.advantages(x)
    assert returns is None and (advantages == advantages[:, :1]).all()
    centred = pass_at_k_advantages(scores=verdicts, samples_per_prompt=4, k=2)
    std = centred.view(2, 4).std(dim=1).repeat_interleave(4)
    torch.testing.assert_close(advantages[:, 0], centred / (std + 1e-4), **TIGHT)
    torch.testing.assert_close(
        advantages[:4, 0], t64([1.0, -1.0, 1.0, -1.0]) * (1 / 12) / (math.sqrt(1 / 108) + 1e-4), **TIGHT
    )
    assert (advantages[4:] == 0).all()
    with pytest.raises(ValueError, match="pass_at_k needs 1 <= k < samples_per_prompt; got k = 4"):
        row.advantages(dataclasses.replace(x, pass_k=4))


def test_pass_at_k_with_k_1_is_dr_grpo_over_n_and_k_must_be_below_n():
    scores = torch.randn(12, generator=torch.Generator().manual_seed(4), dtype=F64)
    torch.testing.assert_close(
        pass_at_k_advantages(scores=scores, samples_per_prompt=4, k=1),
        grpo_advantages(scores=scores, samples_per_prompt=4, scale_by_std=False) / 4,
        **TIGHT,
    )
    for k in (0, 4, 5):
        with pytest.raises(
            ValueError, match=rf"needs 1 <= k < samples_per_prompt; got k = {k}, samples_per_prompt = 4"
        ):
            pass_at_k_advantages(scores=scores, samples_per_prompt=4, k=k)


def test_scores_by_prompt_layout_and_errors():
    scores = t64(range(8))
    torch.testing.assert_close(
        scores_by_prompt(scores=scores, samples_per_prompt=4), t64([[0, 1, 2, 3], [4, 5, 6, 7]]), **TIGHT
    )
    torch.testing.assert_close(
        scores_by_prompt(scores=scores, samples_per_prompt=1), scores.view(8, 1), **TIGHT
    )
    with pytest.raises(ValueError, match="samples_per_prompt = 3 does not divide the batch of 8 sequences"):
        scores_by_prompt(scores=scores, samples_per_prompt=3)
    with pytest.raises(ValueError, match="samples_per_prompt = 0"):
        scores_by_prompt(scores=scores, samples_per_prompt=0)
    with pytest.raises(ValueError, match=r"shape \(B,\); got shape \(2, 4\)"):
        scores_by_prompt(scores=scores.view(2, 4), samples_per_prompt=4)
    with pytest.raises(ValueError, match="samples_per_prompt = 3 does not divide"):
        grpo_advantages(scores=scores, samples_per_prompt=3)


def test_remax_subtracts_the_greedy_score_of_the_same_prompt():
    scores = t64([1.0, 0.0, 0.0, 3.0, 2.0, -1.0])  # 3 prompts x 2 samples
    greedy = t64([0.5, 1.0, -2.0])
    advantages = remax_advantages(scores=scores, baseline_scores=greedy, samples_per_prompt=2)
    torch.testing.assert_close(advantages, t64([0.5, -0.5, -1.0, 2.0, 4.0, 1.0]), **TIGHT)

    generator = torch.Generator().manual_seed(4)
    scores, greedy = (
        torch.randn(12, generator=generator, dtype=F64),
        torch.randn(4, generator=generator, dtype=F64),
    )
    expected = t64([float(scores[p * 3 + i] - greedy[p]) for p in range(4) for i in range(3)])  # the loop
    torch.testing.assert_close(
        remax_advantages(scores=scores, baseline_scores=greedy, samples_per_prompt=3), expected, **TIGHT
    )
    # ReMax as published, one sample per prompt.
    torch.testing.assert_close(
        remax_advantages(scores=scores, baseline_scores=scores.flip(0), samples_per_prompt=1),
        scores - scores.flip(0),
        **TIGHT,
    )


def test_remax_baseline_must_be_one_score_per_prompt():
    with pytest.raises(ValueError, match=r"one greedy score per prompt, shape \(3,\); got shape \(6,\)"):
        remax_advantages(scores=t64(range(6)), baseline_scores=t64(range(6)), samples_per_prompt=2)


# ----------------------------------------------------------------------------------------------
# Dynamic sampling
# ----------------------------------------------------------------------------------------------


def test_tied_groups_finds_groups_whose_scores_all_tie():
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.25])
    assert tied_groups(scores=scores, samples_per_prompt=4).tolist() == [True, False, True, False]
    naive = [len(set(scores[p * 4 : p * 4 + 4].tolist())) == 1 for p in range(4)]
    assert tied_groups(scores=scores, samples_per_prompt=4).tolist() == naive
    with pytest.raises(ValueError, match="does not divide"):
        tied_groups(scores=scores, samples_per_prompt=3)


def naive_select(tied, n):
    kept = [p for p in range(len(tied)) if not tied[p]][:n]
    kept += [p for p in range(len(tied)) if tied[p]][: n - len(kept)]
    return sorted(kept)


@pytest.mark.parametrize("num_groups", [1, 2, 3, 4, 5, 6])
def test_select_groups_takes_untied_groups_first_then_fills_with_tied(num_groups):
    tied = torch.tensor([False, True, False, True, True, False])
    selected = select_groups(tied=tied, num_groups=num_groups)
    assert selected.tolist() == naive_select(tied.tolist(), num_groups)
    assert select_groups(tied=tied, num_groups=2).tolist() == [0, 2]
    assert select_groups(tied=tied, num_groups=4).tolist() == [0, 1, 2, 5]


def test_select_groups_needs_enough_groups_and_group_rows():
    with pytest.raises(ValueError, match="at least num_groups = 3"):
        select_groups(tied=torch.tensor([False, True]), num_groups=3)
    assert group_rows(groups=torch.tensor([0, 2]), samples_per_prompt=2).tolist() == [0, 1, 4, 5]
    scores = torch.tensor([0.0, 1, 1, 1, 1, 0, 2, 2])
    groups = select_groups(tied=tied_groups(scores=scores, samples_per_prompt=2), num_groups=2)
    assert scores[group_rows(groups=groups, samples_per_prompt=2)].tolist() == [0.0, 1, 1, 0]
