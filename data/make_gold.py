"""Calibrate and check the fluency-aware gold judge of the reviews task; writes data/reviews/gold.json.

    python data/make_gold.py [--calibration 500] [--fluency-model data/smollm2-135m-instruct]

The gold (llm_rlhf/gold.py, FluentGoldJudge) is  gold = sentiment - w * (fluency_nll - nll_0):
sentiment = data/reviews/gold_judge.json (fitted on the human ratings of gold_train.jsonl), fluency_nll
= mean negative log-likelihood per token of the response and an end marker under SmolLM2-135M (an LM no
stage trains). Two constants are measured here, on train sentences only:

- nll_0 (`reference_nll`): the median fluency_nll of real continuations (the sentence after its SFT
  opening, `data/README.md` rule 3) of `--calibration` train sentences;
- w (`fluency_weight`): between two real sentences people decide by what they say, not by how surprising
  an LM finds them; the fluency term is there to sink text that is not English. So w is the largest
  value on a grid for which (1) on the human preference pairs of `prefs_val.jsonl` (two real
  continuations of one opening, mean ratings >= 1 apart; sentences the sentiment judge never saw) the
  gold agrees with people at most 0.01 less often than the sentiment judge alone, and (2) on the
  calibration sentences the gold prefers the real continuation to (a) its words shuffled in >= 95% and
  (b) the continuation with its most positive word (by the sentiment judge) written four times in
  >= 90% of pairs, both less one standard error (so that sampling noise does not decide the bar). The
  grid is also computed for the hinge form sentiment - w * max(0, fluency_nll - nll_0) and stored, for
  comparison.

Then the validity figures are measured on every held-out test sentence (gold_test.jsonl, never used
above) and stored in the JSON: how often the gold prefers the real sentence to (a) and (b), and how often
the sentiment judge alone does; and the agreement with people on the held-out pairs of prefs_test.jsonl. Seeded; the shuffles use random.Random(seed).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llm_rlhf.gold import FLUENT_FORMAT, FluencyLM, GoldJudge, gold_from_parts  # noqa: E402

WEIGHTS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)
SHUFFLED_BAR, REPEATED_BAR = 0.95, 0.90
AGREEMENT_TOLERANCE = 0.01  # the gold may agree with people this much less often than sentiment alone
WORD = re.compile(r"(?u)\b\w\w+\b")  # the sentiment judge's token pattern


def opening_and_rest(text: str) -> tuple[str, str]:
    """The SFT opening (3 words, or 2 under 6 words) and the rest with its leading space."""
    words = text.split(" ")
    k = 3 if len(words) >= 6 else 2
    return " ".join(words[:k]), " " + " ".join(words[k:])


def shuffled(response: str, rng: random.Random) -> str:
    words = response.split()
    for _ in range(10):  # a shuffle that changes nothing is not a test
        rng.shuffle(words)
        if " " + " ".join(words) != response:
            break
    return " " + " ".join(words)


def repeated(response: str, judge: GoldJudge) -> str:
    """The response with its most positive word (largest sentiment coefficient) written four times."""
    best, best_coef = None, float("-inf")
    for m in WORD.finditer(response):
        term = judge.terms.get(m.group(0).lower())
        if term is not None and term[1] > best_coef:
            best, best_coef = m, term[1]
    if best is None:
        return response
    return response[: best.start()] + " ".join([best.group(0)] * 4) + response[best.end() :]


def variants(rows: list[dict], judge: GoldJudge, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    prompts, real, shuf, rep = [], [], [], []
    for row in rows:
        p, r = opening_and_rest(row["text"])
        prompts.append(p)
        real.append(r)
        shuf.append(shuffled(r, rng))
        rep.append(repeated(r, judge))
    return {"prompt": prompts, "real": real, "shuffled": shuf, "repeated": rep}


def parts(v: dict[str, list[str]], judge: GoldJudge, lm: FluencyLM) -> dict[str, dict[str, list[float]]]:
    return {
        k: {"sentiment": judge(v["prompt"], v[k]), "nll": lm.nll(v["prompt"], v[k])}
        for k in ("real", "shuffled", "repeated")
    }


def win_rate(first: list[float], second: list[float]) -> float:
    """Fraction of rows where first > second; ties count one half."""
    wins = [1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(first, second)]
    return sum(wins) / len(wins)


def golds(
    p: dict, kind: str, rows, *, weight: float, reference_nll: float, hinge: bool = False
) -> list[float]:
    """The gold of `kind`'s rows from its stored parts; hinge: no penalty below reference_nll."""
    return [
        gold_from_parts(
            sentiment=p[kind]["sentiment"][i],
            fluency_nll=max(p[kind]["nll"][i], reference_nll) if hinge else p[kind]["nll"][i],
            fluency_weight=weight,
            reference_nll=reference_nll,
        )
        for i in rows
    ]


