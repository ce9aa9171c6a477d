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
        {"step": s, "accuracy": a, "accuracy_greedy": a + 0.1, "kl": k}
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
    assert rows["a"][6] == "0.400 ± 0.100" and rows["b"][6] == "0.300 ± 0.100"
    assert rows["a"][7] == "11.0 ± 1.0" and rows["b"][8] == "160 ± 0"  # s a step; PPO wall s: 8 steps of 20 s
    assert "- a - b: +0.300 ± 0.141 (resolved at 2 se)" in out
