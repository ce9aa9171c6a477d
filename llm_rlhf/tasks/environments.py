"""Environments for episodes of several turns (the episode itself: `llm_rlhf.rl.episodes`).

A recipe names its environment as it names a reward function:

    environment: calculator                    a shipped one, a row of `ENVIRONMENTS`
    environment: my_envs.py:Maze               a user's class ('module:Class' works too)

An environment is a class with `reset(prompt)` and `step(turn) -> Step(reply, reward, done)` (the module
docstring of `llm_rlhf.rl.episodes`); one instance plays one episode, so it keeps its episode's state on
`self`. A user's class is built with no arguments, or with `verifier=` (the run's loaded accuracy_fn: a
callable (prompts, responses) -> 1.0 / 0.0) when its __init__ takes one; the class is checked when the config
is read (`resolve_environment`, before any stage runs) and built once per episode. A few lines are enough:

    from llm_rlhf.rl.env_workers import EnvironmentWorkers
from llm_rlhf.rl.episodes import Step, shown

    class Countdown:
        reply_role = "user"                          # the chat role of the replies (optional)
        def reset(self, prompt):                     # the prompt's text, as a reward function sees it
            self.left = 3
        def step(self, turn):                        # the policy's turn, its text without EOS
            self.left -= 1
            if "done" in turn or self.left == 0:
                return Step(reward=1.0 if "done" in turn else 0.0, done=True)
            return Step(reply=f"{self.left} turns left.")

Tools are plain Python functions (`ToolUse`): the policy calls one by writing `<tool>name(argument)</tool>`;
the turn pauses at "</tool>" (the environment's `stop_strings`), the function runs on the text between the
parentheses, and its result comes back inline as `<result>...</result>` for the policy to go on in the same
message. A tool that raises answers "<result>error: ...</result>" (the model reads one line); one that hangs
or returns megabytes is bounded by the episode's limits (`episodes.bounded_call`, max_reply_tokens).
`describe_tools` writes each tool's signature and first docstring line for the system prompt.

    calculator  ToolUse([calculator]): the arithmetic of the chain_sum ladder, parsed here (never eval)
    feedback    Feedback: the policy answers, the task's verifier judges; wrong -> "too high" / "too low" (a
                number) or "not right" and another try; right -> reward 1 and the episode ends
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from llm_rlhf.core.callables import resolve_callable
from llm_rlhf.core.errors import UserError
from llm_rlhf.rl.env_workers import EnvironmentWorkers
from llm_rlhf.rl.episodes import Step, shown
from llm_rlhf.tasks.gym import extract_answer

# ---------------------------------------------------------------------------------------------
# The calculator: arithmetic parsed by hand
# ---------------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**15  # larger intermediate values are an error, not a bignum the model never needs
RATIONAL_DIGITS = 12  # the significant digits of a result with no finite decimal (1 / 3)
_TOKEN = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]+)?)|(.))")  # ASCII digits only: "٣" is not a number here


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * /, parentheses, unary minus. Example: 3 + 4 * (2 - 7)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    value = _Parser(expression.replace("\u2212", "-").replace("×", "*").replace("÷", "/")).parse()
    return decimal_text(value)


def decimal_text(value: Fraction) -> str:
    """A calculator result as text, exact where it has a finite decimal: 7 -> "7", 123456.8 -> "123456.8",
    -1/8 -> "-0.125"; otherwise rounded to RATIONAL_DIGITS significant digits: 1/3 -> "0.333333333333"."""
    if value.denominator == 1:
        return str(value.numerator)
    rest, twos, fives = value.denominator, 0, 0
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:  # no finite decimal
        return f"{float(value):.{RATIONAL_DIGITS}g}"
    places = max(twos, fives)  # value * 10**places is an integer
    whole, frac = divmod(abs(value.numerator) * 10**places // value.denominator, 10**places)
    return ("-" if value < 0 else "") + f"{whole}.{frac:0{places}d}".rstrip("0")


class _Parser:
    """Recursive descent over  expr := term (('+'|'-') term)*;  term := factor (('*'|'/') factor)*;
    factor := ('+'|'-') factor | NUMBER | '(' expr ')'.  Exact rationals (`Fraction`) throughout, so integers
    and decimals are never rounded; nothing is evaluated as Python."""

    def __init__(self, text: str):
        self.tokens: list[tuple[str, Any]] = []
        for number, other in _TOKEN.findall(text):
            if number:
                self.tokens.append(("num", Fraction(number)))
            elif other.strip():
                if other not in "+-*/()":
                    raise ValueError(f"unexpected character {other!r}")
                self.tokens.append(("op", other))
        self.i = 0

    def parse(self) -> Fraction:
        if not self.tokens:
            raise ValueError("empty expression")
        value = self.expr(depth=0)
        if self.i != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.i][1]!r}")
        return value

    def peek(self):
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.tokens[self.i][1]
            self.i += 1
            value = _checked(value + self.term(depth) if op == "+" else value - self.term(depth))
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.tokens[self.i][1]
            self.i += 1
            right = self.factor(depth)
            if op == "/" and right == 0:
                raise ValueError("division by zero")
            value = _checked(value * right if op == "*" else value / right)
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > 50:
            raise ValueError("too deeply nested")
        if self.i >= len(self.tokens):
            raise ValueError("the expression ends too early")
        kind, x = self.tokens[self.i]
        self.i += 1
        if kind == "num":
            return _checked(x)
        if x in ("+", "-"):
            value = self.factor(depth + 1)
            return value if x == "+" else -value
        if x == "(":
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise ValueError("missing ')'")
            self.i += 1
            return value
        raise ValueError(f"unexpected {x!r}")


def _checked(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("number too large")
    return value


# ---------------------------------------------------------------------------------------------
# Tool use
# ---------------------------------------------------------------------------------------------

TOOL_CALL = re.compile(r"<tool>\s*([A-Za-z_]\w*)\s*\((.*)\)\s*</tool>\s*$", re.DOTALL)
TOOL_STOP = "</tool>"
MAX_PAUSE_TAIL = 4  # characters the token completing "</tool>" may carry past it (a turn that paused there)


def describe_tools(tools: Sequence[Callable]) -> str:
    """One line per tool for a system prompt: its signature and the first line of its docstring.

    calculator(expression: str) -> str: Evaluate an arithmetic expression: numbers, + - * /, ..."""
    lines = []
    for fn in tools:
        doc = (inspect.getdoc(fn) or "").splitlines()
        signature = str(inspect.signature(fn)).replace("'", "")
        lines.append(f"{fn.__name__}{signature}" + (f": {doc[0]}" if doc else ""))
    return "\n".join(lines)


class ToolUse:
    """An environment of tools: a turn that ends with `<tool>name(argument)</tool>` (and at most MAX_PAUSE_TAIL
    characters of the token that completed it) calls the tool `name` on the argument's text and gets
    `<result>...</result>` back inline (reward 0; `reply`); a turn without a call is the answer
    and ends the episode (the task's reward function scores the policy's text). An unknown tool, a malformed
    call or a tool that raises answers `<result>error: ...</result>`. `calls` and `used` count for the
    statistics: the tool calls, and whether the final answer's number is one a tool returned."""

    stop_strings = (TOOL_STOP,)
    reply_role = "tool"

    def __init__(self, tools: Sequence[Callable]):
        self.tools = {fn.__name__: fn for fn in tools}
        self.calls, self.results, self.used = 0, [], False

    def reset(self, prompt: str) -> None:
        self.calls, self.results, self.used = 0, [], False

    def step(self, turn: str) -> Step:
        end = turn.rfind(TOOL_STOP)
        tail = turn[end + len(TOOL_STOP) :] if end >= 0 else ""
        if end < 0 or len(tail) > MAX_PAUSE_TAIL:  # no call at the turn's end: the answer
            answer = extract_answer(turn, "number")
            self.used = answer is not None and answer in self.results
            return Step(done=True)
        self.calls += 1
        call = TOOL_CALL.search(turn[turn.rfind("<tool>", 0, end + 1) : end + len(TOOL_STOP)])
        if call is None:
            return self.reply("error: write a call as <tool>name(argument)</tool>", tail)
        name, argument = call.group(1), call.group(2)
        if name not in self.tools:
            return self.reply(f"error: no tool {name}; tools: {', '.join(self.tools)}", tail)
        try:
            result = str(self.tools[name](argument))
        except Exception as e:  # the tool's own error, told to the model in one line
            return self.reply(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", tail)
        self.results.append(result)
        return self.reply(result, tail)

    @staticmethod
    def reply(text: str, tail: str) -> Step:
        """`<result>text</result>`, less what the policy already wrote of it after "</tool>": the token that
        completes the stop string may run past it (SmolLM2 writes "</tool><result>" with a "><" token, so its
        turn pauses at "...</tool><"), and the reply goes on from there, so the text reads as one call and one
        result either way."""
        reply = f"<result>{text}</result>"
        return Step(reply=reply[len(tail) :] if reply.startswith(tail) else reply)


def calculator_environment() -> ToolUse:
    return ToolUse([calculator])


# The system prompt of the calculator recipes (recipes/gym-chain_sum-t3d1/tool/ppo.yaml writes it out, and the
# tool-call traces of data/make_tool_traces.py are rendered with it; a test keeps the three the same).
CALCULATOR_SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator. To use it, write <tool>calculator(EXPRESSION)</tool>; its "
    "result comes back as <result>VALUE</result>.\nTools:\n" + describe_tools([calculator])
)


