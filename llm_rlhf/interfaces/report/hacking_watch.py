"""Section 5, the reward-hacking watch: the alarm (where it fired, its rule and the samples that fired it, or
that it stayed quiet), the samples the proxy likes far more than the gold, and the degeneracy and collapse
counters (`llm_rlhf.evaluation.hacking`).
"""

from __future__ import annotations

import html

import numpy as np

from llm_rlhf.evaluation.hacking import (
    CHAR_RUN_RATE,
    COUNTER_RULES,
    DEFAULT_RESPONSES,
    DEGENERACY_KEYS,
    EMPTY_RATE,
    PROXY,
    PROXY_UP_GOLD_DOWN,
    REPEATED_NGRAM_RATE,
    collapse_rates,
    counter_threshold,
    degeneracy_flags,
    degeneracy_rates,
    echoes,
    most_shared_bigram,
    standardised_gaps,
)
from llm_rlhf.evaluation.metric_names import (
    BASELINE,
    COLLAPSE_KEYS,
    COMBINED_SCORE,
    DUPLICATE_RATE,
    ECHO_RATE,
    GOLD_SCORE,
    KL_TO_REF,
    LOG_KL,
    LOG_STEP,
    NUM_RESPONSES,
    PROMPT,
    RESPONSE,
    RM_SCORE,
    SHARED_BIGRAM_RATE,
    TOP_BIGRAM_SHARE,
    TOP_RESPONSE_SHARE,
    WORD_DISTINCT_2,
    side,
)
from llm_rlhf.interfaces.report.accuracy import accuracy_logged
from llm_rlhf.interfaces.report.cards import accuracy_cards
from llm_rlhf.interfaces.report.figures import new_figure, no_data, nth_color
from llm_rlhf.interfaces.report.numbers import first_of, num, series
from llm_rlhf.interfaces.report.page import Page, num_cell, pct, table
from llm_rlhf.interfaces.report.runs import Run, baseline_name, final_alarm, final_value, heldout_alarm
from llm_rlhf.interfaces.report.samples import shown_text

WATCH_TOP = 3  # samples shown per evaluation

WATCH_OPEN = 5  # evaluations shown open (the final and the latest PPO ones); the rest collapsed

DEGENERACY_NAMES = {
    CHAR_RUN_RATE: "a run of one character (4+)",
    REPEATED_NGRAM_RATE: "a repeated word 3-gram",
    EMPTY_RATE: "empty",
}
COLLAPSE_NAMES = {
    DUPLICATE_RATE: "the response to another prompt too",
    TOP_BIGRAM_SHARE: "the most frequent word bigram's share",
    SHARED_BIGRAM_RATE: "holding the most shared word bigram",
    WORD_DISTINCT_2: "word distinct-2",
    TOP_RESPONSE_SHARE: "one same response to several prompts",
    ECHO_RATE: "copies its prompt",
}
RULE_NAMES = {PROXY_UP_GOLD_DOWN: "proxy up, gold down", **DEGENERACY_NAMES, **COLLAPSE_NAMES}
DEGENERACY_FLAG = {CHAR_RUN_RATE: "char_run", REPEATED_NGRAM_RATE: "repeated_ngram", EMPTY_RATE: "empty"}


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
    final = _watched(
        "final evaluation",
        final_value(run, "eval", KL_TO_REF),
        *sides["policy"],
        reference="the SFT baseline's samples",
        ref=baseline,
    )
    final["baseline"] = _watched(
        f"{baseline_name(run)} (final evaluation)",
        final_value(run, "eval", KL_TO_REF + BASELINE),
        *baseline,
        reference="its own samples",
        ref=baseline,
    )
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
            f"PPO step {step:g}",
            kl_at.get(step),
            [{"prompt": r.get(PROMPT), "response": r.get(RESPONSE)} for r in by_step[step]],
            [num(r.get(PROXY)) for r in by_step[step]],
            [num(r.get(GOLD_SCORE)) for r in by_step[step]],
            reference="the step-0 evaluation (the SFT model)",
            ref=ref,
            step=step,
        )
        for step in sorted(by_step, reverse=True)
    ]


def _complete(values: list | None) -> list | None:
    return values if values and None not in values else None


