"""On-policy distillation (teacher_model_path): the teacher scores every sampled token, and each response token's
reward gains -distill_coef * d_t, d_t = log pi_theta(y_t|s_t) - log pi_teacher(y_t|s_t) (`ppo_math.distill_kl`).

The signal against its analytic form and against TRL 1.16's DistillationTrainer loss; a teacher equal to the
student gives a signal and a gradient of exactly zero; the signal enters the rewards as said, through the real
trainer; the keys' checks and the one-line errors (another vocabulary, a teacher that does not load); the
teacher on its own dtype and device; kill -9 and resume, bit for bit."""

from __future__ import annotations

import json
import math
import signal

import pytest
import torch
from helpers import ppo_cli_args, ppo_config, record_raw_grads, recording_rollouts, tiny_ppo_trainer
from processes import ppo_command

from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.rl import ppo_math

# pure distillation on grpo: no reward model, no reward function: the teacher's signal is the whole reward
DISTILL = dict(
    advantage_estimator="grpo",
    samples_per_prompt=4,
    rollout_batch_size=2,
    mini_batch_size=4,
    kl_controller="fixed",
    init_kl_coef=0.04,
)


# --- the signal ---------------------------------------------------------------------------------------------


def test_distill_kl_worked_example():
    """log pi_theta = log 0.5, log pi_teacher = log 0.25 -> d = log 2; 0 outside the response."""
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.1]]))
    teacher = torch.log(torch.tensor([[0.25, 0.5, 0.9]]))
    mask = torch.tensor([[True, True, False]])
    d = ppo_math.distill_kl(logprobs=logprobs, teacher_logprobs=teacher, response_mask=mask)
    torch.testing.assert_close(d, torch.tensor([[0.693147, 0.0, 0.0]]), atol=1e-6, rtol=0)


def tiny_heads(seed: int = 0, B: int = 2, K: int = 3, H: int = 5, V: int = 7):
    """Hidden states and LM heads of a student and a teacher on a vocabulary of V tokens, with a mask."""
    g = torch.Generator().manual_seed(seed)
    h_s, h_t = torch.randn(B, K, H, generator=g), torch.randn(B, K, H, generator=g)
    w_s, w_t = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return h_s, h_t, w_s, w_t, mask


def expected_signal_and_surrogate(logits_s: torch.Tensor, logits_t: torch.Tensor, mask: torch.Tensor):
    """Over every token y of the vocabulary at each position (what sampling y_t ~ pi_theta averages): the mean
    over the masked positions of E[d] = sum_y pi(y) d(y), and of the policy-gradient surrogate whose gradient is
    E[grad log pi(y) * d(y)] (the reward -d(y) held fixed, as PPO holds its advantages)."""
    logp_s, logp_t = logits_s.log_softmax(-1), logits_t.log_softmax(-1)  # (B, K, V)
    V = logits_s.shape[-1]
    per_token = mask.bool()[..., None].expand(
        -1, -1, V
    )  # (B, K, V): every candidate token at a real position
    d = ppo_math.distill_kl(
        logprobs=logp_s.flatten(1), teacher_logprobs=logp_t.flatten(1), response_mask=per_token.flatten(1)
    ).view_as(logp_s)  # (B, K, V)
    p = logp_s.exp().detach()
    n = mask.sum()
    expected = (p * d).sum(-1).sum() / n
    surrogate = (p * d.detach() * logp_s).sum(-1).sum() / n
    return expected, surrogate


