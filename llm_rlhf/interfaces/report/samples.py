"""Tables of responses: the evaluation's before / after pairs (eval/samples.jsonl) and PPO's logged samples
(ppo/samples.jsonl).
"""

from __future__ import annotations

import html
from typing import Any

from llm_rlhf.evaluation.metric_names import (
    COMBINED_SCORE,
    CORRECT,
    EOS,
    FLUENCY_PERPLEXITY,
    GOLD_SCORE,
    GREEDY_CORRECT,
    GREEDY_RESPONSE,
    KL_TO_REF,
    LENGTH,
    PROMPT,
    RESPONSE,
    REWARD_FN,
    RM_SCORE,
    SAMPLE,
    SENTIMENT,
    side,
)
from llm_rlhf.interfaces.report.numbers import num
from llm_rlhf.interfaces.report.page import num_cell
from llm_rlhf.ppo import metrics as ppo_metrics

TURNS = (
    "turns"  # an episode's transcript: eval_samples.jsonl; policy_turns and baseline_turns in samples.jsonl
)

SAMPLE_ROWS = 20  # rows of each sample table
SCORES_SHOWN = (  # (eval/samples.jsonl field, its name under a response, format)
    (GOLD_SCORE, "gold", "+.2f"),
    (SENTIMENT, "sentiment", "+.2f"),
    (FLUENCY_PERPLEXITY, "perplexity", ".3g"),
    (RM_SCORE, "RM", "+.2f"),
    (REWARD_FN, "reward fn", "+.3g"),
    (COMBINED_SCORE, "PPO score", "+.2f"),
    (KL_TO_REF, "KL", ".2f"),
)


def sample_value(value: Any) -> float | None:
    """A samples.jsonl field as a number: eos (a bool) counts 1 or 0."""
    return float(value) if isinstance(value, bool) else num(value)


def _verdict(value: Any) -> str:
    """A sample's correctness (a verifier's 1.0 or 0.0) as a tag; none when the sample was not checked."""
    correct = sample_value(value)
    if correct is None:
        return ""
    return '<span class="ok">✓ correct</span>' if correct > 0 else '<span class="wrong">✗ incorrect</span>'


def _scores_line(row: dict, who: str) -> str:
    """The few scores that matter for one side of a sample: whether it is correct (a task with a verifier),
    gold (and its parts), the proxy, length/EOS."""
    items = []
    for field_name, name, spec in SCORES_SHOWN:
        value = num(row.get(side(who, field_name)))
        if value is not None:
            items.append(f"{name} {format(value, spec)}")
    length, eos = num(row.get(side(who, LENGTH))), row.get(side(who, EOS))
    if length is not None:
        items.append(f"{length:g} tokens" + (", no EOS" if eos is False else ""))
    verdict = _verdict(row.get(side(who, CORRECT)))
    return f'<span class="scores">{verdict}{" · " if verdict and items else ""}{html.escape(" · ".join(items))}</span>'


def shown_text(value: Any) -> str:
    """A response or prompt as it was written (whitespace kept by the CSS), escaped; an empty one marked."""
    text = "" if value is None else str(value)
    return html.escape(text) if text.strip() else '<span class="empty">(empty)</span>'


def shown_turns(turns: list[dict] | None) -> str | None:
    """An episode of several turns as its turns, the policy's and the environment's told apart (a label
    and a tinted block for the environment's); None for a single response."""
    if not turns:
        return None
    return "".join(
        f'<span class="turn {html.escape(str(t.get("role")))}"><span class="who">{html.escape(str(t.get("role")))}'
        f"</span>{shown_text(t.get('text'))}</span>"
        for t in turns
    )


def _greedy(row: dict, who: str) -> str:
    """One side's greedy response to the prompt and whether it is correct (eval/samples.jsonl holds it on a
    prompt's first sample alone: nothing on the others)."""
    response = row.get(side(who, GREEDY_RESPONSE))
    if response is None:
        return ""
    verdict = _verdict(row.get(side(who, GREEDY_CORRECT)))
    return (
        f'<span class="greedy"><span class="key">greedy</span>{shown_text(response)}'
        f'{f"""<span class="scores">{verdict}</span>""" if verdict else ""}</span>'
    )


def pair_samples_table(rows: list[dict], limit: int = SAMPLE_ROWS, baseline: str = "SFT baseline") -> str:
    """Per held-out prompt: the prompt across the table, then the baseline's and the policy's responses side
    by side, each with its few scores under it and, where there is one, its greedy response (every field stays
    in eval/samples.jsonl)."""
    body = []
    for row in rows[:limit]:
        sample = f' <span class="key">sample {row[SAMPLE]}</span>' if num(row.get(SAMPLE)) else ""
        body.append(f'<tr class="prompt"><td colspan="2">{shown_text(row.get(PROMPT))}{sample}</td></tr>')
        body.append(
            "<tr>"
            + "".join(
                f'<td><span class="response">{shown_turns(row.get(side(who, TURNS))) or shown_text(row.get(side(who, RESPONSE)))}</span>{_scores_line(row, who)}'
                f"{_greedy(row, who)}</td>"
                for who in ("baseline", "policy")
            )
            + "</tr>"
        )
    return (
        f'<table class="texts pairs">\n<tr><th>{html.escape(baseline[:1].upper() + baseline[1:])}</th><th>PPO policy</th></tr>\n'
        + "\n".join(body)
        + "\n</table>"
    )


def plural(n, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def episodes_table(rows: list[dict], limit: int = 8) -> str:
    """PPO's held-out episodes of one evaluation (ppo/eval_samples.jsonl rows with `turns`): prompt, the episode as
    turns, and its reward function's score (the verifier's, on a task), turns and tool calls."""
    body = []
    for row in rows[:limit]:
        facts = [plural(row.get("num_turns"), "turn")]
        if num(row.get("reward_fn")) is not None:
            facts.insert(0, f"reward_fn {num(row['reward_fn']):g}")
        if row.get("tool_calls") is not None:
            facts.append(
                plural(row["tool_calls"], "tool call")
                + (", answer from the tool" if row.get("tool_answer_used") else "")
            )
        if row.get("env_reward"):
            facts.append(f"environment reward {num(row['env_reward']):g}")
        body.append(
            f'<tr><td class="prompt-text">{shown_text(row.get(PROMPT))}</td><td>{shown_turns(row.get(TURNS))}'
            f'<span class="scores">{html.escape(" · ".join(facts))}</span></td></tr>'
        )
    return (
        '<table class="texts ppo-samples">\n<tr><th>prompt</th><th>episode</th></tr>\n'
        + "\n".join(body)
        + "\n</table>"
    )


def ppo_samples_table(rows: list[dict], limit: int = 10) -> str:
    """PPO's logged samples (ppo/samples.jsonl): prompt, response, the score PPO gave it."""
    body = [
        f"<tr><td>{shown_text(r.get(ppo_metrics.SAMPLE_QUERY))}</td><td>{shown_text(r.get(ppo_metrics.SAMPLE_RESPONSE))}</td>"
        f"{num_cell(num(r.get(ppo_metrics.SAMPLE_SCORE)), '+.3f')}</tr>"
        for r in rows[:limit]
    ]
    return (
        '<table class="texts ppo-samples">\n<tr><th>prompt</th><th>response</th><th>score</th></tr>\n'
        + "\n".join(body)
        + "\n</table>"
    )
