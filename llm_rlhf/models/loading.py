"""Loading models and tokenizers, the value head, the reference forward, and `freeze()`.

Weights load through safetensors only (`use_safetensors=True`); `trust_remote_code` stays off unless
the user's config turns it on.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.activations import GELUTanh, NewGELUActivation

from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.rl.token_math import position_ids_from_mask

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"dtype '{name}' is not one of {sorted(DTYPES)}")
    return DTYPES[name]


# Local model folders that a script of this repository builds, by folder name.
BUILT_BY = {
    "smollm2-135m-instruct": "python data/make_smollm2.py",
    "base_model": "python data/make_base_model.py --data data/reviews --out data/reviews/base_model",
}


def check_local_folder(name_or_path: str, what: str = "model") -> None:
    """A path-like name (./x, /x, ~/x, a/b/c, or a/b whose folder a/ exists here, like
    data/smollm2-135m-instruct) is a local folder, not a hub id (org/name): when it is missing, say so in
    one line, with the command that builds it when a script of this repository does."""
    path = Path(name_or_path).expanduser()
    local = (
        name_or_path.startswith((".", "/", "~"))
        or name_or_path.count("/") > 1
        or (str(path.parent) != "." and path.parent.is_dir())
    )
    if path.is_dir() or not local:
        return
    build = BUILT_BY.get(path.name)
    raise UserError(
        f"{what} '{name_or_path}': no such folder" + (f"; build it with `{build}`" if build else "")
    )


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, padding_side: str = "right"):
    """AutoTokenizer with a pad token. Tokenizers without one (GPT-2) reuse EOS as pad: every mask in
    this package comes from attention masks and lengths, never from `input_ids == pad_token_id`, so the
    real EOS of a response is never mistaken for padding."""
    check_local_folder(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load tokenizer '{name_or_path}': {str(e).splitlines()[0]}") from None
    if tokenizer.eos_token is None:
        raise UserError(f"tokenizer '{name_or_path}' has no EOS token; responses could never stop")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def tokenizer_or_load(cfg, tokenizer=None, model=None, *, padding_side: str = "right"):
    """The tokenizer a stage works with: a copy of the caller's (the Python API), given the pad token and the
    padding side `load_tokenizer` gives, else `cfg.model_name_or_path`'s. A model without its tokenizer is a
    UserError: the token ids mean nothing without it."""
    if tokenizer is None:
        if model is not None:
            raise UserError("tokenizer: a model passed as an object needs its tokenizer (tokenizer=...)")
        return load_tokenizer(
            cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code, padding_side=padding_side
        )
    if tokenizer.eos_token is None:
        raise UserError("tokenizer: it has no EOS token; responses could never stop")
    tokenizer = copy.deepcopy(tokenizer)  # the caller's keeps its own padding side
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def check_embeddings(model, tokenizer, what: str, hint: str) -> None:
    """A model given another's tokenizer (the Python API: a baseline or a reference reads the policy's token
    ids) needs an embedding row for each of its ids; a UserError naming `what`, with `hint`, when it has fewer.
    (Equal counts do not prove equal vocabularies; fewer rows prove different ones.)"""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise UserError(
            f"{what}: its embeddings have {rows} rows, fewer than the {len(tokenizer)} tokens of the policy's "
            f"tokenizer; {hint}"
        )


@dataclasses.dataclass
class Trained:
    """What a stage returns to Python: the trained model (the policy's causal LM for PPO, a `RewardModel`
    for the RM stage), its tokenizer, the value head where PPO trained one, and the stage's metrics (those
    of metrics.json; empty on all but the main process)."""

    model: Any
    tokenizer: Any
    metrics: dict[str, Any]
    value_head: Any = None


def max_positions(model) -> int | None:
    """The longest sequence the model's config allows: n_positions (GPT-2's learned position table has no row
    beyond it) or max_position_embeddings; None where the config names neither."""
    config = getattr(model, "config", None)
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def check_positions(model, longest_prompt: int, max_new_tokens: int, what: str) -> None:
    """The longest prompt plus max_new_tokens fits the model's positions (`max_positions`): a ConfigError naming
    max_new_tokens before any sampling, not an index error in the middle of a run (GPT-2) or responses past the
    positions the model was trained on (rotary models)."""
    limit = max_positions(model)
    if limit is not None and longest_prompt + max_new_tokens > limit:
        raise ConfigError(
            f"config key 'max_new_tokens': the longest prompt ({longest_prompt} tokens) + max_new_tokens "
            f"({max_new_tokens}) = {longest_prompt + max_new_tokens} exceeds the {limit} positions of {what}; "
            "lower max_new_tokens or max_prompt_length"
        )


def shares_vocab(tokenizer, other_tokenizer) -> bool:
    """True when every token id of `tokenizer` means the same token to `other_tokenizer` (extra tokens of
    the other, e.g. the pad token an RM adds, are fine): then a policy's sequences go to the RM as ids,
    not as re-tokenised text."""
    other = other_tokenizer.get_vocab()
    return all(other.get(token) == i for token, i in tokenizer.get_vocab().items())


def check_not_adapter_only(name_or_path: str) -> None:
    """A local folder with a LoRA adapter and no full weights (an SFT run with merge_lora false) cannot be
    the base of the next stage: transformers loads such a folder as its base model with the adapter
    attached, and the RM then fails deep inside training. Say so in one line. The adapter is not merged on
    the fly: the RM, PPO (whose reference is this model) and evaluation should all read one saved model."""
    folder = Path(name_or_path).expanduser()
    has_weights = any(folder.glob("model*.safetensors")) or (folder / "model.safetensors.index.json").exists()
    if (folder / "adapter_config.json").is_file() and not has_weights:
        raise UserError(
            f"'{name_or_path}' holds a LoRA adapter only (adapter_config.json, no model weights); the next "
            "stage needs the merged model: run the SFT stage with --merge_lora true"
        )


def load_causal_lm(name_or_path: str, *, dtype: str = "float32", trust_remote_code: bool = False):
    """AutoModelForCausalLM from a hub name or a local HF folder, safetensors only."""
    check_local_folder(name_or_path)
    check_not_adapter_only(name_or_path)
    try:
        return AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=torch_dtype(dtype), use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load model '{name_or_path}': {str(e).splitlines()[0]}") from None


def use_fused_gelu(model: nn.Module) -> nn.Module:
    """Swap GPT-2's `gelu_new` (eight elementwise kernels written in Python, their intermediates kept for
    backward) for the same tanh approximation in one kernel, transformers' `gelu_pytorch_tanh`: equal up
    to float rounding (|diff| < 1e-6), and faster in a GPT-2 PPO update on CPU (`benchmarks/ppo_step.py --profile`).
    In memory only: the config, and so every saved folder, still says `gelu_new`."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
    return model


