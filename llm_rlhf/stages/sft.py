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
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from transformers.pytorch_utils import Conv1D
from trl import SFTConfig, SFTTrainer

from llm_rlhf.core.config import checked_keywords, help_field, require
from llm_rlhf.core.data import load_sft_dataset
from llm_rlhf.core.utils import (
    atomic_write_json,
    atomic_write_text,
    publish_files,
    seed_everything,
    temp_dir_beside,
)
from llm_rlhf.models.loading import (
    Trained,
    load_causal_lm,
    tokenizer_or_load,
    torch_dtype,
    use_eager_attention,
)
from llm_rlhf.rl.rollout import Sampling, encode_prompt, left_pad, sample
from llm_rlhf.training.compact_lm_head import use_compact_lm_head
from llm_rlhf.training.hf_stage import (
    TrainerStageConfig,
    final_eval,
    first_rows,
    log_callback,
    start_outputs,
    trainer_checkpoint,
    training_metrics,
    whole_model,
)

SAMPLE_BATCH_SIZE = 32  # generation batch for the eos_rate samples (larger batches were slower on CPU)


@checked_keywords
@dataclasses.dataclass
class Config(TrainerStageConfig):
    """The SFT stage's keys: the shared ones of `TrainerStageConfig` (optimiser, LoRA, logging and
    checkpoints), SFT's data and the end-of-stage sampling."""

    # --- model and data ---
    train_file: str = help_field(
        "data/reviews/sft_train.jsonl",
        "Demonstrations: .jsonl/.json/.csv/.parquet or a hub dataset (prompt/completion, messages or text).",
    )
    eval_file: str = help_field(
        "data/reviews/sft_val.jsonl",
        "Held-out demonstrations for eval loss/perplexity; their prompts are sampled at the end.",
    )
    data_format: str = help_field(
        "auto",
        "Schema of train_file and eval_file: 'auto' (detected from the columns) or 'hh' (Anthropic/hh-rlhf "
        "chosen/rejected dialogues, also detected by 'auto': trains on `chosen`, the prompt up to and "
        "including its last '\\n\\nAssistant:', the completion the rest).",
    )
    output_dir: str = help_field(
        "runs/reviews/sft", "Where the model, checkpoints/, samples.jsonl and metrics.json go."
    )
    max_length: int = help_field(
        96, "Tokens per training sequence (prompt + completion + EOS); longer ones are cut at the end."
    )
    # --- end-of-stage sampling (the eos_rate measurement) ---
    num_samples: int = help_field(
        64, "Responses sampled from eval prompts at the end (eos_rate, samples.jsonl); 0 = none."
    )
    max_new_tokens: int = help_field(48, "Sampling: at most this many response tokens.")
    temperature: float = help_field(1.0, "Sampling temperature; 0 = greedy.")
    top_k: int = help_field(0, "Sampling: keep the k most likely tokens; 0 = off.")
    top_p: float = help_field(1.0, "Sampling: nucleus probability mass; 1.0 = off.")

    def __post_init__(self):
        super().__post_init__()
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(self.num_samples >= 0, "num_samples", "must be >= 0")
        require(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        require(self.top_k >= 0, "top_k", "must be >= 0 (0 = off)")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")


def load_inputs(cfg: Config, *, model=None, tokenizer=None, train_data=None, eval_data=None):
    """Tokenizer, datasets and model, all checked; returns (tokenizer, model, train_dataset, eval_dataset).
    A model and its tokenizer, or data held in Python (`data.InMemory`), stand in for the config's paths."""
    cfg.check_outputs()
    if model is None:
        cfg.check_model_path()
    tokenizer = tokenizer_or_load(cfg, tokenizer, model)
    rules = {"max_length": cfg.max_length, "data_format": cfg.data_format, "skip_long": cfg.skip_long}
    train = load_sft_dataset(train_data or cfg.train_file, tokenizer, split=cfg.train_split, **rules)
    val = load_sft_dataset(eval_data or cfg.eval_file, tokenizer, split=cfg.eval_split, **rules)
    val = first_rows(val, cfg.max_eval_samples)
    if model is None:
        model = load_causal_lm(
            cfg.model_name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code
        )
    return tokenizer, model, train, val


# ---------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------


def lora_config(cfg: Config, model) -> LoraConfig:
    return LoraConfig(
        **cfg.lora_arguments(model),
        # GPT-2 stores its linear layers transposed (Conv1D); peft would flip this itself, with a warning
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
        task_type="CAUSAL_LM",
    )


def training_args(cfg: Config) -> SFTConfig:
    """TRL's SFTConfig (TrainingArguments) from our flat config; creating it sets up the distributed state."""
    return SFTConfig(
        **cfg.training_arguments(),
        completion_only_loss=True,  # labels = -100 on the prompt, built from a completion mask (not from pad ids)
        packing=False,
        per_device_eval_batch_size=SAMPLE_BATCH_SIZE,
        # without an accelerator, say "CPU" so that `accelerate launch` (WORLD_SIZE > 1) runs DDP over gloo
        use_cpu=not (torch.cuda.is_available() or torch.backends.mps.is_available()),
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def build_trainer(cfg: Config, model, tokenizer, train_dataset, eval_dataset, args=None):
    """TRL's SFTTrainer on prompt/completion rows: completion-only loss, EOS appended by TRL. On a CPU its
    loss's LM head runs at the completion positions only (`compact_lm_head`; TRL's chunked kernel elsewhere)."""
    args = args if args is not None else training_args(cfg)
    use_eager_attention(model, bf16=cfg.bf16, device=args.device)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=lora_config(cfg, model) if cfg.use_lora else None,
        callbacks=[log_callback(Path(cfg.output_dir) / "log.jsonl")],
    )
    if trainer.args.device.type == "cpu":
        patched = trainer.model.get_base_model() if isinstance(trainer.model, PeftModel) else trainer.model
        if use_compact_lm_head(patched) and trainer.is_world_process_zero():
            print("loss: the LM head at the completion positions only (CPU)", flush=True)
    return trainer


# ---------------------------------------------------------------------------------------------------
# Sampling: does the model stop?
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def sample_responses(
    model, tokenizer, prompts: list[str], sampling: Sampling, batch_size: int = 32
) -> list[dict]:
    """Sample one response per prompt with `sampling` (greedy at temperature 0), batched with left padding,
    by the sampler PPO and evaluation use (`rollout.sample`).

    Returns one dict per prompt: prompt, response (decoded, EOS not included), ended_with_eos (the model
    emitted EOS within max_new_tokens), num_tokens (response tokens before the EOS). An empty prompt
    starts from the BOS token (the EOS for GPT-2).
    """
    eos = tokenizer.eos_token_id
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    results = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        encoded = [encode_prompt(tokenizer, p) or [start] for p in batch]
        query, query_mask = left_pad(encoded, tokenizer.pad_token_id, device)  # (B, P) each
        samples = sample(model, tokenizer, query, query_mask, sampling)
        ended = samples.ended_with_eos(eos)  # (B,)
        lengths = samples.response_mask.sum(-1) - ended.long()  # (B,) response tokens before the EOS
        for prompt, tokens, n, done in zip(
            batch, samples.response.tolist(), lengths.tolist(), ended.tolist()
        ):
            results.append(
                {
                    "prompt": prompt,
                    "response": tokenizer.decode(tokens[:n], skip_special_tokens=True),
                    "ended_with_eos": done,
                    "num_tokens": n,
                }
            )
    model.train(was_training)
    return results


# ---------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------


def _save_final_model(model, tokenizer, folder: Path, *, merge: bool):
    """A standard HF folder: full weights (LoRA merged when asked) or the adapter, plus the tokenizer.
    Returns the model as saved (merged when merged)."""
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
    """`llm-rlhf sft`: `train` from the config's paths; returns the metrics (empty on all but the main process)."""
    return train(cfg).metrics


def train(
    cfg: Config, *, model=None, tokenizer=None, train_data=None, eval_data=None, callbacks=()
) -> Trained:
    """Validate inputs, train with SFTTrainer, evaluate, save the model, sample, write metrics.json.

    model, tokenizer: a loaded causal LM (a peft model trains its adapter) and its tokenizer, in place of
    model_name_or_path (the model is trained in place); train_data, eval_data: `data.InMemory` rows in place
    of train_file, eval_file; callbacks: more transformers `TrainerCallback`s. Returns the trained model (as
    saved: merged when merge_lora; None off the main process under DeepSpeed ZeRO-3), its tokenizer and the
    metrics."""
    started = time.time()
    tokenizer, model, train_dataset, eval_dataset = load_inputs(
        cfg, model=model, tokenizer=tokenizer, train_data=train_data, eval_data=eval_data
    )
    output_dir = Path(cfg.output_dir)
    checkpoint = trainer_checkpoint(output_dir) if cfg.resume else None

    args = training_args(cfg)
    main = args.process_index == 0
    if main:
        start_outputs(cfg, output_dir)  # the first write: every input is valid by now
    seed_everything(cfg.seed)
    trainer = build_trainer(cfg, model, tokenizer, train_dataset, eval_dataset, args)
    for callback in callbacks:
        trainer.add_callback(callback)
    if main:
        _print_data_summary(trainer, tokenizer, cfg)
    if main and checkpoint:
        print(f"resuming from {checkpoint}", flush=True)

    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    eval_metrics = final_eval(trainer)
    trainer.accelerator.wait_for_everyone()

    metrics: dict[str, float | None] = {}
    model = whole_model(trainer, dtype=torch_dtype(cfg.dtype))  # every process: a gather under ZeRO-3
    if main:
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
            **training_metrics(trainer, train_output),
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
    return Trained(model=model, tokenizer=tokenizer, metrics=metrics)


def _sample_eval_prompts(cfg: Config, model, tokenizer, eval_dataset) -> list[dict]:
    if cfg.num_samples == 0:
        return []
    prompts = list(eval_dataset["prompt"])
    random.Random(cfg.seed).shuffle(prompts)
    seed_everything(cfg.seed)
    return sample_responses(
        model, tokenizer, prompts[: cfg.num_samples], Sampling.of(cfg), batch_size=SAMPLE_BATCH_SIZE
    )


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
