"""`rl.cast_once`: under autocast the layers that do not train run from copies of their weights cast once, and
compute exactly what autocast computes; the layers that train, and everything outside autocast, are untouched."""

from __future__ import annotations

import pytest
import torch
from helpers import with_lora
from transformers import AutoModelForCausalLM

from llm_rlhf.rl import fast_sampling
from llm_rlhf.rl.cast_once import frozen_weights_cast_once


def lora_lm(folder):
    """The tiny model with a LoRA adapter on its attention projections (`helpers.with_lora`), base frozen."""
    return with_lora(AutoModelForCausalLM.from_pretrained(folder).eval())


def forward_backward(lm, x):
    """Logits under bf16 autocast and the adapters' gradients of a loss on them."""
    lm.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = lm(x).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_frozen_layers_cast_once_compute_what_autocast_computes_bit_for_bit(
    kind, tiny_model_dir, tiny_llama_dir
):
    """Two forwards and backwards inside the context (the second from the copies made by the first) give the
    logits and the adapter gradients of plain autocast bit for bit; only the frozen linear layers (the base
    layers under LoRA, GPT-2's Conv1D, the LM head) are replaced, the adapters keep their forward, nothing is
    left behind on exit and no parameter is written."""
    lm = lora_lm(tiny_model_dir if kind == "gpt2" else tiny_llama_dir)
    x = torch.randint(0, 300, (4, 9))
    before = {n: p.clone() for n, p in lm.state_dict().items()}
    logits, grads = forward_backward(lm, x)
    with frozen_weights_cast_once(lm, None, lm):  # None skipped, a model given twice replaced once
        replaced = [m for m in lm.modules() if "forward" in vars(m)]
        first = forward_backward(lm, x)
        second = forward_backward(lm, x)
    for got_logits, got_grads in (first, second):
        assert torch.equal(got_logits, logits)
        assert got_grads.keys() == grads.keys() and all(torch.equal(got_grads[n], grads[n]) for n in grads)
    frozen_linears = 2 * 4 + 1 if kind == "gpt2" else 2 * 7 + 1  # every block's layers and the LM head
    assert len(replaced) == frozen_linears
    assert all(not p.requires_grad for m in replaced for p in m.parameters(recurse=False))
    assert not any("forward" in vars(m) for m in lm.modules())
    assert all(torch.equal(p, before[n]) for n, p in lm.state_dict().items())


def test_outside_autocast_a_trained_layer_and_a_changed_weight_take_the_layer_as_it_is(tiny_llama_dir):
    """Without autocast a replaced layer is the float32 layer; a weight that requires a gradient is never cast
    once (autocast's own cache handles it); a weight written in place after its first call is cast again."""
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval().requires_grad_(False)
    x = torch.randint(0, 300, (2, 7))
    with torch.no_grad():
        plain = lm(x).logits
        with frozen_weights_cast_once(lm):
            assert torch.equal(lm(x).logits, plain)  # float32: the layers' own forwards
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lm(x)  # the copies made
            lm.lm_head.weight.mul_(2.0)  # in place: the version counter moves
            with torch.autocast("cpu", dtype=torch.bfloat16):
                changed = lm(x).logits
            lm.lm_head.weight.requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                trained = lm(x).logits
        lm.lm_head.weight.requires_grad_(False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = lm(x).logits
    assert torch.equal(changed, expected) and torch.equal(trained, expected)


def test_decoding_inside_the_context_uses_its_own_copies_and_gives_the_cast_once_forwards_back(
    tiny_llama_dir,
):
    """`fast_sampling.decoding_weights` replaces the cast-once forwards of the layers it decodes with (LoRA merged,
    bf16 copies) and restores them on exit: the same logits as decoding outside the context."""
    lm = lora_lm(tiny_llama_dir)
    x = torch.randint(0, 300, (3, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with fast_sampling.decoding_weights(lm):
            outside = lm(x).logits
        with frozen_weights_cast_once(lm):
            cast_once = {id(m): vars(m)["forward"] for m in lm.modules() if "forward" in vars(m)}
            with fast_sampling.decoding_weights(lm):
                inside = lm(x).logits
            after = {id(m): vars(m)["forward"] for m in lm.modules() if "forward" in vars(m)}
    assert torch.equal(inside, outside)
    assert after == cast_once
