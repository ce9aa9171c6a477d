"""What the stages built on a Hugging Face `Trainer` (SFT: TRL's SFTTrainer, RM: TRL's RewardTrainer, DPO:
TRL's DPOTrainer) share: the config fields with their help, their checks, the training arguments, the LoRA
arguments, the output-dir and checkpoint checks, the log.jsonl callback, and the steps every stage's `run`
takes alike: its first writes (`start_outputs`), the final evaluation (`final_eval`), the training figures
of metrics.json (`training_metrics`), the trained model with whole weights on the main process
(`whole_model`, also under DeepSpeed ZeRO-3) and the check that the saved folder reloads (`check_reload`).

`TrainerStageConfig` is the base of `sft.Config`, `reward.Config` and `dpo.Config`; a stage re-declares a
field only to change its default or its help. The user still sees one flat config per stage (YAML keys, `--key value`
flags, `--help`, the saved config.yaml).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, get_peft_model
from transformers import TrainerCallback

from llm_rlhf.core.config import (
    REPORT_TO,
    TRACKIO_PROJECT,
    check_report_to_installed,
    format_config,
    help_field,
    require,
    save_config,
)
from llm_rlhf.core.data import DATA_FORMATS
from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.core.utils import append_jsonl, last_checkpoint, resolve_bf16
from llm_rlhf.models.accelerated import loading_whole_models
from llm_rlhf.models.loading import check_local_folder
from llm_rlhf.models.lora import lora_placement

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)


@dataclasses.dataclass
class TrainerStageConfig:
    # --- model and data ---
    model_name_or_path: str = help_field(
        "data/reviews/base_model", "Base causal LM: a hub name or a local HF folder."
    )
    train_file: str = help_field(
        "data/reviews/sft_train.jsonl", "Training data (JSONL/CSV/Parquet or a hub dataset)."
    )
    eval_file: str = help_field(
        "data/reviews/sft_val.jsonl", "Held-out data, evaluated during training and at the end."
    )
    train_split: str = help_field("train", "Split of train_file when it is a hub dataset.")
    eval_split: str = help_field("test", "Split of eval_file when it is a hub dataset.")
    max_eval_samples: int | None = help_field(
        None,
        "Evaluate on the first N rows of eval_file only (file order; null = every row): each held-out row "
        "costs a forward at every evaluation.",
    )
    data_format: str = help_field(
        "auto", "Schema of the data files: 'auto' (detected from the columns) or 'hh' (Anthropic/hh-rlhf)."
    )
    skip_long: bool = help_field(
        False,
        "Leave out (and count) examples whose prompt leaves no room for a response within max_length; "
        "false = stop with an error naming the row.",
    )
    output_dir: str = help_field("runs/reviews/sft", "Where the model, checkpoints/ and metrics.json go.")
    max_length: int = help_field(96, "Tokens per training sequence.")
    trust_remote_code: bool = help_field(
        False, "Allow model/tokenizer code from the hub (off: only trusted architectures)."
    )
    # --- optimisation ---
    learning_rate: float = help_field(5e-4, "Peak AdamW learning rate.")
    num_train_epochs: float = help_field(1.0, "Passes over train_file (ignored when max_steps > 0).")
    max_steps: int = help_field(-1, "Optimizer steps to run; -1 = use num_train_epochs.")
    per_device_train_batch_size: int = help_field(32, "Sequences per device per micro-batch.")
    gradient_accumulation_steps: int = help_field(1, "Micro-batches per optimizer step.")
    warmup_ratio: float = help_field(0.05, "Fraction of the steps with a linear warm-up from 0, in [0, 1).")
    lr_scheduler_type: str = help_field(
        "cosine", f"Learning-rate schedule after warm-up: one of {', '.join(SCHEDULERS)}."
    )
    weight_decay: float = help_field(0.0, "AdamW weight decay.")
    max_grad_norm: float = help_field(1.0, "Gradient clipping (global L2 norm).")
    seed: int = help_field(42, "Seed for python, numpy, torch, data order and LoRA init.")
    dtype: str = help_field("float32", "Weights dtype: float32, bfloat16 or float16.")
    bf16: bool | str = help_field(
        False,
        "bfloat16 autocast (mixed precision) during training: true, false, or auto (on where the hardware "
        "computes bf16 natively: a CPU with AMX or AVX512-BF16; float32 on a GPU and elsewhere; logged).",
    )
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
    lora_layers: int | None = help_field(
        None,
        "Adapters only in the last N transformer blocks (peft's layers_to_transform): the backward pass "
        "stops below them, so a step costs less; null = every block.",
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
    report_to: str = help_field(
        "none",
        "Also send metrics to: none, tensorboard, wandb or trackio (local-first: project llm_rlhf, the run named by "
        "output_dir, under $TRACKIO_DIR or ~/.cache/huggingface/trackio; `trackio show` opens it).",
    )

    def __post_init__(self):
        self.bf16, self.precision = resolve_bf16(self.bf16)
        require(self.max_length >= 4, "max_length", "must be at least 4 tokens")
        require(self.data_format in DATA_FORMATS, "data_format", f"must be one of {', '.join(DATA_FORMATS)}")
        require(self.learning_rate > 0, "learning_rate", "must be > 0")
        require(
            self.max_steps > 0 or self.num_train_epochs > 0,
            "num_train_epochs",
            "must be > 0 (or set max_steps)",
        )
        for key in (
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
            "save_steps",
            "save_total_limit",
            "lora_r",
        ):
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
        require(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        require(len(self.lora_target_modules) > 0, "lora_target_modules", "needs at least one module name")
        require(self.lora_layers is None or self.lora_layers >= 1, "lora_layers", "must be >= 1 (or null)")
        require(
            self.max_eval_samples is None or self.max_eval_samples >= 1,
            "max_eval_samples",
            "must be >= 1 (or null)",
        )

    # --- checks before anything is loaded or written ---------------------------------------------

    def check_outputs(self) -> None:
        """report_to is installed; output_dir holds checkpoints exactly when resuming."""
        check_report_to_installed(self.report_to)
        checkpoint = trainer_checkpoint(self.output_dir)
        if self.resume and checkpoint is None:
            raise UserError(
                f"--resume: no checkpoint in '{Path(self.output_dir) / 'checkpoints'}' to continue from"
            )
        if not self.resume and checkpoint is not None:
            raise UserError(
                f"output_dir '{self.output_dir}' already holds checkpoints of a run; continue it with --resume true "
                "or choose another --output_dir"
            )

    def check_model_path(self, hint: str = "") -> None:
        """A path-like name that is not a folder is a typo, not a hub id: say so without a network round trip."""
        try:
            check_local_folder(self.model_name_or_path, "model_name_or_path")
        except UserError as e:
            raise UserError(f"{e}{hint}") from None

    # --- what the Trainer is given -----------------------------------------------------------

    def training_arguments(self) -> dict[str, Any]:
        """The TrainingArguments both stages set the same way (each stage adds its own and builds TRL's
        SFTConfig / RewardConfig from them)."""
        check_deepspeed_launch(bf16=self.bf16)
        return dict(
            output_dir=str(Path(self.output_dir) / "checkpoints"),
            max_length=self.max_length,
            learning_rate=self.learning_rate,
            num_train_epochs=self.num_train_epochs,
            max_steps=self.max_steps,
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            warmup_steps=self.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of the total steps
            lr_scheduler_type=self.lr_scheduler_type,
            train_sampling_strategy="group_by_length" if self.group_by_length else "random",
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
            seed=self.seed,
            bf16=self.bf16,  # TRL's configs default to bf16=True and gradient_checkpointing=True: always set both
            fp16=False,
            gradient_checkpointing=self.gradient_checkpointing,
            logging_steps=self.logging_steps,
            eval_strategy="steps" if self.eval_steps > 0 else "no",
            eval_steps=self.eval_steps if self.eval_steps > 0 else None,
            save_strategy="steps",
            save_steps=self.save_steps,
            save_total_limit=self.save_total_limit,
            report_to=[] if self.report_to == "none" else [self.report_to],
            project=TRACKIO_PROJECT,  # trackio's project (and the run's name, output_dir, below)
            run_name=str(self.output_dir),
            dataloader_num_workers=0,
            pad_to_multiple_of=None,
            trust_remote_code=self.trust_remote_code,
        )

    def lora_arguments(self, model) -> dict[str, Any]:
        """peft's LoraConfig arguments the stages set the same way (`model`: where the adapters go)."""
        return dict(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            **lora_placement(model, list(self.lora_target_modules), self.lora_layers),
        )


