"""Hashes of what a short run of each estimator computes, to show a refactor changed no arithmetic.

    python benchmarks/behaviour_hashes.py --output_dir runs/hashes           # print one line per variant
    python benchmarks/behaviour_hashes.py --output_dir runs/hashes --json before.json

The reviews task's SFT (20 steps) and RM (20 steps) once, then a 10-step PPO run per variant (`gae`, the
default, and `grpo`, 16 prompts x 4) sharing them: `llm-rlhf pipeline` with a sweep, held-out evaluation and
the report off, on one CPU process with a fixed thread count. Per variant it prints the sha256 of
ppo/metrics.jsonl with the wall-clock keys (time/*, *_per_s, time_per_step_s) removed, and of each weights file
the run saved (model.safetensors, value_head.safetensors). Two checkouts that compute the same thing print the
same hashes on one machine; the thread count is part of the arithmetic (the order of float additions), so
compare runs made with the same --threads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = [
    {"name": "gae"},
    {"name": "grpo", "advantage_estimator": "grpo", "samples_per_prompt": 4, "rollout_batch_size": 16},
]
WALL_CLOCK = ("time/", "_per_s", "time_per_step_s")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--output_dir", required=True, help="the pipeline's folder (reused when it holds the runs)"
    )
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the run")
    p.add_argument("--steps", type=int, default=10, help="PPO steps per variant")
    p.add_argument("--json", help="also write the hashes here")
    return p.parse_args(argv)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def metrics_without_clocks(path: Path) -> bytes:
    """metrics.jsonl with every wall-clock key removed, one sorted JSON line per step."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [{k: v for k, v in r.items() if not any(w in k for w in WALL_CLOCK)} for r in rows]
    return "\n".join(json.dumps(r, sort_keys=True) for r in kept).encode()


def hashes(ppo_dir: Path) -> dict[str, str]:
    out = {"metrics": sha256(metrics_without_clocks(ppo_dir / "metrics.jsonl"))}
    for name in ("model.safetensors", "value_head.safetensors"):
        if (ppo_dir / name).exists():
            out[name] = sha256((ppo_dir / name).read_bytes())
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    sweep = json.dumps(VARIANTS)
    command = [
        sys.executable,
        "-m",
        "llm_rlhf",
        "pipeline",
        "--config",
        "recipes/reviews/pipeline.yaml",
        "--output_dir",
        str(out),
        "--stages",
        "[sft, rm, ppo]",
        "--report",
        "false",
        "--sweep",
        sweep,
        "--sft",
        '{"max_steps": 20}',
        "--rm",
        '{"max_steps": 20, "normalization_samples": 64}',
        "--ppo",
        json.dumps({"steps": args.steps, "eval_every": 0, "save_steps": 0, "log_samples_every": 0}),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env, cwd=Path(__file__).resolve().parents[1])
    result = {v["name"]: hashes(out / v["name"] / "ppo") for v in VARIANTS}
    for name, h in result.items():
        print(name, " ".join(f"{k}={v}" for k, v in h.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
