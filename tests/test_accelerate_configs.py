"""Every accelerate config parses; the ZeRO-3 / FSDP parameter gathering around generation is taken."""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from llm_rlhf import ppo

CONFIGS = Path(__file__).resolve().parents[1] / "accelerate_configs"
EXPECTED = {
    "single_gpu.yaml": "NO",
    "multi_gpu.yaml": "MULTI_GPU",
    "deepspeed_zero2.yaml": "DEEPSPEED",
    "deepspeed_zero3.yaml": "DEEPSPEED",
    "fsdp.yaml": "FSDP",
}


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_parses_with_accelerate(name):
    config = load_config_from_file(str(CONFIGS / name))
    assert str(config.distributed_type).split(".")[-1] == EXPECTED[name]
    if name.startswith("deepspeed"):
        assert config.deepspeed_config["zero_stage"] == int(name[-6])


def fake_trainer(distributed_type, zero_stage=None):
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage))
    policy = SimpleNamespace(lm=torch.nn.Linear(2, 2))
    return SimpleNamespace(
        accelerator=SimpleNamespace(distributed_type=distributed_type, state=state, is_fsdp2=False),
        policy=policy,
    )


def test_zero3_generation_gathers_the_policy_parameters(monkeypatch):
    gathered = []

    @contextmanager
    def GatheredParameters(params):  # noqa: N802 (deepspeed's name)
        gathered.append(params)
        yield

    fake = types.ModuleType("deepspeed")
    fake.zero = SimpleNamespace(GatheredParameters=GatheredParameters)
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    trainer = fake_trainer(DistributedType.DEEPSPEED, zero_stage=3)
    with ppo.PPOTrainer.gathered_for_generation(trainer, trainer.policy):
        pass
    assert len(gathered) == 1 and gathered[0] == list(trainer.policy.lm.parameters())

    gathered.clear()
    trainer = fake_trainer(DistributedType.DEEPSPEED, zero_stage=2)  # ZeRO-2 keeps whole parameters
    with ppo.PPOTrainer.gathered_for_generation(trainer, trainer.policy):
        pass
    assert gathered == []


def test_fsdp_generation_summons_full_parameters(monkeypatch):
    from torch.distributed.fsdp import FullyShardedDataParallel

    summoned = []

    @contextmanager
    def summon_full_params(module, writeback=True, recurse=True, **kwargs):
        summoned.append((module, writeback, recurse))
        yield

    monkeypatch.setattr(FullyShardedDataParallel, "summon_full_params", staticmethod(summon_full_params))
    trainer = fake_trainer(DistributedType.FSDP)
    with ppo.PPOTrainer.gathered_for_generation(trainer, trainer.policy):
        pass
    assert summoned == [(trainer.policy, False, True)]


def test_ddp_generation_gathers_nothing():
    trainer = fake_trainer(DistributedType.MULTI_GPU)
    with ppo.PPOTrainer.gathered_for_generation(trainer, trainer.policy):
        pass


# --- DeepSpeed: accumulation and the ratio guard, with the engine's step semantics ---------------


class StandInDeepSpeedEngine(torch.nn.Module):
    """What the PPO loop relies on of `deepspeed.DeepSpeedEngine` (DeepSpeed cannot be installed on this
    CPU machine), with its semantics: `backward` accumulates into the gradients; `step` does nothing
    unless the accumulation boundary is set, and at the boundary clips to gradient_clipping, steps the
    optimiser and the LR scheduler, then zeroes the gradients; `module` is the wrapped model (what
    accelerate's `unwrap_model` returns). `raw_grads` records the gradient each real step starts from."""

    def __init__(self, module, optimizer, lr_scheduler, gradient_clipping: float):
        super().__init__()
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler
        self.gradient_clipping, self.boundary, self.grad_norm = gradient_clipping, True, None
        self.raw_grads = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_gradient_accumulation_boundary(self, is_boundary: bool):
        self.boundary = is_boundary

    def backward(self, loss):
        loss.backward()

    def step(self):
        if not self.boundary:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.raw_grads.append(torch.cat([p.grad.flatten().clone() for p in params]))
        self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.gradient_clipping)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_global_grad_norm(self):
        return self.grad_norm


