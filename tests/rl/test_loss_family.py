"""The policy-loss family of 2025-26 (DAPO, GSPO, CISPO, SAPO and their kin) against its worked examples,
naive loops and naive autograd versions: clip-higher and the dual clip, the loss aggregations and their
invariance under gradient accumulation and processes, GSPO, CISPO, SAPO, the sampler correction, overlong
shaping and dynamic sampling's group selection."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import F64, TIGHT, t64

from llm_rlhf.rl.loss_math import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    loss_normaliser,
    mask_truncated,
    overlong_penalty,
    sampler_correction_weights,
)
from llm_rlhf.rl.policy_losses import ROWS as LOSS_ROWS
from llm_rlhf.rl.policy_losses import LossInputs, cispo_token_losses, gspo_token_losses, sapo_token_losses
from llm_rlhf.rl.ppo_math import masked_mean, policy_loss, ppo_clip_token_losses, token_advantages


def example_digits(actual: torch.Tensor, printed: list[float], decimals: list[int]) -> None:
    """`actual` rounds to the worked example's printed figures: within half a unit of each one's last printed digit."""
    for a, p, d in zip(actual.tolist(), printed, decimals, strict=True):
        assert abs(a - p) <= 0.5 * 10.0**-d + 1e-15, (a, p, d)


# The policy-loss family's worked example: one minibatch of two responses, max new tokens L = 4.
# a: 2 tokens, A = 1.0, rho = (1.3, 0.9); b: 4 tokens, A = -0.5, rho = (1.1, 0.7, 1.0, 1.25).
L = 4
MASK = torch.tensor([[True, True, False, False], [True, True, True, True]])
RATIOS = t64([[1.3, 0.9, 1.0, 1.0], [1.1, 0.7, 1.0, 1.25]])  # the padding's ratio is never read
ADVANTAGES = token_advantages(advantages=t64([1.0, -0.5]), response_mask=MASK)  # (2, 4)


def example_logprobs(ratios: torch.Tensor = RATIOS) -> torch.Tensor:
    """log pi_theta with log pi_old = 0, so rho = exp(logprobs); with grad."""
    return ratios.log().requires_grad_()


def clip_higher(logprobs: torch.Tensor, **kwargs):
    return ppo_clip_token_losses(
        logprobs=logprobs,
        old_logprobs=torch.zeros_like(logprobs),
        advantages=ADVANTAGES,
        response_mask=MASK,
        **{"cliprange_low": 0.2, "cliprange_high": 0.28, **kwargs},
    )


# ----------------------------------------------------------------------------------------------
# Clip-higher and the dual clip
# ----------------------------------------------------------------------------------------------


def naive_ppo_clip(rho, a, eps_low, eps_high, dual_clip=None):
    """One token's loss, in python floats, the formula of the `ppo_clip_token_losses` docstring."""
    loss = -min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
    if dual_clip is not None and a < 0:
        loss = min(loss, -dual_clip * a)
    return loss


def test_worked_example_clip_higher_token_losses_and_gradient():
    logprobs = example_logprobs()
    losses, stats = clip_higher(logprobs)
    expected = t64([[-1.28, -0.9, 0, 0], [0.55, 0.4, 0.5, 0.625]])
    torch.testing.assert_close(losses, expected, **TIGHT)
    losses.sum().backward()
    # d(-rho * A)/d log pi = -rho * A where unclipped; a clipped token is a constant: a1 (upper), b2 (lower)
    torch.testing.assert_close(logprobs.grad, t64([[0, -0.9, 0, 0], [0.55, 0, 0.5, 0.625]]), **TIGHT)
    assert stats.clipped_high.tolist() == [[True, False, False, False], [False] * 4]
    assert stats.clipped_low.tolist() == [[False] * 4, [False, True, False, False]]
    assert not stats.dual_clipped.any()
    torch.testing.assert_close(stats.ratio[MASK], RATIOS[MASK], **TIGHT)

    symmetric, _ = clip_higher(example_logprobs(), cliprange_high=0.2)
    torch.testing.assert_close(
        symmetric[0, 0], t64(-1.2), **TIGHT
    )  # the example's -1.2 on a1 with a symmetric 0.2
    torch.testing.assert_close(symmetric[1, 3], t64(0.625), **TIGHT)  # b4 at 1.25: A < 0, no upper clip


