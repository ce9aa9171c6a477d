"""Gold and proxy reward against KL over PPO's held-out evaluations (ppo/eval_log.jsonl): one run, and
every run of a sweep overlaid.
"""

from __future__ import annotations

import math

import numpy as np

from llm_rlhf.evaluation import metric_names
from llm_rlhf.interfaces.report.figures import new_figure, no_data, nth_color, twin_axis
from llm_rlhf.interfaces.report.numbers import num
from llm_rlhf.interfaces.report.page import Page, skip_section
from llm_rlhf.interfaces.report.runs import Run, config_value


def eval_points(eval_log: list[dict]):
    """(step, kl, rm_score, gold_score) arrays of the held-out evaluations with a KL and a gold score, in step
    order; rm_score is NaN where no reward model scored (a run on a reward function alone)."""
    keys = (metric_names.LOG_STEP, metric_names.LOG_KL, metric_names.GOLD_SCORE)
    rows = sorted(
        (r for r in eval_log if all(num(r.get(k)) is not None for k in keys[1:])),
        key=lambda r: num(r.get(metric_names.LOG_STEP)) or 0,
    )
    step, kl, gold = (np.array([num(r.get(k)) for r in rows], dtype=float) for k in keys)
    rm = np.array([num(r.get(metric_names.RM_SCORE)) for r in rows], dtype=float)  # None -> NaN
    return step, kl, rm, gold


def _overopt_axes(ax, eval_log: list[dict], title: str, legend: bool = True) -> bool:
    """Proxy (RM) score left, gold score right, both against KL; points joined in step order."""
    step, kl, rm, gold = eval_points(eval_log)
    ax.set(title=title, xlabel="KL to reference (nats / response)")
    if not len(kl):
        no_data(ax)
        return False
    ax.plot(kl, rm, "o-", color="C0", markersize=4, label="proxy: RM score")
    ax.set_ylabel("RM score (normalised)", color="C0")
    ax.tick_params(axis="y", colors="C0")
    twin = twin_axis(ax, "C1")
    twin.plot(kl, gold, "s-", color="C1", markersize=4, label="gold judge score")
    twin.set_ylabel("gold score", color="C1")
    for i in {0, len(kl) - 1}:  # on the proxy's line, or on the gold's when no reward model scored
        on, y = (ax, rm[i]) if np.isfinite(rm[i]) else (twin, gold[i])
        on.annotate(f"step {step[i]:g}", (kl[i], y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if legend:
        ax.figure.legend(handles=[*ax.lines, *twin.lines], loc="outside lower center", ncols=2)
    return True


def plot_overoptimisation(eval_log: list[dict]):
    fig, axes = new_figure(1, 1, 6.5, 4)
    _overopt_axes(axes[0, 0], eval_log, "Gold vs proxy reward as the policy moves away (held-out prompts)")
    return fig


def plot_compare_overoptimisation(runs: list[Run]):
    """Row 1: every run's proxy and gold score against KL, overlaid. Row 2+: each run on its own."""
    ncols = min(len(runs), 3)
    nrows = 1 + math.ceil(len(runs) / ncols)
    fig, axes = new_figure(nrows, max(ncols, 2), 5.2 * max(ncols, 2), 3.8 * nrows)
    proxy_ax, gold_ax = axes[0, 0], axes[0, 1]
    for i, run in enumerate(runs):
        _, kl, rm, gold = eval_points(run.eval_log or [])
        if len(kl):
            proxy_ax.plot(kl, rm, "o-", color=nth_color(i), markersize=3, label=run.name)
            gold_ax.plot(kl, gold, "o-", color=nth_color(i), markersize=3, label=run.name)
    for ax, what in ((proxy_ax, "Proxy: RM score"), (gold_ax, "Gold judge score")):
        ax.set(title=f"{what} against KL, all runs", xlabel="KL to reference (nats / response)", ylabel=what)
        if ax.lines:
            ax.legend()
        else:
            no_data(ax)
    for ax in axes[0, 2:]:
        ax.set_visible(False)
    flat = list(axes[1:].flat)
    for ax, run in zip(flat, runs):
        _overopt_axes(ax, run.eval_log or [], run.name, legend=False)  # the coloured axis labels say which
    for ax in flat[len(runs) :]:
        ax.set_visible(False)
    return fig


def section_overoptimisation(page: Page, run: Run, gold: bool) -> None:
    """Gold and proxy reward against KL over PPO's held-out evaluations, or why there is no such curve."""
    page.add("<h3>Over-optimisation: gold and proxy reward against KL</h3>")
    if gold:
        page.figure(
            plot_overoptimisation(run.eval_log),
            "overoptimisation",
            "Gold and proxy reward against KL",
            "Periodic held-out evaluation during PPO. The RM (proxy) keeps rising with KL; when the gold "
            "score stops following it, the policy is exploiting the reward model.",
        )
    elif run.eval_log:
        page.add(
            '<p class="note">The held-out evaluations during PPO (ppo/eval_log.jsonl) have no gold score or no KL '
            "(e.g. gold_judge: none), so there is no gold-vs-proxy curve.</p>"
        )
    elif config_value(run, "ppo", "eval_every") == 0:
        page.add(
            '<p class="note">Held-out evaluation during PPO was off in this run (ppo/config.yaml: eval_every: 0), '
            "so there is no gold-vs-proxy curve. Run PPO with eval_every &gt; 0 (e.g. "
            '<code>--ppo "{eval_every: 10}"</code> in the pipeline) to draw it.</p>'
        )
    else:
        skip_section(page, run, "ppo", ["ppo/eval_log.jsonl (no over-optimisation curve)"])
