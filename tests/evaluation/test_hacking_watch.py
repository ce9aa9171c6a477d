"""The reward-hacking alarm of `llm_rlhf.evaluation.hacking`: the collapse counters by hand and against
naive versions, the counter rule's exact test (by hand, against enumeration, its threshold scaling with the
responses and the rate), the counters on real review sentences, on a default run's collapse, on a terse correct
policy, a prompt-echoing one and a collapse from near the ceiling, the false alarms of seeded simulations, the
proxy-up / gold-down rule on constructed trajectories (fires on a hack, quiet on healthy, flat and noisy ones),
and the choice of the best held-out evaluation."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from helpers import ROOT

from llm_rlhf.evaluation.hacking import (
    COLLAPSE_KEYS,
    COUNTER_RULES,
    DEFAULT_RESPONSES,
    DEGENERACY_KEYS,
    PROXY_UP_GOLD_DOWN,
    RESPONSES,
    WATCH_KEYS,
    Z_PROXY,
    Z,
    best_evaluation,
    collapse_rates,
    counter_alarms,
    counter_threshold,
    degeneracy_rates,
    duplicate_rate,
    echo_rate,
    echoes,
    exceedance_p,
    most_shared_bigram,
    proxy_up_gold_down,
    top_response_share,
    trajectory_point,
    watch,
    watch_fields,
    word_bigrams,
)

DATA = ROOT / "data" / "reviews"
DEFAULT_RUN_COLLAPSE = [
    " a heart.",
    " is a heart.",
    " heart of a heart.",
]  # what a default run collapsed onto


def review_sentences() -> list[str]:
    """data/reviews/sft_val.jsonl's completions cut to 25 words: real text, about a held-out response long."""
    with (DATA / "sft_val.jsonl").open(encoding="utf-8") as f:
        return [" ".join(json.loads(line)["completion"].split(" ")[:25]) for line in f]


def positive_sentences() -> list[str]:
    """gold_test.jsonl's sentences rated above 1: what a healthy sentiment-tuned policy writes."""
    with (DATA / "gold_test.jsonl").open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [" " + " ".join(r["text"].split(" ")[:25]) for r in rows if r["rating"] > 1.0]


def counters(responses: list[str]) -> dict[str, float]:
    return {**collapse_rates(responses), **degeneracy_rates(responses)}


def point(step, proxy, gold, *, proxy_stderr=0.05, gold_stderr=0.05, **counters) -> dict:
    return {
        "step": step,
        "proxy": proxy,
        "proxy_stderr": proxy_stderr,
        "gold": gold,
        "gold_stderr": gold_stderr,
        **counters,
    }


# ---------------------------------------------------------------------------------------------
# Collapse counters
# ---------------------------------------------------------------------------------------------


def test_collapse_counters_by_hand():
    responses = [
        *DEFAULT_RUN_COLLAPSE,
        "  a   heart. ",
    ]  # the last is the first after whitespace normalisation
    # bigrams: (a heart) | (is a)(a heart) | (heart of)(of a)(a heart) | (a heart):
    # 7 in all, 4 distinct, "a heart" 4 times and in every response
    assert word_bigrams(" heart of a Heart.") == [("heart", "of"), ("of", "a"), ("a", "heart")]
    assert collapse_rates(responses) == {
        "duplicate_rate": 2 / 4,
        "top_bigram_share": 4 / 7,
        "shared_bigram_rate": 4 / 4,
        "word_distinct_2": 4 / 7,
        "top_response_share": 2 / 4,  # " a heart." twice, to two prompts
        "echo_rate": 0.0,  # no prompts' text
        RESPONSES: 4,
    }
    assert most_shared_bigram(responses) == ("a heart", [0, 1, 2, 3])
    # varied text: "the film" twice among 8 bigrams, in 2 of the 3 responses; no duplicate
    varied = ["The film is good", "the FILM was bad", "a good film"]
    assert collapse_rates(varied, suffix="_baseline") == {
        "duplicate_rate_baseline": 0.0,
        "top_bigram_share_baseline": 2 / 8,
        "shared_bigram_rate_baseline": 2 / 3,
        "word_distinct_2_baseline": 7 / 8,
        "top_response_share_baseline": 0.0,
        "echo_rate_baseline": 0.0,
        RESPONSES + "_baseline": 3,
    }
    # the most frequent bigram and the one most responses share can differ: "so so" 3 times in one response
    assert collapse_rates(["so so so so", "a film", "a film here"])["top_bigram_share"] == 3 / 6
    assert collapse_rates(["so so so so", "a film", "a film here"])["shared_bigram_rate"] == 2 / 3
    assert most_shared_bigram(["so so so so", "a film", "a film here"]) == ("a film", [1, 2])
    # no bigram anywhere (one-word and empty responses), no responses
    no_bigram = {
        "duplicate_rate": 2 / 3,
        "top_bigram_share": 0.0,
        "shared_bigram_rate": 0.0,
        "word_distinct_2": 0.0,
        "top_response_share": 2 / 3,
        "echo_rate": 0.0,
        RESPONSES: 3,
    }
    assert collapse_rates(["wow", "", "wow"]) == no_bigram
    assert collapse_rates([]) == {**dict.fromkeys(COLLAPSE_KEYS, 0.0), RESPONSES: 0}
    assert most_shared_bigram(["wow"]) == (None, [])


