"""benchmarks/ppo_step.py runs: a Llama folder with LoRA and the separate critic, a GPT-2 folder with the
value head, a GPT-2 folder with ReMax and 2 samples per prompt (one short step each on the tiny models),
and its FLOP count follows the shapes that ran."""

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
        ("llama", ["--lora", "--value_model", "reward"]),
        ("gpt2", ["--prompt-file", "PROMPTS"]),
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