def test_worked_example_dual_clip():
    logprobs = t64([[math.log(4.0)]]).requires_grad_()
    kwargs = dict(
        old_logprobs=t64([[0.0]]),
        advantages=t64([[-0.5]]),
        response_mask=torch.ones(1, 1, dtype=torch.bool),
        cliprange_low=0.2,
        cliprange_high=0.28,
    )
    plain, plain_stats = ppo_clip_token_losses(logprobs=logprobs, **kwargs)
    torch.testing.assert_close(plain, t64([[2.0]]), **TIGHT)
    (grad,) = torch.autograd.grad(plain.sum(), logprobs)
    torch.testing.assert_close(grad, t64([[2.0]]), **TIGHT)  # -rho * A: unbounded in rho
    assert not plain_stats.dual_clipped.any()

    dual, dual_stats = ppo_clip_token_losses(logprobs=logprobs, dual_clip=3.0, **kwargs)
    torch.testing.assert_close(dual, t64([[1.5]]), **TIGHT)
    (grad,) = torch.autograd.grad(dual.sum(), logprobs)
    torch.testing.assert_close(grad, t64([[0.0]]), **TIGHT)
    assert dual_stats.dual_clipped.tolist() == [[True]]


def test_dual_clip_only_touches_negative_advantages_above_c():
    rhos = t64([[0.5, 2.0, 3.5, 5.0, 5.0, 0.5]])
    advantages = t64([[-1.0, -1.0, -1.0, -1.0, 1.0, 1.0]])
    mask = torch.ones_like(rhos, dtype=torch.bool)
    logprobs = rhos.log().requires_grad_()
    losses, stats = ppo_clip_token_losses(
        logprobs=logprobs,
        old_logprobs=torch.zeros_like(rhos),
        advantages=advantages,
        response_mask=mask,
        cliprange_low=0.2,
        cliprange_high=0.28,
        dual_clip=3.0,
    )
    expected = [
        naive_ppo_clip(r, a, 0.2, 0.28, 3.0) for r, a in zip(rhos[0].tolist(), advantages[0].tolist())
    ]
    torch.testing.assert_close(losses, t64([expected]), **TIGHT)
    assert stats.dual_clipped.tolist() == [[False, False, True, True, False, False]]
    losses.sum().backward()
    # gradient -rho * A on the free tokens; 0 where the lower clip (0.5, A < 0), the dual clip or the upper
    # clip (5.0, A > 0) binds; rho = 0.5 with A > 0 is below the clip range, where PPO does not clip
    torch.testing.assert_close(logprobs.grad, t64([[0, 2.0, 0, 0, 0, -0.5]]), **TIGHT)


@pytest.mark.parametrize("bad", [1.0, 0.5])
def test_dual_clip_must_exceed_one(bad):
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clip_higher(example_logprobs(), dual_clip=bad)


def test_ppo_clip_token_losses_match_the_naive_loop():
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    logprobs = (0.5 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    old = 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    advantages = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) > 0.3
    for dual_clip in (None, 1.5):
        losses, stats = ppo_clip_token_losses(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=advantages,
            response_mask=mask,
            cliprange_low=0.1,
            cliprange_high=0.3,
            dual_clip=dual_clip,
        )
        rho = (logprobs - old).exp().tolist()
        expected = [
            [
                naive_ppo_clip(rho[b][t], advantages[b, t].item(), 0.1, 0.3, dual_clip) if mask[b, t] else 0.0
                for t in range(T)
            ]
            for b in range(B)
        ]
        torch.testing.assert_close(losses, t64(expected), **TIGHT)
        # gradient -rho * A exactly where no clip binds, 0 elsewhere (and off the mask)
        (grad,) = torch.autograd.grad(losses.sum(), logprobs)
        free = mask & ~stats.clipped & ~stats.dual_clipped
        torch.testing.assert_close(grad, torch.where(free, -advantages * stats.ratio, 0), **TIGHT)
        assert not (stats.clipped | stats.dual_clipped)[~mask].any()


def test_policy_loss_is_the_token_mean_of_ppo_clip_and_unchanged():
    """`policy_loss` now goes through `ppo_clip_token_losses`: bit-identical to the formula it had before
    (inlined here) and to the token-mean aggregation, values, gradients and statistics."""
    g = torch.Generator().manual_seed(1)
    B, T = 6, 9
    logprobs = (0.4 * torch.randn(B, T, generator=g)).requires_grad_()
    old = 0.4 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3

    loss, stats = policy_loss(
        logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, cliprange=0.2
    )
    (grad,) = torch.autograd.grad(loss, logprobs)

    log_ratio = logprobs - old  # the pre-family body of policy_loss
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - 0.2, 1.0 + 0.2)
    before = masked_mean(torch.maximum(unclipped, clipped), mask)
    (before_grad,) = torch.autograd.grad(before, logprobs)
    assert torch.equal(loss, before) and torch.equal(grad, before_grad)
    assert torch.equal(stats.ratio, ratio.detach())
    assert torch.equal(stats.clipped, (clipped > unclipped) & mask)
    assert torch.equal(stats.clipfrac, masked_mean((clipped > unclipped).float(), mask))
    assert torch.equal(stats.approxkl, 0.5 * masked_mean(log_ratio.detach() ** 2, mask))

    losses, _ = ppo_clip_token_losses(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=advantages,
        response_mask=mask,
        cliprange_low=0.2,
        cliprange_high=0.2,
    )
    n = loss_normaliser(loss_mask=mask, aggregation="token_mean", max_new_tokens=T)
    assert torch.equal(
        aggregate_loss(token_losses=losses, loss_mask=mask, aggregation="token_mean", normaliser=n), loss
    )


