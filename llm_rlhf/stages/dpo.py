"""DPO, the RM-free alternative to RM + PPO: the SFT model trained directly on the preference pairs.

Direct Preference Optimization (Rafailov et al. 2023) on TRL's `DPOTrainer` (the loss is TRL's, not ours):

    logratio(x, y) = log pi_theta(y | x) - log pi_ref(y | x)       (sums over the response tokens and the EOS)
    L(theta)       = -mean( log sigmoid( beta * (logratio(x, y_w) - logratio(x, y_l)) ) )     (loss_type sigmoid)

pi_ref is the SFT model, frozen: a second copy for full fine-tuning, or with LoRA the same network with
the adapter disabled (TRL does this when it is given the peft config). beta * logratio is DPO's implicit
reward; TRL logs its mean on chosen and rejected responses (`rewards/chosen`, `rewards/rejected`: how far the
policy moved from the reference on the dataset's responses, KL-like but not a KL estimate, since the responses
are not samples of pi_theta), their mean difference (`rewards/margins`) and the fraction of pairs where chosen
beats rejected (`rewards/accuracies`).

The data are the RM stage's preference pairs, read by the same loader (`load_preference_dataset`: the same
schemas and the same one-line errors naming file, row and field). Each sequence is tokenized as the RM and
PPO see it: `tokenizer(prompt + response)` then EOS (`encode_pairs`; TRL appends the EOS text to each
response), the prompt as `tokenizer(prompt)` (`encode_prompt`; BOS where the tokenizer adds one). Pairs
longer than max_length are left out and counted, as in the RM stage, instead of being cut (a cut response
loses its EOS).

Outputs in `output_dir`: config.yaml, log.jsonl, checkpoints/, the policy (a standard HF causal-LM folder:
safetensors, config, tokenizer, generation config; with LoRA the adapter in adapter/, and the merged model
beside it when `merge_lora`), and metrics.json written last (its presence marks the stage done).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D
from trl import DPOConfig, DPOTrainer

from llm_rlhf.core.config import help_field, require
from llm_rlhf.core.data import load_preference_dataset
from llm_rlhf.core.errors import UserError
from llm_rlhf.core.utils import atomic_write_json, publish_files, seed_everything, temp_dir_beside
from llm_rlhf.models.accelerated import loading_whole_models
from llm_rlhf.models.loading import (
    check_not_adapter_only,
    freeze,
    load_causal_lm,
    load_tokenizer,
    torch_dtype,
)
from llm_rlhf.models.reward_model import encode_pairs, pad_right
from llm_rlhf.rl.ppo_math import masked_sum
from llm_rlhf.rl.rollout import encode_prompt
from llm_rlhf.rl.token_math import logprobs_from_logits
from llm_rlhf.training.hf_stage import (
    SCHEDULERS,
    TrainerStageConfig,
    check_reload,
    final_eval,
    first_rows,
    log_callback,
    start_outputs,
    trainer_checkpoint,
    training_metrics,
    whole_model,
)

LOSS_TYPES = ("sigmoid", "hinge", "ipo")  # TRL's losses that need nothing but beta
# TRL's evaluation metrics that go to metrics.json (each the mean over the eval batches of a per-batch mean)
EVAL_METRICS = (
    "eval_loss",
    "eval_rewards/chosen",
    "eval_rewards/rejected",
    "eval_rewards/accuracies",
    "eval_rewards/margins",
    "eval_logps/chosen",
    "eval_logps/rejected",
    "eval_entropy",
    "eval_mean_token_accuracy",
)


@dataclasses.dataclass
class Config(TrainerStageConfig):
    """The DPO stage's keys: the shared ones of `TrainerStageConfig` (optimiser, LoRA, logging and
    checkpoints), the RM stage's preference data, and beta and the loss."""

    # --- model and data ---
    model_name_or_path: str = help_field(
        "runs/reviews/sft",
        "The SFT model (local HF folder or hub name): the starting policy and the frozen reference pi_ref.",
    )
    train_file: str = help_field(
        "data/reviews/prefs_train.jsonl",
        "Preference pairs (the RM stage's): .jsonl/.json/.csv/.parquet or a hub dataset (prompt/chosen/rejected, "
        "chosen/rejected full texts, or prompt + ranked: all K(K-1)/2 pairs of a ranking).",
    )
    eval_file: str = help_field(
        "data/reviews/prefs_val.jsonl",
        "Held-out pairs: DPO loss, reward accuracy and margins during training and at the end (eval_*).",
    )
    data_format: str = help_field(
        "auto",
        "Schema of train_file and eval_file: 'auto' (detected from the columns) or 'hh' (Anthropic/hh-rlhf "
        "chosen/rejected dialogues, also detected by 'auto': the shared text up to the last "
        "'\\n\\nAssistant:' is the prompt).",
    )
    skip_long: bool = help_field(
        False,
        "Leave out (and count) pairs whose prompt leaves no room for a response within max_length; "
        "false = stop with an error naming the row.",
    )
    output_dir: str = help_field(
        "runs/reviews/dpo", "Where the policy, checkpoints/, log.jsonl and metrics.json go."
    )
    max_length: int = help_field(
        128,
        "Tokens per sequence (prompt + response + EOS), as in the RM stage; longer pairs are left out of "
        "training and of the in-training evaluation (never cut: a cut response loses its EOS).",
    )
    # --- optimisation ---
    learning_rate: float = help_field(5e-6, "Peak AdamW learning rate.")
    per_device_train_batch_size: int = help_field(16, "Pairs per device per micro-batch (2x sequences).")
    lr_scheduler_type: str = help_field(
        "linear", f"Learning-rate schedule after warm-up: one of {', '.join(SCHEDULERS)}."
    )
    group_by_length: bool = help_field(
        True,
        "Batch pairs of similar length (less padding: faster, above all on CPU); false = uniform shuffling.",
    )
    # --- LoRA ---
    use_lora: bool = help_field(
        False,
        "Train a LoRA adapter (peft); the reference is then the same network with the adapter disabled "
        "(no second copy in memory).",
    )
    lora_dropout: float = help_field(0.0, "Dropout on the LoRA branch (only when disable_dropout is false).")
    merge_lora: bool = help_field(
        True,
        "With LoRA: also save the merged policy as a plain HF folder in output_dir (what `llm-rlhf eval` "
        "reads); the adapter is always saved in output_dir/adapter.",
    )
    # --- DPO ---
    beta: float = help_field(
        0.1,
        "DPO's beta: the implicit reward is beta * (log pi_theta - log pi_ref); larger = stay closer to the "
        "reference (for ipo, the regularisation tau).",
    )
    loss_type: str = help_field(
        "sigmoid",
        f"One of {', '.join(LOSS_TYPES)}: sigmoid = -log sigmoid(beta * margin) (DPO), hinge = "
        "relu(1 - beta * margin) (SLiC), ipo = (margin / tokens - 1 / (2 beta))^2 (IPO, per-token log-ratios).",
    )
    per_device_eval_batch_size: int = help_field(32, "Pairs per device per evaluation batch.")
    disable_dropout: bool = help_field(
        True, "Turn every dropout off in the policy and the reference (LoRA's too)."
    )

    def __post_init__(self):
        super().__post_init__()
        require(self.beta > 0, "beta", "must be > 0")
        require(self.loss_type in LOSS_TYPES, "loss_type", f"must be one of {', '.join(LOSS_TYPES)}")
        require(self.per_device_eval_batch_size >= 1, "per_device_eval_batch_size", "must be >= 1")


