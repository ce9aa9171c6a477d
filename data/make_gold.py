"""Calibrate and check the fluency-aware gold judge of the reviews task; writes data/reviews/gold.json.

    python data/make_gold.py [--calibration 500] [--fluency-model data/smollm2-135m-instruct]

The gold (llm_rlhf/models/gold.py, FluentGoldJudge) is

    gold = sentiment - w * (fluency_nll - nll_0) - b * max(0, fluency_nll - tau)

sentiment = data/reviews/gold_judge.json (fitted on the human ratings of gold_train.jsonl), fluency_nll
= mean negative log-likelihood per token of the response and an end marker under SmolLM2-135M (an LM no
stage trains). Four constants are measured here, on train sentences and the val pairs only:

- nll_0 (`reference_nll`): the median fluency_nll of real continuations (the sentence after its SFT
  opening, `data/README.md` rule 3) of `--calibration` train sentences;
- w (`fluency_weight`): between two real sentences people decide by what they say, not by how surprising
  an LM finds them. So w is the largest value on a grid for which (1) on the human preference pairs of
  `prefs_val.jsonl` (two real continuations of one opening, mean ratings >= 1 apart; sentences the
  sentiment judge never saw) the gold agrees with people at most 0.01 less often than the sentiment judge
  alone, and (2) on the calibration sentences the gold prefers the real continuation to (a) its words
  shuffled in >= 95% and (b) the continuation with its most positive word (by the sentiment judge) written
  four times in >= 90% of pairs, both less one standard error (so that sampling noise does not decide);
- tau (`disfluency_nll`): the 95th percentile of the real continuations' fluency_nll: text more surprising
  than nearly everything people write;
- b (`disfluency_weight`): the smallest value on a grid for which the gold prefers the real continuation
  to (c) praise salad -- its words shuffled with two of the sentiment judge's 20 most positive words put in
  at random places -- in >= 90% of pairs less one standard error, with (1) and (2) still holding.
  The salad is what a policy that over-optimises a bag-of-words reward writes; it is built here from the
  judge alone, so no policy's samples are used to calibrate.

Then the validity figures are measured on every held-out test sentence (gold_test.jsonl, never used
above) and stored in the JSON: how often the gold prefers the real sentence to (a), (b) and (c), and how
often the sentiment judge alone does; and the agreement with people on the held-out pairs of
prefs_test.jsonl. Seeded; the shuffles use random.Random(seed). fluency_nll values are cached in
`--cache` (a JSON file keyed by the fluency model, end marker, prompt and response), so a re-run with
other bars or grids takes seconds instead of ~25 minutes.
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

from llm_rlhf.models.gold import FLUENT_FORMAT, FluencyLM, GoldJudge, gold_from_parts  # noqa: E402

WEIGHTS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)
DISFLUENCY_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
SHUFFLED_BAR, REPEATED_BAR, SALAD_BAR = 0.95, 0.90, 0.90
DISFLUENCY_QUANTILE = 0.95  # tau: this quantile of the real continuations' fluency_nll
PRAISE_WORDS, PRAISE_INSERTED = 20, 2  # salad: 2 of the judge's 20 most positive words put in
VARIANTS = ("shuffled", "repeated", "salad")
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


def praise_words(judge: GoldJudge, n: int = PRAISE_WORDS) -> list[str]:
    """The judge's n most positive single words (largest coefficients), most positive first."""
    words = [(coef, t) for t, (_, coef) in judge.terms.items() if " " not in t and t.isalpha()]
    return [t for _, t in sorted(words, reverse=True)[:n]]


def salad(response: str, praise: list[str], rng: random.Random) -> str:
    """Praise salad: the response's words shuffled, with PRAISE_INSERTED praise words put in at random places."""
    words = response.split()
    rng.shuffle(words)
    for word in rng.sample(praise, PRAISE_INSERTED):
        words.insert(rng.randrange(len(words) + 1), word)
    return " " + " ".join(words)


def variants(rows: list[dict], judge: GoldJudge, seed: int) -> dict[str, list[str]]:
    rng, salad_rng, praise = random.Random(seed), random.Random(seed + 1000), praise_words(judge)
    prompts, real, shuf, rep, sal = [], [], [], [], []
    for row in rows:
        p, r = opening_and_rest(row["text"])
        prompts.append(p)
        real.append(r)
        shuf.append(shuffled(r, rng))
        rep.append(repeated(r, judge))
        sal.append(salad(r, praise, salad_rng))
    return {"prompt": prompts, "real": real, "shuffled": shuf, "repeated": rep, "salad": sal}


class CachedNLL:
    """FluencyLM.nll with a JSON cache of the values already computed (key: prompt and response)."""

    def __init__(self, lm: FluencyLM, path: Path, key: str):
        self.lm, self.path, self.key = lm, path, key
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        self.values: dict[str, float] = data.get(key, {})
        self.other = {k: v for k, v in data.items() if k != key}

    def nll(self, prompts: list[str], responses: list[str]) -> list[float]:
        keys = [p + "\x00" + r for p, r in zip(prompts, responses)]
        todo = sorted({k for k in keys if k not in self.values})
        if todo:
            pairs = [k.split("\x00", 1) for k in todo]
            for k, v in zip(todo, self.lm.nll([p for p, _ in pairs], [r for _, r in pairs])):
                self.values[k] = v
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({**self.other, self.key: self.values}), encoding="utf-8")
            tmp.replace(self.path)
        return [self.values[k] for k in keys]


