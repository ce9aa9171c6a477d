"""The reward-model math of `llm_rlhf.rl.reward_math` against hand-computed values, enumeration and closed
forms: the Bradley-Terry loss and its gradient, a ranking as pairs, best-of-n's weights and KL, and the fit of
the over-optimisation laws."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import TIGHT, t64

from llm_rlhf.core.data import ranking_to_pairs
from llm_rlhf.rl import reward_math
from llm_rlhf.rl.reward_math import bradley_terry_loss


def test_bradley_terry_loss_against_hand_values():
    loss = bradley_terry_loss(chosen_scores=t64([2.0]), rejected_scores=t64([0.5]))
    torch.testing.assert_close(loss, t64(math.log1p(math.exp(-1.5))), **TIGHT)  # -log sigma(1.5)
    assert abs(loss.item() - 0.20141327798275246) < 1e-12

    with_margin = bradley_terry_loss(
        chosen_scores=t64([2.0, 1.0]), rejected_scores=t64([0.5, 1.0]), margin=t64([1.0, 0.0])
    )
    torch.testing.assert_close(with_margin, t64((math.log1p(math.exp(-0.5)) + math.log(2.0)) / 2), **TIGHT)

    huge_gap = bradley_terry_loss(chosen_scores=t64([-1000.0]), rejected_scores=t64([1000.0]))
    assert huge_gap.item() == 2000.0  # logsigmoid keeps it finite


def test_bradley_terry_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = t64([0.3]).requires_grad_(), t64([0.1]).requires_grad_()
    bradley_terry_loss(chosen_scores=chosen, rejected_scores=rejected).backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()


def test_ranking_to_pairs():
    assert ranking_to_pairs(["B", "A", "D", "C"]) == [
        ("B", "A"),
        ("B", "D"),
        ("B", "C"),
        ("A", "D"),
        ("A", "C"),
        ("D", "C"),
    ]
    assert len(ranking_to_pairs(list(range(7)))) == 7 * 6 // 2
    assert ranking_to_pairs([0]) == []


def test_best_of_n_kl_formula():
    assert reward_math.best_of_n_kl(1) == 0.0
    assert reward_math.best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert reward_math.best_of_n_kl(64) == pytest.approx(math.log(64) - 63 / 64)
    with pytest.raises(ValueError):
        reward_math.best_of_n_kl(0)


def naive_best_of_n_weights(rewards: list[float], n: int) -> list[float]:
    """Every n-subset of the samples equally likely; the best of a subset gets its share, split equally
    between samples that tie for the best."""
    weights = [0.0] * len(rewards)
    subsets = list(itertools.combinations(range(len(rewards)), n))
    for subset in subsets:
        best = max(rewards[i] for i in subset)
        winners = [i for i in subset if rewards[i] == best]
        for i in winners:
            weights[i] += 1 / len(subsets) / len(winners)
    return weights


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_best_of_n_weights_match_enumeration_of_subsets(n):
    rewards = torch.tensor([[0.3, -1.2, 2.0, 0.7, 0.1, -0.4], [1.0, 0.0, 1.0, 2.0, 0.0, 1.0]])  # row 2 ties
    weights = reward_math.best_of_n_weights(rewards=rewards, n=n)
    for row, w in zip(rewards.tolist(), weights):
        assert w.tolist() == pytest.approx(naive_best_of_n_weights(row, n), abs=1e-12)


def test_best_of_n_weights_estimate_the_mean_of_the_best():
    """Uniform(0, 1) rewards: E[max of n] = n / (n + 1)."""
    torch.manual_seed(0)
    rewards = torch.rand(2000, 32)
    for n in (1, 4, 16):
        estimate = (reward_math.best_of_n_weights(rewards=rewards, n=n) * rewards.double()).sum(1).mean()
        assert float(estimate) == pytest.approx(n / (n + 1), abs=0.01)
    with pytest.raises(ValueError):
        reward_math.best_of_n_weights(rewards=rewards, n=33)


def test_best_of_n_empirical_kl():
    # Distinct rewards: the analytic value, up to the finite sample (0.041 nats at n = N = 64).
    rewards = torch.randn(2, 64)
    for n in (1, 2, 8, 16):
        kl = reward_math.best_of_n_empirical_kl(rewards=rewards, n=n)
        assert kl.tolist() == pytest.approx([reward_math.best_of_n_kl(n)] * 2, abs=0.005)
    kl64 = float(reward_math.best_of_n_empirical_kl(rewards=rewards, n=64)[0])
    assert reward_math.best_of_n_kl(64) - 0.05 < kl64 < reward_math.best_of_n_kl(64)
    # Ties by hand: values 0 (p 1/2), 1 (1/4), 2 (1/4); F = 1/2, 3/4, 1; q = F^2 - F(-)^2 = 1/4, 5/16, 7/16.
    kl = reward_math.best_of_n_empirical_kl(rewards=torch.tensor([[0.0, 1.0, 0.0, 2.0]]), n=2)
    expected = 0.25 * math.log(0.5) + 0.3125 * math.log(1.25) + 0.4375 * math.log(1.75)
    assert float(kl[0]) == pytest.approx(expected, abs=1e-12)
    one_response = torch.ones(1, 8)  # every sample the same: best-of-n has no choice
    assert float(reward_math.best_of_n_empirical_kl(rewards=one_response, n=4)[0]) == 0.0


@pytest.mark.parametrize("form, law", [("bon", reward_math.gao_bon_law), ("rl", reward_math.gao_rl_law)])
def test_fit_gao_law_recovers_its_coefficients(form, law):
    d = torch.linspace(0.2, 4.0, 12, dtype=torch.float64)
    fit = reward_math.fit_gao_law(d=d, gain=law(d, alpha=1.3, beta=0.4), form=form)
    assert (fit.alpha, fit.beta) == (pytest.approx(1.3, abs=1e-9), pytest.approx(0.4, abs=1e-9))
    assert fit.rmse < 1e-9 and fit.num_points == 12
    torch.manual_seed(0)
    noisy = reward_math.fit_gao_law(d=d, gain=law(d, alpha=1.3, beta=0.4) + 0.05 * torch.randn(12), form=form)
    assert abs(noisy.alpha - 1.3) < 3 * noisy.alpha_stderr + 1e-3 and noisy.rmse > 0.02
    with pytest.raises(ValueError):
        reward_math.fit_gao_law(d=torch.tensor([0.0, 1.0, 2.0]), gain=torch.zeros(3), form=form)