def test_the_signal_and_its_gradient_are_the_reverse_kl_and_its_analytic_gradient():
    """On a vocabulary of 7 tokens: the expected signal is KL(pi_theta || pi_teacher) at each position, and the
    policy gradient of the reward -d has the reverse KL's analytic gradient in the logits,
    grad_z KL = pi * (d - sum_y pi(y) d(y)) (with d(y) = log pi(y) - log pi_teacher(y))."""
    h_s, h_t, w_s, w_t, mask = tiny_heads()
    logits_s = (h_s @ w_s.T).requires_grad_(True)  # (B, K, V)
    logits_t = h_t @ w_t.T
    expected, surrogate = expected_signal_and_surrogate(logits_s, logits_t, mask)
    p, logp_s, logp_t = logits_s.softmax(-1), logits_s.log_softmax(-1), logits_t.log_softmax(-1)
    kl = (p * (logp_s - logp_t)).sum(-1)  # (B, K)
    torch.testing.assert_close(expected, kl[mask.bool()].mean(), atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad(surrogate, logits_s)
    d = (logp_s - logp_t).detach()
    analytic = p.detach() * (d - (p.detach() * d).sum(-1, keepdim=True)) / mask.sum()  # (B, K, V)
    analytic = analytic * mask[..., None]
    torch.testing.assert_close(grad, analytic, atol=1e-7, rtol=1e-5)
    assert grad.abs().max() > 1e-3


def test_the_signal_equals_trls_distillation_loss_at_beta_1():
    """TRL 1.16's `DistillationTrainer` loss (`_chunked_divergence_loss`, the full-vocabulary generalised JSD of
    student and teacher at each completion position, its mean over the valid positions) at beta = 1, the reverse
    KL: equal to the expected signal, and its gradient in the student's hidden states and LM head equal to the
    expected policy gradient of the reward -d. The difference, named: TRL differentiates the exact KL over the
    vocabulary at each sampled prefix; PPO takes its one-sample estimate at the sampled token (its expectation
    and expected gradient are TRL's), and credits it as a reward (GAE and REINFORCE++: also to the tokens
    before it). At beta = 0 (forward KL) TRL's loss is another quantity, which PPO's signal does not compute."""
    trl = pytest.importorskip("trl.trainer.distillation_trainer")
    h_s, h_t, w_s, w_t, mask = tiny_heads(seed=1)
    h_s, w_s = h_s.requires_grad_(True), w_s.requires_grad_(True)
    loss, _, n_valid = trl._chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, 1.0)
    assert int(n_valid) == int(mask.sum())
    expected, surrogate = expected_signal_and_surrogate(h_s @ w_s.T, h_t @ w_t.T, mask)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    grads_trl = torch.autograd.grad(loss, (h_s, w_s))
    grads_ours = torch.autograd.grad(surrogate, (h_s, w_s))
    for a, b in zip(grads_trl, grads_ours):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)
    forward_kl, _, _ = trl._chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, 0.0)
    assert abs(float(forward_kl.detach()) - float(expected.detach())) > 1e-2


def test_topk_divergence_worked_examples():
    """k = 2, p_t = (0.5, 0.5), p_s = (0.25, 0.75): forward KL 0.5 log 2 + 0.5 log(2/3); the JSD at beta 0.5 by
    its definition with m = (p_s + p_t) / 2; a token of probability 0 in both adds 0 (no nan)."""
    t = torch.log(torch.tensor([[[0.5, 0.5, 0.0]]]))
    s = torch.log(torch.tensor([[[0.25, 0.75, 0.0]]]))
    forward = ppo_math.topk_divergence(student_logprobs=s, teacher_logprobs=t, beta=0.0)
    torch.testing.assert_close(forward, torch.tensor([[0.5 * math.log(2) + 0.5 * math.log(2 / 3)]]))
    m = [0.375, 0.625]
    jsd = 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    jsd += 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1]))
    got = ppo_math.topk_divergence(student_logprobs=s, teacher_logprobs=t, beta=0.5)
    torch.testing.assert_close(got, torch.tensor([[jsd]]))


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.8])
def test_the_loss_term_over_the_whole_vocabulary_equals_trls_loss(beta):
    """`topk_divergence` with k = V (the teacher's every token), as the update takes its token mean: equal to
    TRL 1.16's `DistillationTrainer` loss at the same beta (forward KL at 0, the generalised JSD between), its
    value and its gradient in the student's hidden states and LM head."""
    trl = pytest.importorskip("trl.trainer.distillation_trainer")
    h_s, h_t, w_s, w_t, mask = tiny_heads(seed=2)
    h_s, w_s = h_s.requires_grad_(True), w_s.requires_grad_(True)
    loss, _, _ = trl._chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, beta)
    logp_t = (h_t @ w_t.T).log_softmax(-1)  # (B, K, V)
    top, ids = logp_t.topk(logp_t.shape[-1], dim=-1)  # every token, largest first
    student = (h_s @ w_s.T).log_softmax(-1).gather(-1, ids)
    divergence = ppo_math.topk_divergence(student_logprobs=student, teacher_logprobs=top, beta=beta)
    ours = ppo_math.masked_mean(divergence, mask.bool())
    torch.testing.assert_close(ours, loss, atol=1e-6, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(loss, (h_s, w_s)), torch.autograd.grad(ours, (h_s, w_s))):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


# --- through the trainer ------------------------------------------------------------------------------------


def distill_config(model_dir, teacher_dir, prompt_file, out, **kw):
    return ppo_config(
        model_dir, None, prompt_file, out, teacher_model_path=str(teacher_dir), **{**DISTILL, **kw}
    )