def parts(v: dict[str, list[str]], judge: GoldJudge, lm) -> dict[str, dict[str, list[float]]]:
    return {
        k: {"sentiment": judge(v["prompt"], v[k]), "nll": lm.nll(v["prompt"], v[k])}
        for k in ("real", *VARIANTS)
    }


def win_rate(first: list[float], second: list[float]) -> float:
    """Fraction of rows where first > second; ties count one half."""
    wins = [1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(first, second)]
    return sum(wins) / len(wins)


def golds(p: dict, kind: str, rows, consts: dict[str, float]) -> list[float]:
    """The gold of `kind`'s rows from its stored parts, with the constants `consts` (gold_from_parts)."""
    return [
        gold_from_parts(sentiment=p[kind]["sentiment"][i], fluency_nll=p[kind]["nll"][i], **consts)
        for i in rows
    ]


def prefer_real(p: dict, other: str, consts: dict[str, float], keep: list[int]) -> float:
    """Fraction of rows where gold(real) > gold(other); ties count one half."""
    return win_rate(golds(p, "real", keep, consts), golds(p, other, keep, consts))


def sentiment_prefers_real(p: dict, other: str, keep: list[int]) -> float:
    s, o = p["real"]["sentiment"], p[other]["sentiment"]
    return win_rate([s[i] for i in keep], [o[i] for i in keep])


def changed(v: dict[str, list[str]], other: str) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(v["real"], v[other])) if a != b]


def pair_parts(path: Path, judge: GoldJudge, lm) -> dict[str, dict[str, list[float]]]:
    """Sentiment and fluency_nll of the chosen and the rejected continuation of every preference pair."""
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    prompts = [r["prompt"] for r in rows]
    return {
        k: {"sentiment": judge(prompts, [r[k] for r in rows]), "nll": lm.nll(prompts, [r[k] for r in rows])}
        for k in ("chosen", "rejected")
    }


def agreement(pp: dict, consts: dict[str, float]) -> float:
    """Fraction of pairs where gold(chosen) > gold(rejected), as people said; ties count one half."""
    rows = range(len(pp["chosen"]["nll"]))
    return win_rate(golds(pp, "chosen", rows, consts), golds(pp, "rejected", rows, consts))


