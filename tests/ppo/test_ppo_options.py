"""Every PPO option through `ppo_step`: the KL estimators, eos_penalty, score_clip,
whiten_rewards, target_approxkl, ratio_guard, value_model: reward; and non-finite values stopping a run."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ppo_config, recording_rollouts, tiny_ppo_trainer, use_fixed_responses

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.errors import ConfigError, NonFiniteError
from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.ppo.config import Config
from llm_rlhf.rl import ppo_math
from llm_rlhf.stages import ppo


def recorded_step(trainer: ppo_trainer.PPOTrainer, monkeypatch) -> tuple[dict, dict]:
    """One ppo_step; returns its metrics and what it computed: the rollout and the rewards passed to GAE."""
    seen, rollouts, compute_gae = {}, recording_rollouts(trainer), ppo_math.compute_gae

    def recording_gae(**kw):
        seen["rewards"] = kw["rewards"]
        return compute_gae(**kw)

    monkeypatch.setattr(ppo_math, "compute_gae", recording_gae)
    metrics = trainer.ppo_step()
    monkeypatch.undo()
    del trainer.rollout  # the trainer's own method again
    seen["rollout"] = rollouts[-1]
    return metrics, seen


def last_token(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x at each row's last response token: (B, R) -> (B,)."""
    return x[torch.arange(x.shape[0]), mask.sum(-1) - 1]


def naive_kl(logprobs: float, ref_logprobs: float, estimator: str) -> float:
    d = logprobs - ref_logprobs
    return {"k1": d, "k3": math.exp(-d) - 1 + d, "abs": abs(d), "mse": 0.5 * d * d}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k3", "abs", "mse"])
def test_kl_estimator_shapes_the_rewards(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch, estimator
):
    """Second step (the policy has moved): reward_t = -beta * KL_t (+ score at the last token), KL_t the
    chosen estimator written out per token; objective/kl is its sum over the response."""
    cfg = ppo_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        kl_estimator=estimator,
        kl_controller="fixed",
        init_kl_coef=0.5,
        learning_rate=1e-2,
    )
    trainer = tiny_ppo_trainer(cfg)
    trainer.ppo_step()
    metrics, seen = recorded_step(trainer, monkeypatch)
    r, mask = seen["rollout"], seen["rollout"].response_mask
    expected = torch.zeros_like(r.logprobs, dtype=torch.float64)
    kl_seq = torch.zeros(mask.shape[0], dtype=torch.float64)
    for i, t in mask.nonzero().tolist():
        kl = naive_kl(float(r.logprobs[i, t]), float(r.ref_logprobs[i, t]), estimator)
        expected[i, t] = -0.5 * kl
        kl_seq[i] += kl
    ends = mask.sum(-1) - 1
    expected[torch.arange(len(ends)), ends] += r.scores.double()
    assert kl_seq.abs().max() > 1e-4, "the policy moved away from the reference"
    torch.testing.assert_close(seen["rewards"].double(), expected, atol=1e-5, rtol=1e-5)
    assert metrics["objective/kl"] == pytest.approx(kl_seq.mean().item(), rel=1e-5, abs=1e-6)


def test_eos_penalty_replaces_the_score_of_truncated_responses(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    trainer = tiny_ppo_trainer(
        ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, eos_penalty=-3.0)
    )
    use_fixed_responses(trainer)
    _, seen = recorded_step(trainer, monkeypatch)  # first step: KL_t = 0, the rewards are the scores
    r = seen["rollout"]
    ended = r.ended_with_eos(trainer.tokenizer.eos_token_id)
    assert ended.any() and (~ended).any()
    expected = torch.where(ended, r.scores, torch.tensor(-3.0))
    torch.testing.assert_close(last_token(seen["rewards"], r.response_mask), expected)


