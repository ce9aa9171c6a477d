"""Held-out accuracy on a task with a verifier: PPO's held-out evaluations against step and KL,
one run and every run of a sweep.
"""

from __future__ import annotations

import numpy as np

from llm_rlhf.evaluation import metric_names
from llm_rlhf.interfaces.report.evaluation import pass_at_logged
from llm_rlhf.interfaces.report.figures import add_legend, new_figure, no_data, nth_color
from llm_rlhf.interfaces.report.numbers import logged, num
from llm_rlhf.interfaces.report.page import Page
from llm_rlhf.interfaces.report.runs import Run, config_value, name_stem, run_estimator
from llm_rlhf.interfaces.report.samples import TURNS, episodes_table

# Held-out accuracy on a task with a verifier: (key, what it is). The key's standard error is
# key + STDERR; in eval/metrics.json the baseline's are key + BASELINE and key + STDERR + BASELINE.
ACCURACY_KINDS = ((metric_names.ACCURACY, "sampled"), (metric_names.ACCURACY_GREEDY, "greedy"))
STEP, KL = metric_names.LOG_STEP, metric_names.LOG_KL  # the x axes: PPO's step, the KL to the reference


def accuracy_logged(eval_log: list[dict] | None) -> bool:
    """Whether PPO's held-out evaluations measured accuracy (a task with a verifier)."""
    return any(logged(eval_log, key) for key, _ in ACCURACY_KINDS)


def accuracy_kinds(eval_log: list[dict] | None) -> tuple[tuple[str, str], ...]:
    """ACCURACY_KINDS, then a (pass_at_<k>, "pass@k") for each pass@k the held-out evaluations reported
    (eval_pass_at_k)."""
    return ACCURACY_KINDS + tuple((keys[0], f"pass@{k}") for k, keys in pass_at_logged(eval_log))


def accuracy_points(eval_log: list[dict] | None, key: str, x: str = STEP):
    """(step, x, accuracy, stderr) arrays of the held-out evaluations with a number under x and key, in step
    order (against KL as well: the curve is the run's path, and KL need not grow at every evaluation); stderr
    is NaN where the row has none."""
    rows = sorted(
        (r for r in eval_log or () if num(r.get(x)) is not None and num(r.get(key)) is not None),
        key=lambda r: num(r.get(STEP)) or 0,
    )
    return tuple(
        np.array([num(r.get(k)) for r in rows], dtype=float)
        for k in (STEP, x, key, key + metric_names.STDERR)
    )


def _accuracy_curve(ax, eval_log, key: str, x: str, *, line: dict, band: float = 0.12) -> bool:
    """One accuracy curve: against the step with ± one standard error shaded (opacity `band`), against KL
    with it as bars (a band would fold back where KL falls between evaluations). line: the curve's color and
    label, and its linestyle and marker when not "-" and "o"."""
    _, xs, y, se = accuracy_points(eval_log, key, x)
    if not len(xs):
        return False
    style = {"linestyle": "-", "marker": "o", **line, "markersize": 3}
    if x == STEP:
        ax.plot(xs, y, **style)
        ax.fill_between(
            xs, y - se, y + se, color=line["color"], alpha=band, linewidth=0
        )  # NaN stderr: no band
    else:
        ax.errorbar(xs, y, yerr=np.nan_to_num(se), capsize=2, elinewidth=0.8, **style)
    return True


def _accuracy_axes(ax, x: str, title: str, drawn: bool) -> None:
    """Accuracy from 0% to 100% on every panel, so runs and panels read on one scale."""
    from matplotlib.ticker import PercentFormatter  # optional, heavy: only when drawing

    ax.set(title=title, xlabel="PPO step" if x == STEP else "KL to reference (nats / response)")
    if not drawn:
        no_data(ax)
        return
    ax.set(ylabel="held-out accuracy", ylim=(-0.02, 1.02))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))


def plot_accuracy(eval_log: list[dict]):
    """PPO's held-out accuracy, sampled and greedy (and each pass@k logged), against the step (left) and
    against KL (right)."""
    fig, axes = new_figure(1, 2, 12, 3.8)
    kinds = accuracy_kinds(eval_log)
    for ax, x in zip(axes[0], (STEP, KL)):
        drawn = [
            _accuracy_curve(
                ax, eval_log, key, x, line={"color": nth_color(i), "label": kind, "marker": "os^vD<>"[i % 7]}
            )
            for i, (key, kind) in enumerate(kinds)
        ]
        _accuracy_axes(ax, x, f"Held-out accuracy against {'step' if x == STEP else 'KL'}", any(drawn))
        if x == KL and any(drawn):  # where the path starts and ends
            key = ACCURACY_KINDS[0][0] if drawn[0] else ACCURACY_KINDS[1][0]
            step, kl, y, _ = accuracy_points(eval_log, key, KL)
            for i in {0, len(kl) - 1}:
                ax.annotate(
                    f"step {step[i]:g}",
                    (kl[i], y[i]),
                    textcoords="offset points",
                    xytext=(4, -10),
                    fontsize=7,
                )
        add_legend(ax)
    return fig


