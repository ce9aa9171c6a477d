"""Section 5, the reward-hacking watch: the samples the proxy likes far more than the gold, and the
degeneracy counters (`llm_rlhf.rl.hacking`).
"""

from __future__ import annotations

import html

import numpy as np

from llm_rlhf.interfaces.report.accuracy import accuracy_logged
from llm_rlhf.interfaces.report.cards import accuracy_cards
from llm_rlhf.interfaces.report.figures import new_figure, no_data, nth_color
from llm_rlhf.interfaces.report.numbers import first_of, num, series
from llm_rlhf.interfaces.report.page import Page, num_cell, pct, table
from llm_rlhf.interfaces.report.runs import Run, baseline_name, final_value
from llm_rlhf.interfaces.report.samples import shown_text
from llm_rlhf.rl.hacking import (
    CHAR_RUN_RATE,
    DEGENERACY_KEYS,
    EMPTY_RATE,
    PROXY,
    REPEATED_NGRAM_RATE,
    degeneracy_flags,
    degeneracy_rates,
    standardised_gaps,
)
from llm_rlhf.stages.eval_metrics import (
    BASELINE,
    COMBINED_SCORE,
    GOLD_SCORE,
    KL_TO_REF,
    LOG_KL,
    LOG_STEP,
    PROMPT,
    RESPONSE,
    RM_SCORE,
    side,
)

WATCH_TOP = 3  # samples shown per evaluation

WATCH_OPEN = 5  # evaluations shown open (the final and the latest PPO ones); the rest collapsed

DEGENERACY_NAMES = {
    CHAR_RUN_RATE: "a run of one character (4+)",
    REPEATED_NGRAM_RATE: "a repeated word 3-gram",
    EMPTY_RATE: "empty",
}


def watched_evaluations(run: Run) -> list[dict]:
    """Every evaluation with per-sample scores, newest first: the final one (eval/samples.jsonl, the policy's
    side), then PPO's held-out evaluations (ppo/eval_samples.jsonl), latest step first. Each is a dict: label,
    kl, reference (what its gaps are standardised by), samples (dicts: prompt, response, proxy, gold, gap; gap
    None without a gold or a proxy), proxy_mean, gold_mean and the degeneracy rates of its responses; the
    final one also `baseline`, the same figures of the SFT baseline's samples.

    The proxy is the score PPO maximised: the combined score with a reward function, else the RM's. The gap
    is `hacking.standardised_gaps` against the SFT model's samples: the baseline's in the final evaluation,
    PPO's step-0 evaluation (the policy is the SFT model then) for PPO's; the evaluation's own without them."""
    return [*final_evaluation(run), *ppo_evaluations(run)]


def final_evaluation(run: Run) -> list[dict]:
    """The final evaluation of `watched_evaluations` (eval/samples.jsonl), its SFT baseline's under
    `baseline`; none without the samples."""
    rows = run.eval_samples
    if not rows:
        return []
    sides = {
        who: (
            [{"prompt": r.get(PROMPT), "response": r.get(side(who, RESPONSE))} for r in rows],
            [first_of(num(r.get(side(who, COMBINED_SCORE))), num(r.get(side(who, RM_SCORE)))) for r in rows],
            [num(r.get(side(who, GOLD_SCORE))) for r in rows],
        )
        for who in ("policy", "baseline")
    }
    baseline = sides["baseline"]
    final = _watched("final evaluation", final_value(run, "eval", KL_TO_REF), *sides["policy"],
                     reference="the SFT baseline's samples", ref=baseline)  # fmt: skip
    final["baseline"] = _watched(f"{baseline_name(run)} (final evaluation)", final_value(run, "eval", KL_TO_REF + BASELINE),
                                 *baseline, reference="its own samples", ref=baseline)  # fmt: skip
    return [final]


def ppo_evaluations(run: Run) -> list[dict]:
    """PPO's held-out evaluations of `watched_evaluations` (ppo/eval_samples.jsonl), latest step first."""
    by_step: dict[float, list[dict]] = {}
    for r in run.heldout_samples or ():
        if num(r.get(LOG_STEP)) is not None:
            by_step.setdefault(num(r[LOG_STEP]), []).append(r)
    kl_at = {num(r.get(LOG_STEP)): num(r.get(LOG_KL)) for r in run.eval_log or ()}
    start = by_step.get(0.0)
    ref = (
        (None, [num(r.get(PROXY)) for r in start], [num(r.get(GOLD_SCORE)) for r in start]) if start else None
    )
    return [
        _watched(
            f"PPO step {step:g}", kl_at.get(step),
            [{"prompt": r.get(PROMPT), "response": r.get(RESPONSE)} for r in by_step[step]],
            [num(r.get(PROXY)) for r in by_step[step]], [num(r.get(GOLD_SCORE)) for r in by_step[step]],
            reference="the step-0 evaluation (the SFT model)", ref=ref,
        )
        for step in sorted(by_step, reverse=True)
    ]  # fmt: skip


