"""Runs that differ only by their seed, averaged over the seeds, so that methods compare "over 3 seeds, at equal
sampled responses": a table of each group's final held-out accuracy and KL, mean ± standard error over its seeds, and a
figure of the seeds' mean held-out accuracy against the responses sampled, the KL and PPO's wall seconds.

A seed group is the runs whose PPO configs (ppo/config.yaml) are equal once `seed` and `output_dir` are left out
and each run's own folder is masked out of the paths (`seed_groups`); folder names do not group runs. A group of two
runs or more is averaged and named by its runs' common folder name without the seed ("gspo" for gspo-seed0,
gspo-seed1, ...), or where the names say nothing by the keys in which the groups' configs differ (`group_labels`).
The math is in small pure functions over arrays (`seed_mean_stderr`, `responses_sampled`, `wall_seconds`,
`shared_steps`); the rest reads the runs and draws.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from typing import Any

import numpy as np
import yaml

from llm_rlhf.evaluation import metric_names
from llm_rlhf.interfaces.report.accuracy import accuracy_kinds
from llm_rlhf.interfaces.report.figures import new_figure, no_data, nth_color
from llm_rlhf.interfaces.report.numbers import first_of, logged, num
from llm_rlhf.interfaces.report.page import Page, RawNumber, table
from llm_rlhf.interfaces.report.runs import (
    Run,
    config_value,
    differing_keys,
    masked_run,
    name_stem,
    run_estimator,
)
from llm_rlhf.ppo import metrics as ppo_metrics

SEED_FREE = ("seed", "output_dir")  # the PPO config keys in which a group's runs may differ
# the figure's x axes: (the key of `group_evaluations`, the axis label, the panel's title)
X_AXES = (
    ("responses", "responses sampled (the seeds' mean)", "responses sampled"),
    ("kl", "KL to reference (nats / response, the seeds' mean)", "KL"),
    ("seconds", "PPO wall seconds (the seeds' mean)", "wall seconds"),
)


# --- the math: pure functions over arrays -------------------------------------------------------------------


def seed_mean_stderr(values) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard error over seeds, column by column. values: (S, N), one row per seed.

        mean_j = (1/S) sum_s x_sj
        sd_j   = sqrt( sum_s (x_sj - mean_j)^2 / (S - 1) )      (the sample standard deviation)
        se_j   = sd_j / sqrt(S)

    A NaN in a column makes its mean and se NaN; with one seed (S = 1) se is NaN: one seed says nothing about
    the spread. Returns (mean (N,), se (N,))."""
    x = np.asarray(values, dtype=float)  # (S, N)
    mean = x.mean(axis=0)  # (N,)
    if x.shape[0] < 2:
        return mean, np.full_like(mean, np.nan)
    return mean, x.std(axis=0, ddof=1) / np.sqrt(x.shape[0])  # (N,)


def responses_sampled(*, episodes, sampled_per_trained) -> np.ndarray:
    """Responses sampled by the end of each step, those dynamic sampling discarded included.

        sampled_s = episodes_s * rho_s

    episodes_s: the responses trained on by the end of step s, over every process (ppo_metrics.EPISODES);
    rho_s: the responses sampled per response trained over the run so far (sampling/sampled_per_trained; 1
    without dynamic sampling). (N,) each; returns (N,)."""
    return np.asarray(episodes, dtype=float) * np.asarray(sampled_per_trained, dtype=float)


def wall_seconds(*, step_seconds) -> np.ndarray:
    """PPO's wall seconds by the end of each step: seconds_s = sum_{t <= s} step_seconds_t (time/step: the
    step's sampling, scoring and update; held-out evaluations and checkpoints not counted). (N,) -> (N,)."""
    return np.cumsum(np.asarray(step_seconds, dtype=float))


def shared_steps(step_lists) -> list[float]:
    """The steps that are in every list, ascending: the held-out evaluations every seed of a group made (a
    seed still running, or one stopped early, has fewer)."""
    sets = [set(steps) for steps in step_lists]
    return sorted(set.intersection(*sets)) if sets else []


# --- the groups ---------------------------------------------------------------------------------------------


def seed_free_config(run: Run) -> dict | None:
    """The run's PPO config without the SEED_FREE keys, its own folder masked out of the paths (`masked_run`);
    None without a readable ppo/config.yaml."""
    try:
        config = yaml.safe_load(run.configs.get("ppo/config.yaml") or "")
    except yaml.YAMLError:
        return None
    if not isinstance(config, dict):
        return None
    return {key: masked_run(value, run) for key, value in config.items() if key not in SEED_FREE}


