"""The PPO math of `llm_rlhf.rl.ppo_math` and `token_math` against hand-worked examples, hand-computed values
and naive reference loops: the KL and the shaped rewards, GAE, the clipped objective, the masked reductions,
the response mask, log-probs, entropy and the KL estimators, the value loss, the KL controllers, REINFORCE++
and the KL in the loss. (The group-relative advantages: test_group_advantages.py; the reward-model math:
test_reward_math.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import F64, FOUR_DECIMALS, TIGHT, t64

from llm_rlhf.rl import ppo_math, token_math
from llm_rlhf.rl.loss_math import spread_about_one
from llm_rlhf.rl.ppo_math import (
    AdaptiveKLController,
    FixedKLController,
    clip_scores,
    compute_gae,
    explained_variance,
    kl_loss,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    reinforce_pp_advantages,
    sequence_kl,
    shaped_rewards,
    token_advantages,
    value_loss,
)
from llm_rlhf.rl.token_math import entropy_from_logits, logprobs_from_logits, response_mask_from_tokens

# The worked example: the 3-token response "very very sleepy", beta = 0.1, RM score 5.0.
LOGPROBS = [-0.9, -2.5, -0.5]
REF_LOGPROBS = [-1.5, -1.0, -0.5]


def naive_gae(rewards, values, mask, gamma, lam):
    """The double loop of the `compute_gae` docstring, in plain python floats."""
    B, T = len(rewards), len(rewards[0])
    advantages = [[0.0] * T for _ in range(B)]
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_value = next_advantage = 0.0
        for t in reversed([t for t in range(T) if mask[b][t]]):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            next_advantage = advantages[b][t] = delta + gamma * lam * next_advantage
            next_value = values[b][t]
            returns[b][t] = advantages[b][t] + values[b][t]
    return t64(advantages), t64(returns)


def padded_mask(lengths: list[tuple[int, int, int]], T: int) -> torch.Tensor:
    """response_mask for rows laid out as (left pad, query, response, right pad); lengths = (pad, q, r)."""
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, (pad, q, r) in enumerate(lengths):
        mask[b, pad + q : pad + q + r] = True
    return mask


def random_layout(generator: torch.Generator, B: int, T: int) -> torch.Tensor:
    lengths = []
    for _ in range(B):
        pad, q = (int(v) for v in torch.randint(0, T // 3, (2,), generator=generator))
        r = int(torch.randint(0, T - pad - q + 1, (1,), generator=generator))
        lengths.append((pad, q, r))
    lengths[0] = (0, 0, T)  # one row fills the whole width
    lengths[1] = (1, 2, 0)  # one row has an empty response
    return padded_mask(lengths, T)


# ----------------------------------------------------------------------------------------------
# The worked example
# ----------------------------------------------------------------------------------------------


def test_worked_example_kl_and_augmented_reward():
    logprobs, ref_logprobs = t64([LOGPROBS]), t64([REF_LOGPROBS])  # (1, 3)
    kl = kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, estimator="k1")
    torch.testing.assert_close(kl, t64([[0.6, -1.5, 0.0]]), **TIGHT)

    rewards, non_score_reward = shaped_rewards(
        scores=t64([5.0]), kl=kl, kl_coef=0.1, response_mask=torch.ones(1, 3, dtype=torch.bool)
    )
    torch.testing.assert_close(rewards, t64([[-0.06, 0.15, 5.00]]), **TIGHT)
    torch.testing.assert_close(non_score_reward, t64([[-0.06, 0.15, 0.0]]), **TIGHT)


def test_worked_example_gae():
    rewards, values = t64([[-0.06, 0.15, 5.00]]), t64([[3.0, 3.5, 4.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)

    deltas, _ = compute_gae(rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.0)
    torch.testing.assert_close(deltas, t64([[0.09, 0.25, 1.00]]), **TIGHT)  # lam = 0: A_t = delta_t

    advantages, returns = compute_gae(rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, t64([[0.7884, 0.97, 1.00]]), **TIGHT)
    torch.testing.assert_close(returns, t64([[3.7884, 4.47, 5.00]]), **TIGHT)


CLIP_CASES = [  # (A, rho, loss, clipped) worked by hand, epsilon = 0.2
    pytest.param(2.0, 1.1, -2.2, False, id="good-safe"),
    pytest.param(2.0, 1.5, -2.4, True, id="good-aggressive"),
    pytest.param(-2.0, 0.9, 1.8, False, id="bad-safe"),
    pytest.param(-2.0, 0.5, 1.6, True, id="bad-aggressive"),
]


@pytest.mark.parametrize(("advantage", "rho", "expected_loss", "clipped"), CLIP_CASES)
def test_worked_example_clipped_objective(advantage, rho, expected_loss, clipped):
    logprobs = t64([[math.log(rho)]]).requires_grad_()
    loss, stats = policy_loss(
        logprobs=logprobs,
        old_logprobs=t64([[0.0]]),
        advantages=t64([[advantage]]),
        response_mask=torch.ones(1, 1, dtype=torch.bool),
        cliprange=0.2,
    )
    loss.backward()
    torch.testing.assert_close(loss, t64(expected_loss), rtol=0, atol=1e-12)
    # d(-rho * A)/d logprobs = -rho * A unclipped; a clipped token contributes a constant.
    expected_grad = 0.0 if clipped else -rho * advantage
    torch.testing.assert_close(logprobs.grad, t64([[expected_grad]]), rtol=0, atol=1e-12)
    assert stats.clipfrac.item() == float(clipped)
    torch.testing.assert_close(stats.ratio, t64([[rho]]), rtol=0, atol=1e-12)


def test_policy_loss_gradient_is_zero_elementwise_on_clipped_tokens():
    advantages = t64([[2.0, 2.0, -2.0, -2.0, 5.0]])
    rhos = t64([[1.1, 1.5, 0.9, 0.5, 3.0]])
    mask = torch.tensor([[True, True, True, True, False]])  # the last token is padding
    logprobs = rhos.log().requires_grad_()
    loss, stats = policy_loss(
        logprobs=logprobs,
        old_logprobs=torch.zeros_like(rhos),
        advantages=advantages,
        response_mask=mask,
        cliprange=0.2,
    )
    loss.backward()
    torch.testing.assert_close(loss, t64((-2.2 - 2.4 + 1.8 + 1.6) / 4), **TIGHT)
    torch.testing.assert_close(logprobs.grad, t64([[-2.2 / 4, 0.0, 1.8 / 4, 0.0, 0.0]]), **TIGHT)
    assert stats.clipped.tolist() == [[False, True, False, True, False]]
    torch.testing.assert_close(stats.clipfrac, t64(0.5))
    expected_approxkl = 0.5 * sum(math.log(r) ** 2 for r in [1.1, 1.5, 0.9, 0.5]) / 4
    torch.testing.assert_close(stats.approxkl, t64(expected_approxkl), **TIGHT)


def test_policy_equal_to_old_policy_gives_ratio_one_and_zero_kl():
    logprobs = torch.randn(3, 7)
    mask = torch.rand(3, 7) > 0.3
    _, stats = policy_loss(
        logprobs=logprobs,
        old_logprobs=logprobs.clone(),
        advantages=torch.randn(3, 7),
        response_mask=mask,
        cliprange=0.2,
    )
    assert torch.equal(stats.ratio, torch.ones(3, 7))
    assert stats.approxkl.item() == 0.0 and stats.clipfrac.item() == 0.0
    assert torch.equal(kl_penalty(logprobs=logprobs, ref_logprobs=logprobs.clone()), torch.zeros(3, 7))


# ----------------------------------------------------------------------------------------------
# GAE against the naive loop
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_naive_loop_on_padded_batches(seed):
    generator = torch.Generator().manual_seed(seed)
    B, T, gamma, lam = 8, 13, 0.97, 0.9
    mask = random_layout(generator, B, T)
    rewards = torch.randn(B, T, generator=generator, dtype=F64)
    values = torch.randn(B, T, generator=generator, dtype=F64)

    advantages, returns = compute_gae(
        rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam
    )
    naive_advantages, naive_returns = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(advantages, naive_advantages, **TIGHT)
    torch.testing.assert_close(returns, naive_returns, **TIGHT)
    assert not advantages[~mask].any() and not returns[~mask].any()


def test_gae_matches_naive_loop_with_holes_in_the_mask():
    generator = torch.Generator().manual_seed(3)
    mask = torch.rand(6, 10, generator=generator) > 0.4
    rewards = torch.randn(6, 10, generator=generator, dtype=F64)
    values = torch.randn(6, 10, generator=generator, dtype=F64)
    advantages, returns = compute_gae(rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.95)
    naive_advantages, naive_returns = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.95)
    torch.testing.assert_close(advantages, naive_advantages, **TIGHT)
    torch.testing.assert_close(returns, naive_returns, **TIGHT)


def test_gae_ignores_whatever_sits_in_padding():
    generator = torch.Generator().manual_seed(4)
    mask = random_layout(generator, 6, 11)
    rewards = torch.randn(6, 11, generator=generator, dtype=F64)
    values = torch.randn(6, 11, generator=generator, dtype=F64)
    clean = compute_gae(rewards=rewards, values=values, response_mask=mask, gamma=0.99, lam=0.95)

    garbage_rewards = torch.where(mask, rewards, math.nan)
    garbage_values = torch.where(mask, values, 1e6)
    dirty = compute_gae(
        rewards=garbage_rewards, values=garbage_values, response_mask=mask, gamma=0.99, lam=0.95
    )
    torch.testing.assert_close(dirty, clean, **TIGHT)


def test_score_in_the_middle_of_a_padded_batch_gives_the_unpadded_advantages():
    """A 2-token response padded to width 6 (query left, padding right) equals the same response alone."""
    kl = t64([[0.3, -0.2]])
    values = t64([[0.5, 1.5]])
    alone_rewards, _ = shaped_rewards(
        scores=t64([2.0]), kl=kl, kl_coef=0.1, response_mask=torch.ones(1, 2).bool()
    )
    alone = compute_gae(
        rewards=alone_rewards, values=values, response_mask=torch.ones(1, 2).bool(), gamma=0.9, lam=0.8
    )

    mask = padded_mask([(1, 1, 2)], T=6)  # pad q r r pad pad
    padded_kl = t64([[7.0, 7.0, 0.3, -0.2, 7.0, 7.0]])
    padded_values = t64([[9.0, 9.0, 0.5, 1.5, 9.0, 9.0]])
    rewards, _ = shaped_rewards(scores=t64([2.0]), kl=padded_kl, kl_coef=0.1, response_mask=mask)
    assert rewards[0, 3] == -0.1 * -0.2 + 2.0  # the score sits at position 3, padding follows
    padded = compute_gae(rewards=rewards, values=padded_values, response_mask=mask, gamma=0.9, lam=0.8)
    for alone_tensor, padded_tensor in zip(alone, padded):
        torch.testing.assert_close(padded_tensor[:, 2:4], alone_tensor, **TIGHT)
        assert not padded_tensor[~mask].any()


# ----------------------------------------------------------------------------------------------
# Reward shaping
# ----------------------------------------------------------------------------------------------


def test_shaped_rewards_places_the_score_at_the_last_response_token():
    #        pad    q      q      r      r      r      pad    pad
    mask = padded_mask([(1, 2, 3), (0, 1, 7), (0, 3, 1), (2, 3, 0)], T=8)
    kl = torch.arange(32, dtype=F64).reshape(4, 8) / 10
    scores = t64([1.0, 2.0, 3.0, 4.0])
    rewards, non_score_reward = shaped_rewards(scores=scores, kl=kl, kl_coef=0.5, response_mask=mask)

    torch.testing.assert_close(non_score_reward, torch.where(mask, -0.5 * kl, 0), **TIGHT)
    score_part = rewards - non_score_reward
    expected = torch.zeros(4, 8, dtype=F64)
    expected[0, 5], expected[1, 7], expected[2, 3] = 1.0, 2.0, 3.0  # row 3 has no response: no score
    torch.testing.assert_close(score_part, expected, **TIGHT)
    assert not rewards[3].any()


def test_shaped_rewards_with_no_response_at_all():
    mask = torch.zeros(2, 4, dtype=torch.bool)
    rewards, non_score_reward = shaped_rewards(
        scores=t64([1.0, -1.0]), kl=torch.ones(2, 4), kl_coef=0.1, response_mask=mask
    )
    assert not rewards.any() and not non_score_reward.any()


def test_eos_trick_replaces_the_score_of_unfinished_responses():
    mask = torch.ones(3, 2, dtype=torch.bool)
    rewards, _ = shaped_rewards(
        scores=t64([2.0, 2.0, -3.0]),
        kl=torch.zeros(3, 2, dtype=F64),
        kl_coef=0.1,
        response_mask=mask,
        eos_penalty=-1.0,
        ended_with_eos=torch.tensor([True, False, False]),
    )
    assert rewards[:, -1].tolist() == [2.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="together"):
        shaped_rewards(
            scores=t64([1.0]), kl=torch.zeros(1, 2), kl_coef=0.1, response_mask=mask[:1], eos_penalty=-1.0
        )


def test_clip_scores():
    assert clip_scores(scores=t64([-9.0, 0.5, 9.0]), score_clip=3.0).tolist() == [-3.0, 0.5, 3.0]


def test_sequence_kl_sums_over_the_response():
    kl = t64([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    mask = torch.tensor([[False, True, True], [True, False, False]])
    assert sequence_kl(kl=kl, response_mask=mask).tolist() == [6.0, 8.0]


# ----------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------


def test_masked_mean_and_sum():
    x = t64([[1.0, 2.0, math.nan], [4.0, math.inf, 6.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert masked_sum(x, mask).item() == 3.0
    assert masked_mean(x, mask).item() == 1.5
    assert masked_mean(x, mask, dim=1).tolist() == [1.5, 0.0]  # an empty row has mean 0, not NaN


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_matches_torch_var_on_the_selected_entries(unbiased):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=generator, dtype=F64) * 3 + 1
    mask = torch.rand(5, 9, generator=generator) > 0.5
    torch.testing.assert_close(
        masked_var(x, mask, unbiased=unbiased), torch.var(x[mask], unbiased=unbiased), **TIGHT
    )


def test_masked_var_needs_two_entries():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(torch.ones(2, 2), torch.tensor([[True, False], [False, False]]))


def test_spread_about_one_by_hand_and_against_torch():
    """w = (0.5, 1.0, 1.5): E[w] = 1, E[(w - 1)^2] = 1/6, std sqrt(1/6); weights near 1 (1 +- 1e-4) against
    torch.std with the 1/n formula, in float64; a rounding below zero gives 0."""
    assert spread_about_one(mean=1.0, mean_sq_dev=1 / 6) == pytest.approx(math.sqrt(1 / 6), rel=1e-12)
    w = 1 + 1e-4 * torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=F64)
    spread = spread_about_one(mean=float(w.mean()), mean_sq_dev=float(((w - 1) ** 2).mean()))
    assert spread == pytest.approx(float(torch.std(w, unbiased=False)), rel=1e-9)
    assert spread_about_one(mean=1.1, mean_sq_dev=0.0099999) == 0.0


def test_masked_whiten():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 10, generator=generator, dtype=F64) * 5 + 3
    mask = random_layout(generator, 6, 10)
    whitened = masked_whiten(x, mask)
    torch.testing.assert_close(whitened[mask].mean(), t64(0.0), rtol=0, atol=1e-12)
    torch.testing.assert_close(whitened[mask].std(), t64(1.0), rtol=0, atol=1e-8)
    assert not whitened[~mask].any()

    kept_mean = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(kept_mean[mask].mean(), x[mask].mean(), rtol=0, atol=1e-12)
    torch.testing.assert_close(kept_mean[mask].std(), t64(1.0), rtol=0, atol=1e-8)
    assert not kept_mean[~mask].any()


# ----------------------------------------------------------------------------------------------
# The response mask
# ----------------------------------------------------------------------------------------------


def test_response_mask_stops_after_first_eos():
    eos = 0
    response = torch.tensor([[5, 6, 0, 7, 0], [5, 6, 7, 8, 9], [0, 3, 3, 3, 3], [0, 0, 0, 0, 0]])
    expected = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool
    )  # EOS kept, then padding; no EOS (truncated): all True; pad == EOS: only the first counts
    assert torch.equal(response_mask_from_tokens(response=response, eos_token_id=eos), expected)


def test_response_mask_matches_the_loop():
    generator = torch.Generator().manual_seed(0)
    response = torch.randint(0, 4, (16, 7), generator=generator)  # token 0 = EOS, often several per row
    B, R = response.shape
    loop = torch.tensor([[0 not in response[b, :t] for t in range(R)] for b in range(B)])
    assert torch.equal(response_mask_from_tokens(response=response, eos_token_id=0), loop)


def test_response_mask_ends_at_a_stop_token_like_at_eos():
    """The docstring's layout: the token completing a stop string ("\\n", position 1) ends the response."""
    eos = 0
    response = torch.tensor([[5, 7, 6, eos, eos], [5, 6, eos, 7, eos], [5, 6, 6, 6, 6]])  # (3, 5)
    stops = torch.tensor([[False, True, False, False, False], [False] * 5, [False, False, True, False, True]])
    expected = torch.tensor(
        [
            [True, True, False, False, False],
            [True, True, True, False, False],
            [True, True, True, False, False],
        ]
    )
    assert torch.equal(response_mask_from_tokens(response=response, eos_token_id=eos, stops=stops), expected)
    is_end = (response == eos) | stops
    loop = torch.tensor([[not is_end[b, :t].any() for t in range(5)] for b in range(3)])
    assert torch.equal(expected, loop)


