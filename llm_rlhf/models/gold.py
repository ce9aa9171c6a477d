"""Gold judges: stand-ins for the people who would judge the outputs (evaluation only).

A judge is any callable

    judge(prompts: list[str], responses: list[str]) -> list[float]     # one score per pair, higher = better

so users can plug in their own (another reward model, a classifier, an API they own). `llm-rlhf eval`
takes it as `--gold_judge <judge>`, resolved by `load_judge`:

    path/to/judge.json   a judge saved as JSON: the fluency-aware `FluentGoldJudge` (default:
                         data/reviews/gold.json) or the sentiment-only `GoldJudge` (data/reviews/gold_judge.json)
    module:function      a function with the signature above, imported from the current directory or the
                         python path (or path/to/file.py:function); the rules of `callables.resolve_callable`,
                         which `reward_fn` follows too
    module:Class         a class, instantiated with no arguments; its instances are such callables
    none                 no gold judge (gold metrics are reported as null)

`GoldJudge`, the sentiment part of the reviews task's gold, predicts the mean human rating (-4 .. +4) of the text
`prompt + response`: TF-IDF of word 1-2 grams (scikit-learn's `TfidfVectorizer` conventions, reproduced
here) and a linear ridge regression, fitted by `data/make_gold_judge.py` on the human ratings of
`data/reviews/gold_train.jsonl` only; its held-out accuracy on `gold_test.jsonl` is stored in the JSON.
The file holds the vocabulary, idf and coefficients (no pickle: loading it runs no code) and this
scorer is plain python, so the judge does not depend on the toolkit's models in any way.

`FluentGoldJudge` (data/reviews/gold.json), the reviews task's gold: more positive *and* still fluent
English, as a person would judge. A bag-of-words sentiment judge alone rewards word salad ("quietly quietly hilarious, quiet and quiet"). A
person prefers a fluent positive sentence to positive word salad, so the gold adds fluency, measured by an
independent pretrained LM that no stage of the pipeline trained (SmolLM2-135M for the reviews task):

    fluency_nll(x, y) = -1/(T+1) * [ sum_{t=1..T} log p_LM(y_t | x, y_<t) + log p_LM(end | x, y) ]
    fluency_perplexity = exp(fluency_nll)

over the T response tokens and an end marker (`end_text`, e.g. a newline: a sentence cut off mid-way, or
an empty response, is not fluent text either). The gold score, in the sentiment judge's units (the
predicted mean human rating, -4 .. +4):

    gold = sentiment - fluency_weight * (fluency_nll - reference_nll)
                     - disfluency_weight * max(0, fluency_nll - disfluency_nll)

a penalty that is linear in fluency_nll with a steeper slope beyond disfluency_nll:

- reference_nll is the median fluency_nll of real human continuations, so a response as fluent as what
  people typically write scores its sentiment, and each nat per token of extra surprise costs
  `fluency_weight` rating points (fewer nats earn as much). That weight is the largest at which the gold
  still agrees with people about pairs of real sentences about as often as sentiment alone, so within
  English the fluency term does not overrule what people said. It is linear, not zero below some level:
  a repeated word ("a great great great great film") is predictable after its first repeat, so repeated
  text stays near human fluency, and the sentiment judge counts n-grams by presence, so a repeat earns
  nothing there; only the fluency slope lets the gold prefer the real sentence.
- disfluency_nll is the 95th percentile of fluency_nll over real human continuations: beyond it text is
  more surprising than nearly anything people write, i.e. it is not read as English, and each further nat
  costs `disfluency_weight` more. That weight is the smallest for which the gold prefers a real sentence
  to praise salad (its own words shuffled, with two of the sentiment judge's most positive words put in)
  as the calibration bar asks: a bag of praise words must not outscore a sentence.

`data/make_gold.py` measures the constants and stores them, the calibration grid and the validity
figures on held-out data in the judge's JSON (format `FLUENT_FORMAT`); `data/README.md` explains them.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from llm_rlhf.core.callables import resolve_callable
from llm_rlhf.core.errors import UserError
from llm_rlhf.models.loading import check_local_folder, freeze, load_causal_lm, load_tokenizer

FORMAT = "llm_rlhf.gold_judge/tfidf-ridge-v1"
TF_BINARY, TF_SUBLINEAR = "binary (presence)", "sublinear (1 + ln tf)"  # features.tf of the judge JSON


class Judge(Protocol):
    """Any callable (prompts, responses) -> one float per pair; higher = better."""

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]: ...


class GoldJudge:
    """Linear model on TF-IDF features of word n-grams; scores `prompt + response`.

    score(text) = intercept + sum_j coef_j * x_j, with
        tf_j = count of n-gram j in text          (n-grams of the lower-cased tokens of `token_pattern`)
        x_j  = f(tf_j) * idf_j / ||f(tf) * idf||_2      (l2 norm)
        f(tf) = 1 (binary: presence)  or  1 + ln tf (sublinear)
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
        binary: bool = False,
        info: dict[str, Any] | None = None,
    ):
        self.terms = terms  # n-gram -> (idf, coef)
        self.intercept = float(intercept)
        self.ngram_range = (int(ngram_range[0]), int(ngram_range[1]))
        self.token_pattern = re.compile(token_pattern)
        self.lowercase = lowercase
        self.binary = binary
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
            tf = features.get("tf", TF_SUBLINEAR)
            if tf not in (TF_BINARY, TF_SUBLINEAR):
                raise ValueError(f"features.tf must be '{TF_BINARY}' or '{TF_SUBLINEAR}', found {tf!r}")
            terms = {t: (float(v[0]), float(v[1])) for t, v in data["terms"].items()}
            return cls(
                terms=terms,
                intercept=data["intercept"],
                ngram_range=tuple(features["ngram_range"]),
                token_pattern=features["token_pattern"],
                lowercase=features["lowercase"],
                binary=tf == TF_BINARY,
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
                "tf": TF_BINARY if self.binary else TF_SUBLINEAR,
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
            weights = {  # f(tf) * idf
                g: (1.0 if self.binary else 1.0 + math.log(tf)) * self.terms[g][0] for g, tf in counts.items()
            }
            norm = math.sqrt(sum(w * w for w in weights.values()))
            dot = sum(w * self.terms[g][1] for g, w in weights.items())
            scores.append(self.intercept + (dot / norm if norm > 0 else 0.0))
        return scores

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return self.score_texts([p + r for p, r in zip(prompts, responses)])


JUDGE_FORMS = "a judge JSON file, 'module:function', 'module:Class', 'path/to/file.py:function' or 'none'"


def load_judge(spec: str) -> Judge | None:
    """Resolve `--gold_judge`: a judge JSON path, 'none' (-> None), or a callable resolved as a reward function
    is (`callables.resolve_callable`: 'module:function', 'module:Class', 'path/to/file.py:function')."""
    spec = spec.strip()
    if spec.lower() in ("none", "null", ""):
        return None
    if spec.lower().endswith(".json") or Path(spec).is_file():
        path = Path(spec)
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UserError(f"gold judge '{path}': not valid JSON ({e})") from None
            if isinstance(data, dict) and data.get("format") == FLUENT_FORMAT:
                return FluentGoldJudge.load(path, data)
        return GoldJudge.load(spec)
    return resolve_callable(spec, "gold_judge", JUDGE_FORMS)


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


def judge_details(
    judge: Callable[..., Any], prompts: list[str], responses: list[str]
) -> dict[str, list[float]]:
    """{"gold_score": one float per pair} plus the judge's parts when it reports them (a `details` method,
    like `FluentGoldJudge`'s: sentiment, fluency_nll, fluency_perplexity), each checked like `call_judge`.
    `llm-rlhf eval` and `llm-rlhf judge` both score through this."""
    details = getattr(judge, "details", None)
    if details is None:
        return {"gold_score": call_judge(judge, prompts, responses)}
    parts = details(list(prompts), list(responses))
    out = {}
    for key, values in parts.items():
        try:
            out[key] = [float(v) for v in values]
        except (TypeError, ValueError) as e:
            raise UserError(f"gold judge {judge!r}: '{key}': expected a list of numbers ({e})") from None
        if len(out[key]) != len(prompts) or not all(math.isfinite(v) for v in out[key]):
            raise UserError(f"gold judge {judge!r}: '{key}' is not one finite number per response")
    if "gold_score" not in out:
        raise UserError(f"gold judge {judge!r}: details() returned no 'gold_score'")
    return out


def judge_pairs(
    judge: Callable[..., Any], prompts: list[str], responses: list[str]
) -> dict[str, list[float]]:
    """`judge_details` of the rows, each distinct (prompt, response) judged once (in the order first seen) and
    its parts given to every row that holds it: one float per row under each key. Where the gold of a sample
    is judged, for `llm-rlhf eval`, PPO's held-out evaluation and `compare` (whose best-of-n draws the same
    response to a prompt more than once) alike (`measures.sample_and_score`); rows without a repeat make
    exactly `judge_details`' call."""
    pairs = list(dict.fromkeys(zip(prompts, responses)))  # distinct, in order
    parts = judge_details(judge, [p for p, _ in pairs], [r for _, r in pairs])
    index = {pair: i for i, pair in enumerate(pairs)}
    rows = [index[pair] for pair in zip(prompts, responses)]  # row -> its distinct pair
    return {key: [values[i] for i in rows] for key, values in parts.items()}


FLUENT_FORMAT = "llm_rlhf.gold_judge/sentiment-fluency-v1"


class FluencyLM:
    """Per-response mean negative log-likelihood under a frozen causal LM (float32, eval mode, no grad).

    prompt and response are tokenised separately (the prompt as the tokenizer does by default, so with
    its BOS if it adds one; the response and end marker without special tokens) and concatenated, so the
    response tokens are the same whatever the prompt. Rows are left-padded, positions count real tokens
    only, and the LM head runs on the last K positions only (K = the longest response + end)."""

    def __init__(
        self, model, tokenizer, *, end_text: str = "\n", batch_size: int = 32, max_length: int = 512
    ):
        self.model = freeze(model)
        self.tokenizer = tokenizer
        self.end_ids = tokenizer(end_text, add_special_tokens=False).input_ids if end_text else []
        self.batch_size = batch_size
        self.max_length = max_length

    @classmethod
    def load(cls, name_or_path: str, **kwargs) -> FluencyLM:
        check_local_folder(name_or_path, "fluency model")
        tokenizer = load_tokenizer(name_or_path)
        model = load_causal_lm(name_or_path, dtype="float32")
        return cls(model, tokenizer, **kwargs)

    def encode(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids + end ids), the prompt cut from the left to fit max_length."""
        target = self.tokenizer(response, add_special_tokens=False).input_ids + self.end_ids
        context = self.tokenizer(prompt).input_ids if prompt else []
        if not context:  # nothing to condition the first token on: start from BOS (or the end marker)
            bos = self.tokenizer.bos_token_id
            context = [bos] if bos is not None else self.end_ids[:1]
        target = target[: self.max_length - 1]
        context = context[-(self.max_length - len(target)) :]
        return context, target

    @torch.no_grad()
    def nll(self, prompts: list[str], responses: list[str]) -> list[float]:
        """fluency_nll of each (prompt, response); one float per pair, in input order."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        pairs = [self.encode(p, r) for p, r in zip(prompts, responses)]
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
        out = [0.0] * len(pairs)
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            seqs = [pairs[i][0] + pairs[i][1] for i in rows]
            width = max(len(s) for s in seqs)
            keep = max(len(pairs[i][1]) for i in rows) + 1  # logits for the last `keep` positions
            ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, W) left-padded
            mask = torch.zeros((len(rows), width), dtype=torch.bool)
            target_mask = torch.zeros((len(rows), width), dtype=torch.bool)  # True at response + end tokens
            for b, (i, seq) in enumerate(zip(rows, seqs)):
                ids[b, width - len(seq) :] = torch.tensor(seq)
                mask[b, width - len(seq) :] = True
                target_mask[b, width - len(pairs[i][1]) :] = True
            ids, mask, target_mask = ids.to(device), mask.to(device), target_mask.to(device)
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # real tokens count from 0
            logits = self.model(
                input_ids=ids, attention_mask=mask.long(), position_ids=positions, logits_to_keep=keep
            ).logits.float()  # (B, keep, V): positions W-keep .. W-1
            logprobs = torch.log_softmax(logits[:, :-1], dim=-1)  # position t predicts token t+1
            targets = ids[:, width - keep + 1 :]  # (B, keep-1)
            token_logp = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, keep-1)
            tmask = target_mask[:, width - keep + 1 :]
            per_row = (token_logp * tmask).sum(-1) / tmask.sum(-1).clamp(min=1)  # (B,)
            for b, i in enumerate(rows):
                out[i] = -float(per_row[b])
        return out