def run_styles(runs: list[Run]) -> list[tuple]:
    """(colour, line style) of each run's accuracy curves: a colour per run; but where runs repeat a variant
    (its seeds) and there is more than one variant, a colour per variant and a line style per run within it,
    so four variants x three seeds read as four colours. A variant is the run's folder name without its seed
    (`name_stem`) where those repeat (a sweep's "gspo-seed0", "gspo-seed1", ...: GSPO and CISPO share an
    estimator), otherwise its advantage estimator."""
    stems = [name_stem(run.name) for run in runs]
    by_name = "" not in stems and len(set(stems)) < len(stems)
    variants = stems if by_name else [run_estimator(run) for run in runs]
    distinct = list(dict.fromkeys(variants))
    if len(distinct) in (1, len(runs)):
        return [(nth_color(i), "-") for i in range(len(runs))]
    styles = []
    for i, variant in enumerate(variants):
        repeat = variants[:i].count(variant)
        styles.append((nth_color(distinct.index(variant)), ("-", "--", ":", "-.")[repeat % 4]))
    return styles


def plot_compare_accuracy(runs: list[Run]):
    """Every run's held-out accuracy against step (left) and KL (right), one curve per run (no average over
    seeds: each seed is a run); a row per kind some run measured (sampled, greedy)."""
    from matplotlib.lines import Line2D  # optional, heavy: only when drawing

    every_log = [line for r in runs for line in r.eval_log or ()]
    kinds = [
        (key, kind) for key, kind in accuracy_kinds(every_log) if any(logged(r.eval_log, key) for r in runs)
    ]
    styles = run_styles(runs)
    fig, axes = new_figure(len(kinds), 2, 12, 3.8 * len(kinds))
    for row, (key, kind) in zip(axes, kinds):
        for ax, x in zip(row, (STEP, KL)):
            drawn = [  # fainter bands than one run's: many overlap
                _accuracy_curve(
                    ax, r.eval_log, key, x, line={"color": c, "label": r.name, "linestyle": ls}, band=0.06
                )
                for r, (c, ls) in zip(runs, styles)
            ]
            _accuracy_axes(
                ax, x, f"Held-out accuracy, {kind}, against {'step' if x == STEP else 'KL'}", any(drawn)
            )
    colors = list(dict.fromkeys(c for c, _ in styles))
    # the legend filled column by column, a colour's runs together: with equal groups, a column per estimator
    order = sorted(range(len(runs)), key=lambda i: colors.index(styles[i][0]))
    handles = [Line2D([], [], color=styles[i][0], linestyle=styles[i][1], label=runs[i].name) for i in order]
    ncols = len(colors) if len(colors) < len(runs) else min(len(runs), 6)
    fig.legend(handles=handles, loc="outside upper center", ncols=ncols)
    return fig


def section_accuracy(page: Page, run: Run, gold: bool) -> None:
    """PPO's held-out accuracy (a task with a verifier) against step and KL."""
    page.add("<h3>Held-out accuracy against step and KL</h3>")
    verifier = (run.metrics.get("eval") or {}).get(metric_names.ACCURACY_FN) or config_value(
        run, "ppo", "reward_fn"
    )
    caption = (
        "PPO's held-out evaluations (ppo/eval_log.jsonl; step 0 is the model PPO started from): the accuracy of "
        "the run's sampling and of one greedy response per prompt, and each pass@k (unbiased, from "
        "eval_samples_per_prompt samples of a prompt) it logged, ± one standard error over the prompts (shaded; "
        "bars against KL). Right: the same against KL to the reference on the held-out samples, joined in step order: what "
        "each nat away from the reference buys in held-out accuracy."
    )
    if not gold:
        caption += (
            " This run has no gold judge: held-out accuracy"
            + (f", checked by the verifier {verifier}," if verifier else "")
            + " is its held-out metric."
        )
    page.figure(plot_accuracy(run.eval_log), "accuracy", "Held-out accuracy against step and KL", caption)
    episodes = [r for r in run.heldout_samples or () if r.get(TURNS)]
    if episodes:  # episodes of several turns: the first and the last evaluation's, as turns
        steps = sorted({r.get("step") for r in episodes}, key=lambda s: num(s) or 0)
        for step in dict.fromkeys(steps[:1] + steps[-1:]):
            page.add(f"<h3>Held-out episodes at step {step}</h3>")
            page.add(episodes_table([r for r in episodes if r.get("step") == step]))
