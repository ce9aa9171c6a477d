"""Stage 2, the reward model: the SFT transformer with a linear head to one scalar, trained on preferences.

    r_phi(x, y) = w . h_L(x + y)[last non-pad token]          (AutoModelForSequenceClassification, num_labels=1)
    L(phi)      = -mean( log sigmoid( r(x, y_w) - r(x, y_l) - margin ) )    (Bradley-Terry; TRL's RewardTrainer)

The model, where its score is read, its pad token and the stored normalisation: `llm_rlhf.models.reward_model`.
After training, the mean and (population) std of the raw scores on a reference set, the unique prompt +
response texts (chosen and rejected) of the training pairs, are stored with the model.

Outputs in `output_dir`: config.yaml, log.jsonl, checkpoints/, the model (a standard HF folder: safetensors,
config, tokenizer; with LoRA an adapter folder whose `modules_to_save` holds the trained score head; load it
with `load_reward_model`, or plain peft: `AutoPeftModelForSequenceClassification.from_pretrained(dir,
num_labels=1)`), reward_normalization.json, and metrics.json written last (its presence marks the stage done).
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
from datasets import Dataset
from peft import LoraConfig
from trl import RewardConfig, RewardTrainer

from llm_rlhf.core.config import checked_keywords, help_field, require
from llm_rlhf.core.data import load_preference_dataset, load_rows
from llm_rlhf.core.errors import ConfigError, DataError, UserError
from llm_rlhf.core.utils import atomic_write_json, publish_files, seed_everything, temp_dir_beside
from llm_rlhf.models.accelerated import loading_whole_models
from llm_rlhf.models.baseline import fit_bow_baseline, pairwise_accuracy
from llm_rlhf.models.loading import (
    Trained,
    check_not_adapter_only,
    tokenizer_or_load,
    torch_dtype,
    use_eager_attention,
)
from llm_rlhf.models.reward_model import (
    RewardModel,
    add_pad_token,
    encode_pairs,
    load_reward_model,
    load_sequence_classifier,
    save_reward_model,
    score_pairs,
    sequence_classifier_from,
)
from llm_rlhf.rl.reward_math import bradley_terry_loss
from llm_rlhf.training.hf_stage import (
    SCHEDULERS,
    TrainerStageConfig,
    check_reload,
    first_rows,
    log_callback,
    start_outputs,
    trainer_checkpoint,
    training_metrics,
    whole_model,
)


@checked_keywords
@dataclasses.dataclass
class Config(TrainerStageConfig):
    """The RM stage's keys: the shared ones of `TrainerStageConfig` (optimiser, LoRA, logging and
    checkpoints), the preference data, the loss and the normalisation."""

    # --- model and data ---
    model_name_or_path: str = help_field(
        "runs/reviews/sft",
        "The SFT model (local HF folder or hub name): trunk of the RM, its LM head is dropped.",
    )
    train_file: str = help_field(
        "data/reviews/prefs_train.jsonl",
        "Preference pairs: .jsonl/.json/.csv/.parquet or a hub dataset (prompt/chosen/rejected, "
        "chosen/rejected full texts, or prompt + ranked: all K(K-1)/2 pairs of a ranking).",
    )
    eval_file: str = help_field(
        "data/reviews/prefs_val.jsonl", "Held-out pairs: evaluated during training and at the end (eval_*)."
    )
    eval_split: str = help_field("test", "Split of eval_file and test_file when they are hub datasets.")
    output_dir: str = help_field(
        "runs/reviews/rm", "Where the RM, checkpoints/, log.jsonl and metrics.json go."
    )
    max_length: int = help_field(
        128, "Tokens per sequence (prompt + response + EOS); longer pairs are left out of training."
    )
    data_format: str = help_field(
        "auto",
        "Schema of train_file, eval_file and test_file: 'auto' (detected from the columns) or 'hh' "
        "(Anthropic/hh-rlhf chosen/rejected dialogues, also detected by 'auto': the shared text up to "
        "the last '\\n\\nAssistant:' is the prompt).",
    )
    skip_long: bool = help_field(
        False,
        "Leave out (and count) pairs whose prompt leaves no room for a response within max_length; "
        "false = stop with an error naming the row.",
    )
    # --- optimisation ---
    learning_rate: float = help_field(5e-5, "Peak AdamW learning rate.")
    per_device_train_batch_size: int = help_field(16, "Pairs per device per micro-batch (2x sequences).")
    lr_scheduler_type: str = help_field(
        "linear", f"Learning-rate schedule after warm-up: one of {', '.join(SCHEDULERS)}."
    )
    seed: int = help_field(42, "Seed for python, numpy, torch, data order, the score head and LoRA init.")
    group_by_length: bool = help_field(
        True,
        "Batch pairs of similar length (less padding: faster, above all on CPU); false = uniform shuffling.",
    )
    # --- LoRA ---
    use_lora: bool = help_field(
        False,
        "Train a LoRA adapter (peft); the score head is trained in full and saved with it (modules_to_save).",
    )
    lora_dropout: float = help_field(0.0, "Dropout on the LoRA branch (only when disable_dropout is false).")
    lora_target_modules: list[str] = help_field(
        ["all-linear"],
        "Modules that get adapters ('all-linear' = every linear/Conv1D layer but the score head).",
    )
    merge_lora: bool = help_field(
        False, "Merge the adapter and save a full HF folder instead of the adapter folder."
    )
    # --- logging ---
    logging_steps: int = help_field(
        10, "Log loss/accuracy every N optimizer steps (console, log.jsonl, report_to)."
    )
    # --- the RM's own keys ---
    test_file: str | None = help_field(
        "data/reviews/prefs_test.jsonl",
        "Final held-out pairs, evaluated once at the end (test_*); null = none.",
    )
    margin: float = help_field(
        0.0,
        "Llama-2 margin: the loss is -log sigmoid(r_w - r_l - margin * m) with m the pair's `margin` "
        "column (prompt/chosen/rejected files only); 0 = plain Bradley-Terry.",
    )
    center_rewards_coefficient: float = help_field(
        0.0,
        "Adds coef * mean((r_w + r_l)^2) to the loss, pulling scores towards 0 (Eisenstein et al. 2023); 0 = off.",
    )
    per_device_eval_batch_size: int = help_field(32, "Pairs per device per evaluation batch.")
    disable_dropout: bool = help_field(
        True,
        "Turn every dropout off (LoRA's too), so a pair's training scores are the scores it is judged by.",
    )
    normalization_samples: int = help_field(
        2000,
        "Reference set for the score mean/std: up to this many unique train texts (chosen and rejected).",
    )
    score_batch_size: int = help_field(
        64, "Sequences per batch when scoring at the end (eval, test, reference set)."
    )
    bootstrap_seed: int | None = help_field(
        None,
        "Train on a bootstrap resample of the training pairs: as many pairs as fit max_length, drawn with "
        "replacement with this seed (an ensemble member's own data; the pipeline's rm_bootstrap sets it). "
        "The normalisation reference set stays the full training set. null = every pair once.",
    )

    def __post_init__(self):
        super().__post_init__()
        for key in ("per_device_eval_batch_size", "normalization_samples", "score_batch_size"):
            require(getattr(self, key) >= 1, key, "must be >= 1")
        require(self.margin >= 0, "margin", "must be >= 0 (0 = off)")
        require(self.center_rewards_coefficient >= 0, "center_rewards_coefficient", "must be >= 0 (0 = off)")
        require(not self.merge_lora or self.use_lora, "merge_lora", "only applies with use_lora: true")


# ---------------------------------------------------------------------------------------------------
# Inputs: everything is validated before anything is written
# ---------------------------------------------------------------------------------------------------


def _margins(cfg: Config, num_pairs: int, source=None) -> list[float]:
    """The `margin` column of train_file (or of `source`, rows held in Python), one float per pair (only files
    with one pair per row)."""
    source = source or cfg.train_file
    rows = load_rows(source, split=cfg.train_split)
    if "margin" not in rows.column_names or "ranked" in rows.column_names or len(rows) != num_pairs:
        raise ConfigError(
            f"config key 'margin': {cfg.margin} needs a numeric `margin` column in train_file, one pair per row "
            "(prompt/chosen/rejected or chosen/rejected); set margin: 0 for plain Bradley-Terry"
        )
    values = []
    for i, value in enumerate(rows["margin"], start=1):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(
                f"expected a finite number, got {value!r:.40}",
                file=getattr(source, "name", source),
                row=i,
                field="margin",
            )
        values.append(cfg.margin * float(value))
    return values


def bootstrap_indices(n: int, *, seed: int) -> list[int]:
    """A bootstrap resample of n items (Efron 1979): n indices drawn uniformly with replacement, seeded.
    Each item is left out with probability (1 - 1/n)^n ~ 1/e ~ 37%, so members trained on different
    resamples differ in their data as well as in their initialisation and data order."""
    rng = random.Random(seed)
    return [rng.randrange(n) for _ in range(n)]


def _tokenize(dataset, tokenizer, max_length: int, margins: list[float] | None = None):
    """prompt/chosen/rejected strings -> chosen_ids/rejected_ids (+ margin), the processed form TRL takes
    as is, plus `length` (the longer of the two, for group_by_length; TRL's collator ignores it); pairs
    longer than max_length are left out. Returns (dataset, number left out)."""
    columns: dict[str, list] = {"chosen_ids": [], "rejected_ids": [], "length": []}
    if margins is not None:
        columns["margin"] = []
    chosen = encode_pairs(tokenizer, dataset["prompt"], dataset["chosen"])
    rejected = encode_pairs(tokenizer, dataset["prompt"], dataset["rejected"])
    dropped = 0
    for i, (chosen_ids, rejected_ids) in enumerate(zip(chosen, rejected)):
        if max(len(chosen_ids), len(rejected_ids)) > max_length:
            dropped += 1
            continue
        columns["chosen_ids"].append(chosen_ids)
        columns["rejected_ids"].append(rejected_ids)
        columns["length"].append(max(len(chosen_ids), len(rejected_ids)))  # for group_by_length
        if margins is not None:
            columns["margin"].append(margins[i])
    return Dataset.from_dict(columns), dropped


@dataclasses.dataclass
class Inputs:
    tokenizer: object
    model: object
    train: object  # prompt/chosen/rejected strings
    eval: object
    test: object | None
    margins: list[float] | None


def load_inputs(
    cfg: Config, *, model=None, tokenizer=None, train_data=None, eval_data=None, test_data=None
) -> Inputs:
    """Tokenizer (with its pad token), the three pair sets and the model, all checked. model, tokenizer: a
    loaded causal LM (or `RewardModel`, whose tokenizer is the default) in place of model_name_or_path;
    train_data, eval_data, test_data: `data.InMemory` rows in place of train_file, eval_file, test_file."""
    cfg.check_outputs()
    if isinstance(model, RewardModel):  # trained further, as a reward model folder is
        model, tokenizer = model.model, tokenizer if tokenizer is not None else model.tokenizer
    if model is None:
        hint = " (train it with `llm-rlhf sft`)" if cfg.model_name_or_path.rstrip("/").endswith("sft") else ""
        cfg.check_model_path(hint)
        check_not_adapter_only(cfg.model_name_or_path)
    tokenizer = tokenizer_or_load(cfg, tokenizer, model)
    load = load_preference_dataset
    rules = {"max_length": cfg.max_length, "data_format": cfg.data_format, "skip_long": cfg.skip_long}
    train = load(train_data or cfg.train_file, tokenizer, split=cfg.train_split, **rules)
    val = load(eval_data or cfg.eval_file, tokenizer, split=cfg.eval_split, **rules)
    val = first_rows(val, cfg.max_eval_samples)
    test_source = test_data or cfg.test_file
    test = load(test_source, tokenizer, split=cfg.eval_split, **rules) if test_source else None
    margins = _margins(cfg, len(train), train_data) if cfg.margin > 0 else None
    seed_everything(cfg.seed)  # the score head is initialised at load time
    if model is not None:
        model = sequence_classifier_from(model, dtype=cfg.dtype)
    else:
        # Local folders by absolute path: a LoRA adapter records its base model's path in adapter_config.json.
        name = cfg.model_name_or_path
        name = os.path.abspath(os.path.expanduser(name)) if os.path.isdir(os.path.expanduser(name)) else name
        model = load_sequence_classifier(
            name, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, need_head=False
        )
    add_pad_token(model, tokenizer)
    return Inputs(tokenizer, model, train, val, test, margins)


# ---------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------


def lora_config(cfg: Config, model) -> LoraConfig:
    return LoraConfig(
        **cfg.lora_arguments(model),
        modules_to_save=["score"],  # the head is trained in full and saved with the adapter
        task_type="SEQ_CLS",
    )


def build_trainer(cfg: Config, model, tokenizer, train_dataset, eval_dataset):
    """TRL's RewardTrainer on pre-tokenized pairs (chosen_ids/rejected_ids, so tokenization is `encode_pair`'s)."""
    output_dir = Path(cfg.output_dir)
    args = RewardConfig(
        **cfg.training_arguments(),
        center_rewards_coefficient=cfg.center_rewards_coefficient or None,
        disable_dropout=cfg.disable_dropout,
        per_device_eval_batch_size=cfg.per_device_eval_batch_size,
        length_column_name="length",
        remove_unused_columns=False,  # keep `length` for the sampler: the dataset holds nothing else extra
        # `accelerate launch` with several processes on a machine without GPUs: transformers only sets up
        # DDP over gloo when told to use the CPU; otherwise every process would train its own copy.
        # and bf16 autocast on a CPU is refused unless the run is marked as a CPU run
        use_cpu=(int(os.environ.get("WORLD_SIZE", "1")) > 1 or cfg.bf16) and not torch.cuda.is_available(),
    )
    use_eager_attention(model, bf16=cfg.bf16, device=args.device)
    return RewardTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=lora_config(cfg, model) if cfg.use_lora else None,
        callbacks=[log_callback(output_dir / "log.jsonl")],
    )


# ---------------------------------------------------------------------------------------------------
# Evaluation, normalisation, saving
# ---------------------------------------------------------------------------------------------------


def evaluate_pairs(
    model: RewardModel, pairs, *, batch_size: int, progress: str | bool = False
) -> dict[str, float]:
    """Pairwise accuracy (ties count 1/2), mean margin r(y_w) - r(y_l) in raw score units, and the pairs'
    Bradley-Terry loss (`reward_math.bradley_terry_loss`, no margin: what training minimised, held out)."""
    n = len(pairs)
    scores = score_pairs(
        model,
        list(pairs["prompt"]) * 2,
        list(pairs["chosen"]) + list(pairs["rejected"]),
        batch_size=batch_size,
        normalize=False,
        progress=progress,
    )
    chosen, rejected = scores[:n], scores[n:]  # (N,) each
    return {
        "accuracy": pairwise_accuracy(chosen.numpy(), rejected.numpy()),
        "margin": float((chosen - rejected).mean()),
        "loss": float(bradley_terry_loss(chosen_scores=chosen.double(), rejected_scores=rejected.double())),
    }


def reference_texts(pairs, *, max_samples: int, seed: int) -> tuple[list[str], list[str]]:
    """The normalisation reference set: unique (prompt, response) of the training pairs, chosen and
    rejected, at most max_samples of them (a seeded sample)."""
    unique = dict.fromkeys(
        [(p, c) for p, c in zip(pairs["prompt"], pairs["chosen"])]
        + [(p, r) for p, r in zip(pairs["prompt"], pairs["rejected"])]
    )
    texts = list(unique)
    if len(texts) > max_samples:
        texts = random.Random(seed).sample(texts, max_samples)
    return [p for p, _ in texts], [r for _, r in texts]


def normalization_stats(raw_scores: torch.Tensor) -> tuple[float, float]:
    """Mean and population std of raw scores (so the normalised reference scores have std exactly 1)."""
    mean = float(raw_scores.mean())
    std = float(raw_scores.std(unbiased=False))
    return mean, std if std > 1e-8 else 1.0


def _full_texts(pairs) -> tuple[list[str], list[str]]:
    """prompt + chosen and prompt + rejected: what the baseline sees (the RM sees the same text)."""
    chosen = [p + c for p, c in zip(pairs["prompt"], pairs["chosen"])]
    return chosen, [p + r for p, r in zip(pairs["prompt"], pairs["rejected"])]


def normalize_and_evaluate(cfg: Config, reward_model: RewardModel, inputs: Inputs) -> dict[str, float]:
    """Store the normalisation on `reward_model` (mean/std of its raw scores on the reference set), then
    held-out accuracy and margin on eval (and test) pairs, with the bag-of-words baseline beside them.
    Under `bf16` the scores are computed under bf16 autocast, as PPO computes them with its own `bf16`."""
    device = next(reward_model.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.bf16):
        return _normalize_and_evaluate(cfg, reward_model, inputs)


def _normalize_and_evaluate(cfg: Config, reward_model: RewardModel, inputs: Inputs) -> dict[str, float]:
    bs = cfg.score_batch_size
    prompts, responses = reference_texts(inputs.train, max_samples=cfg.normalization_samples, seed=cfg.seed)
    raw = score_pairs(
        reward_model, prompts, responses, batch_size=bs, normalize=False, progress="reference set"
    )
    mean, std = normalization_stats(raw)
    reward_model.mean, reward_model.std = mean, std
    reward_model.normalization = {
        "mean": mean,
        "std": std,
        "reference_set": "unique prompt+response texts (chosen and rejected) of the training pairs in "
        f"{cfg.train_file}, {len(raw)} sampled with seed {cfg.seed}",
        "n": len(raw),
    }
    eval_chosen, eval_rejected = _full_texts(inputs.eval)  # picks the baseline's regularisation strength
    baseline = fit_bow_baseline(
        *_full_texts(inputs.train), eval_chosen=eval_chosen, eval_rejected=eval_rejected
    )
    metrics = {"score_mean": mean, "score_std": std, "normalization_samples": len(raw)}
    for prefix, pairs in (("eval", inputs.eval), ("test", inputs.test)):
        if pairs is None:
            continue
        result = evaluate_pairs(reward_model, pairs, batch_size=bs, progress=f"{prefix} pairs")
        metrics[f"{prefix}_accuracy"] = result["accuracy"]
        metrics[f"{prefix}_margin"] = result["margin"]  # raw score units
        metrics[f"{prefix}_margin_normalized"] = result["margin"] / std  # in units of the reference std
        metrics[f"{prefix}_pair_loss"] = result["loss"]
        metrics[f"{prefix}_pairs"] = len(pairs)
        name = "baseline_accuracy" if prefix == "eval" else f"baseline_{prefix}_accuracy"
        metrics[name] = baseline.accuracy(*_full_texts(pairs))
    metrics["baseline_C"] = baseline.C  # bag-of-words (TF-IDF uni+bigram) logistic regression
    return metrics


def run(cfg: Config) -> dict[str, float]:
    """`llm-rlhf rm`: `train` from the config's paths; returns the metrics (empty on all but the main process)."""
    return train(cfg).metrics