def test_score_clip_clips_the_scores_in_the_rewards(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    trainer = tiny_ppo_trainer(
        ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, score_clip=0.05)
    )
    _, seen = recorded_step(trainer, monkeypatch)
    scores = seen["rollout"].scores
    assert (scores.abs() > 0.05).any()
    torch.testing.assert_close(
        last_token(seen["rewards"], seen["rollout"].response_mask), scores.clamp(-0.05, 0.05)
    )


def test_whiten_rewards_scales_the_rewards_to_unit_std(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    trainer = tiny_ppo_trainer(
        ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, whiten_rewards=True)
    )
    _, seen = recorded_step(trainer, monkeypatch)
    mask, rewards = seen["rollout"].response_mask, seen["rewards"]
    raw = torch.zeros_like(rewards)
    raw[torch.arange(raw.shape[0]), mask.sum(-1) - 1] = seen["rollout"].scores  # first step: KL_t = 0
    assert rewards[mask].std().item() == pytest.approx(1.0, abs=1e-4)
    expected = (raw[mask] - raw[mask].mean()) / raw[mask].std() + raw[mask].mean()  # shift_mean=False
    torch.testing.assert_close(rewards[mask], expected, atol=1e-5, rtol=1e-5)


def count_optimizer_steps(trainer: ppo_trainer.PPOTrainer) -> list[int]:
    count, step = [0], trainer.optimizer.step

    def counting(*args, **kwargs):
        count[0] += 1
        return step(*args, **kwargs)

    trainer.optimizer.step = counting
    return count


@pytest.mark.parametrize("target", [None, 1e-12])
def test_target_approxkl_stops_the_epochs(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, target):
    """2 epochs x 2 minibatches. The first minibatch comes before any update (approx-KL exactly 0, not
    above the target), the second after one: with a tiny target the epochs stop there."""
    trainer = tiny_ppo_trainer(
        ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, target_approxkl=target)
    )
    steps = count_optimizer_steps(trainer)
    metrics = trainer.ppo_step()
    assert steps[0] == (4 if target is None else 2)
    assert metrics["policy/early_stopped"] == float(target is not None)


def test_ratio_guard_skips_every_update_and_reports_no_statistics(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    trainer = tiny_ppo_trainer(
        ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, ratio_guard=0.5)
    )
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_policy.named_parameters()}
    steps = count_optimizer_steps(trainer)
    metrics = trainer.ppo_step()  # rho == 1 > 0.5 in every minibatch
    assert steps[0] == 0 and metrics["policy/skipped_minibatches"] == 4
    assert math.isnan(metrics["loss/policy"]) and math.isnan(metrics["policy/ratio"])
    for n, p in trainer.unwrapped_policy.named_parameters():
        assert torch.equal(p, before[n]), n