def seed_groups(runs: list[Run]) -> list[list[Run]]:
    """The runs whose `seed_free_config` are equal, each group in seed order, the groups in the order of their
    first run. A run without a PPO config is in no group."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        config = seed_free_config(run)
        if config is not None:
            groups.setdefault(json.dumps(config, sort_keys=True, default=str), []).append(run)
    return [sorted(group, key=_seed_order) for group in groups.values()]


def _seed_order(run: Run) -> tuple:
    seed = num(config_value(run, "ppo", "seed"))
    return (seed is None, seed or 0.0, run.name)


COMMON_LABEL = "the common values"  # the group whose every differing key holds its most common value


def group_labels(groups: list[list[Run]]) -> list[str]:
    """What tells the groups apart. A sweep's names first: where every run of a group has the same folder name
    once a seed suffix is cut (`name_stem`: "gspo-seed0", "gspo-seed1" -> "gspo") and the groups' stems differ,
    the stems. Otherwise "key: value" of each PPO config key in which their seed-free configs differ
    ("advantage_estimator: grpo, samples_per_prompt: 4"), leaving out a key where the group holds the value
    that more groups hold than any other (of three groups or more: one variant of a base config is named by
    what it changed, "policy_loss: cispo", not by every key some other variant changed). The group that holds
    every such common value is COMMON_LABEL; a lone group is named by its estimator."""
    stems = [{name_stem(run.name) for run in group} for group in groups]  # a set per group
    if len(groups) > 1 and all(len(s) == 1 and "" not in s for s in stems):
        names = [next(iter(s)) for s in stems]
        if len(set(names)) == len(names):
            return names
    configs = [seed_free_config(group[0]) or {} for group in groups]
    diffs = differing_keys(configs)
    if not diffs:
        return [run_estimator(group[0]) or "all runs" for group in groups]
    labels = []
    for i in range(len(groups)):
        parts = [f"{key}: {_value(values[i])}" for key, values in diffs if not _most_common(values, i)]
        labels.append(", ".join(parts) or COMMON_LABEL)
    return labels


def _most_common(values: list[Any], i: int) -> bool:
    """values[i] is held by more of `values` than any other value, and by two or more."""
    counts = Counter(json.dumps(v, sort_keys=True, default=str) for v in values)
    ranked = counts.most_common()
    mine = json.dumps(values[i], sort_keys=True, default=str)
    top, n = ranked[0]
    return mine == top and n >= 2 and (len(ranked) == 1 or ranked[1][1] < n)


def _value(value: Any) -> str:
    return "null" if value is None else str(value)


# --- a group's held-out evaluations --------------------------------------------------------------------------


def progress(run: Run) -> dict[float, tuple[float, float]]:
    """step -> (responses sampled, PPO wall seconds) by the end of the step (`responses_sampled`,
    `wall_seconds`), read from ppo/metrics.jsonl (a step logged twice, by a resumed run: its last line); step 0,
    the model PPO started from, is (0, 0). What the log lacks is NaN."""
    rows = {num(r.get(ppo_metrics.STEP)): r for r in run.ppo_history or ()}
    steps = sorted(s for s in rows if s is not None)

    def column(key: str, default: float) -> list[float]:
        return [first_of(num(rows[s].get(key)), default) for s in steps]

    responses = responses_sampled(
        episodes=column(ppo_metrics.EPISODES, np.nan),
        sampled_per_trained=column(ppo_metrics.SAMPLING_SAMPLED_PER_TRAINED, 1.0),  # logged with it on alone
    )
    seconds = wall_seconds(step_seconds=column(ppo_metrics.TIME_STEP, np.nan))
    return {0.0: (0.0, 0.0), **{s: (float(r), float(t)) for s, r, t in zip(steps, responses, seconds)}}


def group_evaluations(runs: list[Run], key: str) -> dict[str, np.ndarray]:
    """The seeds' held-out evaluations (ppo/eval_log.jsonl) at the steps every seed evaluated with a number
    under `key` (`shared_steps`): {"step": (N,), and (S, N), a row per seed: "accuracy" (under key), "kl" (the
    held-out KL), "responses" and "seconds" (`progress`)}; NaN where a seed's log lacks the number."""
    logs = [
        {
            num(r.get(metric_names.LOG_STEP)): r
            for r in run.eval_log or ()
            if num(r.get(metric_names.LOG_STEP)) is not None and num(r.get(key)) is not None
        }
        for run in runs
    ]
    steps = shared_steps([log.keys() for log in logs])
    made = [progress(run) for run in runs]

    def rows(value) -> np.ndarray:  # (S, N)
        return np.array([[value(i, s) for s in steps] for i in range(len(runs))], dtype=float).reshape(
            len(runs), len(steps)
        )

    return {
        "step": np.array(steps, dtype=float),
        "accuracy": rows(lambda i, s: num(logs[i][s].get(key))),
        "kl": rows(lambda i, s: first_of(num(logs[i][s].get(metric_names.LOG_KL)), np.nan)),
        "responses": rows(lambda i, s: made[i].get(s, (np.nan, np.nan))[0]),
        "seconds": rows(lambda i, s: made[i].get(s, (np.nan, np.nan))[1]),
    }


