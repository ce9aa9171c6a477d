"""The fluency-aware gold: FluencyLM against a naive per-row computation, the gold formula, loading from
JSON (relative paths, the missing-model error), `judge_details`, and the `llm-rlhf judge` command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, build_model, write_jsonl

from llm_rlhf.core.errors import UserError
from llm_rlhf.models.gold import (
    FLUENT_FORMAT,
    FluencyLM,
    FluentGoldJudge,
    GoldJudge,
    gold_from_parts,
    judge_details,
    judge_pairs,
    load_judge,
)
from llm_rlhf.stages import evaluate

PROMPTS = ["The film is", "A", "", "This movie was so"]
RESPONSES = [" a quiet and funny story.", " good movie", " The acting is bad.", ""]


def naive_nll(model, tokenizer, prompt: str, response: str, end_text: str) -> float:
    """One row, no padding, full logits: -mean log p(response tokens + end | prompt)."""
    target = tokenizer(response, add_special_tokens=False).input_ids
    target += tokenizer(end_text, add_special_tokens=False).input_ids
    context = tokenizer(prompt).input_ids if prompt else [tokenizer.bos_token_id]
    ids = torch.tensor([context + target])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)  # (T, V)
    picked = [
        logprobs[len(context) - 1 + j, t] for j, t in enumerate(target)
    ]  # position t-1 predicts token t
    return -float(sum(picked) / len(picked))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fluency_nll_matches_naive_rows(kind, tiny_model_dir, tiny_llama_dir):
    folder = tiny_model_dir if kind == "gpt2" else tiny_llama_dir
    lm = FluencyLM.load(str(folder), end_text="\n", batch_size=3)
    got = lm.nll(PROMPTS, RESPONSES)
    expected = [naive_nll(lm.model, lm.tokenizer, p, r, "\n") for p, r in zip(PROMPTS, RESPONSES)]
    assert got == pytest.approx(expected, abs=1e-4)
    # batch make-up and order do not matter
    one_by_one = [lm.nll([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES)]
    assert one_by_one == pytest.approx(got, abs=1e-4)
    assert lm.nll(PROMPTS[::-1], RESPONSES[::-1]) == pytest.approx(got[::-1], abs=1e-4)
    # the end marker counts: without it the empty response has nothing to score (nll 0)
    lm_no_end = FluencyLM.load(str(folder), end_text="", batch_size=3)
    assert lm_no_end.nll(PROMPTS[3:], RESPONSES[3:]) == [0.0]
    assert got[3] > 0


def fluent_judge_file(tmp_path: Path, model_dir: Path, weight=2.0, reference_nll=5.0, **disfluency) -> Path:
    judges = tmp_path / "judges"
    judges.mkdir()
    (judges / "sentiment.json").write_text(
        json.dumps(GoldJudge(terms={"good": (1.0, 2.0), "bad": (2.0, -3.0)}, intercept=0.5).to_dict())
    )
    path = judges / "gold.json"
    path.write_text(
        json.dumps(
            {
                "format": FLUENT_FORMAT,
                "sentiment_judge": "sentiment.json",  # relative to the JSON's folder
                "fluency_model": str(Path("..") / model_dir.name),
                "end_text": "\n",
                "fluency_weight": weight,
                "reference_nll": reference_nll,
                **disfluency,
            }
        )
    )
    return path


def test_fluent_gold_formula_and_parts(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "lm"
    model_dir.symlink_to(tiny_model_dir, target_is_directory=True)
    judge = load_judge(str(fluent_judge_file(tmp_path, model_dir)))
    assert isinstance(judge, FluentGoldJudge)
    parts = judge_details(judge, PROMPTS, RESPONSES)
    assert set(parts) == {"gold_score", "sentiment", "fluency_nll", "fluency_perplexity"}
    sentiment = GoldJudge.load(tmp_path / "judges" / "sentiment.json")(PROMPTS, RESPONSES)
    assert parts["sentiment"] == pytest.approx(sentiment)
    for i in range(len(PROMPTS)):
        assert parts["gold_score"][i] == pytest.approx(sentiment[i] - 2.0 * (parts["fluency_nll"][i] - 5.0))
        assert parts["fluency_perplexity"][i] == pytest.approx(math.exp(parts["fluency_nll"][i]))
    assert judge(PROMPTS, RESPONSES) == parts["gold_score"]
    # the formula: more fluent (lower nll) or more positive is better; at reference_nll it is the sentiment
    assert gold_from_parts(sentiment=1.0, fluency_nll=5.0, fluency_weight=2.0, reference_nll=5.0) == 1.0
    assert gold_from_parts(sentiment=1.0, fluency_nll=6.0, fluency_weight=2.0, reference_nll=5.0) == -1.0
    assert gold_from_parts(sentiment=1.0, fluency_nll=4.5, fluency_weight=2.0, reference_nll=5.0) == 2.0
    # beyond disfluency_nll every nat costs disfluency_weight more; below it the linear form is untouched
    consts = {"fluency_weight": 2.0, "reference_nll": 5.0, "disfluency_weight": 3.0, "disfluency_nll": 6.0}
    assert gold_from_parts(sentiment=1.0, fluency_nll=5.5, **consts) == 0.0
    assert gold_from_parts(sentiment=1.0, fluency_nll=6.0, **consts) == -1.0
    assert gold_from_parts(sentiment=1.0, fluency_nll=7.0, **consts) == -3.0 - 3.0


def test_fluent_gold_disfluency_term_is_read_from_the_json(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "lm"
    model_dir.symlink_to(tiny_model_dir, target_is_directory=True)
    # a random tiny LM: every response is far beyond nll 1.0, so each row pays 4 per nat beyond it
    path = fluent_judge_file(tmp_path, model_dir, disfluency_weight=4.0, disfluency_nll=1.0)
    parts = judge_details(load_judge(str(path)), PROMPTS, RESPONSES)
    for s, n, g in zip(parts["sentiment"], parts["fluency_nll"], parts["gold_score"]):
        assert n > 1.0
        assert g == pytest.approx(s - 2.0 * (n - 5.0) - 4.0 * (n - 1.0))


def test_missing_fluency_model_names_the_build_command(tmp_path, tiny_model_dir):
    path = fluent_judge_file(tmp_path, tmp_path / "smollm2-135m-instruct")
    with pytest.raises(UserError) as e:
        load_judge(str(path))
    message = str(e.value)
    assert "no such folder" in message and "python data/make_smollm2.py" in message
    assert "\n" not in message


def test_judge_details_checks_what_a_judge_returns():
    def plain(prompts, responses):
        return [float(len(r)) for r in responses]

    assert judge_details(plain, ["a", "b"], ["xy", "z"]) == {"gold_score": [2.0, 1.0]}

    class Bad:
        def details(self, prompts, responses):
            return {"gold_score": [1.0] * len(prompts), "sentiment": [float("nan")] * len(prompts)}

    with pytest.raises(UserError, match="'sentiment' is not one finite number per response"):
        judge_details(Bad(), ["a"], ["b"])


def test_judge_pairs_judges_each_distinct_pair_once():
    """The one place a sample's gold is judged (eval, PPO's held-out evaluation, compare's best-of-n): each
    distinct (prompt, response) once, in the order first seen, every part given back to each row holding it;
    rows without a repeat make judge_details' own call."""
    calls = []

    class Judge:
        def details(self, prompts, responses):
            calls.append(list(zip(prompts, responses)))
            gold = [100.0 * len(p) + len(r) for p, r in zip(prompts, responses)]
            return {"gold_score": gold, "sentiment": [-g for g in gold]}

    parts = judge_pairs(Judge(), ["a", "bb", "a", "a"], ["xy", "xy", "xy", "z"])
    assert parts == {
        "gold_score": [102.0, 202.0, 102.0, 101.0],
        "sentiment": [-102.0, -202.0, -102.0, -101.0],
    }
    assert calls == [[("a", "xy"), ("bb", "xy"), ("a", "z")]]
    calls.clear()
    assert judge_pairs(Judge(), PROMPTS, RESPONSES) == judge_details(Judge(), PROMPTS, RESPONSES)
    assert calls[0] == calls[1] == list(zip(PROMPTS, RESPONSES))


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llm_rlhf", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_judge_command(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "lm"
    model_dir.symlink_to(tiny_model_dir, target_is_directory=True)
    gold = fluent_judge_file(tmp_path, model_dir)
    rows = [{"prompt": p, "response": r, "id": i} for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    done = run_cli(
        "judge", "--input_file", str(src), "--output_file", str(out), "--gold_judge", str(gold), cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    judged = [json.loads(line) for line in out.read_text().splitlines()]
    expected = judge_details(load_judge(str(gold)), PROMPTS, RESPONSES)  # the same call eval makes
    assert [r["id"] for r in judged] == [0, 1, 2, 3]  # input fields kept, in order
    for key in ("gold_score", "sentiment", "fluency_perplexity"):  # float32 in two processes: a perplexity of
        # ~400 can differ in its 7th digit (the sums' order follows the thread count), hence rel as well as abs
        assert [r[key] for r in judged] == pytest.approx(expected[key], rel=1e-6, abs=1e-5)

    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], {"prompt": "A", "response": None}])
    out2 = tmp_path / "out2.jsonl"
    done = run_cli(
        "judge", "--input_file", str(bad), "--output_file", str(out2), "--gold_judge", str(gold), cwd=ROOT
    )
    assert done.returncode == 2
    assert f"error: {bad}, row 2, field 'response': missing (or null)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out2.exists()


