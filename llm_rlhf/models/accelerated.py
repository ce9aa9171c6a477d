"""The PPO trainer's models under accelerate: the precision and sharding plumbing, apart from the algorithm
(`llm_rlhf.ppo.trainer`), so that each distributed type's rules live in one place.

    check_deepspeed_config   what the DeepSpeed config must say for PPO's own accumulation and LR schedule
    loading_whole_models     PPO's models loaded whole on every process under ZeRO-3 (not under zero.Init)
    outside_zero_init        models loaded on one process alone while ZeRO-3 is registered (the eval stage)
    Accelerated              one accelerator's ways with the policy (and critic):
        prepare              the checks of the distributed type (FSDP1 rejected), then `accelerator.prepare`; the frozen
                             reference and RM cast to the dtype the policy computes in (FSDP2's param_dtype,
                             DeepSpeed's engine dtype); FSDP2's root set up
        autocast             bf16 autocast (`bf16`) or accelerate's (`mixed_precision`)
        checkpointing        gradient checkpointing for a training forward
        gathered_for_generation  ZeRO-3 / FSDP2 parameters gathered whole for `generate` (FSDP1 is rejected)
        accumulating         no gradient all-reduce before a minibatch's last micro-batch
        backward, clip_gradients, discard_gradients   what a DeepSpeed engine does itself
        save_model_state / load_model_state   the weights and optimiser state of a checkpoint: trainable
                             weights as safetensors (one process), torch's distributed checkpoint (FSDP2) or the
                             engine's own (DeepSpeed)

Every rule here exists so that KL = 0 and ratio = 1 hold at the first step and the update equals DDP's
under every accelerate config of accelerate_configs/ (one device, DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import GradientCheckpointingLayer

from llm_rlhf.core.errors import UserError


def check_deepspeed_config(plugin, *, micro_batch_size: int, critic: bool) -> None:
    """Under DeepSpeed the PPO loop accumulates micro-batches itself (`Accelerated.backward`): the engine
    must not divide the loss by an accumulation count of its own, and it is told the micro-batch size
    (there is no dataloader for accelerate to read it from). The LR schedule is PPO's (`PPOUpdate.optimizer_step`),
    so the config has none."""
    if critic:
        raise UserError(
            "value_model: 'reward' is not supported under DeepSpeed (accelerate builds one DeepSpeed engine "
            "per Accelerator); use value_model: policy"
        )
    config = plugin.deepspeed_config
    if config.get("gradient_accumulation_steps", 1) not in (1, "auto"):
        raise UserError(
            "the DeepSpeed config's gradient_accumulation_steps must be 1: set gradient_accumulation_steps "
            "in the PPO config instead (the PPO loop accumulates micro-batches itself)"
        )
    config["gradient_accumulation_steps"] = 1
    if "scheduler" in config:
        raise UserError(
            "the DeepSpeed config must not define a scheduler: the engine would step it as well as PPO's own; "
            "set lr_scheduler_type in the PPO config instead"
        )
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = micro_batch_size


@contextmanager
def loading_whole_models(accelerator):
    """The context to load PPO's models in: under DeepSpeed ZeRO-3 accelerate registers its config with
    transformers, which then builds every model under `deepspeed.zero.Init` (parameters partitioned as they
    load; accelerate 1.15 registers it whatever `zero3_init_flag` says). The frozen reference (a copy of the
    policy) and the RM are never handed to an engine, so they would stay empty partitions: PPO loads all of
    them whole on every process (the ZeRO-3 engine partitions the policy when it is built, in `prepare`),
    and the registration is restored after. Elsewhere nothing changes."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


@contextmanager
def outside_zero_init():
    """The context for one process to load and run models alone while DeepSpeed ZeRO-3 is registered with
    transformers (the evaluation stage, whose main process evaluates while the others wait): every stage
    that built a ZeRO-3 Accelerator earlier in the process (`llm-rlhf pipeline`: SFT, RM, PPO) leaves
    accelerate's config registered, and `from_pretrained` would then build the model under
    `deepspeed.zero.Init`, a collective the waiting processes never enter: the evaluation hung there
    (the stack dump showed the main process in zero.Init's module __init__, the others at the
    stage's barrier). The registration is restored after. Elsewhere nothing changes."""
    from transformers.integrations import deepspeed as hf_deepspeed

    if not hf_deepspeed.is_deepspeed_zero3_enabled():
        yield
        return
    registered = hf_deepspeed._hf_deepspeed_config_weak_ref()  # held alive by accelerate's DeepSpeed plugin
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(registered)