def test_duplicates_count_only_across_prompts():
    # two samples of one prompt agreeing on its answer are not collapse; the same text for two prompts is
    assert duplicate_rate(["12", "12", "7", "7"], prompts=["p", "p", "q", "r"]) == 2 / 4
    assert duplicate_rate(["12", "12", "7", "7"]) == 4 / 4  # no prompts: each response its own prompt's
    assert duplicate_rate([" a heart.", "a heart.\n", "A heart."]) == 2 / 3  # whitespace only, not case
    assert duplicate_rate([]) == 0.0
    with pytest.raises(ValueError):
        duplicate_rate(["a", "b"], prompts=["p"])


def test_duplicate_counters_match_their_naive_forms():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        responses = [
            rng.choice(["a heart.", " a heart.", "a  heart.", "good", "good film", ""]) for _ in range(n)
        ]
        prompts = [rng.choice("pqr") for _ in range(n)]
        correct = [rng.choice([1.0, 0.0, None]) for _ in range(n)]
        norm = [" ".join(r.split()) for r in responses]
        repeated = [any(norm[i] == norm[j] and prompts[i] != prompts[j] for j in range(n)) for i in range(n)]
        assert duplicate_rate(responses, prompts=prompts) == sum(repeated) / n
        counted = [repeated[i] and not correct[i] for i in range(n)]
        assert duplicate_rate(responses, prompts=prompts, correct=correct) == sum(counted) / n
        to_several = {t for t in norm if len({prompts[i] for i in range(n) if norm[i] == t}) > 1}
        naive_top = (
            max((sum(norm[i] == t and not correct[i] for i in range(n)) for t in to_several), default=0) / n
        )
        assert top_response_share(responses, prompts=prompts, correct=correct) == naive_top
    with pytest.raises(ValueError):
        duplicate_rate(["a", "b"], correct=[1.0])


def test_echo_is_copying_the_prompt_not_naming_its_numbers():
    prompt = "What is 23 + 41? Answer with just the number."
    assert echoes(prompt, prompt) and echoes("what is 23 + 41", prompt)  # 2 of 2 word 3-grams
    assert not echoes("23 + 41 = 64", prompt)  # (23 41 64) is not the prompt's
    assert not echoes("64", prompt) and not echoes("", prompt)  # no 3-gram: no copy
    assert not echoes("What is 23 + 41? It is 64", prompt)  # 2 of its 5 3-grams in the prompt: under half
    assert echoes("What is 23 + 41? 64", prompt)  # 2 of 3
    assert echo_rate([prompt, "64", "The answer is 64."], prompts=[prompt] * 3) == 1 / 3
    assert echo_rate([prompt], prompts=None) == 0.0  # without the prompts' text: says nothing


# ---------------------------------------------------------------------------------------------
# Counter rule: thresholds against the baseline
# ---------------------------------------------------------------------------------------------


def hypergeometric_tail_by_enumeration(x, n, x_base, n_base):
    """P(policy count >= x) over every way to split the K = x + x_base tripped responses of n + n_base between
    the two sides, each equally likely (Fisher's conditioning), counted one labelled arrangement at a time."""
    people = range(n + n_base)  # 0 .. n-1 the policy's responses
    splits = list(itertools.combinations(people, x + x_base))
    return sum(sum(i < n for i in tripped) >= x for tripped in splits) / len(splits)


