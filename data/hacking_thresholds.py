"""The reward-hacking alarm's error rates, measured (`llm_rlhf.evaluation.hacking`).

    OMP_NUM_THREADS=1 python data/hacking_thresholds.py [--runs 2000] [--seed 0]

Seeded; prints markdown tables. Each rule is `hacking`'s own (its thresholds, `watch` itself where a run is
simulated whole); the earlier fixed-margin rule (a counter +0.25 above step 0's; the gold 3 se below its
best so far) is measured beside it on the same draws.

1. Real text: a "baseline" and a "policy" of N sentences drawn from data/reviews/sft_val.jsonl (cut to 25
   words), and a "policy" of N positive gold_test.jsonl sentences (a healthy sentiment-tuned policy): the
   smallest `counter_p_value` over the draws, per counter, against COUNTER_ALPHA (above it: quiet); then
   the default reviews run's collapse (" a heart." variants) against real sentences.
2. False alarms of the counter rule: every counter of COUNTER_RULES an independent binomial count of N
   responses at one rate, step 0 included (nothing changes); the fraction of runs of E evaluations in which
   any counter fires.
3. False alarms of the gold rule: the gold flat, the proxy rising 4 se per evaluation, independent normal noise
   of one standard error (0.05) on each; the fraction of runs of E evaluations in which `watch` fires.
4. Detections, from an onset half-way through a 40-evaluation run: the fraction of runs that fire at or after
   the onset (and before it: false), and the median number of evaluations from the onset to the alarm (0: at
   the onset's evaluation). Counters: binomial counts, the rate jumping at the onset (a collapse; one from
   near the ceiling). Text: arithmetic prompts answered through the real counters (`collapse_rates`) and
   `watch`: a policy that copies its prompt (echo), one that collapses onto one answer from terse answers
   (duplicate_rate already near its ceiling, no verifier), and the false alarms of a correct terse policy
   (with a verifier) against a wordy baseline. Gold: falling 1 or 2 se per evaluation after the onset.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from functools import cache
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llm_rlhf.evaluation.hacking import (  # noqa: E402
    COUNTER_ALPHA,
    COUNTER_RULES,
    DEFAULT_RESPONSES,
    RESPONSES,
    Z,
    collapse_rates,
    counter_p_value,
    counter_threshold,
    degeneracy_rates,
    watch,
)

ISSUE_40 = [" a heart.", " is a heart.", " heart of a heart."]
OLD_MARGIN, OLD_Z = (
    0.25,
    3.0,
)  # the earlier rules: a counter +0.25 over step 0's; the gold 3 se below its best
ONSET, LENGTH = 20, 40  # detection runs: the change at evaluation 20 of 40
SE = 0.05


def counters(texts: list[str], prompts: list[str] | None = None, correct: list | None = None) -> dict:
    return {**collapse_rates(texts, prompts=prompts, correct=correct), **degeneracy_rates(texts)}


# ---------------------------------------------------------------------------------------------
# 1. Real text
# ---------------------------------------------------------------------------------------------


def sentences() -> tuple[list[str], list[str]]:
    """(sft_val completions, positive gold_test sentences), each cut to its first 25 words."""
    reviews = REPO / "data" / "reviews"
    cut = lambda text: " ".join(text.split(" ")[:25])  # noqa: E731
    val = [cut(json.loads(line)["completion"]) for line in (reviews / "sft_val.jsonl").open()]
    test = [json.loads(line) for line in (reviews / "gold_test.jsonl").open()]
    return val, [cut(" " + row["text"]) for row in test if row["rating"] > 1.0]


def smallest_p(base: dict, policy: dict, key: str) -> float | None:
    kind, value, ref = COUNTER_RULES[key], policy[key], base[key]
    if kind == "below" and 0.0 in (value, ref):
        return None
    n, n_base = policy[RESPONSES], base[RESPONSES]
    return counter_p_value(value, ref, kind=kind, n=n, n_base=n_base)


def real_text(draws: int, rng: random.Random) -> None:
    val, positive = sentences()
    print(
        f"\n### 1. Real review sentences ({len(val)} sft_val, {len(positive)} positive gold_test), {draws} draws"
    )
    print(
        f"\nthe smallest p of each counter over the draws; fires at p <= COUNTER_ALPHA = {COUNTER_ALPHA:.1e}\n"
    )
    print("| N | " + " | ".join(COUNTER_RULES) + " |")
    print("|---:|" + "---:|" * len(COUNTER_RULES))
    for n in (16, 32, 64):
        low = dict.fromkeys(COUNTER_RULES, 1.0)
        for _ in range(draws):
            base = counters(rng.sample(val, n))
            for policy in (counters(rng.sample(val, n)), counters(rng.sample(positive, n))):
                for key in COUNTER_RULES:
                    p = smallest_p(base, policy, key)
                    low[key] = min(low[key], p) if p is not None else low[key]
        print(f"| {n} | " + " | ".join(f"{low[k]:.1e}" for k in COUNTER_RULES) + " |")
    base = counters(val[:32])
    collapsed = counters([ISSUE_40[i % 3] for i in range(32)])
    fired = [k for k in COUNTER_RULES if (smallest_p(base, collapsed, k) or 1.0) <= COUNTER_ALPHA]
    print(
        f'\nthe earlier recipe\'s " a heart." collapse (32 responses) against 32 real sentences fires: {", ".join(fired)}'
    )


# ---------------------------------------------------------------------------------------------
# 2. and 4. Counters as binomial counts
# ---------------------------------------------------------------------------------------------


@cache
def new_threshold(x_base: int, n: int) -> int:
    """The count of n responses at which a counter fires against x_base of n (n + 1: never)."""
    value = counter_threshold(x_base / n, kind="above", n=n, n_base=n)
    return n + 1 if value is None else round(value * n)


def fires(counts: np.ndarray, n: int, rule: str) -> np.ndarray:
    """counts: (runs, evaluations, counters), evaluation 0 the baseline -> (runs, evaluations) any counter
    past its threshold at that evaluation (evaluation 0 never)."""
    base = counts[:, :1, :]  # (runs, 1, counters)
    if rule == "new":
        threshold = np.vectorize(lambda x: new_threshold(int(x), n))(base)
        over = counts >= threshold
    else:
        over = counts - base >= OLD_MARGIN * n
    over[:, 0, :] = False
    return over.any(axis=2)


def counter_false_alarms(runs: int, rng: np.random.Generator) -> None:
    print(
        f"\n### 2. Counter rule, false alarms: {len(COUNTER_RULES)} counters at one rate, {runs} runs each\n"
    )
    print("| held-out responses N | rate | evaluations | new rule: runs with an alarm | old (+0.25) |")
    print("|---:|---:|---:|---:|---:|")
    for n in (32, 76):
        for rate in (0.05, 0.3, 0.5, 0.8, 0.95):
            counts = rng.binomial(n, rate, size=(runs, 100, len(COUNTER_RULES)))
            new, old = fires(counts, n, "new"), fires(counts, n, "old")
            for evals in (20, 100):
                print(
                    f"| {n} | {rate:g} | {evals} | {new[:, :evals].any(1).mean():.2%} | "
                    f"{old[:, :evals].any(1).mean():.2%} |"
                )


def delays(alarm_at: list[int | None]) -> str:
    """'detected %, before the onset %, median evaluations after the onset' of a list of alarm indices."""
    after = [i - ONSET for i in alarm_at if i is not None and i >= ONSET]
    early = sum(i is not None and i < ONSET for i in alarm_at)
    median = f"{statistics.median(after):g}" if after else "—"
    return f"{len(after) / len(alarm_at):.1%} | {early / len(alarm_at):.1%} | {median}"


def first(fired: np.ndarray) -> list[int | None]:
    return [int(row.argmax()) if row.any() else None for row in fired]


def counter_detections(runs: int, rng: np.random.Generator) -> None:
    print(
        f"\n### 4a. Counter rule, detections: one counter's rate jumps at evaluation {ONSET} of {LENGTH}, {runs} runs\n"
    )
    print(
        "| case | N | rate before → after | new: detected | new: before the onset | new: median evaluations "
        "after the onset | old: detected | old: before | old: median |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    cases = [
        ("collapse", 0.05, 1.0),
        ("partial collapse", 0.05, 0.5),
        ("partial collapse", 0.3, 0.7),
        ("near the ceiling", 0.8, 1.0),
        ("near the ceiling", 0.9, 1.0),
    ]
    for name, before, after in cases:
        for n in (32, 76, 256):
            rates = np.where(np.arange(LENGTH) < ONSET, before, after)[None, :, None]  # (1, evals, 1)
            counts = rng.binomial(n, np.broadcast_to(rates, (runs, LENGTH, 1)))
            new, old = first(fires(counts, n, "new")), first(fires(counts, n, "old"))
            print(f"| {name} | {n} | {before:g} → {after:g} | {delays(new)} | {delays(old)} |")


# ---------------------------------------------------------------------------------------------
# 3. and 4. The gold rule
# ---------------------------------------------------------------------------------------------


def trajectory(rng: random.Random, n: int, gold) -> list[dict]:
    return [
        {
            "step": 10 * i,
            "gold": gold(i) + rng.gauss(0, SE),
            "gold_stderr": SE,
            "proxy": 4 * SE * i + rng.gauss(0, SE),
            "proxy_stderr": SE,
        }
        for i in range(n)
    ]


def alarm_index(points: list[dict], rule: str) -> int | None:
    alarm = watch(points, baseline=None) if rule == "new" else watch(points, baseline=None, z=OLD_Z)
    return alarm["index"] if alarm else None


def gold_rule(runs: int, rng: random.Random) -> None:
    print(f"\n### 3. Gold rule, false alarms: flat gold, proxy +4 se per evaluation, {runs} runs each\n")
    print(f"| evaluations | new rule (Z {Z:.2f}, 2 in a row) | old (Z 3, 2 in a row) |")
    print("|---:|---:|---:|")
    for n in (21, 51, 101):
        flat = [trajectory(rng, n, lambda i: 0.0) for _ in range(runs)]
        rates = [sum(alarm_index(p, rule) is not None for p in flat) / runs for rule in ("new", "old")]
        print(f"| {n} | {rates[0]:.2%} | {rates[1]:.2%} |")
    print(
        f"\n### 4b. Gold rule, detections: the gold falls after evaluation {ONSET} of {LENGTH}, {runs} runs each\n"
    )
    print(
        "| gold after the onset | new: detected | new: before the onset | new: median evaluations after "
        "the onset | old: detected | old: before | old: median |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for fall in (1, 2, 4):
        gold = lambda i, fall=fall: -fall * SE * max(i - ONSET, 0)  # noqa: E731
        falling = [trajectory(rng, LENGTH, gold) for _ in range(runs)]
        new, old = ([alarm_index(p, rule) for p in falling] for rule in ("new", "old"))
        print(f"| −{fall} se per evaluation | {delays(new)} | {delays(old)} |")


# ---------------------------------------------------------------------------------------------
# 4. Text through the real counters and watch
# ---------------------------------------------------------------------------------------------


def problems(rng: random.Random, n: int) -> list[tuple[str, int]]:
    """n arithmetic prompts and their answers ("What is 23 + 41? Answer with just the number.")."""
    pairs = [(rng.randint(1, 60), rng.randint(1, 60)) for _ in range(n)]
    return [(f"What is {a} + {b}? Answer with just the number.", a + b) for a, b in pairs]


def answer(rng: random.Random, prompt: str, total: int, kind: str, accuracy: float) -> tuple[str, float]:
    """(response, verdict) of one policy kind: wordy, terse, echo (copies the prompt), one (always "42")."""
    value = total if rng.random() < accuracy else total + rng.choice([-2, -1, 1, 2])
    text = {
        "wordy": f"The sum is {value}, since adding the two numbers gives {value}.",
        "terse": str(value),
        "echo": prompt,
        "one": "42",
    }[kind]
    return text, float(text.strip() == str(total))


def text_run(
    rng: random.Random, n: int, *, before: str, after: str, verifier: bool, share: float
) -> dict | None:
    """A LENGTH-evaluation run of n fresh problems each; from ONSET a `share` of the responses are `after`'s
    kind, the rest (and everything before) `before`'s; `watch` over the counters (the verdicts to the counters
    only with a verifier). `watch`'s alarm, or None."""
    points = []
    for i in range(LENGTH):
        rows = []
        for prompt, total in problems(rng, n):
            kind = after if i >= ONSET and rng.random() < share else before
            rows.append((prompt, *answer(rng, prompt, total, kind, 0.3 if i == 0 else 0.9)))
        prompts, texts, verdicts = zip(*rows)
        values = counters(list(texts), list(prompts), list(verdicts) if verifier else None)
        points.append({"step": i, "gold": None, **values})
    return watch(points, baseline=points[0])


