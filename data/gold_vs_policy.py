"""How often the gold prefers the real held-out sentence to a policy's sample for the same opening.

    python data/gold_vs_policy.py runs/reviews-sweep/no-kl/eval/samples.jsonl [--gold data/reviews/gold.json]

The evaluation prompts are SFT openings of gold_test.jsonl sentences (data/README.md, rule 7); the real
continuation of a prompt is the rest of the first test sentence with that opening. For every row of an
evaluation's samples.jsonl the gold scores the real continuation and the policy's response; the script
prints the fraction of rows where gold(real) > gold(policy) (ties count one half) with its standard
error, and the same for the sentiment judge alone and for fluency alone. The validity check of the gold
against a policy that over-optimised the reward model (the samples of a run without the KL penalty).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from make_gold import opening_and_rest, win_rate  # noqa: E402

from llm_rlhf.models.gold import judge_details, load_judge  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "samples", type=Path, help="samples.jsonl of an `llm-rlhf eval` run on eval_prompts.jsonl"
    )
    ap.add_argument("--gold", default=str(REPO / "data" / "reviews" / "gold.json"))
    ap.add_argument("--test", type=Path, default=REPO / "data" / "reviews" / "gold_test.jsonl")
    ap.add_argument("--positive", type=float, default=1.0, help="mean human rating of a positive sentence")
    args = ap.parse_args()

    real_of: dict[str, str] = {}
    rating_of: dict[str, float] = {}
    for line in args.test.open(encoding="utf-8"):
        sentence = json.loads(line)
        prompt, rest = opening_and_rest(sentence["text"])
        if prompt not in real_of:
            real_of[prompt], rating_of[prompt] = rest, float(sentence["rating"])
    rows = [json.loads(line) for line in args.samples.open(encoding="utf-8")]
    missing = [r["prompt"] for r in rows if r["prompt"] not in real_of]
    if missing:
        sys.exit(
            f"error: {args.samples}: {len(missing)} prompts are no gold_test opening, e.g. {missing[0]!r}"
        )
    prompts = [r["prompt"] for r in rows]
    judge = load_judge(args.gold)
    real = judge_details(judge, prompts, [real_of[p] for p in prompts])
    policy = judge_details(judge, prompts, [r["policy_response"] for r in rows])
    positive = [i for i, p in enumerate(prompts) if rating_of[p] >= args.positive]
    out = {"samples": str(args.samples), "rows": len(rows), "rows_positive_real": len(positive)}
    for subset, keep in (("", range(len(rows))), ("positive_real_", positive)):
        for name, key, sign in (
            ("gold", "gold_score", 1),
            ("sentiment", "sentiment", 1),
            ("fluency", "fluency_nll", -1),
        ):
            p = win_rate([sign * real[key][i] for i in keep], [sign * policy[key][i] for i in keep])
            se = math.sqrt(p * (1 - p) / max(len(keep), 1))
            out[f"{subset}{name}_prefers_real"] = round(p, 4)
            out[f"{subset}{name}_prefers_real_stderr"] = round(se, 4)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