def test_skipped_minibatch_is_left_out_of_the_statistics(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """The second minibatch's log-probs are pushed up by 5 nats (rho ~ 148 > ratio_guard = 10): it is
    skipped, the step's policy/ratio is the mean over the minibatches that were kept, and the
    linear LR schedule advanced for the kept one only (1 of the run's 4 optimiser steps)."""
    cfg = ppo_config(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, ppo_epochs=1, lr_scheduler_type="linear"
    )
    trainer = tiny_ppo_trainer(cfg)
    forward, calls = trainer.forward_policy, [0]

    def diverged_second_minibatch(samples, *, train=False):
        logprobs, values, entropy = forward(samples, train=train)
        if train:
            calls[0] += 1
            if calls[0] == 2:
                logprobs = logprobs + 5.0
        return logprobs, values, entropy

    trainer.forward_policy = diverged_second_minibatch
    steps = count_optimizer_steps(trainer)
    metrics = trainer.ppo_step()
    assert calls[0] == 2 and steps[0] == 1 and metrics["policy/skipped_minibatches"] == 1
    assert metrics["policy/ratio"] == 1.0  # the kept first minibatch, before any update
    assert metrics["lr"] == pytest.approx(1e-3 * (1 - 1 / 4), rel=1e-12)


@pytest.mark.slow
def test_separate_critic_through_ppo_step_and_the_final_folder(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """value_model: reward: the policy has no value head, the critic gives the rollout's values and is
    trained, and the final folder holds it as a reward-model folder."""
    from llm_rlhf.models.reward_model import load_reward_model

    cfg = ppo_config(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "run", value_model="reward", steps=2
    )
    ppo.run(cfg)
    out = tmp_path / "run"
    assert not (out / "value_head.safetensors").exists()
    critic, rm = load_reward_model(out / "critic"), load_reward_model(tiny_rm_dir)
    changed = [n for (n, p), q in zip(critic.named_parameters(), rm.parameters()) if not torch.equal(p, q)]
    assert "model.score.weight" in changed and len(changed) > len(list(rm.parameters())) // 2
    assert (critic.mean, critic.std) == (rm.mean, rm.std)

    trainer = tiny_ppo_trainer(
        ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "t", value_model="reward")
    )
    assert trainer.unwrapped_policy.value_head is None and trainer.critic is not None
    rollout, _ = trainer.rollout(trainer.collector.queries(trainer.step))
    with torch.no_grad():
        P = rollout.query.shape[1]
        values = trainer.critic(rollout.sequence, rollout.attention_mask)[:, P - 1 : -1]
    torch.testing.assert_close(
        rollout.values[rollout.response_mask], values[rollout.response_mask], atol=1e-5, rtol=1e-5
    )


# --- non-finite values ---------------------------------------------------------------------------


def test_nan_scores_stop_the_run_before_a_checkpoint(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """The RM returns NaN for some rows from the second step on: the run stops with one line naming the
    step and the phase; the step-1 checkpoint is the last one and holds finite weights."""
    from safetensors.torch import load_file

    from llm_rlhf.models.reward_model import RewardModel

    score, calls = RewardModel.score, [0]

    def nan_from_the_second_step(self, input_ids, attention_mask):
        calls[0] += 1
        scores = score(self, input_ids, attention_mask)
        if calls[0] >= 2:
            scores[1::3] = math.nan
        return scores

    monkeypatch.setattr(RewardModel, "score", nan_from_the_second_step)
    out = tmp_path / "run"
    cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, steps=3, save_steps=1, eval_every=0)
    with pytest.raises(NonFiniteError, match=r"^PPO step 2, rollout phase: non-finite scores \(3 entries\)"):
        ppo.run(cfg)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    for name, t in load_file(out / "checkpoints" / "step-1" / "policy_trainable.safetensors").items():
        assert torch.isfinite(t).all(), name
    assert not (out / "metrics.json").exists()


def test_nan_loss_stops_before_the_update(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    trainer = tiny_ppo_trainer(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_policy.named_parameters()}
    forward = trainer.forward_policy

    def nan_in_training(samples, *, train=False):
        logprobs, values, entropy = forward(samples, train=train)
        return (logprobs * math.nan if train else logprobs), values, entropy

    trainer.forward_policy = nan_in_training
    with pytest.raises(
        NonFiniteError, match=r"^PPO step 1, train phase \(epoch 1\): non-finite loss"
    ) as error:
        trainer.ppo_step()
    assert str(error.value).endswith("nothing was updated")
    for n, p in trainer.unwrapped_policy.named_parameters():
        assert torch.equal(p, before[n]), n


def test_nan_loss_after_an_update_says_the_weights_moved(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """A NaN in the second minibatch of a PPO step: the first minibatch's optimiser step has already moved
    the weights, and the message says so (one optimiser step) instead of "nothing was updated"."""
    trainer = tiny_ppo_trainer(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path))
    sizes = trainer.sizes
    per_minibatch = sizes.mini_batch_per_process // sizes.micro_batch_per_process  # forwards per minibatch
    assert sizes.rollout_per_process // sizes.mini_batch_per_process >= 2  # a second minibatch exists
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_policy.named_parameters()}
    forward, calls = trainer.forward_policy, [0]

    def nan_from_the_second_minibatch(samples, *, train=False):
        logprobs, values, entropy = forward(samples, train=train)
        calls[0] += train
        return (logprobs * math.nan if calls[0] > per_minibatch else logprobs), values, entropy

    trainer.forward_policy = nan_from_the_second_minibatch
    with pytest.raises(
        NonFiniteError, match=r"^PPO step 1, train phase \(epoch 1\): non-finite loss"
    ) as error:
        trainer.ppo_step()
    message = str(error.value)
    assert "nothing was updated" not in message and "1 earlier optimiser step of this PPO step" in message
    assert "\n" not in message and trainer.step == 0  # the step count was not updated
    moved = [n for n, p in trainer.unwrapped_policy.named_parameters() if not torch.equal(p, before[n])]
    assert moved  # the message is true: the first minibatch did update the weights


def test_a_global_batch_of_one_episode_is_rejected(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    from llm_rlhf.core.errors import UserError

    cfg = ppo_config(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, rollout_batch_size=1, mini_batch_size=1
    )
    with pytest.raises(UserError, match="at least 2 episodes"):
        tiny_ppo_trainer(cfg)


@pytest.mark.parametrize(("key", "value"), [("top_k", 50), ("top_p", 0.9)])
def test_ppo_refuses_truncated_sampling(key, value):
    """Top-k / top-p would draw tokens from a truncated softmax while the ratio and the KL use the full
    one (and a token outside the reference's kept set has infinite KL): PPO refuses them by name."""
    with pytest.raises(ConfigError, match=f"^config key '{key}': must be"):
        parse_config(Config, [f"--{key}", str(value)])


def test_sampling_compile_samples_the_policys_distribution_through_compiled_steps(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """sampling_compile: the rollout's decode steps run through the compiled step, and the tokens still come
    from the policy's distribution: the sampler's log-probs equal the PPO forward's to float rounding
    (objective/kl_sampler ~0), and the first step has KL = 0 to the reference."""
    from llm_rlhf.rl import fast_sampling

    calls, real = [], fast_sampling.compiled_step

    def recording(model):
        calls.append(model)
        return real(model)

    monkeypatch.setattr(fast_sampling, "compiled_step", recording)
    cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, sampling_compile=True)
    trainer = tiny_ppo_trainer(cfg)
    metrics, seen = recorded_step(trainer, monkeypatch)
    r, mask = seen["rollout"], seen["rollout"].response_mask
    assert len(calls) == 1 and calls[0] is trainer.unwrapped_policy.lm  # the policy's own model, compiled
    assert (r.sampler_logprobs - r.logprobs)[mask].abs().max() < 1e-4
    assert abs(metrics["objective/kl_sampler"]) < 1e-5
    assert metrics["objective/kl"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_dtype_logs_the_gap_between_sampler_and_policy(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch, dtype
):
    """sampling_dtype: the rollout is drawn by the sampler in that dtype; objective/kl_sampler is the mean
    over response tokens of log q(y_t) - log pi_theta(y_t), ~0 in float32, bfloat16's rounding otherwise;
    the old log-probs stay the float32 policy's, so the first step still has KL = 0 to the reference."""
    cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, sampling_dtype=dtype)
    trainer = tiny_ppo_trainer(cfg)
    metrics, seen = recorded_step(trainer, monkeypatch)
    r, mask = seen["rollout"], seen["rollout"].response_mask
    expected = (r.sampler_logprobs - r.logprobs)[mask].double().mean().item()
    assert metrics["objective/kl_sampler"] == pytest.approx(expected, rel=1e-4, abs=1e-9)
    assert metrics["objective/kl"] == 0.0
    gap = (r.sampler_logprobs - r.logprobs)[mask].abs().max()
    assert gap < 1e-4 if dtype == "float32" else gap > 1e-3