def _complete(values: list | None) -> list | None:
    return values if values and None not in values else None


def _watched(label: str, kl, samples: list[dict], proxy: list, gold: list, *, reference: str, ref) -> dict:
    """One evaluation of `watched_evaluations`; ref: (samples, proxy, gold) of the reference set, or None."""
    gaps = None
    if _complete(proxy) and _complete(gold):
        ref_proxy, ref_gold = (_complete(ref[1]), _complete(ref[2])) if ref else (None, None)
        if ref_proxy is None or ref_gold is None:
            ref_proxy = ref_gold = None
            reference = "this evaluation's own samples"
        gaps = standardised_gaps(proxy=proxy, gold=gold, ref_proxy=ref_proxy, ref_gold=ref_gold)
    for i, sample in enumerate(samples):
        sample.update(proxy=proxy[i], gold=gold[i], gap=gaps[i] if gaps else None)
    return {
        "label": label, "kl": kl, "reference": reference, "samples": samples,
        "proxy_mean": float(np.mean(proxy)) if _complete(proxy) else None,
        "gold_mean": float(np.mean(gold)) if _complete(gold) else None,
        **degeneracy_rates([str(s["response"] or "") for s in samples]),
    }  # fmt: skip


def largest_gaps(evaluation: dict, k: int = WATCH_TOP) -> list[dict]:
    """The k samples of an evaluation with the largest proxy−gold gap (none without gaps)."""
    scored = [s for s in evaluation["samples"] if s["gap"] is not None]
    return sorted(scored, key=lambda s: s["gap"], reverse=True)[:k]


def _flags(text: str) -> str:
    tripped = [name for name, on in degeneracy_flags(text).items() if on]
    return "".join(f' <span class="flag">{html.escape(name.replace("_", " "))}</span>' for name in tripped)


def watch_table(evaluations: list[dict]) -> str:
    """Per evaluation (a header row), its WATCH_TOP samples with the largest gap: gap, proxy, gold, and the
    prompt (grey) with the response and the degeneracy counters it trips."""
    body = []
    for ev in evaluations:
        top = largest_gaps(ev)
        if not top:
            continue
        kl = f" · KL {ev['kl']:.3g}" if ev["kl"] is not None else ""
        body.append(
            f'<tr class="group"><th colspan="4">{html.escape(ev["label"])}{kl} · {len(ev["samples"])} samples; '
            f"standardised by {html.escape(ev['reference'])}</th></tr>"
        )
        for s in top:
            body.append(
                f"<tr>{num_cell(s['gap'], '+.2f')}{num_cell(s['proxy'], '+.3g')}{num_cell(s['gold'], '+.3g')}"
                f'<td><span class="prompt-text">{shown_text(s["prompt"])}</span>'
                f'<span class="response">{shown_text(s["response"])}</span>{_flags(str(s["response"] or ""))}</td></tr>'
            )  # fmt: skip
    head = "<tr><th>gap (σ)</th><th>proxy</th><th>gold</th><th>prompt → response</th></tr>"
    return f'<table class="texts watch">\n{head}\n' + "\n".join(body) + "\n</table>"


def counters_table(evaluations: list[dict]) -> str:
    """One row per evaluation, oldest first: KL, mean proxy and gold, the largest gap and the degeneracy rates."""
    rows = []
    oldest_first = [e for later in reversed(evaluations) for e in (later.get("baseline"), later) if e]
    for ev in oldest_first:  # the SFT baseline's row just before the final evaluation's
        top = largest_gaps(ev, 1)
        rows.append([ev["label"], ev["kl"], ev["proxy_mean"], ev["gold_mean"], top[0]["gap"] if top else None,
                     *[pct(ev[k]) for k in DEGENERACY_KEYS]])  # fmt: skip
    header = [
        "evaluation",
        "KL",
        "proxy (mean)",
        "gold (mean)",
        "largest gap (σ)",
        *DEGENERACY_NAMES.values(),
    ]
    return table(header, rows, css_class="counters")


