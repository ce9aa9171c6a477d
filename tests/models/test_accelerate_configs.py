"""Every accelerate config parses; the ZeRO-3 / FSDP2 parameter gathering around generation is taken; FSDP1 is rejected."""

from __future__ import annotations

import math
import sys
import types
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import accelerate.accelerator
import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from helpers import ROOT, one_update, ppo_config, record_raw_grads, tiny_ppo_trainer

from llm_rlhf.core.errors import UserError
from llm_rlhf.models.accelerated import Accelerated, check_deepspeed_config
from llm_rlhf.ppo import trainer as ppo_trainer

CONFIGS = ROOT / "accelerate_configs"
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
    with Accelerated(trainer.accelerator).gathered_for_generation(trainer.policy):
        pass
    assert len(gathered) == 1 and gathered[0] == list(trainer.policy.lm.parameters())

    gathered.clear()
    trainer = fake_trainer(DistributedType.DEEPSPEED, zero_stage=2)  # ZeRO-2 keeps whole parameters
    with Accelerated(trainer.accelerator).gathered_for_generation(trainer.policy):
        pass
    assert gathered == []


def test_fsdp1_is_rejected_in_one_line_naming_fsdp_version_2():
    """accelerate's default FSDP plugin is version 1; PPO's checkpoints and final save handle FSDP2's shards
    only, so FSDP1 stops before `accelerator.prepare` with one line naming the key to set."""
    prepared = []
    accelerator = SimpleNamespace(
        distributed_type=DistributedType.FSDP, is_fsdp2=False, prepare=lambda *a: prepared.append(a)
    )
    with pytest.raises(UserError) as error:
        Accelerated(accelerator).prepare(
            torch.nn.Linear(2, 2), None, None, frozen=[], micro_batch_size=1, lora=False
        )
    assert "fsdp_version: 2" in str(error.value) and "\n" not in str(error.value) and prepared == []
    # the accelerate config the project ships is FSDP2
    assert load_config_from_file(str(CONFIGS / "fsdp.yaml")).fsdp_config["fsdp_version"] == 2


@pytest.mark.parametrize("kind", ["fsdp2", "deepspeed"])
def test_compiled_sampling_is_refused_under_sharding(kind):
    """sampling_compile compiles the model's own forward, untested under FSDP2's and DeepSpeed's hooks: it
    stops before `accelerator.prepare` with one line naming the key; DDP and one device take it."""
    prepared = []
    distributed = DistributedType.FSDP if kind == "fsdp2" else DistributedType.DEEPSPEED
    accelerator = SimpleNamespace(
        distributed_type=distributed, is_fsdp2=kind == "fsdp2", prepare=lambda *a: prepared.append(a)
    )
    with pytest.raises(UserError) as error:
        Accelerated(accelerator).prepare(
            torch.nn.Linear(2, 2),
            None,
            None,
            frozen=[],
            micro_batch_size=1,
            lora=False,
            sampling_compile=True,
        )
    assert "sampling_compile: false" in str(error.value) and "\n" not in str(error.value) and prepared == []


def test_ddp_generation_gathers_nothing(monkeypatch):
    """DDP (and one process) keep whole parameters: no gather of any kind around generation, and the
    generation inside runs on the policy as it is."""
    from llm_rlhf.models import accelerated

    gathered = []

    @contextmanager
    def recording(kind, *args, **kwargs):
        gathered.append(kind)
        yield

    fake = types.ModuleType("deepspeed")
    fake.zero = SimpleNamespace(GatheredParameters=lambda *a, **kw: recording("zero3"))
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    monkeypatch.setattr(accelerated, "fsdp2_unsharded", lambda *a, **kw: recording("fsdp2"))
    for kind in (DistributedType.MULTI_GPU, DistributedType.NO):
        trainer = fake_trainer(kind)
        before = trainer.policy.lm.weight.detach().clone()
        with Accelerated(trainer.accelerator).gathered_for_generation(trainer.policy):
            ran = trainer.policy.lm(torch.ones(1, 2))  # what generation would call
        assert ran.shape == (1, 2) and torch.equal(trainer.policy.lm.weight, before)
    assert gathered == []
    # the recorder does record: the same call under ZeRO-3 gathers
    trainer = fake_trainer(DistributedType.DEEPSPEED, zero_stage=3)
    with Accelerated(trainer.accelerator).gathered_for_generation(trainer.policy):
        pass
    assert gathered == ["zero3"]