def train(
    cfg: Config, *, model=None, tokenizer=None, train_data=None, eval_data=None, test_data=None, callbacks=()
) -> Trained:
    """Validate inputs, train with RewardTrainer, normalise, evaluate (with the baseline), save, write metrics.

    model, tokenizer: a loaded causal LM (a peft model's adapter merged) or `RewardModel` and its tokenizer,
    in place of model_name_or_path; the reward model trains a copy of its weights (`sequence_classifier_from`).
    train_data, eval_data, test_data: `data.InMemory` pairs in place of the config's files; callbacks: more
    transformers `TrainerCallback`s. Returns the trained `RewardModel` (normalised; on the main process,
    None elsewhere), its tokenizer and the metrics."""
    started = time.time()
    inputs = load_inputs(
        cfg, model=model, tokenizer=tokenizer, train_data=train_data, eval_data=eval_data, test_data=test_data
    )
    tokenizer, output_dir = inputs.tokenizer, Path(cfg.output_dir)
    train_dataset, dropped = _tokenize(inputs.train, tokenizer, cfg.max_length, inputs.margins)
    eval_dataset, eval_dropped = _tokenize(inputs.eval, tokenizer, cfg.max_length)
    for name, dataset in (("train_file", train_dataset), ("eval_file", eval_dataset)):
        if len(dataset) == 0:
            raise UserError(f"{name}: no pair fits in max_length={cfg.max_length} tokens; raise max_length")
    resampled = None
    if cfg.bootstrap_seed is not None:  # an ensemble member's own resample of the pairs
        resampled = bootstrap_indices(len(train_dataset), seed=cfg.bootstrap_seed)
        train_dataset = train_dataset.select(resampled)
    checkpoint = trainer_checkpoint(output_dir) if cfg.resume else None

    seed_everything(cfg.seed)
    trainer = build_trainer(cfg, inputs.model, tokenizer, train_dataset, eval_dataset)
    for callback in callbacks:
        trainer.add_callback(callback)
    main = trainer.accelerator.is_main_process
    if main:
        start_outputs(cfg, output_dir)  # the first write: every input is valid by now
        lengths = sorted(
            len(ids) for ids in list(train_dataset["chosen_ids"]) + list(train_dataset["rejected_ids"])
        )
        print(
            f"train: {len(train_dataset)} pairs ({len(inputs.train)} read, {dropped} longer than max_length="
            f"{cfg.max_length} left out), tokens per sequence median {lengths[len(lengths) // 2]}, max {lengths[-1]}; "
            f"eval: {len(eval_dataset)} pairs ({eval_dropped} left out of the in-training eval)",
            flush=True,
        )
        if resampled is not None:
            print(
                f"bootstrap (seed {cfg.bootstrap_seed}): {len(set(resampled))} distinct pairs of "
                f"{len(resampled)} drawn",
                flush=True,
            )
    if checkpoint:
        print(f"resuming from {checkpoint}", flush=True)

    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.accelerator.wait_for_everyone()

    metrics: dict[str, float] = {}
    reward_model = None
    model = whole_model(trainer, dtype=torch_dtype(cfg.dtype))  # every process: a gather under ZeRO-3
    if main:
        reward_model = RewardModel(model, tokenizer).eval()
        metrics = normalize_and_evaluate(cfg, reward_model, inputs)
        tmp = temp_dir_beside(output_dir / "final")
        save_reward_model(reward_model, tmp, merge_lora=cfg.merge_lora)
        with loading_whole_models(trainer.accelerator):  # ZeRO-3: from_pretrained off zero.Init
            check_reload(
                reward_model,
                lambda: load_reward_model(tmp, dtype=cfg.dtype),
                score_pairs,
                inputs.eval,
                what="the saved reward model scores differently",
                rtol=1e-3,
            )
        publish_files(tmp, output_dir)
        metrics.update(
            {
                **training_metrics(trainer, train_output),
                "train_pairs": len(train_dataset),
                "train_pairs_too_long": dropped,
                **({"train_pairs_distinct": len(set(resampled))} if resampled is not None else {}),
                "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "total_runtime_s": time.time() - started,
            }
        )
        print(json.dumps(metrics, indent=2), flush=True)
        atomic_write_json(output_dir / "metrics.json", metrics)  # last: marks the stage done
    trainer.accelerator.wait_for_everyone()
    return Trained(model=reward_model, tokenizer=tokenizer, metrics=metrics)
