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

Bounded: each environment call runs at most `environment_timeout` seconds (`bounded_call`); a reply is cut to
`max_reply_tokens` (its text first to 8 characters a token, so a reply of megabytes is never tokenized whole);
an environment that raises or hangs ends its episode there (reward 0 from it, an `env/errors` count and a
one-line note on stderr), one that never says done is ended by max_turns or max_episode_tokens.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llm_rlhf.core.config import require
from llm_rlhf.rl.rollout import Samples, Sampling, left_pad, sample

POLICY, ENVIRONMENT = "policy", "environment"  # who wrote a piece of an episode
CHARS_PER_TOKEN = 8  # a reply's text is cut to max_reply_tokens * this before it is tokenized


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
}


def check_episode_keys(cfg) -> None:
    """The episode keys of a PPO or evaluation config (a ConfigError naming the key)."""
    require(cfg.max_turns >= 1, "max_turns", "must be >= 1")
    require(cfg.max_reply_tokens >= 1, "max_reply_tokens", "must be >= 1")
    require(cfg.environment_timeout > 0, "environment_timeout", "must be > 0 seconds")
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

    @classmethod
    def of(cls, cfg) -> EpisodeLimits:
        return cls(cfg.max_turns, cfg.max_episode_tokens, cfg.max_reply_tokens, cfg.environment_timeout)


@dataclass
class Episode:
    """One episode while it is played: its pieces (owner, token ids) in order, the reward of each policy turn,
    how it ended, and what the report shows."""

    environment: Any
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


def bounded_call(fn: Callable, *args, timeout: float) -> tuple[Any, str | None]:
    """fn(*args) in a daemon thread, waited for at most `timeout` seconds: (result, None), or (None, a one-line
    reason) when it raised or did not return in time. A call that hangs is left running in its thread (Python
    cannot stop one); the episode does not wait for it."""
    out: dict[str, Any] = {}

    def target():
        try:
            out["result"] = fn(*args)
        except Exception as e:  # the environment's own error, reported as one line
            out["error"] = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(
                ": "
            )

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return None, f"did not return within {timeout:g} s"
    if "error" in out:
        return None, out["error"]
    return out.get("result"), None


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


def reply_ids(tokenizer, text: str, *, inline: bool, role: str, max_reply_tokens: int) -> list[int]:
    """The token ids of an environment's reply: inline (after a stop string) its text alone, else wrapped as a
    chat message of `role` (`chat_reply_text`); the reply's own text cut to max_reply_tokens tokens (its
    characters first, `CHARS_PER_TOKEN` a token, then its tokens), with " [cut]" where it was."""
    limit = max_reply_tokens * CHARS_PER_TOKEN
    body = text if len(text) <= limit else text[:limit]
    ids = tokenizer(body, add_special_tokens=False)["input_ids"]
    if len(ids) > max_reply_tokens or len(body) < len(text):
        ids = ids[:max_reply_tokens] + tokenizer(" [cut]", add_special_tokens=False)["input_ids"]
    if inline:
        return ids
    before, after = chat_reply_text(tokenizer, role)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(before) + ids + enc(after)


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


