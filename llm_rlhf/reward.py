"""Stage 2, the reward model: the SFT transformer with a linear head to one scalar, trained on preferences.

    r_phi(x, y) = w . h_L(x + y)[last non-pad token]          (AutoModelForSequenceClassification, num_labels=1)
    L(phi)      = -mean( log sigmoid( r(x, y_w) - r(x, y_l) - margin ) )    (Bradley-Terry; TRL's RewardTrainer)

What the model reads, and where the score lands (the same for training, `RewardModel` and PPO):

    tokens          = tokenizer(prompt + response) + [EOS]      (TRL's convention: EOS appended to each response)
    right padding:    x  x  x  y  y  EOS pad pad        left padding:  pad pad x  x  x  y  y  EOS
    attention_mask:   1  1  1  1  1  1   0   0                         0   0   1  1  1  1  1  1
    position_ids:     0  1  2  3  4  5   5   5                         0   0   0  1  2  3  4  5
    score read at:                   ^                                                         ^

`position_ids = cumsum(attention_mask) - 1` (clamped at 0), so left padding does not shift absolute
positions (GPT-2 would otherwise read them from the padded index).

The pad token. transformers' sequence-classification pooling reads "the rightmost token != pad_token_id".
GPT-2 tokenizers have no pad token and the usual fix, pad = EOS, makes that pooling skip the EOS that TRL
appends and read the token before it. So the RM gets a dedicated pad token (`<|pad|>`, one new embedding
row, zero and never read: padded positions are masked). With it TRL's pooling during training, our
`RewardModel.forward` (which gathers at the last position where attention_mask is 1, and so does not even
depend on the pad id) and plain `AutoModelForSequenceClassification` on the saved folder all read the EOS.
Token ids of the SFT tokenizer stay valid RM ids (only the pad token is added).

Normalisation: after training, the mean and (population) std of the raw scores on a reference set, the
unique prompt + response texts (chosen and rejected) of the training pairs, are stored in
`reward_normalization.json` (and in config.json as `reward_normalization` for full models), so that
`load_reward_model(...).score` returns roughly N(0, 1) scores. Plain transformers still loads the folder
and returns raw scores.

Outputs in `output_dir`: config.yaml, log.jsonl, checkpoints/, the model (a standard HF folder: safetensors,
config, tokenizer; with LoRA an adapter folder whose `modules_to_save` holds the trained score head; load it
with `load_reward_model`, or plain peft: `AutoPeftModelForSequenceClassification.from_pretrained(dir,
num_labels=1)`), reward_normalization.json, and metrics.json written last (its presence marks the stage done).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path

import torch
from torch import nn

from llm_rlhf.config import format_config, help_field, require, save_config
from llm_rlhf.data import DATA_FORMATS
from llm_rlhf.errors import ConfigError, DataError, UserError
from llm_rlhf.models import check_not_adapter_only, position_ids_from_mask
from llm_rlhf.utils import (
    append_jsonl,
    atomic_write_json,
    publish_files,
    read_json,
    seed_everything,
    temp_dir_beside,
)

PAD_TOKEN = "<|pad|>"
NORMALIZATION_FILE = "reward_normalization.json"
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay")  # fmt: skip
REPORT_TO = ("none", "tensorboard", "wandb")


@dataclasses.dataclass
class Config:
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
    test_file: str | None = help_field(
        "data/reviews/prefs_test.jsonl",
        "Final held-out pairs, evaluated once at the end (test_*); null = none.",
    )
    train_split: str = help_field("train", "Split of train_file when it is a hub dataset.")
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
    trust_remote_code: bool = help_field(
        False, "Allow model/tokenizer code from the hub (off: only trusted architectures)."
    )
    # --- loss ---
    margin: float = help_field(
        0.0,
        "Llama-2 margin: the loss is -log sigmoid(r_w - r_l - margin * m) with m the pair's `margin` "
        "column (prompt/chosen/rejected files only); 0 = plain Bradley-Terry.",
    )
    center_rewards_coefficient: float = help_field(
        0.0,
        "Adds coef * mean((r_w + r_l)^2) to the loss, pulling scores towards 0 (Eisenstein et al. 2023); 0 = off.",
    )
    # --- optimisation ---
    learning_rate: float = help_field(5e-5, "Peak AdamW learning rate.")
    num_train_epochs: float = help_field(1.0, "Passes over train_file (ignored when max_steps > 0).")
    max_steps: int = help_field(-1, "Optimizer steps to run; -1 = use num_train_epochs.")
    per_device_train_batch_size: int = help_field(16, "Pairs per device per micro-batch (2x sequences).")
    per_device_eval_batch_size: int = help_field(32, "Pairs per device per evaluation batch.")
    gradient_accumulation_steps: int = help_field(1, "Micro-batches per optimizer step.")
    warmup_ratio: float = help_field(0.05, "Fraction of the steps with a linear warm-up from 0, in [0, 1).")
    lr_scheduler_type: str = help_field(
        "linear", f"Learning-rate schedule after warm-up: one of {', '.join(SCHEDULERS)}."
    )
    weight_decay: float = help_field(0.0, "AdamW weight decay.")
    max_grad_norm: float = help_field(1.0, "Gradient clipping (global L2 norm).")
    seed: int = help_field(42, "Seed for python, numpy, torch, data order, the score head and LoRA init.")
    dtype: str = help_field("float32", "Weights dtype: float32, bfloat16 or float16.")
    bf16: bool = help_field(False, "bfloat16 autocast (mixed precision) during training.")
    gradient_checkpointing: bool = help_field(
        False, "Recompute activations in the backward pass to save memory."
    )
    group_by_length: bool = help_field(
        True,
        "Batch pairs of similar length (less padding: faster, above all on CPU); false = uniform shuffling.",
    )
    disable_dropout: bool = help_field(
        True,
        "Turn every dropout off (LoRA's too), so a pair's training scores are the scores it is judged by.",
    )
    # --- LoRA ---
    use_lora: bool = help_field(
        False,
        "Train a LoRA adapter (peft); the score head is trained in full and saved with it (modules_to_save).",
    )
    lora_r: int = help_field(16, "LoRA rank.")
    lora_alpha: int = help_field(32, "LoRA scaling numerator (scale = lora_alpha / lora_r).")
    lora_dropout: float = help_field(0.0, "Dropout on the LoRA branch (only when disable_dropout is false).")
    lora_target_modules: list[str] = help_field(
        ["all-linear"],
        "Modules that get adapters ('all-linear' = every linear/Conv1D layer but the score head).",
    )
    merge_lora: bool = help_field(
        False, "Merge the adapter and save a full HF folder instead of the adapter folder."
    )
    # --- evaluation and normalisation ---
    normalization_samples: int = help_field(
        2000,
        "Reference set for the score mean/std: up to this many unique train texts (chosen and rejected).",
    )
    score_batch_size: int = help_field(
        64, "Sequences per batch when scoring at the end (eval, test, reference set)."
    )
    # --- logging and checkpoints ---
    logging_steps: int = help_field(
        10, "Log loss/accuracy every N optimizer steps (console, log.jsonl, report_to)."
    )
    eval_steps: int = help_field(100, "Evaluate on eval_file every N steps; 0 = only at the end.")
    save_steps: int = help_field(100, "Write a checkpoint to output_dir/checkpoints every N steps.")
    save_total_limit: int = help_field(2, "Checkpoints to keep (the oldest are deleted).")
    resume: bool = help_field(False, "Continue from the last checkpoint in output_dir/checkpoints.")
    report_to: str = help_field("none", "Also send metrics to: none, tensorboard or wandb.")

    def __post_init__(self):
        require(self.data_format in DATA_FORMATS, "data_format", f"must be one of {', '.join(DATA_FORMATS)}")
        require(self.max_length >= 4, "max_length", "must be at least 4 tokens")
        require(self.learning_rate > 0, "learning_rate", "must be > 0")
        require(
            self.max_steps > 0 or self.num_train_epochs > 0,
            "num_train_epochs",
            "must be > 0 (or set max_steps)",
        )
        for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                    "logging_steps", "save_steps", "save_total_limit", "normalization_samples", "score_batch_size",
                    "lora_r"):  # fmt: skip
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
        require(self.margin >= 0, "margin", "must be >= 0 (0 = off)")
        require(self.center_rewards_coefficient >= 0, "center_rewards_coefficient", "must be >= 0 (0 = off)")
        require(self.eval_steps >= 0, "eval_steps", "must be >= 0")
        require(self.report_to in REPORT_TO, "report_to", f"must be one of {', '.join(REPORT_TO)}")
        require(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        require(len(self.lora_target_modules) > 0, "lora_target_modules", "needs at least one module name")
        require(not self.merge_lora or self.use_lora, "merge_lora", "only applies with use_lora: true")


# ---------------------------------------------------------------------------------------------------
# Where the score is read: small pure functions, pinned by tests
# ---------------------------------------------------------------------------------------------------


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position where attention_mask is 1, for any padding side. (B, T) -> (B,).

    The loop it replaces: `[max(t for t in range(T) if attention_mask[b, t]) for b in range(B)]`.
    """
    if not bool(attention_mask.bool().any(-1).all()):
        raise ValueError("every sequence needs at least one token with attention_mask == 1")
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)  # (T,)
    return (positions * attention_mask.bool()).argmax(-1)  # (B,) the largest unmasked position wins