def prefer_real(
    p: dict, other: str, *, weight: float, reference_nll: float, keep: list[int], hinge: bool = False
) -> float:
    """Fraction of rows where gold(real) > gold(other); ties count one half."""
    kw = {"weight": weight, "reference_nll": reference_nll, "hinge": hinge}
    return win_rate(golds(p, "real", keep, **kw), golds(p, other, keep, **kw))


def sentiment_prefers_real(p: dict, other: str, keep: list[int]) -> float:
    s, o = p["real"]["sentiment"], p[other]["sentiment"]
    return win_rate([s[i] for i in keep], [o[i] for i in keep])


def changed(v: dict[str, list[str]], other: str) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(v["real"], v[other])) if a != b]


def pair_parts(path: Path, judge: GoldJudge, lm: FluencyLM) -> dict[str, dict[str, list[float]]]:
    """Sentiment and fluency_nll of the chosen and the rejected continuation of every preference pair."""
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    prompts = [r["prompt"] for r in rows]
    return {
        k: {"sentiment": judge(prompts, [r[k] for r in rows]), "nll": lm.nll(prompts, [r[k] for r in rows])}
        for k in ("chosen", "rejected")
    }


def agreement(pp: dict, *, weight: float, reference_nll: float) -> float:
    """Fraction of pairs where gold(chosen) > gold(rejected), as people said; ties count one half."""
    rows = range(len(pp["chosen"]["nll"]))
    kw = {"weight": weight, "reference_nll": reference_nll}
    return win_rate(golds(pp, "chosen", rows, **kw), golds(pp, "rejected", rows, **kw))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO / "data" / "reviews")
    ap.add_argument(
        "--fluency-model", default="data/smollm2-135m-instruct", help="repo-relative folder or hub name"
    )
    ap.add_argument("--calibration", type=int, default=500, help="train sentences for nll_0 and w")
    ap.add_argument("--end-text", default="\n", help="end marker scored after each response")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "data" / "reviews" / "gold.json")
    args = ap.parse_args()
    start = time.time()

    judge = GoldJudge.load(args.data / "gold_judge.json")
    model = REPO / args.fluency_model if (REPO / args.fluency_model).is_dir() else args.fluency_model
    lm = FluencyLM.load(str(model), end_text=args.end_text)

    train = [json.loads(line) for line in (args.data / "gold_train.jsonl").open(encoding="utf-8")]
    random.Random(args.seed).shuffle(train)
    cal_v = variants(train[: args.calibration], judge, args.seed)
    cal = parts(cal_v, judge, lm)
    reference_nll = statistics.median(cal["real"]["nll"])
    keep = {k: changed(cal_v, k) for k in ("shuffled", "repeated")}
    val_pairs = pair_parts(args.data / "prefs_val.jsonl", judge, lm)
    sentiment_agreement = agreement(val_pairs, weight=0.0, reference_nll=reference_nll)
    print(
        f"sentiment alone agrees with people on {sentiment_agreement:.4f} of the prefs_val pairs", flush=True
    )
    grid = []
    for w in WEIGHTS:
        row = {
            "fluency_weight": w,
            "agrees_with_people": agreement(val_pairs, weight=w, reference_nll=reference_nll),
        }
        for form, hinge in (("", False), ("hinge_", True)):
            for kind in ("shuffled", "repeated"):
                row[f"{form}prefers_real_over_{kind}"] = prefer_real(
                    cal, kind, weight=w, reference_nll=reference_nll, keep=keep[kind], hinge=hinge
                )
        grid.append(row)
        print(json.dumps(row), flush=True)

    def passes(rate: float, n: int, bar: float) -> bool:
        return rate - math.sqrt(rate * (1 - rate) / n) >= bar

    passing = [
        r for r in grid
        if r["agrees_with_people"] >= sentiment_agreement - AGREEMENT_TOLERANCE
        and passes(r["prefers_real_over_shuffled"], len(keep["shuffled"]), SHUFFLED_BAR)
        and passes(r["prefers_real_over_repeated"], len(keep["repeated"]), REPEATED_BAR)
    ]  # fmt: skip
    if not passing:
        sys.exit(f"error: no fluency_weight in {WEIGHTS} passes the calibration bars; see the grid above")
    weight = passing[-1]["fluency_weight"]

    test = [json.loads(line) for line in (args.data / "gold_test.jsonl").open(encoding="utf-8")]
    test_v = variants(test, judge, args.seed + 1)
    tp = parts(test_v, judge, lm)
    tkeep = {k: changed(test_v, k) for k in ("shuffled", "repeated")}
    test_pairs = pair_parts(args.data / "prefs_test.jsonl", judge, lm)
    validity = {
        "file": "data/reviews/gold_test.jsonl",
        "sentences": len(test),
        "pairs_shuffled": len(tkeep["shuffled"]),
        "pairs_repeated": len(tkeep["repeated"]),
        "gold_prefers_real_over_shuffled": prefer_real(tp, "shuffled", weight=weight, reference_nll=reference_nll, keep=tkeep["shuffled"]),
        "gold_prefers_real_over_repeated": prefer_real(tp, "repeated", weight=weight, reference_nll=reference_nll, keep=tkeep["repeated"]),
        "sentiment_prefers_real_over_shuffled": sentiment_prefers_real(tp, "shuffled", tkeep["shuffled"]),
        "sentiment_prefers_real_over_repeated": sentiment_prefers_real(tp, "repeated", tkeep["repeated"]),
        "fluency_nll_real_median": statistics.median(tp["real"]["nll"]),
        "fluency_nll_shuffled_median": statistics.median(tp["shuffled"]["nll"]),
        "fluency_nll_repeated_median": statistics.median(tp["repeated"]["nll"]),
        "pairs_file": "data/reviews/prefs_test.jsonl",
        "pairs": len(test_pairs["chosen"]["nll"]),
        "gold_agrees_with_people": agreement(test_pairs, weight=weight, reference_nll=reference_nll),
        "sentiment_agrees_with_people": agreement(test_pairs, weight=0.0, reference_nll=reference_nll),
    }  # fmt: skip
    out = {
        "format": FLUENT_FORMAT,
        "description": (
            "gold = sentiment - fluency_weight * (fluency_nll - reference_nll): the predicted mean human "
            "rating (-4 .. +4), less a penalty per nat of surprise beyond what people typically write"
        ),
        "built_by": "python data/make_gold.py " + " ".join(sys.argv[1:]),
        "sentiment_judge": "gold_judge.json",
        "fluency_model": str(Path("..") / Path(args.fluency_model).name)
        if (REPO / args.fluency_model).is_dir()
        else args.fluency_model,
        "fluency_model_hub_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "end_text": args.end_text,
        "reference_nll": round(reference_nll, 4),
        "fluency_weight": weight,
        "calibration": {
            "file": "data/reviews/gold_train.jsonl",
            "sentences": args.calibration,
            "pairs_file": "data/reviews/prefs_val.jsonl",
            "pairs": len(val_pairs["chosen"]["nll"]),
            "sentiment_agrees_with_people": sentiment_agreement,
            "seed": args.seed,
            "reference_nll_rule": "median fluency_nll of the real continuations",
            "fluency_weight_rule": (
                f"largest w with agrees_with_people >= sentiment's - {AGREEMENT_TOLERANCE} (prefs_val pairs) and "
                f"(rate - 1 stderr) >= {SHUFFLED_BAR} (shuffled) and >= {REPEATED_BAR} (repeated)"
            ),
            "grid": grid,
        },
        "validity": validity,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(validity, indent=2))
    print(f"wrote {args.out} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