# ----------------------------------------------------------------------------------------------
# Loss aggregation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("aggregation", "expected", "normaliser"),
    [
        ("token_mean", -0.0175, 6),  # over the minibatch's 6 tokens
        ("seq_mean_token_mean", -0.285625, 2),  # mean of a's (-1.09) and b's (0.51875) token means
        ("token_sum_norm", -0.013125, 8),  # over B * L = 2 * 4
    ],
)
def test_worked_example_loss_aggregation(aggregation, expected, normaliser):
    logprobs = example_logprobs()
    losses, _ = clip_higher(logprobs)
    n = loss_normaliser(loss_mask=MASK, aggregation=aggregation, max_new_tokens=L)
    assert n.item() == normaliser
    loss = aggregate_loss(token_losses=losses, loss_mask=MASK, aggregation=aggregation, normaliser=n)
    torch.testing.assert_close(loss, t64(expected), **TIGHT)
    loss.backward()
    # each token's weight: 1/6 (token), 1/(2 |y_i|) (sequence), 1/8 (constant); clipped tokens get 0
    weight = {
        "token_mean": t64([[1 / 6] * 4, [1 / 6] * 4]),
        "seq_mean_token_mean": t64([[1 / 4] * 4, [1 / 8] * 4]),
        "token_sum_norm": t64([[1 / 8] * 4, [1 / 8] * 4]),
    }[aggregation]
    unweighted = t64([[0, -0.9, 0, 0], [0.55, 0, 0.5, 0.625]])
    torch.testing.assert_close(logprobs.grad, weight * unweighted, **TIGHT)


def naive_aggregate(losses, mask, aggregation, max_new_tokens):
    """The loop of the `aggregate_loss` docstring over a whole minibatch, with its own normaliser."""
    rows = [[losses[b][t] for t in range(len(mask[b])) if mask[b][t]] for b in range(len(mask))]
    if aggregation == "seq_mean_token_mean":
        kept = [sum(r) / len(r) for r in rows if r]
        return sum(kept) / len(kept)
    total = sum(sum(r) for r in rows)
    return total / (sum(len(r) for r in rows) if aggregation == "token_mean" else len(rows) * max_new_tokens)


