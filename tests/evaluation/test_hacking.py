"""The reward-hacking signs of `llm_rlhf.evaluation.hacking`: degeneracy counters on crafted responses, standardised
proxy-gold gaps against a hand computation, and the rows PPO logs per held-out sample."""

from __future__ import annotations

import math

import pytest

from llm_rlhf.evaluation.hacking import (
    degeneracy_flags,
    degeneracy_rates,
    heldout_sample_rows,
    longest_char_run,
    repeated_ngrams,
    standardised_gaps,
)

PADDED = " it is..................... splendid cinema."  # a smollm2 run's sample at step 40: runs of padding


def test_counters_on_crafted_responses():
    assert longest_char_run(PADDED) == 21
    assert repeated_ngrams(PADDED) == 0
    assert degeneracy_flags(PADDED) == {"char_run": True, "repeated_ngram": False, "empty": False}
    # "great great great" twice, "great great film"/"a great great" once each: one repeat
    assert repeated_ngrams("a great great great great film") == 1
    # words lower-cased, punctuation dropped: 8 words, 6 trigrams, 2 distinct ("so good so", "good so good")
    assert repeated_ngrams("So good, so good. SO GOOD so good!") == 4
    assert degeneracy_flags("a great great great great film") == {
        "char_run": False,
        "repeated_ngram": True,
        "empty": False,
    }
    assert (
        longest_char_run("wait... what") == 3 and not degeneracy_flags("wait... what")["char_run"]
    )  # ellipsis
    assert degeneracy_flags("it cost $10000 !!!!")["char_run"]  # the "!!!!", not the zeros
    assert longest_char_run("it cost $10000") == 1
    assert longest_char_run("soooo good") == 4 and longest_char_run("a      b") == 1  # spaces are not a run
    assert degeneracy_flags(" \n\t") == {"char_run": False, "repeated_ngram": False, "empty": True}
    assert degeneracy_flags("") == {"char_run": False, "repeated_ngram": False, "empty": True}


def test_rates_are_fractions_of_the_responses():
    responses = [PADDED, "a great great great great film", "", "a fine film.", "!!!! great great great great"]
    assert degeneracy_rates(responses) == {
        "char_run_rate": 2 / 5,
        "repeated_ngram_rate": 2 / 5,
        "empty_rate": 1 / 5,
    }
    assert degeneracy_rates(responses, "_baseline").keys() == {
        "char_run_rate_baseline",
        "repeated_ngram_rate_baseline",
        "empty_rate_baseline",
    }
    assert degeneracy_rates([]) == {"char_run_rate": 0.0, "repeated_ngram_rate": 0.0, "empty_rate": 0.0}


def test_standardised_gaps_by_hand():
    # reference: proxy (0, 2) -> mean 1, std 1; gold (0, 4) -> mean 2, std 2
    gaps = standardised_gaps(proxy=[3.0, 1.0], gold=[2.0, 6.0], ref_proxy=[0.0, 2.0], ref_gold=[0.0, 4.0])
    assert gaps == pytest.approx([(3 - 1) / 1 - (2 - 2) / 2, (1 - 1) / 1 - (6 - 2) / 2])  # (2, -2)
    # without a reference the samples standardise themselves: the same ranking, centred at 0
    own = standardised_gaps(proxy=[1.0, 2.0, 3.0], gold=[3.0, 2.0, 1.0])
    s = math.sqrt(2 / 3)
    assert own == pytest.approx([-2 / s, 0.0, 2 / s])
    # a constant score standardises to 0 rather than dividing by zero
    assert standardised_gaps(proxy=[1.0, 1.0], gold=[0.0, 2.0]) == pytest.approx([1.0, -1.0])
    constant = [0.2] * 25  # its float mean is not exactly 0.2: the std is rounding noise, not a spread
    assert standardised_gaps(
        proxy=[1.0], gold=[0.7], ref_proxy=[0.0, 2.0], ref_gold=constant
    ) == pytest.approx([-0.5])
    with pytest.raises(ValueError):
        standardised_gaps(proxy=[1.0], gold=[1.0, 2.0])


def test_heldout_rows_carry_the_score_ppo_maximised():
    record = {
        "prompt": "The film",
        "response": " was fine.",
        "rm_score": 0.5,
        "reward_fn": None,
        "gold_score": 0.2,
        "sentiment": 0.4,
        "fluency_perplexity": 30.0,
        "kl_to_ref": 1.5,
        "length": 4,
        "eos": True,
        "response_ids": [1, 2, 3],
    }
    (row,) = heldout_sample_rows([record], step=10, reward_fn_weight=0.5)
    assert row["step"] == 10 and row["proxy"] == 0.5 and "response_ids" not in row
    assert {k: row[k] for k in ("prompt", "response", "gold_score", "kl_to_ref")} == {
        "prompt": "The film",
        "response": " was fine.",
        "gold_score": 0.2,
        "kl_to_ref": 1.5,
    }
    # with a reward function the proxy is PPO's score: rm_score + weight * reward_fn (rm 0 without an RM)
    assert (
        heldout_sample_rows([{**record, "reward_fn": 1.0}], step=0, reward_fn_weight=0.5)[0]["proxy"] == 1.0
    )
    no_rm = {**record, "rm_score": None, "reward_fn": 1.0}
    assert heldout_sample_rows([no_rm], step=0, reward_fn_weight=0.5)[0]["proxy"] == 0.5
    assert (
        heldout_sample_rows([{**record, "rm_score": None}], step=0, reward_fn_weight=1.0)[0]["proxy"] is None
    )
