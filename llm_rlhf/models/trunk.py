"""The frozen trunk: the blocks below the first adapter, run once per rollout and reused by every forward.

With adapters only in the last N of L blocks (`lora_layers`), blocks 0 .. K-1 (K = L - N) hold no adapter and
no trainable parameter, so their output h_K over a rollout's tokens is one tensor for the old policy, the
reference (the same network with the adapters switched off) and every PPO epoch's forward:

    without:   old policy   L blocks  |  reference  L blocks  |  each epoch  L blocks + backward of N
    with:      h_K once     K blocks  |  old policy N, reference N, each epoch N blocks + backward of N

    frozen_block_count(lm)        K: the leading blocks with no trainable parameter and no adapter
    shared_block_count(a, b)      K for two LMs: the leading blocks of equal weights, all else equal too
    trunk_states(lm, K, model, *inputs)  h_K (B, T, H): block K-1's output in `model(*inputs)`, stopped there
    from_trunk(lm, h_K, K)        inside: blocks 0..K-2 pass their input through and block K-1 returns h_K,
                                  so a forward computes the embeddings, then blocks K..L-1 on h_K

A forward inside `from_trunk` computes the same outputs as the full forward on the same rows and widths,
bit for bit: the blocks above K run on the tensor blocks 0..K-1 gave (`tests/models/test_trunk.py`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from llm_rlhf.models.lora import block_count


def blocks(lm: nn.Module) -> nn.ModuleList:
    """The transformer blocks of `lm` (a causal LM, possibly a peft model): the outermost `nn.ModuleList` with
    one entry per block (Llama's `model.layers`, GPT-2's `transformer.h`)."""
    n = block_count(lm)
    for module in lm.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"{type(lm).__name__} has no list of its {n} blocks")


def frozen_block_count(lm: nn.Module) -> int:
    """K: how many blocks, from the first, hold no trainable parameter and no peft adapter (0 when block 0
    trains). Their output is the same with the adapters on or off, before and after any update."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    k = 0
    for block in blocks(lm):
        trains = any(p.requires_grad for p in block.parameters())
        if trains or any(isinstance(m, BaseTunerLayer) for m in block.modules()):
            break
        k += 1
    return k


def _block_list_name(lm: nn.Module) -> str:
    target = blocks(lm)
    return next(name for name, module in lm.named_modules() if module is target)


def shared_block_count(a: nn.Module, b: nn.Module) -> int:
    """K for two causal LMs of one architecture (a policy and its reference loaded from their folders): how
    many blocks, from the first, hold equal weights in both, when every weight outside the blocks (the
    embeddings, the final norm, the LM head) is equal too; 0 otherwise. Then h_K is one tensor for both: a
    PPO policy merged from adapters in its last N blocks shares K = L - N with the model it started from."""
    state_a, state_b = a.state_dict(), b.state_dict()
    if state_a.keys() != state_b.keys():
        return 0
    prefix = _block_list_name(a) + "."
    differs = set()  # the blocks holding a weight that differs; -1 for a weight outside them
    for name, x in state_a.items():
        y = state_b[name]
        if x.shape != y.shape or not torch.equal(x, y):
            differs.add(int(name[len(prefix) :].split(".")[0]) if name.startswith(prefix) else -1)
    if -1 in differs:
        return 0
    return min(differs, default=len(blocks(a)))


class _TrunkDone(Exception):
    """Raised by the hook on block K-1 to stop the forward there, carrying the block's output."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


@torch.no_grad()
def trunk_states(lm: nn.Module, k: int, model: nn.Module, *inputs, **kwargs) -> torch.Tensor:
    """h_K: the output of block K-1 of `lm` (B, T, H) in the forward `model(*inputs, **kwargs)` (`lm` or a
    module that runs it); the forward stops after block K-1, so nothing above it is computed."""

    def stop(module, args, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returns {type(output).__name__}, not its hidden states")
        raise _TrunkDone(output)

    handle = blocks(lm)[k - 1].register_forward_hook(stop)
    try:
        model(*inputs, **kwargs)
    except _TrunkDone as done:
        return done.hidden
    finally:
        handle.remove()
    raise RuntimeError(f"the forward did not run block {k - 1}")


def _pass_through(hidden_states, *args, **kwargs):
    return hidden_states


@contextmanager
def from_trunk(lm: nn.Module, hidden: torch.Tensor, k: int):
    """Inside: a forward of `lm` on the rows and columns `hidden` (B, T, H) was computed for runs blocks K..L-1
    on it, blocks 0..K-1 skipped (their instances' `forward` replaced, the parameters untouched)."""
    skipped = list(blocks(lm)[:k])
    for block in skipped[:-1]:
        block.forward = _pass_through
    skipped[-1].forward = lambda *args, **kwargs: hidden
    try:
        yield
    finally:
        for block in skipped:
            del block.forward
