"""The frozen trunk (`llm_rlhf.models.trunk`): the blocks below the adapters computed once, and a forward that
starts from their output giving the full forward's logits, values and adapter gradients, bit for bit."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from llm_rlhf.models.loading import PolicyWithValue, Reference, ValueHead
from llm_rlhf.models.lora import lora_placement
from llm_rlhf.models.trunk import blocks, from_trunk, frozen_block_count, shared_block_count, trunk_states


def four_block_policy(kind: str, lora_layers: int | None) -> PolicyWithValue:
    """A 4-block GPT-2 or Llama from a config, LoRA on every linear layer of the last `lora_layers` blocks
    (None: no LoRA, every weight trains), the adapters' B random so that they change the outputs."""
    torch.manual_seed(0)
    if kind == "gpt2":
        lm = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=2, n_embd=32, vocab_size=97, n_positions=64))
    else:
        lm = four_block_llama()
    if lora_layers is not None:
        placement = lora_placement(lm, ["all-linear"], lora_layers)
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, fan_in_fan_out=kind == "gpt2", **placement)
        lm = get_peft_model(lm, lora)
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)
    head = ValueHead(32)
    torch.nn.init.normal_(head.summary.weight)
    return PolicyWithValue(lm, head).eval()


def left_padded_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 9 columns, the first two with 3 and 1 padding columns on the left, the last with 2 on the
    right (a short response)."""
    torch.manual_seed(1)
    ids = torch.randint(1, 97, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, :1] = 0
    mask[2, -2:] = 0
    return ids, mask


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_frozen_block_count_is_the_blocks_below_the_first_adapter(kind):
    assert frozen_block_count(four_block_policy(kind, lora_layers=1).lm) == 3
    assert frozen_block_count(four_block_policy(kind, lora_layers=3).lm) == 1
    assert frozen_block_count(four_block_policy(kind, lora_layers=4).lm) == 0
    assert frozen_block_count(four_block_policy(kind, lora_layers=None).lm) == 0  # block 0 trains


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trunk_states_stop_after_the_last_frozen_block(kind):
    """h_K is block K-1's output in the full forward, and no block above K-1 runs to get it."""
    policy = four_block_policy(kind, lora_layers=2)
    ids, mask = left_padded_rows()
    outputs = {}
    hooks = [
        block.register_forward_hook(lambda m, a, out, i=i: outputs.setdefault(i, out))
        for i, block in enumerate(blocks(policy.lm))
    ]
    with torch.no_grad():
        policy(ids, mask)
    full = dict(outputs)
    outputs.clear()
    h = trunk_states(policy.lm, 2, policy, ids, mask)
    for hook in hooks:
        hook.remove()
    assert sorted(outputs) == [0, 1]  # blocks 2 and 3 never ran
    assert h.shape == (3, 9, 32) and torch.equal(h, full[1])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("lora_layers", [1, 2])
def test_a_forward_from_the_trunk_is_the_full_forward(kind, lora_layers):
    """The policy's logits and values, the reference's logits (the adapters off) and the adapters' and the
    value head's gradients: equal bit for bit from h_K and from the tokens; the blocks' own forwards are back
    after the context."""
    policy = four_block_policy(kind, lora_layers)
    k = frozen_block_count(policy.lm)
    ids, mask = left_padded_rows()
    keep = torch.arange(3, 8)  # the logits of five positions, as PPO keeps the response's
    h = trunk_states(policy.lm, k, policy, ids, mask)

    def run(trunk: torch.Tensor | None):
        for p in policy.parameters():
            p.grad = None
        with from_trunk(policy.lm, trunk, k) if trunk is not None else nullcontext():
            logits, values = policy(ids, mask, logits_to_keep=keep)
            (logits.square().mean() + values.square().mean()).backward()
            with torch.no_grad(), policy.lm.disable_adapter():
                ref = Reference(policy.lm)(ids, mask, logits_to_keep=keep)
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        return logits.detach(), values.detach(), ref, grads

    full, reused = run(None), run(h)
    assert not any("forward" in vars(block) for block in blocks(policy.lm))
    for a, b in zip(full[:3], reused[:3]):
        assert torch.equal(a, b)
    adapted_per_block = (
        4 if kind == "gpt2" else 7
    )  # c_attn, attn/mlp c_proj, c_fc; q, k, v, o, gate, up, down
    assert full[3].keys() == reused[3].keys()
    assert len(full[3]) == 2 + 2 * adapted_per_block * lora_layers  # the value head; each adapter's A and B
    for name, grad in full[3].items():
        assert grad.abs().sum() > 0 and torch.equal(grad, reused[3][name]), name
    assert not torch.equal(full[2], full[0])  # the adapters matter: the reference is another distribution


def four_block_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=97,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def test_shared_block_count_is_the_leading_blocks_of_equal_weights():
    """A policy merged from adapters in its last block shares the other three with its start; a weight that
    differs outside the blocks (the embeddings, the final norm) shares nothing."""
    base = four_block_llama()
    assert shared_block_count(base, copy.deepcopy(base)) == 4
    lm = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, **lora_placement(base, ["all-linear"], 1))
    )
    for name, p in lm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    merged = lm.merge_and_unload()
    assert shared_block_count(merged, base) == 3
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0
    assert shared_block_count(changed, base) == 1
    for where in ("model.embed_tokens.weight", "model.norm.weight"):
        other = copy.deepcopy(base)
        with torch.no_grad():
            other.get_parameter(where)[0] += 1.0
        assert shared_block_count(other, base) == 0, where
    assert shared_block_count(base, four_block_llama(seed=1)) == 0


def test_the_evaluation_kl_from_the_shared_blocks_is_the_kl_of_two_full_forwards():
    """`sequence_kl_to_ref` with the 3 blocks a merged policy shares with its reference: the same sequence KLs
    bit for bit as two full forwards, and those blocks run once instead of twice."""
    from llm_rlhf.evaluation.measures import KLReference, sequence_kl_to_ref
    from llm_rlhf.rl.rollout import Samples, Sampling

    reference = four_block_llama()
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.model.layers[3].parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids, mask = left_padded_rows()
    batch = Samples(
        query=ids[:, :5], query_mask=mask[:, :5], response=ids[:, 5:], response_mask=mask[:, 5:].bool()
    )
    sampling = Sampling(max_new_tokens=4, temperature=0.7)
    k = shared_block_count(policy, reference)
    runs = {}
    for shared in (0, k):
        calls = []
        hooks = [
            lm.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a, calls=calls: calls.append(1))
            for lm in (policy, reference)
        ]
        runs[shared] = sequence_kl_to_ref(
            policy, KLReference(reference, shared_blocks=shared), batch, sampling
        )
        for hook in hooks:
            hook.remove()
        runs[shared] += (len(calls),)
    assert k == 3
    (kl1, kl_tau, full_calls), (kl1_shared, kl_tau_shared, shared_calls) = runs[0], runs[k]
    assert torch.equal(kl1, kl1_shared) and torch.equal(kl_tau, kl_tau_shared)
    assert kl1.abs().min() > 0  # the policy differs from its reference
    assert (full_calls, shared_calls) == (2, 1)