def varied_minibatch(seed: int, B: int = 8, T: int = 6):
    """B responses of lengths 1..T (one empty row) in a (B, T) layout; logprobs with grad."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T, 1, 3, 0, 5, 2, 6, 4][:B]
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, T)
    logprobs = (0.3 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    old = 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    advantages = token_advantages(advantages=torch.randn(B, generator=g, dtype=F64), response_mask=mask)
    return logprobs, old, advantages, mask


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_aggregation_matches_the_naive_loop(aggregation):
    logprobs, old, advantages, mask = varied_minibatch(2)
    losses, _ = ppo_clip_token_losses(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=advantages,
        response_mask=mask,
        cliprange_low=0.2,
        cliprange_high=0.28,
    )
    n = loss_normaliser(loss_mask=mask, aggregation=aggregation, max_new_tokens=10)
    loss = aggregate_loss(token_losses=losses, loss_mask=mask, aggregation=aggregation, normaliser=n)
    expected = naive_aggregate(losses.tolist(), mask.tolist(), aggregation, 10)
    torch.testing.assert_close(loss, t64(expected), **TIGHT)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("row", LOSS_ROWS, ids=lambda r: r.name)
def test_aggregation_is_invariant_under_accumulation_and_processes(aggregation, row):
    """Two simulated processes of two micro-batches each (rows of different lengths, micro-batches trimmed to
    their own widths as `forward_policy` does): each micro-batch back-propagates num_processes * its
    aggregate_loss over the global normaliser, DDP averages the processes' gradients; the loss and the
    gradient equal those of the whole minibatch at once."""
    logprobs, old, advantages, mask = varied_minibatch(3)
    max_new_tokens = 6

    def token_losses(rows):
        width = max(int(mask[rows].sum(-1).max()), 1)  # trimmed to the micro-batch's longest response
        lp, m = logprobs[rows, :width], mask[rows, :width]
        losses, _ = row.token_losses(
            LossInputs(
                logprobs=lp,
                old_logprobs=old[rows, :width],
                advantages=advantages[rows, :width],
                response_mask=m,
                cliprange_low=0.05,
                cliprange_high=0.28,
                dual_clip=3.0,
            )
        )
        return losses, m

    everything = torch.arange(mask.shape[0])
    full_losses, full_mask = token_losses(everything)
    n_full = loss_normaliser(loss_mask=full_mask, aggregation=aggregation, max_new_tokens=max_new_tokens)
    full = aggregate_loss(
        token_losses=full_losses, loss_mask=full_mask, aggregation=aggregation, normaliser=n_full
    )
    (full_grad,) = torch.autograd.grad(full, logprobs)

    processes = [[torch.tensor([0, 1]), torch.tensor([2, 3])], [torch.tensor([4]), torch.tensor([5, 6, 7])]]
    parts = [(rows, *token_losses(rows)) for micro_batches in processes for rows in micro_batches]
    n = sum(
        loss_normaliser(loss_mask=m, aggregation=aggregation, max_new_tokens=max_new_tokens)
        for _, _, m in parts
    )
    assert n.item() == n_full.item()
    process_grads, total = [], 0.0
    for micro_batches in processes:
        grad = torch.zeros_like(logprobs)
        for rows in micro_batches:
            losses, m = token_losses(rows)
            part = aggregate_loss(token_losses=losses, loss_mask=m, aggregation=aggregation, normaliser=n)
            (g,) = torch.autograd.grad(part * len(processes), logprobs)
            grad += g
            total = total + part.detach()
        process_grads.append(grad)
    ddp_grad = torch.stack(process_grads).mean(0)  # DDP's all-reduce: the mean over processes
    torch.testing.assert_close(total, full.detach(), **TIGHT)
    torch.testing.assert_close(ddp_grad, full_grad, **TIGHT)
    assert full_grad.abs().sum() > 0


def test_token_sum_norm_counts_max_new_tokens_not_the_trimmed_width():
    mask = torch.tensor([[True, True], [True, False]])  # a rollout trimmed to width 2 of L = 4
    assert loss_normaliser(loss_mask=mask, aggregation="token_sum_norm", max_new_tokens=4).item() == 8
    assert loss_normaliser(loss_mask=mask, aggregation="token_mean", max_new_tokens=4).item() == 3
    assert loss_normaliser(loss_mask=mask, aggregation="seq_mean_token_mean", max_new_tokens=4).item() == 2


def test_aggregation_of_nothing_is_zero_and_unknown_mode_raises():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    losses = torch.ones(2, 3)
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        n = loss_normaliser(loss_mask=mask, aggregation=aggregation, max_new_tokens=3)
        assert (
            aggregate_loss(token_losses=losses, loss_mask=mask, aggregation=aggregation, normaliser=n).item()
            == 0
        )
    with pytest.raises(ValueError, match="unknown loss aggregation 'token_sum'"):
        loss_normaliser(loss_mask=mask, aggregation="token_sum", max_new_tokens=3)
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq_mean'"):
        aggregate_loss(token_losses=losses, loss_mask=mask, aggregation="seq_mean", normaliser=1)


# ----------------------------------------------------------------------------------------------
# GSPO
# ----------------------------------------------------------------------------------------------


def gspo(logprobs, advantages=ADVANTAGES, mask=MASK, **eps):
    return gspo_token_losses(
        logprobs=logprobs,
        old_logprobs=torch.zeros_like(logprobs),
        advantages=advantages,
        response_mask=mask,
        **eps,
    )


def naive_gspo(logprobs, old, seq_advantages, mask, eps_low, eps_high):
    """GSPO's sequence objective by autograd straight through s_i = exp(mean_t log rho_t), a loop over the
    responses: mean_i max(-A_i s_i, -A_i clip(s_i))."""
    losses = []
    for b in range(logprobs.shape[0]):
        log_rho = (logprobs[b] - old[b])[mask[b]]
        s = torch.exp(log_rho.mean())
        a = seq_advantages[b]
        losses.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - eps_low, 1 + eps_high)))
    return torch.stack(losses).mean()


def test_worked_example_gspo():
    logprobs = example_logprobs()
    losses, stats = gspo(logprobs)  # the paper's clip range is the default: 3e-4 below, 4e-4 above
    s = stats.ratio[:, 0]
    example_digits(s, [1.0816654, 0.9904902], [7, 7])
    torch.testing.assert_close(s, t64([math.sqrt(1.3 * 0.9), (1.1 * 0.7 * 1.0 * 1.25) ** 0.25]), **TIGHT)
    torch.testing.assert_close(losses, t64([[-1.0004, -1.0004, 0, 0], [0.49985] * 4]), **TIGHT)
    assert stats.clipped_high.tolist() == [[True, True, False, False], [False] * 4]
    assert stats.clipped_low.tolist() == [[False] * 4, [True] * 4]
    n = loss_normaliser(loss_mask=MASK, aggregation="seq_mean_token_mean", max_new_tokens=L)
    loss = aggregate_loss(
        token_losses=losses, loss_mask=MASK, aggregation="seq_mean_token_mean", normaliser=n
    )
    torch.testing.assert_close(loss, t64(-0.250275), **TIGHT)  # the mean over responses
    naive = naive_gspo(logprobs, torch.zeros_like(logprobs), [1.0, -0.5], MASK, 3e-4, 4e-4)
    torch.testing.assert_close(loss, naive, **TIGHT)
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))  # both responses clipped: no gradient


def test_gspo_gradient_flows_through_the_sequence_ratio():
    """Unclipped (a wide range), the token form's gradient is the sequence objective's: on token t of
    response i, d loss / d log pi(y_t) = -A_i * s_i / (G * |y_i|), the same as autograd through s_i."""
    logprobs = example_logprobs()
    losses, stats = gspo(logprobs, cliprange_low=0.5, cliprange_high=0.5)
    assert not stats.clipped.any()
    n = loss_normaliser(loss_mask=MASK, aggregation="seq_mean_token_mean", max_new_tokens=L)
    loss = aggregate_loss(
        token_losses=losses, loss_mask=MASK, aggregation="seq_mean_token_mean", normaliser=n
    )
    loss.backward()
    s_a, s_b = math.sqrt(1.3 * 0.9), (1.1 * 0.7 * 1.25) ** 0.25
    expected = t64([[-1.0 * s_a / (2 * 2)] * 2 + [0, 0], [0.5 * s_b / (2 * 4)] * 4])
    torch.testing.assert_close(logprobs.grad, expected, **TIGHT)

    naive_logprobs = example_logprobs()
    naive = naive_gspo(naive_logprobs, torch.zeros_like(naive_logprobs), [1.0, -0.5], MASK, 0.5, 0.5)
    naive.backward()
    torch.testing.assert_close(loss, naive, **TIGHT)
    torch.testing.assert_close(logprobs.grad, naive_logprobs.grad, **TIGHT)


def test_gspo_matches_naive_autograd_on_random_responses():
    logprobs, old, advantages, mask = varied_minibatch(4)
    seq_advantages = advantages[:, 0]  # the per-response A: every response starts at position 0
    losses, stats = gspo_token_losses(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=advantages,
        response_mask=mask,
        cliprange_low=0.05,
        cliprange_high=0.08,
    )
    assert stats.clipped.any() and (mask & ~stats.clipped).any()  # some responses clipped, some not
    n = loss_normaliser(loss_mask=mask, aggregation="seq_mean_token_mean", max_new_tokens=6)
    loss = aggregate_loss(
        token_losses=losses, loss_mask=mask, aggregation="seq_mean_token_mean", normaliser=n
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    kept = mask.any(-1)
    naive_lp = logprobs.detach().clone().requires_grad_()
    naive = naive_gspo(naive_lp[kept], old[kept], seq_advantages[kept].tolist(), mask[kept], 0.05, 0.08)
    (naive_grad,) = torch.autograd.grad(naive, naive_lp)
    torch.testing.assert_close(loss, naive, **TIGHT)
    torch.testing.assert_close(grad, naive_grad, **TIGHT)
    # a clipped response's tokens get no gradient; an unclipped one's all do
    assert (grad[stats.clipped] == 0).all() and (grad[mask & ~stats.clipped] != 0).all()


# ----------------------------------------------------------------------------------------------
# CISPO
# ----------------------------------------------------------------------------------------------


def test_worked_example_cispo():
    logprobs = example_logprobs()
    losses, stats = cispo_token_losses(
        logprobs=logprobs,
        old_logprobs=torch.zeros_like(logprobs),
        advantages=ADVANTAGES,
        response_mask=MASK,
        cliprange_high=0.28,
    )
    n = loss_normaliser(loss_mask=MASK, aggregation="token_mean", max_new_tokens=L)
    aggregate_loss(token_losses=losses, loss_mask=MASK, aggregation="token_mean", normaliser=n).backward()
    grad = logprobs.grad
    example_digits(grad[0, :2], [-0.21333, -0.15], [5, 2])
    example_digits(grad[1], [0.091667, 0.058333, 0.083333, 0.104167], [6, 6, 6, 6])
    # exactly -sg(min(rho, 1.28)) * A / 6: every token keeps a gradient, a1's weight truncated at 1.28
    expected = t64([[-1.28 / 6, -0.9 / 6, 0, 0], [0.55 / 6, 0.35 / 6, 0.5 / 6, 0.625 / 6]])
    torch.testing.assert_close(grad, expected, **TIGHT)
    assert (grad[MASK] != 0).all()
    assert stats.clipped_high.tolist() == [[True, False, False, False], [False] * 4]
    assert not stats.clipped_low.any()


def test_cispo_matches_the_naive_loop_and_keeps_every_gradient():
    logprobs, old, advantages, mask = varied_minibatch(5)
    losses, stats = cispo_token_losses(
        logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, cliprange_high=0.1
    )
    (grad,) = torch.autograd.grad(losses.sum(), logprobs)
    B, T = mask.shape
    expected_losses, expected_grad = torch.zeros(B, T, dtype=F64), torch.zeros(B, T, dtype=F64)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                w = min(math.exp(logprobs[b, t].item() - old[b, t].item()), 1.1)
                expected_losses[b, t] = -w * advantages[b, t].item() * logprobs[b, t].item()
                expected_grad[b, t] = -w * advantages[b, t].item()
    torch.testing.assert_close(losses, expected_losses, **TIGHT)
    torch.testing.assert_close(grad, expected_grad, **TIGHT)
    assert stats.clipped_high.any()  # some weights truncated, and their tokens still have a gradient
    assert (grad[stats.clipped_high] != 0).all()


# ----------------------------------------------------------------------------------------------
# SAPO
# ----------------------------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def naive_sapo(rho: float, a: float, tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple[float, float]:
    """One token's SAPO loss and d loss / d log pi by hand, in python floats: l = -(4/tau) sigmoid(tau (rho -
    1)) A; with rho = exp(log pi - log pi_old), d rho / d log pi = rho and d sigmoid(x) / dx = s (1 - s), so
    d l / d log pi = -A * rho * 4 s (1 - s)."""
    tau = tau_pos if a > 0 else tau_neg
    s = sigmoid(tau * (rho - 1.0))
    return -(4.0 / tau) * s * a, -a * rho * 4.0 * s * (1.0 - s)


def sapo(ratios, advantages, mask=None):
    """`sapo_token_losses` with log pi_old = 0 (rho = exp(logprobs)): (losses, stats, d sum(losses) / d log pi)."""
    logprobs = t64(ratios).log().requires_grad_()
    mask = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask
    losses, stats = sapo_token_losses(
        logprobs=logprobs,
        old_logprobs=torch.zeros_like(logprobs),
        advantages=t64(advantages),
        response_mask=mask,
    )
    (grad,) = torch.autograd.grad(losses.sum(), logprobs)
    return losses, stats, grad


def test_worked_example_sapo():
    """Worked example: rho = (1.2, 0.9, 1.0), A = (1.0, -0.5, 2.0) -> losses (-2.199336, 0.902427, -4.0), d loss / d log
    pi = (-1.188080, 0.448762, -2.0) (PPO's clip at 0.2: -1.2, 0.45, -2.0)."""
    losses, stats, grad = sapo([1.2, 0.9, 1.0], [1.0, -0.5, 2.0])
    example_digits(losses, [-2.199336, 0.902427, -4.0], [6, 6, 6])
    example_digits(grad, [-1.188080, 0.448762, -2.0], [6, 6, 6])
    # by hand: a1 tau_pos = 1: -4 sigmoid(0.2); a2 tau_neg = 1.05: (4 / 1.05) sigmoid(-0.105) * 0.5
    s1, s2 = sigmoid(0.2), sigmoid(1.05 * -0.1)
    torch.testing.assert_close(losses, t64([-4.0 * s1, 0.5 * (4.0 / 1.05) * s2, -4.0]), **TIGHT)
    expected_grad = [-1.2 * 4 * s1 * (1 - s1), 0.5 * 0.9 * 4 * s2 * (1 - s2), -2.0 * 1.0 * 4 * 0.25]
    torch.testing.assert_close(grad, t64(expected_grad), **TIGHT)
    assert not (stats.clipped_high | stats.clipped_low | stats.dual_clipped).any()  # no hard clip
    # PPO's clip at 0.2 on the same tokens, for the comparison the worked example prints
    ppo_lp = t64([1.2, 0.9, 1.0]).log().requires_grad_()
    ppo, _ = ppo_clip_token_losses(
        logprobs=ppo_lp,
        old_logprobs=torch.zeros(3, dtype=F64),
        advantages=t64([1.0, -0.5, 2.0]),
        response_mask=torch.ones(3, dtype=torch.bool),
        cliprange_low=0.2,
        cliprange_high=0.2,
    )
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), ppo_lp)
    torch.testing.assert_close(ppo_grad, t64([-1.2, 0.45, -2.0]), **TIGHT)


