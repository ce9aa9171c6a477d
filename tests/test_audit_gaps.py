"""The audit's test gaps (issue 36, item 7): each test here fails on a named mutation of the code that every
other fast test let through.

    KL in the loss           the raw gradient of a step whose groups are all tied is beta * grad mean_t k3,
                             against the reference (not the old policy) and not detached
    data-parallel prompts    two ranks draw different prompts whose union is one process's (`next_queries`)
    micro-batches            the token mean is over the whole minibatch for a critic-free estimator with the
                             KL in the loss; REINFORCE++ whitens over the global batch, not per micro-batch
                             nor per process
    k3                       not clamped, and its expected gradient is that of KL(pi_ref || pi_theta)
    `llm-rlhf eval`          with several samples per prompt, win rates and standard errors over the prompts

Two data-parallel ranks are simulated in one process where the code reads only the rank
(`accelerator.process_index`) or sums over the ranks (`accelerator.reduce`): the real methods run, the
stand-in accelerator gives them the rank, or the sum over two threads that play the two ranks.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    SENTENCES,
    approx_numbers,
    build_model,
    eval_config,
    ppo_config,
    record_raw_grads,
    recording_rollouts,
    tiny_ppo_trainer,
    use_fixed_responses,
    write_jsonl,
)

from llm_rlhf.evaluation import measures
from llm_rlhf.models.loading import load_causal_lm
from llm_rlhf.ppo.config import batch_sizes
from llm_rlhf.rl import ppo_math
from llm_rlhf.stages import evaluate


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Move every parameter by scale * N(0, 1) noise (seeded): the policy off its reference."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def row_tokens(rollout, b: int) -> tuple[list[int], list[int]]:
    """Row b's real query and response tokens (no padding)."""
    query = rollout.query[b][rollout.query_mask[b].bool()].tolist()
    response = rollout.response[b][rollout.response_mask[b]].tolist()
    return query, response


def response_logprobs_alone(lm, query: list[int], response: list[int]) -> torch.Tensor:
    """log p(y_t | x, y_<t) of each response token, the row alone (no padding), at temperature 1. (T,)"""
    ids = torch.tensor([query + response])
    logits = lm(input_ids=ids).logits[0, len(query) - 1 : -1]  # (T, V): position t predicts response token t
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


# --- KL in the loss ----------------------------------------------------------------------------------------


def test_kl_in_the_loss_gradient_is_beta_times_the_gradient_of_token_mean_k3(
    tiny_model_dir, prompt_file, tmp_path
):
    """grpo with its KL in the loss and a constant score (every group tied: every advantage 0, the policy loss
    has zero gradient), the policy moved off the reference: the raw gradient of the one update (before
    clipping) is beta * grad of the token mean of k3 over the minibatch, computed here row by row with the
    reference loaded again from its folder, and it is not zero. Fails if k3 is detached (zero gradient) or
    taken against the old policy (zero at the first epoch, where the policy is the old one)."""
    beta = 0.5
    cfg = ppo_config(tiny_model_dir, None, prompt_file, tmp_path, reward_fn="reward_fns:half",
                     advantage_estimator="grpo", samples_per_prompt=4, rollout_batch_size=2, mini_batch_size=8,
                     ppo_epochs=1, steps=1, kl_controller="fixed", init_kl_coef=beta, max_grad_norm=1e9)  # fmt: skip
    assert cfg.kl_penalty_in_loss
    trainer = tiny_ppo_trainer(cfg)
    perturb(trainer.unwrapped_policy, seed=0)
    before = copy.deepcopy(trainer.unwrapped_policy)  # the weights the update's gradient is taken at
    rollouts, raw = recording_rollouts(trainer), []
    record_raw_grads(trainer, raw)
    metrics = trainer.ppo_step()
    assert metrics["objective/groups_tied"] == 1.0 and metrics["loss/kl"] > 0
    assert len(raw) == 1, "one optimiser step"

    rollout, reference = rollouts[0], load_causal_lm(str(tiny_model_dir)).eval()
    k3_sum, tokens = 0.0, int(rollout.response_mask.sum())
    for b in range(rollout.query.shape[0]):
        query, response = row_tokens(rollout, b)
        logp = response_logprobs_alone(before.lm, query, response)  # (T,) with grad
        with torch.no_grad():
            ref = response_logprobs_alone(reference, query, response)  # (T,)
        k3_sum = k3_sum + (torch.exp(ref - logp) - (ref - logp) - 1).sum()
    (beta * k3_sum / tokens).backward()
    expected = torch.cat([p.grad.flatten() for p in before.parameters() if p.requires_grad])
    assert expected.abs().max() > 1e-4 and raw[0].abs().max() > 1e-4
    torch.testing.assert_close(raw[0], expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4)


