"""Rule-based reward functions for the tests (tests/models/test_reward_fn.py and others), named in configs as
`reward_fns:<name>` (tests/ is on the python path under pytest) or `tests/reward_fns.py:<name>` (the file,
from the repo root); and verifiers for tests/evaluation/test_accuracy.py (`accuracy_fn`: 1.0 correct, 0.0
wrong)."""

from __future__ import annotations

import math
import os

import numpy as np

KEYWORD = "e"


def keyword(prompts: list[str], responses: list[str]) -> list[float]:
    """How often KEYWORD occurs in the response (dense enough for a tiny random policy to learn)."""
    return [float(r.count(KEYWORD)) for r in responses]


def length(prompts: list[str], responses: list[str]) -> list[float]:
    """The response's length in characters, over 10."""
    return [len(r) / 10 for r in responses]


def length_numpy(prompts: list[str], responses: list[str]):
    return np.array(length(prompts, responses))


class Keyword:
    """A class: built once with no arguments, its instances are the reward function."""

    def __init__(self):
        self.word = KEYWORD

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        return [float(r.count(self.word)) for r in responses]


def wrong_length(prompts: list[str], responses: list[str]) -> list[float]:
    return [1.0] * (len(responses) - 1)


def returns_nan(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.0, math.nan, *[0.0] * (len(responses) - 2)]


def raises(prompts: list[str], responses: list[str]) -> list[float]:
    return [1.0 / 0 for _ in responses]


not_callable = 3.0


class NanAfterProbe:
    """Fine on the probe (its first call), then NaN at index 2: the check at the first training step."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        self.calls += 1
        return [math.nan if self.calls > 1 and i == 2 else 0.0 for i in range(len(responses))]


class WrongLengthOnRank1AfterProbe:
    """Under `accelerate launch`: fine on the probe and on rank 0; rank 1 returns one score too few."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        self.calls += 1
        n = len(responses) - (self.calls > 1 and os.environ.get("RANK") == "1")
        return [0.0] * n


def even_length(prompts: list[str], responses: list[str]) -> list[float]:
    """A verifier: "correct" (1.0) when the response has an even number of characters, else 0.0 (a tiny
    random model gets some of each)."""
    return [float(len(r) % 2 == 0) for r in responses]


def half(prompts: list[str], responses: list[str]) -> list[float]:
    """Not a verifier: a graded score, 0.5 for every response."""
    return [0.5 for _ in responses]
