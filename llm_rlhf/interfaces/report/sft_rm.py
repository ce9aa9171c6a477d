"""Sections 1 and 2: the SFT loss; the reward model's loss, pairwise accuracy and margin."""

from __future__ import annotations

from llm_rlhf.interfaces.report.figures import add_legend, new_figure, no_data, plot_line
from llm_rlhf.interfaces.report.numbers import num, series
from llm_rlhf.interfaces.report.page import Page, metrics_table, skip_section, wall_time_line
from llm_rlhf.interfaces.report.runs import Run


def plot_sft(log: list[dict]):
    fig, axes = new_figure(1, 1, 6.5, 3.6)
    ax = axes[0, 0]
    for key, label in (("loss", "train"), ("eval_loss", "eval")):
        x, y = series(log, key)
        if len(x):
            plot_line(ax, x, y, label=label)
    ax.set(
        title="SFT loss (completion tokens)", xlabel="optimizer step", ylabel="cross-entropy (nats / token)"
    )
    add_legend(ax)
    return fig


def plot_rm(log: list[dict] | None, metrics: dict | None):
    """Loss, pairwise accuracy (chance 0.5, bag-of-words baseline dashed) and margin r(chosen) − r(rejected)."""
    metrics = metrics or {}
    fig, axes = new_figure(1, 3, 12, 3.6)
    last_step = max((num(r.get("step")) or 0 for r in log or ()), default=0) or num(
        metrics.get("global_step")
    )
    panels = (
        ("Bradley–Terry loss", "loss (nats / pair)", "loss", "eval_loss"),
        ("Pairwise accuracy", "fraction of pairs ranked right", "accuracy", "eval_accuracy"),
        ("Reward margin", "r(chosen) − r(rejected)", "margin", "eval_margin"),
    )
    for ax, (title, ylabel, train_key, eval_key) in zip(axes[0], panels):
        drawn = False
        for key, label in ((train_key, "train"), (eval_key, "eval")):
            x, y = series(log, key)
            if len(x):
                plot_line(ax, x, y, label=label)
                drawn = True
        final = num(metrics.get(eval_key))
        if final is not None and not len(series(log, eval_key)[0]):
            ax.plot(
                [last_step or 0], [final], "*", markersize=12, color="C1", label=f"final eval {final:.3g}"
            )
            drawn = True
        if train_key == "accuracy" and drawn:
            ax.axhline(0.5, color="gray", linestyle=":", linewidth=1, label="chance")
            baseline = num(metrics.get("baseline_accuracy"))
            if baseline is not None:
                ax.axhline(
                    baseline, color="k", linestyle="--", linewidth=1, label=f"bag-of-words {baseline:.3g}"
                )
        if not drawn:
            no_data(ax)
        ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
        add_legend(ax)
    return fig


def section_sft(page: Page, run: Run) -> None:
    page.add('<h2 id="sft">1. Supervised fine-tuning</h2>', wall_time_line(run, "sft"))
    if run.sft_log and len(series(run.sft_log, "loss")[0]) + len(series(run.sft_log, "eval_loss")[0]):
        page.figure(
            plot_sft(run.sft_log),
            "sft_loss",
            "SFT loss",
            "Next-token loss on the completion tokens only. "
            "Each train point is the mean over the optimizer steps since the previous point (logging_steps). With "
            "group_by_length the batches run from long to short within each mega-batch of 50, so a point also "
            "follows its batches' lengths.",
        )
    else:
        skip_section(page, run, "sft", ["sft/train_log.json (no loss curve)"])
    if run.metrics.get("sft"):
        page.add(metrics_table(run.metrics["sft"]))


def section_rm(page: Page, run: Run) -> None:
    page.add('<h2 id="rm">2. Reward model</h2>', wall_time_line(run, "rm"))
    if run.rm_log or run.metrics.get("rm"):
        page.figure(
            plot_rm(run.rm_log, run.metrics.get("rm")),
            "rm",
            "Reward model loss, accuracy and margin",
            "Held-out pairwise accuracy against chance (0.5) and a bag-of-words logistic regression. "
            "Each train point is the mean over the optimizer steps since the previous point (logging_steps). With "
            "group_by_length the batches run from long to short within each mega-batch of 50, so a point also "
            "follows its batches' lengths.",
        )
        if not run.rm_log:
            page.missing("Missing: rm/train_log.json — only the final evaluation is plotted.")
    else:
        skip_section(page, run, "rm", ["rm/train_log.json", "rm/metrics.json"])
    if run.metrics.get("rm"):
        page.add(metrics_table(run.metrics["rm"]))