# --- the data-parallel prompt layout -------------------------------------------------------------------------


def test_two_ranks_draw_different_prompts_whose_union_is_one_process_prompts(tiny_model_dir, tmp_path):
    """18 distinct prompts, 6 per step: one process draws them 6 at a time; two ranks of 3 prompts each, the
    same run on 2 processes (`batch_sizes` with num_processes 2, the rank given to `next_queries` as
    `accelerator.process_index`), draw different prompts at every step, rank 0's then rank 1's being the one
    process's 6, and the 3 steps of the first pass over the data hold every prompt once. Fails if every
    rank gets the same prompts."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}: {SENTENCES[i % 10]}"} for i in range(18)])

    def trainer_for(rollout_batch_size: int, num_processes: int):
        cfg = ppo_config(tiny_model_dir, None, prompts, tmp_path, reward_fn="reward_fns:half",
                         rollout_batch_size=rollout_batch_size, mini_batch_size=rollout_batch_size, seed=3)  # fmt: skip
        trainer = tiny_ppo_trainer(cfg)
        trainer.context.sizes = batch_sizes(rollout_batch_size=rollout_batch_size, mini_batch_size=rollout_batch_size,
                                        gradient_accumulation_steps=1, ppo_epochs=cfg.ppo_epochs, steps=cfg.steps,
                                        num_processes=num_processes)  # fmt: skip
        return trainer

    one, ranks = trainer_for(6, 1), trainer_for(3, 2)
    assert ranks.sizes.prompts_per_step == one.sizes.prompts_per_step == 6
    real_accelerator, seen = ranks.accelerator, []
    for step in range(4):  # step 3 starts the second pass, in another order
        drawn = []
        for rank in (0, 1):
            ranks.context.accelerator = SimpleNamespace(process_index=rank)
            drawn.append(ranks.collector.queries(step))
        ranks.context.accelerator = real_accelerator
        assert len(drawn[0]) == len(drawn[1]) == 3
        assert not set(map(tuple, drawn[0])) & set(map(tuple, drawn[1])), (
            f"step {step}: the ranks share a prompt"
        )
        assert drawn[0] + drawn[1] == one.collector.queries(step), step
        if step < 3:
            seen += drawn[0] + drawn[1]
    assert sorted(seen) == sorted(one.collector.prompts), "the first pass holds every prompt once"


# --- micro-batches and the global batch ----------------------------------------------------------------------


def test_critic_free_token_mean_is_over_the_minibatch_not_per_micro_batch(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """A grpo step with the KL in the loss, responses of 2 to 8 tokens (`use_fixed_responses`) and the policy
    moved off the reference (the policy loss and the KL loss both have gradients): one minibatch of 8 and 8
    accumulated micro-batches of 1 give the same raw gradient. Fails if each micro-batch's mean is averaged
    instead of weighted by its share of the minibatch's tokens."""
    grads = []
    for ga in (1, 8):
        cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / str(ga), advantage_estimator="grpo",
                         samples_per_prompt=2, rollout_batch_size=4, mini_batch_size=8, gradient_accumulation_steps=ga,
                         ppo_epochs=1, max_grad_norm=1e9, kl_controller="fixed", init_kl_coef=0.5)  # fmt: skip
        trainer, raw = tiny_ppo_trainer(cfg), []
        use_fixed_responses(trainer)
        perturb(trainer.unwrapped_policy, seed=1)
        record_raw_grads(trainer, raw)
        metrics = trainer.ppo_step()
        assert len(raw) == 1 and metrics["loss/kl"] > 0
        grads.append(raw[0])
    assert grads[0].abs().max() > 1e-4
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6 * float(grads[0].abs().max()), rtol=1e-4)


