"""Environments for the episode tests (tests/rl/test_episodes.py, tests/scripts/episode_ranks.py), named in
configs as `tests/envs.py:<Class>` (from the repo root) or `envs:<Class>` (tests/ is on the python path under
pytest)."""

from __future__ import annotations

import time

from llm_rlhf.rl.episodes import Step

PAUSE = "e"  # the tiny tokenizer writes it often: turns pause there and the reply follows inline


class Echo:
    """Replies to every turn with its number and rewards it 0.5 (per-turn rewards); never ends by itself:
    max_turns and max_episode_tokens end its episodes. Turns pause at PAUSE."""

    stop_strings = (PAUSE,)

    def reset(self, prompt):
        self.turn = 0

    def step(self, turn):
        self.turn += 1
        return Step(reply=f" [{self.turn}]", reward=0.5)


class ThreeTurns:
    """Ends the episode after its third policy turn with reward 1.0; replies " ok" before."""

    stop_strings = (PAUSE,)

    def reset(self, prompt):
        self.turn = 0

    def step(self, turn):
        self.turn += 1
        if self.turn == 3:
            return Step(reward=1.0, done=True)
        return Step(reply=" ok")


class Raises(Echo):
    def step(self, turn):
        raise RuntimeError("the environment broke")


class Hangs(Echo):
    def step(self, turn):
        time.sleep(30)
        return Step(reply="late")


class Megabytes(Echo):
    def step(self, turn):
        return Step(reply="x " * 2_000_000)


class NotAStep(Echo):
    def step(self, turn):
        return "a string"


class Chatty(Echo):
    """Echo whose turns pause at any vowel: short turns, so a greedy tiny model's episodes take several."""

    stop_strings = tuple("aeiou")
