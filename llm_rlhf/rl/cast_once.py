"""Autocast without re-casting the weights that do not train.

    frozen_weights_cast_once(*models)   inside: under autocast, every linear layer (nn.Linear, GPT-2's Conv1D)
                                        whose weight and bias need no gradient runs from copies of them in
                                        autocast's dtype, made at the layer's first call and kept to the end;
                                        outside autocast, and for a layer that trains, the layer's own forward

`torch.autocast` computes a linear layer in bf16 by casting its float32 input, weight and bias at every call.
It keeps a cast for the rest of its region only for a leaf tensor that requires a gradient, so the weights
that do not train are cast again at every forward: a LoRA model's base weights, the frozen reference and
reward model. The largest is the LM head: SmolLM2-135M's (49,152 x 576, tied to the embedding) took 23 ms to
cast on a 2-core Intel Xeon, at each of the 22 forwards of a PPO step of the main job (rollout chunks,
reference, 12 minibatches): about 0.5 s of a 9 s step.

The copy is what autocast casts to (`weight.to(dtype)`), so a layer computes the same numbers, bit for bit,
with the same kernel (`F.linear`, and `addmm` for Conv1D, each under the same autocast, which still casts the
input) — `tests/rl/test_cast_once.py`. A copy is made again when its weight changed (another storage or an
in-place write that moved its version counter). Meant for a region where the frozen weights stay as they are
(a PPO step, an evaluation); the copies are freed on exit. Shards (FSDP2's DTensor, ZeRO-3's placeholder) and
layers that carry a forward of their own (accelerate's hooks) keep their forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


def is_whole(weight: torch.Tensor) -> bool:
    """A plain tensor holding the whole weight: not a shard (FSDP2's DTensor, ZeRO-3's empty placeholder outside
    its gather), which keeps its own forward."""
    return type(weight.data) is torch.Tensor and weight.numel() > 0


class LowCopies:
    """Copies of tensors in a dtype, one per (tensor, dtype), made again when the tensor changed."""

    def __init__(self):
        self.held: dict[tuple[int, torch.dtype], tuple[tuple, torch.Tensor]] = {}

    def get(self, tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if tensor is None:
            return None
        stamp = (tensor.data_ptr(), tensor._version, tensor.device, tensor.shape, tensor.dtype)
        key = (id(tensor), dtype)
        held = self.held.get(key)
        if held is None or held[0] != stamp:
            with torch.no_grad(), torch.inference_mode(False):
                held = (stamp, tensor.detach().to(dtype))
            self.held[key] = held
        return held[1]


def cast_once_forward(module: nn.Module, copies: LowCopies):
    """The forward of one linear layer (nn.Linear: x W^T + b; Conv1D: x W' + b by addmm) from copies of its
    weight and bias in autocast's dtype while autocast is on and neither needs a gradient; else its own."""
    own = type(module).forward
    conv = isinstance(module, Conv1D)

    def forward(x, *args, **kwargs):
        weight, bias = module.weight, module.bias
        device = x.device.type
        if (
            not torch.is_autocast_enabled(device)
            or weight.requires_grad
            or (bias is not None and bias.requires_grad)
            or weight.dtype == torch.float64  # autocast leaves float64 alone
        ):
            return own(module, x, *args, **kwargs)
        dtype = torch.get_autocast_dtype(device)
        low_weight, low_bias = copies.get(weight, dtype), copies.get(bias, dtype)
        if conv:  # GPT-2's own kernel: addmm(b, x (N, in), W' (in, out))
            out = torch.addmm(low_bias, x.view(-1, x.size(-1)), low_weight)
            return out.view(x.size()[:-1] + (low_weight.shape[1],))
        return nn.functional.linear(x, low_weight, low_bias)

    forward.cast_once = True
    return forward


def is_cast_once(module: nn.Module) -> bool:
    """Whether the module runs `frozen_weights_cast_once`'s forward (which a decoding context may replace)."""
    return getattr(vars(module).get("forward"), "cast_once", False)


@contextmanager
def frozen_weights_cast_once(*models: nn.Module | None):
    """Inside, the linear layers of `models` whose weight needs no gradient now (None entries skipped; a layer
    two models share, once) run `cast_once_forward`, which checks again at each call; on exit their own forwards again, the copies freed. The parameters are never written."""
    copies, replaced, seen = LowCopies(), [], set()
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if id(module) in seen or "forward" in vars(module):
                continue
            seen.add(id(module))
            linear = type(module) in (nn.Linear, Conv1D)
            if linear and is_whole(module.weight) and not module.weight.requires_grad:
                module.forward = cast_once_forward(module, copies)
                replaced.append(module)
    try:
        yield
    finally:
        for module in replaced:
            del module.forward
        copies.held.clear()