def as_deepspeed(trainer, monkeypatch) -> StandInDeepSpeedEngine:
    """The trainer's policy, optimiser and scheduler as `accelerator.prepare` returns them under DeepSpeed:
    the engine as the model, accelerate's DeepSpeed optimizer/scheduler wrappers (whose step and zero_grad
    do nothing), `accelerator.backward` through accelerate's real `DeepSpeedEngineWrapper`."""
    from accelerate.utils.deepspeed import (
        DeepSpeedEngineWrapper,
        DeepSpeedOptimizerWrapper,
        DeepSpeedSchedulerWrapper,
    )

    optimizer = trainer.optimizer.optimizer  # the torch AdamW under accelerate's wrapper
    scheduler = trainer.scheduler.scheduler
    engine = StandInDeepSpeedEngine(trainer.policy, optimizer, scheduler, gradient_clipping=1e9)
    trainer.policy = engine
    trainer.optimizer = DeepSpeedOptimizerWrapper(optimizer)
    trainer.scheduler = DeepSpeedSchedulerWrapper(scheduler, [optimizer])
    accelerator = trainer.accelerator
    accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    plugin = SimpleNamespace(zero_stage=2, deepspeed_config={"gradient_accumulation_steps": 1})  # fp32
    monkeypatch.setattr(accelerator.state, "deepspeed_plugins", plugin, raising=False)
    unwrap = accelerator.unwrap_model
    monkeypatch.setattr(
        accelerator, "unwrap_model", lambda m, **kw: m.module if m is engine else unwrap(m, **kw)
    )
    return engine


def test_deepspeed_accumulates_like_ddp(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    """A minibatch of 8 as 4 micro-batches under the DeepSpeed engine: one engine step, from the same raw
    gradient as the plain one-process loop without accumulation."""
    from test_ppo import make_cfg, one_update, record_raw_grads

    kw = dict(rollout_batch_size=8, mini_batch_size=8, ppo_epochs=1, max_grad_norm=1e9)
    plain = []
    cfg = make_cfg(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "plain", **kw)
    one_update(cfg, lambda trainer: record_raw_grads(trainer, plain))
    engines = []
    cfg = make_cfg(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "ds", gradient_accumulation_steps=4, **kw
    )
    one_update(cfg, lambda trainer: engines.append(as_deepspeed(trainer, monkeypatch)))
    assert len(plain) == 1 and len(engines[0].raw_grads) == 1, "one optimiser step per minibatch"
    torch.testing.assert_close(engines[0].raw_grads[0], plain[0], atol=1e-7, rtol=1e-4)


def test_deepspeed_ratio_guard_takes_no_step(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    from test_ppo import make_cfg, make_trainer

    cfg = make_cfg(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, gradient_accumulation_steps=2, ratio_guard=0.5
    )
    trainer = make_trainer(cfg)
    engine = as_deepspeed(trainer, monkeypatch)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    metrics = trainer.ppo_step()  # rho == 1 > 0.5: every minibatch is skipped
    assert metrics["policy/skipped_minibatches"] == 4 and engine.raw_grads == []
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None or not p.grad.any(), n


def test_deepspeed_config_checks():
    from llm_rlhf.errors import UserError

    sizes = ppo.batch_sizes(rollout_batch_size=8, mini_batch_size=4, gradient_accumulation_steps=2, ppo_epochs=1,
                            steps=1, num_processes=1)  # fmt: skip
    plugin = SimpleNamespace(
        deepspeed_config={"gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}
    )
    ppo.check_deepspeed_config(plugin, sizes, critic=False)
    assert plugin.deepspeed_config == {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 2}
    with pytest.raises(UserError, match="gradient_accumulation_steps must be 1"):
        ppo.check_deepspeed_config(
            SimpleNamespace(deepspeed_config={"gradient_accumulation_steps": 4}), sizes, critic=False
        )
    with pytest.raises(UserError, match="not supported under DeepSpeed"):
        ppo.check_deepspeed_config(plugin, sizes, critic=True)