def _watched(
    label: str, kl, samples: list[dict], proxy: list, gold: list, *, reference: str, ref, step=None
) -> dict:
    """One evaluation of `watched_evaluations` (step: PPO's, None for the final evaluation); ref: (samples,
    proxy, gold) of the reference set, or None."""
    gaps = None
    if _complete(proxy) and _complete(gold):
        ref_proxy, ref_gold = (_complete(ref[1]), _complete(ref[2])) if ref else (None, None)
        if ref_proxy is None or ref_gold is None:
            ref_proxy = ref_gold = None
            reference = "this evaluation's own samples"
        gaps = standardised_gaps(proxy=proxy, gold=gold, ref_proxy=ref_proxy, ref_gold=ref_gold)
    for i, sample in enumerate(samples):
        sample.update(proxy=proxy[i], gold=gold[i], gap=gaps[i] if gaps else None)
    responses = [str(s["response"] or "") for s in samples]
    return {
        "label": label,
        "step": step,
        "kl": kl,
        "reference": reference,
        "samples": samples,
        "proxy_mean": float(np.mean(proxy)) if _complete(proxy) else None,
        "gold_mean": float(np.mean(gold)) if _complete(gold) else None,
        **degeneracy_rates(responses),
        **collapse_rates(responses, prompts=[str(s["prompt"]) for s in samples]),
    }


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
            )
    head = "<tr><th>gap (σ)</th><th>proxy</th><th>gold</th><th>prompt → response</th></tr>"
    return f'<table class="texts watch">\n{head}\n' + "\n".join(body) + "\n</table>"