# ----------------------------------------------------------------------------------------------
# Log-probs, entropy, KL estimators
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_torch_distributions(temperature):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator, dtype=F64)
    labels = torch.randint(0, 11, (3, 5), generator=generator)
    dist = torch.distributions.Categorical(logits=logits / temperature)
    logprobs = logprobs_from_logits(logits=logits, labels=labels, temperature=temperature)
    torch.testing.assert_close(logprobs, dist.log_prob(labels), **TIGHT)
    entropy = entropy_from_logits(logits=logits, temperature=temperature)
    torch.testing.assert_close(entropy, dist.entropy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_from_one_log_softmax_equal_the_two_formulas(temperature):
    """The fused function's log-probs are the separate function's bit for bit, its entropy and the entropy's
    gradient equal `entropy_from_logits`' (and torch's Categorical) to rounding, -inf logits included; as a
    metric (entropy_grad False) the entropy carries no graph."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 11, generator=generator, dtype=F64)
    logits[:, :2, 3] = -math.inf  # a token of probability 0 at the first two positions (mask_eos_logits)
    labels = torch.randint(0, 3, (6, 5), generator=generator)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    logprobs, entropy = token_math.logprobs_and_entropy_from_logits(
        logits=a, labels=labels, temperature=temperature
    )
    expected_entropy = entropy_from_logits(logits=b, temperature=temperature)
    assert torch.equal(logprobs, logprobs_from_logits(logits=logits, labels=labels, temperature=temperature))
    dist = torch.distributions.Categorical(logits=logits[:, 2:] / temperature)
    torch.testing.assert_close(entropy[:, 2:], dist.entropy(), rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-12)
    weights = torch.randn(6, 5, generator=generator, dtype=F64)
    (entropy * weights).sum().backward()
    (expected_entropy * weights).sum().backward()
    assert torch.isfinite(a.grad).all()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    metric_logprobs, metric = token_math.logprobs_and_entropy_from_logits(
        logits=a, labels=labels, temperature=temperature, entropy_grad=False
    )
    assert not metric.requires_grad and metric_logprobs.requires_grad
    torch.testing.assert_close(metric, expected_entropy.detach(), rtol=0, atol=1e-12)


def test_kl_estimators_against_hand_values():
    logprobs, ref_logprobs = t64(LOGPROBS), t64(REF_LOGPROBS)  # log p - log q = (0.6, -1.5, 0.0)
    expected = {
        "k1": [0.6, -1.5, 0.0],
        "k3": [
            math.exp(-0.6) - 1 + 0.6,
            math.exp(1.5) - 1 - 1.5,
            0.0,
        ],  # r - 1 - log r, log r = log q - log p
        "abs": [0.6, 1.5, 0.0],
        "mse": [0.18, 1.125, 0.0],
    }
    for estimator, values in expected.items():
        kl = kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, estimator=estimator)
        torch.testing.assert_close(kl, t64(values), **TIGHT, msg=estimator)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, estimator="k2")


def test_k3_is_nonnegative():
    generator = torch.Generator().manual_seed(0)
    logprobs, ref_logprobs = torch.rand(2, 1000, generator=generator, dtype=F64).mul(-8).unbind()
    assert (kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, estimator="k3") >= 0).all()


def test_k1_and_k3_are_unbiased_estimates_of_kl_policy_to_reference():
    """Averaged over tokens sampled from the policy p, k1 and k3 both give KL(p || q) (Schulman 2020)."""
    p, q = t64([0.5, 0.3, 0.15, 0.05]), t64([0.25, 0.25, 0.25, 0.25])
    exact = (p * (p / q).log()).sum()
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    for estimator in ("k1", "k3"):
        kl = kl_penalty(logprobs=p.log()[tokens], ref_logprobs=q.log()[tokens], estimator=estimator)
        torch.testing.assert_close(kl.mean(), exact, rtol=0, atol=0.01, msg=estimator)


# ----------------------------------------------------------------------------------------------
# Value loss, explained variance
# ----------------------------------------------------------------------------------------------


VALUE_CASES = [  # (V_old, V, R, loss, dL/dV, clipped) with eps_v = 0.2, worked by hand
    pytest.param(1.0, 1.1, 2.0, 0.5 * 0.9**2, 1.1 - 2.0, False, id="inside-the-clip-range"),
    pytest.param(1.0, 1.5, 2.0, 0.5 * 0.8**2, 0.0, True, id="moved-too-far-toward-R"),  # V_clip = 1.2
    pytest.param(1.0, 2.5, 2.0, 0.5 * 0.8**2, 0.0, True, id="overshot-R"),  # (1.2-2)^2 > (2.5-2)^2
    pytest.param(1.0, 0.5, 2.0, 0.5 * 1.5**2, 0.5 - 2.0, False, id="moved-away-from-R"),  # V_clip = 0.8
]


@pytest.mark.parametrize(
    ("old_value", "value", "ret", "expected_loss", "expected_grad", "clipped"), VALUE_CASES
)
def test_value_loss_clipping_by_hand(old_value, value, ret, expected_loss, expected_grad, clipped):
    values = t64([[value, 7.0]]).requires_grad_()
    mask = torch.tensor([[True, False]])
    loss, stats = value_loss(
        values=values,
        old_values=t64([[old_value, 0.0]]),
        returns=t64([[ret, 0.0]]),
        response_mask=mask,
        cliprange_value=0.2,
    )
    loss.backward()
    torch.testing.assert_close(loss, t64(expected_loss), rtol=0, atol=1e-12)
    torch.testing.assert_close(values.grad, t64([[expected_grad, 0.0]]), rtol=0, atol=1e-12)
    assert stats.clipfrac.item() == float(clipped)
    assert stats.clipped.tolist() == [[clipped, False]]


def test_explained_variance():
    returns = t64([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 6.0, -99.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    assert explained_variance(values=returns, returns=returns, mask=mask).item() == 1.0
    constant = torch.full_like(returns, 3.5)
    torch.testing.assert_close(
        explained_variance(values=constant, returns=returns, mask=mask), t64(0.0), **TIGHT
    )
    flat = torch.ones(2, 4, dtype=F64)
    assert math.isnan(explained_variance(values=returns, returns=flat, mask=mask).item())


# ----------------------------------------------------------------------------------------------
# KL controllers
# ----------------------------------------------------------------------------------------------


def test_adaptive_kl_controller_moves_beta_toward_the_target():
    controller = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10_000)
    controller.update(current_kl=7.2, n_steps=512)  # e = 7.2 / 6 - 1 = 0.2
    assert controller.value == pytest.approx(0.2 * (1 + 0.2 * 512 / 10_000))

    controller = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10_000)
    controller.update(current_kl=4.5, n_steps=512)  # e = -0.25, clipped to -0.2
    assert controller.value == pytest.approx(0.2 * (1 - 0.2 * 512 / 10_000))

    controller = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10_000)
    controller.update(current_kl=6.6, n_steps=512)  # e = 0.1, not clipped
    assert controller.value == pytest.approx(0.2 * (1 + 0.1 * 512 / 10_000))


def test_adaptive_kl_controller_error_is_clipped_and_horizon_is_in_episodes():
    controller = AdaptiveKLController(init_kl_coef=0.1, target=2.0, horizon=256)
    controller.update(current_kl=20.0, n_steps=64)  # 10x the target: e clipped to +0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 64 / 256))

    controller = AdaptiveKLController(init_kl_coef=0.1, target=2.0, horizon=256)
    controller.update(current_kl=torch.tensor(20.0), n_steps=256)  # n = horizon multiplies by 1.2
    assert controller.value == pytest.approx(0.12)

    controller.update(current_kl=0.0, n_steps=256)  # far below the target: e clipped to -0.2
    assert controller.value == pytest.approx(0.12 * 0.8)


def test_kl_controllers_state_dict_round_trip():
    controller = AdaptiveKLController(init_kl_coef=0.1, target=2.0, horizon=256)
    controller.update(current_kl=3.0, n_steps=64)
    resumed = AdaptiveKLController(init_kl_coef=0.1, target=2.0, horizon=256)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.value == controller.value
    controller.update(current_kl=1.0, n_steps=64)
    resumed.update(current_kl=1.0, n_steps=64)
    assert resumed.value == controller.value

    fixed = FixedKLController(kl_coef=0.05)
    fixed.update(current_kl=100.0, n_steps=64)
    assert fixed.value == 0.05
    other = FixedKLController(kl_coef=0.3)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05


def test_mask_eos_logits_hand_example_and_gradient():
    """EOS (id 2) gets -inf at positions t < min_new_tokens = 2, nothing else changes; the log-probs are then
    those of softmax over the other tokens there, the entropy is finite, and no gradient is NaN."""
    logits = torch.tensor([[[1.0, 2.0, 3.0, 0.5], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 4.0, 1.0]]], dtype=F64)
    logits.requires_grad_(True)
    masked = token_math.mask_eos_logits(logits=logits, eos_token_id=2, min_new_tokens=2)  # (1, 3, 4)
    inf = -math.inf
    expected = [[[1.0, 2.0, inf, 0.5], [0.0, 0.0, inf, 0.0], [1.0, 1.0, 4.0, 1.0]]]
    assert masked.tolist() == expected
    assert (
        token_math.mask_eos_logits(logits=logits, eos_token_id=2, min_new_tokens=0) is logits
    )  # off: no copy
    labels = torch.tensor([[0, 1, 2]])
    logprobs = logprobs_from_logits(logits=masked, labels=labels)  # (1, 3)
    by_hand = [1.0 - math.log(math.e + math.e**2 + math.e**0.5), -math.log(3.0)]
    torch.testing.assert_close(logprobs[0, :2], torch.tensor(by_hand, dtype=F64), **TIGHT)
    torch.testing.assert_close(logprobs[0, 2], torch.log_softmax(logits[0, 2], -1)[2], **TIGHT)
    entropy = entropy_from_logits(logits=masked, temperature=0.7)  # (1, 3)
    dist = torch.distributions.Categorical(logits=logits[0, 1, [0, 1, 3]] / 0.7)  # the three tokens left
    torch.testing.assert_close(entropy[0, 1], dist.entropy(), **TIGHT)
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, :2, 2].abs().max() == 0  # the masked EOS entries get no gradient


# ----------------------------------------------------------------------------------------------
# REINFORCE++ and the KL in the loss
# ----------------------------------------------------------------------------------------------


def naive_reinforce_pp_returns(rewards, mask) -> torch.Tensor:
    """The loop of the `reinforce_pp_advantages` docstring, in plain python floats."""
    B, T = len(rewards), len(rewards[0])
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        running = 0.0
        for t in reversed([t for t in range(T) if mask[b][t]]):
            running = returns[b][t] = rewards[b][t] + running
    return t64(returns)


def test_worked_example_reinforce_pp():
    """From the log-probs of the 3-token example through the k1 reward shaping to REINFORCE++."""
    mask = torch.ones(1, 3, dtype=torch.bool)
    kl = kl_penalty(logprobs=t64([LOGPROBS]), ref_logprobs=t64([REF_LOGPROBS]), estimator="k1")
    rewards, _ = shaped_rewards(scores=t64([5.0]), kl=kl, kl_coef=0.1, response_mask=mask)
    advantages, returns = reinforce_pp_advantages(rewards=rewards, response_mask=mask)
    torch.testing.assert_close(returns, t64([[5.09, 5.15, 5.00]]), **TIGHT)
    # masked_whiten's unbiased variance (n - 1) is the one the worked example's numbers use; n would give
    # (0.1622, 1.1355, -1.2978).
    torch.testing.assert_close(advantages, t64([[0.1325, 0.9272, -1.0596]]), **FOUR_DECIMALS)


def test_worked_example_k3_in_the_loss():
    logprobs, ref_logprobs = t64([LOGPROBS]), t64([REF_LOGPROBS])
    k3 = kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, estimator="k3")
    written_out = torch.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1  # GRPO's form
    torch.testing.assert_close(k3, written_out, **TIGHT)
    torch.testing.assert_close(k3[0, :2], t64([0.14881, 1.98169]), rtol=0, atol=5e-6)

    mask = torch.tensor([[True, True, False]])  # token 3 as padding: it must not count in the mean
    loss = kl_loss(logprobs=logprobs, ref_logprobs=ref_logprobs, response_mask=mask, kl_coef=0.1)
    torch.testing.assert_close(loss, 0.1 * (k3[0, 0] + k3[0, 1]) / 2, **TIGHT)


def test_kl_loss_gradient_through_the_policy_logprobs():
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.rand(5, 9, generator=generator, dtype=F64).mul(-6)
    ref_logprobs = torch.rand(5, 9, generator=generator, dtype=F64).mul(-6)
    mask = random_layout(generator, 5, 9)
    kl_coef = 0.05

    policy = logprobs.clone().requires_grad_()
    kl_loss(logprobs=policy, ref_logprobs=ref_logprobs, response_mask=mask, kl_coef=kl_coef).backward()

    formula = logprobs.clone().requires_grad_()
    k3 = torch.exp(ref_logprobs - formula) - (ref_logprobs - formula) - 1  # (B, T)
    (kl_coef * k3[mask].mean()).backward()
    torch.testing.assert_close(policy.grad, formula.grad, **TIGHT)

    analytic = kl_coef * (1 - torch.exp(ref_logprobs - logprobs)) / mask.sum()  # d/dlogp of k3, mean over n
    torch.testing.assert_close(policy.grad, torch.where(mask, analytic, 0), **TIGHT)
    assert not policy.grad[~mask].any()
    # Above the reference the gradient step lowers log p, below it raises it.
    assert (policy.grad[mask & (logprobs > ref_logprobs)] > 0).all()
    assert (policy.grad[mask & (logprobs < ref_logprobs)] < 0).all()


def test_k3_in_the_loss_is_not_clamped():
    """A token the reference gives e^5 times the policy's probability: k3 = e^5 - 5 - 1 ~ 142.4 (past verl's
    and OpenRLHF's clamp at 10) and its gradient 1 - e^5 per unit of log p, in full (docs/reference/glossary.md, k3: why
    no clamp). Fails if k3 is clamped (value 10, gradient 0)."""
    logprobs = torch.tensor([[-6.0, -1.0]], requires_grad=True)
    ref_logprobs = torch.tensor([[-1.0, -1.0]])
    mask = torch.tensor([[True, True]])
    loss = ppo_math.kl_loss(logprobs=logprobs, ref_logprobs=ref_logprobs, response_mask=mask, kl_coef=1.0)
    loss.backward()
    assert float(loss.detach()) == pytest.approx((math.exp(5) - 6) / 2, rel=1e-6)
    assert logprobs.grad[0].tolist() == pytest.approx([(1 - math.exp(5)) / 2, 0.0], rel=1e-6)


def test_k3_loss_expected_gradient_is_the_forward_kl_gradient():
    """For one state, a categorical policy p = softmax(z) and a reference q: the expectation over y ~ p of the
    gradient of k3(y) (through log p(y) only, as the loss differentiates it) is grad_z KL(q || p), the forward
    KL, not grad_z KL(p || q), the reverse KL that the reward's k1 penalty optimises through the policy
    gradient (k2 in the loss would give that one). The two agree to first order as p -> q. docs/reference/glossary.md, k3."""
    torch.manual_seed(0)
    z = torch.randn(6, dtype=torch.float64, requires_grad=True)
    log_q = torch.log_softmax(torch.randn(6, dtype=torch.float64), dim=-1)

    def expected_gradient(estimator: str) -> torch.Tensor:
        log_p = torch.log_softmax(z, dim=-1)
        values = ppo_math.kl_penalty(logprobs=log_p, ref_logprobs=log_q, estimator=estimator)  # (V,)
        (grad,) = torch.autograd.grad((log_p.exp().detach() * values).sum(), z)  # sum_y p(y) grad k(y)
        return grad

    def kl_gradient(a_is_p: bool) -> torch.Tensor:
        log_p = torch.log_softmax(z, dim=-1)
        log_a, log_b = (log_p, log_q) if a_is_p else (log_q, log_p)
        (grad,) = torch.autograd.grad((log_a.exp() * (log_a - log_b)).sum(), z)
        return grad

    forward, reverse = kl_gradient(a_is_p=False), kl_gradient(a_is_p=True)
    torch.testing.assert_close(expected_gradient("k3"), forward)
    torch.testing.assert_close(expected_gradient("mse"), reverse)
    assert not torch.allclose(forward, reverse, atol=1e-3)


def test_token_advantages_fill_the_response_and_nothing_else():
    mask = padded_mask([(0, 2, 3), (1, 1, 1), (0, 0, 6), (2, 2, 0)], 6)  # the last row has no response
    mask[2, 3] = False  # a hole inside a response
    advantages = t64([1.5, -2.0, 0.25, 9.0])
    spread = token_advantages(advantages=advantages, response_mask=mask)
    expected = t64([[advantages[b].item() if mask[b, t] else 0.0 for t in range(6)] for b in range(4)])
    torch.testing.assert_close(spread, expected, **TIGHT)
    assert spread.shape == (4, 6) and not spread[~mask].any()
    # query | response | pad
    torch.testing.assert_close(spread[0], t64([0.0, 0.0, 1.5, 1.5, 1.5, 0.0]), **TIGHT)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_pp_matches_naive_loop_on_padded_batches(seed):
    generator = torch.Generator().manual_seed(seed)
    B, T = 8, 12
    rewards = torch.randn(B, T, generator=generator, dtype=F64)
    mask = random_layout(generator, B, T)
    mask[0, 4] = False  # a hole inside the full-width response
    rewards_in_padding = torch.where(mask, rewards, torch.full_like(rewards, 1e6))  # must not leak in

    advantages, returns = reinforce_pp_advantages(rewards=rewards_in_padding, response_mask=mask)
    expected_returns = naive_reinforce_pp_returns(rewards.tolist(), mask.tolist())
    torch.testing.assert_close(returns, expected_returns, rtol=0, atol=1e-12)
    torch.testing.assert_close(advantages, masked_whiten(expected_returns, mask), rtol=0, atol=1e-12)
    assert not advantages[~mask].any() and not returns[~mask].any()

    # The same returns as GAE with gamma = lam = 1 and no critic (V = 0).
    gae_advantages, _ = compute_gae(
        rewards=rewards, values=torch.zeros_like(rewards), response_mask=mask, gamma=1.0, lam=1.0
    )
    torch.testing.assert_close(returns, gae_advantages, rtol=0, atol=1e-12)


def test_reinforce_pp_whitens_over_the_global_batch():
    """reduce_sum reaches the whitening: a stand-in for two processes holding the same rows (every sum
    doubles) gives each the whitening of the batch of both, i.e. of the rows stacked twice."""
    generator = torch.Generator().manual_seed(5)
    rewards = torch.randn(6, 7, generator=generator, dtype=F64)
    mask = random_layout(generator, 6, 7)
    twice, _ = reinforce_pp_advantages(rewards=rewards.repeat(2, 1), response_mask=mask.repeat(2, 1))
    advantages, _ = reinforce_pp_advantages(rewards=rewards, response_mask=mask, reduce_sum=lambda t: 2 * t)
    torch.testing.assert_close(advantages, twice[:6], rtol=0, atol=1e-12)
    alone, _ = reinforce_pp_advantages(rewards=rewards, response_mask=mask)
    assert not torch.allclose(advantages, alone)  # n - 1 differs: the global statistics were used