def first_rows(dataset, n: int | None):
    """The first n rows of a datasets.Dataset (all of them when n is None or not smaller)."""
    return dataset if n is None or n >= len(dataset) else dataset.select(range(n))


def trainer_checkpoint(output_dir: str | Path) -> str | None:
    """The newest `checkpoint-N` folder the Trainer wrote to output_dir/checkpoints, as the str that
    `Trainer.train(resume_from_checkpoint=...)` takes, or None."""
    checkpoint = last_checkpoint(output_dir, "checkpoint")
    return None if checkpoint is None else str(checkpoint)


def log_callback(path: Path) -> TrainerCallback:
    """Every Trainer log line (losses, accuracy, learning rate, eval metrics) appended to log.jsonl."""
    return JsonlLog(path)


class JsonlLog(TrainerCallback):
    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            append_jsonl(self.path, {"step": state.global_step, "epoch": state.epoch, **logs})


# ---------------------------------------------------------------------------------------------------
# What every stage's `run` does alike
# ---------------------------------------------------------------------------------------------------


def start_outputs(cfg, output_dir: Path) -> None:
    """The first writes of a stage (main process), once every input is valid: print and save the resolved
    config, and remove an earlier metrics.json: a rerun is not done until it writes it again."""
    print(format_config(cfg), flush=True)
    print(f"precision: {cfg.precision}", flush=True)
    save_config(cfg, output_dir)
    (output_dir / "metrics.json").unlink(missing_ok=True)


