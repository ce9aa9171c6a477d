"""The loss family's sharp edges (issue 50): each test fails on a named mutation that every other fast test
let through (the audit of issue 50: 27 mutations, 6 survivors).

    sampler correction      the trainer's raw gradient under TIS / MIS is that of the token losses times the
                            weights detached (mutation: a weight that carries gradient, w * exp(lp - sg(lp)))
    dynamic sampling ties   on the scorer's raw scores, not on the overlong or the EOS penalty (mutation: tie on
                            the shaped scores the rewards hold), and on the verifier's verdicts where there is
                            one (accuracy_fn)
    the KL of every group   objective/kl and the adaptive controller read the KL of every sampled group, the
                            dropped ones' too
    two ranks, one process  the global normaliser of every aggregation (mutations: N not all-reduced; the
                            policy loss's share not multiplied by the processes DDP averages over) and the
                            rounds of dynamic sampling (mutation: a process stops on its own untied count)

Two data-parallel ranks are simulated in one process, as in tests/test_audit_gaps.py: one trainer per rank
(the same initial weights), two threads, and a stand-in accelerator whose `reduce` is the all-reduce of the
two threads' tensors; everything else is the trainer's real code.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, ppo_config, record_raw_grads, tiny_ppo_trainer, use_fixed_responses

from llm_rlhf.models.reward_fn import decode_texts
from llm_rlhf.models.scoring import Scores
from llm_rlhf.ppo.config import batch_sizes
from llm_rlhf.rl import loss_math, ppo_math

REWARD_FNS = str(ROOT / "tests" / "reward_fns.py")
EVEN, HALF = REWARD_FNS + ":even_length", REWARD_FNS + ":half"  # 0 / 1 by parity; 0.5 for every response


def grpo_config(model_dir, prompt_file, out, **kw):
    """grpo with 4 prompts x 2 samples, no reward model nor KL penalty, one epoch over one minibatch of 8."""
    base = dict(advantage_estimator="grpo", samples_per_prompt=2, rollout_batch_size=4, mini_batch_size=8,
                ppo_epochs=1, reward_fn=EVEN, kl_controller="fixed", init_kl_coef=0.0, eval_every=0,
                max_grad_norm=1e9)  # fmt: skip
    base.update(kw)
    return ppo_config(model_dir, None, prompt_file, out, **base)


def fixed_rollout(cfg, seed: int = 0):
    """A rollout of `use_fixed_responses` (rows 0, 3, 6 truncated, the others ended at varied lengths) and
    per-response advantages ~ N(0, 1) on each of its tokens, (B, R)."""
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    a = torch.randn(rollout.scores.shape, generator=torch.Generator().manual_seed(seed))  # (B,)
    return rollout, ppo_math.token_advantages(advantages=a, response_mask=rollout.response_mask)


def raw_gradient(trainer, rollout, advantages) -> torch.Tensor:
    """The raw gradient (before clipping) of `trainer`'s one update on `rollout`."""
    grads = []
    record_raw_grads(trainer, grads)
    trainer.train_on_rollout(rollout, advantages, None)
    assert len(grads) == 1
    return grads[0]