def constants(w: float, nll_0: float, b: float = 0.0, tau: float = math.inf) -> dict[str, float]:
    return {"fluency_weight": w, "reference_nll": nll_0, "disfluency_weight": b, "disfluency_nll": tau}


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs, linear between order statistics (numpy's default)."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO / "data" / "reviews")
    ap.add_argument(
        "--fluency-model", default="data/smollm2-135m-instruct", help="repo-relative folder or hub name"
    )
    ap.add_argument("--calibration", type=int, default=500, help="train sentences for the constants")
    ap.add_argument("--end-text", default="\n", help="end marker scored after each response")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "data" / "reviews" / "gold.json")
    ap.add_argument(
        "--cache", type=Path, default=REPO / "runs" / "make_gold" / "nll_cache.json", help="fluency_nll cache"
    )
    args = ap.parse_args()
    start = time.time()

    judge = GoldJudge.load(args.data / "gold_judge.json")
    model = REPO / args.fluency_model if (REPO / args.fluency_model).is_dir() else args.fluency_model
    lm = CachedNLL(
        FluencyLM.load(str(model), end_text=args.end_text),
        args.cache,
        f"{args.fluency_model}|{args.end_text!r}",
    )

    def passes(rate: float, n: int, bar: float) -> bool:
        return rate - math.sqrt(rate * (1 - rate) / n) >= bar

    train = [json.loads(line) for line in (args.data / "gold_train.jsonl").open(encoding="utf-8")]
    random.Random(args.seed).shuffle(train)
    cal_v = variants(train[: args.calibration], judge, args.seed)
    cal = parts(cal_v, judge, lm)
    reference_nll = statistics.median(cal["real"]["nll"])
    disfluency_nll = quantile(cal["real"]["nll"], DISFLUENCY_QUANTILE)
    keep = {k: changed(cal_v, k) for k in VARIANTS}
    val_pairs = pair_parts(args.data / "prefs_val.jsonl", judge, lm)
    sentiment_agreement = agreement(val_pairs, constants(0.0, reference_nll))
    print(
        f"sentiment alone agrees with people on {sentiment_agreement:.4f} of the prefs_val pairs", flush=True
    )

    def grid_row(consts: dict[str, float]) -> dict[str, float]:
        row = {k: consts[k] for k in ("fluency_weight", "disfluency_weight")}
        row["agrees_with_people"] = agreement(val_pairs, consts)
        for kind in VARIANTS:
            row[f"prefers_real_over_{kind}"] = prefer_real(cal, kind, consts, keep[kind])
        print(json.dumps(row), flush=True)
        return row

    def holds(row: dict[str, float]) -> bool:  # (1) and (2) of the module docstring
        return (
            row["agrees_with_people"] >= sentiment_agreement - AGREEMENT_TOLERANCE
            and passes(row["prefers_real_over_shuffled"], len(keep["shuffled"]), SHUFFLED_BAR)
            and passes(row["prefers_real_over_repeated"], len(keep["repeated"]), REPEATED_BAR)
        )

    grid = [grid_row(constants(w, reference_nll)) for w in WEIGHTS]
    passing = [r for r in grid if holds(r)]
    if not passing:
        sys.exit(f"error: no fluency_weight in {WEIGHTS} passes the calibration bars; see the grid above")
    weight = passing[-1]["fluency_weight"]
    disfluency_grid = [
        grid_row(constants(weight, reference_nll, b, disfluency_nll)) for b in DISFLUENCY_WEIGHTS
    ]
    passing = [
        r
        for r in disfluency_grid
        if holds(r) and passes(r["prefers_real_over_salad"], len(keep["salad"]), SALAD_BAR)
    ]
    if not passing:
        sys.exit(
            f"error: no disfluency_weight in {DISFLUENCY_WEIGHTS} passes the calibration bars (grid above)"
        )
    consts = constants(weight, reference_nll, passing[0]["disfluency_weight"], disfluency_nll)

    test = [json.loads(line) for line in (args.data / "gold_test.jsonl").open(encoding="utf-8")]
    test_v = variants(test, judge, args.seed + 1)
    tp = parts(test_v, judge, lm)
    tkeep = {k: changed(test_v, k) for k in VARIANTS}
    test_pairs = pair_parts(args.data / "prefs_test.jsonl", judge, lm)
    validity = {
        "file": "data/reviews/gold_test.jsonl",
        "sentences": len(test),
        **{f"pairs_{k}": len(tkeep[k]) for k in VARIANTS},
        **{f"gold_prefers_real_over_{k}": prefer_real(tp, k, consts, tkeep[k]) for k in VARIANTS},
        **{f"sentiment_prefers_real_over_{k}": sentiment_prefers_real(tp, k, tkeep[k]) for k in VARIANTS},
        "fluency_nll_real_median": statistics.median(tp["real"]["nll"]),
        **{f"fluency_nll_{k}_median": statistics.median(tp[k]["nll"]) for k in VARIANTS},
        "pairs_file": "data/reviews/prefs_test.jsonl",
        "pairs": len(test_pairs["chosen"]["nll"]),
        "gold_agrees_with_people": agreement(test_pairs, consts),
        "sentiment_agrees_with_people": agreement(test_pairs, constants(0.0, reference_nll)),
    }
    out = {
        "format": FLUENT_FORMAT,
        "description": (
            "gold = sentiment - fluency_weight * (fluency_nll - reference_nll) - disfluency_weight * "
            "max(0, fluency_nll - disfluency_nll): the predicted mean human rating (-4 .. +4), less a penalty "
            "per nat of surprise beyond what people typically write, steeper beyond what people hardly ever write"
        ),
        "built_by": "python data/make_gold.py " + " ".join(sys.argv[1:]),
        "sentiment_judge": "gold_judge.json",
        "fluency_model": str(Path("..") / Path(args.fluency_model).name)
        if (REPO / args.fluency_model).is_dir()
        else args.fluency_model,
        "fluency_model_hub_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "end_text": args.end_text,
        "reference_nll": round(reference_nll, 4),
        "fluency_weight": consts["fluency_weight"],
        "disfluency_nll": round(disfluency_nll, 4),
        "disfluency_weight": consts["disfluency_weight"],
        "calibration": {
            "file": "data/reviews/gold_train.jsonl",
            "sentences": args.calibration,
            "pairs_file": "data/reviews/prefs_val.jsonl",
            "pairs": len(val_pairs["chosen"]["nll"]),
            "sentiment_agrees_with_people": sentiment_agreement,
            "seed": args.seed,
            "praise_words": praise_words(judge),
            "reference_nll_rule": "median fluency_nll of the real continuations",
            "fluency_weight_rule": (
                f"largest w with agrees_with_people >= sentiment's - {AGREEMENT_TOLERANCE} (prefs_val pairs) and "
                f"(rate - 1 stderr) >= {SHUFFLED_BAR} (shuffled) and >= {REPEATED_BAR} (repeated)"
            ),
            "disfluency_nll_rule": f"{DISFLUENCY_QUANTILE} quantile of fluency_nll of the real continuations",
            "disfluency_weight_rule": (
                f"smallest b with (rate - 1 stderr) >= {SALAD_BAR} (salad: words shuffled, {PRAISE_INSERTED} of the "
                f"{PRAISE_WORDS} praise_words put in) and the fluency_weight rule still holding"
            ),
            "grid": grid,
            "disfluency_grid": disfluency_grid,
        },
        "validity": validity,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(validity, indent=2))
    print(f"wrote {args.out} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