# ---------------------------------------------------------------------------------------------------
# Inputs: everything is validated before anything is written
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    tokenizer: object
    model: object  # the policy, initialised from the SFT model
    ref_model: object | None  # a frozen copy of the SFT model; None with LoRA (adapter disabled instead)
    train: Dataset  # prompt/chosen/rejected strings and length: the pairs that fit in max_length
    eval: Dataset
    pairs_read: int  # train pairs in train_file
    dropped: tuple[int, int]  # train and eval pairs longer than max_length, left out


def load_inputs(cfg: Config) -> Inputs:
    """Tokenizer, the two pair sets (those that fit in max_length), the policy and (full fine-tuning) the
    reference, all checked."""
    cfg.check_outputs()
    hint = " (train it with `llm-rlhf sft`)" if cfg.model_name_or_path.rstrip("/").endswith("sft") else ""
    cfg.check_model_path(hint)
    check_not_adapter_only(cfg.model_name_or_path)
    tokenizer = load_tokenizer(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    rules = {"max_length": cfg.max_length, "data_format": cfg.data_format, "skip_long": cfg.skip_long}
    train = load_preference_dataset(cfg.train_file, tokenizer, split=cfg.train_split, **rules)
    val = load_preference_dataset(cfg.eval_file, tokenizer, split=cfg.eval_split, **rules)
    val = first_rows(val, cfg.max_eval_samples)
    train_fitting, dropped = fitting_pairs(train, tokenizer, cfg.max_length)
    eval_fitting, eval_dropped = fitting_pairs(val, tokenizer, cfg.max_length)
    for key, dataset in (("train_file", train_fitting), ("eval_file", eval_fitting)):
        if len(dataset) == 0:
            raise UserError(f"{key}: no pair fits in max_length={cfg.max_length} tokens; raise max_length")
    # Local folders by absolute path: a LoRA adapter records its base model's path in adapter_config.json.
    name = cfg.model_name_or_path
    name = os.path.abspath(os.path.expanduser(name)) if os.path.isdir(os.path.expanduser(name)) else name
    load = {"dtype": cfg.dtype, "trust_remote_code": cfg.trust_remote_code}
    model = load_causal_lm(name, **load)
    ref_model = None if cfg.use_lora else freeze(load_causal_lm(name, **load))
    return Inputs(
        tokenizer, model, ref_model, train_fitting, eval_fitting, len(train), (dropped, eval_dropped)
    )


def fitting_pairs(pairs, tokenizer, max_length: int) -> tuple[Dataset, int]:
    """The pairs whose two sequences (prompt + response + EOS, `encode_pairs`) fit in max_length, plus
    `length` (the longer of the two, for group_by_length; TRL's collator ignores it). TRL would cut the
    longer ones at max_length; they are left out instead, as in the RM stage. Returns (dataset, number left out)."""
    chosen = encode_pairs(tokenizer, pairs["prompt"], pairs["chosen"])
    rejected = encode_pairs(tokenizer, pairs["prompt"], pairs["rejected"])
    lengths = [max(len(c), len(r)) for c, r in zip(chosen, rejected)]
    keep = [i for i, n in enumerate(lengths) if n <= max_length]
    dataset = Dataset.from_dict(
        {
            "prompt": [pairs["prompt"][i] for i in keep],
            "chosen": [pairs["chosen"][i] for i in keep],
            "rejected": [pairs["rejected"][i] for i in keep],
            "length": [lengths[i] for i in keep],
        }
    )
    return dataset, len(lengths) - len(keep)


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


def build_trainer(cfg: Config, model, ref_model, tokenizer, train_dataset, eval_dataset) -> DPOTrainer:
    """TRL's DPOTrainer on prompt/chosen/rejected strings (TRL appends the EOS and tokenizes them as
    `encode_pairs` does; pinned by tests/stages/test_bos_prompts.py). ref_model None: the LoRA reference."""
    args = DPOConfig(
        **cfg.training_arguments(),
        beta=cfg.beta,
        loss_type=[cfg.loss_type],
        disable_dropout=cfg.disable_dropout,
        per_device_eval_batch_size=cfg.per_device_eval_batch_size,
        truncation_mode="keep_start",  # never reached: pairs longer than max_length are left out first
        length_column_name="length",
        remove_unused_columns=False,  # keep `length` for the sampler; the collator reads only its own keys
        # `accelerate launch` with several processes on a machine without GPUs: transformers only sets up
        # DDP over gloo when told to use the CPU; otherwise every process would train its own copy.
        # and bf16 autocast on a CPU is refused unless the run is marked as a CPU run
        use_cpu=(int(os.environ.get("WORLD_SIZE", "1")) > 1 or cfg.bf16) and not torch.cuda.is_available(),
    )
    return DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=lora_config(cfg, model) if cfg.use_lora else None,
        callbacks=[log_callback(Path(cfg.output_dir) / "log.jsonl")],
    )


