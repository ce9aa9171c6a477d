"""Episodes of several turns: the policy writes a turn, its environment replies, the policy writes
the next, until the environment says the episode is over, a turn limit or a token budget.

An environment is any object with

    reset(prompt: str) -> None          a new episode on this prompt (the text a reward function sees)
    step(turn: str) -> Step             the policy's turn (its text, EOS dropped) -> Step(reply, reward, done)

and optionally `stop_strings` (where a turn pauses for the environment: a tool call's end, "</tool>") and
`reply_role` (the chat role of its replies, "user" unless set). One instance plays one episode; the shipped ones
and the loading of a user's are `llm_rlhf.tasks.environments`.

An episode is the token ids the policy sampled and the ids the environment's replies were encoded to,
concatenated in order and never re-tokenized (verl found that re-applying the chat template to the final
messages, instead of keeping the sampled ids, stopped PPO from converging). Its row after the prompt:

    query             | response (R = max_episode_tokens)
    pad q q q         | p p p EOS  e e e e  p p </tool>  e e  p p EOS  pad pad
    response_mask     | T T T T    F F F F  T T T        F F  T T T    F   F      the policy's tokens
    env_mask          | F F F F    T T T T  F F F        T T  F F F    F   F      the environment's
    attention         | 1 1 1 1    1 1 1 1  1 1 1        1 1  1 1 1    0   0      both

A reply after a turn that ended with EOS (the policy ended its message) is a new chat message of `reply_role`
with the template's text around it and the next assistant header (`chat_reply_text`); after a turn that paused
at a stop string (a tool call) the reply follows inline and the policy goes on in the same message. Every
per-token quantity of PPO (the loss, the KL, the entropy, the values, every aggregation) is masked by
response_mask, so the environment's tokens are context the policy reads, never actions it is trained on. GAE
runs over the policy's tokens only (`ppo_math.compute_gae` skips masked positions): the value bootstraps from
the policy's next token across a reply, with one gamma per policy token. A reward the environment gives with a
turn lands on that turn's last token (`env_rewards`).

Bounded: each environment call (building it, reset, step) runs at most `environment_timeout` seconds, the
episodes' calls all at once (`bounded_calls`); a reply is cut to `max_reply_tokens` (its text first to 8
characters a token, so a reply of megabytes is never tokenized whole) and encoded as plain text (`plain_ids`:
markup or an EOS written in a reply never becomes a control token). An environment that raises (SystemExit too),
hangs or returns what `step_problem` refuses (a reply that is not a str, a reward that is not a number within
+-MAX_REWARD, a done that is not a bool) ends its episode there (reward 0 from it, an `env/error_rate` count
and a one-line note on stderr naming the environment, the method and the value); one that never says done is
ended by max_turns or max_episode_tokens. What cannot go on stops the run with a one-line UserError: stop_strings
that are not a list of strings, or a round in which no episode got to its first turn.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llm_rlhf.core.config import require
from llm_rlhf.core.errors import UserError
from llm_rlhf.rl.rollout import Samples, Sampling, left_pad, sample

POLICY, ENVIRONMENT = "policy", "environment"  # who wrote a piece of an episode
CHARS_PER_TOKEN = 8  # a reply's text is cut to max_reply_tokens * this before it is tokenized
MAX_REWARD = 1e6  # an environment's reward per turn at most, in absolute value (`step_problem`)


@dataclass(frozen=True)
class Step:
    """What an environment returns for a policy turn: its reply to the policy (None: nothing to say), a reward
    for that turn (placed on its last token), and whether the episode is over."""

    reply: str | None = None
    reward: float = 0.0
    done: bool = False


# The keys of a PPO or evaluation config that play episodes: (default, help), declared in each Config with
# `help_field(*EPISODE_KEYS[name])`, so the help is written once.
EPISODE_KEYS = {
    "environment": (
        None,
        "Play episodes of several turns with this environment: a shipped one "
        "(calculator, feedback: `llm_rlhf.tasks.environments`), 'module:Class' or 'path/to/file.py:Class' "
        "(a class with reset(prompt) and step(turn) -> Step(reply, reward, done)). The policy's turns "
        "and the environment's replies make one response; only the policy's tokens are trained on; "
        "the environment's rewards land on each turn's last token. null = single responses.",
    ),
    "max_turns": (4, "With an environment: the policy's turns per episode at most."),
    "max_episode_tokens": (
        256,
        "With an environment: the tokens of an episode after the prompt at most, the "
        "policy's and the environment's (each turn at most max_new_tokens of them).",
    ),
    "max_reply_tokens": (
        64,
        "With an environment: one reply's tokens at most (longer ones are cut, '[cut]').",
    ),
    "environment_timeout": (
        10.0,
        "With an environment: seconds one reset or step may take; an environment that "
        "raises or takes longer ends its episode there (a note, the run goes on).",
    ),
    "environment_process": (
        True,
        "With an environment: each episode's environment in a worker process (forked, reused across rounds), "
        "killed and forked again when a call takes longer than environment_timeout, its memory capped by "
        "environment_memory_mb and its replies cut to 64 x max_reply_tokens characters before they reach "
        "the trainer; false: in threads of the trainer (a call that never returns keeps its thread).",
    ),
    "environment_memory_mb": (
        1024,
        "With environment_process: the MiB a worker may allocate beyond its size when forked (RLIMIT_AS, "
        "Linux); past it the call raises MemoryError, reported as the episode's error.",
    ),
}


# seconds a round waits beyond environment_timeout for a worker's answer: the worker's own deadline ends the
# call, a kill included (`env_workers.Worker.call`)
WORKER_GRACE = 5.0


def check_episode_keys(cfg) -> None:
    """The episode keys of a PPO or evaluation config (a ConfigError naming the key)."""
    require(cfg.max_turns >= 1, "max_turns", "must be >= 1")
    require(cfg.max_reply_tokens >= 1, "max_reply_tokens", "must be >= 1")
    require(cfg.environment_timeout > 0, "environment_timeout", "must be > 0 seconds")
    require(cfg.environment_memory_mb >= 1, "environment_memory_mb", "must be >= 1")
    if cfg.environment is None:
        return
    require(
        cfg.max_episode_tokens >= cfg.max_new_tokens,
        "max_episode_tokens",
        f"must be >= max_new_tokens ({cfg.max_new_tokens}): one turn must fit",
    )
    require(
        cfg.min_new_tokens == 0,
        "min_new_tokens",
        "must be 0 with an environment (EOS is masked by response position, which in an episode is not the turn's)",
    )


def episode_keys(cfg) -> dict[str, Any]:
    """The episode keys of a config by name (what an evaluation takes from the PPO run it judges)."""
    return {key: getattr(cfg, key) for key in EPISODE_KEYS}


@dataclass(frozen=True)
class EpisodeLimits:
    """max_turns: policy turns at most; max_episode_tokens: the response's width R, the policy's and the
    environment's tokens together; max_reply_tokens: one reply's tokens at most; environment_timeout: seconds
    one reset or step may take."""

    max_turns: int
    max_episode_tokens: int
    max_reply_tokens: int = 64
    environment_timeout: float = 10.0
    environment_process: bool = False
    environment_memory_mb: int = 1024

    @classmethod
    def of(cls, cfg) -> EpisodeLimits:
        return cls(
            cfg.max_turns,
            cfg.max_episode_tokens,
            cfg.max_reply_tokens,
            cfg.environment_timeout,
            cfg.environment_process,
            cfg.environment_memory_mb,
        )


@dataclass
class Episode:
    """One episode while it is played: its pieces (owner, token ids) in order, the reward of each policy turn,
    how it ended, and what the report shows."""

    environment: Any  # None when building it failed
    name: str = ""  # the environment's class name, for the notes
    pieces: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (response position, reward)
    sampler_logprobs: list[float] = dataclasses.field(default_factory=list)  # one per response position
    turns: int = 0
    done: bool = False  # the environment ended it
    over: bool = False  # no further turn: done, a limit, an error, or a truncated turn
    error: str | None = None

    @property
    def length(self) -> int:
        return sum(len(ids) for _, ids in self.pieces)

    def ids(self) -> list[int]:
        return [t for _, ids in self.pieces for t in ids]


class EnvironmentCallError(Exception):
    """A call to an environment in another process that failed: `reason` is the one line the episode reports."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class InAnotherProcess:
    """An environment run in another process (`env_workers.EnvironmentInWorker`): `name` is its class's name."""

    name: str


