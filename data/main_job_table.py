"""The main job's tables for a README: one row per seed against the bars, then held-out samples side by side.

    python data/main_job_table.py runs/smollm2-reviews-seed0 runs/smollm2-reviews-seed1 ... [--samples 12]

Each argument is a pipeline run folder (sft/, rm/, ppo/, eval/, pipeline.json). The first table has one row
per run: the reward model's test accuracy against the bag-of-words baseline on the same pairs, the gold win rate
of the PPO policy against the SFT model with its standard error, whether the reward-hacking alarm stayed quiet
during PPO (`ppo/metrics.json` alarm_step) and on the final evaluation (`eval/metrics.json` alarm_rules), the
policy's duplicate_rate, its word distinct-2 and mean length as ratios to the SFT model's, and each stage's wall
seconds (`pipeline.json`). The second table is the first run's first `--samples` rows of eval/samples.jsonl, in
the prompt file's order, as written: the prompt, the SFT model's response and the policy's, each with its gold.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STAGES = ("sft", "rm", "ppo", "eval")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def ratio(metrics: dict, key: str) -> float | None:
    policy, baseline = metrics.get(key), metrics.get(f"{key}_baseline")
    return None if policy is None or not baseline else policy / baseline


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def seed_row(run: Path) -> str:
    rm, ppo, ev = (read_json(run / s / "metrics.json") for s in ("rm", "ppo", "eval"))
    stages = read_json(run / "pipeline.json")
    seconds = [stages.get(s, {}).get("wall_time_s") for s in STAGES]
    total = sum(s for s in seconds if s is not None)
    quiet_ppo = "quiet" if ppo and ppo.get("alarm_step") is None else f"fired at {ppo.get('alarm_step')}"
    quiet_eval = "quiet" if ev and not ev.get("alarm_rules") else ", ".join(ev.get("alarm_rules") or ["-"])
    cells = [
        run.name,
        f"{fmt(rm.get('test_accuracy'), '.3f')} ({fmt(rm.get('baseline_test_accuracy'), '.3f')})",
        f"{fmt(ev.get('gold_win_rate'), '.3f')} ± {fmt(ev.get('gold_win_rate_stderr'), '.3f')}",
        f"{quiet_ppo} / {quiet_eval}",
        fmt(ev.get("duplicate_rate"), ".3f"),
        fmt(ratio(ev, "word_distinct_2"), ".2f"),
        fmt(ratio(ev, "response_length_mean"), ".2f"),
        " / ".join(fmt(s, ".0f") for s in seconds) + f" = {total:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def seeds_table(runs: list[Path]) -> str:
    head = (
        "| run | RM test accuracy (bag-of-words) | gold win rate vs SFT | alarm: PPO / final eval | "
        "duplicate_rate | word distinct-2 / SFT's | length / SFT's | seconds: SFT / RM / PPO / eval = all |\n"
        "|---|---:|---:|---|---:|---:|---:|---:|"
    )
    return head + "\n" + "\n".join(seed_row(r) for r in runs)


def cell_text(text: str) -> str:
    """A response in a markdown table cell: pipes escaped, line breaks shown as ⏎, the outer spaces (which
    markdown drops) left out, as written otherwise."""
    return text.strip().replace("|", "\\|").replace("\n", " ⏎ ") or "(empty)"


def samples_table(run: Path, rows: int) -> str:
    lines = (run / "eval" / "samples.jsonl").read_text().splitlines()[:rows]
    out = ["| prompt | SFT model (gold) | PPO policy (gold) |", "|---|---|---|"]
    for row in map(json.loads, lines):
        out.append(
            f"| {cell_text(row['prompt'])} | {cell_text(row['baseline_response'])} "
            f"({row['baseline_gold_score']:+.2f}) | {cell_text(row['policy_response'])} "
            f"({row['policy_gold_score']:+.2f}) |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="pipeline run folders (one per seed)")
    ap.add_argument("--samples", type=int, default=12, help="rows of the first run's samples table")
    args = ap.parse_args(argv)
    print(seeds_table(args.runs))
    if args.samples:
        print()
        print(samples_table(args.runs[0], args.samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