# --- DeepSpeed: accumulation and the ratio guard, with the engine's step semantics ---------------


class StandInDeepSpeedEngine(torch.nn.Module):
    """What the PPO loop relies on of `deepspeed.DeepSpeedEngine` (DeepSpeed cannot be installed on this
    CPU machine), with its semantics: `backward` accumulates into the gradients; `step` does nothing
    unless the accumulation boundary is set, and at the boundary clips to gradient_clipping, steps the
    optimiser, then zeroes the gradients; `module` is the wrapped model (what accelerate's `unwrap_model`
    returns). `raw_grads` records the gradient each real step starts from. No LR scheduler: accelerate hands
    the engine only DeepSpeed's own schedule classes (`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`),
    never a torch LambdaLR such as PPO's."""

    def __init__(self, module, optimizer, gradient_clipping: float):
        super().__init__()
        self.module, self.optimizer = module, optimizer
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
        self.optimizer.zero_grad(set_to_none=True)

    def get_global_grad_norm(self):
        return self.grad_norm


class StandInZero3Engine(StandInDeepSpeedEngine):
    """The stand-in engine with ZeRO-3's partitioned parameters where checkpoints and the final save meet
    them: outside a gather every parameter of the module is empty (DeepSpeed leaves `param.data` without
    elements) and this process's partition lives in the engine (`partitions`; one process here, so the
    whole tensors). `save_checkpoint` / `load_checkpoint` write and read this process's own file (each
    process calls them); `_zero3_consolidated_16bit_state_dict` is a collective every process must enter
    (counted in `gathers`) that returns the whole state dict on rank 0 and None on the others."""

    def __init__(self, module, optimizer, gradient_clipping: float):
        super().__init__(module, optimizer, gradient_clipping)
        self.rank, self.saves, self.gathers = 0, 0, 0
        self.partitions = {k: v.detach().clone() for k, v in module.state_dict().items()}
        for p in module.parameters():
            p.data = torch.empty(0, dtype=p.dtype)

    def states_file(self, folder, tag) -> Path:
        return Path(folder) / tag / f"zero_pp_rank_{self.rank}_states.pt"

    def save_checkpoint(self, save_dir, tag):
        self.saves += 1
        path = self.states_file(save_dir, tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"partitions": self.partitions, "optimizer": self.optimizer.state_dict()}, path)

    def load_checkpoint(self, load_dir, tag):
        path = self.states_file(load_dir, tag)
        state = torch.load(path, weights_only=True)
        self.partitions = state["partitions"]
        self.optimizer.load_state_dict(state["optimizer"])
        return str(path), {}

    def zero_gather_16bit_weights_on_model_save(self):
        return True  # the config's zero3_save_16bit_model: true

    def _zero3_consolidated_16bit_state_dict(self):
        self.gathers += 1
        return {k: v.clone() for k, v in self.partitions.items()} if self.rank == 0 else None


def deepspeed_state(accelerator, monkeypatch, zero_stage: int = 2, mixed_precision: str = "no") -> None:
    """accelerate's state under DeepSpeed: the distributed type, the plugin with its config (where accelerate
    writes mixed_precision, `DeepSpeedPlugin.set_mixed_precision`) and its autocast off (accelerate sets
    `native_amp` only outside DeepSpeed)."""
    from accelerate.utils.deepspeed import (
        DeepSpeedEngineWrapper,
        DeepSpeedOptimizerWrapper,
        DeepSpeedSchedulerWrapper,
    )

    # accelerate.accelerator imports these names only when deepspeed is installed
    for wrapper in (DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper):
        monkeypatch.setattr(accelerate.accelerator, wrapper.__name__, wrapper, raising=False)
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    config = {
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": mixed_precision == "bf16"},
        "fp16": {"enabled": mixed_precision == "fp16"},
    }
    monkeypatch.setattr(accelerator, "deepspeed_config", config, raising=False)
    plugin = SimpleNamespace(zero_stage=zero_stage, deepspeed_config=config)
    monkeypatch.setattr(accelerator.state, "deepspeed_plugins", plugin, raising=False)
    monkeypatch.setattr(accelerator, "native_amp", False)
    # accelerate's autocast is then a null context; the real one would also build a new AcceleratorState,
    # which copies back PartialState's distributed type (NO here, so that reductions stay on this process)
    monkeypatch.setattr(accelerator, "autocast", lambda *args, **kwargs: nullcontext())


