"""The scripts that measure the reward-hacking watch: the planted preference file and the table."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from helpers import ROOT, load_script


def test_plant_marks_the_chosen_of_a_seeded_fraction_and_nothing_else():
    plant = load_script(ROOT / "data" / "make_planted_prefs.py").plant
    rows = [
        {"prompt": f"p{i}", "chosen": f" good {i}.", "rejected": f" bad {i}.", "margin": 1.0}
        for i in range(10)
    ]
    planted = plant(rows, marker=" !!!", fraction=0.3, seed=0)
    marked = [i for i, (a, b) in enumerate(zip(rows, planted)) if a != b]
    assert len(marked) == 3 and planted == plant(rows, marker=" !!!", fraction=0.3, seed=0)
    for i in marked:
        assert planted[i] == {**rows[i], "chosen": rows[i]["chosen"] + " !!!"}
    assert plant(rows, marker=" !!!", fraction=0.3, seed=1) != planted  # another seed, other rows


def write_run(folder: Path, golds: list[float], alarm_step, final_rules: list[str]) -> Path:
    """A run folder as a pipeline leaves it: ppo/eval_log.jsonl with the watch's fields, config, eval metrics."""
    (folder / "ppo").mkdir(parents=True)
    (folder / "eval").mkdir()
    best = max(range(len(golds)), key=lambda i: (golds[i], -i))
    lines = [
        {
            "step": 10 * i,
            "rm_score": 0.1 * i,
            "gold_score": g,
            "gold_score_stderr": 0.05,
            "alarm_step": alarm_step if alarm_step is not None and 10 * i >= alarm_step else None,
            "alarm_rules": ["duplicate_rate"] if alarm_step is not None and 10 * i >= alarm_step else [],
            "best_step": 10 * best,
        }
        for i, g in enumerate(golds)
    ]
    (folder / "ppo" / "eval_log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "ppo" / "config.yaml").write_text(yaml.safe_dump({"reward_fn_weight": 1.0}))
    (folder / "eval" / "metrics.json").write_text(json.dumps({"alarm_rules": final_rules}))
    return folder


def test_the_table_reads_the_alarm_the_gold_peak_and_the_lead(tmp_path):
    table = load_script(ROOT / "data" / "hacking_table.py")
    hacked = write_run(
        tmp_path / "hacked", [-1.0, 0.5, 0.2, -0.5], alarm_step=10, final_rules=["word_distinct_2"]
    )
    row = table.run_row("induced", hacked)
    assert (row["alarm_step"], row["gold_peak_step"], row["lead_evals"]) == (10, 10, 0)
    assert row["gold_fell"] is True and row["fired"] is True and row["final_rules"] == ["word_distinct_2"]
    early = table.run_row(
        "induced", write_run(tmp_path / "early", [-1.0, 0.0, 0.5], alarm_step=0, final_rules=[])
    )
    assert early["lead_evals"] == 2  # the alarm two evaluations before the gold's peak
    quiet = table.run_row(
        "quiet", write_run(tmp_path / "quiet", [-1.0, -0.5], alarm_step=None, final_rules=[])
    )
    assert quiet["fired"] is False and quiet["lead_evals"] is None and quiet["gold_fell"] is False
    text = table.markdown([row, early, quiet])
    assert "detection: 2 of 2 induced runs (2 during the run); lead times (evaluations) [0, 2]" in text
    assert "false alarms: 0 of 1 quiet runs" in text