def encode_pairs(tokenizer, prompts: list[str], responses: list[str]) -> list[list[int]]:
    """The token ids the RM scores: tokenizer(prompt + response), then EOS (unless the tokenizer added
    one). The same as TRL's RewardTrainer, which appends the EOS text to each response."""
    texts = [p + r for p, r in zip(prompts, responses, strict=True)]
    if not texts:
        return []
    eos = tokenizer.eos_token_id
    return [ids if ids and ids[-1] == eos else ids + [eos] for ids in tokenizer(texts)["input_ids"]]


def encode_pair(tokenizer, prompt: str, response: str) -> list[int]:
    return encode_pairs(tokenizer, [prompt], [response])[0]


def pad_right(sequences: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: (input_ids, attention_mask), both (B, T) long."""
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences], device=device)  # (B, T)
    attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
    return input_ids, attention_mask


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------


class RewardModel(nn.Module):
    """r_phi(x, y) of a sequence-classification model (num_labels=1), possibly wrapped by peft.

    forward(input_ids, attention_mask) -> (B,) raw scores, read at the last position where attention_mask
    is 1 (left, right or both-sided padding; the pad id does not matter). score(...) -> (B,) normalised:
    (raw - mean) / std. Attributes: `model`, `tokenizer` (with its dedicated pad token), `mean`, `std`,
    `normalization` (the stored record, None if the folder has none: then mean 0, std 1).
    """

    def __init__(self, model, tokenizer, normalization: dict | None = None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.normalization = normalization
        self.mean = float(normalization["mean"]) if normalization else 0.0
        self.std = float(normalization["std"]) if normalization else 1.0

    def _trunk_and_head(self):
        """(transformer trunk, score head) of the sequence classifier, looking through a peft wrapper."""
        model = self.model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        return inner.base_model, inner.score

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last-layer hidden states (B, T, H), with positions that ignore padding."""
        trunk, _ = self._trunk_and_head()
        out = trunk(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return out.last_hidden_state  # (B, T, H)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        _, head = self._trunk_and_head()
        hidden = self.hidden_states(input_ids, attention_mask)  # (B, T, H)
        last = last_token_index(attention_mask)  # (B,)
        rows = torch.arange(hidden.shape[0], device=hidden.device)  # (B,)
        hidden_last = hidden[rows, last]  # (B, H): the hidden state at the last non-pad token (the EOS)
        return head(hidden_last).squeeze(-1).float()  # (B,)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Normalised scores (raw - mean) / std: (B,)."""
        return (self.forward(input_ids, attention_mask) - self.mean) / self.std

    def score_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokenizer) -> torch.Tensor:
        """Normalised scores of sequences written in another tokenizer's ids (a policy's rollouts): (B,).

        Each row's unmasked tokens are decoded and re-encoded exactly as in training (`encode_pair`), so
        the RM sees the tokens it was trained on whatever the policy's tokenizer, BOS handling or
        tokenization of sampled text. A row that ends with the policy's EOS is scored as finished (EOS
        appended); a truncated row is scored at its last token, without an EOS.
        """
        texts, finished = [], []
        for ids, mask in zip(input_ids.tolist(), attention_mask.bool().tolist()):
            ids = [t for t, keep in zip(ids, mask) if keep]  # the row without its padding
            finished.append(bool(ids) and ids[-1] == tokenizer.eos_token_id)
            text = tokenizer.decode(ids[:-1] if finished[-1] else ids, clean_up_tokenization_spaces=False)
            bos = self.tokenizer.bos_token
            if bos and bos != self.tokenizer.eos_token and text.startswith(bos):
                text = text[len(bos) :]  # the RM tokenizer adds its own BOS
            texts.append(text)
        encoded = encode_pairs(self.tokenizer, texts, [""] * len(texts))  # each ends with the RM's EOS
        rows = [ids if done or len(ids) == 1 else ids[:-1] for ids, done in zip(encoded, finished)]
        rm_ids, rm_mask = pad_right(rows, self.tokenizer.pad_token_id, device=input_ids.device)
        return self.score(rm_ids, rm_mask)

    def as_critic(self) -> RewardCritic:
        """A trainable critic initialised from this RM (shares its weights: load a fresh RM for it)."""
        return RewardCritic(self)


class RewardCritic(nn.Module):
    """V(s_t) for every position: the RM's score head on each hidden state, normalised like its scores.
    (B, T) ids and mask -> (B, T) values. The classic critic initialisation from the reward model
    (Ouyang et al. 2022, sec. 3.5). Its token ids must be the RM's (the SFT tokenizer's ids are)."""

    def __init__(self, reward_model: RewardModel):
        super().__init__()
        self.reward_model = reward_model
        for p in self.reward_model.parameters():
            p.requires_grad_(True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rm = self.reward_model
        _, head = rm._trunk_and_head()
        hidden = rm.hidden_states(input_ids, attention_mask)  # (B, T, H)
        values = head(hidden).squeeze(-1).float()  # (B, T)
        return (values - rm.mean) / rm.std


def add_pad_token(model, tokenizer) -> None:
    """Give the RM a pad token of its own when it has none or pad == EOS (see the module docstring).
    The new embedding row is set to zero: padded positions are masked, so it is never read."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    embeddings = model.get_input_embeddings()
    old_rows = embeddings.num_embeddings
    if tokenizer.pad_token_id >= old_rows:  # never shrink: some models carry spare rows
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            model.get_input_embeddings().weight[old_rows:] = 0.0
    model.config.pad_token_id = tokenizer.pad_token_id


@contextlib.contextmanager
def _quiet_transformers():
    """Silence the load report that lists `score.weight` as newly initialised (expected from a causal LM)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _load_sequence_classifier(name_or_path: str, *, dtype: str, trust_remote_code: bool, need_head: bool):
    """AutoModelForSequenceClassification with one label, safetensors only. need_head: the score head must
    come from the checkpoint (a trained RM), not be freshly initialised."""
    from transformers import AutoModelForSequenceClassification

    from llm_rlhf.models import torch_dtype

    try:
        with _quiet_transformers():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                name_or_path,
                num_labels=1,
                dtype=torch_dtype(dtype),
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"cannot load model '{name_or_path}': {str(e).strip().splitlines()[0]}") from None
    if not hasattr(model, "score"):
        raise UserError(
            f"'{name_or_path}': {type(model).__name__} has no `score` head; not a causal-LM architecture"
        )
    if need_head and any(k.startswith("score") for k in info["missing_keys"]):
        raise UserError(
            f"'{name_or_path}' has no trained score head (is it a causal-LM folder?); train one with `llm-rlhf rm`"
        )
    return model


def load_reward_model(
    path: str | os.PathLike, *, dtype: str = "float32", trust_remote_code: bool = False, device=None
) -> RewardModel:
    """A saved RM folder (full model, or a LoRA adapter folder with its score head) as a `RewardModel`
    in eval mode, with the stored normalisation. A LoRA adapter is merged into its base (the SFT folder
    named in adapter_config.json) for speed; the scores are the adapter's."""
    from llm_rlhf.models import load_tokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"reward model '{path}': no such folder (train one with `llm-rlhf rm`)")
    tokenizer = load_tokenizer(str(folder), trust_remote_code=trust_remote_code)
    if (folder / "adapter_config.json").is_file():
        model = _load_lora_reward_model(folder, tokenizer, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        model = _load_sequence_classifier(
            str(folder), dtype=dtype, trust_remote_code=trust_remote_code, need_head=True
        )
    add_pad_token(model, tokenizer)  # a no-op for our folders; RMs from elsewhere may lack a pad token
    normalization = (
        read_json(folder / NORMALIZATION_FILE) if (folder / NORMALIZATION_FILE).is_file() else None
    )
    reward_model = RewardModel(model, tokenizer, normalization).eval()
    return reward_model.to(device) if device is not None else reward_model


def _load_lora_reward_model(folder: Path, tokenizer, *, dtype: str, trust_remote_code: bool):
    from peft import PeftConfig, PeftModel
    from safetensors import safe_open

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise UserError(f"'{folder}': adapter_config.json without adapter_model.safetensors")
    with safe_open(str(weights), "pt") as f:
        if not any(".score." in key or key.startswith("score.") for key in f.keys()):
            raise UserError(
                f"'{folder}': the adapter holds no score head (train with modules_to_save=['score'])"
            )
    base_path = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
    base = _load_sequence_classifier(
        base_path, dtype=dtype, trust_remote_code=trust_remote_code, need_head=False
    )
    add_pad_token(base, tokenizer)  # the same extra (zero) row as in training, before the adapter loads
    return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()


@torch.no_grad()
def score_pairs(
    model: RewardModel,
    prompts: list[str],
    responses: list[str],
    *,
    batch_size: int = 32,
    normalize: bool = True,
    max_length: int | None = None,
    progress: bool | str = False,
) -> torch.Tensor:
    """r(x, y) of each (prompt, response), batched: (N,) float32, in input order, normalised or raw.

    Sequences are sorted by length so each batch pads little. A sequence longer than `max_length`
    (default: the model's maximum positions) keeps its last `max_length` tokens: the score is read at the end.
    """
    from tqdm.auto import tqdm

    tokenizer = model.tokenizer
    config = model.model.config
    limit = (
        max_length or getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    )
    encoded = encode_pairs(tokenizer, prompts, responses)
    if limit:
        encoded = [ids[-limit:] for ids in encoded]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = torch.empty(len(encoded))
    starts = range(0, len(order), batch_size)
    for start in tqdm(
        starts, desc=progress if isinstance(progress, str) else "scoring", disable=not progress
    ):
        idx = order[start : start + batch_size]
        input_ids, attention_mask = pad_right([encoded[i] for i in idx], tokenizer.pad_token_id, device)
        scores = (
            model.score(input_ids, attention_mask) if normalize else model(input_ids, attention_mask)
        )  # (b,)
        out[idx] = scores.float().cpu()
    model.train(was_training)
    return out


# ---------------------------------------------------------------------------------------------------
# Inputs: everything is validated before anything is written
# ---------------------------------------------------------------------------------------------------


def _check_model_path(name_or_path: str) -> None:
    """A path-like name that is not a folder is a typo, not a hub id: say so without a network round trip."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        hint = " (train it with `llm-rlhf sft`)" if name_or_path.rstrip("/").endswith("sft") else ""
        raise UserError(f"model_name_or_path '{name_or_path}': no such folder{hint}")
    check_not_adapter_only(name_or_path)


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


def _margins(cfg: Config, num_pairs: int) -> list[float]:
    """The `margin` column of train_file, one float per pair (only files with one pair per row)."""
    from llm_rlhf.data import load_rows

    rows = load_rows(cfg.train_file, split=cfg.train_split)
    if "margin" not in rows.column_names or "ranked" in rows.column_names or len(rows) != num_pairs:
        raise ConfigError(
            f"config key 'margin': {cfg.margin} needs a numeric `margin` column in train_file, one pair per row "
            "(prompt/chosen/rejected or chosen/rejected); set margin: 0 for plain Bradley-Terry"
        )
    values = []
    for i, value in enumerate(rows["margin"], start=1):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(
                f"expected a finite number, got {value!r:.40}", file=cfg.train_file, row=i, field="margin"
            )
        values.append(cfg.margin * float(value))
    return values


def _tokenize(dataset, tokenizer, max_length: int, margins: list[float] | None = None):
    """prompt/chosen/rejected strings -> chosen_ids/rejected_ids (+ margin), the processed form TRL takes
    as is, plus `length` (the longer of the two, for group_by_length; TRL's collator ignores it); pairs
    longer than max_length are left out. Returns (dataset, number left out)."""
    from datasets import Dataset

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


def load_inputs(cfg: Config) -> Inputs:
    """Tokenizer (with its pad token), the three pair sets and the model, all checked."""
    from llm_rlhf.data import load_preference_dataset
    from llm_rlhf.models import load_tokenizer

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
    load = load_preference_dataset
    rules = {"max_length": cfg.max_length, "data_format": cfg.data_format, "skip_long": cfg.skip_long}
    train = load(cfg.train_file, tokenizer, split=cfg.train_split, **rules)
    val = load(cfg.eval_file, tokenizer, split=cfg.eval_split, **rules)
    test = load(cfg.test_file, tokenizer, split=cfg.eval_split, **rules) if cfg.test_file else None
    margins = _margins(cfg, len(train)) if cfg.margin > 0 else None
    # Local folders by absolute path: a LoRA adapter records its base model's path in adapter_config.json.
    name = cfg.model_name_or_path
    name = os.path.abspath(os.path.expanduser(name)) if os.path.isdir(os.path.expanduser(name)) else name
    seed_everything(cfg.seed)  # the score head is initialised at load time
    model = _load_sequence_classifier(
        name, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, need_head=False
    )
    add_pad_token(model, tokenizer)
    return Inputs(tokenizer, model, train, val, test, margins)


# ---------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------


def _log_callback(path: Path):
    from transformers import TrainerCallback

    class JsonlLog(TrainerCallback):
        """Every Trainer log line (loss, accuracy, margin, learning rate, eval metrics) appended to log.jsonl."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                append_jsonl(path, {"step": state.global_step, "epoch": state.epoch, **logs})

    return JsonlLog()


def lora_config(cfg: Config):
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        modules_to_save=["score"],  # the head is trained in full and saved with the adapter
        task_type="SEQ_CLS",
    )


def build_trainer(cfg: Config, model, tokenizer, train_dataset, eval_dataset):
    """TRL's RewardTrainer on pre-tokenized pairs (chosen_ids/rejected_ids, so tokenization is `encode_pair`'s)."""
    from trl import RewardConfig, RewardTrainer

    output_dir = Path(cfg.output_dir)
    args = RewardConfig(
        output_dir=str(output_dir / "checkpoints"),
        max_length=cfg.max_length,
        center_rewards_coefficient=cfg.center_rewards_coefficient or None,
        disable_dropout=cfg.disable_dropout,
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        per_device_eval_batch_size=cfg.per_device_eval_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        warmup_steps=cfg.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of the total steps
        lr_scheduler_type=cfg.lr_scheduler_type,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
        bf16=cfg.bf16,  # RewardConfig defaults to bf16=True and gradient_checkpointing=True: always set both
        fp16=False,
        gradient_checkpointing=cfg.gradient_checkpointing,
        logging_steps=cfg.logging_steps,
        eval_strategy="steps" if cfg.eval_steps > 0 else "no",
        eval_steps=cfg.eval_steps if cfg.eval_steps > 0 else None,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit,
        report_to=[] if cfg.report_to == "none" else [cfg.report_to],
        dataloader_num_workers=0,
        pad_to_multiple_of=None,
        train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
        length_column_name="length",
        remove_unused_columns=False,  # keep `length` for the sampler: the dataset holds nothing else extra
        trust_remote_code=cfg.trust_remote_code,
        # `accelerate launch` with several processes on a machine without GPUs: transformers only sets up
        # DDP over gloo when told to use the CPU; otherwise every process would train its own copy.
        use_cpu=int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available(),
    )
    return RewardTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=lora_config(cfg) if cfg.use_lora else None,
        callbacks=[_log_callback(output_dir / "log.jsonl")],
    )