def stand_in_engine(accelerator, monkeypatch, model, optimizer, zero_stage: int = 2):
    """The engine and optimizer wrapper `accelerator.prepare` returns under DeepSpeed for `model` and the
    torch `optimizer`: the engine is in the accelerator's list of prepared models (which `save_state` and
    `load_state` go through) and behind `unwrap_model`, `accelerator.backward` runs through accelerate's real
    `DeepSpeedEngineWrapper`, the optimizer wrapper is accelerate's (its step and zero_grad do nothing)."""
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper

    kind = StandInZero3Engine if zero_stage == 3 else StandInDeepSpeedEngine
    engine = kind(model, optimizer, gradient_clipping=1e9)
    wrapped_optimizer = DeepSpeedOptimizerWrapper(optimizer)
    # The wrapper's new AcceleratorState copied the distributed type back from PartialState's, which stays
    # NO (so that reductions stay on this one process): DeepSpeed again.
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
    monkeypatch.setattr(accelerator, "_models", [engine])
    monkeypatch.setattr(accelerator, "_optimizers", [wrapped_optimizer])
    unwrap = accelerator.unwrap_model
    monkeypatch.setattr(
        accelerator, "unwrap_model", lambda m, **kw: m.module if m is engine else unwrap(m, **kw)
    )
    return engine, wrapped_optimizer


def as_deepspeed(trainer, monkeypatch, zero_stage: int = 2) -> StandInDeepSpeedEngine:
    """A trainer built on one process, its policy and optimiser then as `accelerator.prepare` returns them
    under DeepSpeed (fp32). The trainer's scheduler is left as it is: accelerate gives a torch LambdaLR to
    no engine, so `prepare` returns the same for it under DeepSpeed as on one process."""
    deepspeed_state(trainer.accelerator, monkeypatch, zero_stage)
    optimizer = trainer.optimizer.optimizer  # the torch AdamW under accelerate's wrapper
    engine, trainer.optimizer = stand_in_engine(
        trainer.accelerator, monkeypatch, trainer.policy, optimizer, zero_stage
    )
    trainer.policy = trainer.update.policy = trainer.collector.policy = (
        engine  # the trainer's, its update's, its room's
    )
    trainer.update.optimizer = trainer.optimizer
    return engine


def test_deepspeed_accumulates_like_ddp(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    """A minibatch of 8 as 4 micro-batches under the DeepSpeed engine: one engine step, from the same raw
    gradient as the plain one-process loop without accumulation."""

    kw = dict(rollout_batch_size=8, mini_batch_size=8, ppo_epochs=1, max_grad_norm=1e9)
    plain = []
    cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "plain", **kw)
    one_update(cfg, lambda trainer: record_raw_grads(trainer, plain))
    engines = []
    cfg = ppo_config(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "ds", gradient_accumulation_steps=4, **kw
    )
    one_update(cfg, lambda trainer: engines.append(as_deepspeed(trainer, monkeypatch)))
    assert len(plain) == 1 and len(engines[0].raw_grads) == 1, "one optimiser step per minibatch"
    torch.testing.assert_close(engines[0].raw_grads[0], plain[0], atol=1e-7, rtol=1e-4)


def test_deepspeed_ratio_guard_takes_no_step(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    cfg = ppo_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        gradient_accumulation_steps=2,
        ratio_guard=0.5,
        lr_scheduler_type="linear",
    )
    trainer = tiny_ppo_trainer(cfg)
    engine = as_deepspeed(trainer, monkeypatch)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    metrics = trainer.ppo_step()  # rho == 1 > 0.5: every minibatch is skipped
    assert metrics["policy/skipped_minibatches"] == 4 and engine.raw_grads == []
    assert engine.optimizer.param_groups[0]["lr"] == 1e-3  # no step, so no schedule step
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None or not p.grad.any(), n