# ---------------------------------------------------------------------------------------------------
# Log-probabilities of responses (the reload check, and what the tests hold TRL's numbers against)
# ---------------------------------------------------------------------------------------------------


def response_token_mask(prompt_lengths: list[int], attention_mask: torch.Tensor) -> torch.Tensor:
    """True on the response tokens (EOS included) of right-padded prompt + response rows. (B, T) bool.

    tokens:         x  x  x  y  y  EOS pad pad
    attention_mask: 1  1  1  1  1  1   0   0
    response mask:  0  0  0  1  1  1   0   0        (prompt length 3)
    """
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)  # (T,)
    starts = torch.tensor(prompt_lengths, device=attention_mask.device)  # (B,)
    return (positions[None, :] >= starts[:, None]) & attention_mask.bool()  # (B, T)


def sequence_logprobs(
    *, logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """log pi(y | x) = sum_t log pi(y_t | x, y_<t) over the response tokens. logits: (B, T, V), input_ids and
    response_mask: (B, T). Returns (B,)."""
    # (B, T-1): position t predicts token t + 1
    logprobs = logprobs_from_logits(logits=logits[:, :-1], labels=input_ids[:, 1:])
    return masked_sum(logprobs, response_mask[:, 1:], dim=1)  # (B,) the first token is never a response token


@torch.no_grad()
def response_logprobs(
    model, tokenizer, prompts: list[str], responses: list[str], *, batch_size: int = 32
) -> torch.Tensor:
    """log pi(response + EOS | prompt) for each pair of texts, tokenized as in training: the sequence is
    `encode_pairs`, the response starts where it leaves `encode_prompt(prompt)` (TRL's common prefix). (N,)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sequences = encode_pairs(tokenizer, prompts, responses)
    prompt_lengths = []
    for prompt, ids in zip(prompts, sequences):
        prompt_ids = encode_prompt(tokenizer, prompt)
        n = 0
        while n < min(len(prompt_ids), len(ids)) and prompt_ids[n] == ids[n]:
            n += 1  # the shared prefix: tokens that merge across the boundary belong to the response
        prompt_lengths.append(n)
    out = []
    for start in range(0, len(sequences), batch_size):
        rows = sequences[start : start + batch_size]
        input_ids, attention_mask = pad_right(rows, tokenizer.pad_token_id, device)  # (b, T) each
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).logits  # (b, T, V)
        logits = logits.float()
        mask = response_token_mask(prompt_lengths[start : start + batch_size], attention_mask)  # (b, T)
        out.append(sequence_logprobs(logits=logits, input_ids=input_ids, response_mask=mask).cpu())
    model.train(was_training)
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------


def save_policy(model, tokenizer, folder: Path, *, merge_lora: bool):
    """The policy as a standard HF folder: full weights, or with LoRA the adapter in folder/adapter (plus the
    merged weights in folder when merge_lora); the tokenizer and generation config beside them. Returns the
    model whose weights are in `folder` (the merged one), or the peft model when only the adapter is saved."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if isinstance(model, PeftModel):
        model.save_pretrained(folder / "adapter", safe_serialization=True)
        model.generation_config.save_pretrained(folder / "adapter")
        tokenizer.save_pretrained(folder / "adapter")
        if not merge_lora:
            tokenizer.save_pretrained(folder)
            return model
        model = model.merge_and_unload()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return model


def load_saved_policy(folder: Path, *, dtype: str = "float32"):
    """What a user loads: the plain HF folder, or the adapter on its base model when only it was saved."""
    if (folder / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype), use_safetensors=True)
    adapter = folder / "adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    return PeftModel.from_pretrained(load_causal_lm(base, dtype=dtype), adapter)