def test_a_teacher_equal_to_the_student_gives_zero_signal_and_zero_gradient(
    tiny_model_dir, other_model_dir, prompt_file, tmp_path
):
    """The teacher loaded from the policy's own folder: its log-probs are the old policy's exactly, the signal
    and objective/distill_kl are 0, and with no other reward (pure distillation, the KL to the reference 0 at the
    first step) every raw gradient of the step is exactly 0. Another teacher (other weights, the same tokenizer)
    gives a positive KL and a gradient."""
    runs = {}
    for name, teacher in (("self", tiny_model_dir), ("other", other_model_dir)):
        trainer = tiny_ppo_trainer(
            distill_config(tiny_model_dir, teacher, prompt_file, tmp_path / name, steps=1)
        )
        grads, rollouts = [], recording_rollouts(trainer)
        record_raw_grads(trainer, grads)
        runs[name] = (trainer.ppo_step(), grads, rollouts[0])
    metrics, grads, rollout = runs["self"]
    assert torch.equal(rollout.teacher_logprobs, rollout.logprobs)
    assert metrics[ppo_metrics.OBJECTIVE_DISTILL_KL] == 0.0
    assert len(grads) == 4 and all(torch.count_nonzero(g) == 0 for g in grads)
    metrics, grads, rollout = runs["other"]
    assert (
        metrics[ppo_metrics.OBJECTIVE_DISTILL_KL] > 0.01
    )  # two random tiny models: near-uniform, near each other
    assert all(g.abs().max() > 0 for g in grads)
    assert metrics[ppo_metrics.TIME_TEACHER] > 0
    # the teacher's reward unties the groups the zero scores alone would tie (the student as teacher: all tied)
    assert (
        metrics[ppo_metrics.OBJECTIVE_GROUPS_TIED] == 0.0
        and runs["self"][0][ppo_metrics.OBJECTIVE_GROUPS_TIED] == 1.0
    )


def test_the_signal_enters_the_rewards_as_said(
    tiny_model_dir, other_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """With a reward model and a teacher (gae, KL in the reward): the per-token rewards are those without the
    teacher minus distill_coef * d_t on every response token, d_t from the rollout's old log-probs."""
    cfg = ppo_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        teacher_model_path=str(other_model_dir),
        distill_coef=0.3,
    )
    trainer = tiny_ppo_trainer(cfg)
    rollout, _ = trainer.rollout(trainer.collector.queries(0))
    mask = rollout.response_mask
    assert rollout.teacher_logprobs.shape == rollout.logprobs.shape
    assert torch.all(rollout.teacher_logprobs[~mask] == 0) and torch.all(rollout.teacher_logprobs[mask] < 0)
    with_teacher, kl = trainer.rewards(rollout, kl_coef=0.1)
    import dataclasses

    without, kl_without = trainer.rewards(dataclasses.replace(rollout, teacher_logprobs=None), kl_coef=0.1)
    d = torch.where(mask, rollout.logprobs - rollout.teacher_logprobs, 0.0)
    torch.testing.assert_close(with_teacher, without - 0.3 * d, atol=1e-6, rtol=0)
    assert torch.equal(kl, kl_without) and d.abs().max() > 0.1


@pytest.mark.slow
def test_a_teacher_of_its_own_dtype_and_device_and_architecture(
    tiny_model_dir, tiny_llama_dir, prompt_file, tmp_path
):
    """A Llama teacher (the same tokenizer) for a GPT-2 student, in bfloat16 on the CPU (teacher_dtype,
    teacher_device): its weights are bfloat16, its log-probs those of its own forward in bfloat16 outside the
    policy's autocast, and the run trains."""
    cfg = distill_config(
        tiny_model_dir, tiny_llama_dir, prompt_file, tmp_path, teacher_dtype="bfloat16", teacher_device="cpu"
    )
    trainer = tiny_ppo_trainer(cfg)
    assert next(trainer.teacher.parameters()).dtype == torch.bfloat16
    assert trainer.teacher not in trainer.frozen_models
    rollouts = recording_rollouts(trainer)
    metrics = trainer.ppo_step()
    rollout = rollouts[0]
    again = trainer.teacher_scores(rollout)["teacher_logprobs"]
    assert torch.equal(again, rollout.teacher_logprobs)
    from llm_rlhf.rl.rollout import response_logprobs_and_values

    part = rollout.select(slice(0, 4)).trimmed()
    direct = response_logprobs_and_values(
        trainer.teacher, part, trainer.sampling, eos_token_id=trainer.tokenizer.eos_token_id, entropy="none"
    )[0]
    torch.testing.assert_close(
        direct.float(), rollout.teacher_logprobs[:4, : direct.shape[1]], atol=0, rtol=0
    )
    assert metrics[ppo_metrics.OBJECTIVE_DISTILL_KL] > 0