def test_exceedance_p_by_hand_and_by_enumeration():
    # 3 of 3 against 0 of 3: all three tripped responses on the policy's side, 1 of C(6, 3) = 20 splits
    assert exceedance_p(x=3, n=3, x_base=0, n_base=3) == 1 / 20
    assert exceedance_p(x=0, n=5, x_base=2, n_base=4) == 1.0  # nothing tripped on the policy's side: no news
    for x, n, x_base, n_base in [(2, 4, 1, 5), (4, 6, 0, 3), (3, 5, 3, 5), (5, 5, 4, 6), (1, 7, 0, 2)]:
        naive = hypergeometric_tail_by_enumeration(x, n, x_base, n_base)
        assert exceedance_p(x=x, n=n, x_base=x_base, n_base=n_base) == pytest.approx(naive, rel=1e-12)


def test_counter_threshold_scales_with_the_responses_and_the_rate():
    """Where a counter fires against its baseline: nearer with more responses, farther at a rate of 0.3 than
    of 0.05 (binomial noise grows with p(1 - p)); near the ceiling, nowhere at 32 responses (6 of 32 below
    1.0 cannot tell), at 1.0 with 76, below it with 256. The old rule fired at +0.25 everywhere."""
    at = lambda base, n: counter_threshold(base, kind="above", n=n, n_base=n)  # noqa: E731
    assert at(0.3, 32) > at(0.3, 76) > at(0.3, 256) and at(0.05, 76) < at(0.3, 76)
    assert at(0.3, 32) - 0.3 > 0.5 and at(0.3, 256) - 0.3 < 0.25
    assert at(0.8, 32) is None and at(0.8, 76) == 1.0 and at(0.8, 256) < 1.0
    # "below" (word distinct-2) is the same test on the repeated share, 1 - value
    below = counter_threshold(0.9, kind="below", n=76, n_base=76)
    assert below == pytest.approx(1.0 - at(0.1, 76))
    # the rule fires exactly from the threshold on, over the responses it is told (or DEFAULT_RESPONSES)
    for base, n in ((0.0, 32), (0.3, 32), (0.3, 76), (0.8, 76)):
        edge = round(at(base, n) * n)
        baseline = {"duplicate_rate": base, RESPONSES: n}
        assert counter_alarms({"duplicate_rate": edge / n, RESPONSES: n}, baseline=baseline) != {}
        assert counter_alarms({"duplicate_rate": (edge - 1) / n, RESPONSES: n}, baseline=baseline) == {}
    unsized = counter_alarms({"duplicate_rate": at(0.3, 32)}, baseline={"duplicate_rate": 0.3})
    assert DEFAULT_RESPONSES == 32 and unsized != {}


def test_counter_alarms_read_each_side():
    baseline = {"duplicate_rate": 0.0, "word_distinct_2": 0.9, "empty_rate": 0.5, RESPONSES: 32}
    # relative to the baseline: 0.9 empty is an alarm against 0.25, not against 0.5
    assert counter_alarms({"empty_rate": 0.9, RESPONSES: 32}, baseline=baseline) == {}
    quarter = {"empty_rate": 0.25, RESPONSES: 32}
    assert counter_alarms({"empty_rate": 0.9, RESPONSES: 32}, baseline=quarter).keys() == {"empty_rate"}
    # word distinct-2 falls; at 0.0 (no response has two words) it is undefined and says nothing
    assert counter_alarms({"word_distinct_2": 0.2}, baseline=baseline).keys() == {"word_distinct_2"}
    assert counter_alarms({"word_distinct_2": 0.0}, baseline=baseline) == {}
    assert counter_alarms({"word_distinct_2": 0.2}, baseline={"word_distinct_2": 0.0}) == {}
    # a counter missing or None on either side is skipped
    assert counter_alarms({"shared_bigram_rate": 1.0}, baseline=baseline) == {}
    assert counter_alarms({"duplicate_rate": None}, baseline=baseline) == {}
    line = counter_alarms({"duplicate_rate": 0.5}, baseline=baseline)["duplicate_rate"]
    assert "0.500 > baseline 0.000" in line and "(32 and 32 responses)" in line


def test_every_counter_has_a_rule():
    # the alarm reads every counter an evaluation computes, under the names the rates functions return
    assert set(COUNTER_RULES) == set(COLLAPSE_KEYS) | set(DEGENERACY_KEYS)
    assert set(collapse_rates(["a b"])) | set(degeneracy_rates(["a b"])) == {*COUNTER_RULES, RESPONSES}


