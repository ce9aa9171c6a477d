"""benchmarks/ppo_step.py runs: a Llama folder with LoRA and the separate critic, a GPT-2 folder with the
value head, a GPT-2 folder with ReMax and 2 samples per prompt (one short step each on the tiny models),
and its FLOP count follows the shapes that ran.
benchmarks/rollout.py runs every sampling path on the tiny models and counts the roofline's weights;
benchmarks/static_cache.py draws the same tokens with a static cache and a compiled step.
benchmarks/grpo_vs_trl.py alternates our GRPO step with TRL's GRPOTrainer and prints both medians and the ratio."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def load_benchmark():
    spec = importlib.util.spec_from_file_location("ppo_step_benchmark", ROOT / "benchmarks" / "ppo_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "policy, extra",
    [
        ("llama", ["--lora", "--value_model", "reward", "--sampling-dtype", "bfloat16"]),
        ("gpt2", ["--prompt-file", "PROMPTS", "--sampling-compile"]),
        ("gpt2", ["--advantage-estimator", "remax", "--samples-per-prompt", "2"]),
    ],
)
def test_benchmark_runs_on_any_causal_lm_folder(
    policy, extra, tiny_model_dir, tiny_llama_dir, prompt_file, tmp_path, capsys
):
    bench = load_benchmark()
    model_dir = tiny_llama_dir if policy == "llama" else tiny_model_dir
    extra = [str(prompt_file) if a == "PROMPTS" else a for a in extra]
    out = tmp_path / "result.json"
    args = ["--model-dir", str(model_dir), "--rollout", "4", "--mini-batch", "2", "--new-tokens", "4"]
    args += ["--steps", "1", "--warmup", "0", "--gen-reps", "1", "--peak-size", "64", "--threads", "2"]
    bench.main(args + extra + ["--workdir", str(tmp_path / "work"), "--json", str(out)])
    result = json.loads(out.read_text())
    assert "| **step** |" in capsys.readouterr().out
    c = result["config"]
    assert c["architecture"] == ("Llama" if policy == "llama" else "GPT2")
    assert c["value_model"] == ("reward" if "--value_model" in extra else "policy")
    assert set(result["matmul_peak_gflops"]) == {"fp32"}  # no bf16 peak unless --bf16
    assert ("critic" in c["params"]) == (c["value_model"] == "reward")
    assert c["sampling_dtype"] == ("bfloat16" if "--sampling-dtype" in extra else "float32")
    assert c["sampling_compile"] == ("--sampling-compile" in extra)
    k = 2 if "--samples-per-prompt" in extra else 1
    assert (c["advantage_estimator"], c["samples_per_prompt"]) == (("remax", 2) if k == 2 else ("gae", 1))
    for phase in ("generate", "old_logprobs_values", "reference", "reward_model", "update"):
        assert result["phases"][phase]["seconds"] > 0, phase
    assert result["train_flops_per_step"] > 0 and 0 < result["mfu"]
    assert (
        0 < result["tokens_per_step"]["update"] <= 4 * k * (16 + 4)
    )  # 4 * k rows of at most prompt + response


def test_flops_count_the_shapes_that_ran():
    bench = load_benchmark()
    net = dict(trunk=100, trunk_frozen=0, lora=0, head=10, head_frozen=False, n_layer=2, d=4)
    timer = bench.PhaseTimer(device=None)
    log = bench.ShapeLog(timer)
    log.calls = {"update": [("lm", 2, 5, 3), ("lm", 2, 3, 1)], "reference": [("lm", 4, 5, 3)]}
    train = 6 * 100 * (2 * 5 + 2 * 3) + 6 * 10 * (2 * 3 + 2 * 1) + 12 * 2 * 4 * (2 * 25 + 2 * 9)
    assert log.flops("update", {"lm": net}) == train
    assert log.flops("reference", {"lm": net}) == 2 * 100 * 20 + 2 * 10 * 12 + 4 * 2 * 4 * 4 * 25
    assert log.tokens("update") == 16
    lora = dict(net, trunk_frozen=100, lora=7, head_frozen=True)
    assert log.flops("update", {"lm": lora}) == (
        4 * 100 * 16 + 4 * 10 * 8 + 6 * 7 * 16 + 12 * 2 * 4 * (2 * 25 + 2 * 9)
    )


def test_rollout_benchmark_prints_the_ratio_to_the_roofline(tiny_model_dir, tiny_llama_dir, tmp_path, capsys):
    """benchmarks/rollout.py on the tiny models (the tiny Llama standing in for SmolLM2, with its LoRA): every
    path of the ablation samples, and each row has a positive step time, tokens/s and roofline ratio."""
    spec = importlib.util.spec_from_file_location("rollout_benchmark", ROOT / "benchmarks" / "rollout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rollout.json"
    args = ["--reviews-dir", str(tiny_model_dir), "--smollm2-dir", str(tiny_llama_dir), "--batches", "2,3"]
    args += [
        "--new-tokens",
        "4",
        "--reps",
        "1",
        "--peak-size",
        "64",
        "--bandwidth-mib",
        "4",
        "--paths",
        "all",
    ]
    result = bench.main(args + ["--lora-r", "2", "--json", str(out)])
    assert json.loads(out.read_text())["models"] == json.loads(json.dumps(result["models"]))
    printed = capsys.readouterr().out
    assert "| measured / roofline |" in printed
    assert [m["model"] for m in result["models"]] == ["reviews", "smollm2", "smollm2-lora"]
    assert "LoRA r=2" in result["models"][2]["source"] and "random" not in result["models"][1]["source"]
    assert result["models"][2]["matmul_weights"] > result["models"][1]["matmul_weights"]  # the adapters count
    for m in result["models"]:
        for batch, entry in m["batches"].items():
            assert entry["roofline_ms"] > 0 and entry["flops_per_step"] > 0 and entry["bytes_per_step"] > 0
            assert list(entry["paths"]) == list(bench.ABLATION)
            for path, p in entry["paths"].items():
                assert p["ms_per_step"] > 0 and p["tokens_per_s"] > 0 and p["ratio_to_roofline"] > 0, (
                    batch,
                    path,
                )
                assert f"| {m['model']} | {batch} | {path} |" in printed
            kl = {path: p["kl_sampler_per_token"] for path, p in entry["paths"].items()}
            assert kl["generate"] is None and abs(kl["fast"]) < 1e-4  # float32: the policy's distribution
            assert abs(kl["fast-compiled"]) < 1e-4  # compiled steps: the same distribution
            assert isinstance(kl["fast-bf16"], float) and kl["fast-bf16"] != kl["fast"]


def test_rollout_roofline_counts_the_matmul_weights(tiny_llama_dir):
    """N counts every linear weight once (the tied LM head too); the roofline is the larger of the two bounds."""
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("rollout_benchmark", ROOT / "benchmarks" / "rollout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    c = lm.config
    d, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    per_layer = d * d * 2 + 2 * d * kv + 3 * d * c.intermediate_size  # q, o; k, v; gate, up, down
    N = c.num_hidden_layers * per_layer + c.vocab_size * d
    assert bench.matmul_weights(lm) == N
    roof = bench.roofline_seconds(lm, batch=4, length=10, peak=1e9, bandwidth=1e9)
    flops = 2 * N * 4 + 4 * c.num_hidden_layers * d * 10 * 4
    nbytes = 4 * N + 8 * c.num_hidden_layers * kv * 10 * 4
    assert (roof["flops"], roof["bytes"]) == (flops, nbytes)
    assert roof["seconds"] == max(flops, nbytes) / 1e9


def test_prompt_grouping_benchmark_times_each_way(tiny_llama_dir, prompt_file, capsys):
    """benchmarks/prompt_grouping.py on the tiny Llama: every way of batching is timed on every repetition."""
    spec = importlib.util.spec_from_file_location(
        "prompt_grouping", ROOT / "benchmarks" / "prompt_grouping.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--model-dir", str(tiny_llama_dir), "--prompt-file", str(prompt_file), "--prompts", "6"]
    seconds = bench.main(
        args + ["--groups", "3", "--new-tokens", "3", "--reps", "2"]
    )  # torch's threads: left as they are
    assert list(seconds) == ["one batch", "sorted, one batch", "sorted, 3 batches"]
    assert all(len(s) == 2 and min(s) > 0 for s in seconds.values())
    assert "6 prompts of" in capsys.readouterr().out


def test_static_cache_benchmark_draws_the_same_tokens_in_every_mode(tiny_llama_dir, capsys):
    """benchmarks/static_cache.py on the tiny Llama with its LoRA: the static cache and the compiled static-cache
    step give the dynamic cache's logits up to float rounding when fed the same tokens, and each mode is timed."""
    spec = importlib.util.spec_from_file_location("static_cache", ROOT / "benchmarks" / "static_cache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--model", "smollm2-lora", "--smollm2-dir", str(tiny_llama_dir), "--lora-r", "2"]
    results = bench.main(args + ["--batches", "2,3", "--new-tokens", "5", "--calls", "2"])
    assert [(r["batch"], r["mode"]) for r in results] == [(b, m) for b in (2, 3) for m in bench.MODES]
    assert all(r["ms_per_forward"] > 0 and r["first_call_s"] > 0 for r in results)
    for r in results:
        assert r["draws"] == r["batch"] * 5 and 0 <= r["draws_differing"] <= r["draws"]
        if r["mode"] == "eager-dynamic":  # the reference itself
            assert r["draws_differing"] == 0 and r["max_logit_difference"] == 0.0
        else:  # the same distribution: rounding, not a wrong position, mask or cache slot (those differ by O(1))
            assert r["max_logit_difference"] < 1e-5, r  # rounding: ~5e-8 here; a position off by one: ~5e-4
    assert "| 3 | compiled-static |" in capsys.readouterr().out


