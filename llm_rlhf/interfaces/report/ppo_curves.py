"""Section 3: PPO's curves (ppo/metrics.jsonl, one point per step) as small multiples, one run and every run
side by side; a reward-model ensemble's members; then the held-out curves and PPO's samples.
"""

from __future__ import annotations

import math

import numpy as np

from llm_rlhf.interfaces.report.accuracy import accuracy_logged, section_accuracy
from llm_rlhf.interfaces.report.figures import (
    SMOOTH_ABOVE,
    add_legend,
    new_figure,
    no_data,
    nth_color,
    plot_line,
    twin_axis,
)
from llm_rlhf.interfaces.report.numbers import logged, num, series
from llm_rlhf.interfaces.report.overoptimisation import eval_points, section_overoptimisation
from llm_rlhf.interfaces.report.page import Page, fmt, metrics_table, skip_section, wall_time_line
from llm_rlhf.interfaces.report.runs import Run, kl_target, without_reward_model
from llm_rlhf.interfaces.report.samples import ppo_samples_table
from llm_rlhf.ppo import metrics as ppo_metrics

# What PPO's score is called on a panel: (title of the reward panel, its y label, the side-by-side panel's title,
# its y label), by whether the score is a reward model's or, with reward_model_path: none, a reward function's.
SCORE_WORDS = {
    True: ("RM score and RLHF reward", "reward (normalised RM units)", "RM score", "normalised RM units"),
    False: (
        "Score and RLHF reward",
        "reward (the reward function's units)",
        "Score (reward function)",
        "reward",
    ),
}

# PPO small multiples: (title, left y label, left keys, (right key, right y label) or None); the reward panel's
# words are SCORE_WORDS' for the run.
PPO_PANELS = (
    (
        *SCORE_WORDS[True][:2],
        (
            ppo_metrics.OBJECTIVE_SCORES,
            ppo_metrics.OBJECTIVE_RLHF_REWARD,
            ppo_metrics.OBJECTIVE_NON_SCORE_REWARD,
        ),
        None,
    ),
    (
        "KL to reference, β (right)",
        "KL (nats / response)",
        (ppo_metrics.OBJECTIVE_KL,),
        (ppo_metrics.OBJECTIVE_KL_COEF, "β"),
    ),
    (
        "Entropy",
        "nats / response",
        (ppo_metrics.OBJECTIVE_ENTROPY,),
        (ppo_metrics.POLICY_ENTROPY, "nats / token"),
    ),
    (
        "Clip fraction",
        "fraction of tokens clipped",
        (ppo_metrics.POLICY_CLIPFRAC, ppo_metrics.VAL_CLIPFRAC),
        None,
    ),
    ("Approx. KL, old → new policy", "nats / token", (ppo_metrics.POLICY_APPROXKL,), None),
    ("Policy loss", "loss", (ppo_metrics.LOSS_POLICY,), None),
    ("Value loss", "loss (squared error)", (ppo_metrics.LOSS_VALUE,), None),
    ("Explained variance of returns", "1 − Var(R − V) / Var(R)", (ppo_metrics.VAL_EXPLAINED_VARIANCE,), None),
    (
        "Response length, EOS rate (right)",
        "tokens",
        (ppo_metrics.RESPONSE_LENGTH,),
        (ppo_metrics.EOS_RATE, "EOS rate"),
    ),
    (
        "Episodes: turns, tool-call rate (right)",
        "policy turns / episode",
        (ppo_metrics.ENV_TURNS,),
        (ppo_metrics.ENV_TOOL_CALL_RATE, "tool-call rate"),
    ),
    ("Environment reward", "reward / episode", (ppo_metrics.ENV_REWARD,), None),
    (
        "Distillation: reverse KL to the teacher, teacher's share of the step (right)",
        "nats / response token",
        (ppo_metrics.OBJECTIVE_DISTILL_KL,),
        (ppo_metrics.TIME_TEACHER_SHARE, "time/teacher ÷ time/step"),
    ),
    ("Time per phase (stacked)", "seconds / step", ppo_metrics.TIME_PHASES, None),
    ("Throughput", "tokens / s", (ppo_metrics.TOKENS_PER_S,), None),
    ("Probability ratio π_θ / π_θ_old", "mean ratio", (ppo_metrics.POLICY_RATIO,), None),
)

# the panels only runs with an environment log, and the one only distillation runs (a teacher) log
OPTIONAL_KEYS = (ppo_metrics.ENV_TURNS, ppo_metrics.ENV_REWARD, ppo_metrics.OBJECTIVE_DISTILL_KL)