def reinforce_pp_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, **kw):
    """reinforce_pp, 4 prompts x 2 samples, one minibatch of 8 in 4 micro-batches, the KL in the reward."""
    return ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, advantage_estimator="reinforce_pp",
                      samples_per_prompt=2, rollout_batch_size=4, mini_batch_size=8, gradient_accumulation_steps=4,
                      ppo_epochs=1, kl_controller="fixed", init_kl_coef=0.5, **kw)  # fmt: skip


def naive_reinforce_pp(rollout, beta: float) -> torch.Tensor:
    """The SPEC's REINFORCE++ advantages written out: per-token rewards -beta * k1 and the score at the last
    token, gamma = 1 returns row by row, whitened (mean, unbiased std) over every response token of the
    batch. (B, R) float64, 0 at padding."""
    mask = rollout.response_mask
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        tokens = mask[b].nonzero().flatten().tolist()
        running = 0.0
        for t in reversed(tokens):
            reward = -beta * float(rollout.logprobs[b, t] - rollout.ref_logprobs[b, t])
            running += reward + (float(rollout.scores[b]) if t == tokens[-1] else 0.0)
            returns[b, t] = running
    values = returns[mask]
    out = torch.zeros_like(returns)
    out[mask] = (values - values.mean()) / values.std()
    return out


def test_reinforce_pp_whitens_over_the_minibatch_not_per_micro_batch(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """The advantages the policy loss gets, micro-batch by micro-batch (4 of 2 rows, responses of different
    lengths), are the whole rollout's returns whitened together. Fails if each micro-batch is whitened alone."""
    trainer = tiny_ppo_trainer(reinforce_pp_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path))
    use_fixed_responses(trainer)
    rollouts, given, policy_loss = recording_rollouts(trainer), [], ppo_math.policy_loss

    def recording(**kw):
        given.append(kw["advantages"].detach())
        return policy_loss(**kw)

    monkeypatch.setattr(ppo_math, "policy_loss", recording)
    trainer.ppo_step()
    assert len(given) == 4, "4 micro-batches, the first epoch in rollout order"
    rollout = rollouts[0]
    assert len(set(rollout.response_mask.sum(-1).tolist())) > 1, "responses of different lengths"
    expected = naive_reinforce_pp(rollout, beta=0.5)
    torch.testing.assert_close(torch.cat(given).double(), expected, atol=1e-5, rtol=1e-5)


class TwoThreadSum:
    """`accelerator.reduce(x, "sum")` of two data-parallel ranks played by two threads: each call waits for
    the other rank's call and returns the sum of both tensors (as an all-reduce does)."""

    num_processes = 2

    def __init__(self, device):
        self.device, self.barrier, self.parts = device, threading.Barrier(2, timeout=60), []

    def reduce(self, x: torch.Tensor, reduction: str) -> torch.Tensor:
        assert reduction == "sum"
        self.parts.append(x)
        self.barrier.wait()
        total = self.parts[0] + self.parts[1]
        if self.barrier.wait() == 0:  # both have read the parts: one thread clears them for the next call
            self.parts.clear()
        self.barrier.wait()
        return total


