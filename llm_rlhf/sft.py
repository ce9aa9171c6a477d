"""Stage 1, supervised fine-tuning: next-token cross-entropy on the completion tokens only, EOS included.

Built on TRL's `SFTTrainer` (prompt-completion format with `completion_only_loss=True`): TRL appends the
EOS to every completion and builds the labels from a completion mask at tokenization time, so the real
EOS stays a label even when pad == eos (GPT-2); the collator pads labels with -100 (pinned by a test).
Full fine-tuning or LoRA (peft); a LoRA adapter is merged into a plain HF folder when `merge_lora`.

Outputs in `output_dir`: config.yaml, log.jsonl, checkpoints/, the final model (a standard HF folder:
safetensors, config, tokenizer, generation config; or an adapter folder when LoRA is not merged),
samples.jsonl, and metrics.json written last (its presence marks the stage done).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path

import torch

from llm_rlhf.config import format_config, help_field, require, save_config
from llm_rlhf.data import DATA_FORMATS
from llm_rlhf.errors import ConfigError, UserError
from llm_rlhf.utils import (
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    publish_files,
    seed_everything,
    temp_dir_beside,
)

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay")  # fmt: skip
REPORT_TO = ("none", "tensorboard", "wandb")
SAMPLE_BATCH_SIZE = 32  # generation batch for the eos_rate samples (larger batches were slower on CPU)


@dataclasses.dataclass
class Config:
    # --- model and data ---
    model_name_or_path: str = help_field(
        "data/reviews/base_model", "Base causal LM: a hub name or a local HF folder."
    )
    train_file: str = help_field(
        "data/reviews/sft_train.jsonl",
        "Demonstrations: .jsonl/.json/.csv/.parquet or a hub dataset (prompt/completion, messages or text).",
    )
    eval_file: str = help_field(
        "data/reviews/sft_val.jsonl",
        "Held-out demonstrations for eval loss/perplexity; their prompts are sampled at the end.",
    )
    train_split: str = help_field("train", "Split of train_file when it is a hub dataset.")
    eval_split: str = help_field("test", "Split of eval_file when it is a hub dataset.")
    data_format: str = help_field(
        "auto",
        "Schema of train_file and eval_file: 'auto' (detected from the columns) or 'hh' (Anthropic/hh-rlhf "
        "chosen/rejected dialogues, also detected by 'auto': trains on `chosen`, the prompt up to and "
        "including its last '\\n\\nAssistant:', the completion the rest).",
    )
    skip_long: bool = help_field(
        False,
        "Leave out (and count) examples whose prompt leaves no room for a response within max_length; "
        "false = stop with an error naming the row.",
    )
    output_dir: str = help_field(
        "runs/reviews/sft", "Where the model, checkpoints/, samples.jsonl and metrics.json go."
    )
    max_length: int = help_field(
        96, "Tokens per training sequence (prompt + completion + EOS); longer ones are cut at the end."
    )
    trust_remote_code: bool = help_field(
        False, "Allow model/tokenizer code from the hub (off: only trusted architectures)."
    )
    # --- optimisation ---
    learning_rate: float = help_field(5e-4, "Peak AdamW learning rate.")
    num_train_epochs: float = help_field(1.0, "Passes over train_file (ignored when max_steps > 0).")
    max_steps: int = help_field(-1, "Optimizer steps to run; -1 = use num_train_epochs.")
    per_device_train_batch_size: int = help_field(32, "Sequences per device per micro-batch.")
    per_device_eval_batch_size: int = help_field(64, "Sequences per device per evaluation batch.")
    gradient_accumulation_steps: int = help_field(1, "Micro-batches per optimizer step.")
    warmup_ratio: float = help_field(0.05, "Fraction of the steps with a linear warm-up from 0, in [0, 1).")
    lr_scheduler_type: str = help_field(
        "cosine", f"Learning-rate schedule after warm-up: one of {', '.join(SCHEDULERS)}."
    )
    weight_decay: float = help_field(0.0, "AdamW weight decay.")
    max_grad_norm: float = help_field(1.0, "Gradient clipping (global L2 norm).")
    seed: int = help_field(42, "Seed for python, numpy, torch, data order and LoRA init.")
    dtype: str = help_field("float32", "Weights dtype: float32, bfloat16 or float16.")
    bf16: bool = help_field(False, "bfloat16 autocast (mixed precision) during training.")
    gradient_checkpointing: bool = help_field(
        False, "Recompute activations in the backward pass to save memory."
    )
    group_by_length: bool = help_field(
        True, "Batch sequences of similar length together (less padding, faster); batches stay shuffled."
    )
    # --- LoRA ---
    use_lora: bool = help_field(False, "Train a LoRA adapter (peft) instead of all weights.")
    lora_r: int = help_field(16, "LoRA rank.")
    lora_alpha: int = help_field(32, "LoRA scaling numerator (scale = lora_alpha / lora_r).")
    lora_dropout: float = help_field(0.05, "Dropout on the LoRA branch.")
    lora_target_modules: list[str] = help_field(
        ["all-linear"],
        "Modules that get adapters ('all-linear' = every linear/Conv1D layer but the LM head).",
    )
    merge_lora: bool = help_field(
        True,
        "Merge the adapter into the weights and save a plain HF folder (what the RM/PPO stages expect); false = save the adapter folder.",
    )
    # --- logging and checkpoints ---
    logging_steps: int = help_field(
        10, "Log the training loss every N optimizer steps (console, log.jsonl, report_to)."
    )
    eval_steps: int = help_field(100, "Evaluate on eval_file every N steps; 0 = only at the end.")
    save_steps: int = help_field(100, "Write a checkpoint to output_dir/checkpoints every N steps.")
    save_total_limit: int = help_field(2, "Checkpoints to keep (the oldest are deleted).")
    resume: bool = help_field(False, "Continue from the last checkpoint in output_dir/checkpoints.")
    report_to: str = help_field("none", "Also send metrics to: none, tensorboard or wandb.")
    # --- end-of-stage sampling (the eos_rate measurement) ---
    num_samples: int = help_field(
        64, "Responses sampled from eval prompts at the end (eos_rate, samples.jsonl); 0 = none."
    )
    max_new_tokens: int = help_field(48, "Sampling: at most this many response tokens.")
    temperature: float = help_field(1.0, "Sampling temperature; 0 = greedy.")
    top_k: int = help_field(0, "Sampling: keep the k most likely tokens; 0 = off.")
    top_p: float = help_field(1.0, "Sampling: nucleus probability mass; 1.0 = off.")

    def __post_init__(self):
        require(self.max_length >= 4, "max_length", "must be at least 4 tokens")
        require(self.data_format in DATA_FORMATS, "data_format", f"must be one of {', '.join(DATA_FORMATS)}")
        require(self.learning_rate > 0, "learning_rate", "must be > 0")
        require(
            self.max_steps > 0 or self.num_train_epochs > 0,
            "num_train_epochs",
            "must be > 0 (or set max_steps)",
        )
        for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                    "logging_steps", "save_steps", "save_total_limit", "max_new_tokens"):  # fmt: skip
            require(getattr(self, key) >= 1, key, "must be >= 1")
        require(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        require(
            self.lr_scheduler_type in SCHEDULERS,
            "lr_scheduler_type",
            f"must be one of {', '.join(SCHEDULERS)}",
        )
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.max_grad_norm > 0, "max_grad_norm", "must be > 0")
        require(
            self.dtype in ("float32", "bfloat16", "float16"), "dtype", "must be float32, bfloat16 or float16"
        )
        require(self.eval_steps >= 0, "eval_steps", "must be >= 0")
        require(self.report_to in REPORT_TO, "report_to", f"must be one of {', '.join(REPORT_TO)}")
        require(self.lora_r >= 1, "lora_r", "must be >= 1")
        require(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        require(len(self.lora_target_modules) > 0, "lora_target_modules", "needs at least one module name")
        require(self.num_samples >= 0, "num_samples", "must be >= 0")
        require(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        require(self.top_k >= 0, "top_k", "must be >= 0 (0 = off)")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")


# ---------------------------------------------------------------------------------------------------
# Inputs: everything is validated before anything is written
# ---------------------------------------------------------------------------------------------------


def _check_model_path(name_or_path: str) -> None:
    """A path-like name that is not a folder is a typo, not a hub id: say so without a network round trip."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise UserError(f"model_name_or_path '{name_or_path}': no such folder")