def test_sapo_fades_off_policy_where_ppo_stops():
    """Worked example: far off-policy with A = 1, rho = 2 -> gradient -1.572895, rho = 3 -> -1.259923, where PPO's clip
    gives 0; at rho = 1 the gradient is the plain policy gradient -A whatever the sign and tau."""
    _, _, grad = sapo([2.0, 3.0], [1.0, 1.0])
    example_digits(grad, [-1.572895, -1.259923], [6, 6])
    s2, s3 = sigmoid(1.0), sigmoid(2.0)
    torch.testing.assert_close(grad, t64([-2.0 * 4 * s2 * (1 - s2), -3.0 * 4 * s3 * (1 - s3)]), **TIGHT)
    _, _, at_one = sapo([1.0, 1.0, 1.0], [1.0, -0.5, 3.0])
    torch.testing.assert_close(at_one, t64([-1.0, 0.5, -3.0]), **TIGHT)


def test_sapo_matches_the_naive_loop_with_each_sides_temperature():
    """Random ratios, advantages of both signs and a mask: every token's loss and gradient are the hand
    formula's with tau_pos where A > 0 and tau_neg elsewhere; the padding gets neither."""
    logprobs, old, advantages, mask = varied_minibatch(7)
    losses, stats = sapo_token_losses(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=advantages,
        response_mask=mask,
        tau_pos=0.7,
        tau_neg=1.3,
    )
    (grad,) = torch.autograd.grad(losses.sum(), logprobs)
    B, T = mask.shape
    expected_losses, expected_grad = torch.zeros(B, T, dtype=F64), torch.zeros(B, T, dtype=F64)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                rho = math.exp(logprobs[b, t].item() - old[b, t].item())
                loss, g = naive_sapo(rho, advantages[b, t].item(), tau_pos=0.7, tau_neg=1.3)
                expected_losses[b, t], expected_grad[b, t] = loss, g
    assert (advantages[mask] > 0).any() and (advantages[mask] < 0).any()
    torch.testing.assert_close(losses, expected_losses, **TIGHT)
    torch.testing.assert_close(grad, expected_grad, **TIGHT)
    torch.testing.assert_close(stats.ratio[mask], torch.exp(logprobs - old).detach()[mask], **TIGHT)