def test_reinforce_pp_whitens_over_every_process(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """The rollout cut into two ranks of 2 prompts x 2 samples (whole groups), each rank's advantages made by
    the real `advantages` with the ranks' sums all-reduced (two threads): together they are the one process's
    advantages of the whole rollout, and differ from each half whitened alone. Fails if REINFORCE++ whitens
    per process."""
    trainer = tiny_ppo_trainer(reinforce_pp_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path))
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    rewards, _ = trainer.rewards(rollout, 0.5)
    whole, _ = trainer.advantages(rollout, rewards)  # one process
    torch.testing.assert_close(whole.double(), naive_reinforce_pp(rollout, beta=0.5), atol=1e-5, rtol=1e-5)

    halves = [torch.arange(0, 4), torch.arange(4, 8)]
    real_accelerator, out, errors = trainer.accelerator, [None, None], []
    trainer.context.accelerator = TwoThreadSum(trainer.device)

    def rank(r: int) -> None:
        try:
            out[r] = trainer.advantages(rollout.select(halves[r]), rewards[halves[r]])[0]
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)
            trainer.accelerator.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trainer.context.accelerator = real_accelerator
    assert not errors, errors
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-6, rtol=1e-5)
    alone = trainer.advantages(rollout.select(halves[0]), rewards[halves[0]])[0]
    assert not torch.allclose(alone, whole[halves[0]], atol=1e-3), "whitened alone, a half differs"


# --- k3 in the loss ------------------------------------------------------------------------------------------


def test_k3_in_the_loss_is_not_clamped():
    """A token the reference gives e^5 times the policy's probability: k3 = e^5 - 5 - 1 ~ 142.4 (past verl's
    and OpenRLHF's clamp at 10) and its gradient 1 - e^5 per unit of log p, in full (README glossary, k3: why
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
    gradient (k2 in the loss would give that one). The two agree to first order as p -> q. README glossary, k3."""
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


# --- llm-rlhf eval with several samples per prompt ----------------------------------------------------------


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny_gpt2_other"), "gpt2", seed=1)


def over_prompts(values: list[float], k: int) -> tuple[float, float]:
    """Mean of every value, and sd / sqrt(n) over the n prompts' means (k consecutive values per prompt)."""
    means = [statistics.fmean(values[i : i + k]) for i in range(0, len(values), k)]
    return statistics.fmean(values), statistics.stdev(means) / math.sqrt(len(means))


def test_eval_win_rates_and_standard_errors_are_over_prompts(
    tiny_model_dir, other_model_dir, prompt_file, tmp_path
):
    """12 prompts x 3 samples: every win rate is the mean of the win points (1, 1/2, 0) of the 36 pairs, and
    its stderr and every score's stderr is the one over the 12 prompts' means, read back from samples.jsonl
    (a prompt's samples share the prompt: not independent draws), as for accuracy. Fails if a stderr is
    taken over the samples."""
    k, out = 3, tmp_path / "eval"
    metrics = evaluate.run(
        eval_config(other_model_dir, tiny_model_dir, prompt_file, out, samples_per_prompt=k,
                    reward_fn="reward_fns:length")
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 36 and [r["sample"] for r in rows[:4]] == [0, 1, 2, 0]
    for key in ("gold_score", "reward_fn", "combined_score"):  # sentiment: measured with a fluency gold only
        a, b = [r[f"policy_{key}"] for r in rows], [r[f"baseline_{key}"] for r in rows]
        points = measures.win_points(a, b)
        name = key.removesuffix("_score")
        mean, stderr = over_prompts(points, k)
        assert metrics[f"{name}_win_rate"] == pytest.approx(mean), key
        assert metrics[f"{name}_win_rate_stderr"] == pytest.approx(stderr), key
        assert stderr != pytest.approx(statistics.stdev(points) / 6), f"{key}: not over the samples"
    for key in ("gold_score", "reward_fn", "combined_score", "kl_to_ref"):
        for who, suffix in (("policy", ""), ("baseline", "_baseline")):
            mean, stderr = over_prompts([r[f"{who}_{key}"] for r in rows], k)
            assert metrics[(key if key == "kl_to_ref" else f"{key}_mean") + suffix] == pytest.approx(mean)
            assert metrics[f"{key}_stderr{suffix}"] == pytest.approx(stderr, abs=1e-12), (key, who)
    assert json.loads((out / "metrics.json").read_text()) == approx_numbers(metrics)