@torch.no_grad()
def run_episodes(
    lm,
    tokenizer,
    queries: Sequence[list[int]],
    environments: Sequence[Any],
    sampling: Sampling,
    limits: EpisodeLimits,
    *,
    device=None,
    any_active: Callable[[bool], bool] | None = None,
) -> tuple[Samples, list[Episode]]:
    """Play one episode per query with its environment (fresh instances, one each) and return the episodes
    as `Samples` (the layout of the module docstring: R = max_episode_tokens on every row, env_mask and
    env_rewards set) and the `Episode`s (pieces, turns, errors) for the statistics and the report.

    Each turn samples the next policy turn of every unfinished episode in one `rollout.sample` call on its
    whole context so far (the prompt and every piece, left-padded), at most sampling.max_new_tokens and the
    episode's remaining budget, pausing also at the environment's stop strings. Draws come from the global RNG,
    turn after turn. any_active: agrees over the processes whether some episode anywhere is unfinished (a
    global sum); under ZeRO-3 a process whose episodes are all over then samples one throw-away row, so every
    process runs as many sampling calls (`fast_sampling.steps_on_every_process`)."""
    tokens_left = limits.max_episode_tokens
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    stops = tuple(sampling.stop_strings) + tuple(getattr(environments[0], "stop_strings", ()))
    episodes = [Episode(environment=env) for env in environments]
    with_sampler = True  # the sampler gave its log q(y_t) at every turn (the fast sampler does)
    decode_prompt = [tokenizer.decode(q, skip_special_tokens=False) for q in queries]
    for episode, prompt in zip(episodes, decode_prompt):
        _, error = bounded_call(episode.environment.reset, prompt, timeout=limits.environment_timeout)
        if error is not None:
            end_with_error(episode, f"reset {error}")
    while True:
        rows = [i for i, e in enumerate(episodes) if not e.over]
        if any_active is not None and not any_active(bool(rows)):
            break
        if any_active is None and not rows:
            break
        budget = {i: tokens_left - episodes[i].length for i in rows}
        width = max([min(sampling.max_new_tokens, b) for b in budget.values()] or [1])
        turn_sampling = dataclasses.replace(sampling, max_new_tokens=width, stop_strings=stops)
        contexts = [list(queries[i]) + episodes[i].ids() for i in rows] or [
            list(queries[0])
        ]  # throw-away row
        query, query_mask = left_pad(contexts, pad, device)  # (b, P_turn)
        out = sample(lm, tokenizer, query, query_mask, turn_sampling)
        with_sampler = with_sampler and out.sampler_logprobs is not None
        for j, i in enumerate(rows):
            mask = out.response_mask[j]  # (w,) the turn's tokens, up to its EOS or stop string
            ids = out.response[j][mask].tolist()[: budget[i]]
            logprobs = (
                [] if out.sampler_logprobs is None else out.sampler_logprobs[j][mask].tolist()[: budget[i]]
            )
            ended_eos = bool(ids) and ids[-1] == eos
            paused = bool(out.stopped[j]) and len(ids) == int(mask.sum())
            play_turn(episodes[i], ids, logprobs, tokenizer, limits, ended_eos=ended_eos, paused=paused)
    samples = episodes_to_samples(episodes, queries, tokenizer, limits, device)
    if not with_sampler:
        samples.sampler_logprobs = None
    return samples, episodes


def play_turn(
    episode: Episode, ids: list[int], logprobs: list[float], tokenizer, limits, *, ended_eos, paused
):
    """Append the policy's turn to `episode`, let its environment step on it, append the reply: a turn that
    neither ended with EOS nor paused at a stop string was truncated (max_new_tokens or the budget) and ends
    the episode without a step."""
    start = episode.length
    episode.pieces.append((POLICY, ids))
    episode.sampler_logprobs += logprobs or [0.0] * len(ids)
    episode.turns += 1
    if not ids or not (ended_eos or paused):
        episode.over = True
        return
    eos = tokenizer.eos_token_id
    text = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
    env = episode.environment
    step, error = bounded_call(env.step, text, timeout=limits.environment_timeout)
    if error is None and not isinstance(step, Step):
        error = f"returned {type(step).__name__}, not a Step"
    if error is not None:
        end_with_error(episode, f"step {error}")
        return
    reward = float(step.reward)
    if reward != reward or reward in (float("inf"), float("-inf")):
        end_with_error(episode, f"step returned a non-finite reward {reward}")
        return
    if reward:
        episode.rewards.append((start + len(ids) - 1, reward))  # on the turn's last token
    if step.done:
        episode.done = episode.over = True
        return
    if episode.turns >= limits.max_turns or step.reply is None and ended_eos:
        episode.over = True  # the turn limit, or nothing to say to a finished message
        return
    role = getattr(env, "reply_role", "user")
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
    name = type(episode.environment).__name__
    episode.error = reason
    episode.over = True
    note(f"environment {name} {reason}; its episode ends at turn {episode.turns}, the run goes on")


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
