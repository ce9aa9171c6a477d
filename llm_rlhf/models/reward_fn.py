"""Reward functions: a rule written in python as the score of a response, alone or beside the reward model.

A reward function is any callable

    reward_fn(prompts: list[str], responses: list[str]) -> list[float]     # one score per pair, higher = better

named in a config as `reward_fn: <callable>`, in one of two forms:

    module:callable         imported from the current directory or the python path (`my_rewards:length`,
                            `mypackage.rewards:concise`)
    path/to/file.py:callable   the file is loaded as a module (relative to the current directory)

A class is built once with no arguments and its instances are called (a function that loads a classifier
once, say). Where its score goes (`llm_rlhf.models.scoring.Scorer`: PPO, `llm-rlhf eval`, held-out evaluation):

    scores = rm_score + reward_fn_weight * reward_fn(prompts, responses)      (B,)
    rm_score = r_phi(x, y), normalised (0 when reward_model_path is null: the score is the function's alone)

the one scalar per sequence that PPO adds at the last response token, before the score_clip and the EOS
trick (`ppo_math.shaped_rewards`). The texts it sees: the prompt string of the prompt file (a chat prompt
rendered with its template) and the response decoded without its EOS, in PPO as in evaluation
(`decode_texts`).

Checks, each a one-line `UserError` naming the callable:
- `load_reward_fn`: the module imports, the attribute exists, the object is callable;
- every call (`RewardFn.__call__`): it returns a sequence of one number per response, each finite (the
  error names the first bad index); an exception raised inside becomes one line with its type, message
  and the line of the function that raised it;
- `probe`: one call on the first two prompts of the run with two dummy responses, before any model is
  loaded or any output written, so a broken function stops the run at once instead of at the first step.

A verifier (`accuracy_fn: <callable>`, the held-out accuracy of `llm-rlhf eval` and PPO's held-out evaluation) is a
reward function of the same interface and rules whose every score is 1.0 (correct) or 0.0 (wrong):
`load_reward_fn(spec, key="accuracy_fn", binary=True)`, whose errors name `accuracy_fn`, and any other value
(0.5, 2.0) is one more error line: the accuracy of a graded score means nothing.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from llm_rlhf.core.callables import resolve_callable
from llm_rlhf.core.data import adds_bos
from llm_rlhf.core.errors import UserError

PROBE_RESPONSES = ("", " and it was good.")  # an empty response (EOS at once) and a short one


class RewardFn:
    """A loaded reward function: `self(prompts, responses)` calls it and checks what comes back.

    fn: the user's callable; spec: how the config named it and key: the config key that named it (every error
    message starts "<key> '<spec>'"); binary: a verifier, every score must be 1.0 or 0.0 (`check_binary`).
    """

    def __init__(
        self,
        fn: Callable[[list[str], list[str]], Any],
        spec: str,
        *,
        key: str = "reward_fn",
        binary: bool = False,
    ):
        self.fn, self.spec, self.key, self.binary = fn, spec, key, binary

    def __repr__(self) -> str:
        return f"RewardFn('{self.spec}')"

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        try:
            out = self.fn(list(prompts), list(responses))
        except Exception as e:  # the user's code: one line with where it failed, not a traceback
            frames = traceback.extract_tb(e.__traceback__)
            where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if len(frames) > 1 else ""
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(
                f"{self.key} '{self.spec}' raised {type(e).__name__}{': ' + message if message else ''}{where}"
            ) from e
        scores = check_scores(out, len(responses), self.spec, key=self.key)
        return check_binary(scores, self.spec, key=self.key) if self.binary else scores


def check_scores(out: Any, n: int, spec: str, *, key: str = "reward_fn") -> list[float]:
    """`out` as n finite floats, or a one-line UserError naming `key`, `spec` (and the first bad index).

    Accepted: a list, tuple, numpy array or 1-D tensor of numbers (python, numpy or 0-d tensor scalars)."""
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().tolist() if out.dim() == 1 else out
    if hasattr(out, "tolist") and getattr(out, "ndim", None) == 1:  # a numpy array
        out = out.tolist()
    if isinstance(out, (str, bytes, dict)) or not isinstance(out, Sequence):
        raise UserError(
            f"{key} '{spec}' returned {type(out).__name__}; expected a list of {n} numbers, one per response"
        )
    if len(out) != n:
        raise UserError(f"{key} '{spec}' returned {len(out)} scores for {n} responses")
    scores = []
    for i, value in enumerate(out):
        try:
            if isinstance(value, (str, bytes, bool)):
                raise TypeError
            score = float(value)
        except (TypeError, ValueError):
            raise UserError(
                f"{key} '{spec}': score {i} is {value!r} ({type(value).__name__}), not a number"
            ) from None
        if not math.isfinite(score):
            raise UserError(f"{key} '{spec}': score {i} is {score} (NaN or infinite)")
        scores.append(score)
    return scores


def check_binary(scores: list[float], spec: str, *, key: str = "accuracy_fn") -> list[float]:
    """A verifier's scores, each 1.0 (correct) or 0.0 (wrong), or a one-line UserError naming `key`, `spec`,
    the first other value and its index."""
    for i, score in enumerate(scores):
        if score not in (0.0, 1.0):
            raise UserError(
                f"{key} '{spec}': score {i} is {score!r}; a verifier returns 1.0 (correct) or 0.0 (wrong) "
                "(the accuracy of a graded score is meaningless)"
            )
    return scores


def load_reward_fn(spec: str, *, key: str = "reward_fn", binary: bool = False) -> RewardFn:
    """Resolve `<key>: <callable>` (see the module docstring; the rules of `callables.resolve_callable`, which
    a `gold_judge` callable follows too) to a checked `RewardFn`. binary: a verifier (`accuracy_fn`), whose
    every score must be 1.0 or 0.0."""
    return RewardFn(resolve_callable(spec, key), spec, key=key, binary=binary)


def probe(reward_fn: RewardFn, prompts: Sequence[str]) -> list[float]:
    """One checked call on the first two prompts, each with the dummy responses `PROBE_RESPONSES` (4 pairs),
    before training starts: a function that fails, returns the wrong number of scores or a non-finite one
    stops the run here with its one-line error. Returns the scores."""
    first = list(prompts[:2])
    pairs = [(p, r) for p in first for r in PROBE_RESPONSES]
    return reward_fn([p for p, _ in pairs], [r for _, r in pairs])


def decode_texts(tokenizer, query, query_mask, response, response_mask) -> tuple[list[str], list[str]]:
    """The (prompts, responses) texts a reward function sees for a batch of samples.

    query, query_mask: (B, P); response: (B, R); response_mask: (B, R) bool, True up to and including the
    first EOS. The prompt: its real tokens decoded back to the text `rollout.encode_prompt` encoded (the BOS
    the tokenizer adds dropped; special tokens a chat template wrote kept), which is the prompt string
    `llm-rlhf eval` passes. The response: its real tokens without the EOS, decoded as `llm-rlhf eval` does
    (special tokens skipped; a stop string that ended it kept).
    """
    bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None
    prompts = []
    for q, m in zip(query, query_mask):
        ids = q[m.bool()].tolist()  # (P',) the real query tokens
        ids = ids[1:] if bos is not None and ids[:1] == [bos] else ids
        prompts.append(tokenizer.decode(ids, clean_up_tokenization_spaces=False))
    eos = (response == tokenizer.eos_token_id) & response_mask.bool()  # (B, R) the first EOS, if any
    keep = response_mask.bool() & ~eos  # (B, R) the response's text tokens
    responses = [tokenizer.decode(r[k].tolist(), skip_special_tokens=True) for r, k in zip(response, keep)]
    return prompts, responses
