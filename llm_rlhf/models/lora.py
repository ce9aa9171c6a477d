"""Where LoRA adapters go: peft's `target_modules` and `layers_to_transform` from a stage's config keys.

    lora_target_modules  module names ("all-linear": every linear layer of the blocks), or None (peft's
                         default for the architecture: Llama q_proj and v_proj, GPT-2 c_attn)
    lora_layers          adapters only in the last N transformer blocks, or None (every block)

With adapters only in the last N of L blocks nothing below block L - N needs a gradient, so autograd stops
there: the backward pass runs through N blocks instead of L (the forward is unchanged). On SmolLM2-135M (30
blocks), N = 10 is about twice as fast a training step as every block (`recipes/smollm2-reviews/README.md`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.pytorch_utils import Conv1D

from llm_rlhf.core.errors import ConfigError


def block_count(model) -> int:
    """The number of transformer blocks (`num_hidden_layers`; GPT-2's n_layer is an alias of it)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def linear_names(model) -> list[str]:
    """The last name component of every linear (or GPT-2 Conv1D) layer inside the blocks: what peft's
    "all-linear" adapts, spelled out (peft takes no layer list with "all-linear"). The output layers
    (`lm_head`, a reward model's `score`, a value head) are outside the blocks and left out."""
    names = set()
    for name, module in model.named_modules():
        parts = name.split(".")
        in_block = any(p.isdigit() for p in parts)  # model.layers.3.mlp.up_proj, transformer.h.3.attn.c_attn
        if in_block and isinstance(module, (nn.Linear, Conv1D)):
            names.add(parts[-1])
    return sorted(names)


def lora_placement(model, target_modules: list[str] | str | None, lora_layers: int | None) -> dict[str, Any]:
    """peft `LoraConfig` keyword arguments for the adapters' places: `target_modules`, and
    `layers_to_transform` = the indices of the last `lora_layers` blocks when it is set.

    target_modules: a list of names, ["all-linear"] / "all-linear", or None (peft's default)."""
    all_linear = target_modules == "all-linear" or target_modules == ["all-linear"]
    if lora_layers is None:
        return {"target_modules": "all-linear" if all_linear else target_modules}
    n = block_count(model)
    if not 1 <= lora_layers <= n:
        raise ConfigError(
            f"config key 'lora_layers': {lora_layers} must be between 1 and the model's {n} blocks"
        )
    if all_linear:
        targets = linear_names(model)
    elif target_modules is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        model_type = model.config.model_type
        if model_type not in DEFAULTS:
            raise ConfigError(
                f"config key 'lora_target_modules': peft has no default for '{model_type}' models; name the "
                "modules (or all-linear) to use lora_layers"
            )
        targets = list(DEFAULTS[model_type])
    else:
        targets = list(target_modules)
    return {"target_modules": targets, "layers_to_transform": list(range(n - lora_layers, n))}