# --- the sampler correction's weight carries no gradient ------------------------------------------------


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_sampler_correction_weight_carries_no_gradient(tiny_model_dir, prompt_file, tmp_path, correction):
    """A rollout whose sampler log-probs are the old policy's + 0.1 * N(0, 1) (cap 1.05: some weights
    truncated or masked): the trainer's raw gradient is that of the token-mean loss -w_t * A_t * rho_t written
    out, with the weights w_t = min(pi_old / q, C) (tis) or 1[1/C <= pi_old / q <= C] (mis) detached (rho = 1
    and no clip at the first update). Fails if the weight carries gradient (w * exp(lp - sg(lp)): the same
    values, twice the gradient)."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, sampler_correction=correction,
                      sampler_correction_cap=1.05)  # fmt: skip
    rollout, advantages = fixed_rollout(cfg)
    mask = rollout.response_mask
    noise = 0.1 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))  # (B, R)
    rollout.sampler_logprobs = torch.where(mask, rollout.logprobs + noise, 0.0)  # log q
    ratio = torch.exp(rollout.logprobs - rollout.sampler_logprobs)  # (B, R) pi_old / q
    corrected = (ratio > 1.05) | ((ratio < 1 / 1.05) if correction == "mis" else False)  # (B, R)
    weights = ratio.clamp(max=1.05) if correction == "tis" else (~corrected).float()  # (B, R), no grad
    assert 0 < int((corrected & mask).sum()) < int(mask.sum()), "some weights truncated or masked"

    trainer = tiny_ppo_trainer(cfg)
    params = list(trainer.trainable_parameters())
    logprobs, _, _ = trainer.forward_policy(rollout, train=True)  # (B, R), with grad
    rho = torch.exp(logprobs - rollout.logprobs)  # (B, R), 1 in value
    loss = (-weights * advantages * rho)[mask].sum() / mask.sum()  # token mean over the minibatch
    by_hand = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    got = raw_gradient(tiny_ppo_trainer(cfg), rollout, advantages)
    assert by_hand.abs().max() > 1e-4
    torch.testing.assert_close(got, by_hand, atol=1e-6 * float(by_hand.abs().max()), rtol=1e-4)


# --- dynamic sampling ties on raw scores or verdicts ---------------------------------------------------


def tie_config(tiny_model_dir, prompt_file, tmp_path, **kw):
    return grpo_config(tiny_model_dir, prompt_file, tmp_path, **{"dynamic_sampling": True,
                       "dynamic_sampling_max_rounds": 3, **kw})  # fmt: skip


@pytest.mark.parametrize(
    "shaping",
    [dict(overlong_buffer=4, overlong_penalty=1.0), dict(eos_penalty=-1.0)],
    ids=["overlong", "eos"],
)
def test_dynamic_sampling_ties_on_raw_scores_not_the_penalties(
    tiny_model_dir, prompt_file, tmp_path, shaping
):
    """Every response scores 0.5 (the groups all tie) and the responses have different lengths, some
    truncated (`use_fixed_responses`): the overlong penalty and the EOS penalty separate some groups' shaped
    scores, but no penalty unties a group. Every round's groups are tied, so the step samples its 3 rounds,
    drops 8 groups and trains 4 tied ones. Fails if the tie test reads the shaped scores."""
    trainer = tiny_ppo_trainer(tie_config(tiny_model_dir, prompt_file, tmp_path, reward_fn=HALF, **shaping))
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    shaped = trainer.rewards(rollout, 0.0)[0].sum(-1)  # (B,) the score the rewards hold (kl_coef 0)
    assert not loss_math.tied_groups(scores=shaped, samples_per_prompt=2).all(), "the penalty unties a group"
    m = trainer.ppo_step()
    assert (m["sampling/rounds"], m["sampling/groups_dropped"]) == (3.0, 8.0)
    assert m["sampling/tied_groups_trained"] == 4.0 and trainer.collector.extra_prompts == 8


def write_verifier(folder) -> str:
    (folder / "verifiers.py").write_text(
        "def always(prompts, responses):\n    return [1.0 for _ in responses]\n"
    )
    return str(folder / "verifiers.py") + ":always"


def test_dynamic_sampling_ties_on_the_verifier_verdicts(tiny_model_dir, prompt_file, tmp_path):
    """With accuracy_fn (the task's verifier, loaded by `build_trainer`), a group ties when its verdicts tie:
    every answer correct (always 1.0) while the reward function grades by parity is dropped in every round;
    with every score 0.5 and the verdicts by parity, the groups tie where the parities do."""
    always = write_verifier(tmp_path)
    trainer = tiny_ppo_trainer(
        tie_config(tiny_model_dir, prompt_file, tmp_path, reward_fn=EVEN, accuracy_fn=always)
    )
    assert trainer.collector.verifier is not None and trainer.collector.verifier.key == "accuracy_fn"
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    assert not loss_math.tied_groups(scores=rollout.scores, samples_per_prompt=2).all(), "the scores differ"
    m = trainer.ppo_step()
    assert (m["sampling/rounds"], m["sampling/groups_dropped"], m["sampling/tied_groups_trained"]) == (
        3,
        8,
        4,
    )

    cfg = tie_config(tiny_model_dir, prompt_file, tmp_path, reward_fn=HALF, accuracy_fn=EVEN,
                     dynamic_sampling_max_rounds=1)  # fmt: skip
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)
    rollouts, real = [], trainer.dynamic_rollout

    def dynamic_rollout(*args):
        out = real(*args)
        rollouts.append(out[0])
        return out

    trainer.dynamic_rollout = dynamic_rollout
    m = trainer.ppo_step()
    r = rollouts[0]
    _, responses = decode_texts(trainer.tokenizer, r.query, r.query_mask, r.response, r.response_mask)
    parity = torch.tensor([float(len(text) % 2 == 0) for text in responses])  # (B,)
    tied = loss_math.tied_groups(scores=parity, samples_per_prompt=2)  # (P,)
    assert 0 < int(tied.sum()) < 4, "some groups tie on parity, some do not"
    assert m["sampling/tied_groups_trained"] == float(tied.sum())


# --- the KL of every sampled group ------------------------------------------------------------------------


def test_kl_and_its_controller_see_every_sampled_group(tiny_model_dir, prompt_file, tmp_path):
    """The policy moved off the reference, all groups tied (every score 0.5), 3 rounds: objective/kl is the
    mean sequence KL over the 24 sampled responses, the 16 dropped ones' too, and the adaptive controller
    moves by that KL (its target set to it once sampled: beta stays where it was, where the 8 kept
    responses' KL would move it). Fails if either reads the kept responses alone."""
    cfg = tie_config(tiny_model_dir, prompt_file, tmp_path, reward_fn=HALF, kl_controller="adaptive",
                     init_kl_coef=0.1, kl_target=0.01, kl_horizon=10)  # fmt: skip
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)
    with torch.no_grad():
        for p in trainer.unwrapped_policy.lm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    every = []  # the sequence KL of every sampled round, computed alone
    real_generate = trainer.collector.generate

    def generate(queries, sampling=None):
        samples = real_generate(queries, sampling)
        logprobs, _, _ = trainer.forward_policy(samples)
        kl = ppo_math.kl_penalty(logprobs=logprobs, ref_logprobs=trainer.reference_logprobs(samples),
                                 estimator=cfg.kl_estimator)  # fmt: skip
        every.append(ppo_math.sequence_kl(kl=kl, response_mask=samples.response_mask))
        if len(every) == 3:  # the last round: the controller's target is the KL of every sampled response
            trainer.kl_ctl.target = float(torch.cat(every).mean())
        return samples

    trainer.collector.generate = generate
    m = trainer.ppo_step()
    every = torch.cat(every)  # (24,)
    assert every.shape == (24,) and m["sampling/rounds"] == 3
    assert m["objective/kl"] == pytest.approx(float(every.mean()), rel=1e-5)
    kept = float(every[:8].mean())  # all tied: the first round's groups fill the step
    assert abs(kept / float(every.mean()) - 1) > 0.01, "the dropped rounds' KL differs"
    assert trainer.kl_ctl.value == pytest.approx(0.1, rel=1e-5)  # the error 0: beta unmoved


# --- two ranks simulated in one process -------------------------------------------------------------------


class TwoRanks:
    """The accelerator as the trainer's collectives see it on one of two data-parallel ranks played by two
    threads: `reduce(x, "sum" | "mean")` waits for the other rank's call and returns the all-reduce of both
    tensors; process_index is this rank's; the rest is the rank's real (one-process) accelerator. One
    `TwoRanks` per rank, sharing `pair` (a barrier, the parts)."""

    num_processes = 2

    def __init__(self, rank: int, pair: SimpleNamespace, real):
        self.process_index, self.pair, self.real = rank, pair, real

    def __getattr__(self, name: str):
        return getattr(self.real, name)  # unwrap_model, device, ...

    @staticmethod
    def pair() -> SimpleNamespace:
        return SimpleNamespace(barrier=threading.Barrier(2, timeout=30), parts={})

    def reduce(self, x: torch.Tensor, reduction: str) -> torch.Tensor:
        pair = self.pair
        pair.parts[self.process_index] = x
        pair.barrier.wait()
        total = pair.parts[0] + pair.parts[1]
        pair.barrier.wait()  # both have read the parts before the next call writes them
        return total if reduction == "sum" else total / 2


def on_two_ranks(trainers, work) -> list:
    """`work(rank, trainer)` on two threads, each trainer's accelerator the rank's `TwoRanks`; the results."""
    pair, out, errors = TwoRanks.pair(), [None, None], []
    real = [t.accelerator for t in trainers]
    for rank, t in enumerate(trainers):
        t.context.accelerator = TwoRanks(rank, pair, t.accelerator)  # the trainer's, the collector's, the update's

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank, trainers[rank])
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)
            pair.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t, accelerator in zip(trainers, real):
        t.context.accelerator = accelerator
    if errors:
        raise errors[0]
    return out


