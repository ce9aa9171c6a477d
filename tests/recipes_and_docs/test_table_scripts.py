"""The scripts that turn a sweep's run folders into a README's table (data/seed_table.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, load_script


def write_variant(
    folder: Path, *, loss: str, seed: int, accuracy: list[float], kl: list[float], step_s: float
):
    """A finished sweep variant as the pipeline leaves it: its config, metrics and held-out log at steps 0, 4, 8."""
    (folder / "ppo").mkdir(parents=True)
    (folder / "pipeline.json").write_text(json.dumps({"ppo": {"metrics": {"episodes": 96}}}))
    (folder / "ppo" / "config.yaml").write_text(yaml.safe_dump({"policy_loss": loss, "seed": seed}))
    (folder / "ppo" / "metrics.json").write_text(json.dumps({"episodes": 96}))
    metrics = [
        {"step": s, "episodes": 32 * s, "time/step": step_s, "objective/groups_tied": 0.5}
        for s in range(1, 9)
    ]
    (folder / "ppo" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    log = [
        {"step": s, "accuracy": a, "accuracy_greedy": a + 0.1, "pass_at_2": a + 0.2, "kl": k}
        for s, a, k in zip((0, 4, 8), accuracy, kl)
    ]
    (folder / "ppo" / "eval_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))


def test_read_at_interpolates_between_evaluations_and_says_nothing_outside():
    read_at = load_script(ROOT / "data" / "seed_table.py").read_at
    assert read_at([0.0, 1.0, 3.0], [0.1, 0.3, 0.7], 2.0) == pytest.approx(0.5)
    assert read_at([0.0, 1.0], [0.1, 0.3], 1.0) == pytest.approx(0.3)
    assert all(v != v for v in (read_at([0.0, 1.0], [0.1, 0.3], 1.5), read_at([], [], 0.0)))  # NaN


def test_the_table_averages_each_loss_over_its_seeds_and_reads_them_at_a_shared_kl(
    tmp_path, monkeypatch, capsys
):
    table = load_script(ROOT / "data" / "seed_table.py")
    write_variant(tmp_path / "a-seed0", loss="a", seed=0, accuracy=[0.1, 0.3, 0.5], kl=[0, 1, 2], step_s=10)
    write_variant(tmp_path / "a-seed1", loss="a", seed=1, accuracy=[0.1, 0.5, 0.7], kl=[0, 1, 2], step_s=12)
    write_variant(tmp_path / "b-seed0", loss="b", seed=0, accuracy=[0.1, 0.2, 0.2], kl=[0, 0.5, 1], step_s=20)
    write_variant(tmp_path / "b-seed1", loss="b", seed=1, accuracy=[0.1, 0.2, 0.4], kl=[0, 0.5, 1], step_s=20)
    monkeypatch.setattr(sys, "argv", ["seed_table.py", str(tmp_path)])
    table.main()
    out = capsys.readouterr().out
    rows = {
        line.split(" | ")[0].strip("| `"): line.split(" | ")
        for line in out.splitlines()
        if line.startswith("| `")
    }
    assert set(rows) == {"a", "b"}
    # a: step 8 sampled 0.6 ± 0.1 (0.5, 0.7); read at b's KL 1 (the lowest last-step KL): 0.3 and 0.5 -> 0.4 ± 0.1
    assert rows["a"][1:4] == ["0, 1", "0.400 ± 0.100", "**0.600 ± 0.100 (0.500, 0.700)**"]
    assert rows["a"][4:6] == ["0.700 ± 0.100", "0.800 ± 0.100"]  # greedy and pass@2 at step 8
    assert "| pass@2, step 8 |" in out
    assert rows["a"][7] == "0.400 ± 0.100" and rows["b"][7] == "0.300 ± 0.100"
    assert rows["a"][8] == "11.0 ± 1.0" and rows["b"][9] == "160 ± 0"  # s a step; PPO wall s: 8 steps of 20 s
    assert "- a - b: +0.300 ± 0.141 (resolved at 2 se)" in out


def write_main_job(folder: Path, *, test_accuracy: float, alarm_step, alarm_rules: list[str]) -> None:
    """A finished main-job run as the pipeline leaves it: the stages' metrics, pipeline.json and eval samples."""
    for stage in ("sft", "rm", "ppo", "eval"):
        (folder / stage).mkdir(parents=True)
    (folder / "rm" / "metrics.json").write_text(
        json.dumps({"test_accuracy": test_accuracy, "baseline_test_accuracy": 0.831})
    )
    (folder / "ppo" / "metrics.json").write_text(json.dumps({"alarm_step": alarm_step}))
    evaluation = {
        "gold_win_rate": 0.85,
        "gold_win_rate_stderr": 0.02,
        "alarm_rules": alarm_rules,
        "duplicate_rate": 0.01,
        "word_distinct_2": 0.9,
        "word_distinct_2_baseline": 0.95,
        "response_length_mean": 12.0,
        "response_length_mean_baseline": 15.0,
    }
    (folder / "eval" / "metrics.json").write_text(json.dumps(evaluation))
    times = {"sft": 100.0, "rm": 200.0, "ppo": 250.0, "eval": 90.0}
    (folder / "pipeline.json").write_text(json.dumps({s: {"wall_time_s": t} for s, t in times.items()}))
    rows = [
        {
            "prompt": f"Prompt {i}",
            "baseline_response": f" sft | {i}",
            "policy_response": "" if i == 1 else f" ppo\n{i}",
            "baseline_gold_score": -0.5,
            "policy_gold_score": 0.25,
        }
        for i in range(15)
    ]
    (folder / "eval" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_main_job_table_has_a_row_per_seed_and_the_first_samples_as_written(tmp_path, capsys):
    table = load_script(ROOT / "data" / "main_job_table.py")
    write_main_job(tmp_path / "seed0", test_accuracy=0.912, alarm_step=None, alarm_rules=[])
    write_main_job(tmp_path / "seed1", test_accuracy=0.905, alarm_step=10, alarm_rules=["duplicate_rate"])
    assert table.main([str(tmp_path / "seed0"), str(tmp_path / "seed1"), "--samples", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| seed")]
    assert rows[0][1:] == [
        "0.912 (0.831)",
        "0.850 ± 0.020",
        "quiet / quiet",
        "0.010",
        "0.95",
        "0.80",
        "100 / 200 / 250 / 90 = 640 |",
    ]
    assert rows[1][3] == "fired at 10 / duplicate_rate"
    samples = [line for line in lines if line.startswith("| Prompt")]
    assert samples == [
        "| Prompt 0 | sft \\| 0 (-0.50) | ppo ⏎ 0 (+0.25) |",
        "| Prompt 1 | sft \\| 1 (-0.50) | (empty) (+0.25) |",
        "| Prompt 2 | sft \\| 2 (-0.50) | ppo ⏎ 2 (+0.25) |",
    ]
