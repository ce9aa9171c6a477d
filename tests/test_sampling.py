"""The sampled tokens come from exactly softmax(logits / temperature), the distribution whose log-probs
PPO uses: a checkpoint's generation_config.json (repetition_penalty, top_k, min_new_tokens, ...) and
transformers' own defaults (top_k=50) must not reshape it. Checked draw for draw against a naive loop
that samples from the plain softmax with the same random numbers."""

from __future__ import annotations

import pytest
import torch
from helpers import naive_sample
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from llm_rlhf.rollout import Sampling, left_pad, sample
from llm_rlhf.sft import sample_responses

HOSTILE = dict(
    repetition_penalty=3.0, no_repeat_ngram_size=1, top_k=3, top_p=0.3, min_p=0.2, typical_p=0.5,
    min_new_tokens=4, temperature=0.05, do_sample=False,
)  # fmt: skip


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sample_draws_from_the_plain_softmax(kind, tiny_model_dir, tiny_llama_dir):
    folder = tiny_model_dir if kind == "gpt2" else tiny_llama_dir
    lm = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    lm.generation_config = GenerationConfig(**HOSTILE, eos_token_id=tokenizer.eos_token_id)
    saved = lm.generation_config.to_dict()
    ids = tokenizer("The film is").input_ids
    query, query_mask = left_pad([ids] * 64, tokenizer.pad_token_id)  # (64, P): no padding, same prompt

    torch.manual_seed(123)
    sampling = Sampling(max_new_tokens=8, temperature=0.9, top_k=0, top_p=1.0)
    got = sample(lm, tokenizer, query, query_mask, sampling)
    torch.manual_seed(123)
    with torch.no_grad():
        expected = naive_sample(
            lm, query, steps=8, temperature=0.9, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id
        )
    assert torch.equal(got.response[:, : expected.shape[1]], expected)
    # the test has teeth: the hostile settings would have given other tokens, and top_k=50 too
    assert len(set(got.response[:, 0].tolist())) > 3  # top_k=3 / greedy would allow at most 3
    assert lm.generation_config.to_dict() == saved  # put back after sampling

    # the SFT stage's end-of-training samples use the same settings
    torch.manual_seed(123)
    rows = sample_responses(lm, tokenizer, ["The film is"] * 64, sampling, batch_size=64)
    eos = tokenizer.eos_token_id
    for row, tokens in zip(rows, expected.tolist()):
        n = tokens.index(eos) if eos in tokens else len(tokens)
        assert row["num_tokens"] == n and row["response"] == tokenizer.decode(
            tokens[:n], skip_special_tokens=True
        )