def plot_degeneracy(eval_log: list[dict]):
    """The degeneracy rates of PPO's held-out evaluations against the step and against KL."""
    fig, axes = new_figure(1, 2, 12, 3.4)
    for ax, x_key, xlabel in (
        (axes[0, 0], LOG_STEP, "PPO step"),
        (axes[0, 1], LOG_KL, "KL to reference (nats / response)"),
    ):
        for i, (key, name) in enumerate(DEGENERACY_NAMES.items()):
            x, y = series(eval_log, key, x=x_key)
            if len(x):
                ax.plot(x, y, "o-", color=nth_color(i), markersize=3, label=name)
        ax.set(title=f"Degenerate responses against {'step' if x_key == LOG_STEP else 'KL'}", xlabel=xlabel,
               ylabel="fraction of held-out responses")  # fmt: skip
        if ax.lines:
            top = max(max(line.get_ydata()) for line in ax.lines)
            ax.set_ylim(0, max(0.05, 1.15 * top))  # fractions: from 0, and a flat 0 stays at the bottom
            ax.legend(loc="best")
        else:
            no_data(ax)
    return fig


def section_hacking(page: Page, run: Run) -> None:
    page.add('<h2 id="hacking">5. Reward-hacking watch</h2>')
    evaluations = watched_evaluations(run)
    if not evaluations:
        page.add(
            '<p class="note">No evaluation with per-sample scores in this run (eval/samples.jsonl, '
            "ppo/eval_samples.jsonl): nothing to watch.</p>"
        )
        return
    page.add(
        '<p class="meta">A policy that games its reward model writes what the proxy (the RM, or the combined '
        "score PPO maximised) likes and people would not: padding, a phrase said again and again, nothing, or one "
        "word the proxy overvalues put everywhere. "
        "For each held-out evaluation, the samples the proxy likes most above the gold: gap = z(proxy) − "
        "z(gold), each score in standard deviations of the SFT model's samples, so gaps grow across "
        "evaluations when the proxy rises and the gold does not. Orange tags: the degeneracy counters a "
        "response trips.</p>"
    )
    gap_tables(page, run, evaluations)
    degeneracy_counters(page, run, evaluations)


def gap_tables(page: Page, run: Run, evaluations: list[dict]) -> None:
    """The samples with the largest proxy-gold gap of each evaluation (the latest WATCH_OPEN open), or why
    there is no gap to rank."""
    if not any(s["gap"] is not None for ev in evaluations for s in ev["samples"]):
        page.add(
            '<p class="note">This run has no gold score beside its proxy (gold_judge: none, or no proxy), so '
            "there is no proxy−gold gap to rank and "
            + (
                "the held-out accuracy (sections 3 and 4) is what to hold the proxy against"
                if accuracy_logged(run.eval_log) or accuracy_cards(run)
                else "the task has no other held-out metric to hold the proxy against"
            )
            + "; the degeneracy counters below still apply.</p>"
        )
    else:
        shown = [ev for ev in evaluations if largest_gaps(ev)]
        page.add(watch_table(shown[:WATCH_OPEN]))
        if len(shown) > WATCH_OPEN:
            page.add(
                f"<details><summary>Earlier evaluations ({len(shown) - WATCH_OPEN})</summary>",
                watch_table(shown[WATCH_OPEN:]),
                "</details>",
            )


def degeneracy_counters(page: Page, run: Run, evaluations: list[dict]) -> None:
    """The degeneracy rates of PPO's held-out evaluations against step and KL, and every evaluation's row."""
    page.add("<h3>Degeneracy counters</h3>")
    rates = [num(r.get(k)) for r in run.eval_log or () for k in DEGENERACY_KEYS]
    if any(rates):
        page.figure(
            plot_degeneracy(run.eval_log),
            "degeneracy",
            "Degenerate responses against step and KL",
            "PPO's held-out evaluations: the fraction of responses with a run of one character repeated 4 "
            "or more times (not a space or a digit), a word 3-gram said twice, or no text.",
        )
    elif any(rate is not None for rate in rates):  # a flat line at 0 says less than a sentence
        page.add(
            '<p class="note">No response of PPO\'s held-out evaluations tripped a counter (a run of one character '
            "repeated 4 or more times, a word 3-gram said twice, no text): nothing to plot.</p>"
        )
    page.add(counters_table(evaluations))