def gold_from_parts(
    *,
    sentiment: float,
    fluency_nll: float,
    fluency_weight: float,
    reference_nll: float,
    disfluency_weight: float = 0.0,
    disfluency_nll: float = math.inf,
) -> float:
    """The gold score of one response (module docstring):

    gold = sentiment - fluency_weight * (fluency_nll - reference_nll)
                     - disfluency_weight * max(0, fluency_nll - disfluency_nll)
    """
    excess = max(0.0, fluency_nll - disfluency_nll)
    return sentiment - fluency_weight * (fluency_nll - reference_nll) - disfluency_weight * excess


class FluentGoldJudge:
    """The gold for the reviews task: a sentiment judge's score less a penalty for disfluency (module doc).

    `details` returns every part per row (gold_score, sentiment, fluency_nll, fluency_perplexity), so the
    evaluation can report sentiment-only and fluency figures beside the gold from one call."""

    def __init__(
        self,
        *,
        sentiment,
        fluency: FluencyLM,
        fluency_weight: float,
        reference_nll: float,
        disfluency_weight: float = 0.0,
        disfluency_nll: float = math.inf,
        info: dict[str, Any] | None = None,
    ):
        self.sentiment = sentiment
        self.fluency = fluency
        self.constants = {
            "fluency_weight": float(fluency_weight),
            "reference_nll": float(reference_nll),
            "disfluency_weight": float(disfluency_weight),
            "disfluency_nll": float(disfluency_nll),
        }
        self.info = info or {}

    def details(self, prompts: list[str], responses: list[str]) -> dict[str, list[float]]:
        sentiment = [float(s) for s in self.sentiment(list(prompts), list(responses))]
        nll = self.fluency.nll(list(prompts), list(responses))
        gold = [gold_from_parts(sentiment=s, fluency_nll=n, **self.constants) for s, n in zip(sentiment, nll)]
        return {
            "gold_score": gold,
            "sentiment": sentiment,
            "fluency_nll": nll,
            "fluency_perplexity": [math.exp(n) for n in nll],
        }

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.details(prompts, responses)["gold_score"]

    @classmethod
    def load(cls, path: str | Path, data: dict[str, Any] | None = None) -> FluentGoldJudge:
        """Read a judge JSON of format `FLUENT_FORMAT`; its file paths are relative to the JSON's folder."""
        path = Path(path)
        if data is None:
            data = json.loads(path.read_text(encoding="utf-8"))
        try:
            sentiment_path = path.parent / data["sentiment_judge"]
            model = data["fluency_model"]
            local = path.parent / model
            fluency = FluencyLM.load(
                os.path.normpath(local) if local.is_dir() or not _looks_like_hub_name(model) else model,
                end_text=data.get("end_text", "\n"),
                batch_size=int(data.get("batch_size", 32)),
            )
            return cls(
                sentiment=GoldJudge.load(sentiment_path),
                fluency=fluency,
                fluency_weight=float(data["fluency_weight"]),
                reference_nll=float(data["reference_nll"]),
                disfluency_weight=float(data.get("disfluency_weight", 0.0)),
                disfluency_nll=float(data.get("disfluency_nll", math.inf)),
                info={k: v for k, v in data.items() if k != "format"},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"gold judge '{path}': malformed ({type(e).__name__}: {e})") from None


def _looks_like_hub_name(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))
