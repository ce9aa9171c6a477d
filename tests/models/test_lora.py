"""Where LoRA adapters go (`llm_rlhf.models.lora`): all-linear spelled out, adapters in the last blocks only,
and the backward pass that stops below them."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from llm_rlhf.core.errors import ConfigError
from llm_rlhf.models.loading import load_causal_lm
from llm_rlhf.models.lora import block_count, linear_names, lora_placement


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_last_blocks_only_get_adapters_and_gradients(kind, tiny_model_dir, tiny_llama_dir):
    folder = tiny_model_dir if kind == "gpt2" else tiny_llama_dir
    lm = load_causal_lm(str(folder))
    assert block_count(lm) == 2
    expected = (
        ["c_attn", "c_fc", "c_proj"]
        if kind == "gpt2"
        else [
            "down_proj",
            "gate_proj",
            "k_proj",
            "o_proj",
            "q_proj",
            "up_proj",
            "v_proj",
        ]
    )
    assert linear_names(lm) == expected  # lm_head is outside the blocks
    placement = lora_placement(lm, ["all-linear"], 1)
    assert placement == {"target_modules": expected, "layers_to_transform": [1]}
    model = get_peft_model(
        lm, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, fan_in_fan_out=kind == "gpt2", **placement)
    )
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapted and all(".1." in n for n in adapted), adapted  # block 1 only
    block = ".h." if kind == "gpt2" else ".layers."
    in_block_1 = {n.split(block)[1].split(".lora_")[0] for n in adapted}
    assert len(in_block_1) == (
        4 if kind == "gpt2" else 7
    )  # every linear layer of the last block (GPT-2: two c_proj)

    # The gradient reaches the last block's adapters and not the embeddings' output: autograd stops below.
    ids = torch.tensor([[1, 2, 3, 4]])
    reached = []
    embeddings = model.get_input_embeddings()
    embeddings.register_forward_hook(lambda m, i, out: reached.append(out.requires_grad))
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    assert reached == [False]
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_every_block_and_peft_defaults(tiny_llama_dir):
    lm = load_causal_lm(str(tiny_llama_dir))
    assert lora_placement(lm, ["all-linear"], None) == {"target_modules": "all-linear"}
    assert lora_placement(lm, None, None) == {"target_modules": None}
    assert lora_placement(lm, None, 2) == {
        "target_modules": ["q_proj", "v_proj"],
        "layers_to_transform": [0, 1],
    }
    assert lora_placement(lm, ["q_proj"], 1) == {"target_modules": ["q_proj"], "layers_to_transform": [1]}
    with pytest.raises(ConfigError, match="'lora_layers': 3 must be between 1 and the model's 2 blocks"):
        lora_placement(lm, ["all-linear"], 3)


def test_adapters_in_the_last_block_compute_what_the_same_adapters_compute_among_all(tiny_llama_dir):
    """lora_layers 1 is the all-blocks model with block 0's adapters at zero, and nothing more: the same logits
    and the same gradients for block 1's adapters (given the same adapter weights), computed without any
    backward pass through block 0."""
    models = {}
    for layers in (None, 1):
        lm = load_causal_lm(str(tiny_llama_dir))
        config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, **lora_placement(lm, ["all-linear"], layers))
        models[layers] = get_peft_model(lm, config)
    every, last = models[None], models[1]
    torch.manual_seed(0)
    with torch.no_grad():
        params = dict(every.named_parameters())
        for name, p in params.items():
            if "lora_B" in name:  # non-zero adapters: block 1 random, block 0 zero
                p.copy_(torch.randn_like(p) * 0.1 if ".layers.1." in name else torch.zeros_like(p))
        for name, p in last.named_parameters():
            if "lora_" in name:
                p.copy_(params[name])
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    out = {}
    for key, model in (("every", every), ("last", last)):
        logits = model(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if ".layers.1." in n and "lora_" in n}
        out[key] = (logits.detach(), grads)
    torch.testing.assert_close(out["every"][0], out["last"][0], rtol=0, atol=0)
    assert out["every"][1].keys() == out["last"][1].keys() and len(out["last"][1]) == 14
    for name, grad in out["last"][1].items():
        torch.testing.assert_close(grad, out["every"][1][name], rtol=1e-6, atol=1e-7)