@pytest.mark.parametrize("shape", ["tiny", "smollm2"])
def test_grpo_vs_trl_prints_both_medians_and_the_ratio(shape, tiny_llama_dir, tmp_path, capsys):
    """benchmarks/grpo_vs_trl.py, one step of each trainer at a reduced shape: the tiny GPT-2, and the smollm2
    path (LoRA on both sides) with the tiny Llama standing in for the SmolLM2 folder."""
    spec = importlib.util.spec_from_file_location("grpo_vs_trl", ROOT / "benchmarks" / "grpo_vs_trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--shape", shape, "--prompts", "2", "--samples", "2", "--new-tokens", "3", "--prompt-len", "4"]
    args += ["--steps", "1", "--warmup", "0", "--vocab-size", "512", "--smollm2-dir", str(tiny_llama_dir)]
    out = tmp_path / "result.json"
    result = bench.main(args + ["--workdir", str(tmp_path / "work"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert "ours (llm_rlhf ppo_step): median" in printed and "TRL GRPOTrainer:          median" in printed
    assert f"ratio ours / TRL: {result['ratio']:.3f}" in printed
    assert json.loads(out.read_text())["ratio"] == result["ratio"]
    assert len(result["seconds"]["ours"]) == len(result["seconds"]["trl"]) == 1
    assert result["median_ours"] > 0 and result["median_trl"] > 0
    assert result["config"]["lora"] == (shape == "smollm2")
    assert result["model"] == (str(tiny_llama_dir) if shape == "smollm2" else "random weights")
    assert "old_logprobs_values" not in result["our_phases_median"]  # one update: the old forward is skipped
    assert result["our_phases_median"]["update"] > 0 and result["our_phases_median"]["reference"] > 0