def test_deepspeed_steps_the_lr_schedule_once_per_optimizer_step(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """lr_scheduler_type: linear under DeepSpeed: the engine steps no torch LambdaLR, so PPO steps it after
    each engine step; one PPO step is 4 of the run's 8 optimiser steps (2 minibatches x 2 epochs, each of 2
    micro-batches), after which the optimiser's lr is half the initial one (not left where it started)."""

    cfg = ppo_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        gradient_accumulation_steps=2,
        lr_scheduler_type="linear",
    )
    trainer = tiny_ppo_trainer(cfg)
    engine = as_deepspeed(trainer, monkeypatch)
    metrics = trainer.ppo_step()
    assert len(engine.raw_grads) == 4
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 4 / 8), rel=1e-12)
    assert metrics["lr"] == engine.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("mixed_precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_deepspeed_mixed_precision_first_step_kl_zero_ratio_one(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch, mixed_precision, dtype
):
    """mixed_precision bf16 (both DeepSpeed configs ship it) or fp16: the engine holds the policy in that
    dtype and accelerate's autocast is off under DeepSpeed, so the reference and the RM must be cast to it,
    or KL != 0 and rho != 1 before the first update. The trainer is built under the stand-in from
    the start (`prepare` returns the engine, which casts the model as DeepSpeed's does); one minibatch per
    step, so the step's ratio and approx-KL are those before any update."""
    from accelerate.scheduler import AcceleratedScheduler

    cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, mini_batch_size=8, ppo_epochs=1)
    original_init = ppo_trainer.PPOTrainer.__init__

    def init_under_deepspeed(self, cfg, *, accelerator, **models):
        deepspeed_state(accelerator, monkeypatch, mixed_precision=mixed_precision)

        def prepare(*objects):
            optimizer = next(o for o in objects if isinstance(o, torch.optim.Optimizer))
            model = objects[0].to(dtype)  # the engine casts the model to its config's bf16/fp16 dtype
            engine, wrapped_optimizer = stand_in_engine(accelerator, monkeypatch, model, optimizer)
            prepared = {id(model): engine, id(optimizer): wrapped_optimizer}
            # a torch scheduler comes back in accelerate's wrapper, as from its DeepSpeed branch
            return tuple(
                prepared[id(o)] if id(o) in prepared else AcceleratedScheduler(o, wrapped_optimizer)
                for o in objects
            )

        monkeypatch.setattr(accelerator, "prepare", prepare)
        original_init(self, cfg, accelerator=accelerator, **models)

    monkeypatch.setattr(ppo_trainer.PPOTrainer, "__init__", init_under_deepspeed)
    trainer = tiny_ppo_trainer(cfg, mixed_precision=mixed_precision)
    assert isinstance(trainer.policy, StandInDeepSpeedEngine)
    first = trainer.ppo_step()
    assert len(trainer.policy.raw_grads) == 1  # the engine took the step
    assert first["objective/kl"] == 0.0
    assert first["policy/ratio"] == 1.0 and first["policy/approxkl"] == 0.0
    for model in (trainer.unwrapped_policy, trainer.ref_model, trainer.collector.scorer.reward_model):
        assert {p.dtype for p in model.parameters()} == {dtype}
    assert all(math.isfinite(first[k]) for k in ("loss/policy", "loss/value", "objective/scores"))
    assert trainer.ppo_step()["objective/kl"] != 0.0  # the policy moved and the KL sees it