def test_eval_reports_the_gold_parts(tmp_path, tiny_model_dir, prompt_file):
    """`llm-rlhf eval` with the fluency-aware gold: sentiment_win_rate and the fluency perplexities beside
    gold_win_rate, each sample's parts equal to what `llm-rlhf judge` gives for its row."""
    model_dir = tmp_path / "lm"
    model_dir.symlink_to(tiny_model_dir, target_is_directory=True)
    gold = fluent_judge_file(tmp_path, model_dir)
    policy = build_model(tmp_path / "policy", "gpt2", seed=1)
    cfg = evaluate.Config(
        policy_path=str(policy),
        baseline_path=str(tiny_model_dir),
        reward_model_path="none",
        gold_judge=str(gold),
        prompt_file=str(prompt_file),
        num_prompts=8,
        max_new_tokens=6,
        batch_size=4,
        output_dir=str(tmp_path / "eval"),
    )
    metrics = evaluate.run(cfg)
    for key in ("gold_win_rate", "sentiment_win_rate", "fluency_perplexity", "fluency_perplexity_baseline"):
        assert metrics[key] is not None
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    judge = load_judge(str(gold))
    for who in ("policy", "baseline"):
        parts = judge_details(judge, [s["prompt"] for s in samples], [s[f"{who}_response"] for s in samples])
        assert [s[f"{who}_gold_score"] for s in samples] == pytest.approx(parts["gold_score"], abs=1e-5)
        assert [s[f"{who}_sentiment"] for s in samples] == pytest.approx(parts["sentiment"], abs=1e-9)
        suffix = "" if who == "policy" else "_baseline"
        geometric = math.exp(sum(parts["fluency_nll"]) / len(samples))
        assert metrics["fluency_perplexity" + suffix] == pytest.approx(geometric, rel=1e-5)
    wins = [
        1.0
        if s["policy_sentiment"] > s["baseline_sentiment"]
        else 0.5
        if s["policy_sentiment"] == s["baseline_sentiment"]
        else 0.0
        for s in samples
    ]
    assert metrics["sentiment_win_rate"] == pytest.approx(sum(wins) / len(wins))