def _check_report_to(report_to: str) -> None:
    import importlib.util

    needs = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}.get(report_to, ())
    if needs and not any(importlib.util.find_spec(m) for m in needs):
        raise ConfigError(
            f"config key 'report_to': '{report_to}' is not installed (pip install 'llm-rlhf[{report_to}]')"
        )


def last_checkpoint(output_dir: str | Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(output_dir) / "checkpoints"
    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def load_inputs(cfg: Config):
    """Tokenizer, datasets and model, all checked; returns (tokenizer, model, train_dataset, eval_dataset)."""
    from llm_rlhf.data import load_sft_dataset
    from llm_rlhf.models import load_causal_lm, load_tokenizer

    _check_report_to(cfg.report_to)
    checkpoint = last_checkpoint(cfg.output_dir)
    if cfg.resume and checkpoint is None:
        raise UserError(
            f"--resume: no checkpoint in '{Path(cfg.output_dir) / 'checkpoints'}' to continue from"
        )
    if not cfg.resume and checkpoint is not None:
        raise UserError(
            f"output_dir '{cfg.output_dir}' already holds checkpoints of a run; continue it with --resume true "
            "or choose another --output_dir"
        )
    _check_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    rules = {"max_length": cfg.max_length, "data_format": cfg.data_format, "skip_long": cfg.skip_long}
    train = load_sft_dataset(cfg.train_file, tokenizer, split=cfg.train_split, **rules)
    val = load_sft_dataset(cfg.eval_file, tokenizer, split=cfg.eval_split, **rules)
    model = load_causal_lm(cfg.model_name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    return tokenizer, model, train, val


# ---------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------


def _log_callback(path: Path):
    from transformers import TrainerCallback

    class JsonlLog(TrainerCallback):
        """Every Trainer log line (train loss, eval loss, learning rate...) appended to log.jsonl."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                append_jsonl(path, {"step": state.global_step, "epoch": state.epoch, **logs})

    return JsonlLog()


def lora_config(cfg: Config, model):
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    targets = cfg.lora_target_modules
    return LoraConfig(
        # GPT-2 stores its linear layers transposed (Conv1D); peft would flip this itself, with a warning
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        task_type="CAUSAL_LM",
    )


def training_args(cfg: Config):
    """TRL's SFTConfig (TrainingArguments) from our flat config; creating it sets up the distributed state."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=str(Path(cfg.output_dir) / "checkpoints"),
        max_length=cfg.max_length,
        completion_only_loss=True,  # labels = -100 on the prompt, built from a completion mask (not from pad ids)
        packing=False,
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        per_device_eval_batch_size=SAMPLE_BATCH_SIZE,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        warmup_steps=cfg.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of the total steps
        lr_scheduler_type=cfg.lr_scheduler_type,
        train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
        bf16=cfg.bf16,  # SFTConfig defaults to bf16=True and gradient_checkpointing=True: always set both
        fp16=False,
        gradient_checkpointing=cfg.gradient_checkpointing,
        logging_steps=cfg.logging_steps,
        eval_strategy="steps" if cfg.eval_steps > 0 else "no",
        eval_steps=cfg.eval_steps if cfg.eval_steps > 0 else None,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit,
        report_to=[] if cfg.report_to == "none" else [cfg.report_to],
        # without an accelerator, say "CPU" so that `accelerate launch` (WORLD_SIZE > 1) runs DDP over gloo
        use_cpu=not (torch.cuda.is_available() or torch.backends.mps.is_available()),
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        pad_to_multiple_of=None,
        trust_remote_code=cfg.trust_remote_code,
    )


def build_trainer(cfg: Config, model, tokenizer, train_dataset, eval_dataset, args=None):
    """TRL's SFTTrainer on prompt/completion rows: completion-only loss, EOS appended by TRL."""
    from trl import SFTTrainer

    return SFTTrainer(
        model=model,
        args=args if args is not None else training_args(cfg),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=lora_config(cfg, model) if cfg.use_lora else None,
        callbacks=[_log_callback(Path(cfg.output_dir) / "log.jsonl")],
    )


# ---------------------------------------------------------------------------------------------------
# Sampling: does the model stop?
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float, top_k: int,
                     top_p: float, batch_size: int = 32) -> list[dict]:  # fmt: skip
    """Sample one response per prompt, batched with left padding.

    Returns one dict per prompt: prompt, response (decoded, EOS not included), ended_with_eos (the model
    emitted EOS within max_new_tokens), num_tokens (response tokens before the EOS). An empty prompt
    starts from the BOS token (the EOS for GPT-2).
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": top_k or None, "top_p": top_p}
        if temperature > 0
        else {"do_sample": False}
    )
    results = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        encoded = [tokenizer(p)["input_ids"] or [start] for p in batch]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor(
            [[pad] * (width - len(ids)) + ids for ids in encoded], device=device
        )  # (B, T) left-padded
        attention_mask = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device
        )
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            **sampling,
        )
        for prompt, tokens in zip(batch, output[:, width:].tolist()):  # (B, new) response tokens only
            n = tokens.index(eos) if eos in tokens else len(tokens)  # tokens after the EOS are padding
            results.append(
                {
                    "prompt": prompt,
                    "response": tokenizer.decode(tokens[:n], skip_special_tokens=True),
                    "ended_with_eos": n < len(tokens),
                    "num_tokens": n,
                }  # fmt: skip
            )
    model.train(was_training)
    return results


# ---------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------


def _save_final_model(model, tokenizer, folder: Path, *, merge: bool):
    """A standard HF folder: full weights (LoRA merged when asked) or the adapter, plus the tokenizer.
    Returns the model as saved (merged when merged)."""
    from peft import PeftModel

    if isinstance(model, PeftModel) and merge:
        model = model.merge_and_unload()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    if isinstance(model, PeftModel):  # the adapter folder alone: keep the generation config next to it
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def run(cfg: Config) -> dict[str, float | None]:
    """Validate inputs, train with SFTTrainer, evaluate, save the model, sample, write metrics.json."""
    started = time.time()
    tokenizer, model, train_dataset, eval_dataset = load_inputs(cfg)
    output_dir = Path(cfg.output_dir)
    checkpoint = last_checkpoint(output_dir) if cfg.resume else None

    args = training_args(cfg)
    main = args.process_index == 0
    if main:
        print(format_config(cfg), flush=True)
        save_config(cfg, output_dir)  # the first write: every input is valid by now
        (output_dir / "metrics.json").unlink(missing_ok=True)  # a rerun is not done until it writes it again
    seed_everything(cfg.seed)
    trainer = build_trainer(cfg, model, tokenizer, train_dataset, eval_dataset, args)
    if main:
        _print_data_summary(trainer, tokenizer, cfg)
    if main and checkpoint:
        print(f"resuming from {checkpoint}", flush=True)

    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    eval_metrics = _final_eval(trainer)
    trainer.accelerator.wait_for_everyone()

    metrics: dict[str, float | None] = {}
    if main:
        model = trainer.accelerator.unwrap_model(trainer.model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tmp = temp_dir_beside(output_dir / "final")  # inside output_dir: moving files out of it is atomic
        model = _save_final_model(model, tokenizer, tmp, merge=cfg.merge_lora)  # sample from what was saved
        samples = _sample_eval_prompts(cfg, model, tokenizer, eval_dataset)
        atomic_write_text(tmp / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
        publish_files(tmp, output_dir)

        eval_loss = float(eval_metrics["eval_loss"])
        n = len(samples)
        metrics = {
            "eval_loss": eval_loss,
            "eval_perplexity": math.exp(min(eval_loss, 50.0)),
            "eos_rate": sum(s["ended_with_eos"] for s in samples) / n if n else None,  # None: nothing sampled
            "mean_response_tokens": sum(s["num_tokens"] for s in samples) / n if n else None,
            "train_loss": float(train_output.training_loss),
            "train_runtime_s": float(train_output.metrics.get("train_runtime", float("nan"))),
            "global_step": int(trainer.state.global_step),
            "train_examples": len(train_dataset),
            "eval_examples": len(eval_dataset),
            "trainable_parameters": trainable,
            "total_runtime_s": time.time() - started,
        }
        for sample in samples[:3]:
            print(f"--- sample  eos={sample['ended_with_eos']}\n{sample['prompt']}|{sample['response']}")
        print(json.dumps(metrics, indent=2), flush=True)
        atomic_write_json(output_dir / "metrics.json", metrics)  # last: marks the stage done
    trainer.accelerator.wait_for_everyone()
    return metrics


def _final_eval(trainer) -> dict[str, float]:
    """The evaluation Trainer ran at the last step (eval_steps divides it, or the run ended), else a new one."""
    last = trainer.state.log_history
    done = [e for e in last if "eval_loss" in e and e.get("step") == trainer.state.global_step]
    return done[-1] if done else trainer.evaluate()


def _sample_eval_prompts(cfg: Config, model, tokenizer, eval_dataset) -> list[dict]:
    if cfg.num_samples == 0:
        return []
    prompts = list(eval_dataset["prompt"])
    random.Random(cfg.seed).shuffle(prompts)
    seed_everything(cfg.seed)
    return sample_responses(
        model, tokenizer, prompts[: cfg.num_samples], max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, batch_size=SAMPLE_BATCH_SIZE,
    )  # fmt: skip


def _print_data_summary(trainer, tokenizer, cfg: Config) -> None:
    """Say how many examples lost their EOS to truncation at max_length (they never learn to stop)."""
    ids = trainer.train_dataset["input_ids"]
    cut = sum(1 for seq in ids if seq[-1] != tokenizer.eos_token_id)
    lengths = sorted(len(seq) for seq in ids)
    print(
        f"train: {len(lengths)} examples, tokens per example median {lengths[len(lengths) // 2]}, max {lengths[-1]}"
        + (f"; {cut} cut at max_length={cfg.max_length} (they lose their EOS)" if cut else ""),
        flush=True,
    )
