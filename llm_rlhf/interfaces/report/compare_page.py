"""The page of a folder of runs: their headline metrics side by side, where their configs differ, and their
curves overlaid.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import yaml

from llm_rlhf.evaluation import metric_names
from llm_rlhf.interfaces.report.accuracy import (
    ACCURACY_KINDS,
    accuracy_logged,
    plot_compare_accuracy,
    run_styles,
)
from llm_rlhf.interfaces.report.methods import section_methods
from llm_rlhf.interfaces.report.numbers import num
from llm_rlhf.interfaces.report.overoptimisation import eval_points, plot_compare_overoptimisation
from llm_rlhf.interfaces.report.page import Page, Raw, RawNumber, page_header, plus_minus, table
from llm_rlhf.interfaces.report.ppo_curves import plot_compare_ppo
from llm_rlhf.interfaces.report.runs import (
    Run,
    as_dict,
    baseline_name,
    differing_keys,
    final_value,
    load_compare,
    masked_run,
    run_estimator,
)
from llm_rlhf.interfaces.report.seeds import section_seeds
from llm_rlhf.ppo import metrics as ppo_metrics

# Headline columns of the side-by-side table: (stage whose final metrics hold it, key); a column no run has a
# value for is left out (`compare_columns`).
COMPARE_COLUMNS = (
    ("eval", metric_names.ACCURACY),
    ("eval", metric_names.ACCURACY_GREEDY),
    ("eval", metric_names.GOLD_WIN_RATE),
    ("eval", metric_names.SENTIMENT_WIN_RATE),
    ("eval", metric_names.FLUENCY_PERPLEXITY),
    ("eval", metric_names.FLUENCY_PERPLEXITY + metric_names.BASELINE),
    ("eval", metric_names.RM_WIN_RATE),
    ("eval", metric_names.KL_TO_REF),
    ("eval", metric_names.GOLD_SCORE_MEAN),
    ("eval", metric_names.RM_SCORE_MEAN),
    ("ppo", ppo_metrics.OBJECTIVE_SCORES),
    ("ppo", ppo_metrics.OBJECTIVE_KL),
    ("ppo", ppo_metrics.OBJECTIVE_KL_COEF),
)


def config_differences(runs: list[Run]) -> list[tuple[str, list[Any]]]:
    """Config keys whose values differ between runs (the run's own folder name masked out of paths)."""
    flat: list[dict[str, Any]] = []
    for run in runs:
        values: dict[str, Any] = {}
        for rel, text in run.configs.items():
            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError:
                continue
            prefix = rel.split("/")[0] if "/" in rel else "pipeline"
            for key, value in data.items() if isinstance(data, dict) else ():
                if prefix == "pipeline" and isinstance(value, dict):
                    continue  # its per-stage overrides show up in the stages' own configs
                values[f"{prefix}.{key}"] = masked_run(value, run)
        flat.append(values)
    return differing_keys(flat)


def compare_columns(runs: list[Run]) -> list[tuple[str, str]]:
    """The COMPARE_COLUMNS some run has a value for (no accuracy columns for a task without a verifier)."""
    return [
        (stage, key)
        for stage, key in COMPARE_COLUMNS
        if any(final_value(r, stage, key) is not None for r in runs)
    ]


def heldout_accuracy(run: Run, key: str) -> Any:
    """A headline cell for a run that PPO evaluated on held-out problems: the last held-out evaluation with
    `key` (ppo/eval_log.jsonl) as a percentage ± its standard error and its step, "62.5% ± 4.1% (step 12)";
    None where none has it. A sweep with no eval stage (`stages: [ppo]`) has only these."""
    rows = [row for row in run.eval_log or () if num(row.get(key)) is not None]
    if not rows:
        return None
    last = rows[-1]
    text = plus_minus(num(last[key]), num(last.get(key + metric_names.STDERR)))
    return RawNumber(html.escape(f"{text} (step {last.get(metric_names.LOG_STEP)})"))


def column_value(run: Run, stage: str, key: str) -> Any:
    """A cell of the side-by-side table: the final value; an accuracy as a percentage ± its standard error."""
    value = final_value(run, stage, key)
    if key in dict(ACCURACY_KINDS) and value is not None:
        return RawNumber(html.escape(plus_minus(value, final_value(run, stage, key + metric_names.STDERR))))
    return value


def compare_accuracy(page: Page, runs: list[Run]) -> None:
    """Every run's held-out accuracy against step and KL on one figure (a task with a verifier)."""
    page.add("<h2>Held-out accuracy against step and KL</h2>")
    grouped = len({c for c, _ in run_styles(runs)}) < len(runs)
    page.figure(
        plot_compare_accuracy(runs),
        "compare_accuracy",
        "Held-out accuracy of every run against step and KL",
        "PPO's held-out evaluations (ppo/eval_log.jsonl) of each run, ± one standard error (shaded; bars "
        "against KL); every run is its own curve (seeds too: their average is the next section)."
        + (
            " One colour per variant (the run's name without its seed, or else its advantage estimator), a line"
            " style per run of it."
            if grouped
            else " One colour per run."
        ),
    )


def build_compare_page(runs: list[Run], folder: Path, png_dir: Path) -> Page:
    """The headline metrics side by side, where the configs differ, the curves overlaid, the sweep's compare
    stage, the missing files."""
    page = Page(png_dir)
    page_header(page, f"RLHF runs side by side: {folder.resolve().name}", folder)
    headline_table(page, runs, folder)
    diffs = config_differences(runs)
    if diffs:
        page.add("<h2>Where the configs differ</h2>")
        page.add(table(["config key", *[r.name for r in runs]], [[k, *v] for k, v in diffs]))
    compare_curves(page, runs)
    shared = Run(path=folder, name=folder.resolve().name)  # a sweep's compare stage runs once, in DIR/compare
    shared.pipeline = as_dict(shared.json("pipeline.json", note=False))
    load_compare(shared)
    section_methods(page, shared, number="")
    notes = [f"{r.name}: {', '.join(r.missing)}" for r in runs if r.missing]
    if notes:
        page.add(
            "<h2>Missing files</h2>", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"
        )
    return page


def headline_table(page: Page, runs: list[Run], folder: Path) -> None:
    """A row per run (its name links to its own report): the estimator and the COMPARE_COLUMNS some run has."""
    page.add("<h2>Headline metrics</h2>")
    columns = compare_columns(runs)
    cells = {key: [heldout_accuracy(run, key) for run in runs] for key, _ in ACCURACY_KINDS}
    heldout = [key for key, column in cells.items() if any(column)]  # only the kinds some run has
    header = [
        "run",
        "estimator",
        *[f"{key}, held-out during PPO" for key in heldout],
        *[f"{key} ({stage})" if stage == "ppo" else key for stage, key in columns],
    ]
    rows = []
    for index, run in enumerate(runs):
        link = Raw(
            f'<a href="{html.escape(run.path.relative_to(folder).as_posix())}/report.html">{html.escape(run.name)}</a>'
        )
        rows.append(
            [
                link,
                run_estimator(run),
                *[cells[key][index] for key in heldout],
                *[column_value(run, stage, key) for stage, key in columns],
            ]
        )
    # the run and estimator cells unbroken (table.runs); a table wider than the page scrolls
    page.add('<div class="wide">', table(header, rows, css_class="runs"), "</div>")
    baselines = sorted({baseline_name(run) for run in runs})  # "SFT baseline" and/or "starting model"
    evaluated = (
        f"Win rates and scores from the final evaluation on held-out prompts (vs the {' or '.join(baselines)}). "
        if any(stage == "eval" for stage, _ in columns)
        else ""
    )  # no eval column (runs without the eval stage): nothing to say about it
    page.add(
        f'<p class="meta">{evaluated}The ppo columns are the last PPO step\'s rollout statistics. estimator: '
        "the PPO stage's advantage_estimator, with k = samples_per_prompt when a prompt was sampled more than once."
        + (
            " held-out during PPO: PPO's last held-out evaluation (ppo/eval_log.jsonl) ± its standard error, at the"
            " step in brackets."
            if heldout
            else ""
        )
        + (
            " accuracy: the final evaluation's held-out accuracy ± its standard error."
            if any(("eval", key) in columns for key, _ in ACCURACY_KINDS)
            else ""
        )
        + "</p>"
    )


def compare_curves(page: Page, runs: list[Run]) -> None:
    """Every run's PPO curves, held-out accuracy (a task with a verifier) and gold and proxy reward against KL,
    overlaid."""
    page.add("<h2>PPO curves</h2>")
    if any(r.ppo_history for r in runs):
        page.figure(
            plot_compare_ppo(runs),
            "compare_ppo",
            "PPO curves of every run",
            "One colour per run; dashed lines in the KL panel are each run's KL target.",
        )
    else:
        page.missing("No run has ppo/metrics.jsonl.")
    accuracy = any(accuracy_logged(r.eval_log) for r in runs)
    if accuracy:
        compare_accuracy(page, runs)
        section_seeds(page, runs)
    if any(r.eval_log and len(eval_points(r.eval_log)[0]) for r in runs):
        page.add("<h2>What the KL penalty buys: gold and proxy reward against KL</h2>")
        page.figure(
            plot_compare_overoptimisation(runs),
            "compare_overoptimisation",
            "Gold and proxy reward against KL per run",
            "Top: all runs overlaid. Below: each run, proxy (RM) score on the left axis, gold score on the right.",
        )
    elif not accuracy:  # with accuracy and no gold, the accuracy curves stand alone
        page.add("<h2>What the KL penalty buys: gold and proxy reward against KL</h2>")
        page.missing(
            "No run's held-out evaluations (ppo/eval_log.jsonl) have a gold score and a KL."
            if any(r.eval_log for r in runs)
            else "No run has ppo/eval_log.jsonl."
        )
