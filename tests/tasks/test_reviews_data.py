"""The committed "reviews" task data (data/reviews) and its base model: splits, pair rules, loading."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, load_script

DATA = ROOT / "data" / "reviews"
BASE_MODEL = DATA / "base_model"
PAIR_MIN_MARGIN = 1.0  # the rule in data/make_reviews.py and data/README.md
EOS = "<|endoftext|>"


def read(name: str) -> list[dict]:
    with (DATA / name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sentences() -> dict[str, dict[str, float | None]]:
    """Lower-cased movie sentences of each split -> mean rating (None where the split has no gold file)."""
    train = {r["text"].lower(): r["rating"] for r in read("gold_train.jsonl")}
    test = {r["text"].lower(): r["rating"] for r in read("gold_test.jsonl")}
    val = {(r["prompt"] + r["completion"]).lower(): None for r in read("sft_val.jsonl")}
    return {"train": train, "val": val, "test": test}


def test_schemas_and_sizes():
    keys = {
        "pretrain.jsonl": {"text"},
        "sft_train.jsonl": {"prompt", "completion"},
        "sft_val.jsonl": {"prompt", "completion"},
        "prefs_train.jsonl": {"prompt", "chosen", "rejected", "margin"},
        "prefs_val.jsonl": {"prompt", "chosen", "rejected", "margin"},
        "prefs_test.jsonl": {"prompt", "chosen", "rejected", "margin"},
        "rankings_train.jsonl": {"prompt", "ranked"},
        "ppo_prompts.jsonl": {"prompt"},
        "eval_prompts.jsonl": {"prompt"},
        "gold_train.jsonl": {"text", "rating", "ratings"},
        "gold_test.jsonl": {"text", "rating", "ratings"},
    }
    for name, expected in keys.items():
        rows = read(name)
        assert rows, name
        for i, row in enumerate(rows):
            assert set(row) == expected, f"{name} row {i}: {sorted(row)}"
    assert len(read("prefs_train.jsonl")) >= 3000
    assert len(read("prefs_test.jsonl")) >= 500
    assert 0 < len(read("eval_prompts.jsonl")) <= 256


def test_splits_are_disjoint(sentences):
    held_out = set(sentences["val"]) | set(sentences["test"])
    assert len(held_out) == len(sentences["val"]) + len(sentences["test"])  # val and test disjoint
    assert not held_out & set(sentences["train"])
    assert not held_out & {r["text"].lower() for r in read("pretrain.jsonl")}
    assert not held_out & {(r["prompt"] + r["completion"]).lower() for r in read("sft_train.jsonl")}
    for r in read("prefs_train.jsonl"):
        assert (r["prompt"] + r["chosen"]).lower() not in held_out
        assert (r["prompt"] + r["rejected"]).lower() not in held_out
    for r in read("rankings_train.jsonl"):
        assert not {(r["prompt"] + x).lower() for x in r["ranked"]} & held_out
    train_openings = {(r["prompt"]) for r in read("sft_train.jsonl")}
    assert {r["prompt"] for r in read("ppo_prompts.jsonl")} <= train_openings


def test_pretrain_holds_every_train_sentence(sentences):
    pretrain = {r["text"].lower() for r in read("pretrain.jsonl")}
    assert set(sentences["train"]) <= pretrain
    assert len(pretrain) > len(sentences["train"])  # plus the Amazon, NYT and tweet sentences


def test_sft_rows_reconstruct_real_sentences(sentences):
    gold_train = {r["text"] for r in read("gold_train.jsonl")}
    rows = read("sft_train.jsonl")
    assert len(rows) == len(gold_train)
    for r in rows:
        assert r["completion"].startswith(" ") and r["completion"].strip()
        assert 2 <= len(r["prompt"].split()) <= 4
        assert r["prompt"] + r["completion"] in gold_train  # exact, casing included


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_preference_pairs_follow_the_rule(sentences, split):
    real = sentences[split]
    for i, r in enumerate(read(f"prefs_{split}.jsonl")):
        chosen, rejected = (r["prompt"] + r["chosen"]).lower(), (r["prompt"] + r["rejected"]).lower()
        assert r["chosen"] != r["rejected"], i
        assert r["chosen"].startswith(" ") and r["rejected"].startswith(" "), i
        assert r["margin"] >= PAIR_MIN_MARGIN, i
        # both continuations are real sentences of this split (case-insensitive: a group's prompt takes
        # its most common casing, a few members open in another case)
        assert chosen in real and rejected in real, i
        if real[chosen] is not None:
            assert real[chosen] - real[rejected] == pytest.approx(r["margin"], abs=1e-3), i


def test_rankings_best_first_and_spaced(sentences):
    ratings = sentences["train"]
    rows = read("rankings_train.jsonl")
    assert rows
    for i, r in enumerate(rows):
        assert 3 <= len(r["ranked"]) <= 4, i
        scores = [ratings[(r["prompt"] + x).lower()] for x in r["ranked"]]
        assert all(a - b >= PAIR_MIN_MARGIN for a, b in zip(scores, scores[1:])), i
        assert len(set(r["ranked"])) == len(r["ranked"]), i


def test_prompts_unique_and_eval_prompts_unseen():
    ppo = [r["prompt"] for r in read("ppo_prompts.jsonl")]
    evals = [r["prompt"] for r in read("eval_prompts.jsonl")]
    assert len(set(ppo)) == len(ppo) and len(set(evals)) == len(evals)
    assert not {p.lower() for p in evals} & {p.lower() for p in ppo}
    test_texts = [r["text"] for r in read("gold_test.jsonl")]
    for p in evals:  # each one opens a test sentence
        assert any(t.startswith(p + " ") for t in test_texts), p


def test_gold_ratings_are_means_of_individual_ratings():
    for name in ("gold_train.jsonl", "gold_test.jsonl"):
        for i, r in enumerate(read(name)):
            assert len(r["ratings"]) >= 15 and all(-4 <= x <= 4 for x in r["ratings"]), (name, i)
            assert sum(r["ratings"]) / len(r["ratings"]) == pytest.approx(r["rating"], abs=1e-6), (name, i)


def test_data_matches_the_script(tmp_path, monkeypatch):
    """Committed files == a fresh run of data/make_reviews.py (needs the source files next to the repo)."""
    make_reviews = load_script(
        ROOT / "data" / "make_reviews.py", monkeypatch=monkeypatch
    )  # dataclasses need it
    if not make_reviews.DEFAULT_SOURCE.is_dir():
        pytest.skip(f"source data not found at {make_reviews.DEFAULT_SOURCE}")
    counts = make_reviews.build(make_reviews.DEFAULT_SOURCE, tmp_path)
    for name in (n for n in counts if n.endswith(".jsonl")):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_base_model_tokenizer_round_trips_and_has_no_pad():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BASE_MODEL)
    assert tok.eos_token == EOS and tok.bos_token == EOS
    assert tok.pad_token is None and tok.pad_token_id is None  # exactly like gpt2
    text = 'The film is a "gorgeous" mess... Jirí Hubac\'s script, 100% – 🙂 fun.'
    ids = tok(text)["input_ids"]
    assert tok.eos_token_id not in ids  # no bos/eos added when encoding
    assert tok.decode(ids) == text
    assert tok.decode(tok(text + EOS)["input_ids"]) == text + EOS
    assert tok(text + EOS)["input_ids"][-1] == tok.eos_token_id


def test_base_model_loads_from_safetensors():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (BASE_MODEL / "model.safetensors").is_file()
    assert not list(BASE_MODEL.glob("*.bin"))
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(BASE_MODEL)
    assert model.config.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    ids = tok("The film is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits  # (1, T, V)
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
