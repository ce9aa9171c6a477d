"""Gold judges: stand-ins for the people who would judge the outputs (evaluation only).

A judge is any callable

    judge(prompts: list[str], responses: list[str]) -> list[float]     # one score per pair, higher = better

so users can plug in their own (another reward model, a classifier, an API they own). `llm-rlhf eval`
takes it as `--gold_judge SPEC`, resolved by `load_judge`:

    path/to/judge.json   a `GoldJudge` saved as JSON (default: data/reviews/gold_judge.json)
    module:function      a function with the signature above, imported from an importable module
    module:Class         a class, instantiated with no arguments; its instances are such callables
    none                 no gold judge (gold metrics are reported as null)

`GoldJudge`, the default for the "reviews" task, predicts the mean human rating (-4 .. +4) of the text
`prompt + response`: TF-IDF of word 1-2 grams (scikit-learn's `TfidfVectorizer` conventions, reproduced
here) and a linear ridge regression, fitted by `data/make_gold_judge.py` on the human ratings of
`data/reviews/gold_train.jsonl` only; its held-out accuracy on `gold_test.jsonl` is stored in the JSON.
The file holds the vocabulary, idf and coefficients (no pickle: loading it runs no code) and this
scorer is plain python, so the judge does not depend on the toolkit's models in any way.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from llm_rlhf.errors import UserError

FORMAT = "llm_rlhf.gold_judge/tfidf-ridge-v1"


class Judge(Protocol):
    """Any callable (prompts, responses) -> one float per pair; higher = better."""

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]: ...


class GoldJudge:
    """Linear model on TF-IDF features of word n-grams; scores `prompt + response`.

    score(text) = intercept + sum_j coef_j * x_j, with
        tf_j = count of n-gram j in text          (n-grams of the lower-cased tokens of `token_pattern`)
        x_j  = (1 + ln tf_j) * idf_j / ||(1 + ln tf) * idf||_2      (sublinear tf, l2 norm)
    over the n-grams j of the vocabulary (others are ignored); a text with none scores `intercept`.
    """

    def __init__(
        self,
        *,
        terms: dict[str, tuple[float, float]],
        intercept: float,
        ngram_range: tuple[int, int] = (1, 2),
        token_pattern: str = r"(?u)\b\w\w+\b",
        lowercase: bool = True,
        info: dict[str, Any] | None = None,
    ):
        self.terms = terms  # n-gram -> (idf, coef)
        self.intercept = float(intercept)
        self.ngram_range = (int(ngram_range[0]), int(ngram_range[1]))
        self.token_pattern = re.compile(token_pattern)
        self.lowercase = lowercase
        self.info = info or {}  # provenance and held-out accuracy, as stored by the script

    @classmethod
    def load(cls, path: str | Path) -> GoldJudge:
        """Read a judge JSON written by `data/make_gold_judge.py` (or `to_dict`)."""
        path = Path(path)
        if not path.is_file():
            raise UserError(
                f"gold judge '{path}': no such file (build it with `python data/make_gold_judge.py`)"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"gold judge '{path}': not valid JSON ({e})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> GoldJudge:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise UserError(f"gold judge '{source}': expected format '{FORMAT}', found {found!r}")
        try:
            features = data["features"]
            terms = {t: (float(v[0]), float(v[1])) for t, v in data["terms"].items()}
            return cls(
                terms=terms,
                intercept=data["intercept"],
                ngram_range=tuple(features["ngram_range"]),
                token_pattern=features["token_pattern"],
                lowercase=features["lowercase"],
                info={k: v for k, v in data.items() if k not in ("terms", "intercept", "features", "format")},
            )
        except (KeyError, TypeError, ValueError, IndexError, re.error) as e:
            raise UserError(f"gold judge '{source}': malformed ({type(e).__name__}: {e})") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "features": {
                "lowercase": self.lowercase,
                "token_pattern": self.token_pattern.pattern,
                "ngram_range": list(self.ngram_range),
                "tf": "sublinear (1 + ln tf)",
                "norm": "l2",
            },
            **self.info,
            "intercept": self.intercept,
            "terms": {t: [idf, coef] for t, (idf, coef) in self.terms.items()},
        }

    def ngrams(self, text: str) -> list[str]:
        """Word n-grams as scikit-learn builds them: tokens of `token_pattern`, joined by one space."""
        tokens = self.token_pattern.findall(text.lower() if self.lowercase else text)
        lo, hi = self.ngram_range
        return [" ".join(tokens[i : i + n]) for n in range(lo, hi + 1) for i in range(len(tokens) - n + 1)]

    def score_texts(self, texts: list[str]) -> list[float]:
        scores = []
        for text in texts:
            counts = Counter(g for g in self.ngrams(text) if g in self.terms)
            weights = {g: (1.0 + math.log(tf)) * self.terms[g][0] for g, tf in counts.items()}  # tf * idf
            norm = math.sqrt(sum(w * w for w in weights.values()))
            dot = sum(w * self.terms[g][1] for g, w in weights.items())
            scores.append(self.intercept + (dot / norm if norm > 0 else 0.0))
        return scores

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return self.score_texts([p + r for p, r in zip(prompts, responses)])


def load_judge(spec: str) -> Judge | None:
    """Resolve `--gold_judge`: a judge JSON path, 'module:function', 'module:Class' or 'none' (-> None)."""
    spec = spec.strip()
    if spec.lower() in ("none", "null", ""):
        return None
    if spec.lower().endswith(".json") or Path(spec).is_file():
        return GoldJudge.load(spec)
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise UserError(
            f"gold_judge '{spec}': expected a judge JSON file, 'module:function', 'module:Class' or 'none'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"gold_judge '{spec}': cannot import module '{module_name}' ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"gold_judge '{spec}': '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        try:
            obj = obj()
        except TypeError as e:
            raise UserError(
                f"gold_judge '{spec}': the class must be constructible with no arguments ({e})"
            ) from None
    if not callable(obj):
        raise UserError(f"gold_judge '{spec}': {type(obj).__name__} is not callable")
    return obj


def call_judge(
    judge: Callable[[list[str], list[str]], Any], prompts: list[str], responses: list[str]
) -> list[float]:
    """Call a judge and check what comes back: one finite float per (prompt, response)."""
    scores = judge(list(prompts), list(responses))
    try:
        scores = [float(s) for s in scores]
    except (TypeError, ValueError) as e:
        raise UserError(f"gold judge {judge!r}: expected a list of numbers ({e})") from None
    if len(scores) != len(prompts):
        raise UserError(f"gold judge {judge!r}: returned {len(scores)} scores for {len(prompts)} responses")
    if not all(math.isfinite(s) for s in scores):
        raise UserError(f"gold judge {judge!r}: returned a score that is NaN or infinite")
    return scores
