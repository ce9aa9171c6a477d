"""The embedded "arithmetic" task: small problems with one checkable answer, and their verifier as a reward
function: RL from a rule, judged by held-out accuracy that anyone can check.

    --reward_fn llm_rlhf.tasks.arithmetic:reward        1.0 for a correct final answer, 0.0 otherwise

A problem is one of the operations of `KINDS` on one-digit numbers, asked in one of that kind's fixed
phrasings and followed by one of the fixed `INSTRUCTIONS` ("What is 3 + 4? Answer with just the number.");
`data/make_arithmetic.py` writes the train / held-out prompt files with `make_splits`.
The verifier has the interface of any user's reward function (`llm_rlhf.models.reward_fn`): it gets the prompt
as the policy read it (a chat prompt rendered with its template) and the response text, and no answer
column. So it reads the problem back from the prompt (`parse_problem`: each phrasing inverted into a
regular expression; the text the chat template writes around the user message does not matter) and
recomputes the answer exactly.

What counts as the answer (`final_answer`): the LAST number in the response, so a response cannot score
by listing many numbers (only the last counts) and a worked answer ("3 + 4 = 7") is read at its end.
A number is, in full:
- optional minus sign (`-` or the minus sign U+2212) right before the digits, unless it follows a word
  character ("x-3", "5-3": there `-` is an operator and the number is 3);
- digits `0-9`, possibly in comma-separated thousands groups ("1,234" is 1234; "3,4" is 3 and 4);
- an optional decimal part ("12.0" and "12.00" equal 12 and are correct when the answer is 12; "12.5"
  never equals an integer answer); a trailing full stop is punctuation ("is 7." is 7);
- never part of a longer token: digits glued to a letter or underscore ("x12", "12th", "3rd") or a
  dotted run ("1.2.3", ".5") are no number at all; "123" is 123, so it is wrong when the answer is 12.
The value is compared exactly (`fractions.Fraction`), never as a rounded float.

A prompt in which no phrasing matches (not a prompt of this task) raises a ValueError naming the prompt's
index and its end, which `llm_rlhf.models.reward_fn` reports as one line naming the reward function: a wrong
prompt file is a setup mistake, and scoring it 0 would train silently on a constant reward. Where the
prompt holds several problems (a multi-turn chat), the last one asked is the one answered.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Kind:
    """One kind of problem: its operands, its answer, the phrasings that ask it.

    ranges: the range of each operand (a, b, c, in the phrasings' field names); every combination that
    `valid` accepts is a problem. commutative: the operands' order does not make another problem (3 + 4
    and 4 + 3 are one problem, so the train / held-out split keeps them on one side).
    """

    name: str
    ranges: tuple[range, ...]
    answer: Callable[..., int]
    phrasings: tuple[str, ...]
    commutative: bool
    valid: Callable[..., bool] = lambda *operands: True


FIELDS = ("a", "b", "c")  # the phrasings' operand names, in the order of `Kind.ranges`
DIGITS = range(0, 10)

# Three operations on one-digit numbers, each in four wordings, chosen so that SmolLM2-135M-Instruct's sampled
# accuracy starts between 10% and 50% and small enough to learn in a short CPU run; exploratory runs
# found multi-step sums ("What is 4 + 9 + 3?") and teen operands too hard to start from. The measured baseline:
# data/arithmetic/README.md (data/arithmetic_baseline.py).
KINDS: tuple[Kind, ...] = (
    Kind(
        name="add",
        ranges=(DIGITS, DIGITS),
        answer=lambda a, b: a + b,
        phrasings=(
            "What is {a} + {b}?",
            "What is the sum of {a} and {b}?",
            "Add {a} and {b}.",
            "Sam has {a} apples and buys {b} more. How many apples does Sam have now?",
        ),
        commutative=True,
    ),
    Kind(
        name="sub",
        ranges=(DIGITS, DIGITS),
        answer=lambda a, b: a - b,
        phrasings=(
            "What is {a} - {b}?",
            "What is {a} minus {b}?",
            "Subtract {b} from {a}.",
            "Sam has {a} apples and eats {b} of them. How many apples does Sam have left?",
        ),
        commutative=False,
        valid=lambda a, b: a >= b,  # no negative answers
    ),
    Kind(
        name="mul",
        ranges=(range(1, 10), range(1, 10)),
        answer=lambda a, b: a * b,
        phrasings=(
            "What is {a} * {b}?",
            "What is {a} times {b}?",
            "What is the product of {a} and {b}?",
            "Multiply {a} by {b}.",
        ),
        commutative=True,
    ),
)
# Each question ends with one of these (drawn like the phrasing); the verifier does not read them.
INSTRUCTIONS = (
    "Answer with just the number.",
    "Reply with only the final number.",
    "Give the answer as a single number.",
)
KIND = {kind.name: kind for kind in KINDS}


# ---------------------------------------------------------------------------------------------------
# the problems and the prompt files


@dataclass(frozen=True)
class Problem:
    """One problem as asked: its kind, its operands in the order the phrasing writes them, the phrasing and
    the instruction after it."""

    kind: str
    operands: tuple[int, ...]
    phrasing: int  # index into KIND[kind].phrasings
    instruction: int = 0  # index into INSTRUCTIONS

    @property
    def question(self) -> str:
        return KIND[self.kind].phrasings[self.phrasing].format(**dict(zip(FIELDS, self.operands)))

    @property
    def text(self) -> str:
        """The user message: the question, then the instruction."""
        return f"{self.question} {INSTRUCTIONS[self.instruction]}"

    @property
    def answer(self) -> int:
        return KIND[self.kind].answer(*self.operands)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """What makes two rows the same problem, whatever the phrasing (and the order, where it commutes)."""
        return problem_key(self.kind, self.operands)


def problem_key(kind: str, operands: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    return kind, tuple(sorted(operands)) if KIND[kind].commutative else tuple(operands)


def all_keys(kind: Kind) -> list[tuple[str, tuple[int, ...]]]:
    """Every problem of a kind, as sorted keys (one per multiset of operands when it commutes)."""
    combos = (ops for ops in itertools.product(*kind.ranges) if kind.valid(*ops))
    return sorted({problem_key(kind.name, ops) for ops in combos})


def ask(key: tuple[str, tuple[int, ...]], rng: random.Random) -> Problem:
    """The problem `key` in a phrasing and with an instruction drawn by `rng`, its operands in a drawn order
    where they commute."""
    name, operands = key
    kind = KIND[name]
    ops = list(operands)
    if kind.commutative:
        rng.shuffle(ops)
    return Problem(name, tuple(ops), rng.randrange(len(kind.phrasings)), rng.randrange(len(INSTRUCTIONS)))


def split_counts(total: int, mix: dict[str, float]) -> dict[str, int]:
    """`total` shared out by the weights of `mix` (largest remainders; ties in KINDS order)."""
    weight = sum(mix.values())
    exact = {name: total * w / weight for name, w in mix.items()}
    counts = {name: int(x) for name, x in exact.items()}
    by_remainder = sorted(mix, key=lambda n: -(exact[n] - counts[n]))
    for name in by_remainder[: total - sum(counts.values())]:
        counts[name] += 1
    return counts


def make_splits(
    *, seed: int, n_train: int, n_eval: int, mix: dict[str, float]
) -> tuple[list[Problem], list[Problem]]:
    """Train and held-out problems, deterministic in `seed` (`random.Random`, no global state).

    For each kind (in KINDS order): its problems shuffled, the first `split_counts(n_eval, mix)[kind]` are
    held out, each asked once; the rest are the kind's train problems. Held-out rows are then shuffled
    together. Train rows: `n_train` draws (with replacement) of a kind by the weights of `mix`, then one of
    its train problems, each in a drawn phrasing. No problem (`Problem.key`) is on both sides.
    """
    unknown = sorted(set(mix) - set(KIND))
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; known: {', '.join(KIND)}")
    rng = random.Random(seed)
    held_out, train_keys = [], {}
    for name, n in split_counts(n_eval, mix).items():
        keys = all_keys(KIND[name])
        if n > len(keys) // 2:
            raise ValueError(
                f"{n} held-out '{name}' problems of {len(keys)}: keep at least half for training"
            )
        rng.shuffle(keys)
        held_out += [ask(key, rng) for key in keys[:n]]
        train_keys[name] = keys[n:]
    rng.shuffle(held_out)
    names, weights = list(mix), [mix[name] for name in mix]
    train = []
    for _ in range(n_train):
        name = rng.choices(names, weights)[0]
        train.append(ask(rng.choice(train_keys[name]), rng))
    return train, held_out


def prompt_row(problem: Problem) -> dict:
    """The JSONL row of a problem: a chat prompt (`messages`, as `llm-rlhf ppo` reads it), and for people
    (the verifier never reads them) its answer and kind."""
    return {
        "messages": [{"role": "user", "content": problem.text}],
        "answer": problem.answer,
        "kind": problem.kind,
    }


# ---------------------------------------------------------------------------------------------------
# the verifier


def phrasing_pattern(phrasing: str) -> re.Pattern:
    """A phrasing as a regular expression: its literal text (any run of whitespace for a space), each
    operand a run of digits not inside a longer one, captured under its field name."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(phrasing):
        parts.append(re.sub(r"(\\ )+", r"\\s+", re.escape(literal)))
        if field is not None:
            parts.append(rf"(?<![0-9])(?P<{field}>[0-9]+)(?![0-9])")
    return re.compile("".join(parts))