# --- the table ------------------------------------------------------------------------------------------------


def _number(value: float, spec: str) -> str:
    return "–" if not np.isfinite(value) else format(value, spec)


def mean_stderr_text(values, spec: str, seeds: bool = True) -> str:
    """The seeds' mean ± standard error (`seed_mean_stderr`), then the seeds' own values in brackets:
    "62.5% ± 2.1% [60.0%, 61.3%, 66.3%]" (spec ".1%"); "–" when no seed has the number."""
    x = np.asarray(values, dtype=float)  # (S,)
    if not np.isfinite(x).any():  # no seed logged it (an older log)
        return "–"
    mean, se = (float(v[0]) for v in seed_mean_stderr(x[:, None]))
    text = _number(mean, spec) + ("" if not np.isfinite(se) else f" ± {_number(se, spec)}")
    return text + (" [" + ", ".join(_number(v, spec) for v in x) + "]" if seeds else "")


def seed_table(groups: list[list[Run]], labels: list[str], kinds: list[tuple[str, str]]) -> str:
    """A row per group: its seeds, the last held-out evaluation they all made, the accuracy of each kind and the
    held-out KL there (mean ± se over the seeds, each seed's value in brackets), the responses sampled by then
    and PPO's wall seconds to then."""
    rows = []
    for group, label in zip(groups, labels):
        evaluations = [group_evaluations(group, key) for key, _ in kinds]
        first = evaluations[0]  # the step of the row: the first kind's last shared evaluation
        seeds = ", ".join(_value(config_value(run, "ppo", "seed")) for run in group)
        if not len(first["step"]):
            rows.append([label, seeds, "no evaluation every seed made", *[None] * (len(kinds) + 3)])
            continue
        step = first["step"][-1]
        cells = []
        for ev in evaluations:
            at = np.flatnonzero(ev["step"] == step)  # the same step for every kind, or none
            cells.append(
                RawNumber(html.escape(mean_stderr_text(ev["accuracy"][:, at[0]], ".1%"))) if len(at) else None
            )
        responses = first["responses"][:, -1]  # (S,)
        equal = len(set(responses.tolist())) == 1
        rows.append(
            [
                label,
                seeds,
                step,
                *cells,
                RawNumber(html.escape(mean_stderr_text(first["kl"][:, -1], ".3g"))),
                RawNumber(
                    html.escape(_number(responses[0], ".0f") if equal else mean_stderr_text(responses, ".0f"))
                ),
                RawNumber(html.escape(mean_stderr_text(first["seconds"][:, -1], ".0f", seeds=False))),
            ]
        )
    header = [
        "runs (what differs)",
        "seeds",
        "at step",
        *[f"held-out accuracy, {kind}" for _, kind in kinds],
        "held-out KL",
        "responses sampled",
        "PPO seconds",
    ]
    return table(header, rows, css_class="seeds")


# --- the figure ------------------------------------------------------------------------------------------------