# ---------------------------------------------------------------------------------------------
# Feedback: a checkable task as a game
# ---------------------------------------------------------------------------------------------


class Feedback:
    """A checkable task turned into a game: each turn's answer is judged by the task's verifier (`verifier`, the
    run's accuracy_fn); right -> reward 1.0 and the episode ends; wrong -> a reply and another try: "too high"
    / "too low" where the verifier knows the answer and it is a number (a reasoning-gym task folder's
    verifier: `Verifier.entry`), else "not right", and "no answer found" when the turn has no answer. The
    success rate is the share of episodes that end with reward 1 within max_turns."""

    reply_role = "user"

    def __init__(self, verifier: Callable[[list[str], list[str]], list[float]]):
        self.verifier = verifier
        self.prompt, self.answer = "", None

    def reset(self, prompt: str) -> None:
        self.prompt = prompt
        entry = getattr(getattr(self.verifier, "fn", self.verifier), "entry", None)
        found = entry(prompt) if entry is not None else None
        self.answer = _number(str(found["answer"])) if found else None

    def step(self, turn: str) -> Step:
        if self.verifier([self.prompt], [turn])[0] == 1.0:
            return Step(reward=1.0, done=True)
        said = extract_answer(turn, "number")
        guess = _number(said) if said is not None else None
        if guess is None:
            return Step(reply="No answer found. Give the final answer as: Answer: <answer>")
        if self.answer is None or guess == self.answer:
            return Step(reply=f"{said} is not right. Try again.")
        return Step(reply=f"{said} is too {'high' if guess > self.answer else 'low'}. Try again.")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("\u2212", "-"))
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# The table and the loading
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvironmentRow:
    """A shipped environment: its name, what makes one instance (given the run's verifier when `verifier`),
    and what it is."""

    name: str
    make: Callable[..., Any]
    verifier: bool
    summary: str


