"""The tool comparison measured: held-out accuracy with and without the calculator, by seed.

    python data/episode_table.py tool:runs/gym-chain_sum-t3d1-tool answer:runs/gym-chain_sum-t3d1-answer \\
        feedback:runs/gym-chain_sum-t3d1-feedback [--steps 0 12]

Each argument is LABEL:SWEEP, SWEEP a pipeline sweep folder whose variants (seed0, seed1, ...) hold
ppo/eval_log.jsonl and ppo/metrics.jsonl. Per variant and per held-out evaluation step asked for: the accuracy of
one sampled response (episode) per prompt and of one greedy one, the turns per episode, the tool-call rate and the
share of answers that are a number the tool returned (tool environments), the environment's success rate
(feedback), and from metrics.jsonl the mean seconds per step and the last step's KL. Then each label's mean ± the
standard error over its seeds (sd with n - 1, over sqrt n), each seed's value in brackets.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

COLUMNS = (  # (eval_log.jsonl key, column)
    ("accuracy", "sampled"),
    ("accuracy_greedy", "greedy"),
    ("turns_mean", "turns"),
    ("tool_call_rate", "tool-call rate"),
    ("tool_answer_used_rate", "answer from the tool"),
    ("env_success_rate", "success (feedback)"),
)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_se(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    m = sum(values) / len(values)
    se = (
        math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values))
        if len(values) > 1
        else 0.0
    )
    return f"{m:.3f} ± {se:.3f} ({', '.join(f'{v:.3f}' for v in values)})"


def variant_figures(folder: Path, steps: list[int]) -> dict[str, float | None]:
    """One variant's figures: '<column> @<step>' for each held-out step, 's a step' and 'KL, last step'."""
    log = {r["step"]: r for r in read(folder / "ppo" / "eval_log.jsonl")}
    metrics = read(folder / "ppo" / "metrics.jsonl")
    out: dict[str, float | None] = {}
    for step in steps:
        for key, column in COLUMNS:
            out[f"{column} @{step}"] = log.get(step, {}).get(key)
    out["s a step"] = sum(m["time/step"] for m in metrics) / len(metrics)
    out["KL, last step"] = metrics[-1]["objective/kl"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="LABEL:SWEEP_FOLDER")
    parser.add_argument("--steps", nargs="+", type=int, default=[0, 12])
    args = parser.parse_args()
    table: dict[str, dict[str, list]] = {}
    for arg in args.runs:
        label, folder = arg.split(":", 1)
        variants = sorted(
            p for p in Path(folder).iterdir() if (p / "ppo" / "metrics.json").is_file()
        )  # a variant still running (no final metrics yet) left out
        figures = [variant_figures(v, args.steps) for v in variants]
        table[f"{label} ({', '.join(v.name for v in variants)})"] = {
            key: [f[key] for f in figures] for key in figures[0]
        }
    keys = [
        k for k in next(iter(table.values())) if any(any(v is not None for v in t[k]) for t in table.values())
    ]
    print("| run | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for label, columns in table.items():
        print(f"| {label} | " + " | ".join(mean_se(columns[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