# Side-by-side PPO panels: one key each, one line per run.
COMPARE_PANELS = (
    (ppo_metrics.OBJECTIVE_SCORES, *SCORE_WORDS[True][2:]),
    (ppo_metrics.OBJECTIVE_KL, "KL to reference (dashed: target)", "nats / response"),
    (ppo_metrics.OBJECTIVE_KL_COEF, "KL coefficient β", "β"),
    (ppo_metrics.OBJECTIVE_RLHF_REWARD, "RLHF reward (score − β·KL)", "reward"),
    (ppo_metrics.OBJECTIVE_ENTROPY, "Entropy", "nats / response"),
    (ppo_metrics.POLICY_CLIPFRAC, "Policy clip fraction", "fraction of tokens"),
    (ppo_metrics.POLICY_APPROXKL, "Approx. KL, old → new policy", "nats / token"),
    (ppo_metrics.LOSS_VALUE, "Value loss", "loss"),
    (ppo_metrics.VAL_EXPLAINED_VARIANCE, "Explained variance", "1 − Var(R − V) / Var(R)"),
    (ppo_metrics.OBJECTIVE_DISTILL_KL, "Reverse KL to the teacher", "nats / response token"),
    (ppo_metrics.RESPONSE_LENGTH, "Response length", "tokens"),
    (ppo_metrics.EOS_RATE, "EOS rate", "fraction"),
    (ppo_metrics.TIME_STEP, "Time per step", "seconds"),
)


def ppo_panels(history: list[dict]) -> tuple:
    """The PPO_PANELS this run logged anything for: a critic-free estimator logs no loss/value or val/*, so its
    report has no value-loss or explained-variance panel."""
    return tuple(
        panel
        for panel in PPO_PANELS
        if any(logged(history, key) for key in (*panel[2], *(panel[3] or ())[:1]))
    )


def compare_panels(runs: list[Run]) -> tuple:
    """The COMPARE_PANELS some run logged their key for (no value panels when no run has a value function)."""
    return tuple(panel for panel in COMPARE_PANELS if any(logged(run.ppo_history, panel[0]) for run in runs))


def _panel_grid(panels: int, panel_width: float, row_height: float):
    """A figure of `panels` panels in as few rows of at most 5 as hold them, the rows as even as they can be
    (12 panels: 3 x 4; 10, a run without a value function: 2 x 5); the unused cells of the last row hidden.
    Returns (fig, the panels' axes in reading order)."""
    nrows = max(1, math.ceil(panels / 5))
    ncols = max(1, math.ceil(panels / nrows))
    fig, axes = new_figure(nrows, ncols, panel_width * ncols, row_height * nrows)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:panels])


def plot_ppo(history: list[dict], kl_target: float | None, reward_model: bool = True):
    """PPO_PANELS for one run; `reward_model`: its score is a reward model's (False: a reward function's)."""
    panels = ppo_panels(history)
    fig, axes = _panel_grid(len(panels), 4, 9.5 / 3)
    for ax, (title, ylabel, keys, right) in zip(axes, panels):
        if keys[0] == ppo_metrics.OBJECTIVE_SCORES:
            title, ylabel = SCORE_WORDS[reward_model][:2]
        ax.set(title=title, xlabel="PPO step", ylabel=ylabel)
        if keys == ppo_metrics.TIME_PHASES:
            drawn = _time_panel(ax, history)
        else:
            drawn = False
            for i, key in enumerate(keys):
                x, y = series(history, key)
                if not len(x):
                    continue
                line = plot_line(ax, x, y, label=key, color=f"C{i}")
                drawn = True
                if key == ppo_metrics.OBJECTIVE_SCORES:
                    _, std = series(history, ppo_metrics.OBJECTIVE_SCORES_STD)
                    if len(std) == len(y):
                        ax.fill_between(
                            x, y - std, y + std, color=line.get_color(), alpha=0.15, label="± std"
                        )
            if keys[0] == ppo_metrics.OBJECTIVE_KL and kl_target is not None and drawn:
                ax.axhline(kl_target, color="C0", linestyle="--", linewidth=1, label=f"target {kl_target:g}")
            if keys[0] == ppo_metrics.POLICY_RATIO and drawn:
                ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
        axes_used = [ax]
        if right is not None:
            x, y = series(history, right[0])
            if len(x):
                twin = twin_axis(ax, "C3")
                plot_line(twin, x, y, label=right[0], color="C3")
                twin.set_ylabel(right[1], color="C3")
                axes_used.append(twin)
                drawn = True
        if not drawn:
            no_data(ax)
        add_legend(*axes_used)
    fig.suptitle("PPO training (one point per rollout batch)", fontweight="bold")
    return fig


def ensemble_members(history: list[dict]) -> list[str]:
    """The objective/scores_member_<k> keys a PPO run with a reward-model ensemble logged, in member order."""
    keys = {k for row in history for k in row if k.startswith(ppo_metrics.OBJECTIVE_SCORES_MEMBER)}
    return sorted(keys, key=lambda k: int(k.rsplit("_", 1)[1]))