def test_alarm_fires_on_the_default_runs_collapse():
    real = review_sentences()
    baseline = counters(real[:32])  # the SFT model's step-0 evaluation: varied reviews
    collapsed = [DEFAULT_RUN_COLLAPSE[i % 3] for i in range(32)]
    points = [
        point(0, 0.0, 0.0, **baseline),
        point(10, 0.5, 0.1, **counters(real[32:64])),
        point(20, 1.0, 0.1, **counters(collapsed)),
    ]
    alarm = watch(points, baseline=baseline)
    assert alarm is not None and (alarm["index"], alarm["step"]) == (2, 20)
    assert alarm["rules"] == ["duplicate_rate", "top_bigram_share", "shared_bigram_rate", "word_distinct_2"]
    assert all(reason.startswith("step 20: ") for reason in alarm["reasons"])
    assert most_shared_bigram(collapsed) == ("a heart", list(range(32)))


def test_alarm_fires_on_near_duplicates_no_response_repeats():
    # " <word> of a heart." with 32 different words: no exact duplicate, one phrase everywhere
    words = sorted({w for s in review_sentences()[:200] for w in s.lower().split() if w.isalpha()})[:32]
    near = [f" {w} of a heart." for w in words]
    assert len(set(near)) == 32 and duplicate_rate(near) == 0.0
    baseline = counters(review_sentences()[:32])
    alarm = watch([point(0, 0.0, 0.0, **baseline), point(10, 1.0, 0.0, **counters(near))], baseline=baseline)
    assert alarm is not None and alarm["step"] == 10
    assert "duplicate_rate" not in alarm["rules"] and "shared_bigram_rate" in alarm["rules"]


def test_counters_stay_quiet_on_real_reviews():
    """Every disjoint 32 real sentences against the first 32, and every 32 positive ones (a healthy policy
    that learnt to praise): no counter crosses its threshold."""
    real, positive = review_sentences(), positive_sentences()
    baseline = counters(real[:32])
    chunks = [real[i : i + 32] for i in range(32, len(real) - 31, 32)]
    chunks += [positive[i : i + 32] for i in range(0, len(positive) - 31, 32)]
    assert len(chunks) > 40
    for chunk in chunks:
        assert counter_alarms(counters(chunk), baseline=baseline) == {}, chunk
    points = [point(10 * k, 0.1 * k, 0.05 * k, **counters(c)) for k, c in enumerate([real[:32], *chunks])]
    assert watch(points, baseline=baseline) is None


# --- the counter rule where it once erred: quiet with nothing wrong, firing with something wrong ---------
# Each case runs through the real counters (`collapse_rates`, `degeneracy_rates`) and `watch`;
# data/hacking_thresholds.py measures the same at scale.


def arithmetic(rng: random.Random, n: int) -> list[tuple[str, int]]:
    """n problems as the arithmetic task asks them, and their answers."""
    pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(n)]
    return [(f"What is {a} + {b}? Answer with just the number.", a + b) for a, b in pairs]


def evaluation(step: int, prompts: list[str], responses: list[str], correct: list | None = None) -> dict:
    """A held-out evaluation as `watch` reads it: the counters (and num_responses), no gold."""
    rates = collapse_rates(responses, prompts=prompts, correct=correct)
    return {"step": step, "gold": None, **rates, **degeneracy_rates(responses)}


def test_a_correct_terse_verifier_policy_stays_quiet():
    """76 problems answered with just the number, all correct: answers repeat (sums of 1..20 take 39 values),
    and no response has two words. Rules on the raw counters would fire duplicate_rate (the repeats) and
    word_distinct_2 (0.0 read as a collapse) against the instruct model's sentences; here repeats of verified
    answers are not counted and an undefined distinct-2 says nothing."""
    rng = random.Random(0)
    problems = arithmetic(rng, 76)
    prompts = [p for p, _ in problems]
    wordy = [f"The sum is {t}, since adding the two numbers gives {t}." for _, t in problems]
    terse = [str(t) for _, t in problems]
    correct = [1.0] * 76
    baseline = evaluation(0, prompts, wordy, [1.0 if rng.random() < 0.5 else 0.0 for _ in problems])
    policy = evaluation(10, prompts, terse, correct)
    unverified = collapse_rates(terse, prompts=prompts)
    assert (
        unverified["duplicate_rate"] > 0.5 and unverified["word_distinct_2"] == 0.0
    )  # the raw counters' reading
    assert policy["duplicate_rate"] == 0.0 and policy["top_response_share"] == 0.0
    assert counter_alarms(policy, baseline=baseline) == {}
    assert watch([baseline, *[{**policy, "step": 10 * k} for k in range(1, 30)]], baseline=baseline) is None


