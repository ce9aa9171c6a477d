"""Seconds per PPO step with episodes of several turns against single turns, in one process.

    python benchmarks/episode_step.py [--model runs/gym-chain_sum-t3d1-tool/sft] [--steps 3] [--json out.json]

The calculator recipe's PPO (recipes/gym-chain_sum-t3d1/tool/ppo.yaml: GRPO, 8 problems x 4 responses, LoRA, the
calculator's system prompt) from `--model` (the tool SFT's output; data/smollm2-135m-instruct works too), run
`--steps` steps twice in this process, alternating nothing else: once with `environment: calculator` (episodes:
the call, the result, the answer) and once with `environment: null` (one response per prompt, the same prompts,
system prompt and budget). No held-out evaluation, no checkpoints. Prints each run's seconds per step (the first
step left out: warm-up) with its phases (generate, score, train), tokens per response or episode, and the ratio.
Run it alone on the machine: two timing jobs at once inflate both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llm_rlhf.core.config import parse_config  # noqa: E402
from llm_rlhf.interfaces import pipeline  # noqa: E402
from llm_rlhf.stages import ppo  # noqa: E402

PIPELINE = REPO / "recipes" / "gym-chain_sum-t3d1" / "tool" / "pipeline.yaml"


def run(model: str, steps: int, environment: str | None, out: Path, **keys) -> list[dict]:
    """`steps` PPO steps of the tool recipe's config from `model`, with `environment` (and any other PPO `keys`,
    e.g. a tiny model's max_prompt_length); the metrics per step."""
    cfg = pipeline.sweep_runs(parse_config(pipeline.Config, ["--config", str(PIPELINE)]))[1]  # seed 0
    ppo_cfg = pipeline.stage_config(cfg, "ppo")
    ppo_cfg.model_name_or_path, ppo_cfg.output_dir, ppo_cfg.steps = model, str(out), steps
    ppo_cfg.eval_every, ppo_cfg.save_steps, ppo_cfg.log_samples_every, ppo_cfg.environment = (
        0,
        0,
        0,
        environment,
    )
    for key, value in keys.items():
        setattr(ppo_cfg, key, value)
    ppo.run(ppo_cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(metrics: list[dict]) -> dict:
    later = metrics[1:] or metrics  # the first step warms up
    mean = lambda key: statistics.mean(m[key] for m in later)  # noqa: E731
    return {
        "s_per_step": mean("time/step"),
        "generate_s": mean("time/generate"),
        "score_s": mean("time/score"),
        "train_s": mean("time/train"),
        "tokens_per_row": mean("response_length"),
        "turns": mean("env/turns") if "env/turns" in later[0] else 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="runs/gym-chain_sum-t3d1-tool/sft")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--max-prompt-length", type=int, help="the recipe's unless given (a tiny test model)")
    args = parser.parse_args()
    keys = {"max_prompt_length": args.max_prompt_length} if args.max_prompt_length else {}
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            name: summary(run(args.model, args.steps, env, Path(tmp) / name, **keys))
            for name, env in (("episodes", "calculator"), ("single", None))
        }
    for name, r in results.items():
        print(
            f"{name:9s} {r['s_per_step']:.1f} s a step (generate {r['generate_s']:.1f}, score {r['score_s']:.1f}, "
            f"train {r['train_s']:.1f}); {r['tokens_per_row']:.1f} policy tokens and {r['turns']:.2f} turns a row"
        )
    ratio = results["episodes"]["s_per_step"] / results["single"]["s_per_step"]
    print(f"episodes / single turns: {ratio:.2f}x seconds per step")
    if args.json:
        args.json.write_text(json.dumps({**results, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