# ---------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------


def run(cfg: Config) -> dict[str, float]:
    """Validate inputs, train with DPOTrainer, evaluate, save the policy, write metrics.json."""
    started = time.time()
    inputs = load_inputs(cfg)
    tokenizer, output_dir = inputs.tokenizer, Path(cfg.output_dir)
    train_dataset, eval_dataset, (dropped, eval_dropped) = inputs.train, inputs.eval, inputs.dropped
    checkpoint = trainer_checkpoint(output_dir) if cfg.resume else None

    seed_everything(cfg.seed)
    trainer = build_trainer(cfg, inputs.model, inputs.ref_model, tokenizer, train_dataset, eval_dataset)
    main = trainer.accelerator.is_main_process
    if main:
        start_outputs(cfg, output_dir)  # the first write: every input is valid by now
        lengths = sorted(train_dataset["length"])
        print(
            f"train: {len(train_dataset)} pairs ({inputs.pairs_read} read, {dropped} longer than max_length="
            f"{cfg.max_length} left out), tokens per longer sequence median {lengths[len(lengths) // 2]}, max "
            f"{lengths[-1]}; eval: {len(eval_dataset)} pairs ({eval_dropped} left out)",
            flush=True,
        )
    if checkpoint:
        print(f"resuming from {checkpoint}", flush=True)

    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    eval_metrics = final_eval(trainer)
    trainer.accelerator.wait_for_everyone()

    metrics: dict[str, float] = {}
    model = whole_model(trainer, dtype=torch_dtype(cfg.dtype))  # every process: a gather under ZeRO-3
    if main:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tmp = temp_dir_beside(output_dir / "final")  # inside output_dir: moving files out of it is atomic
        saved = save_policy(model, tokenizer, tmp, merge_lora=cfg.merge_lora)
        with loading_whole_models(trainer.accelerator):  # ZeRO-3: from_pretrained off zero.Init
            check_reload(
                saved,
                lambda: load_saved_policy(tmp, dtype=cfg.dtype),
                lambda model, prompts, responses: response_logprobs(model, tokenizer, prompts, responses),
                inputs.eval,
                what="the saved policy gives other log-probs",
                rtol=1e-4,
            )
        publish_files(tmp, output_dir)
        metrics = {key: float(value) for key, value in eval_metrics.items() if key in EVAL_METRICS}
        metrics.update(
            {
                **training_metrics(trainer, train_output),
                "train_pairs": len(train_dataset),
                "train_pairs_too_long": dropped,
                "eval_pairs": len(eval_dataset),
                "trainable_parameters": trainable,
                "total_runtime_s": time.time() - started,
            }
        )
        print(json.dumps(metrics, indent=2), flush=True)
        atomic_write_json(output_dir / "metrics.json", metrics)  # last: marks the stage done
    trainer.accelerator.wait_for_everyone()
    return metrics