def test_a_prompt_echoing_policy_fires():
    """Half of the responses copy their prompt back (a case no other counter sees): echo_rate
    fires at the first evaluation it shows; answers naming the prompt's numbers ("7 + 5 = 12") do not."""
    rng = random.Random(1)
    problems = arithmetic(rng, 32)
    prompts = [p for p, _ in problems]
    worked = [f"{p.split()[2]} + {p.split()[4].rstrip('?')} = {t}" for p, t in problems]
    baseline = evaluation(0, prompts, worked)
    echo = [p if i % 2 else w for i, (p, w) in enumerate(zip(prompts, worked))]
    points = [baseline, evaluation(10, prompts, worked), evaluation(20, prompts, echo)]
    assert points[1]["echo_rate"] == 0.0 and points[2]["echo_rate"] == 0.5
    alarm = watch(points, baseline=baseline)
    assert alarm is not None and alarm["step"] == 20 and "echo_rate" in alarm["rules"]


def test_a_collapse_from_near_the_ceiling_fires():
    """A terse policy without a verifier repeats itself from step 0 (duplicate_rate near its ceiling: a fixed
    +0.25 margin could not be crossed). Collapsing onto one answer fires top_response_share (the largest share
    of one response given to several prompts) at 32 and 76 prompts; duplicate_rate itself, judged on the
    headroom left, fires from a baseline of 0.79 at 76 prompts (16 responses below the ceiling), not at 32 (7:
    too few to tell from chance, data/hacking_thresholds.py)."""
    rng = random.Random(2)
    for n in (32, 76):
        problems = arithmetic(random.Random(n), n)
        prompts = [p for p, _ in problems]
        terse = [str(rng.choice([t, 20, 21, 22])) for _, t in problems]  # the step-0 model: mostly guesses
        baseline = evaluation(0, prompts, terse)
        assert baseline["duplicate_rate"] > 0.75  # no room for a fixed margin of +0.25
        alarm = watch([baseline, evaluation(10, prompts, ["21"] * n)], baseline=baseline)
        assert alarm is not None and alarm["step"] == 10 and "top_response_share" in alarm["rules"], alarm
    ceiling = {"duplicate_rate": 60 / 76, RESPONSES: 76}
    assert counter_alarms({"duplicate_rate": 1.0, RESPONSES: 76}, baseline=ceiling).keys() == {
        "duplicate_rate"
    }
    assert counter_alarms({"duplicate_rate": 1.0, RESPONSES: 32}, baseline={**ceiling, RESPONSES: 32}) == {}


def test_counter_false_alarms_of_a_seeded_simulation_stay_under_the_bound():
    """Nothing changes: every counter an independent binomial count of 32 responses at a rate of 0.3, step 0
    included, 20 evaluations (a fixed +0.25 margin would fire in 21% of such runs with one counter, about
    90% with all nine). Through `watch`: at most 5% of 200 seeded runs alarm."""
    rng = random.Random(3)
    n, runs = 32, 200

    def draw(step: int) -> dict:
        return {
            "step": step,
            RESPONSES: n,
            **{k: sum(rng.random() < 0.3 for _ in range(n)) / n for k in COUNTER_RULES},
        }

    alarms = 0
    for _ in range(runs):
        points = [draw(step) for step in range(20)]
        alarms += watch(points, baseline=points[0]) is not None
    assert alarms <= 0.05 * runs


# ---------------------------------------------------------------------------------------------
# Proxy-up / gold-down rule
# ---------------------------------------------------------------------------------------------

HACKED = [  # proxy keeps rising; gold peaks at step 20 then falls (se 0.03 each: a drop of 0.19+ is Z se)
    point(0, 0.0, 0.00, gold_stderr=0.03),
    point(10, 0.5, 0.30, gold_stderr=0.03),
    point(20, 1.0, 0.50, gold_stderr=0.03),
    point(30, 1.5, 0.35, gold_stderr=0.03),
    point(40, 2.0, 0.20, gold_stderr=0.03),
    point(50, 2.5, 0.10, gold_stderr=0.03),
]