def text_detections(runs: int, rng: random.Random) -> None:
    print(
        f"\n### 4c. Text through the real counters and `watch`: arithmetic, the change at evaluation {ONSET} "
        f"of {LENGTH}, {runs} runs each\n"
    )
    print(
        "| case | N | fired at or after the onset | before the onset | median evaluations after the onset | "
        "rules, first run that fired |"
    )
    print("|---|---:|---:|---:|---:|---|")
    cases = [
        ("correct terse policy (verifier), wordy step 0: should stay quiet", "wordy", "terse", True, 1.0),
        ("terse, no verifier, all terse from step 0: should stay quiet", "terse", "terse", False, 1.0),
        ("echo: half the responses copy the prompt", "wordy", "echo", True, 0.5),
        ("echo: a quarter copy the prompt", "wordy", "echo", True, 0.25),
        (
            "terse (duplicate_rate near its ceiling), no verifier, collapses onto one answer",
            "terse",
            "one",
            False,
            1.0,
        ),
        ("the same, half the answers", "terse", "one", False, 0.5),
    ]
    for name, before, after, verifier, share in cases:
        for n in (32, 76):
            found, rules = [], "—"
            for _ in range(runs):
                alarm = text_run(rng, n, before=before, after=after, verifier=verifier, share=share)
                found.append(alarm["index"] if alarm else None)
                if alarm and rules == "—":
                    rules = ", ".join(alarm["rules"])
            print(f"| {name} | {n} | {delays(found)} | {rules} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000, help="simulated runs per row (text: a tenth)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng, np_rng = random.Random(args.seed), np.random.default_rng(args.seed)
    print(f"COUNTER_ALPHA {COUNTER_ALPHA:.2e}, Z {Z:.3f}, DEFAULT_RESPONSES {DEFAULT_RESPONSES}")
    real_text(max(args.runs // 10, 1), rng)
    counter_false_alarms(args.runs, np_rng)
    gold_rule(args.runs, rng)
    counter_detections(args.runs, np_rng)
    text_detections(max(args.runs // 10, 1), rng)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
