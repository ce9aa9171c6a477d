"""Fit the gold judge of the "reviews" task: ``data/reviews/gold_judge.json``.

The gold judge stands in for the people who would judge the pipeline's outputs: a sentiment scorer
fitted to the mean human rating (-4 .. +4) of the sentences of ``gold_train.jsonl`` (the training
split: no evaluation sentence is ever seen here), with its held-out accuracy measured once on
``gold_test.jsonl``. The pipeline never trains on the judge; ``llm-rlhf eval`` only calls it.

Method: TF-IDF of lower-cased word 1-2 grams (scikit-learn ``TfidfVectorizer``: binary tf, smoothed
idf, l2 norm; n-grams seen in fewer than ``MIN_DF`` training sentences are dropped, which keeps the
file small) and a ridge regression on the mean rating. Binary tf (an n-gram present or not) because
a reader does not find "great great great great" more positive than "great": with counts (even
sublinear ones) a policy buys sentiment by repeating its most positive word, and the sentiment judge
with sublinear tf preferred such a repetition to the real sentence in 98% of held-out pairs
(``data/make_gold.py``). The n-gram range and the ridge penalty are
chosen by 5-fold cross-validation on the training split only (sign accuracy, ties broken by grid
order); the test split is touched once, after the choice, to report:

    accuracy   sign agreement of the judge's score with the mean human rating on gold_test.jsonl,
               rows with a mean rating of exactly 0 excluded (they have no sign)

The fitted judge is written as JSON (vocabulary, idf, coefficients; no pickle) and the accuracy is
recomputed from that file with the toolkit's scorer (``llm_rlhf.models.gold.GoldJudge``), so the number in
the file is the number of the file. Deterministic: the folds are shuffled with ``--seed``.

    python data/make_gold_judge.py [--data data/reviews] [--out data/reviews/gold_judge.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import Ridge
from sklearn.model_selection import KFold

from llm_rlhf.core.utils import atomic_write_text
from llm_rlhf.models.gold import GoldJudge

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN_PATTERN = r"(?u)\b\w\w+\b"  # scikit-learn's default: words of >= 2 word characters
MIN_DF = 2
NGRAM_RANGES = ((1, 1), (1, 2))
ALPHAS = (0.3, 1.0, 3.0, 10.0)
FOLDS = 5
SIGNIFICANT_DIGITS = (
    7  # of idf and coefficients in the JSON (the stored accuracy is that of the rounded judge)
)


def read_rows(path: Path) -> tuple[list[str], np.ndarray]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["text"] for r in rows], np.array([float(r["rating"]) for r in rows])


def sign_accuracy(scores: np.ndarray, ratings: np.ndarray) -> tuple[float, int]:
    """Fraction of rows where sign(score) == sign(mean rating), over rows with a non-zero mean rating."""
    keep = ratings != 0
    return float(np.mean(np.sign(scores[keep]) == np.sign(ratings[keep]))), int(keep.sum())


def vectorizer(ngram_range: tuple[int, int]) -> TfidfVectorizer:
    return TfidfVectorizer(
        lowercase=True,
        token_pattern=TOKEN_PATTERN,
        ngram_range=ngram_range,
        min_df=MIN_DF,
        binary=True,  # presence, not counts (see the module docstring)
        smooth_idf=True,
        norm="l2",
    )


def ridge(alpha: float) -> Ridge:
    return Ridge(alpha=alpha, solver="sparse_cg", tol=1e-8, max_iter=10000)


def cross_validate(texts: list[str], ratings: np.ndarray, seed: int) -> list[dict]:
    """Mean sign accuracy over FOLDS folds of the training split, for every grid point."""
    folds = list(KFold(n_splits=FOLDS, shuffle=True, random_state=seed).split(texts))
    results = []
    for ngram_range in NGRAM_RANGES:
        per_alpha: dict[float, list[float]] = {a: [] for a in ALPHAS}
        for fit_idx, val_idx in folds:
            vec = vectorizer(ngram_range)
            x_fit = vec.fit_transform([texts[i] for i in fit_idx])
            x_val = vec.transform([texts[i] for i in val_idx])
            for alpha in ALPHAS:
                model = ridge(alpha).fit(x_fit, ratings[fit_idx])
                per_alpha[alpha].append(sign_accuracy(model.predict(x_val), ratings[val_idx])[0])
        for alpha in ALPHAS:
            results.append(
                {
                    "ngram_range": list(ngram_range),
                    "alpha": alpha,
                    "cv_accuracy": float(np.mean(per_alpha[alpha])),
                }
            )
    return results


def round_sig(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}")


def to_json(judge: GoldJudge) -> str:
    """The judge as JSON, readable: metadata first, indented; then one n-gram per line: [idf, coef]."""
    data = judge.to_dict()
    terms = data.pop("terms")
    head = json.dumps(data, indent=1, ensure_ascii=False)[:-2]  # drop the closing "\n}"
    lines = ",\n".join(f"  {json.dumps(t, ensure_ascii=False)}: {json.dumps(v)}" for t, v in terms.items())
    return f'{head},\n "terms": {{\n{lines}\n }}\n}}\n'


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "data" / "reviews")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "reviews" / "gold_judge.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.time()

    train_texts, train_ratings = read_rows(args.data / "gold_train.jsonl")
    cv = cross_validate(train_texts, train_ratings, args.seed)
    best = max(cv, key=lambda r: r["cv_accuracy"])  # max keeps the first of equals: grid order
    ngram_range, alpha = tuple(best["ngram_range"]), best["alpha"]
    for r in cv:
        print(f"cv  ngram_range={r['ngram_range']}  alpha={r['alpha']:<5}  accuracy={r['cv_accuracy']:.4f}")
    print(f"chosen on the training split: ngram_range={list(ngram_range)} alpha={alpha}")

    vec = vectorizer(ngram_range)
    x_train = vec.fit_transform(train_texts)
    model = ridge(alpha).fit(x_train, train_ratings)
    terms = {
        term: (round_sig(float(vec.idf_[j])), round_sig(float(model.coef_[j])))
        for term, j in sorted(vec.vocabulary_.items(), key=lambda kv: kv[1])
    }
    judge = GoldJudge(
        terms=terms,
        intercept=round_sig(float(model.intercept_)),
        ngram_range=ngram_range,
        token_pattern=TOKEN_PATTERN,
        lowercase=True,
        binary=True,
    )

    # The pure-python scorer must reproduce scikit-learn's prediction (up to the rounding of the file).
    sk_train = model.predict(x_train)
    ours_train = np.array(judge.score_texts(train_texts))
    max_diff = float(np.max(np.abs(sk_train - ours_train)))
    assert max_diff < 1e-4, f"GoldJudge disagrees with scikit-learn by {max_diff}"

    # The one look at the test split: the stored figures are those of the judge as written.
    test_path = args.data / "gold_test.jsonl"
    test_texts, test_ratings = read_rows(test_path)
    test_scores = np.array(judge.score_texts(test_texts))
    accuracy, n_used = sign_accuracy(test_scores, test_ratings)
    info = {
        "description": "Predicted mean human rating (-4 .. +4) of prompt + response; higher = more positive.",
        "method": (
            f"TF-IDF of word {ngram_range[0]}-{ngram_range[1]} grams (binary tf, smoothed idf, l2 norm, "
            f"min_df={MIN_DF}) + ridge regression (alpha={alpha}) on the mean human rating"
        ),
        "built_by": "python data/make_gold_judge.py",
        "seed": args.seed,
        "train": {
            "file": "data/reviews/gold_train.jsonl",
            "rows": len(train_texts),
            "sha256": sha256(args.data / "gold_train.jsonl"),
        },
        "cross_validation": {
            "folds": FOLDS,
            "metric": "sign accuracy, zero-mean rows excluded",
            "grid": cv,
            "chosen": {"ngram_range": list(ngram_range), "alpha": alpha},
        },
        "heldout": {
            "file": "data/reviews/gold_test.jsonl",
            "sha256": sha256(test_path),
            "metric": "sign agreement of the score with the mean human rating; rows with mean rating 0 excluded",
            "accuracy": accuracy,
            "rows": len(test_texts),
            "rows_used": n_used,
            "rows_excluded_zero_mean": len(test_texts) - n_used,
            "pearson_r": float(np.corrcoef(test_scores, test_ratings)[0, 1]),
            "mean_abs_error": float(np.mean(np.abs(test_scores - test_ratings))),
        },
        "vocabulary_size": len(terms),
    }
    judge.info = info
    text = to_json(judge)
    assert math.isclose(  # what is written is what was measured
        sign_accuracy(np.array(GoldJudge.from_dict(json.loads(text)).score_texts(test_texts)), test_ratings)[
            0
        ],
        accuracy,
    )
    atomic_write_text(args.out, text)

    held = info["heldout"]
    print(
        f"wrote {args.out} ({len(text.encode()) / 1e6:.2f} MB, {len(terms)} n-grams) in {time.time() - start:.0f}s"
    )
    print(
        f"held-out accuracy {accuracy:.4f} on {n_used} of {held['rows']} test sentences "
        f"({held['rows_excluded_zero_mean']} with mean rating 0 excluded); pearson r {held['pearson_r']:.3f}"
    )
    print("line for data/README.md:")
    print(
        f"- `gold_judge.json` (from `python data/make_gold_judge.py`, seed {args.seed}): the gold judge, "
        f"{info['method']}, fitted on gold_train.jsonl only; held-out accuracy (sign agreement with the mean "
        f"human rating) {accuracy:.3f} on gold_test.jsonl ({n_used} sentences, the "
        f"{held['rows_excluded_zero_mean']} with mean rating 0 excluded), Pearson r {held['pearson_r']:.3f}."
    )


if __name__ == "__main__":
    main()