def test_alarm_fires_on_proxy_up_gold_down():
    alarm = watch(HACKED, baseline=None)
    # evaluation 3's fall (0.15, 3.5 se) is inside Z = 4.41; 4's (0.30, 7.1 se) is not; two in a row: 5
    assert alarm is not None and (alarm["index"], alarm["step"]) == (5, 50)
    assert alarm["rules"] == [PROXY_UP_GOLD_DOWN]
    assert proxy_up_gold_down(HACKED, index=3) is None and proxy_up_gold_down(HACKED, index=4) is not None
    assert "best 0.5 at step 20" in alarm["reasons"][0]
    assert watch(HACKED, baseline=None, k_evals=1)["index"] == 4
    assert watch(HACKED, baseline=None, z=3.0, k_evals=1)["index"] == 3  # z = 3: an earlier alarm
    # where it fires does not move as evaluations are added (what a run sees, one evaluation at a time)
    assert [watch(HACKED[:k], baseline=None) for k in range(1, 6)] == [None] * 5
    assert watch(HACKED, baseline=None) == alarm


def test_proxy_up_gold_down_needs_each_difference_beyond_z_se():
    se_diff = 0.05 * 2**0.5  # two evaluations of se 0.05

    def pair(gold_drop, proxy_rise):
        return [point(0, 0.0, 1.0), point(10, proxy_rise, 1.0 - gold_drop)]

    assert Z == pytest.approx(4.415, abs=1e-3) and Z_PROXY == 2.0  # Bonferroni: 0.025 over 4950 pairs
    assert proxy_up_gold_down(pair((Z + 0.01) * se_diff, 1.0), index=1) is not None
    assert proxy_up_gold_down(pair((Z - 0.01) * se_diff, 1.0), index=1) is None  # gold drop inside the noise
    assert proxy_up_gold_down(pair(1.0, 2.01 * se_diff), index=1) is not None
    assert proxy_up_gold_down(pair(1.0, 1.99 * se_diff), index=1) is None  # proxy rise inside the noise
    assert proxy_up_gold_down(pair(1.0, -1.0), index=1) is None  # both fell: worse, not hacked
    assert proxy_up_gold_down(pair(2.99 * se_diff, 1.0), index=1, z=2.0) is not None
    # without standard errors (an older eval_log) the rule cannot tell a fall from noise: it does not fire
    no_se = [{**p, "gold_stderr": None} for p in HACKED]
    assert proxy_up_gold_down(no_se, index=3) is None and watch(no_se, baseline=None) is None
    # an evaluation without a gold is skipped, not a reason to stay quiet; one without a gold never fires
    gap = [HACKED[0], point(5, 0.2, None), *HACKED[1:]]
    assert watch(gap, baseline=None)["step"] == 50 and proxy_up_gold_down(gap, index=1) is None


def test_alarm_quiet_on_healthy_and_flat_trajectories():
    baseline = dict.fromkeys(COLLAPSE_KEYS, 0.1) | {"word_distinct_2": 0.9}
    healthy = [point(10 * i, 0.5 * i, 0.1 * i, **baseline) for i in range(11)]  # both rise, counters as SFT's
    assert watch(healthy, baseline=baseline) is None
    flat = [point(10 * i, 0.0, 0.0) for i in range(11)]
    assert watch(flat, baseline=baseline) is None
    # a zigzag gold, 2.9 se of a difference apart at every other evaluation, while the proxy keeps rising
    se_diff = 0.05 * 2**0.5
    zigzag = [point(10 * i, 0.5 * i, 0.0 if i % 2 == 0 else -2.9 * se_diff) for i in range(11)]
    assert watch(zigzag, baseline=None) is None
    # the gold falls without the proxy rising (a policy getting worse at everything): not this rule
    worse = [point(10 * i, -0.5 * i, -0.5 * i) for i in range(11)]
    assert watch(worse, baseline=None) is None


def test_gold_rule_false_alarms_over_a_long_run():
    """Independent normal noise of one standard error on every figure, gold flat, proxy rising 4 se per
    evaluation, 101 evaluations: against the best gold so far, Z = 3 (two in a row) fires in 16-18%
    of such runs (data/hacking_thresholds.py); Z = 4.41 (Bonferroni over the run's pairs) in about
    0.1%. Here at most 2% of 150 seeded runs, where Z = 3 trips more than 8%."""
    rng = random.Random(1)

    def run():
        return [point(10 * i, 0.2 * i + rng.gauss(0, 0.05), rng.gauss(0, 0.05)) for i in range(101)]

    runs = [run() for _ in range(150)]
    assert sum(watch(r, baseline=None) is not None for r in runs) <= 3
    assert sum(watch(r, baseline=None, z=3.0) is not None for r in runs) > 12  # z = 3 trips on them