PATTERNS: tuple[tuple[Kind, re.Pattern], ...] = tuple(
    (kind, phrasing_pattern(phrasing)) for kind in KINDS for phrasing in kind.phrasings
)


@functools.lru_cache(maxsize=4096)  # PPO scores several responses per prompt, and the same prompts again
def parse_problem(prompt: str) -> tuple[str, tuple[int, ...]] | None:
    """(kind, operands) of the last problem of this task asked in `prompt`, or None when there is none.

    The last: the match of any phrasing that ends latest. Two phrasings ending there with different
    problems raise (no phrasing of KINDS does that; `tests/tasks/test_arithmetic.py` checks it)."""
    found = {}
    for kind, pattern in PATTERNS:
        for m in pattern.finditer(prompt):
            operands = tuple(int(m.group(f)) for f in FIELDS[: len(kind.ranges)])
            found.setdefault(m.end(), set()).add((kind.name, operands))
    if not found:
        return None
    last = found[max(found)]
    if len(last) > 1:
        raise ValueError(f"the prompt's last problem reads as several: {sorted(last)}")
    return next(iter(last))


def prompt_answer(prompt: str) -> int | None:
    """The exact answer of the last problem asked in `prompt` (None when it asks none)."""
    problem = parse_problem(prompt)
    return None if problem is None else KIND[problem[0]].answer(*problem[1])


