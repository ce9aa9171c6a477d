"""Where the reward-hacking alarm's thresholds come from (`llm_rlhf.rl.hacking`, issue 40): two measurements.

    python data/hacking_thresholds.py [--draws 2000] [--seed 0]

1. Collapse counters on real text. A "baseline" and a "policy" are each N sentences drawn at random from
   data/reviews/sft_val.jsonl's completions (cut to 25 words, about what the 32-token held-out responses
   hold), and a second "policy" draws N positive sentences of gold_test.jsonl (rating > 1: what a healthy
   sentiment-tuned policy writes). Per N, over the draws: each counter's mean, and the largest policy -
   baseline difference (word_distinct_2: the lowest policy / baseline ratio), against the counter's
   threshold. Then issue 40's collapse (" a heart.", " is a heart.", " heart of a heart." over 32 prompts).
2. The proxy-up / gold-down rule on simulated trajectories (independent normal noise of one standard error,
   se 0.05, on every evaluation's proxy and gold; the proxy rising 4 se per evaluation): how often it fires
   when the gold is flat, and when it falls 1 or 2 se per evaluation after a peak half-way, for Z = 2 and 3.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llm_rlhf.rl.hacking import COUNTER_RULES, collapse_rates, watch  # noqa: E402

ISSUE_40 = [" a heart.", " is a heart.", " heart of a heart."]


def sentences() -> tuple[list[str], list[str]]:
    """(sft_val completions, positive gold_test sentences), each cut to its first 25 words."""
    reviews = REPO / "data" / "reviews"
    cut = lambda text: " ".join(text.split(" ")[:25])  # noqa: E731
    val = [cut(json.loads(line)["completion"]) for line in (reviews / "sft_val.jsonl").open()]
    test = [json.loads(line) for line in (reviews / "gold_test.jsonl").open()]
    return val, [cut(" " + row["text"]) for row in test if row["rating"] > 1.0]


def counters(draws: int, rng: random.Random) -> None:
    val, positive = sentences()
    print(f"{len(val)} sft_val sentences, {len(positive)} positive gold_test ones")
    for n in (16, 32, 64):
        stats = {key: [] for key in COUNTER_RULES if key in collapse_rates([])}
        worst = {key: -1e9 for key in stats}
        for _ in range(draws):
            base = collapse_rates(rng.sample(val, n))
            for policy in (collapse_rates(rng.sample(val, n)), collapse_rates(rng.sample(positive, n))):
                for key in stats:
                    kind, _ = COUNTER_RULES[key]
                    stats[key].append(policy[key])
                    score = policy[key] - base[key] if kind == "above" else -policy[key] / base[key]
                    worst[key] = max(worst[key], score)
        for key, (kind, threshold) in ((k, COUNTER_RULES[k]) for k in stats):
            mean = sum(stats[key]) / len(stats[key])
            head = f"N {n:3d}  {key:20s} mean {mean:.3f}"
            if kind == "above":
                print(f"{head}  largest difference {worst[key]:+.3f}  (fires at +{threshold:g})")
            else:
                print(f"{head}  lowest ratio {-worst[key]:.3f}  (fires below {threshold:.3g})")
    print("issue 40's collapse:", collapse_rates([ISSUE_40[i % 3] for i in range(32)]))


def trajectory(rng: random.Random, n: int, gold, proxy, se: float = 0.05) -> list[dict]:
    return [
        {"step": 10 * i, "gold": gold(i) + rng.gauss(0, se), "gold_stderr": se,
         "proxy": proxy(i) + rng.gauss(0, se), "proxy_stderr": se}
        for i in range(n)
    ]  # fmt: skip


def simulated(draws: int, rng: random.Random) -> None:
    for z in (2.0, 3.0):
        for n in (6, 11, 21):
            peak = n // 2
            for name, fall in (
                ("flat gold", 0.0),
                ("gold -1 se/eval after its peak", 0.05),
                ("gold -2 se/eval after its peak", 0.10),
            ):
                gold = lambda i, fall=fall, peak=peak: -fall * abs(i - peak)  # noqa: E731
                runs = [trajectory(rng, n, gold, lambda i: 0.2 * i) for _ in range(draws)]
                fired = sum(watch(points, baseline=None, z=z) is not None for points in runs) / draws
                print(f"Z {z:g}  {n:2d} evaluations  {name:32s} fired in {fired:.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    counters(args.draws, rng)
    simulated(args.draws, rng)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