VOCAB = 400  # the tiny models' vocabulary: distill_top_k = VOCAB is the exact divergence


@pytest.mark.parametrize(("loss", "beta"), [("forward_kl", 0.0), ("jsd", 0.3)])
def test_the_loss_term_of_an_update_is_the_divergence_of_its_rollout(
    loss, beta, tiny_model_dir, other_model_dir, prompt_file, tmp_path
):
    """distill_loss forward_kl / jsd with the teacher's every token (distill_top_k = V), one epoch of one
    minibatch: loss/distill is distill_coef times the token mean, over the rollout's response tokens, of the
    divergence computed here from the student's and the teacher's full logits (`rollout.response_logits`); no
    reverse KL enters the rewards. With the student as its own teacher the term is 0 and every raw gradient 0 up to
    float rounding (below 1e-7; ~1e-9 measured): the gradient p_s * sum_j p_t(j) - p_t vanishes only as far as
    the teacher's softmax sums to 1 (the reverse KL in the reward gives exactly 0)."""
    from llm_rlhf.rl.rollout import response_logits

    extra = dict(distill_loss=loss, distill_top_k=VOCAB, distill_coef=0.7, ppo_epochs=1, mini_batch_size=8)
    extra.update(distill_jsd_beta=beta) if loss == "jsd" else None
    for name, teacher in (("other", other_model_dir), ("self", tiny_model_dir)):
        cfg = distill_config(tiny_model_dir, teacher, prompt_file, tmp_path / name, steps=1, **extra)
        trainer = tiny_ppo_trainer(cfg)
        grads, rollouts = [], recording_rollouts(trainer)
        record_raw_grads(trainer, grads)
        with torch.no_grad():
            before = {k: v.clone() for k, v in trainer.unwrapped_policy.lm.state_dict().items()}
        metrics = trainer.ppo_step()
        rollout = rollouts[0]
        assert rollout.teacher_top_ids.shape == (*rollout.response.shape, VOCAB)
        rewards, _ = trainer.rewards(rollout, kl_coef=0.0)
        assert torch.count_nonzero(rewards) == 0  # pure distillation in the loss: no reward at all
        if name == "self":  # grad = p_s * sum_j p_t(j) - p_t: 0 up to the rounding of the softmax's sum
            assert metrics[ppo_metrics.LOSS_DISTILL] == 0.0
            assert all(g.abs().max() < 1e-7 for g in grads)
            continue
        trainer.unwrapped_policy.lm.load_state_dict(before)  # the policy the update started from
        with torch.no_grad():
            temperature = cfg.temperature
            logp_s = (response_logits(trainer.unwrapped_policy.lm, rollout) / temperature).log_softmax(-1)
            logp_t = (response_logits(trainer.teacher.lm, rollout) / temperature).log_softmax(-1)
        divergence = ppo_math.topk_divergence(student_logprobs=logp_s, teacher_logprobs=logp_t, beta=beta)
        expected = 0.7 * ppo_math.masked_mean(divergence, rollout.response_mask)
        assert metrics[ppo_metrics.LOSS_DISTILL] == pytest.approx(float(expected), rel=1e-4)
        assert float(expected) > 1e-3 and len(grads) == 1 and grads[0].abs().max() > 0


# --- keys and errors ----------------------------------------------------------------------------------------