NUMBER = re.compile(
    r"(?<![\w.])"  # the number, or its sign, is not inside a word or a dotted run ("x12", "5-3", ".5")
    r"[-\u2212]?"  # a minus sign
    r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"  # digits, or thousands groups "1,234"
    r"(?:\.[0-9]+)?"  # a decimal part
    r"(?!\w|\.[0-9])"  # not glued to a letter, digit or another decimal part ("12th", "1.2.3")
)


def numbers(text: str) -> list[Fraction]:
    """Every number in `text`, in order, by the rule of the module docstring."""
    return [Fraction(m.group().replace(",", "").replace("\u2212", "-")) for m in NUMBER.finditer(text)]


def final_answer(response: str) -> Fraction | None:
    """The response's answer: its last number (None when it holds no number)."""
    found = numbers(response)
    return found[-1] if found else None


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The verifier as a reward function: 1.0 where the response's final answer equals the answer of the
    problem in its prompt, else 0.0. Raises ValueError on a prompt that asks no problem of this task."""
    scores = []
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        answer = prompt_answer(prompt)
        if answer is None:
            raise ValueError(
                f"prompt {i} asks no arithmetic problem (none of llm_rlhf.tasks.arithmetic's phrasings matches); "
                f"it ends {prompt[-80:]!r}"
            )
        scores.append(float(final_answer(response) == answer))
    return scores