# ----------------------------------------------------------------------------------------------
# Sampler correction
# ----------------------------------------------------------------------------------------------


def correction(kind, d, cap=2.0, mask=None):
    d = t64([d])
    mask = torch.ones_like(d, dtype=torch.bool) if mask is None else mask
    return sampler_correction_weights(
        old_logprobs=d - 1.0,
        sampler_logprobs=torch.full_like(d, -1.0),
        response_mask=mask,
        correction=kind,
        cap=cap,
    )


def test_worked_example_sampler_correction():
    tis, tis_stats = correction("tis", [0.1, -0.2, 0.9])
    example_digits(tis[0], [1.10517, 0.81873, 2.0], [5, 5, 1])
    torch.testing.assert_close(tis, t64([[math.exp(0.1), math.exp(-0.2), 2.0]]), **TIGHT)
    assert tis_stats.corrected.tolist() == [[False, False, True]]
    torch.testing.assert_close(
        tis_stats.mean_weight, t64((math.exp(0.1) + math.exp(-0.2) + 2.0) / 3), **TIGHT
    )
    torch.testing.assert_close(tis_stats.corrected_frac, t64(1 / 3), **TIGHT)

    mis, mis_stats = correction("mis", [0.1, -0.2, 0.9])
    assert mis.tolist() == [[1.0, 1.0, 0.0]]
    assert mis_stats.corrected.tolist() == [[False, False, True]]
    torch.testing.assert_close(mis_stats.mean_weight, t64(2 / 3), **TIGHT)
    torch.testing.assert_close(mis_stats.corrected_frac, t64(1 / 3), **TIGHT)