ENVIRONMENTS = {
    row.name: row
    for row in (
        EnvironmentRow(
            "calculator",
            lambda: calculator_environment(),
            False,
            "a calculator tool: <tool>calculator(3 + 4)</tool> -> <result>7</result>",
        ),
        EnvironmentRow(
            "feedback",
            lambda verifier: Feedback(verifier),  # called as make(verifier=...)
            True,
            "the task's verifier judges each answer; too high / too low, another try",
        ),
    )
}

ENVIRONMENT_FORMS = f"one of {', '.join(ENVIRONMENTS)}, 'module:Class' or 'path/to/file.py:Class'"


def resolve_environment(spec: str) -> tuple[Callable[..., Any], bool]:
    """The class (or a shipped row's maker) `spec` names and whether it takes the run's verifier, checked and
    never built: a user's environment must be a class with callable reset and step whose __init__ needs no
    argument but an optional `verifier`. Every failure is one UserError naming `environment`."""
    if spec in ENVIRONMENTS:
        row = ENVIRONMENTS[spec]
        return row.make, row.verifier
    what = f"environment '{spec}'"
    cls = resolve_callable(spec, "environment", ENVIRONMENT_FORMS, build=False)
    if not inspect.isclass(cls):
        raise UserError(f"{what}: {shown(cls)} is not a class (one instance plays one episode)")
    missing = [m for m in ("reset", "step") if not callable(inspect.getattr_static(cls, m, None))]
    if missing:
        raise UserError(f"{what}: {cls.__name__} has no {' or '.join(missing)} method")
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        parameters = []
    needed = [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "verifier"
    ]
    if needed:
        raise UserError(
            f"{what}: {cls.__name__}() needs {', '.join(needed)}; an environment is built with no arguments "
            "(or verifier=, the run's accuracy_fn)"
        )
    return cls, any(p.name == "verifier" for p in parameters)


def check_environment(spec: str, *, has_verifier: bool) -> None:
    """The config check of `environment:` (before any stage runs): resolved and checked (`resolve_environment`),
    never built; one that judges with the verifier needs accuracy_fn."""
    _, takes_verifier = resolve_environment(spec)
    if takes_verifier and not has_verifier:
        raise UserError(f"environment '{spec}' judges answers with the task's verifier: set accuracy_fn")


# a worker's reply is cut to this many characters per max_reply_tokens before it reaches the trainer
REPLY_CHARS_PER_TOKEN = 64


def environment_factory(spec: str, *, verifier=None, limits=None) -> Callable[[], Any]:
    """What makes one instance of the environment `spec` names (`environment:` of a config): a shipped row, or a
    user's class called with no arguments, or with verifier= when it takes one (`resolve_environment`). Nothing is
    built here: each episode builds its own, bounded (`episodes.run_episodes`). limits: an `EpisodeLimits`;
    with environment_process the instances are built and run in worker processes (`rl.env_workers`)."""
    check_environment(spec, has_verifier=verifier is not None)
    cls, takes_verifier = resolve_environment(spec)

    def make():
        return cls(verifier=verifier) if takes_verifier else cls()

    make.__name__ = spec if spec in ENVIRONMENTS else cls.__name__
    if limits is None or not limits.environment_process:
        return make
    return EnvironmentWorkers(
        make,
        timeout=limits.environment_timeout,
        memory_mb=limits.environment_memory_mb,
        max_reply_chars=REPLY_CHARS_PER_TOKEN * limits.max_reply_tokens,
    )
