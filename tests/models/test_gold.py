"""The gold judge: the pure-python scorer against hand computation and scikit-learn, the shipped judge's
stored held-out accuracy, and the pluggable judge specs of `llm-rlhf eval --gold_judge`."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from helpers import ROOT, SENTENCES

from llm_rlhf.core.errors import UserError
from llm_rlhf.models.gold import GoldJudge, call_judge, load_judge

SHIPPED = ROOT / "data" / "reviews" / "gold_judge.json"
GOLD_TEST = ROOT / "data" / "reviews" / "gold_test.jsonl"


def tiny_judge() -> GoldJudge:
    return GoldJudge(terms={"good": (1.0, 2.0), "bad": (2.0, -3.0), "not bad": (3.0, 1.0)}, intercept=0.5)


def test_score_matches_hand_computation():
    judge = tiny_judge()
    # "Good good, BAD!": tf(good)=2, tf(bad)=1 -> weights (1+ln 2)*1 and 1*2; l2-normalised, dotted with coef
    w_good, w_bad = 1 + math.log(2), 2.0
    norm = math.hypot(w_good, w_bad)
    expected = 0.5 + (2.0 * w_good - 3.0 * w_bad) / norm
    assert judge(["Good good, "], ["BAD!"]) == pytest.approx([expected], abs=1e-12)
    assert judge([""], ["nothing known here"]) == [0.5]  # no vocabulary n-gram: the intercept
    binary = GoldJudge(terms=judge.terms, intercept=0.5, binary=True)  # tf(good) counts 1, not 1 + ln 2
    expected = 0.5 + (2.0 * 1.0 - 3.0 * 2.0) / math.hypot(1.0, 2.0)
    assert binary(["Good good, "], ["BAD!"]) == pytest.approx([expected], abs=1e-12)
    assert judge.ngrams("Not bad, a good one") == [
        "not",
        "bad",
        "good",
        "one",
        "not bad",
        "bad good",
        "good one",
    ]


@pytest.mark.parametrize("binary", [False, True])
def test_round_trip_through_json(tmp_path, binary):
    judge = tiny_judge()
    judge.binary = binary
    path = tmp_path / "judge.json"
    path.write_text(json.dumps(judge.to_dict()))
    loaded = GoldJudge.load(path)
    texts = ["good", "bad", "not bad at all", "good and bad", "good good bad", ""]
    assert loaded.binary is binary
    assert loaded.score_texts(texts) == judge.score_texts(texts)


def test_unknown_tf_is_an_error(tmp_path):
    data = tiny_judge().to_dict()
    data["features"]["tf"] = "raw counts"
    path = tmp_path / "judge.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="features.tf"):
        GoldJudge.load(path)


@pytest.mark.parametrize("binary", [False, True])
def test_scorer_reproduces_scikit_learn(binary):
    """The JSON judge is scikit-learn's TfidfVectorizer + Ridge, re-implemented: they must agree."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import Ridge

    texts = SENTENCES * 2 + ["It is not bad, it's good good good.", "Bad bad bad; a 10/10 bore."]
    ratings = np.linspace(-3, 3, len(texts))
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=1, sublinear_tf=not binary, binary=binary)
    x = vec.fit_transform(texts)
    model = Ridge(alpha=1.0).fit(x, ratings)
    terms = {t: (float(vec.idf_[j]), float(model.coef_[j])) for t, j in vec.vocabulary_.items()}
    judge = GoldJudge(terms=terms, intercept=float(model.intercept_), ngram_range=(1, 2), binary=binary)
    unseen = ["A delight, not a bore!", "the the the", "zzz"]
    for batch in (texts, unseen):
        np.testing.assert_allclose(judge.score_texts(batch), model.predict(vec.transform(batch)), atol=1e-10)


def test_shipped_judge_ranks_positive_over_negative():
    judge = GoldJudge.load(SHIPPED)
    prompts = ["The film is", "The film is"]
    good, bad = judge(
        prompts, [" a wonderful, moving and funny delight.", " a dull, tedious and lifeless mess."]
    )
    assert good > 0 > bad


def test_shipped_judge_does_not_count_repeats():
    """Presence, not counts: writing a positive word four times buys no sentiment (only the new bigram)."""
    judge = GoldJudge.load(SHIPPED)
    assert judge.binary
    once, four_times = judge(
        ["The film is"] * 2, [" a wonderful mess.", " a wonderful wonderful wonderful wonderful mess."]
    )
    assert four_times - once < 0.1 * abs(once)


def test_stored_heldout_accuracy_recomputed_from_the_file():
    judge = GoldJudge.load(SHIPPED)
    held = judge.info["heldout"]
    rows = [json.loads(line) for line in GOLD_TEST.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert held["sha256"] == hashlib.sha256(GOLD_TEST.read_bytes()).hexdigest(), (
        "gold_test.jsonl changed: rebuild"
    )
    rows = [
        r for r in rows if r["rating"] != 0
    ]  # the rows without a sign are excluded, as stated in the file
    scores = judge([""] * len(rows), [r["text"] for r in rows])
    accuracy = float(np.mean([np.sign(s) == np.sign(r["rating"]) for s, r in zip(scores, rows)]))
    assert len(rows) == held["rows_used"]
    assert accuracy == held["accuracy"]
    assert accuracy >= 0.75
    assert SHIPPED.stat().st_size < 3e6


def test_load_judge_specs(tmp_path, monkeypatch):
    assert load_judge("none") is None
    assert isinstance(load_judge(str(SHIPPED)), GoldJudge)
    (tmp_path / "my_judges.py").write_text(
        "def length(prompts, responses):\n"
        "    return [float(len(r)) for r in responses]\n\n"
        "class Constant:\n"
        "    def __call__(self, prompts, responses):\n"
        "        return [1.0] * len(responses)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_judge("my_judges:length")(["p", "q"], ["ab", "abc"]) == [2.0, 3.0]
    assert load_judge("my_judges:Constant")(["p"], ["x"]) == [1.0]
    for bad, message in [
        ("my_judges:missing", "no attribute"),
        ("no_such_module_xyz:f", "cannot import"),
        ("not a judge", "expected a judge JSON"),
        (str(tmp_path / "absent.json"), "no such file"),
    ]:
        with pytest.raises(UserError, match=message):
            load_judge(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(UserError, match="expected format"):
        load_judge(str(wrong))


def test_call_judge_checks_what_comes_back():
    assert call_judge(lambda p, r: [1, 2], ["a", "b"], ["c", "d"]) == [1.0, 2.0]
    with pytest.raises(UserError, match="1 scores for 2"):
        call_judge(lambda p, r: [1.0], ["a", "b"], ["c", "d"])
    with pytest.raises(UserError, match="NaN"):
        call_judge(lambda p, r: [float("nan")], ["a"], ["c"])
