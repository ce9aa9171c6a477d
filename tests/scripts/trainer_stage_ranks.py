"""Run under `accelerate launch` with 1 process, or 2 under multi_gpu.yaml / deepspeed_zero2.yaml /
deepspeed_zero3.yaml: the SFT, RM and DPO stages (TRL's trainers) on a fixed global batch, each run twice.

    python trainer_stage_ranks.py MODEL_DIR SFT_TRAIN SFT_VAL PREF_TRAIN PREF_VAL OUT_DIR [lora]

With `lora` every stage trains a LoRA adapter (LORA: rank 4, no dropout, merged into the saved folder; the
RM's score head trained in full beside it, DPO's reference the policy with the adapter disabled), and the
raw gradient is that of the trainable parameters (the adapter, and the RM's score head).

Each stage trains 2 steps of a global batch of 8 rows (per process 8 / world; the training files hold exactly
8 rows, so every step sees all of them whatever the split across processes, and the gradient of a correctly
scaled loss does not depend on the split), with a checkpoint every step, into OUT_DIR/<stage>/a; then
OUT_DIR/<stage>/b, holding only a's checkpoint-1, resumes to step 2 (`resume: true`). RM and DPO train on
the preference pairs, from MODEL_DIR as SFT does. OUT_DIR/ranks.json
(main process) holds the distributed type, the world size, per stage the RAW gradient of the first update
(whole, flattened in the parameters' order, before clipping) and the main process's local parameter size
(under ZeRO-3 its partitions: smaller than the whole). The logs and final folders are in OUT_DIR.

The raw gradient: on one process and under DDP, read when the Trainer asks accelerate to clip (after DDP's
all-reduce); under DeepSpeed, read from the engine's partitions (`deepspeed.utils.safe_get_full_grad`, a
gather every rank enters) before the engine's step clips and applies it. Under ZeRO-3 this script sets
stage3_param_persistence_threshold, stage3_max_live_parameters and stage3_max_reuse_distance to 0 (every
parameter partitioned, none kept live: the tiny model is under the default thresholds), so that a forward on
the main process alone after training (the stages' sampling and scoring) would hang.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from llm_rlhf.core.utils import use_cpu_ddp_without_gpus
from llm_rlhf.stages import dpo, reward, sft

GLOBAL_BATCH = 8
LORA = dict(use_lora=True, lora_r=4, lora_dropout=0.0, merge_lora=True)
RECORDED: list[dict] = []  # per optimizer step: the raw gradient and the local parameter size


def record_raw_gradients() -> None:
    """Append each optimizer step's raw gradient (see the module docstring) to RECORDED."""
    import accelerate
    from accelerate.utils import DistributedType

    clip = accelerate.Accelerator.clip_grad_norm_

    def record_then_clip(self, parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        if self.distributed_type != DistributedType.DEEPSPEED and max_norm != float("inf"):
            trainable = [p for p in parameters if p.requires_grad]
            RECORDED.append(
                {
                    "grad": torch.cat([p.grad.detach().flatten().clone() for p in trainable]),
                    "local_numel": sum(p.numel() for p in trainable),
                }
            )
        return clip(self, parameters, max_norm, *args, **kwargs)

    accelerate.Accelerator.clip_grad_norm_ = record_then_clip
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad

    step = DeepSpeedEngine.step

    def record_then_step(self, *args, **kwargs):
        if self.is_gradient_accumulation_boundary():
            trainable = [p for p in self.module.parameters() if p.requires_grad]
            RECORDED.append(
                {
                    "grad": torch.cat([safe_get_full_grad(p).detach().flatten().float() for p in trainable]),
                    "local_numel": sum(
                        p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in trainable
                    ),
                }
            )
        return step(self, *args, **kwargs)

    DeepSpeedEngine.step = record_then_step


def shard_everything_under_zero3() -> None:
    """ZeRO-3 with every parameter partitioned and none kept live (see the module docstring)."""
    from accelerate.utils import DeepSpeedPlugin

    post_init = DeepSpeedPlugin.__post_init__

    def post_init_sharding_everything(self):
        post_init(self)
        if self.zero_stage == 3:
            self.deepspeed_config["zero_optimization"].update(
                stage3_param_persistence_threshold=0,
                stage3_max_live_parameters=0,
                stage3_max_reuse_distance=0,
            )

    DeepSpeedPlugin.__post_init__ = post_init_sharding_everything


def stage_twice(module, values: dict, out: Path, world: int, main: bool) -> dict:
    """`module.run` 2 steps into out/a; out/b (a's checkpoint-1 only) resumes to step 2."""
    common = dict(
        max_steps=2,
        max_length=32,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=1e-3,
        warmup_ratio=0.0,
        lr_scheduler_type="constant",
        group_by_length=False,
        logging_steps=1,
        eval_steps=2,
        save_steps=1,
        save_total_limit=2,
        **values,
    )
    RECORDED.clear()
    module.run(module.Config(**common, output_dir=str(out / "a")))
    first = RECORDED[0]
    if main:
        shutil.copytree(
            out / "a" / "checkpoints" / "checkpoint-1", out / "b" / "checkpoints" / "checkpoint-1"
        )
    if world > 1:
        torch.distributed.barrier()  # b's checkpoint is in place
    module.run(module.Config(**common, output_dir=str(out / "b"), resume=True))
    return {"grad": first["grad"].tolist(), "local_numel": first["local_numel"]}


def main() -> None:
    model_dir, sft_train, sft_val, pref_train, pref_val, out = sys.argv[1:7]
    out = Path(out)
    lora = LORA if sys.argv[7:] == ["lora"] else {}
    use_cpu_ddp_without_gpus()
    shard_everything_under_zero3()
    record_raw_gradients()
    from accelerate import PartialState

    state = PartialState()
    world, is_main = state.num_processes, state.is_main_process
    record = {
        "sft": stage_twice(
            sft,
            dict(
                model_name_or_path=model_dir,
                train_file=sft_train,
                eval_file=sft_val,
                num_samples=4,
                max_new_tokens=4,
                **lora,
            ),
            out / "sft",
            world,
            is_main,
        ),
        "rm": stage_twice(
            reward,
            dict(
                model_name_or_path=model_dir,
                train_file=pref_train,
                eval_file=pref_val,
                test_file=None,
                normalization_samples=8,
                disable_dropout=True,
                **lora,
            ),
            out / "rm",
            world,
            is_main,
        ),
        "dpo": stage_twice(
            dpo,
            dict(model_name_or_path=model_dir, train_file=pref_train, eval_file=pref_val, **lora),
            out / "dpo",
            world,
            is_main,
        ),
    }
    from accelerate.state import AcceleratorState

    if is_main:
        record.update(world=world, distributed_type=AcceleratorState().distributed_type.value)
        (out / "ranks.json").write_text(json.dumps(record))
    if world > 1:
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # as `llm-rlhf` leaves a data-parallel run (utils.exit_process)


if __name__ == "__main__":
    main()
