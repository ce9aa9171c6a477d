"""A PPO step with one optimiser step skips the rollout's old-policy forward where that is exact
(`PPOTrainer.old_logprobs_from_update`): the old log-probs and entropy come from the update's own forward,
detached. The same draws, the same raw gradients, the same weights and the same metrics as with the separate
forward, bit for bit; the ratio is exactly 1."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from helpers import ppo_config, record_raw_grads, recording_rollouts, tiny_ppo_trainer

from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.rl import ppo_math

# grpo, 2 prompts x 4 samples: 8 episodes in one minibatch, one PPO epoch: one optimiser step per PPO step.
ONE_UPDATE = dict(
    advantage_estimator="grpo",
    samples_per_prompt=4,
    rollout_batch_size=2,
    mini_batch_size=8,
    ppo_epochs=1,
    reward_fn="reward_fns:keyword",
    kl_controller="fixed",
    init_kl_coef=0.04,
)


def skips(**kw) -> bool:
    """`old_logprobs_from_update` of a config (ONE_UPDATE changed by kw), without building models."""
    cfg = ppo_trainer.Config(**{**ONE_UPDATE, "reward_model_path": None, **kw})
    sizes = ppo_trainer.batch_sizes(
        rollout_batch_size=cfg.rollout_batch_size,
        mini_batch_size=cfg.mini_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        ppo_epochs=cfg.ppo_epochs,
        steps=cfg.steps,
        num_processes=1,
        samples_per_prompt=cfg.samples_per_prompt,
    )
    teacher = object() if cfg.teacher_model_path is not None else None
    trainer = SimpleNamespace(cfg=cfg, sizes=sizes, teacher=teacher)
    return ppo_trainer.PPOTrainer.old_logprobs_from_update.fget(trainer)


def test_the_old_forward_is_skipped_only_where_it_is_exact():
    assert skips()
    assert skips(gradient_accumulation_steps=4)  # one minibatch in micro-batches: still one update
    assert skips(advantage_estimator="dr_grpo") and skips(advantage_estimator="rloo", kl_in_loss=True)
    assert not skips(ppo_epochs=2)  # the second epoch's old policy is not the updated one
    assert not skips(mini_batch_size=4)  # nor the second minibatch's
    assert not skips(kl_in_loss=False)  # k1 in the reward: the advantages need the old log-probs first
    assert not skips(advantage_estimator="rloo")  # its published form: the KL in the reward
    assert not skips(advantage_estimator="gae", samples_per_prompt=1, rollout_batch_size=8)  # old values
    assert not skips(ent_coef=0.01)  # the update's entropy is then the "grad" one, not the rollout's
    assert not skips(teacher_model_path="t")  # distillation's rewards read the old log-probs first


def run_steps(cfg, *, skip: bool, mixed_precision: str = "no") -> dict:
    """Two PPO steps; what they drew, the raw gradients, the ratios, the rollouts, metrics and weights."""
    trainer = tiny_ppo_trainer(cfg, mixed_precision=mixed_precision)
    grads, ratios, old_forwards = [], [], []
    record_raw_grads(trainer, grads)
    rollouts = recording_rollouts(trainer)
    forward_policy, policy_loss = trainer.forward_policy, ppo_math.policy_loss

    def counting_forward(samples, *, train=False):
        old_forwards.append(not train)
        return forward_policy(samples, train=train)

    def recording_loss(**kw):
        loss, stats = policy_loss(**kw)
        ratios.append(stats.ratio[kw["response_mask"]].detach())
        return loss, stats

    trainer.forward_policy = counting_forward
    with (
        mock.patch.object(ppo_trainer.PPOTrainer, "old_logprobs_from_update", skip),
        mock.patch.object(ppo_math, "policy_loss", recording_loss),
    ):
        metrics = [trainer.ppo_step() for _ in range(cfg.steps)]
    return dict(
        grads=grads,
        ratios=ratios,
        old_forwards=sum(old_forwards),
        rollouts=rollouts,
        metrics=metrics,
        params={k: v.detach().clone() for k, v in trainer.unwrapped_policy.named_parameters()},
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "gpt2-bf16", "llama-lora"])
def test_skipping_the_old_forward_draws_and_updates_bit_for_bit_the_same(
    model, tiny_model_dir, tiny_llama_dir, prompt_file, tmp_path
):
    """GPT-2 full fine-tuning in one micro-batch, in float32 and under accelerate's bf16 mixed precision (the
    update's forward through `prepare`'s autocast wrapper, the rollout's unwrapped); Llama with LoRA (the
    reference: the adapter disabled) in 2 micro-batches. Both runs draw the same responses at both steps (the second step's draws come from the
    updated weights and the RNG), the raw gradients before clipping are equal (torch.equal), so are the
    weights after the two steps, the rollout's log-probs and entropy, and every metric but the times."""
    llama = model == "llama-lora"
    extra = dict(use_lora=True, lora_r=4, gradient_accumulation_steps=2) if llama else {}
    runs = {}
    for skip in (False, True):
        cfg = ppo_config(
            tiny_llama_dir if llama else tiny_model_dir,
            None,
            prompt_file,
            tmp_path / str(skip),
            **ONE_UPDATE,
            **extra,
        )
        runs[skip] = run_steps(cfg, skip=skip, mixed_precision="bf16" if model == "gpt2-bf16" else "no")
    new, old = runs[True], runs[False]
    assert new["old_forwards"] == 0 and old["old_forwards"] == 2 * (2 if llama else 1)  # chunks of micro rows
    assert len(new["grads"]) == len(old["grads"]) == 2 and new["grads"][0].abs().max() > 0
    for a, b in zip(new["grads"], old["grads"]):
        assert torch.equal(a, b)
    for ratio in new["ratios"] + old["ratios"]:
        assert ratio.numel() > 0 and torch.equal(ratio, torch.ones_like(ratio))  # exp(0) = 1 exactly
    for a, b in zip(new["rollouts"], old["rollouts"]):
        for field in ("response", "response_mask", "logprobs", "entropy", "ref_logprobs", "scores"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert new["rollouts"][1].logprobs.abs().sum() > 0  # filled in by the update, not left at zero
    for a, b in zip(new["metrics"], old["metrics"]):
        timing = {k for k in a if k.startswith("time/") or k == "tokens_per_s"}
        assert {k: v for k, v in a.items() if k not in timing} == {
            k: v for k, v in b.items() if k not in timing
        }
    assert new["metrics"][1]["objective/kl"] != 0  # the second step's KL is read from the filled log-probs
    assert new["params"].keys() == old["params"].keys()
    for name, value in new["params"].items():
        assert torch.equal(value, old["params"][name]), name
