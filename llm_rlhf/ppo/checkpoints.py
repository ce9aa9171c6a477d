"""A PPO run's files: checkpoints that continue a run exactly (trainable weights, optimiser, scheduler, the step,
the KL controller and every process's RNG state; written to a temporary folder and renamed), the logs cut back to a
resumed step, and the final policy (an HF folder with its value head or critic, whole weights under ZeRO-3 and FSDP2,
LoRA merged or kept as an adapter) with metrics.json written last."""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import get_peft_model
from safetensors.torch import save_file

from llm_rlhf.core.errors import UserError
from llm_rlhf.core.utils import (
    atomic_write_json,
    last_checkpoint,
    publish_files,
    replace_dir,
    temp_dir_beside,
)
from llm_rlhf.models.accelerated import loading_whole_models
from llm_rlhf.models.loading import (
    PolicyWithValue,
    ValueHead,
)
from llm_rlhf.models.reward_model import (
    save_reward_model,
)
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.ppo.config import Config  # the keys of `llm-rlhf ppo`
from llm_rlhf.ppo.trainer import PPOTrainer


def resume_point(cfg: Config, out: Path, accelerator) -> Path | None:
    """The checkpoint to resume from (resume: the last in output_dir/checkpoints, None when there is none);
    without resume, an output_dir that already holds a run is refused."""
    resume_from = last_checkpoint(out, "step") if cfg.resume else None
    if cfg.resume and resume_from is None and accelerator.is_main_process:
        print(f"resume: no checkpoint in {out / 'checkpoints'}; starting from scratch")
    if not cfg.resume and (out / "metrics.jsonl").exists():
        raise UserError(
            f"output_dir '{out}' already holds a PPO run; pass --resume true or choose another output_dir"
        )
    return resume_from


def read_jsonl(path: Path) -> list[dict]:
    """A JSONL log's lines (none when the file is absent)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def truncate_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint we resume from (they will be written again)."""
    if path.exists():
        lines = [
            ln for ln in path.read_text().splitlines() if ln and json.loads(ln)[ppo_metrics.STEP] <= step
        ]
        path.write_text("".join(ln + "\n" for ln in lines))


def save_final(trainer: PPOTrainer, cfg: Config, out: Path, final: dict) -> None:
    """The policy (`save_policy`), then metrics.json (last)."""
    save_policy(trainer, cfg, out)
    if trainer.accelerator.is_main_process:
        write_final_metrics(out, final)
    trainer.accelerator.wait_for_everyone()


def save_policy(trainer: PPOTrainer, cfg: Config, out: Path, *, merge_copies: bool = False) -> None:
    """The policy as a plain HF causal-LM folder in `out`, the value head beside it (or the separate critic as
    an RM folder in critic/). Every process calls it. merge_copies: with LoRA, merge the adapters into copies
    of the models (merging unloads them in place): the trainer's models keep theirs, for keep_best to load the
    best checkpoint into after saving the last policy."""
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    if accelerator.is_fsdp2 or (trainer.accelerated.zero3 and not cfg.use_lora):
        save_policy_gathered(trainer, out)
        return
    policy = trainer.unwrapped_policy
    if (
        trainer.accelerated.zero3
    ):  # LoRA: the partitions gathered into a whole copy (every process enters the gather)
        policy, merge_copies = whole_lora_policy(trainer), False  # the copy is this function's to merge
    if not accelerator.is_main_process:
        return
    tmp = temp_dir_beside(out / "final")
    lm = policy.lm
    if cfg.use_lora:
        lm.save_pretrained(tmp / "adapter")
        trainer.tokenizer.save_pretrained(tmp / "adapter")
        if cfg.merge_lora:
            lm = (copy.deepcopy(lm) if merge_copies else lm).merge_and_unload()
    if not cfg.use_lora or cfg.merge_lora:
        lm.save_pretrained(tmp, safe_serialization=True)
    trainer.tokenizer.save_pretrained(tmp)
    if policy.value_head is not None:
        save_file(
            {k: v.contiguous() for k, v in policy.value_head.state_dict().items()},
            tmp / "value_head.safetensors",
        )
    if trainer.critic is not None:  # the trained critic, an RM folder (`load_reward_model` reads it)
        critic = trainer.accelerator.unwrap_model(trainer.critic).reward_model
        critic = copy.deepcopy(critic) if merge_copies and cfg.use_lora else critic
        save_reward_model(critic, tmp / "critic", merge_lora=True)
    publish_files(tmp, out)


def write_final_metrics(out: Path, final: dict) -> None:
    atomic_write_json(
        out / "metrics.json", {k: v for k, v in final.items() if not (isinstance(v, float) and math.isnan(v))}
    )
    print(
        json.dumps(
            {
                k: final[k]
                for k in (
                    ppo_metrics.SCORES_FIRST,
                    ppo_metrics.SCORES_LAST,
                    ppo_metrics.SCORES_STD_FIRST,
                    ppo_metrics.KL_LAST,
                    ppo_metrics.KL_TARGET,
                    ppo_metrics.TIME_PER_STEP_S,
                )
            },
            indent=2,
        )
    )