def deepspeed_param_dtype(config: dict) -> torch.dtype | None:
    """The dtype the DeepSpeed engine casts the model to: its config's bf16 (alias bfloat16) or fp16 section,
    where accelerate writes `mixed_precision` (`DeepSpeedPlugin.set_mixed_precision`); None for fp32."""
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        if str(config.get(key, {}).get("enabled", False)).lower() == "true":
            return dtype
    return None


class Accelerated:
    """One accelerator's ways with the policy: what differs between one process, DDP, DeepSpeed (ZeRO-2/3),
    FSDP2 and FSDP, and between precisions. The models are passed in, not held: the trainer owns them.

    bf16: the PPO config's bf16 autocast; gradient_checkpointing: its gradient_checkpointing."""

    def __init__(self, accelerator, *, bf16: bool = False, gradient_checkpointing: bool = False):
        self.accelerator, self.bf16, self.gradient_checkpointing = accelerator, bf16, gradient_checkpointing

    @property
    def deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    @property
    def zero3(self) -> bool:
        """DeepSpeed ZeRO-3: each process holds only its partition of every parameter."""
        return self.deepspeed and self.accelerator.state.deepspeed_plugin.zero_stage == 3

    # --- building ---------------------------------------------------------------------------------

    def prepare(
        self,
        policy,
        critic,
        optimizer,
        *,
        frozen: list,
        micro_batch_size: int,
        lora: bool,
        sampling_compile: bool = False,
    ):
        """`accelerator.prepare` of the policy (and critic) with the optimiser, after the checks of this
        distributed type; then the `frozen` models (the reference, the RM) in the dtype the policy computes in,
        and FSDP2's root set up. Returns (policy, critic, optimizer), critic None without one."""
        accelerator = self.accelerator
        if sampling_compile and (accelerator.is_fsdp2 or self.deepspeed):
            # the compiled step would trace the model's own forward with sharded (or gathered) parameters,
            # which FSDP2's and DeepSpeed's hooks manage around it: untested, so refused
            raise UserError(
                "sampling_compile is supported on one device and with DDP, not under FSDP2 or DeepSpeed: "
                "set sampling_compile: false"
            )
        if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
            # FSDP1 (accelerate's default fsdp_version) would train, but checkpoints and the final save take
            # the one-process branch on sharded weights: reject it rather than save shards wrongly.
            raise UserError(
                "FSDP version 1 is not supported by PPO: set `fsdp_version: 2` under fsdp_config in the "
                "accelerate config (see accelerate_configs/fsdp.yaml)"
            )
        if accelerator.is_fsdp2 and (lora or critic is not None):
            raise UserError(
                "FSDP2 runs full fine-tuning with the policy's value head; use_lora and value_model: reward are "
                "not supported under it yet (use DDP or DeepSpeed for them)"
            )
        if self.deepspeed:
            check_deepspeed_config(
                accelerator.state.deepspeed_plugin,
                micro_batch_size=micro_batch_size,
                critic=critic is not None,
            )
        if critic is not None:
            policy, critic, optimizer = accelerator.prepare(policy, critic, optimizer)
        else:
            policy, optimizer = accelerator.prepare(policy, optimizer)
        for dtype in (self.fsdp2_param_dtype(), self.engine_dtype()):
            # FSDP2's MixedPrecisionPolicy (mixed_precision: bf16) computes with the policy's parameters cast
            # to param_dtype, norms and embeddings included, which autocast alone does not do; a DeepSpeed
            # engine holds the policy in bf16/fp16 and accelerate's autocast is off under DeepSpeed. Either
            # way: the same weights for the reference and the RM, or KL != 0 and rho != 1 at the first step.
            # With LoRA the reference is the policy's own network, already cast.
            if dtype is not None:
                for model in frozen:
                    model.to(dtype)
        return policy, critic, optimizer

    def fsdp2_param_dtype(self) -> torch.dtype | None:
        if (
            self.accelerator.is_fsdp2
            and self.accelerator.state.fsdp_plugin.mixed_precision_policy is not None
        ):
            return self.accelerator.state.fsdp_plugin.mixed_precision_policy.param_dtype
        return None

    def engine_dtype(self) -> torch.dtype | None:
        if not self.deepspeed:
            return None
        return deepspeed_param_dtype(self.accelerator.state.deepspeed_plugin.deepspeed_config)

    def set_up_root(self, policy, token_id: int) -> None:
        """FSDP2 sets up its root unit at the root's first forward; generation calls the LM below the root
        (`fsdp2_unsharded`), so run that first forward now, on every process. Nothing elsewhere."""
        if self.accelerator.is_fsdp2:
            with torch.no_grad():
                one = torch.ones((1, 1), dtype=torch.long, device=self.accelerator.device)
                policy(one * token_id, one)

    # --- forwards ---------------------------------------------------------------------------------

    def autocast(self):
        """bf16 autocast with --bf16, else accelerate's autocast under its `mixed_precision` (bf16/fp16 in
        the sharded configs): `prepare` wraps the policy's forward in it, and the reference, the RM and
        generation must run in the same precision, or KL != 0 and rho != 1 at the first step."""
        if self.bf16:
            return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16)
        if self.accelerator.mixed_precision != "no":
            return self.accelerator.autocast()
        return nullcontext()

    @contextmanager
    def checkpointing(self, lm, train: bool):
        """Gradient checkpointing for a training forward of `lm`. transformers checkpoints a layer only while
        that layer is in training mode, and the policy stays in eval mode (dropout off), so the option did
        nothing: flag the checkpointed layers alone as training (their submodules, dropout included,
        stay in eval mode), and only for the training forward (generation keeps its KV cache)."""
        if not (train and self.gradient_checkpointing):
            yield
            return
        layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
        for layer in layers:
            layer.training = True
        try:
            yield
        finally:
            for layer in layers:
                layer.training = False

    @contextmanager
    def gathered_for_generation(self, policy):
        """ZeRO-3 / FSDP2 shard parameters: gather them once for the many small forwards of generation
        (each rank then generates on its own, so ranks that finish early wait for nobody). `policy`: the
        `PolicyWithValue` (unwrapped) whose `lm` generates."""
        accelerator = self.accelerator
        if (
            accelerator.distributed_type == DistributedType.DEEPSPEED
            and accelerator.state.deepspeed_plugin.zero_stage == 3
        ):
            import deepspeed  # optional dependency (the deepspeed extra), needed only under ZeRO-3

            with deepspeed.zero.GatheredParameters(list(policy.lm.parameters())):
                yield
        elif accelerator.is_fsdp2:
            with fsdp2_unsharded(policy):
                yield
        else:  # FSDP1 never gets here: `prepare` rejects it
            yield

    # --- updates ----------------------------------------------------------------------------------

    @contextmanager
    def accumulating(self, models, *, last: bool):
        """Around the forward and backward of one micro-batch: gradients are all-reduced only in the
        backward of a minibatch's last micro-batch (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`
        through `accelerator.no_sync`), so accumulation does not pay one all-reduce per micro-batch.
        `models`: the prepared policy and critic (None entries are skipped)."""
        if last or self.accelerator.num_processes == 1:
            yield
            return
        with ExitStack() as stack:
            for model in models:
                if model is not None:
                    stack.enter_context(self.accelerator.no_sync(model))
            yield

    def backward(self, policy, loss: torch.Tensor, *, last: bool) -> None:
        """`accelerator.backward`, except under DeepSpeed: there it also steps the engine after every
        micro-batch (accelerate's sync_gradients stays True in this loop), so there is no accumulation and
        the ratio guard could not undo a step already taken. Under DeepSpeed the engine's own backward runs,
        its accumulation boundary (where ZeRO reduces the gradients) at the minibatch's last micro-batch,
        and the step waits for the guard (`clip_gradients`), as under DDP."""
        if self.deepspeed:
            policy.set_gradient_accumulation_boundary(last)
            policy.backward(loss)  # the engine divides by its gradient_accumulation_steps: 1 (checked)
        else:
            self.accelerator.backward(loss)

    def clip_gradients(self, policy, parameters, max_grad_norm: float) -> torch.Tensor | None:
        """Clip the gradients to max_grad_norm and return their norm (before clipping), for the caller to
        check before it steps the optimiser. Under DeepSpeed the engine's step does both here: it clips (at
        its config's gradient_clipping, not max_grad_norm) and steps the optimiser, and the norm is read
        after it."""
        if self.deepspeed:
            policy.step()
            return policy.get_global_grad_norm()
        return self.accelerator.clip_grad_norm_(parameters, max_grad_norm)

    def discard_gradients(self, policy, optimizer) -> None:
        """Drop the accumulated gradients of a skipped minibatch (under DeepSpeed they live in the engine's
        optimizer; accelerate's optimizer wrapper does nothing there)."""
        optimizer.zero_grad(set_to_none=True)
        if self.deepspeed:
            policy.optimizer.zero_grad()

    # --- checkpoints ------------------------------------------------------------------------------

    def save_model_state(self, folder: Path, *, policy, critic, optimizer) -> None:
        """The weights and the optimiser state of a checkpoint, into `folder` (the same path on every process):
        - one process or DDP: the main process writes the trainable weights (`policy_trainable.safetensors`,
          `critic_trainable.safetensors`) and the optimiser state (`optimizer.pt`);
        - FSDP2: every process its shards of the policy and of the optimiser state, torch's distributed
          checkpoint (`sharded/`, loadable at another process count);
        - DeepSpeed: accelerate's `save_state` (`deepspeed/`): the engine's own checkpoint on every process
          (under ZeRO its partitions of the weights and of the optimiser state).
        `policy`, `critic`, `optimizer`: as `prepare` returned them."""
        unwrap = self.accelerator.unwrap_model
        if self.deepspeed:
            self.accelerator.save_state(str(folder / "deepspeed"))
        elif self.accelerator.is_fsdp2:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(unwrap(policy), optimizer.optimizer)
            dcp.save(
                {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / "sharded")
            )
        elif self.accelerator.is_main_process:
            save_file(trainable_state(unwrap(policy)), folder / "policy_trainable.safetensors")
            if critic is not None:
                save_file(trainable_state(unwrap(critic)), folder / "critic_trainable.safetensors")
            torch.save({"optimizer": optimizer.state_dict()}, folder / "optimizer.pt")

    def load_model_state(self, folder: Path, *, policy, critic, optimizer) -> None:
        """What `save_model_state` wrote, into the prepared models and optimiser (every process)."""
        unwrap = self.accelerator.unwrap_model
        if self.deepspeed:
            self.accelerator.load_state(
                str(folder / "deepspeed")
            )  # the engine's load_checkpoint: its partitions
        elif self.accelerator.is_fsdp2:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model, inner = unwrap(policy), optimizer.optimizer
            model_state, optimizer_state = get_state_dict(model, inner)
            state = {"model": model_state, "optimizer": optimizer_state}
            dcp.load(state, checkpoint_id=str(folder / "sharded"))
            set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        else:
            loaded = unwrap(policy).load_state_dict(
                load_file(folder / "policy_trainable.safetensors"), strict=False
            )
            if loaded.unexpected_keys:
                raise UserError(
                    f"checkpoint {folder} does not match the model: unexpected {loaded.unexpected_keys[:3]}"
                )
            if critic is not None:
                unwrap(critic).load_state_dict(
                    load_file(folder / "critic_trainable.safetensors"), strict=False
                )
            optimizer.load_state_dict(
                torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")["optimizer"]
            )


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of `model` by name, contiguous, on the CPU: what a checkpoint keeps of it."""
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


@contextmanager
def fsdp2_unsharded(model):
    """Every FSDP2 unit of `model` (`fully_shard`) all-gathered once and kept whole: no forward inside
    runs a collective (generation calls the LM many times and each process stops at its own length, and
    the LM is called below the root unit, whose pre-forward gather would not run). Resharded at the end."""
    from torch.distributed.fsdp import FSDPModule  # here: torch.distributed is missing from some builds

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)