def plot_ensemble(history: list[dict]):
    """A reward-model ensemble: each member's mean score with the combined score PPO optimised, and the
    members' disagreement (std across the members, averaged over the batch)."""
    fig, axes = new_figure(1, 2, 12, 3.6)
    left, right = axes[0]
    for i, key in enumerate(ensemble_members(history)):
        plot_line(
            left, *series(history, key), label=f"member {key.rsplit('_', 1)[1]}", color=nth_color(i + 1)
        )
    plot_line(left, *series(history, ppo_metrics.OBJECTIVE_SCORES), label="combined (PPO's score)", color="k")
    left.set(title="Ensemble: member and combined scores", xlabel="PPO step", ylabel="normalised RM units")
    add_legend(left)
    x, y = series(history, ppo_metrics.OBJECTIVE_SCORES_DISAGREEMENT)
    if len(x):
        plot_line(right, x, y, color=nth_color(0))
    else:
        no_data(right)
    right.set(title="Ensemble disagreement", xlabel="PPO step", ylabel="std across members")
    return fig


def _time_panel(ax, history: list[dict]) -> bool:
    """Generate / score / train stacked, the whole step on top (the rest is bookkeeping)."""
    x, total = series(history, ppo_metrics.TIME_STEP)
    phases = [(k.split("/")[1], [num(r.get(k)) for r in history]) for k in ppo_metrics.TIME_PHASES]
    phases = [(name, v) for name, v in phases if all(t is not None for t in v)]
    steps = [num(r.get(ppo_metrics.STEP)) for r in history]
    if phases and all(s is not None for s in steps):
        order = np.argsort(steps)
        xs = np.array(steps)[order]
        ax.stackplot(xs, *[np.array(v)[order] for _, v in phases], labels=[n for n, _ in phases], alpha=0.7)
    if len(x):
        ax.plot(x, total, color="k", linewidth=1, label="whole step")
    return bool(phases) or bool(len(x))


def plot_compare_ppo(runs: list[Run]):
    panels = compare_panels(runs)
    fig, axes = _panel_grid(len(panels), 4, 10 / 3)
    for ax, (key, title, ylabel) in zip(axes, panels):
        if key == ppo_metrics.OBJECTIVE_SCORES:  # a reward model's words unless no run has one
            title, ylabel = SCORE_WORDS[not all(map(without_reward_model, runs))][2:]
        ax.set(title=title, xlabel="PPO step", ylabel=ylabel)
        drawn = False
        for i, run in enumerate(runs):
            x, y = series(run.ppo_history, key)
            if not len(x):
                continue
            plot_line(ax, x, y, label=run.name, color=nth_color(i))
            drawn = True
            target = kl_target(run)
            if key == ppo_metrics.OBJECTIVE_KL and target is not None:
                ax.axhline(target, color=nth_color(i), linestyle="--", linewidth=1)
        if not drawn:
            no_data(ax)
    from matplotlib.lines import Line2D  # optional, heavy: only when drawing

    handles = [Line2D([], [], color=nth_color(i), label=r.name) for i, r in enumerate(runs)]
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(runs), 6))
    return fig


def section_ppo(page: Page, run: Run) -> None:
    page.add('<h2 id="ppo">3. PPO</h2>', wall_time_line(run, "ppo"))
    if run.ppo_history:
        target = kl_target(run)
        caption = "β on the right axis of the KL panel" + (
            ", the KL target dashed." if target is not None else "."
        )
        if len(run.ppo_history) > SMOOTH_ABOVE:
            caption += " Faint: raw values; solid: centred moving average over 5% of the steps."
        left_out = [  # the episodes' and distillation's panels: not missed by other runs
            panel[0]
            for panel in PPO_PANELS
            if panel not in ppo_panels(run.ppo_history) and panel[2][0] not in OPTIONAL_KEYS
        ]
        if left_out:
            caption += f" Not drawn, nothing logged for them: {', '.join(left_out)}."
        page.figure(
            plot_ppo(run.ppo_history, target, not without_reward_model(run)), "ppo", "PPO curves", caption
        )
        if ensemble_members(run.ppo_history):
            page.figure(
                plot_ensemble(run.ppo_history),
                "ppo_ensemble",
                "Reward-model ensemble: member scores and disagreement",
                "Each member's mean normalised score on the rollouts, the combined score PPO maximised "
                "(ppo/config.yaml: ensemble_combine), and the std across the members, averaged over the batch.",
            )
    else:
        skip_section(page, run, "ppo", ["ppo/metrics.jsonl (no PPO curves)"])
    gold, accuracy = bool(run.eval_log and len(eval_points(run.eval_log)[0])), accuracy_logged(run.eval_log)
    if accuracy:
        section_accuracy(page, run, gold)
    if gold or not accuracy:  # with accuracy and no gold, the accuracy curves stand alone
        section_overoptimisation(page, run, gold)
    if run.ppo_samples:
        steps = sorted(
            {s.get(ppo_metrics.STEP) for s in run.ppo_samples if num(s.get(ppo_metrics.STEP)) is not None}
        )
        for step in dict.fromkeys(steps[:1] + steps[-1:]):  # the first and the last logged step
            page.add(f"<h3>PPO samples at step {fmt(step)}</h3>")
            page.add(ppo_samples_table([s for s in run.ppo_samples if s.get(ppo_metrics.STEP) == step]))
    if run.metrics.get("ppo"):
        page.add(
            "<details><summary>Final PPO metrics</summary>", metrics_table(run.metrics["ppo"]), "</details>"
        )