# ---------------------------------------------------------------------------------------------------
# Evaluation, normalisation, saving
# ---------------------------------------------------------------------------------------------------


def evaluate_pairs(
    model: RewardModel, pairs, *, batch_size: int, progress: str | bool = False
) -> dict[str, float]:
    """Pairwise accuracy (ties count 1/2) and mean margin r(y_w) - r(y_l) in raw score units."""
    from llm_rlhf.baseline import pairwise_accuracy

    n = len(pairs)
    scores = score_pairs(
        model, list(pairs["prompt"]) * 2, list(pairs["chosen"]) + list(pairs["rejected"]),
        batch_size=batch_size, normalize=False, progress=progress,
    )  # fmt: skip
    chosen, rejected = scores[:n], scores[n:]  # (N,) each
    return {
        "accuracy": pairwise_accuracy(chosen.numpy(), rejected.numpy()),
        "margin": float((chosen - rejected).mean()),
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
    held-out accuracy and margin on eval (and test) pairs, with the bag-of-words baseline beside them."""
    from llm_rlhf.baseline import fit_bow_baseline

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
        metrics[f"{prefix}_pairs"] = len(pairs)
        name = "baseline_accuracy" if prefix == "eval" else f"baseline_{prefix}_accuracy"
        metrics[name] = baseline.accuracy(*_full_texts(pairs))
    metrics["baseline_C"] = baseline.C  # bag-of-words (TF-IDF uni+bigram) logistic regression
    return metrics


def save_reward_model(reward_model: RewardModel, folder: Path, *, merge_lora: bool) -> None:
    """The model (full folder, or LoRA adapter folder with its score head), tokenizer, normalisation."""
    model, tokenizer = reward_model.model, reward_model.tokenizer
    if hasattr(model, "merge_and_unload") and merge_lora:
        model = model.merge_and_unload()
    if hasattr(model, "peft_config"):
        # The extra pad row is zero and rebuilt by the loader: keep the adapter small.
        model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
    else:
        model.config.pad_token_id = tokenizer.pad_token_id
        if reward_model.normalization:
            model.config.reward_normalization = reward_model.normalization
        model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if reward_model.normalization:
        atomic_write_json(folder / NORMALIZATION_FILE, reward_model.normalization)


def _check_reload(saved: Path, reward_model: RewardModel, pairs, dtype: str) -> None:
    """The folder must give the scores the trained model gives (no re-initialised head, no lost pad row)."""
    n = min(8, len(pairs))
    prompts, responses = list(pairs["prompt"])[:n], list(pairs["chosen"])[:n]
    expected = score_pairs(reward_model, prompts, responses)
    reloaded = load_reward_model(saved, dtype=dtype).to(next(reward_model.parameters()).device)
    got = score_pairs(reloaded, prompts, responses)
    if not torch.allclose(expected, got, atol=1e-3, rtol=1e-3):
        raise RuntimeError(f"the saved reward model scores differently after reloading: {expected} vs {got}")


def run(cfg: Config) -> dict[str, float]:
    """Validate inputs, train with RewardTrainer, normalise, evaluate (with the baseline), save, write metrics."""
    started = time.time()
    inputs = load_inputs(cfg)
    tokenizer, output_dir = inputs.tokenizer, Path(cfg.output_dir)
    train_dataset, dropped = _tokenize(inputs.train, tokenizer, cfg.max_length, inputs.margins)
    eval_dataset, eval_dropped = _tokenize(inputs.eval, tokenizer, cfg.max_length)
    for name, dataset in (("train_file", train_dataset), ("eval_file", eval_dataset)):
        if len(dataset) == 0:
            raise UserError(f"{name}: no pair fits in max_length={cfg.max_length} tokens; raise max_length")
    checkpoint = last_checkpoint(output_dir) if cfg.resume else None

    seed_everything(cfg.seed)
    trainer = build_trainer(cfg, inputs.model, tokenizer, train_dataset, eval_dataset)
    main = trainer.accelerator.is_main_process
    if main:
        print(format_config(cfg), flush=True)
        save_config(cfg, output_dir)
        (output_dir / "metrics.json").unlink(missing_ok=True)  # a rerun is not done until it writes it again
        lengths = sorted(
            len(ids) for ids in list(train_dataset["chosen_ids"]) + list(train_dataset["rejected_ids"])
        )
        print(
            f"train: {len(train_dataset)} pairs ({len(inputs.train)} read, {dropped} longer than max_length="
            f"{cfg.max_length} left out), tokens per sequence median {lengths[len(lengths) // 2]}, max {lengths[-1]}; "
            f"eval: {len(eval_dataset)} pairs ({eval_dropped} left out of the in-training eval)",
            flush=True,
        )
    if checkpoint:
        print(f"resuming from {checkpoint}", flush=True)

    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.accelerator.wait_for_everyone()

    metrics: dict[str, float] = {}
    if main:
        model = trainer.accelerator.unwrap_model(trainer.model)
        reward_model = RewardModel(model, tokenizer).eval()
        metrics = normalize_and_evaluate(cfg, reward_model, inputs)
        tmp = temp_dir_beside(output_dir / "final")
        save_reward_model(reward_model, tmp, merge_lora=cfg.merge_lora)
        _check_reload(tmp, reward_model, inputs.eval, cfg.dtype)
        publish_files(tmp, output_dir)
        metrics.update({
            "train_loss": float(train_output.training_loss),
            "train_runtime_s": float(train_output.metrics.get("train_runtime", float("nan"))),
            "global_step": int(trainer.state.global_step),
            "train_pairs": len(train_dataset),
            "train_pairs_too_long": dropped,
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "total_runtime_s": time.time() - started,
        })  # fmt: skip
        print(json.dumps(metrics, indent=2), flush=True)
        atomic_write_json(output_dir / "metrics.json", metrics)  # last: marks the stage done
    trainer.accelerator.wait_for_everyone()
    return metrics
