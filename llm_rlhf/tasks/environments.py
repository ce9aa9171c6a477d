"""Environments for episodes of several turns (the episode itself: `llm_rlhf.rl.episodes`).

A recipe names its environment as it names a reward function:

    environment: calculator                    a shipped one, a row of `ENVIRONMENTS`
    environment: my_envs.py:Maze               a user's class (or any callable that makes one instance)

An environment is a class with `reset(prompt)` and `step(turn) -> Step(reply, reward, done)` (the module
docstring of `llm_rlhf.rl.episodes`); one instance plays one episode, so it keeps its episode's state on
`self`. A user's class is built with no arguments, or with `verifier=` (the run's loaded accuracy_fn: a
callable (prompts, responses) -> 1.0 / 0.0) when its __init__ takes one. A few lines are enough:

    from llm_rlhf.rl.episodes import Step

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
from typing import Any

from llm_rlhf.core.callables import resolve_callable
from llm_rlhf.core.errors import UserError
from llm_rlhf.rl.episodes import Step
from llm_rlhf.tasks.gym import extract_answer

# ---------------------------------------------------------------------------------------------
# The calculator: arithmetic parsed by hand
# ---------------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15  # larger intermediate values are an error, not a bignum the model never needs
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * /, parentheses, unary minus. Example: 3 + 4 * (2 - 7)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    value = _Parser(expression.replace("\u2212", "-").replace("×", "*").replace("÷", "/")).parse()
    if value == int(value):
        return str(int(value))
    return f"{value:.6g}"


class _Parser:
    """Recursive descent over  expr := term (('+'|'-') term)*;  term := factor (('*'|'/') factor)*;
    factor := ('+'|'-') factor | NUMBER | '(' expr ')'.  Floats throughout; nothing is evaluated as Python."""

    def __init__(self, text: str):
        self.tokens: list[tuple[str, Any]] = []
        for number, other in _TOKEN.findall(text):
            if number:
                self.tokens.append(("num", float(number)))
            elif other.strip():
                if other not in "+-*/()":
                    raise ValueError(f"unexpected character {other!r}")
                self.tokens.append(("op", other))
        self.i = 0

    def parse(self) -> float:
        if not self.tokens:
            raise ValueError("empty expression")
        value = self.expr(depth=0)
        if self.i != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.i][1]!r}")
        return value

    def peek(self):
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def expr(self, depth: int) -> float:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.tokens[self.i][1]
            self.i += 1
            value = _checked(value + self.term(depth) if op == "+" else value - self.term(depth))
        return value

    def term(self, depth: int) -> float:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.tokens[self.i][1]
            self.i += 1
            right = self.factor(depth)
            if op == "/" and right == 0:
                raise ValueError("division by zero")
            value = _checked(value * right if op == "*" else value / right)
        return value

    def factor(self, depth: int) -> float:
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


def _checked(value: float) -> float:
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
            lambda verifier: Feedback(verifier),
            True,
            "the task's verifier judges each answer; too high / too low, another try",
        ),
    )
}

ENVIRONMENT_FORMS = f"one of {', '.join(ENVIRONMENTS)}, 'module:Class' or 'path/to/file.py:Class'"


def environment_factory(spec: str, *, verifier=None) -> Callable[[], Any]:
    """What makes one instance of the environment `spec` names (`environment:` of a config): a shipped row, or a
    user's class (or function) called with no arguments, or with verifier= when it takes one. Every failure is
    one UserError naming `environment`; the first instance is built (and checked for reset and step) here."""
    if spec in ENVIRONMENTS:
        row = ENVIRONMENTS[spec]
        if row.verifier and verifier is None:
            raise UserError(f"environment '{spec}' judges answers with the task's verifier: set accuracy_fn")
        make = (lambda: row.make(verifier)) if row.verifier else row.make
    else:
        cls = resolve_callable(spec, "environment", ENVIRONMENT_FORMS, build=False)
        takes_verifier = "verifier" in _parameters(cls)
        if takes_verifier and verifier is None:
            raise UserError(f"environment '{spec}' takes a verifier: set accuracy_fn")
        make = (lambda: cls(verifier=verifier)) if takes_verifier else cls
    try:
        first = make()
    except Exception as e:
        raise UserError(f"environment '{spec}': building it raised {type(e).__name__}: {e}") from e
    missing = [m for m in ("reset", "step") if not callable(getattr(first, m, None))]
    if missing:
        raise UserError(f"environment '{spec}': {type(first).__name__} has no {' or '.join(missing)} method")
    return make


def _parameters(cls) -> Sequence[str]:
    try:
        return list(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return []
