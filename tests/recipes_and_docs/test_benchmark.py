"""benchmarks/ppo_step.py runs: a Llama folder with LoRA and the separate critic, a GPT-2 folder with the
value head, a GPT-2 folder with ReMax and 2 samples per prompt (one short step each on the tiny models),
the smollm2 shape (SmolLM2-135M's config, random weights) scaled down, and its FLOP count follows the shapes
that ran.
benchmarks/rollout.py runs every sampling path on the tiny models and counts the roofline's weights;
benchmarks/static_cache.py draws the same tokens with a static cache and a compiled step.
benchmarks/grpo_vs_trl.py alternates our GRPO step with TRL's GRPOTrainer and prints both medians and the ratio,
in float32 and in bf16 mixed precision, and sets TRL's precision, device and generation from its flags.
The runs pass `--device cpu` (the default is the GPU where there is one): the code path a GPU takes, on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, load_script

pytestmark = pytest.mark.slow


def load_benchmark(name: str = "ppo_step"):
    return load_script(ROOT / "benchmarks" / f"{name}.py", f"{name}_benchmark")


@pytest.fixture()
def fresh_accelerate_state():
    """accelerate's state is one per process and keeps the first mixed_precision it was given: grpo_vs_trl.py's
    two Accelerators (ours, TRL's Trainer's) must agree with each other, not with an earlier test's."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


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
    bench.main(args + extra + ["--device", "cpu", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    result = json.loads(out.read_text())
    assert "| **step** |" in capsys.readouterr().out
    c = result["config"]
    assert c["device"] == "cpu" and c["device_name"] and c["threads"] == 2
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


def test_smollm2_shape_is_smollm2_135ms_config():
    """`--model smollm2` is SmolLM2-135M's architecture (rollout.py's SMOLLM2_CONFIG) with the benchmark
    tokenizer's ids; the overrides scale it down with its proportions (heads of d / heads, KV heads dividing
    the heads, the MLP 1536/576 of d). --compile-sampler is sampling_compile."""
    bench = load_benchmark()
    c = bench.model_config(bench.parse_args(["--model", "smollm2"]))
    assert type(c).__name__ == "LlamaConfig"
    shape = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert shape == (576, 30, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (1536, 49152, True)
    assert c.bos_token_id == c.eos_token_id == c.pad_token_id == 0
    tiny = bench.smollm2_config(n_layer=2, n_head=3, n_embd=48, vocab_size=512)
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.head_dim, tiny.num_key_value_heads) == (
        2,
        48,
        16,
        3,
    )
    assert (tiny.intermediate_size, tiny.vocab_size) == (128, 512)
    assert bench.smollm2_config(n_head=4).num_key_value_heads == 1  # gcd(3, 4): KV heads divide the heads
    assert bench.parse_args(["--compile-sampler"]).sampling_compile
    assert bench.parse_args([]).device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_ppo_step_benchmark_runs_the_smollm2_shape_with_random_weights(tmp_path, capsys):
    """`--model smollm2` builds the policy and the reward model from the config with random weights (no folder),
    scaled down here, and runs a GRPO step with bf16 autocast on --device cpu."""
    bench = load_benchmark()
    out = tmp_path / "result.json"
    args = ["--model", "smollm2", "--n-layer", "2", "--n-head", "3", "--n-embd", "48", "--vocab-size", "512"]
    args += [
        "--lora",
        "--bf16",
        "--advantage-estimator",
        "grpo",
        "--samples-per-prompt",
        "2",
        "--rollout",
        "2",
    ]
    args += ["--mini-batch", "4", "--new-tokens", "4", "--steps", "1", "--warmup", "0", "--gen-reps", "1"]
    bench.main(
        args + ["--peak-size", "64", "--device", "cpu", "--workdir", str(tmp_path), "--json", str(out)]
    )
    result = json.loads(out.read_text())
    c = result["config"]
    assert (c["model"], c["architecture"], c["n_layer"], c["n_embd"], c["vocab_size"]) == (
        "smollm2",
        "Llama",
        2,
        48,
        512,
    )
    assert c["device"] == "cpu" and c["bf16"] and set(result["matmul_peak_gflops"]) == {"bf16"}
    assert f"{c['device_name']}, 2 threads" in capsys.readouterr().out
    assert result["phases"]["update"]["seconds"] > 0 and result["mfu"] > 0


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
    bench = load_benchmark("rollout")
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

    bench = load_benchmark("rollout")
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
    bench = load_script(ROOT / "benchmarks" / "prompt_grouping.py")
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
    bench = load_script(ROOT / "benchmarks" / "static_cache.py")
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


@pytest.mark.parametrize(
    "shape, extra", [("tiny", []), ("smollm2", []), ("tiny", ["--bf16"]), ("tiny", ["--sampling-compile"])]
)
def test_grpo_vs_trl_prints_both_medians_and_the_ratio(
    shape, extra, tiny_llama_dir, tmp_path, capsys, fresh_accelerate_state
):
    """benchmarks/grpo_vs_trl.py, one step of each trainer at a reduced shape: the tiny GPT-2, the smollm2
    path (LoRA on both sides) with the tiny Llama standing in for the SmolLM2 folder, and both trainers in
    bf16 mixed precision (one accelerate state: ours and TRL's Accelerator must ask for the same), and ours
    sampling with its compiled decode steps."""
    bench = load_benchmark("grpo_vs_trl")
    args = ["--shape", shape, "--prompts", "2", "--samples", "2", "--new-tokens", "3", "--prompt-len", "4"]
    args += ["--steps", "1", "--warmup", "0", "--vocab-size", "512", "--smollm2-dir", str(tiny_llama_dir)]
    out = tmp_path / "result.json"
    result = bench.main(
        args + extra + ["--device", "cpu", "--workdir", str(tmp_path / "work"), "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert (result["device"], result["threads"], result["trl_generation"]) == ("cpu", 2, "generate")
    assert result["dtype"] == ("bfloat16 autocast, float32 weights" if "--bf16" in extra else "float32")
    compiled = "--sampling-compile" in extra
    assert result["our_sampling"] == ("compiled decode steps" if compiled else "eager")
    assert f"on {result['device_name']} (cpu, 2 threads), {result['dtype']}" in printed
    assert "ours (llm_rlhf ppo_step): median" in printed and "TRL GRPOTrainer:          median" in printed
    assert f"ratio ours / TRL: {result['ratio']:.3f}" in printed
    assert json.loads(out.read_text())["ratio"] == result["ratio"]
    assert len(result["seconds"]["ours"]) == len(result["seconds"]["trl"]) == 1
    assert result["median_ours"] > 0 and result["median_trl"] > 0
    assert result["config"]["lora"] == (shape == "smollm2")
    assert result["model"] == (str(tiny_llama_dir) if shape == "smollm2" else "random weights")
    assert "old_logprobs_values" not in result["our_phases_median"]  # one update: the old forward is skipped
    assert result["our_phases_median"]["update"] > 0 and result["our_phases_median"]["reference"] > 0


def test_grpo_vs_trl_puts_trl_on_the_device_and_precision_it_is_given(tmp_path, fresh_accelerate_state):
    """TRL's GRPOConfig from the flags: its CPU switch from --device, bf16 off unless --bf16 (GRPOConfig's
    own default is on), the model loaded in float32 either way, continuous batching only when asked."""
    bench = load_benchmark("grpo_vs_trl")
    for flags in ([], ["--bf16", "--trl-continuous-batching"]):
        c = bench.trl_config(bench.parse_args(["--device", "cpu", *flags]), tmp_path, 1)
        assert c.use_cpu and not c.fp16 and c.model_init_kwargs == {"dtype": "float32"}
        assert c.bf16 == c.use_transformers_continuous_batching == bool(flags)
        assert not c.gradient_checkpointing and c.mixed_precision == ("bf16" if flags else "no")


def test_distill_vs_trl_runs_each_trainer_in_its_process_and_prints_the_ratio(tmp_path, capsys):
    """benchmarks/distill_vs_trl.py at the tiny shape, one timed step of each trainer, each in its own process:
    both saw the same prompt tokens, both medians and the ratio printed and written, our step's teacher seconds
    and share among its phases, and a teacher that differs from the student (a non-zero reverse KL)."""
    bench = load_benchmark("distill_vs_trl")
    out = tmp_path / "result.json"
    args = ["--shape", "tiny", "--steps", "1", "--warmup", "0", "--threads", "1", "--device", "cpu"]
    result = bench.main(args + ["--workdir", str(tmp_path / "work"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert "ours (llm_rlhf ppo_step):  median" in printed and "TRL DistillationTrainer:   median" in printed
    assert f"ratio ours / TRL: {result['ratio']:.3f}" in printed
    assert json.loads(out.read_text())["ratio"] == result["ratio"]
    assert len(result["seconds"]["ours"]) == len(result["seconds"]["trl"]) == 1
    assert result["median_ours"] > 0 and result["median_trl"] > 0
    metrics = result["our_metrics_median"]
    assert metrics["time/teacher"] > 0 and 0 < metrics["time/teacher_share"] < 1
    assert len(result["our_distill_kl"]) == 1 and result["our_distill_kl"][0] != 0


def test_cpu_kernels_benchmark_times_each_kernel_against_what_it_replaces(capsys):
    """benchmarks/cpu_kernels.py at a small shape: the LM head and the two attention shapes, each a pair of
    positive medians, printed with the CPU's name."""
    bench = load_benchmark("cpu_kernels")
    small = ["--vocab", "512", "--hidden", "32", "--positions", "64", "--labelled", "40", "--batch", "4"]
    medians = bench.main(small + ["--heads", "2", "--length", "7", "--head-dim", "8", "--reps", "2"])
    assert len(medians) == 3 and all(min(pair) > 0 for pair in medians.values())
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "at 64 positions vs the head at 40 labelled" in out
    assert out.count(" ms -> ") == 3