def environment_name(environment: Any) -> str:
    """The name an episode's errors give its environment: its class's."""
    return environment.name if isinstance(environment, InAnotherProcess) else type(environment).__name__


def bounded_call(fn: Callable, *args, timeout: float) -> tuple[Any, str | None]:
    """fn(*args) in a daemon thread, waited for at most `timeout` seconds: (result, None), or (None, a one-line
    reason) when it raised (anything, SystemExit included) or did not return in time. A call that hangs is left
    running in its thread (Python cannot stop one); the episode does not wait for it."""
    return bounded_calls([(fn, args)], timeout=timeout)[0]


def bounded_calls(calls: Sequence[tuple[Callable, tuple]], *, timeout: float) -> list[tuple[Any, str | None]]:
    """Each (fn, args) of `calls` in its own daemon thread, all started at once and waited for together, at
    most `timeout` seconds in all: [(result, None) or (None, a one-line reason)] in order (`bounded_call`)."""
    outs: list[dict[str, Any]] = [{} for _ in calls]

    def target(out, fn, args):
        try:
            out["result"] = fn(*args)
        except EnvironmentCallError as e:  # from another process: its own one line
            out["error"] = e.reason
        except BaseException as e:  # the environment's own error (sys.exit too), reported as one line
            out["error"] = f"raised {type(e).__name__}: {one_line(e)}".rstrip(": ")

    threads = [
        threading.Thread(target=target, args=(out, fn, args), daemon=True)
        for out, (fn, args) in zip(outs, calls)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    results: list[tuple[Any, str | None]] = []
    for thread, out in zip(threads, outs):
        if thread.is_alive() or not out:
            results.append((None, f"did not return within {timeout:g} s"))
        elif "error" in out:
            results.append((None, out["error"]))
        else:
            results.append((out["result"], None))
    return results


def one_line(e: BaseException) -> str:
    """The first line of str(e), or a note that str() itself raised."""
    try:
        text = str(e)
    except Exception:
        return "(its message could not be read: str() raised)"
    return text.splitlines()[0] if text else ""


def shown(value: Any, width: int = 40) -> str:
    """repr(value), cut to `width` characters, for a one-line error (a repr that raises is named, not raised)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<a {type(value).__name__} whose repr raised>"
    return text if len(text) <= width else text[: width - 3] + "..."


def step_problem(step: Any) -> str | None:
    """What is wrong with what an environment's step returned, as the end of a one-line error, or None for a
    Step whose reply is a str or None, whose reward is a real number within +-MAX_REWARD (finite in float32,
    the dtype of the rewards and returns, with room for the value loss's squares) and whose done is a bool."""
    if not isinstance(step, Step):
        return f"returned {type(step).__name__} {shown(step)}, not a Step"
    if step.reply is not None and not isinstance(step.reply, str):
        return (
            f"returned a reply of type {type(step.reply).__name__} ({shown(step.reply)}), not a str or None"
        )
    reward = step.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        return f"returned a reward of type {type(reward).__name__} ({shown(reward)}), not a number"
    if not math.isfinite(float(reward)) or abs(float(reward)) > MAX_REWARD:
        return f"returned the reward {float(reward):g}, outside [-{MAX_REWARD:g}, {MAX_REWARD:g}]"
    if type(step.done).__name__ not in ("bool", "bool_"):
        return f"returned done of type {type(step.done).__name__} ({shown(step.done)}), not a bool"
    return None


def reply_role(environment: Any) -> tuple[str, str | None]:
    """The chat role of an environment's replies ("user" unless it sets `reply_role`) and None, or ("", why
    not) when reading it raised or gave no non-empty string."""
    try:
        role = getattr(environment, "reply_role", "user")
    except Exception as e:
        return "", f"reading reply_role raised {type(e).__name__}: {one_line(e)}"
    if not isinstance(role, str) or not role:
        return "", f"has reply_role {shown(role)}, not a non-empty str"
    return role, None


def environment_stop_strings(environment: Any, name: str) -> tuple[str, ...]:
    """An environment's `stop_strings` (none when it has none): a list or tuple of non-empty strings, else a
    UserError naming the environment (a plain string would pause a turn at each of its characters)."""
    try:
        stops = getattr(environment, "stop_strings", ())
    except Exception as e:
        raise UserError(
            f"environment {name}: reading stop_strings raised {type(e).__name__}: {one_line(e)}"
        ) from None
    if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops):
        hint = " (a string, not a list: write ['" + stops + "'])" if isinstance(stops, str) else ""
        raise UserError(
            f"environment {name}: stop_strings must be a list of non-empty strings, got {shown(stops)}{hint}"
        )
    return tuple(stops)


def chat_reply_text(tokenizer, role: str) -> tuple[str, str]:
    """The text the chat template writes between an assistant message that ended with EOS and a new message of
    `role`, and after that message up to the next assistant header: (before, after), from the template itself
    (two placeholder messages rendered, the EOS the policy sampled dropped from `before`). SmolLM2's:

        before "\\n<|im_start|>user\\n"      after "<|im_end|>\\n<|im_start|>assistant\\n"

    A tokenizer without a chat template: ("\\n", "\\n")."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n", "\n"
    said, reply = "ASSISTANT_TURN_7f3a", "REPLY_TURN_7f3a"
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": said}]
    text = tokenizer.apply_chat_template(
        messages + [{"role": role, "content": reply}], tokenize=False, add_generation_prompt=True
    )
    start, middle = text.index(said) + len(said), text.index(reply)
    before, after = text[start:middle], text[middle + len(reply) :]
    eos = tokenizer.eos_token or ""
    return (before[len(eos) :] if eos and before.startswith(eos) else before), after


def plain_ids(tokenizer, text: str) -> list[int]:
    """`text`'s ids as plain text: the text of a special token in it ("<|im_end|>", "<|endoftext|>") is encoded
    as the characters it is, never as the control token, so a reply cannot end a message or forge a turn."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def inline_ids(tokenizer, text: str) -> list[int]:
    """`text`'s plain ids as it is tokenized after other text, where an inline reply goes (after a tool call): a
    tokenizer that prepends a word boundary to every text it encodes (SentencePiece's "▁", Metaspace) would give
    the reply's first word one space more than the environment wrote. So the text is encoded after a newline
    and the newline's own ids dropped, where they are the head of that encoding (else the text alone)."""
    lead = plain_ids(tokenizer, "\n")
    ids = plain_ids(tokenizer, "\n" + text)
    return ids[len(lead) :] if ids[: len(lead)] == lead else plain_ids(tokenizer, text)


def cut_reply(tokenizer, text: str, max_reply_tokens: int) -> str:
    """A reply's text cut to max_reply_tokens tokens (its characters first, `CHARS_PER_TOKEN` a token, so a
    reply of megabytes is never tokenized whole), with " [cut]" where it was."""
    limit = max_reply_tokens * CHARS_PER_TOKEN
    body = text if len(text) <= limit else text[:limit]
    ids = plain_ids(tokenizer, body)
    if len(ids) <= max_reply_tokens and len(body) == len(text):
        return text
    return tokenizer.decode(ids[:max_reply_tokens]) + " [cut]"


def reply_ids(tokenizer, text: str, *, inline: bool, role: str, max_reply_tokens: int) -> list[int]:
    """The token ids of an environment's reply, its text cut to max_reply_tokens tokens (`cut_reply`) and
    encoded as plain text (`plain_ids`): inline (after a stop string) the text as it is tokenized after other
    text (`inline_ids`); else a chat message of
    `role` as the chat template itself writes and tokenizes it after the policy's EOS, the message's frame and
    body joined (`chat_reply_ids`)."""
    body = cut_reply(tokenizer, text, max_reply_tokens)
    return inline_ids(tokenizer, body) if inline else chat_reply_ids(tokenizer, body, role)


def chat_reply_ids(tokenizer, body: str, role: str) -> list[int]:
    """The ids that follow an assistant message's EOS when the chat template renders a message of `role`
    holding `body` and the next assistant header: the conversation [user, assistant, role] is tokenized by the
    template with the messages' control tokens sanitized (`apply_chat_template(sanitize_control_tokens=True)`:
    only the template's own markup becomes control tokens), and the ids after the assistant's text and EOS are
    the reply's. So the frame and the body are tokenized together, as the template does (a prefix-space
    tokenizer gives the body no extra leading space). Without a chat template: "\n" + body + "\n" as plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return plain_ids(tokenizer, f"\n{body}\n")
    said = "ASSISTANT_TURN_7f3a."
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": said}]
    full = tokenizer.apply_chat_template(
        messages + [{"role": role, "content": body}],
        tokenize=True,
        add_generation_prompt=True,
        sanitize_control_tokens=True,
        return_dict=True,
    )["input_ids"]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    prefix = tokenizer(rendered[: rendered.index(said) + len(said)], add_special_tokens=False)["input_ids"]
    if full[: len(prefix)] != prefix:  # the template merged the assistant's text with what follows
        before, after = chat_reply_text(tokenizer, role)
        enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731  the template's markup
        return enc(before) + plain_ids(tokenizer, body) + enc(after)
    rest = full[len(prefix) :]
    return rest[1:] if rest and rest[0] == tokenizer.eos_token_id else rest


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


@torch.no_grad()
def run_episodes(
    lm,
    tokenizer,
    queries: Sequence[list[int]],
    make_environment: Callable[[], Any],
    sampling: Sampling,
    limits: EpisodeLimits,
    *,
    device=None,
    agree: Callable[[bool, int], tuple[bool, int]] | None = None,
) -> tuple[Samples, list[Episode]]:
    """Play one episode per query, each with a fresh environment from `make_environment`, and return the
    episodes as `Samples` (the layout of the module docstring: R = max_episode_tokens on every row, env_mask and
    env_rewards set) and the `Episode`s (pieces, turns, errors) for the statistics and the report.

    The environments are built and reset all at once, each call bounded (`bounded_calls`); one that fails ends
    its episode before its first turn. Each turn samples the next policy turn of every unfinished episode in one
    `rollout.sample` call on its whole context so far (the prompt and every piece, left-padded), at most
    sampling.max_new_tokens and the episode's remaining budget, pausing also at the environment's stop strings
    (`environment_stop_strings`); the turns' steps run all at once too. Draws come from the global RNG, turn
    after turn. agree: (whether this process has an unfinished episode, its turn's width) -> whether some
    episode anywhere is unfinished and the widest turn of any process (one gather over the processes a turn);
    a process whose episodes are all over then samples one throw-away row, and every process samples the same
    width, so every process runs as many sampling calls and decode steps, as sharded forwards (ZeRO-3, FSDP2)
    need (`fast_sampling.steps_on_every_process`); one process computes that width over all the rows too."""
    tokens_left, timeout = limits.max_episode_tokens, limits.environment_timeout
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    name = getattr(make_environment, "__name__", type(make_environment).__name__)
    prepare = getattr(make_environment, "prepare", None)  # environments in worker processes (`env_workers`)
    if prepare is not None:
        prepare(len(queries))  # a worker per episode, forked here, before any thread
        timeout += WORKER_GRACE  # each call is bounded by the worker's own deadline, a kill included
    built = bounded_calls([(make_environment, ())] * len(queries), timeout=timeout)
    episodes = [
        Episode(environment=env, name=environment_name(env) if error is None else name)
        for env, error in built
    ]
    for episode, (_, error) in zip(episodes, built):
        if error is not None:
            end_with_error(episode, f"building it {error}")
    first = next((e for e in episodes if e.error is None), None)
    stops = tuple(sampling.stop_strings) + (
        environment_stop_strings(first.environment, first.name) if first else ()
    )
    with_sampler = True  # the sampler gave its log q(y_t) at every turn (the fast sampler does)
    live = [i for i, e in enumerate(episodes) if not e.over]
    prompts = [tokenizer.decode(queries[i], skip_special_tokens=False) for i in live]
    resets = bounded_calls(
        [(episodes[i].environment.reset, (p,)) for i, p in zip(live, prompts)], timeout=timeout
    )
    for i, (_, error) in zip(live, resets):
        if error is not None:
            end_with_error(episodes[i], f"reset {error}")
    while True:
        rows = [i for i, e in enumerate(episodes) if not e.over]
        budget = {i: tokens_left - episodes[i].length for i in rows}
        width = max([min(sampling.max_new_tokens, b) for b in budget.values()] or [1])
        active = bool(rows)
        if agree is not None:  # every process: the same turns and widths
            active, width = agree(active, width)
        if not active:
            break
        turn_sampling = dataclasses.replace(sampling, max_new_tokens=width, stop_strings=stops)
        contexts = [list(queries[i]) + episodes[i].ids() for i in rows] or [
            list(queries[0])
        ]  # throw-away row
        query, query_mask = left_pad(contexts, pad, device)  # (b, P_turn)
        out = sample(lm, tokenizer, query, query_mask, turn_sampling)
        with_sampler = with_sampler and out.sampler_logprobs is not None
        turns = {}
        for j, i in enumerate(rows):
            mask = out.response_mask[j]  # (w,) the turn's tokens, up to its EOS or stop string
            ids = out.response[j][mask].tolist()[: budget[i]]
            logprobs = (
                [] if out.sampler_logprobs is None else out.sampler_logprobs[j][mask].tolist()[: budget[i]]
            )
            ended_eos = bool(ids) and ids[-1] == eos
            paused = bool(out.stopped[j]) and len(ids) == int(mask.sum())
            text = add_turn(episodes[i], ids, logprobs, tokenizer, ended_eos=ended_eos, paused=paused)
            if text is not None:
                turns[i] = (text, ended_eos)
        steps = bounded_calls(
            [(episodes[i].environment.step, (text,)) for i, (text, _) in turns.items()], timeout=timeout
        )
        for (i, (_, ended_eos)), (step, error) in zip(turns.items(), steps):
            take_step(episodes[i], step, error, tokenizer, limits, ended_eos=ended_eos)
    samples = episodes_to_samples(episodes, queries, tokenizer, limits, device)
    if not with_sampler:
        samples.sampler_logprobs = None
    return samples, episodes


def add_turn(
    episode: Episode, ids: list[int], logprobs: list[float], tokenizer, *, ended_eos, paused
) -> str | None:
    """Append the policy's turn to `episode` and return its text (EOS dropped) for the environment's step, or
    None when the turn ends the episode without a step: a turn that neither ended with EOS nor paused at a stop
    string was truncated (max_new_tokens or the budget)."""
    episode.pieces.append((POLICY, ids))
    episode.sampler_logprobs += logprobs or [0.0] * len(ids)
    episode.turns += 1
    if not ids or not (ended_eos or paused):
        episode.over = True
        return None
    eos = tokenizer.eos_token_id
    return tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)


def take_step(episode: Episode, step: Any, error: str | None, tokenizer, limits, *, ended_eos: bool) -> None:
    """What the environment's step on the latest turn (`add_turn`) returned, `bounded_call`'s (step, error):
    the turn's reward on its last token, the episode's end, or its reply appended (`reply_ids`). A step that
    failed, or returned something `step_problem` refuses, ends the episode with a note (`end_with_error`)."""
    error = error or step_problem(step)
    if error is not None:
        end_with_error(episode, f"step {error}")
        return
    if step.reward:
        episode.rewards.append((episode.length - 1, float(step.reward)))  # on the turn's last token
    if step.done:
        episode.done = episode.over = True
        return
    if episode.turns >= limits.max_turns or step.reply is None and ended_eos:
        episode.over = True  # the turn limit, or nothing to say to a finished message
        return
    role, error = reply_role(episode.environment)
    if error is not None:
        end_with_error(episode, error)
        return
    reply = reply_ids(
        tokenizer, step.reply or "", inline=not ended_eos, role=role, max_reply_tokens=limits.max_reply_tokens
    )
    if episode.length + len(reply) >= limits.max_episode_tokens:  # no room left for the policy to answer
        episode.over = True
        return
    episode.pieces.append((ENVIRONMENT, reply))
    episode.sampler_logprobs += [0.0] * len(reply)


def end_with_error(episode: Episode, reason: str) -> None:
    """The environment failed: the episode ends here with what it has, and the user reads one line."""
    episode.error = reason
    episode.over = True
    note(f"environment {episode.name} {reason}; its episode ends at turn {episode.turns}, the run goes on")


def no_turn_played(episodes: Sequence[Episode]) -> str:
    """The one-line error of a round in which no episode, on any process, got to a policy token: nothing to
    train on or to judge, so the run stops (its last checkpoint stays)."""
    failed = next((e for e in episodes if e.error is not None), None)
    why = f"; the first failure: {failed.name} {failed.error}" if failed else ""
    return f"environment: no episode of this round got to the policy's first token{why}"


def episodes_to_samples(episodes, queries, tokenizer, limits: EpisodeLimits, device) -> Samples:
    """The played episodes as one `Samples` (the module docstring's layout): response, response_mask (the
    policy's tokens), env_mask (the environment's), env_rewards (each turn's reward on its last token),
    sampler_logprobs (the sampler's log q of the policy's tokens, 0 elsewhere), stopped (the environment ended
    the episode), all (B, R) with R = max_episode_tokens, and turns (B,)."""
    B, R, pad = len(episodes), limits.max_episode_tokens, tokenizer.pad_token_id
    query, query_mask = left_pad(list(queries), pad, device)  # (B, P)
    response = torch.full((B, R), pad, dtype=torch.long)  # (B, R)
    policy = torch.zeros((B, R), dtype=torch.bool)
    env = torch.zeros((B, R), dtype=torch.bool)
    rewards = torch.zeros((B, R))
    sampler = torch.zeros((B, R))
    for b, episode in enumerate(episodes):
        t = 0
        for owner, ids in episode.pieces:
            response[b, t : t + len(ids)] = torch.tensor(ids, dtype=torch.long)
            (policy if owner == POLICY else env)[b, t : t + len(ids)] = True
            t += len(ids)
        for position, reward in episode.rewards:
            rewards[b, position] += reward
        sampler[b, : len(episode.sampler_logprobs)] = torch.tensor(episode.sampler_logprobs)
    return Samples(
        query=query,
        query_mask=query_mask,
        response=response.to(device),
        response_mask=policy.to(device),
        stopped=torch.tensor([e.done for e in episodes], device=device),
        sampler_logprobs=sampler.to(device),
        env_mask=env.to(device),
        env_rewards=rewards.to(device),
        turns=torch.tensor([e.turns for e in episodes], device=device),
    )


def transcript(episode: Episode, tokenizer) -> list[dict[str, str]]:
    """The episode as turns for the report: [{"role": "policy" | "environment", "text": ...}], each piece
    decoded on its own (special tokens kept for the environment's, so the chat frame shows)."""
    return [
        {"role": owner, "text": tokenizer.decode(ids, skip_special_tokens=owner == POLICY)}
        for owner, ids in episode.pieces
    ]


# ---------------------------------------------------------------------------------------------
# Evaluation's view of episodes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodePlay:
    """What an evaluation needs to play episodes as PPO does: a maker of fresh environment instances and the
    limits (`measures.PairedSampling.play`)."""

    make_environment: Callable[[], Any]
    limits: EpisodeLimits


def episode_record(episode: Episode, tokenizer) -> dict[str, Any]:
    """An evaluation record's episode keys: turns (the transcript, `transcript`), num_turns, env_reward (the sum
    of its turns' rewards), env_done (the environment ended it), env_error (None or the one-line reason), and
    for a tool environment (`calls`, `used`) tool_calls and tool_answer_used (its final answer is a number a
    tool returned); None where the environment has no tools."""
    env = episode.environment
    return {
        "turns": transcript(episode, tokenizer),
        "num_turns": episode.turns,
        "env_reward": sum(r for _, r in episode.rewards),
        "env_done": episode.done,
        "env_error": episode.error,
        "tool_calls": getattr(env, "calls", None),
        "tool_answer_used": getattr(env, "used", None),
    }


EPISODE_ROW_KEYS = (
    "turns",
    "num_turns",
    "env_reward",
    "tool_calls",
    "tool_answer_used",
)  # in PPO's eval_samples
EPISODE_FIGURES = (
    "turns_mean",
    "env_reward_mean",
    "env_success_rate",
    "tool_call_rate",
    "tool_answer_used_rate",
)


def episode_figures(records: list[dict[str, Any]], suffix: str = "") -> dict[str, float | None]:
    """`EPISODE_FIGURES` (+ suffix) over one model's records: the policy's turns per episode, the environment's
    reward per episode, the share of episodes it ended with a positive reward (a game won), the share with a
    tool call and the share whose final answer is a number a tool returned; None without episodes (the tool
    figures None without a tool environment)."""
    played = [r for r in records if r.get("num_turns") is not None]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    tools = [r for r in played if r["tool_calls"] is not None]
    values = (
        mean([r["num_turns"] for r in played]),
        mean([r["env_reward"] for r in played]),
        mean([float(r["env_done"] and r["env_reward"] > 0) for r in played]),
        mean([float(r["tool_calls"] > 0) for r in tools]),
        mean([float(bool(r["tool_answer_used"])) for r in tools]),
    )
    return {key + suffix: value for key, value in zip(EPISODE_FIGURES, values)}
