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
        accelerator=SimpleNamespace(distributed_type=distributed_type, state=state), policy=policy
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