@pytest.mark.slow
def test_gold_vs_policy_script(tmp_path, tiny_model_dir):
    """data/gold_vs_policy.py pairs each evaluation prompt with the real test sentence that opens with it
    and reports how often the gold, sentiment alone and fluency alone prefer the real continuation."""
    model_dir = tmp_path / "lm"
    model_dir.symlink_to(tiny_model_dir, target_is_directory=True)
    gold = fluent_judge_file(tmp_path, model_dir)
    test = write_jsonl(
        tmp_path / "test.jsonl",
        [
            {"text": "It was good and fun to watch", "rating": 1.0},
            {"text": "It was bad, bad, bad", "rating": -2.0},  # opening "It was" (under 6 words: 2 words)
            {
                "text": "It was good and never dull at all",
                "rating": 2.0,
            },  # same opening: the first one counts
        ],
    )
    samples = write_jsonl(
        tmp_path / "samples.jsonl",
        [
            {"prompt": "It was good", "policy_response": " good good good"},
            {"prompt": "It was", "policy_response": " good"},
        ],
    )
    done = subprocess.run(
        [sys.executable, "data/gold_vs_policy.py", str(samples), "--gold", str(gold), "--test", str(test)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    judge = load_judge(str(gold))
    real = judge_details(judge, ["It was good", "It was"], [" and fun to watch", " bad, bad, bad"])
    policy = judge_details(judge, ["It was good", "It was"], [" good good good", " good"])
    wins = [
        1.0 if r > p else 0.5 if r == p else 0.0 for r, p in zip(real["gold_score"], policy["gold_score"])
    ]
    assert got["rows"] == 2
    assert got["gold_prefers_real"] == pytest.approx(sum(wins) / 2, abs=1e-4)
    # sentiment counts "good" once: row 1 is a tie (one half), row 2's "bad" loses to "good"
    assert got["sentiment_prefers_real"] == 0.25
    # only "It was good and fun to watch" (rating 1.0) was rated positive: the subset is its row alone
    assert got["rows_positive_real"] == 1
    assert got["positive_real_gold_prefers_real"] == wins[0]
    assert got["positive_real_sentiment_prefers_real"] == 0.5
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"prompt": "Nobody wrote", "policy_response": " x"}])
    done = subprocess.run(
        [sys.executable, "data/gold_vs_policy.py", str(unknown), "--gold", str(gold), "--test", str(test)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "no gold_test opening" in done.stderr


def test_make_gold_salad_quantile_and_nll_cache(tmp_path):
    """The calibration pieces of data/make_gold.py: praise salad keeps the response's words and puts in
    PRAISE_INSERTED of the judge's most positive words; the quantile is numpy's linear one; the NLL cache
    asks the LM only for pairs it has not seen, and a new process reads what the last one wrote."""
    import random

    sys.path.insert(0, str(ROOT / "data"))
    import make_gold

    judge = GoldJudge(
        terms={"good": (1.0, 2.0), "great": (1.0, 3.0), "bad": (1.0, -3.0), "a b": (1.0, 9.0)}, intercept=0.0
    )
    assert make_gold.praise_words(judge, 2) == ["great", "good"]  # single words only, most positive first
    response = " the film is long"
    got = make_gold.salad(response, ["great", "good"], random.Random(0))
    assert got.startswith(" ") and sorted(got.split()) == sorted(response.split() + ["great", "good"])
    xs = [float(v) for v in (3, 1, 4, 1, 5, 9, 2, 6)]
    assert make_gold.quantile(xs, 0.95) == pytest.approx(float(torch.tensor(xs).quantile(0.95)))
    assert make_gold.quantile(xs, 0.5) == pytest.approx(3.5)

    calls = []

    class LM:
        def nll(self, prompts, responses):
            calls.append(list(zip(prompts, responses)))
            return [float(len(p) + len(r)) for p, r in zip(prompts, responses)]

    cache = tmp_path / "cache" / "nll.json"
    first = make_gold.CachedNLL(LM(), cache, "lm|'\\n'")
    assert first.nll(["a", "bb", "a"], [" x", " y", " x"]) == [3.0, 4.0, 3.0]
    assert calls == [[("a", " x"), ("bb", " y")]]  # each new pair once
    second = make_gold.CachedNLL(LM(), cache, "lm|'\\n'")
    assert second.nll(["bb", "c"], [" y", ""]) == [4.0, 1.0]
    assert calls[1:] == [[("c", "")]]
    other = make_gold.CachedNLL(LM(), cache, "other-lm|'\\n'")  # another model: nothing cached for it
    assert other.nll(["a"], [" x"]) == [3.0] and len(calls) == 3
    assert set(json.loads(cache.read_text())) == {"lm|'\\n'", "other-lm|'\\n'"}