def final_eval(trainer) -> dict[str, float]:
    """The evaluation the Trainer ran at the last step (eval_steps divides it, or the run ended), else a new
    one: eval_loss and the trainer's own eval_* figures."""
    step = trainer.state.global_step
    done = [e for e in trainer.state.log_history if "eval_loss" in e and e.get("step") == step]
    return done[-1] if done else trainer.evaluate()


def check_deepspeed_launch(*, bf16: bool) -> None:
    """Under `accelerate launch` with a DeepSpeed config (accelerate passes it in ACCELERATE_* variables):
    ZeRO-2 and ZeRO-3 run TRL's trainers for real, LoRA included (on 2 CPU processes in
    tests/multiprocess/test_deepspeed.py; after training every process enters the gather of ZeRO-3's partitions,
    `whole_model`). The engine trains in the launch's mixed_precision and the Trainer checks its config
    against `bf16`: a mismatch is one line here instead of the Trainer's traceback."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return
    mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if mixed_precision not in ("no", "bf16") or bf16 != (mixed_precision == "bf16"):
        raise ConfigError(
            f"config key 'bf16' is {str(bf16).lower()} but the DeepSpeed launch's mixed_precision is "
            f"{mixed_precision}: set bf16 true with mixed_precision bf16, or false with --mixed_precision no"
        )


def whole_model(trainer, *, dtype: torch.dtype):
    """The trained model with whole weights, for the stage's final save, sampling and scoring on the main
    process: the unwrapped model itself, except under DeepSpeed ZeRO-3. There the model's parameters are
    partitions (a forward on one process alone is a collective the others never enter, and hangs), so every
    process must call this: the whole weights are gathered (DeepSpeed's consolidated state dict, a
    collective; keep the config's zero3_save_16bit_model true, as the Trainer's own checkpoints need too)
    into a copy of the model built outside ZeRO (`loading_whole_models`) in `dtype`, the stage's weights
    dtype, on the main process; None on the others. With LoRA the copy is a peft model (the base model
    from its config, the run's LoRA config), so the stage merges or saves its adapter as without ZeRO-3."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    plugin = trainer.accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return model
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # whole on the main process, else None
    if not trainer.accelerator.is_main_process:
        return None
    with loading_whole_models(trainer.accelerator):
        if isinstance(model, PeftModel):
            base = model.get_base_model()
            lora = copy.deepcopy(model.peft_config[model.active_adapter])
            whole = get_peft_model(type(base)(base.config).to(dtype), lora)
        else:
            whole = type(model)(model.config).to(dtype)
    whole.load_state_dict(state)
    if getattr(model, "generation_config", None) is not None:  # a causal LM's: its EOS, pad, defaults
        whole.generation_config = copy.deepcopy(model.generation_config)
    return whole.train(model.training)


def training_metrics(trainer, train_output) -> dict[str, float]:
    """The training figures of a stage's metrics.json: the mean training loss, the runtime, the last step."""
    return {
        "train_loss": float(train_output.training_loss),
        "train_runtime_s": float(train_output.metrics.get("train_runtime", float("nan"))),
        "global_step": int(trainer.state.global_step),
    }


def check_reload(model, load, measure, pairs, *, what: str, rtol: float) -> None:
    """The folder a stage saved must measure the first (up to 8) pairs as the trained model does: no lost
    weight, head, pad row or adapter. `load()` reloads the folder; `measure(model, prompts, responses)` gives
    one tensor (log-probs, scores); `what` says what differs in the RuntimeError."""
    n = min(8, len(pairs))
    prompts, responses = list(pairs["prompt"])[:n], list(pairs["chosen"])[:n]
    expected = measure(model, prompts, responses)
    got = measure(load().to(next(model.parameters()).device), prompts, responses)
    if not torch.allclose(expected, got, atol=1e-3, rtol=rtol):
        raise RuntimeError(f"{what} after reloading: {expected} vs {got}")
