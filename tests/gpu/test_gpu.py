"""The GPU tier: what only means something on a CUDA device, skipped without one (CI has none;
`benchmarks/gpu_check.sh` runs them on a GPU machine). bf16 autocast in a PPO step, the compiled sampler's
CUDA graphs, and peak memory (LoRA against full fine-tuning). The rest of the suite runs on a GPU machine too,
its models wherever the code under test puts them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, ppo_config, record_raw_grads, tiny_ppo_trainer, use_fixed_responses
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_rlhf.rl import fast_sampling, token_math
from llm_rlhf.rl.rollout import Sampling, generation_config_hidden, left_pad, sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


def cuda_lm(folder):
    lm = AutoModelForCausalLM.from_pretrained(folder).eval().to(CUDA)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    return lm, tokenizer


def test_compiled_sampling_on_cuda_draws_from_the_model(tiny_llama_dir):
    """sampling_compile on CUDA (torch.compile "reduce-overhead": each decode step replayed as a CUDA graph,
    a static KV cache, prompts left-padded to the bucket): the log-prob it records for each drawn token is the
    model's own, teacher-forced over the whole sequence (the distribution PPO's log-probs describe), and at
    temperature 0 it returns `generate`'s greedy tokens."""
    lm, tokenizer = cuda_lm(tiny_llama_dir)
    ids = [tokenizer(p).input_ids for p in ["The film is", "A", "It was a great and", "Bad"] * 8]
    query, query_mask = left_pad(ids, tokenizer.pad_token_id, CUDA)  # (32, P)
    torch.manual_seed(0)
    got = sample(lm, tokenizer, query, query_mask, Sampling(12, temperature=1.0, sampling_compile=True))
    assert got.response.device.type == "cuda" and got.sampler_logprobs is not None
    with torch.no_grad():
        sequences = torch.cat([got.query, got.response], dim=1)  # (B, P + R)
        mask = torch.cat([got.query_mask, got.response_mask.long()], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = lm(input_ids=sequences, attention_mask=mask, position_ids=positions).logits.float()
        logits = logits[
            :, got.query.shape[1] - 1 : -1
        ]  # (B, R): the logits each response token was drawn from
        forced = token_math.logprobs_from_logits(logits=logits, labels=got.response, temperature=1.0)
    forced = torch.where(got.response_mask, forced, 0.0)
    torch.testing.assert_close(got.sampler_logprobs, forced, atol=2e-4, rtol=1e-4)

    greedy = sample(lm, tokenizer, query, query_mask, Sampling(12, temperature=0.0, sampling_compile=True))
    with generation_config_hidden(lm), torch.no_grad():
        expected = lm.generate(
            input_ids=query,
            attention_mask=query_mask,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[:, query.shape[1] :]
    expected = torch.where(
        greedy.response_mask, expected[:, : greedy.response.shape[1]], tokenizer.pad_token_id
    )
    assert torch.equal(greedy.response, expected)
    assert fast_sampling.compiled_step(lm) is fast_sampling.compiled_step(lm)  # kept with the model


def test_bf16_autocast_ppo_step_on_cuda(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """bf16=True on a GPU: the policy's forwards run under CUDA autocast in bfloat16, the step's metrics are
    finite, and its raw gradient points where the float32 step's does (cosine > 0.9 on the same rollout: bf16
    rounds, it must not change what the update does). The rollout is `use_fixed_responses`' for both."""
    grads, trainers = {}, {}
    for bf16 in (False, True):
        cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / str(bf16), bf16=bf16, steps=1)
        trainer = trainers[bf16] = tiny_ppo_trainer(cfg, cpu=False)
        assert trainer.accelerator.device.type == "cuda"
        use_fixed_responses(trainer)  # the same rollout for both
        store = []
        record_raw_grads(trainer, store)
        torch.manual_seed(0)
        metrics = trainer.ppo_step()
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        grads[bf16] = store[0].float()
    seen = []
    lm = trainers[True].unwrapped_policy.lm
    handle = lm.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with trainers[True].accelerated.autocast():
        ids = torch.tensor([[1, 2, 3]], device=CUDA)
        lm(input_ids=ids, attention_mask=torch.ones_like(ids))
    handle.remove()
    assert seen == [torch.bfloat16]
    cosine = torch.nn.functional.cosine_similarity(grads[True], grads[False], dim=0)
    assert cosine > 0.9, float(cosine)


def peak_memory(extra: list[str], tmp_path) -> float:
    out = tmp_path / f"peak{len(extra)}.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "ppo_step.py"),
            "--model",
            "gpt2",
            "--device",
            "cuda",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--json",
            str(out),
            *extra,
        ],
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.read_text())["peak_memory_mb"]


def test_lora_ppo_peak_memory_on_cuda_is_below_full_fine_tuning(tmp_path):
    """GPT-2 124M, the benchmark's PPO step, each in its own process (CUDA's max allocated): LoRA keeps no
    optimiser state or gradients for the frozen weights and shares them with the reference, so its peak is at
    most 0.6x full fine-tuning's (the benchmark's goal; 0.56 measured on a CPU's max RSS)."""
    full, lora = peak_memory([], tmp_path), peak_memory(["--lora"], tmp_path)
    assert lora <= 0.6 * full, (lora, full)