def test_the_keys_are_checked(tiny_model_dir, prompt_file, tmp_path):
    for key, value in (("distill_coef", 0.5), ("teacher_dtype", "bfloat16"), ("teacher_device", "cpu")):
        with pytest.raises(ConfigError, match=f"'{key}': is read only with teacher_model_path"):
            ppo_config(
                tiny_model_dir, None, prompt_file, tmp_path, reward_fn="reward_fns:keyword", **{key: value}
            )
    with pytest.raises(ConfigError, match="'distill_coef': must be > 0"):
        distill_config(tiny_model_dir, tiny_model_dir, prompt_file, tmp_path, distill_coef=0.0)
    with pytest.raises(ConfigError, match="'teacher_dtype'"):
        distill_config(tiny_model_dir, tiny_model_dir, prompt_file, tmp_path, teacher_dtype="int8")
    with pytest.raises(ConfigError, match="'distill_loss': must be one of reverse_kl, forward_kl, jsd"):
        distill_config(tiny_model_dir, tiny_model_dir, prompt_file, tmp_path, distill_loss="kl")
    with pytest.raises(
        ConfigError, match="'distill_top_k': is read only with distill_loss forward_kl or jsd"
    ):
        distill_config(tiny_model_dir, tiny_model_dir, prompt_file, tmp_path, distill_top_k=8)
    with pytest.raises(ConfigError, match="'distill_jsd_beta': is read only with distill_loss jsd"):
        distill_config(tiny_model_dir, tiny_model_dir, prompt_file, tmp_path, distill_jsd_beta=0.3)
    with pytest.raises(ConfigError, match="'distill_jsd_beta': must be strictly between 0 and 1"):
        distill_config(
            tiny_model_dir, tiny_model_dir, prompt_file, tmp_path, distill_loss="jsd", distill_jsd_beta=1.0
        )
    with pytest.raises(ConfigError, match="'distill_top_k': must be >= 1"):
        distill_config(
            tiny_model_dir, tiny_model_dir, prompt_file, tmp_path, distill_loss="forward_kl", distill_top_k=0
        )
    with pytest.raises(ConfigError, match="'reward_model_path'.*teacher_model_path"):
        ppo_config(tiny_model_dir, None, prompt_file, tmp_path)
    assert (
        ppo_config(
            tiny_model_dir,
            None,
            prompt_file,
            tmp_path,
            teacher_model_path="none",
            reward_fn="reward_fns:keyword",
        ).teacher_model_path
        is None
    )


def other_vocabulary_model(folder):
    """A tiny GPT-2 whose tokenizer has 300 tokens, not the tiny models' 400."""
    from helpers import SENTENCES, train_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = train_tokenizer(SENTENCES * 5, vocab_size=300)
    tokenizer.save_pretrained(folder)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


def test_a_teacher_of_another_vocabulary_or_that_does_not_load_is_one_line(
    tiny_model_dir, prompt_file, tmp_path
):
    other = other_vocabulary_model(tmp_path / "other_vocab")
    with pytest.raises(UserError, match="tokenizer is not the policy's") as e:
        tiny_ppo_trainer(distill_config(tiny_model_dir, other, prompt_file, tmp_path / "a"))
    assert "\n" not in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="teacher_model_path: cannot load model") as e:
        tiny_ppo_trainer(distill_config(tiny_model_dir, empty, prompt_file, tmp_path / "b"))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="no such folder"):
        tiny_ppo_trainer(distill_config(tiny_model_dir, tmp_path / "missing/x", prompt_file, tmp_path / "c"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_command_refuses_another_vocabulary_in_one_line(tiny_model_dir, prompt_file, tmp_path):
    """`llm-rlhf ppo --teacher_model_path` with another vocabulary: exit non-zero, one line, nothing written."""
    other = other_vocabulary_model(tmp_path / "other_vocab")
    args = ppo_cli_args(tiny_model_dir, "none", prompt_file, tmp_path / "out", 1, teacher_model_path=other)
    result = ppo_command(args)
    assert result.returncode != 0
    assert "tokenizer is not the policy's" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


# --- resume -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_distillation_killed_and_resumed_ends_bit_identical(
    tiny_model_dir, other_model_dir, prompt_file, tmp_path
):
    """Pure distillation on grpo for 4 steps, a checkpoint every 2; killed with SIGKILL as step 4 starts, then
    resumed: the logs (objective/distill_kl included) and the final weights are those of the straight run."""
    from safetensors.torch import load_file

    def command(out, *more, kill_at=None):
        args = ppo_cli_args(
            tiny_model_dir,
            "none",
            prompt_file,
            out,
            4,
            advantage_estimator="grpo",
            samples_per_prompt=4,
            rollout_batch_size=2,
            mini_batch_size=4,
            save_steps=2,
            teacher_model_path=other_model_dir,
            distill_coef=0.5,
        )
        return ppo_command(args, *more, kill_at=kill_at)

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert command(straight).returncode == 0
    crash = command(killed, kill_at=4)
    assert crash.returncode == -signal.SIGKILL, crash.stderr[-2000:]
    resumed = command(killed, "--resume", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (
        [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (straight, killed)
    )
    assert [m["step"] for m in b] == [1, 2, 3, 4] and all(m[ppo_metrics.OBJECTIVE_DISTILL_KL] != 0 for m in a)
    for ma, mb in zip(a, b):
        drop = ("time/", "tokens_per_s")
        assert {k: v for k, v in mb.items() if not k.startswith(drop)} == {
            k: v for k, v in ma.items() if not k.startswith(drop)
        }
    final_a, final_b = (load_file(d / "model.safetensors") for d in (straight, killed))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
