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