def rank_trainer(cfg, **sizes):
    """A trainer of `cfg` whose batch sizes are those of one of 2 processes (`sizes` the per-process keys)."""
    trainer = tiny_ppo_trainer(cfg)
    keys = dict(rollout_batch_size=cfg.rollout_batch_size, mini_batch_size=cfg.mini_batch_size,
                gradient_accumulation_steps=cfg.gradient_accumulation_steps, ppo_epochs=cfg.ppo_epochs,
                steps=cfg.steps, samples_per_prompt=cfg.samples_per_prompt)  # fmt: skip
    trainer.context.sizes = batch_sizes(**{**keys, **sizes, "num_processes": 2})  # every part's
    return trainer


@pytest.mark.parametrize(
    "keys",
    [dict(), dict(cliprange_high=0.28), dict(loss_aggregation="seq_mean_token_mean"),
     dict(loss_aggregation="token_sum_norm"), dict(cliprange_high=0.28, gradient_accumulation_steps=2)],
    ids=["plain", "token_mean", "seq_mean_token_mean", "token_sum_norm", "accumulated"],
)  # fmt: skip
def test_global_normaliser_two_simulated_ranks_equal_one(tiny_model_dir, prompt_file, tmp_path, keys):
    """One minibatch of 8 responses of 2 to 8 tokens (`use_fixed_responses`): on one process, and cut into two
    ranks of 2 groups (rank 0 holds 20 tokens, rank 1 25) whose normaliser and token counts are all-reduced by
    two threads: the mean of the ranks' raw gradients (what DDP's all-reduce gives) is the one process's, for
    the plain loss and every aggregation. Fails if the normaliser N is this rank's (not all-reduced), or if
    the policy loss's share is not multiplied by the processes DDP averages over."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, **keys)
    rollout, advantages = fixed_rollout(cfg)
    one = raw_gradient(tiny_ppo_trainer(cfg), rollout, advantages)
    halves = [torch.arange(0, 4), torch.arange(4, 8)]
    lengths = [int(rollout.response_mask[h].sum()) for h in halves]
    assert lengths[0] != lengths[1], "the ranks hold different numbers of tokens"

    trainers = [rank_trainer(cfg, rollout_batch_size=2, mini_batch_size=4) for _ in (0, 1)]
    grads = [[], []]
    for t, store in zip(trainers, grads):
        record_raw_grads(t, store)  # on the real accelerator, whose clip the trainer's `acc` calls
    on_two_ranks(
        trainers, lambda r, t: t.train_on_rollout(rollout.select(halves[r]), advantages[halves[r]], None)
    )
    assert len(grads[0]) == len(grads[1]) == 1 and one.abs().max() > 1e-4
    mean = (grads[0][0] + grads[1][0]) / 2  # DDP's all-reduce of the ranks' gradients
    torch.testing.assert_close(mean, one, atol=1e-6 * float(one.abs().max()), rtol=1e-4)


def test_dynamic_sampling_rounds_are_the_same_on_two_simulated_ranks(tiny_model_dir, prompt_file, tmp_path):
    """Two ranks of 2 groups each: rank 0's groups are untied from the first round, rank 1's tie in rounds 1
    and 2 (scripted scores): both sample 3 rounds (their collectives match), rank 0 trains its first
    round's groups, rank 1 its third's, and the counts are global: 8 groups dropped, none tied trained. Fails
    if a process stops on its own untied count."""
    cfg = tie_config(tiny_model_dir, prompt_file, tmp_path, reward_fn=HALF, dynamic_sampling_max_rounds=4)
    trainers = [rank_trainer(cfg, rollout_batch_size=2, mini_batch_size=4) for _ in (0, 1)]
    untied, tied = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])  # (B,) 2 groups
    script = {0: [untied] * 4, 1: [tied, tied, untied, untied]}  # each rank's scores, round by round
    for rank, t in enumerate(trainers):
        use_fixed_responses(t)
        rounds = iter(script[rank])
        t.collector.score = lambda samples, rounds=rounds: Scores(scores=next(rounds))

    def step(rank, t):
        times = {}
        return t.dynamic_rollout(t.collector.queries(t.step), times)

    (r0, _, s0, kl0), (r1, _, s1, kl1) = on_two_ranks(trainers, step)
    assert s0["sampling/rounds"] == s1["sampling/rounds"] == 3.0
    assert s0["sampling/groups_dropped"] == s1["sampling/groups_dropped"] == 8.0
    assert s0["sampling/tied_groups_trained"] == s1["sampling/tied_groups_trained"] == 0.0
    assert r0.scores.tolist() == untied.tolist() and r1.scores.tolist() == untied.tolist()
    assert kl0.shape == kl1.shape == (8,)  # the dropped rows: 2 rounds x 2 groups x 2 samples
    assert trainers[0].collector.extra_prompts == trainers[1].collector.extra_prompts == 8