def test_sampler_correction_bounds_mask_and_naive_loop():
    d = [-1.0, -0.5, 0.0, 0.5, 1.0, 30.0, math.nan]
    mask = torch.tensor([[True] * 6 + [False]])  # the padding's nan never reaches a weight
    cap = 2.0
    tis, tis_stats = correction("tis", d, cap, mask)
    mis, mis_stats = correction("mis", d, cap, mask)
    expected_tis = [min(math.exp(x), cap) for x in d[:6]] + [0.0]
    expected_mis = [1.0 if 1 / cap <= math.exp(x) <= cap else 0.0 for x in d[:6]] + [0.0]
    torch.testing.assert_close(tis, t64([expected_tis]), **TIGHT)
    assert mis.tolist() == [expected_mis] == [[0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]]
    assert tis_stats.corrected.tolist() == [[False, False, False, False, True, True, False]]
    assert mis_stats.corrected.tolist() == [[True, False, False, False, True, True, False]]
    torch.testing.assert_close(mis_stats.corrected_frac, t64(3 / 6), **TIGHT)
    # the weights carry no gradient: the sampler and the old policy are fixed during the update
    assert not tis.requires_grad and not mis.requires_grad


def test_sampler_correction_weights_the_token_losses_without_gradient():
    logprobs = example_logprobs()
    losses, _ = clip_higher(logprobs)
    sampler = torch.zeros(2, 4, dtype=F64)
    old = t64([[0.1, -0.2, 0, 0], [0.9, 0.0, 0.0, 0.0]])
    weights, _ = sampler_correction_weights(
        old_logprobs=old, sampler_logprobs=sampler, response_mask=MASK, correction="tis", cap=2.0
    )
    (losses * weights).sum().backward()
    w = t64([[math.exp(0.1), math.exp(-0.2), 0, 0], [2.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(logprobs.grad, w * t64([[0, -0.9, 0, 0], [0.55, 0, 0.5, 0.625]]), **TIGHT)


@pytest.mark.parametrize("cap", [0.5, 0.999])
def test_sampler_correction_cap_below_one_raises(cap):
    with pytest.raises(ValueError, match="cap must be >= 1"):
        correction("tis", [0.0], cap)
    with pytest.raises(ValueError, match="unknown sampler correction 'is'"):
        correction("is", [0.0], 2.0)


# ----------------------------------------------------------------------------------------------
# Overlong shaping and masking truncated responses
# ----------------------------------------------------------------------------------------------


def naive_overlong(length, truncated, max_new_tokens, buffer, penalty):
    if truncated:
        return -penalty
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * (length - start) / buffer


def test_worked_example_overlong_shaping():
    lengths = torch.tensor([5, 16, 18, 20, 20])
    truncated = torch.tensor([False, False, False, False, True])  # the last has no EOS
    penalty = overlong_penalty(lengths=lengths, truncated=truncated, max_new_tokens=20, overlong_buffer=4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]), rtol=0, atol=0)


@pytest.mark.parametrize(("buffer", "coef"), [(4, 1.0), (7, 0.3), (0, 2.0), (20, 1.0)])
def test_overlong_penalty_matches_the_naive_loop(buffer, coef):
    lengths = torch.arange(0, 21).repeat(2)
    truncated = torch.tensor([False] * 21 + [True] * 21)
    penalty = overlong_penalty(
        lengths=lengths, truncated=truncated, max_new_tokens=20, overlong_buffer=buffer, penalty=coef
    )
    expected = [naive_overlong(int(n), bool(t), 20, buffer, coef) for n, t in zip(lengths, truncated)]
    torch.testing.assert_close(penalty, torch.tensor(expected), rtol=0, atol=1e-7)


@pytest.mark.parametrize("buffer", [-1, 21])
def test_overlong_buffer_out_of_range_raises(buffer):
    with pytest.raises(ValueError, match="overlong_buffer must be in"):
        overlong_penalty(
            lengths=torch.tensor([3]),
            truncated=torch.tensor([False]),
            max_new_tokens=20,
            overlong_buffer=buffer,
        )


def test_mask_truncated_drops_whole_responses_from_the_loss():
    mask = torch.tensor([[True, True, True, True], [True, True, False, False], [True, True, True, True]])
    truncated = torch.tensor([True, False, False])
    loss_mask = mask_truncated(response_mask=mask, truncated=truncated)
    assert loss_mask.tolist() == [[False] * 4, [True, True, False, False], [True] * 4]
    # the masked response leaves the token and sequence counts, not the constant B * L
    assert loss_normaliser(loss_mask=loss_mask, aggregation="token_mean", max_new_tokens=4).item() == 6
    assert (
        loss_normaliser(loss_mask=loss_mask, aggregation="seq_mean_token_mean", max_new_tokens=4).item() == 2
    )
    assert loss_normaliser(loss_mask=loss_mask, aggregation="token_sum_norm", max_new_tokens=4).item() == 12
    # and gets no gradient
    logprobs = torch.zeros(3, 4, dtype=F64, requires_grad=True)
    losses, _ = cispo_token_losses(
        logprobs=logprobs,
        old_logprobs=torch.zeros(3, 4, dtype=F64),
        advantages=torch.ones(3, 4, dtype=F64),
        response_mask=loss_mask,
        cliprange_high=0.28,
    )
    aggregate_loss(
        token_losses=losses, loss_mask=loss_mask, aggregation="token_mean", normaliser=6
    ).backward()
    assert (logprobs.grad[0] == 0).all() and (logprobs.grad[1:][loss_mask[1:]] != 0).all()


@pytest.mark.parametrize("row", LOSS_ROWS, ids=lambda r: r.name)
def test_token_losses_and_flags_are_zero_off_the_mask(row):
    """Padding with wild ratios and advantages reaches neither a loss, a flag nor a gradient."""
    logprobs, old, advantages, mask = varied_minibatch(6)
    wild = torch.where(mask, logprobs, 50.0)  # rho = e^50 at the padding
    wild_advantages = torch.where(mask, advantages, -7.0)
    losses, stats = row.token_losses(
        LossInputs(
            logprobs=wild,
            old_logprobs=old,
            advantages=wild_advantages,
            response_mask=mask,
            cliprange_low=0.2,
            cliprange_high=0.28,
            dual_clip=3.0,
        )
    )
    assert (losses[~mask] == 0).all() and losses.isfinite().all()
    assert not (stats.clipped_high | stats.clipped_low | stats.dual_clipped)[~mask].any()
    (grad,) = torch.autograd.grad(losses.sum(), logprobs)
    assert (grad[~mask] == 0).all()