def test_deepspeed_config_checks():
    from llm_rlhf.core.errors import UserError

    sizes = ppo_trainer.batch_sizes(
        rollout_batch_size=8,
        mini_batch_size=4,
        gradient_accumulation_steps=2,
        ppo_epochs=1,
        steps=1,
        num_processes=1,
    )
    plugin = SimpleNamespace(
        deepspeed_config={"gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}
    )
    micro = sizes.micro_batch_per_process
    check_deepspeed_config(plugin, micro_batch_size=micro, critic=False)
    assert plugin.deepspeed_config == {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 2}
    with pytest.raises(UserError, match="gradient_accumulation_steps must be 1"):
        check_deepspeed_config(
            SimpleNamespace(deepspeed_config={"gradient_accumulation_steps": 4}),
            micro_batch_size=micro,
            critic=False,
        )
    with pytest.raises(UserError, match="not supported under DeepSpeed"):
        check_deepspeed_config(plugin, micro_batch_size=micro, critic=True)
    with pytest.raises(UserError, match="must not define a scheduler"):
        check_deepspeed_config(
            SimpleNamespace(deepspeed_config={"scheduler": {"type": "WarmupLR"}}),
            micro_batch_size=micro,
            critic=False,
        )


def trained_zero3_trainer(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    """One PPO step on one process, then the policy partitioned under the ZeRO-3 stand-in engine."""

    cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "run", lr_scheduler_type="linear")
    trainer = tiny_ppo_trainer(cfg)
    trainer.ppo_step()
    return cfg, trainer, as_deepspeed(trainer, monkeypatch, zero_stage=3)


def test_zero3_checkpoint_is_the_engines_own(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    """Under ZeRO-3 a process's parameters are its partition (here: empty): the checkpoint is the engine's
    own, written through accelerate's save_state, and a resume restores the engine's partitions, optimiser
    and scheduler, the step and the KL controller."""
    from llm_rlhf.ppo import checkpoints as ppo_checkpoints

    cfg, trainer, engine = trained_zero3_trainer(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
    )
    folder = tmp_path / "run" / "checkpoints" / "step-1"
    saved = {k: v.clone() for k, v in engine.partitions.items()}
    adam, lr = engine.optimizer.state_dict(), trainer.scheduler.get_last_lr()
    kl_ctl = trainer.kl_ctl.state_dict()
    ppo_checkpoints.save_checkpoint(trainer, folder)
    assert engine.saves == 1 and engine.states_file(folder / "deepspeed", "pytorch_model").is_file()

    engine.partitions = {k: torch.zeros_like(v) for k, v in saved.items()}  # what training on would change
    engine.optimizer.state.clear()
    trainer.scheduler.step()
    trainer.step, trainer.kl_ctl.value = 7, 0.5
    ppo_checkpoints.load_checkpoint(trainer, folder)
    assert trainer.step == 1 and trainer.kl_ctl.state_dict() == kl_ctl
    assert trainer.scheduler.get_last_lr() == lr
    for k, v in saved.items():
        assert torch.equal(engine.partitions[k], v), k
    restored = engine.optimizer.state_dict()["state"]
    for i, state in adam["state"].items():
        for name, value in state.items():
            assert torch.equal(restored[i][name], value), (i, name)


def test_zero3_final_save_gathers_on_every_process(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """The final policy under ZeRO-3: every process enters the gather (a collective), rank 0 writes one full
    HF folder from the gathered weights; another rank writes nothing."""
    from accelerate import Accelerator
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llm_rlhf.ppo import checkpoints as ppo_checkpoints

    cfg, trainer, engine = trained_zero3_trainer(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
    )
    final = dict.fromkeys(
        ("scores_first", "scores_last", "scores_std_first", "kl_last", "kl_target", "time_per_step_s"), 0.0
    )
    with monkeypatch.context() as rank1:
        engine.rank = 1
        rank1.setattr(Accelerator, "is_main_process", property(lambda self: False))
        ppo_checkpoints.save_final(trainer, cfg, tmp_path / "rank1", final)
    assert engine.gathers == 1 and not (tmp_path / "rank1").exists()

    engine.rank = 0
    ppo_checkpoints.save_final(trainer, cfg, tmp_path / "rank0", final)
    assert engine.gathers == 2
    saved = load_file(tmp_path / "rank0" / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert saved.keys() == initial.keys()
    for k in saved:
        assert torch.equal(saved[k], engine.partitions[f"lm.{k}"]), k
    assert any(not torch.equal(saved[k], initial[k]) for k in initial)  # the trained weights
    AutoModelForCausalLM.from_pretrained(tmp_path / "rank0")
    head = load_file(tmp_path / "rank0" / "value_head.safetensors")
    assert torch.equal(head["summary.weight"], engine.partitions["value_head.summary.weight"])
