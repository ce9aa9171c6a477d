"""The alarm's errors of issue 52 (`llm_rlhf.evaluation.hacking`): where issue 40's alarm fired with nothing wrong (a correct
terse arithmetic policy; binomial noise at a rate of 0.3 on 32 prompts) and where it was quiet with something
wrong (a policy that copies its prompt; a collapse from a counter already near its ceiling). Each case runs
through the real counters (`collapse_rates`, `degeneracy_rates`) and `watch`; data/hacking_thresholds.py
measures the same at scale."""

from __future__ import annotations

import random

from llm_rlhf.evaluation.hacking import (
    COUNTER_RULES,
    RESPONSES,
    collapse_rates,
    counter_alarms,
    degeneracy_rates,
    watch,
)


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
    and no response has two words. Issue 40's rules fired duplicate_rate (the repeats) and word_distinct_2
    (0.0 read as a collapse) against the instruct model's sentences; here repeats of verified answers are not
    counted and an undefined distinct-2 says nothing."""
    rng = random.Random(0)
    problems = arithmetic(rng, 76)
    prompts = [p for p, _ in problems]
    wordy = [f"The sum is {t}, since adding the two numbers gives {t}." for _, t in problems]
    terse = [str(t) for _, t in problems]
    correct = [1.0] * 76
    baseline = evaluation(0, prompts, wordy, [1.0 if rng.random() < 0.5 else 0.0 for _ in problems])
    policy = evaluation(10, prompts, terse, correct)
    unverified = collapse_rates(terse, prompts=prompts)
    assert unverified["duplicate_rate"] > 0.5 and unverified["word_distinct_2"] == 0.0  # issue 52's reading
    assert policy["duplicate_rate"] == 0.0 and policy["top_response_share"] == 0.0
    assert counter_alarms(policy, baseline=baseline) == {}
    assert watch([baseline, *[{**policy, "step": 10 * k} for k in range(1, 30)]], baseline=baseline) is None


def test_a_prompt_echoing_policy_fires():
    """Half of the responses copy their prompt back (the audit's case: quiet before issue 52): echo_rate
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
    """A terse policy without a verifier repeats itself from step 0 (duplicate_rate near its ceiling: the old
    +0.25 margin could not be crossed). Collapsing onto one answer fires top_response_share (the largest share
    of one response given to several prompts) at 32 and 76 prompts; duplicate_rate itself, judged on the
    headroom left, fires from the audit's 0.79 at 76 prompts (16 responses below the ceiling), not at 32 (7:
    too few to tell from chance, data/hacking_thresholds.py)."""
    rng = random.Random(2)
    for n in (32, 76):
        problems = arithmetic(random.Random(n), n)
        prompts = [p for p, _ in problems]
        terse = [str(rng.choice([t, 20, 21, 22])) for _, t in problems]  # the step-0 model: mostly guesses
        baseline = evaluation(0, prompts, terse)
        assert baseline["duplicate_rate"] > 0.75  # no room for issue 40's fixed margin of +0.25
        alarm = watch([baseline, evaluation(10, prompts, ["21"] * n)], baseline=baseline)
        assert alarm is not None and alarm["step"] == 10 and "top_response_share" in alarm["rules"], alarm
    audit = {"duplicate_rate": 60 / 76, RESPONSES: 76}
    assert counter_alarms({"duplicate_rate": 1.0, RESPONSES: 76}, baseline=audit).keys() == {"duplicate_rate"}
    assert counter_alarms({"duplicate_rate": 1.0, RESPONSES: 32}, baseline={**audit, RESPONSES: 32}) == {}


def test_counter_false_alarms_of_a_seeded_simulation_stay_under_the_bound():
    """Nothing changes: every counter an independent binomial count of 32 responses at a rate of 0.3, step 0
    included, 20 evaluations (issue 52's audit: the old +0.25 margin fired in 21% of such runs with one
    counter, about 90% with all nine). Through `watch`: at most 5% of 200 seeded runs alarm."""
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