def use_eager_attention(model: nn.Module, *, bf16: bool, device: torch.device | str) -> nn.Module:
    """Under bf16 autocast on a CPU, every transformers model inside `model` (a policy, a reward model or an
    ensemble's members) computes attention with its eager implementation (two matmuls and a float32 softmax)
    instead of SDPA, whose CPU kernel is the slow part in bf16: fwd+bwd of (32, 9, 45, 64) 26 ms against 6,
    a decode step's 0.63 ms against 0.19 (`benchmarks/cpu_kernels.py`). The same attention up to float
    rounding. device: where the model runs (a stage may load it on the CPU and move it later); on another
    device, in float32 or with another implementation chosen the model is left as it is. In memory only:
    saved folders keep their config."""
    if not bf16 or torch.device(device).type != "cpu":
        return model
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation == "sdpa":
            module.set_attn_implementation("eager")
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode (dropout off) and no gradients: used for the reference policy and the reward model."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class ValueHead(nn.Module):
    """V_psi(s_t): a linear map from the trunk's last hidden state to one scalar per position.

    Initialised to zero (Huang et al. 2023, "The N implementation details of RLHF with PPO"): V = 0 at the
    first step instead of random values of the hidden states' scale, which the first updates would spend
    unlearning while they also train the shared trunk. Its gradient is not zero: dL/dw = sum_t dL/dV_t h_t.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden_states).squeeze(-1)  # (B, L, H) -> (B, L)


class PolicyWithValue(nn.Module):
    """The policy pi_theta (a causal LM, possibly a peft model) and its value head on the same trunk.

    One forward gives the logits and the values, so the rollout's old log-probs and values come from a
    single pass, and so does every training micro-batch. value_head None: a separate critic gives the
    values (`value_model: reward`) and the policy holds no parameter that the loss does not use (DDP's
    reducer fails on such a parameter).
    """

    def __init__(self, lm: nn.Module, value_head: ValueHead | None):
        super().__init__()
        self.lm = lm
        self.value_head = value_head

    @property
    def _no_split_modules(self):
        """The LM's transformer-block classes: accelerate's FSDP auto-wrap shards at these blocks."""
        return getattr(self.lm, "_no_split_modules", None)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int | torch.Tensor = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, attention_mask: (B, L) -> logits (B, L, V), values (B, L) (None without a value head).
        logits_to_keep (transformers' argument; e.g. a (K,) tensor of positions): logits (B, K, V) at those
        positions only (the LM head is the largest matmul of a small LM); values stay (B, L)."""
        out = self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            output_hidden_states=self.value_head is not None,
            use_cache=False,
            logits_to_keep=logits_to_keep,
        )
        if self.value_head is None:
            return out.logits, None
        hidden = out.hidden_states[-1]  # (B, L, H) after the final layer norm
        return out.logits, self.value_head(hidden.to(self.value_head.summary.weight.dtype))


class Reference(nn.Module):
    """pi_ref: a plain causal-LM forward with positions from the attention mask, the same code path as
    the policy's forward (so KL_t = 0 and rho = 1 exactly while the weights are equal)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int | torch.Tensor = 0
    ) -> torch.Tensor:
        return self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            logits_to_keep=logits_to_keep,
        ).logits  # (B, L, V), or (B, K, V) at the K positions in logits_to_keep