def save_policy_gathered(trainer: PPOTrainer, out: Path) -> None:
    """FSDP2 and ZeRO-3 (parameters sharded): the full policy state gathered from the shards (a collective:
    every process), then the main process writes the same folder as `save_policy`: one full HF causal-LM
    folder and the value head. (LoRA under ZeRO-3 takes `whole_lora_policy` instead; FSDP2 refuses LoRA, and
    both refuse the separate critic: `Accelerated.prepare`.)"""
    policy = trainer.unwrapped_policy
    if trainer.accelerated.zero3:
        # DeepSpeed's consolidated 16-bit weights (the config's zero3_save_16bit_model), on rank 0 only
        state = trainer.accelerator.get_state_dict(trainer.policy)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0 only
        state = get_model_state_dict(policy, options=options)
    if trainer.accelerator.is_main_process:
        tmp = temp_dir_beside(out / "final")
        lm_state = {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
        for name in tied_duplicates(policy.lm):  # e.g. GPT-2's lm_head.weight is wte.weight: saved once
            lm_state.pop(name, None)
        policy.lm.save_pretrained(tmp, state_dict=lm_state, safe_serialization=True)
        trainer.tokenizer.save_pretrained(tmp)
        if policy.value_head is not None:
            head = {
                k.removeprefix("value_head."): v.contiguous()
                for k, v in state.items()
                if k.startswith("value_head.")
            }
            save_file(head, tmp / "value_head.safetensors")
        publish_files(tmp, out)
    trainer.accelerator.wait_for_everyone()


def whole_lora_policy(trainer: PPOTrainer) -> PolicyWithValue | None:
    """ZeRO-3 with LoRA: the policy (peft model and value head) with whole weights, for `save_policy` to write
    the folder the unsharded LoRA path writes (adapter/, the merged model with merge_lora). Every process
    calls it: DeepSpeed's consolidated 16-bit state dict is a gather (keep the config's
    zero3_save_16bit_model true); the main process loads it into a copy built outside ZeRO
    (`loading_whole_models`: the base model from its config, the run's LoRA config, a new value head) in the
    engine's dtype; None on the others."""
    state = trainer.accelerator.get_state_dict(trainer.policy)  # whole on the main process, else None
    if not trainer.accelerator.is_main_process:
        return None
    policy = trainer.unwrapped_policy
    base, lora = policy.lm.get_base_model(), copy.deepcopy(policy.lm.peft_config[policy.lm.active_adapter])
    with loading_whole_models(trainer.accelerator):
        lm = get_peft_model(type(base)(base.config), lora)
        head = None if policy.value_head is None else ValueHead(policy.value_head.summary.in_features)
    whole = PolicyWithValue(lm, head).to(next(iter(state.values())).dtype)
    whole.load_state_dict(state)
    lm.generation_config = copy.deepcopy(base.generation_config)
    return whole.eval()


def tied_duplicates(model: torch.nn.Module) -> list[str]:
    """Names of parameters that are another parameter registered again (tied weights), all but the first
    name of each: what `save_pretrained` leaves out of a folder."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [name for group in names.values() for name in group[1:]]


def save_checkpoint(trainer: PPOTrainer, folder: Path) -> None:
    """Atomically write everything needed to continue exactly: the weights and optimiser state
    (`PPOTrainer.save_model_state`: trainable weights on one process or DDP, every process's shards under
    FSDP2 and DeepSpeed), the trainer's state (`PPOTrainer.state_dict`: the step, which fixes the data
    position, the KL controller and the LR schedule) and every process's RNG state. Every process calls it;
    the folder appears whole (renamed at the end)."""
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    rng_all = (
        accelerator.gather_for_metrics([rng_state()], use_gather_object=True)
        if accelerator.num_processes > 1
        else [rng_state()]
    )
    tmp = folder.with_name(f".{folder.name}.tmp")  # the same path on every process
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    trainer.save_model_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save({**trainer.state_dict(), "rng": rng_all}, tmp / "trainer_state.pt")
        (tmp / "step.json").write_text(json.dumps({"step": trainer.step}))
        replace_dir(tmp, folder)
    accelerator.wait_for_everyone()


def load_checkpoint(trainer: PPOTrainer, folder: Path) -> None:
    """What `save_checkpoint` wrote: the weights and optimiser state, the trainer's state and this process's
    RNG state. A checkpoint from before the trainer's state held the LR schedule kept it beside the
    optimiser state (`optimizer.pt`, or `scheduler.pt` when sharded): it is read from there."""
    trainer.load_model_state(folder)
    state = torch.load(folder / "trainer_state.pt", weights_only=True, map_location="cpu")
    if "scheduler" not in state:
        old = folder / ("scheduler.pt" if (folder / "scheduler.pt").is_file() else "optimizer.pt")
        state["scheduler"] = torch.load(old, weights_only=True, map_location="cpu")["scheduler"]
    trainer.load_state_dict(state)
    set_rng_state(state["rng"][trainer.accelerator.process_index])


def rng_state() -> dict:
    """Python, numpy and torch RNG states as plain tensors/tuples (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