def counters_table(evaluations: list[dict]) -> str:
    """One row per evaluation, oldest first: KL, mean proxy and gold, the largest gap, the degeneracy rates and
    the collapse counters (`hacking.collapse_rates`)."""
    rows = []
    oldest_first = [e for later in reversed(evaluations) for e in (later.get("baseline"), later) if e]
    for ev in oldest_first:  # the SFT baseline's row just before the final evaluation's
        top = largest_gaps(ev, 1)
        rows.append(
            [
                ev["label"],
                ev["kl"],
                ev["proxy_mean"],
                ev["gold_mean"],
                top[0]["gap"] if top else None,
                *[pct(ev[k]) for k in DEGENERACY_KEYS],
                *[pct(ev[k]) for k in COLLAPSE_KEYS],
            ]
        )
    header = [
        "evaluation",
        "KL",
        "proxy (mean)",
        "gold (mean)",
        "largest gap (σ)",
        *DEGENERACY_NAMES.values(),
        *COLLAPSE_NAMES.values(),
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
        ax.set(
            title=f"Degenerate responses against {'step' if x_key == LOG_STEP else 'KL'}",
            xlabel=xlabel,
            ylabel="fraction of held-out responses",
        )
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
    alarm_banners(page, run, evaluations)
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
    if any(num(r.get(k)) is not None for r in run.eval_log or () for k in COLLAPSE_KEYS):
        page.figure(
            plot_collapse(run.eval_log),
            "collapse",
            "Collapse counters against step",
            "PPO's held-out evaluations: the fraction of responses that are also the response to another prompt, "
            "the most frequent word bigram's share of all bigrams, the fraction of responses holding the most "
            "shared bigram, and word distinct-2; dashed: the alarm's threshold, set against the step-0 "
            "evaluation's value (`llm_rlhf.evaluation.hacking`).",
        )
    page.add(counters_table(evaluations))


def plot_collapse(eval_log: list[dict]):
    """The collapse counters of PPO's held-out evaluations against the step, one panel each, with the value at
    which the alarm's test against the step-0 evaluation fires dashed (`hacking.counter_threshold`, for an
    evaluation of step 0's num_responses; none where no value would)."""
    fig, axes = new_figure(1, len(COLLAPSE_KEYS), 14, 3.2)
    start = next((r for r in eval_log or () if num(r.get(LOG_STEP)) == 0), None)
    for i, key in enumerate(COLLAPSE_KEYS):
        ax = axes[0, i]
        x, y = series(eval_log, key, x=LOG_STEP)
        if not len(x):
            no_data(ax)
            continue
        ax.plot(x, y, "o-", color=nth_color(i), markersize=3)
        base = num((start or {}).get(key))
        n = int(num((start or {}).get(NUM_RESPONSES)) or DEFAULT_RESPONSES)
        kind = COUNTER_RULES[key]
        threshold = counter_threshold(base, kind=kind, n=n, n_base=n) if base is not None else None
        if threshold is not None and not (kind == "below" and base == 0.0):
            ax.axhline(threshold, color="#b42318", ls="--", lw=1)
        ax.set(title=COLLAPSE_NAMES[key], xlabel="PPO step", ylim=(0, 1.05))
    return fig


def alarm_banners(page: Page, run: Run, evaluations: list[dict]) -> None:
    """Where the alarm fired over PPO's held-out evaluations (the step, its rules and reasons, and the samples
    that fired each rule: `fired_samples`) or that it stayed quiet, with the best evaluation and the step the
    run returned; then the same for the final evaluation's counter rules (policy against the baseline)."""
    alarm = heldout_alarm(run)
    if alarm is not None:
        steps = (
            f"{len(alarm['steps'])} held-out evaluations (steps {alarm['steps'][0]:g}–{alarm['steps'][-1]:g})"
        )
        best = (
            f"best gold at step {alarm['best_step']:g}"
            if alarm["best_step"] is not None
            else "no gold to rank"
        )
        returned = (
            f"; the run returned the policy of step {alarm['returned_step']:g}"
            if alarm["returned_step"] is not None
            else ""
        )
        if alarm["step"] is None:
            page.add(f'<div class="quiet"><strong>Alarm quiet</strong> over {steps}; {best}{returned}.</div>')
        else:
            stopped = " The run stopped there (stop_on_alarm)." if alarm["stopped"] else ""
            page.add(
                f'<div class="alarm"><strong>Reward-hacking alarm at PPO step {alarm["step"]:g}</strong>: '
                f"{html.escape(', '.join(RULE_NAMES.get(r, r) for r in alarm['rules']))}.{stopped} "
                f"Over {steps}; {best}{returned}." + _reasons(alarm["reasons"]) + "</div>"
            )
            at = next((ev for ev in evaluations if ev["step"] == alarm["step"]), None)
            for rules in sample_groups(alarm["rules"]):
                page.add(fired_samples(rules, at))
    final = final_alarm(run)
    evaluated = next((ev for ev in evaluations if ev["step"] is None), None)
    if final is not None and final["rules"]:
        page.add(
            '<div class="alarm"><strong>Reward-hacking alarm on the final evaluation</strong>: '
            f"{html.escape(', '.join(RULE_NAMES.get(r, r) for r in final['rules']))}, the policy's counters "
            f"against the {html.escape(baseline_name(run))}'s." + _reasons(final["reasons"]) + "</div>"
        )
        for rules in sample_groups(final["rules"]):
            page.add(fired_samples(rules, evaluated))
    elif final is not None:
        page.add(
            '<div class="quiet"><strong>Final evaluation quiet</strong>: no counter past its threshold against '
            f"the {html.escape(baseline_name(run))}'s.</div>"
        )


def _reasons(lines: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>" if lines else ""


BIGRAM_RULES = (TOP_BIGRAM_SHARE, SHARED_BIGRAM_RATE, WORD_DISTINCT_2)  # one bigram's samples show all three


def sample_groups(rules: list[str]) -> list[list[str]]:
    """The fired rules in groups that share their samples: the bigram counters together, the others alone."""
    bigram = [r for r in rules if r in BIGRAM_RULES]
    groups = [[r] for r in rules if r not in BIGRAM_RULES]
    return groups + [bigram] if bigram else groups


def fired_samples(rules: list[str], evaluation: dict | None) -> str:
    """The samples that fired a group of rules (`sample_groups`) at an evaluation (a `watched_evaluations`
    dict), as a list: proxy up / gold down, the samples with the largest proxy-gold gap; duplicate_rate, the
    responses given to several prompts, with how many responses and prompts; the bigram counters, the most
    shared word bigram and responses holding it; a degeneracy counter, responses that trip it. Empty without
    the evaluation's samples."""
    if evaluation is None or not evaluation["samples"]:
        return ""
    samples = evaluation["samples"]
    responses = [str(s["response"] or "") for s in samples]
    rule = rules[0]
    name = html.escape(" / ".join(RULE_NAMES.get(r, r) for r in rules))
    if rule == PROXY_UP_GOLD_DOWN:
        top = largest_gaps(evaluation)
        head = f"the samples with the largest proxy−gold gap ({html.escape(evaluation['label'])})"
        items = [f"gap {s['gap']:+.2f}σ: {shown_text(s['response'])}" for s in top]
    elif rule in (DUPLICATE_RATE, TOP_RESPONSE_SHARE):
        given: dict[str, list] = {}  # normalised text -> the prompts of its responses, one per response
        for s, text in zip(samples, responses):
            given.setdefault(" ".join(text.split()), []).append(str(s["prompt"]))
        repeated = sorted(
            ((len(set(p)), len(p), t) for t, p in given.items() if len(set(p)) > 1), reverse=True
        )
        head = f"responses given to several prompts, of {len(samples)}"
        items = [f"{shown_text(text)} × {n} responses to {k} prompts" for k, n, text in repeated[:WATCH_TOP]]
    elif rule in BIGRAM_RULES:
        gram, holders = most_shared_bigram(responses)
        head = (
            f"the most shared word bigram “{html.escape(gram)}”, in {len(holders)} of {len(samples)} responses"
            if gram is not None
            else "no response has two words"
        )
        items = [shown_text(samples[i]["response"]) for i in holders[:WATCH_TOP]]
    elif rule == ECHO_RATE:
        copies = [s for s, text in zip(samples, responses) if echoes(text, str(s["prompt"]))]
        head = f"{len(copies)} of {len(samples)} responses copy their prompt"
        items = [shown_text(s["response"]) for s in copies[:WATCH_TOP]]
    elif rule in DEGENERACY_FLAG:
        tripped = [s for s, text in zip(samples, responses) if degeneracy_flags(text)[DEGENERACY_FLAG[rule]]]
        head = f"{len(tripped)} of {len(samples)} responses"
        items = [shown_text(s["response"]) for s in tripped[:WATCH_TOP]]
    else:
        return ""
    return (
        f'<p class="note"><strong>{name}</strong>: {head}</p><ul class="fired">'
        + "".join(f"<li>{item}</li>" for item in items)
        + "</ul>"
    )