# ---------------------------------------------------------------------------------------------
# eval_log lines, the best evaluation
# ---------------------------------------------------------------------------------------------


def test_trajectory_point_reads_eval_log_lines():
    line = {
        "step": 10,
        "kl": 3.0,
        "rm_score": 0.5,
        "reward_fn": 1.0,
        "gold_score": 0.2,
        "gold_score_stderr": 0.04,
        "accuracy": None,
        "accuracy_stderr": None,
        "duplicate_rate": 0.1,
        "empty_rate": None,
        "eos_rate": 1.0,
    }
    p = trajectory_point(line, reward_fn_weight=0.5)
    assert p == {
        "step": 10,
        "proxy": 0.5 + 0.5 * 1.0,
        "proxy_stderr": None,
        "gold": 0.2,
        "gold_stderr": 0.04,
        "duplicate_rate": 0.1,
    }
    # a logged proxy (and its stderr) wins; no RM: the reward function alone; neither: None
    logged = trajectory_point({**line, "proxy": 2.0, "proxy_stderr": 0.1}, reward_fn_weight=0.5)
    assert (logged["proxy"], logged["proxy_stderr"]) == (2.0, 0.1)
    assert trajectory_point({**line, "rm_score": None}, reward_fn_weight=0.5)["proxy"] == 0.5
    assert trajectory_point({**line, "reward_fn": None}, reward_fn_weight=0.5)["proxy"] == 0.5
    # with a verifier the gold is its accuracy
    verified = trajectory_point({**line, "accuracy": 0.75, "accuracy_stderr": 0.02}, reward_fn_weight=0.5)
    assert (verified["gold"], verified["gold_stderr"]) == (0.75, 0.02)


def test_best_evaluation_by_gold_or_accuracy():
    golds = [0.1, 0.5, None, 0.5, 0.3]
    assert best_evaluation([point(10 * i, 0.0, g) for i, g in enumerate(golds)]) == 1  # the earliest of ties
    assert best_evaluation(HACKED) == 2
    assert best_evaluation([point(0, 0.0, None)]) is None and best_evaluation([]) is None
    lines = [
        {"step": s, "rm_score": 0.0, "reward_fn": None, "gold_score": g, "accuracy": a}
        for s, g, a in ((0, 0.9, 0.2), (10, 0.1, 0.6), (20, 0.5, 0.4))
    ]
    assert best_evaluation([trajectory_point(x, reward_fn_weight=1.0) for x in lines]) == 1  # by accuracy


def test_watch_fields_for_the_eval_log():
    """The fields a run adds to each eval_log.jsonl line: the alarm so far (step-0 line = the baseline's
    counters) and the best step by the gold."""
    real = review_sentences()
    healthy, collapsed = counters(real[:32]), counters([DEFAULT_RUN_COLLAPSE[i % 3] for i in range(32)])

    def line(step, gold, texts_counters):
        scores = {"rm_score": step / 10, "reward_fn": None, "gold_score": gold, "accuracy": None}
        return {"step": step, **scores, "gold_score_stderr": 0.01, "proxy_stderr": 0.01, **texts_counters}

    log = [line(0, 0.0, healthy), line(10, 0.3, counters(real[32:64])), line(20, 0.2, collapsed)]
    assert watch_fields(log[:2], reward_fn_weight=1.0) == {
        "alarm_step": None,
        "alarm_rules": [],
        "alarm_reasons": [],
        "best_step": 10,
    }
    fields = watch_fields(log, reward_fn_weight=1.0)
    assert fields["alarm_step"] == 20 and fields["best_step"] == 10
    assert fields["alarm_rules"] == [
        "duplicate_rate",
        "top_bigram_share",
        "shared_bigram_rate",
        "word_distinct_2",
    ]
    assert len(fields["alarm_reasons"]) == 4 and set(fields) == set(WATCH_KEYS)
    # no step-0 line (the run's first evaluation came later): no baseline, so no counter rule
    assert watch_fields(log[1:], reward_fn_weight=1.0)["alarm_step"] is None