def plot_seed_groups(groups: list[list[Run]], labels: list[str], kinds: list[tuple[str, str]]):
    """Each group's mean held-out accuracy over its seeds against the responses sampled, the KL and PPO's wall
    seconds (columns), ± one standard error over the seeds (shaded; bars against KL, where a band would fold
    back as KL falls between evaluations); a row per accuracy kind; one colour per group."""
    from matplotlib.ticker import PercentFormatter  # optional, heavy: only when drawing

    fig, axes = new_figure(len(kinds), len(X_AXES), 15, 3.8 * len(kinds))
    for row, (key, kind) in zip(axes, kinds):
        evaluations = [group_evaluations(group, key) for group in groups]
        for ax, (x, xlabel, title) in zip(row, X_AXES):
            ax.set(title=f"Held-out accuracy, {kind}, against {title}", xlabel=xlabel)
            drawn = False
            for i, (ev, label) in enumerate(zip(evaluations, labels)):
                xs = ev[x].mean(axis=0)  # (N,) the seeds' mean x
                y, se = seed_mean_stderr(ev["accuracy"])  # (N,) each
                shown = np.isfinite(xs) & np.isfinite(y)  # a seed without the x (an older log): no point
                if not shown.any():
                    continue
                xs, y, se = xs[shown], y[shown], se[shown]
                seeds = f"{ev['accuracy'].shape[0]} seeds"
                style = {"color": nth_color(i), "marker": "o", "markersize": 3, "label": f"{label} ({seeds})"}
                if x == "kl":
                    ax.errorbar(xs, y, yerr=np.nan_to_num(se), capsize=2, elinewidth=0.8, **style)
                else:
                    ax.plot(xs, y, **style)
                    ax.fill_between(xs, y - se, y + se, color=style["color"], alpha=0.15, linewidth=0)
                drawn = True
            if drawn:
                ax.set(ylabel="held-out accuracy", ylim=(-0.02, 1.02))
                ax.yaxis.set_major_formatter(PercentFormatter(1.0))
            else:
                no_data(ax)
    handles, names = next(
        (ax.get_legend_handles_labels() for ax in fig.axes if ax.get_legend_handles_labels()[0]), ([], [])
    )
    if handles:
        fig.legend(handles, names, loc="outside upper center", ncols=min(len(handles), 3))
    return fig


# --- the section ---------------------------------------------------------------------------------------------------


def section_seeds(page: Page, runs: list[Run]) -> None:
    """The seed groups of a folder of runs with held-out accuracy: the table and the figure; one line when no
    two runs differ only by their seed."""
    page.add("<h2>Over seeds: held-out accuracy, mean ± standard error</h2>")
    groups = seed_groups(runs)
    averaged = [group for group in groups if len(group) >= 2]
    if not averaged:
        page.add(
            '<p class="note">No two runs differ only by their seed (their ppo/config.yaml with seed and '
            "output_dir left out): nothing to average; every run is its own curve above.</p>"
        )
        return
    labels = group_labels(averaged)
    every_log = [line for group in averaged for run in group for line in run.eval_log or ()]
    kinds = [
        (key, kind)
        for key, kind in accuracy_kinds(every_log)
        if any(logged(run.eval_log, key) for group in averaged for run in group)
    ]
    if not kinds:
        page.add(
            '<p class="note">The runs that differ only by their seed evaluated no held-out accuracy: nothing to '
            "average.</p>"
        )
        return
    page.add(
        '<p class="meta">A row per group of runs whose PPO configs are equal but for seed and output_dir, named '
        "by its runs' folder name without the seed, or by the config keys in which the groups differ. At the "
        "last held-out evaluation (ppo/eval_log.jsonl) every seed of the group made: accuracy and KL as the mean over the seeds ± its standard error (the "
        "seeds' standard deviation, with n − 1, over √n), each seed's value in brackets; the responses sampled "
        "by then (those dynamic sampling discarded included; ReMax's greedy baselines not) and PPO's wall "
        "seconds to then (time/step summed: held-out evaluations not counted), the mean over the seeds.</p>",
        '<div class="wide">',
        seed_table(averaged, labels, kinds),
        "</div>",
    )
    page.figure(
        plot_seed_groups(averaged, labels, kinds),
        "compare_seeds",
        "Each group's held-out accuracy, the mean over its seeds, against responses sampled, KL and seconds",
        "The mean held-out accuracy of each group's seeds at the evaluations they all made, ± one standard error "
        "over the seeds (shaded; bars against KL), against the seeds' mean responses sampled, held-out KL and "
        "PPO wall seconds by then. One colour per group.",
    )
    alone = [run.name for group in groups if len(group) == 1 for run in group]
    alone += [run.name for run in runs if seed_free_config(run) is None]
    if alone:
        page.add(
            f'<p class="note">Not averaged (no other seed of the same config): {html.escape(", ".join(alone))}.</p>'
        )
