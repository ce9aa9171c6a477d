"""Section 6, for runs with a compare stage (`llm-rlhf compare`): PPO, DPO and best-of-n on one gold-vs-KL
plot, with Gao et al.'s laws fitted (DIR/compare).
"""

from __future__ import annotations

import html

import numpy as np

from llm_rlhf.interfaces.report.figures import new_figure, no_data, nth_color, twin_axis
from llm_rlhf.interfaces.report.numbers import num
from llm_rlhf.interfaces.report.page import Page, table, wall_time_line
from llm_rlhf.interfaces.report.runs import Run, estimator_text

METHOD_NAMES = {
    "ppo": "PPO (along its run)",
    "dpo": "DPO (β sweep)",
    "best_of_n": "best-of-n (the RM picks 1 of n)",
}


def rl_methods(metrics: dict) -> dict:
    """compare's RL runs, method -> {name, ppo_dir, advantage_estimator, samples_per_prompt}: ppo_dir's run
    ("ppo") and each of more_ppo_dirs (a compare from before `runs` was written: "ppo" alone)."""
    runs = metrics.get("runs")
    return runs if isinstance(runs, dict) else {"ppo": {}}


def method_label(method: str, metrics: dict) -> str:
    """A method as the plot and the tables name it: an RL run by its name and estimator ("PPO" when it is the
    only one), DPO and best-of-n by METHOD_NAMES."""
    runs = rl_methods(metrics)
    run = runs.get(method)
    if not isinstance(run, dict) or not run:
        return METHOD_NAMES.get(method, method)
    name = "PPO" if len(runs) == 1 else str(run.get("name") or method)
    estimator = estimator_text(run.get("advantage_estimator"), run.get("samples_per_prompt"))
    return f"{name} (along its run)" if name == estimator else f"{name} ({estimator}, along its run)"


def plot_methods(points: list[dict], metrics: dict):
    """Gold (solid, left axis) and proxy RM score (dashed, right axis) against sqrt(KL), one colour per
    method (each RL run one); Gao et al.'s fitted law dotted through the gold points."""
    fits = metrics.get("fits") or {}
    fig, axes = new_figure(1, 1, 8, 4.8)
    ax = axes[0, 0]
    twin = twin_axis(ax, "0.4")
    ax.set(
        title="Gold reward against KL: which method buys the most gold per nat?",
        xlabel="sqrt(KL to the SFT model)   (sqrt nats)",
        ylabel="gold score (solid)",
    )
    twin.set_ylabel("RM score, normalised (dashed)", color="0.4")
    for i, method in enumerate(dict.fromkeys(p.get("method") for p in points)):
        ps = [p for p in points if p.get("method") == method and num(p.get("kl")) is not None]
        # an RL run's points stay in step order: its path along the run (KL is not monotone)
        if method not in rl_methods(metrics):
            ps.sort(key=lambda p: p["kl"])
        if not ps:
            continue
        d = np.sqrt(np.maximum([p["kl"] for p in ps], 0.0))
        color = nth_color(i)
        ax.plot(
            d,
            [p["gold_score"] for p in ps],
            "o-",
            color=color,
            markersize=4,
            label=method_label(method, metrics),
        )
        twin.plot(d, [p["rm_score"] for p in ps], "--", color=color, linewidth=1)
        fit = fits.get(method)
        if fit:
            grid, curve = np.array(fit["curve"]).T  # compare's fitted law on sqrt(KL)
            ax.plot(
                grid,
                curve,
                ":",
                color=color,
                linewidth=1.5,
                label=f"fit: α {fit['alpha']:.2f}, β {fit['beta']:.2f}, R² {fit['r2']:.2f}"
                + (" (poor)" if fit["poor"] else ""),
            )
    if not ax.lines:
        no_data(ax)
    else:
        ax.legend(fontsize=7, loc="best")
    return fig


def section_methods(page: Page, run: Run, number: str = "6. ") -> None:
    """Only for runs with a compare stage (`llm-rlhf compare`); a sweep's compare page has it unnumbered."""
    if not run.compare_points or not run.compare_metrics:
        return
    metrics = run.compare_metrics
    page.add(
        f'<h2 id="compare">{number}Methods compared: gold reward against KL</h2>',
        wall_time_line(run, "compare"),
    )
    page.add(
        f'<p class="meta">{metrics.get("num_prompts")} held-out prompts (the PPO runs\' held-out set), '
        f"one gold judge ({html.escape(str(metrics.get('gold_judge')))}). Best-of-n's KL is the analytic "
        "log n − (n−1)/n; the KL measured on its samples is in the table.</p>"
    )
    page.figure(
        plot_methods(run.compare_points, metrics),
        "methods",
        "Gold and RM score against sqrt(KL): each RL run joined in step order, DPO and best-of-n by KL",
    )
    order = list(dict.fromkeys(p.get("method") for p in run.compare_points))  # metrics.json's keys are sorted
    best = sorted((metrics.get("best") or {}).items(), key=lambda item: _rank(order, item[0]))
    page.add(
        "<h3>Best gold of each method</h3>",
        table(
            ["method", "best gold score", "at KL", "point"],
            [[method_label(m, metrics), b.get("gold_score"), b.get("kl"), b.get("label")] for m, b in best],
        ),
    )
    fits = sorted(
        ((m, f) for m, f in (metrics.get("fits") or {}).items() if f), key=lambda item: _rank(order, item[0])
    )
    page.add(
        "<h3>Gao et al. (2022) law fits</h3>",
        table(
            ["method", "form (d = sqrt KL)", "α ± se", "β ± se", "R²", "points", "fit"],
            [
                [
                    method_label(m, metrics),
                    "d(α − β d)" if f["form"] == "bon" else "d(α − β log d)",
                    f"{f['alpha']:.3f} ± {f['alpha_stderr']:.3f}",
                    f"{f['beta']:.3f} ± {f['beta_stderr']:.3f}",
                    f["r2"],
                    f["num_points"],
                    "poor" if f["poor"] else "good",
                ]
                for m, f in fits
            ],
        )
        if fits
        else '<p class="note">No law fitted: a fit needs 3 points with KL &gt; 0 and the SFT model\'s gold.</p>',
    )
    rows = [
        [
            method_label(p["method"], metrics),
            p.get("label"),
            p.get("kl"),
            p.get("kl_measured"),
            p.get("rm_score"),
            p.get("gold_score"),
            p.get("fluency_perplexity"),
        ]
        for p in run.compare_points
    ]
    page.add(
        "<details><summary>Every point</summary>",
        table(
            [
                "method",
                "point",
                "KL",
                "KL measured (best-of-n)",
                "RM score",
                "gold score",
                "fluency perplexity",
            ],
            rows,
        ),
        "</details>",
    )


def _rank(order: list, method: str) -> int:
    """Where `method` comes in `order` (the points' order: the RL runs, DPO, best-of-n); unknown ones last."""
    return order.index(method) if method in order else len(order)
