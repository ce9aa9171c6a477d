"""`llm-rlhf report DIR`: one self-contained report.html per pipeline run, rebuilt from its logs.

    llm-rlhf report runs/reviews          # one run: DIR/report.html and DIR/report/*.png
    llm-rlhf report runs/kl_sweep         # sub-folders that are runs: compared side by side

A run folder is recognised by `pipeline.json`. The HTML embeds every plot as a base64 PNG and has
no external CSS or JS, so it opens offline in any browser; the same PNGs are written to
DIR/report/. What the report reads (any of it may be missing: that section says so and is skipped):

    DIR/pipeline.json, DIR/pipeline_config.yaml, DIR/<stage>/config.yaml, DIR/<stage>/metrics.json
    DIR/sft/train_log.json   (or log.jsonl)   HF Trainer log history: SFT train / eval loss
    DIR/rm/train_log.json    (or log.jsonl)   RM loss, accuracy and margin
    DIR/ppo/metrics.jsonl    one line per PPO step;   DIR/ppo/samples.jsonl   logged responses
    DIR/ppo/eval_log.jsonl   held-out kl, rm_score, gold_score during PPO (the over-optimisation curve), the
                             degeneracy rates (`llm_rlhf.hacking`) and, on a task with a verifier, accuracy
                             (sampled and greedy, with standard errors): accuracy against step and KL
    DIR/ppo/eval_samples.jsonl   each held-out sample's proxy and gold score (the reward-hacking watch)
    DIR/eval/metrics.json, DIR/eval/samples.jsonl    final policy vs baseline (SFT; the starting model of a
                             run without an SFT stage); with a verifier, held-out accuracy and each sample's
                             correctness
    DIR/compare/points.jsonl, DIR/compare/metrics.json   PPO, DPO and best-of-n: gold against KL (optional)

When DIR holds several runs, DIR/report.html overlays their PPO curves (legend = folder name),
tabulates their headline metrics and the config keys in which they differ, and draws gold and
proxy reward against KL for each, so one sees what the KL penalty buys, and, with a verifier, every run's
held-out accuracy against step and KL (a sweep of estimators, or of seeds: one curve per run, no average);
each run gets its own report.html as well. A stage that pipeline_config.yaml's `stages` leaves out (PPO
straight from an instruct model: `stages: [ppo, eval]`) gets one line saying so, and its files are not
missing. matplotlib is imported only here (an optional dependency of the core).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from llm_rlhf.config import is_off
from llm_rlhf.estimators import DEFAULT_ESTIMATOR, ESTIMATORS
from llm_rlhf.hacking import DEGENERACY_KEYS, degeneracy_flags, degeneracy_rates, standardised_gaps
from llm_rlhf.utils import atomic_write_text

STAGES = ("sft", "rm", "ppo", "eval")
SAMPLE_ROWS = 20  # rows of each sample table

# PPO small multiples: (title, left y label, left keys, (right key, right y label) or None).
PPO_PANELS = (
    (
        "RM score and RLHF reward",
        "reward (normalised RM units)",
        ("objective/scores", "objective/rlhf_reward", "objective/non_score_reward"),
        None,
    ),
    ("KL to reference, β (right)", "KL (nats / response)", ("objective/kl",), ("objective/kl_coef", "β")),
    ("Entropy", "nats / response", ("objective/entropy",), ("policy/entropy", "nats / token")),
    ("Clip fraction", "fraction of tokens clipped", ("policy/clipfrac", "val/clipfrac"), None),
    ("Approx. KL, old → new policy", "nats / token", ("policy/approxkl",), None),
    ("Policy loss", "loss", ("loss/policy",), None),
    ("Value loss", "loss (squared error)", ("loss/value",), None),
    ("Explained variance of returns", "1 − Var(R − V) / Var(R)", ("val/explained_variance",), None),
    ("Response length, EOS rate (right)", "tokens", ("response_length",), ("eos_rate", "EOS rate")),
    ("Time per phase (stacked)", "seconds / step", ("time/generate", "time/score", "time/train"), None),
    ("Throughput", "tokens / s", ("tokens_per_s",), None),
    ("Probability ratio π_θ / π_θ_old", "mean ratio", ("policy/ratio",), None),
)

# Side-by-side PPO panels: one key each, one line per run.
COMPARE_PANELS = (
    ("objective/scores", "RM score", "normalised RM units"),
    ("objective/kl", "KL to reference (dashed: target)", "nats / response"),
    ("objective/kl_coef", "KL coefficient β", "β"),
    ("objective/rlhf_reward", "RLHF reward (score − β·KL)", "reward"),
    ("objective/entropy", "Entropy", "nats / response"),
    ("policy/clipfrac", "Policy clip fraction", "fraction of tokens"),
    ("policy/approxkl", "Approx. KL, old → new policy", "nats / token"),
    ("loss/value", "Value loss", "loss"),
    ("val/explained_variance", "Explained variance", "1 − Var(R − V) / Var(R)"),
    ("response_length", "Response length", "tokens"),
    ("eos_rate", "EOS rate", "fraction"),
    ("time/step", "Time per step", "seconds"),
)

# Headline columns of the side-by-side table: (stage whose final metrics hold it, key); a column no run has a
# value for is left out (`compare_columns`).
COMPARE_COLUMNS = (
    ("eval", "accuracy"),
    ("eval", "accuracy_greedy"),
    ("eval", "gold_win_rate"),
    ("eval", "sentiment_win_rate"),
    ("eval", "fluency_perplexity"),
    ("eval", "fluency_perplexity_baseline"),
    ("eval", "rm_win_rate"),
    ("eval", "kl_to_ref"),
    ("eval", "gold_score_mean"),
    ("eval", "rm_score_mean"),
    ("ppo", "objective/scores"),
    ("ppo", "objective/kl"),
    ("ppo", "objective/kl_coef"),
)

SMOOTH_ABOVE = 30  # more points than this: raw line faint, a centred moving average on top

# Held-out accuracy on a task with a verifier (issue 25): (key, what it is). The key's standard error is
# key + "_stderr"; in eval/metrics.json the baseline's are key + "_baseline" and key + "_stderr_baseline".
ACCURACY_KINDS = (("accuracy", "sampled"), ("accuracy_greedy", "greedy"))


# ---------------------------------------------------------------------------------------------------
# Reading a run folder
# ---------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything the report reads from one run folder. A file that is absent or unreadable is None
    here and named in `missing` (relative to the run folder)."""

    path: Path
    name: str
    missing: list[str] = field(default_factory=list)
    pipeline: dict | None = None
    stages_planned: list[str] | None = None  # `stages` of pipeline_config.yaml
    metrics: dict[str, dict | None] = field(default_factory=dict)  # stage -> final metrics
    sft_log: list[dict] | None = None
    rm_log: list[dict] | None = None
    ppo_history: list[dict] | None = None
    ppo_samples: list[dict] | None = None
    eval_log: list[dict] | None = None
    heldout_samples: list[dict] | None = None  # ppo/eval_samples.jsonl: every held-out evaluation's samples
    eval_samples: list[dict] | None = None
    compare_points: list[dict] | None = None  # DIR/compare (optional): the methods on one gold-vs-KL plot
    compare_metrics: dict | None = None
    configs: dict[str, str] = field(default_factory=dict)  # relative path -> YAML text

    def _read(self, rel: str, parse, note: bool = True) -> Any:
        path = self.path / rel
        if not path.is_file():
            if note:
                self.missing.append(rel)
            return None
        try:
            return parse(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            self.missing.append(f"{rel} (unreadable: {type(e).__name__})")
            return None

    def json(self, rel: str, note: bool = True) -> Any:
        return self._read(rel, json.loads, note)

    def jsonl(self, rel: str, note: bool = True) -> list[dict] | None:
        return self._read(rel, parse_jsonl, note)

    def text(self, rel: str, note: bool = True) -> str | None:
        return self._read(rel, str, note)


def parse_jsonl(text: str) -> list[dict]:
    """JSON objects one per line; a line that does not parse (the half-written last line of an
    interrupted run) is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def load_run(path: str | Path, name: str | None = None) -> Run:
    path = Path(path)
    run = Run(path=path, name=name or path.resolve().name)
    run.pipeline = _dict(run.json("pipeline.json"))
    pipeline_config = run.text("pipeline_config.yaml")
    if pipeline_config is not None:
        run.configs["pipeline_config.yaml"] = pipeline_config
        run.stages_planned = _planned_stages(pipeline_config)
    for stage in STAGES:
        text = run.text(f"{stage}/config.yaml", note=False)
        if text is not None:
            run.configs[f"{stage}/config.yaml"] = text
        stage_metrics = _dict(run.json(f"{stage}/metrics.json", note=False))
        if stage_metrics is None:  # pipeline.json keeps a copy of each finished stage's metrics
            stage_metrics = _dict((_dict((run.pipeline or {}).get(stage)) or {}).get("metrics"))
        if stage_metrics is None and not any(m.startswith(f"{stage}/metrics.json") for m in run.missing):
            run.missing.append(f"{stage}/metrics.json")
        run.metrics[stage] = stage_metrics
    run.sft_log = trainer_log(run, "sft")
    run.rm_log = trainer_log(run, "rm")
    run.ppo_history = run.jsonl("ppo/metrics.jsonl")
    run.ppo_samples = run.jsonl("ppo/samples.jsonl")
    run.eval_log = run.jsonl("ppo/eval_log.jsonl", note=not heldout_off(run))
    run.heldout_samples = run.jsonl("ppo/eval_samples.jsonl", note=False)  # older runs did not write it
    run.eval_samples = run.jsonl("eval/samples.jsonl")
    load_compare(run)
    # a stage the run left out (`stages: [ppo, eval]`) has no files to miss; an unreadable one is still named
    run.missing = [m for m in run.missing if planned(run, m.split("/")[0]) or "(unreadable" in m]
    return run


def planned(run: Run, stage: str) -> bool:
    """Whether `stage` is part of the run: in pipeline_config.yaml's `stages`, or anything when that is unknown
    (and anything that is not a stage, like pipeline.json)."""
    return run.stages_planned is None or stage not in STAGES or stage in run.stages_planned


def load_compare(run: Run) -> None:
    """DIR/compare's points and metrics (optional: a run or sweep with the compare stage)."""
    run.compare_points = run.jsonl("compare/points.jsonl", note=False)
    run.compare_metrics = _dict(run.json("compare/metrics.json", note=False))


def heldout_off(run: Run) -> bool:
    """The PPO stage's config turned held-out evaluation off (eval_every: 0 or no eval_prompt_file): such a run
    has no ppo/eval_log.jsonl to miss."""
    config = yaml.safe_load(run.configs.get("ppo/config.yaml") or "") or {}
    return isinstance(config, dict) and (
        config.get("eval_every") == 0 or ("eval_prompt_file" in config and config["eval_prompt_file"] is None)
    )


def _dict(value: Any) -> dict | None:
    return value if isinstance(value, dict) else None


def trainer_log(run: Run, stage: str) -> list[dict] | None:
    """The HF Trainer's `state.log_history`: train_log.json (a JSON list), else the log.jsonl the
    stages append to while training."""
    rows = run.json(f"{stage}/train_log.json", note=False)
    if isinstance(rows, list):
        return [r for r in rows if isinstance(r, dict)]
    rows = run.jsonl(f"{stage}/log.jsonl", note=False)
    if rows is None:
        run.missing.append(f"{stage}/train_log.json")
    return rows


def _planned_stages(config_text: str) -> list[str] | None:
    try:
        stages = (yaml.safe_load(config_text) or {}).get("stages")
    except (yaml.YAMLError, AttributeError):
        return None
    return list(stages) if isinstance(stages, list) else None


def find_runs(folder: str | Path) -> list[Path]:
    """The sub-folders of folder that are runs (any depth below, sorted), else [folder] if it is a run.

    A sweep's folder is both: its own pipeline.json records the shared SFT and RM, and each variant is
    a complete run below it; the variants are what the report compares."""
    folder = Path(folder)
    below = sorted(p.parent for p in folder.rglob("pipeline.json") if p.parent != folder)
    if below:
        return below
    return [folder] if (folder / "pipeline.json").is_file() else []


def looks_like_run(folder: Path) -> bool:
    """A run that has not finished its first stage has no pipeline.json yet, only stage folders."""
    return any((folder / name).exists() for name in ("pipeline.json", "pipeline_config.yaml", *STAGES))


# ---------------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def series(rows: list[dict] | None, key: str, x: str = "step"):
    """(x, y) arrays of the rows that hold numbers under both keys, in x order."""
    points = sorted(
        (_num(r.get(x)), _num(r.get(key)))
        for r in rows or ()
        if _num(r.get(x)) is not None and _num(r.get(key)) is not None
    )
    return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)


def smooth(y, window: int):
    """Centred moving average over the finite values in [i - window//2, i + window//2] (shorter at
    the ends). Centred, so a trend is not shifted the way an exponential average lags it.

        out[i] = mean(y[j] for j in range(i - h, i + h + 1) if 0 <= j < len(y) and isfinite(y[j]))
    """
    y = np.asarray(y, dtype=float)
    h = window // 2
    finite = np.isfinite(y)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, y, 0.0))])  # csum[k] = sum of y[:k]
    ccount = np.concatenate([[0], np.cumsum(finite)])
    lo = np.clip(np.arange(len(y)) - h, 0, len(y))
    hi = np.clip(np.arange(len(y)) + h + 1, 0, len(y))
    count = ccount[hi] - ccount[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (csum[hi] - csum[lo]) / count, np.nan)


def final_value(run: Run, stage: str, key: str) -> float | None:
    """A stage's final metric; for PPO keys, the last logged step when metrics.json lacks it."""
    value = _num((run.metrics.get(stage) or {}).get(key))
    if value is None and stage == "ppo" and run.ppo_history:
        value = _num(run.ppo_history[-1].get(key))
    return value


def config_value(run: Run, stage: str, key: str) -> Any:
    """A key of the stage's resolved config (`<stage>/config.yaml`), None when the file or key is absent."""
    return (yaml.safe_load(run.configs.get(f"{stage}/config.yaml") or "") or {}).get(key)


def kl_target(run: Run) -> float | None:
    """The PPO run's KL target; None with a fixed beta (`kl_controller: fixed`), where nothing aims at it."""
    if config_value(run, "ppo", "kl_controller") == "fixed":
        return None
    return final_value(run, "ppo", "kl_target")


def estimator_text(estimator: Any, samples_per_prompt: Any) -> str:
    """How an RL run made its advantages: the advantage_estimator, with the group size when a prompt was
    sampled more than once ("grpo, k = 4"). A config from before the key existed is gae."""
    name = str(estimator or DEFAULT_ESTIMATOR)
    return name if samples_per_prompt in (None, 1) else f"{name}, k = {samples_per_prompt}"


def without_reward_model(run: Run) -> bool:
    """PPO scored without a reward model: its resolved config says reward_model_path: none (a config without
    the key is not evidence of that)."""
    config = yaml.safe_load(run.configs.get("ppo/config.yaml") or "") or {}
    return isinstance(config, dict) and "reward_model_path" in config and is_off(config["reward_model_path"])


def run_estimator(run: Run) -> str | None:
    """The estimator of a run's PPO stage (`estimator_text`), None when the run has no ppo/config.yaml."""
    if "ppo/config.yaml" not in run.configs:
        return None
    return estimator_text(
        config_value(run, "ppo", "advantage_estimator"), config_value(run, "ppo", "samples_per_prompt")
    )


def fmt(value: Any) -> str:
    """A table cell: 4 significant digits for floats, escaped text otherwise."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        value = json.dumps(value)
    return html.escape(str(value))


# ---------------------------------------------------------------------------------------------------
# Plots (matplotlib's object API on the Agg canvas: no pyplot state, no display needed)
# ---------------------------------------------------------------------------------------------------


def _style():
    import matplotlib  # optional for the core, heavy: imported only when a figure is drawn

    return matplotlib.rc_context(
        {
            "font.size": 9,
            "axes.titlesize": 10,
            "axes.titleweight": "bold",
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "legend.fontsize": 8,
            "legend.frameon": False,
            "lines.linewidth": 1.5,
            "axes.formatter.useoffset": False,  # constant series would read "1e-14+1e-2"
        }
    )


def _figure(nrows: int, ncols: int, width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional, heavy: only when drawing
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def png_bytes(fig) -> bytes:
    for ax in fig.axes:
        _widen_flat_ylim(ax)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _widen_flat_ylim(ax) -> None:
    """A constant series (β of a fixed controller, EOS rate 1.0) gets a readable ±5% y range instead
    of ticks spanning its floating-point noise."""
    low, high = ax.dataLim.intervaly
    if ax.lines and ax.get_autoscaley_on() and 0 <= high - low <= 1e-9 * max(1.0, abs(high)):
        pad = 0.05 * abs(high) or 0.05
        ax.set_ylim(low - pad, high + pad)


def _color(i: int):
    import matplotlib  # optional, heavy: only when drawing

    return matplotlib.colormaps["tab10"](i % 10)


def _line(ax, x, y, label: str | None = None, color=None, **kwargs):
    """Raw line; with many points, the raw line faint and a moving average over ~5% of them on top."""
    if len(x) > SMOOTH_ABOVE:
        (raw,) = ax.plot(x, y, color=color, alpha=0.25, linewidth=1)
        return ax.plot(x, smooth(y, len(x) // 20 * 2 + 1), color=raw.get_color(), label=label, **kwargs)[0]
    return ax.plot(
        x, y, color=color, label=label, marker="o" if len(x) < 12 else None, markersize=3, **kwargs
    )[0]


def _no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _twin(ax, color):
    right = ax.twinx()
    right.spines["right"].set_visible(True)
    right.grid(False)
    right.tick_params(axis="y", colors=color)
    return right


def _legend(ax, *more_axes) -> None:
    handles, labels = [], []
    for a in (ax, *more_axes):
        h, lab = a.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:
        ax.legend(handles, labels, loc="best")


def plot_sft(log: list[dict]):
    fig, axes = _figure(1, 1, 6.5, 3.6)
    ax = axes[0, 0]
    for key, label in (("loss", "train"), ("eval_loss", "eval")):
        x, y = series(log, key)
        if len(x):
            _line(ax, x, y, label=label)
    ax.set(
        title="SFT loss (completion tokens)", xlabel="optimizer step", ylabel="cross-entropy (nats / token)"
    )
    _legend(ax)
    return fig


def plot_rm(log: list[dict] | None, metrics: dict | None):
    """Loss, pairwise accuracy (chance 0.5, bag-of-words baseline dashed) and margin r(chosen) − r(rejected)."""
    metrics = metrics or {}
    fig, axes = _figure(1, 3, 12, 3.6)
    last_step = max((_num(r.get("step")) or 0 for r in log or ()), default=0) or _num(
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
                _line(ax, x, y, label=label)
                drawn = True
        final = _num(metrics.get(eval_key))
        if final is not None and not len(series(log, eval_key)[0]):
            ax.plot(
                [last_step or 0], [final], "*", markersize=12, color="C1", label=f"final eval {final:.3g}"
            )
            drawn = True
        if train_key == "accuracy" and drawn:
            ax.axhline(0.5, color="gray", linestyle=":", linewidth=1, label="chance")
            baseline = _num(metrics.get("baseline_accuracy"))
            if baseline is not None:
                ax.axhline(
                    baseline, color="k", linestyle="--", linewidth=1, label=f"bag-of-words {baseline:.3g}"
                )
        if not drawn:
            _no_data(ax)
        ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
        _legend(ax)
    return fig


def _logged(history: list[dict] | None, key: str) -> bool:
    return len(series(history, key)[0]) > 0


def ppo_panels(history: list[dict]) -> tuple:
    """The PPO_PANELS this run logged anything for: a critic-free estimator logs no loss/value or val/*, so its
    report has no value-loss or explained-variance panel."""
    return tuple(
        panel
        for panel in PPO_PANELS
        if any(_logged(history, key) for key in (*panel[2], *(panel[3] or ())[:1]))
    )


def compare_panels(runs: list[Run]) -> tuple:
    """The COMPARE_PANELS some run logged their key for (no value panels when no run has a value function)."""
    return tuple(panel for panel in COMPARE_PANELS if any(_logged(run.ppo_history, panel[0]) for run in runs))


def _panel_grid(panels: int, panel_width: float, row_height: float):
    """A figure of `panels` panels in as few rows of at most 5 as hold them, the rows as even as they can be
    (12 panels: 3 x 4; 10, a run without a value function: 2 x 5); the unused cells of the last row hidden.
    Returns (fig, the panels' axes in reading order)."""
    nrows = max(1, math.ceil(panels / 5))
    ncols = max(1, math.ceil(panels / nrows))
    fig, axes = _figure(nrows, ncols, panel_width * ncols, row_height * nrows)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:panels])


def plot_ppo(history: list[dict], kl_target: float | None):
    panels = ppo_panels(history)
    fig, axes = _panel_grid(len(panels), 4, 9.5 / 3)
    for ax, (title, ylabel, keys, right) in zip(axes, panels):
        ax.set(title=title, xlabel="PPO step", ylabel=ylabel)
        if keys[0].startswith("time/"):
            drawn = _time_panel(ax, history)
        else:
            drawn = False
            for i, key in enumerate(keys):
                x, y = series(history, key)
                if not len(x):
                    continue
                line = _line(ax, x, y, label=key, color=f"C{i}")
                drawn = True
                if key == "objective/scores":
                    _, std = series(history, "objective/scores_std")
                    if len(std) == len(y):
                        ax.fill_between(
                            x, y - std, y + std, color=line.get_color(), alpha=0.15, label="± std"
                        )
            if keys[0] == "objective/kl" and kl_target is not None and drawn:
                ax.axhline(kl_target, color="C0", linestyle="--", linewidth=1, label=f"target {kl_target:g}")
            if keys[0] == "policy/ratio" and drawn:
                ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
        axes_used = [ax]
        if right is not None:
            x, y = series(history, right[0])
            if len(x):
                twin = _twin(ax, "C3")
                _line(twin, x, y, label=right[0], color="C3")
                twin.set_ylabel(right[1], color="C3")
                axes_used.append(twin)
                drawn = True
        if not drawn:
            _no_data(ax)
        _legend(*axes_used)
    fig.suptitle("PPO training (one point per rollout batch)", fontweight="bold")
    return fig


def ensemble_members(history: list[dict]) -> list[str]:
    """The objective/scores_member_<k> keys a PPO run with a reward-model ensemble logged, in member order."""
    keys = {k for row in history for k in row if k.startswith("objective/scores_member_")}
    return sorted(keys, key=lambda k: int(k.rsplit("_", 1)[1]))


def plot_ensemble(history: list[dict]):
    """A reward-model ensemble: each member's mean score with the combined score PPO optimised, and the
    members' disagreement (std across the members, averaged over the batch)."""
    fig, axes = _figure(1, 2, 12, 3.6)
    left, right = axes[0]
    for i, key in enumerate(ensemble_members(history)):
        _line(left, *series(history, key), label=f"member {key.rsplit('_', 1)[1]}", color=_color(i + 1))
    _line(left, *series(history, "objective/scores"), label="combined (PPO's score)", color="k")
    left.set(title="Ensemble: member and combined scores", xlabel="PPO step", ylabel="normalised RM units")
    _legend(left)
    x, y = series(history, "objective/scores_disagreement")
    if len(x):
        _line(right, x, y, color=_color(0))
    else:
        _no_data(right)
    right.set(title="Ensemble disagreement", xlabel="PPO step", ylabel="std across members")
    return fig


def _time_panel(ax, history: list[dict]) -> bool:
    """Generate / score / train stacked, the whole step on top (the rest is bookkeeping)."""
    x, total = series(history, "time/step")
    phases = [
        (k.split("/")[1], [_num(r.get(k)) for r in history])
        for k in ("time/generate", "time/score", "time/train")
    ]
    phases = [(name, v) for name, v in phases if all(t is not None for t in v)]
    steps = [_num(r.get("step")) for r in history]
    if phases and all(s is not None for s in steps):
        order = np.argsort(steps)
        xs = np.array(steps)[order]
        ax.stackplot(xs, *[np.array(v)[order] for _, v in phases], labels=[n for n, _ in phases], alpha=0.7)
    if len(x):
        ax.plot(x, total, color="k", linewidth=1, label="whole step")
    return bool(phases) or bool(len(x))


def _eval_points(eval_log: list[dict]):
    """(step, kl, rm_score, gold_score) arrays of the held-out evaluations with a KL and a gold score, in step
    order; rm_score is NaN where no reward model scored (a run on a reward function alone)."""
    rows = sorted(
        (r for r in eval_log if all(_num(r.get(k)) is not None for k in ("kl", "gold_score"))),
        key=lambda r: _num(r.get("step")) or 0,
    )
    step, kl, gold = (
        np.array([_num(r.get(k)) for r in rows], dtype=float) for k in ("step", "kl", "gold_score")
    )
    rm = np.array([_num(r.get("rm_score")) for r in rows], dtype=float)  # None -> NaN
    return step, kl, rm, gold


def _overopt_axes(ax, eval_log: list[dict], title: str, legend: bool = True) -> bool:
    """Proxy (RM) score left, gold score right, both against KL; points joined in step order."""
    step, kl, rm, gold = _eval_points(eval_log)
    ax.set(title=title, xlabel="KL to reference (nats / response)")
    if not len(kl):
        _no_data(ax)
        return False
    ax.plot(kl, rm, "o-", color="C0", markersize=4, label="proxy: RM score")
    ax.set_ylabel("RM score (normalised)", color="C0")
    ax.tick_params(axis="y", colors="C0")
    twin = _twin(ax, "C1")
    twin.plot(kl, gold, "s-", color="C1", markersize=4, label="gold judge score")
    twin.set_ylabel("gold score", color="C1")
    for i in {0, len(kl) - 1}:  # on the proxy's line, or on the gold's when no reward model scored
        on, y = (ax, rm[i]) if np.isfinite(rm[i]) else (twin, gold[i])
        on.annotate(f"step {step[i]:g}", (kl[i], y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if legend:
        ax.figure.legend(handles=[*ax.lines, *twin.lines], loc="outside lower center", ncols=2)
    return True


def plot_overoptimisation(eval_log: list[dict]):
    fig, axes = _figure(1, 1, 6.5, 4)
    _overopt_axes(axes[0, 0], eval_log, "Gold vs proxy reward as the policy moves away (held-out prompts)")
    return fig


def accuracy_logged(eval_log: list[dict] | None) -> bool:
    """Whether PPO's held-out evaluations measured accuracy (a task with a verifier)."""
    return any(_logged(eval_log, key) for key, _ in ACCURACY_KINDS)


def accuracy_points(eval_log: list[dict] | None, key: str, x: str = "step"):
    """(step, x, accuracy, stderr) arrays of the held-out evaluations with a number under x and key, in step
    order (against KL as well: the curve is the run's path, and KL need not grow at every evaluation); stderr
    is NaN where the row has none."""
    rows = sorted(
        (r for r in eval_log or () if _num(r.get(x)) is not None and _num(r.get(key)) is not None),
        key=lambda r: _num(r.get("step")) or 0,
    )
    return tuple(
        np.array([_num(r.get(k)) for r in rows], dtype=float) for k in ("step", x, key, f"{key}_stderr")
    )


def _accuracy_curve(
    ax, eval_log, key: str, x: str, *, color, label: str, linestyle="-", marker="o", band: float = 0.12
) -> bool:
    """One accuracy curve: against the step with ± one standard error shaded (opacity `band`), against KL
    with it as bars (a band would fold back where KL falls between evaluations)."""
    _, xs, y, se = accuracy_points(eval_log, key, x)
    if not len(xs):
        return False
    style = {"color": color, "label": label, "linestyle": linestyle, "marker": marker, "markersize": 3}
    if x == "step":
        ax.plot(xs, y, **style)
        ax.fill_between(xs, y - se, y + se, color=color, alpha=band, linewidth=0)  # NaN stderr: no band there
    else:
        ax.errorbar(xs, y, yerr=np.nan_to_num(se), capsize=2, elinewidth=0.8, **style)
    return True


def _accuracy_axes(ax, x: str, title: str, drawn: bool) -> None:
    """Accuracy from 0% to 100% on every panel, so runs and panels read on one scale."""
    from matplotlib.ticker import PercentFormatter  # optional, heavy: only when drawing

    ax.set(title=title, xlabel="PPO step" if x == "step" else "KL to reference (nats / response)")
    if not drawn:
        _no_data(ax)
        return
    ax.set(ylabel="held-out accuracy", ylim=(-0.02, 1.02))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))


def plot_accuracy(eval_log: list[dict]):
    """PPO's held-out accuracy, sampled and greedy, against the step (left) and against KL (right)."""
    fig, axes = _figure(1, 2, 12, 3.8)
    for ax, x in zip(axes[0], ("step", "kl")):
        drawn = [
            _accuracy_curve(ax, eval_log, key, x, color=_color(i), label=kind, marker="os"[i])
            for i, (key, kind) in enumerate(ACCURACY_KINDS)
        ]
        _accuracy_axes(ax, x, f"Held-out accuracy against {'step' if x == 'step' else 'KL'}", any(drawn))
        if x == "kl" and any(drawn):  # where the path starts and ends
            key = ACCURACY_KINDS[0][0] if drawn[0] else ACCURACY_KINDS[1][0]
            step, kl, y, _ = accuracy_points(eval_log, key, "kl")
            for i in {0, len(kl) - 1}:
                ax.annotate(
                    f"step {step[i]:g}",
                    (kl[i], y[i]),
                    textcoords="offset points",
                    xytext=(4, -10),
                    fontsize=7,
                )
        _legend(ax)
    return fig


def run_styles(runs: list[Run]) -> list[tuple]:
    """(colour, line style) of each run's accuracy curves: a colour per run; but where runs repeat an advantage
    estimator (its seeds) and there is more than one estimator, a colour per estimator and a line style per run
    within it, so four estimators x three seeds read as four colours."""
    estimators = [run_estimator(run) for run in runs]
    distinct = list(dict.fromkeys(estimators))
    if len(distinct) in (1, len(runs)):
        return [(_color(i), "-") for i in range(len(runs))]
    styles = []
    for i, estimator in enumerate(estimators):
        repeat = estimators[:i].count(estimator)
        styles.append((_color(distinct.index(estimator)), ("-", "--", ":", "-.")[repeat % 4]))
    return styles


def plot_compare_accuracy(runs: list[Run]):
    """Every run's held-out accuracy against step (left) and KL (right), one curve per run (no average over
    seeds: each seed is a run); a row per kind some run measured (sampled, greedy)."""
    from matplotlib.lines import Line2D  # optional, heavy: only when drawing

    kinds = [(key, kind) for key, kind in ACCURACY_KINDS if any(_logged(r.eval_log, key) for r in runs)]
    styles = run_styles(runs)
    fig, axes = _figure(len(kinds), 2, 12, 3.8 * len(kinds))
    for row, (key, kind) in zip(axes, kinds):
        for ax, x in zip(row, ("step", "kl")):
            drawn = [  # fainter bands than one run's: many overlap
                _accuracy_curve(ax, r.eval_log, key, x, color=c, label=r.name, linestyle=ls, band=0.06)
                for r, (c, ls) in zip(runs, styles)
            ]
            _accuracy_axes(
                ax, x, f"Held-out accuracy, {kind}, against {'step' if x == 'step' else 'KL'}", any(drawn)
            )
    colors = list(dict.fromkeys(c for c, _ in styles))
    # the legend filled column by column, a colour's runs together: with equal groups, a column per estimator
    order = sorted(range(len(runs)), key=lambda i: colors.index(styles[i][0]))
    handles = [Line2D([], [], color=styles[i][0], linestyle=styles[i][1], label=runs[i].name) for i in order]
    ncols = len(colors) if len(colors) < len(runs) else min(len(runs), 6)
    fig.legend(handles=handles, loc="outside upper center", ncols=ncols)
    return fig


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
    fig, axes = _figure(1, 1, 8, 4.8)
    ax = axes[0, 0]
    twin = _twin(ax, "0.4")
    ax.set(title="Gold reward against KL: which method buys the most gold per nat?",
           xlabel="sqrt(KL to the SFT model)   (sqrt nats)", ylabel="gold score (solid)")  # fmt: skip
    twin.set_ylabel("RM score, normalised (dashed)", color="0.4")
    for i, method in enumerate(dict.fromkeys(p.get("method") for p in points)):
        ps = [p for p in points if p.get("method") == method and _num(p.get("kl")) is not None]
        # an RL run's points stay in step order: its path along the run (KL is not monotone)
        if method not in rl_methods(metrics):
            ps.sort(key=lambda p: p["kl"])
        if not ps:
            continue
        d = np.sqrt(np.maximum([p["kl"] for p in ps], 0.0))
        color = _color(i)
        ax.plot(d, [p["gold_score"] for p in ps], "o-", color=color, markersize=4,
                label=method_label(method, metrics))  # fmt: skip
        twin.plot(d, [p["rm_score"] for p in ps], "--", color=color, linewidth=1)
        fit = fits.get(method)
        if fit:
            grid, curve = np.array(fit["curve"]).T  # compare's fitted law on sqrt(KL)
            ax.plot(grid, curve, ":", color=color, linewidth=1.5,
                    label=f"fit: α {fit['alpha']:.2f}, β {fit['beta']:.2f}, R² {fit['r2']:.2f}"
                    + (" (poor)" if fit["poor"] else ""))  # fmt: skip
    if not ax.lines:
        _no_data(ax)
    else:
        ax.legend(fontsize=7, loc="best")
    return fig


def plot_compare_ppo(runs: list[Run]):
    panels = compare_panels(runs)
    fig, axes = _panel_grid(len(panels), 4, 10 / 3)
    for ax, (key, title, ylabel) in zip(axes, panels):
        ax.set(title=title, xlabel="PPO step", ylabel=ylabel)
        drawn = False
        for i, run in enumerate(runs):
            x, y = series(run.ppo_history, key)
            if not len(x):
                continue
            _line(ax, x, y, label=run.name, color=_color(i))
            drawn = True
            target = kl_target(run)
            if key == "objective/kl" and target is not None:
                ax.axhline(target, color=_color(i), linestyle="--", linewidth=1)
        if not drawn:
            _no_data(ax)
    from matplotlib.lines import Line2D  # optional, heavy: only when drawing

    handles = [Line2D([], [], color=_color(i), label=r.name) for i, r in enumerate(runs)]
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(runs), 6))
    return fig


def plot_compare_overoptimisation(runs: list[Run]):
    """Row 1: every run's proxy and gold score against KL, overlaid. Row 2+: each run on its own."""
    ncols = min(len(runs), 3)
    nrows = 1 + math.ceil(len(runs) / ncols)
    fig, axes = _figure(nrows, max(ncols, 2), 5.2 * max(ncols, 2), 3.8 * nrows)
    proxy_ax, gold_ax = axes[0, 0], axes[0, 1]
    for i, run in enumerate(runs):
        _, kl, rm, gold = _eval_points(run.eval_log or [])
        if len(kl):
            proxy_ax.plot(kl, rm, "o-", color=_color(i), markersize=3, label=run.name)
            gold_ax.plot(kl, gold, "o-", color=_color(i), markersize=3, label=run.name)
    for ax, what in ((proxy_ax, "Proxy: RM score"), (gold_ax, "Gold judge score")):
        ax.set(title=f"{what} against KL, all runs", xlabel="KL to reference (nats / response)", ylabel=what)
        if ax.lines:
            ax.legend()
        else:
            _no_data(ax)
    for ax in axes[0, 2:]:
        ax.set_visible(False)
    flat = list(axes[1:].flat)
    for ax, run in zip(flat, runs):
        _overopt_axes(ax, run.eval_log or [], run.name, legend=False)  # the coloured axis labels say which
    for ax in flat[len(runs) :]:
        ax.set_visible(False)
    return fig


# ---------------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto;
       max-width: 1400px; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
.meta { color: #666; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8em; margin: 1em 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.6em 1em; min-width: 11em; background: #fafafa; }
.card .label { font-size: 0.8em; color: #666; text-transform: uppercase; letter-spacing: 0.03em; }
.card .value { font-size: 1.35em; font-weight: 600; }
.card .sub { font-size: 0.8em; color: #666; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td { overflow-wrap: anywhere; } td.num { overflow-wrap: normal; white-space: nowrap; }
tr.group th { background: #e9eef5; font-weight: 600; }
.key { display: block; color: #888; font-size: 0.8em; font-family: ui-monospace, monospace; }
table.eval td:first-child { min-width: 12em; }
table.texts { width: 100%; table-layout: fixed; }
table.texts td { white-space: pre-wrap; }
table.pairs th { width: 50%; } tr.prompt td { background: #f7f7f7; font-style: italic; }
table.ppo-samples th:nth-child(1) { width: 30%; } table.ppo-samples th:nth-child(3) { width: 6em; }
table.watch tr:first-child th:nth-child(-n+3) { width: 5.5em; }
table.runs td:nth-child(-n+2) { white-space: nowrap; overflow-wrap: normal; }
.wide { overflow-x: auto; }
.scores { display: block; color: #666; font-size: 0.85em; margin-top: 0.3em; white-space: normal; }
.prompt-text { color: #777; } .empty { color: #999; font-style: italic; }
.ok { color: #1a7f37; font-weight: 600; } .wrong { color: #b42318; font-weight: 600; }
.greedy { display: block; margin-top: 0.4em; padding-top: 0.3em; border-top: 1px dashed #ddd; }
.flag { color: #a15c00; background: #fff0d9; border-radius: 3px; padding: 0 0.3em; font-size: 0.8em;
        white-space: nowrap; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
figure { margin: 1em 0; } figcaption { color: #666; font-size: 0.85em; }
.note { color: #555; }
.missing { color: #a15c00; background: #fff6e5; border-left: 4px solid #f0a020; padding: 0.4em 0.8em; }
details { margin: 0.4em 0; } summary { cursor: pointer; font-weight: 600; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
nav a { margin-right: 1em; }
"""


class Page:
    """A report page being built: HTML parts plus the PNGs it embeds (also written to `png_dir`)."""

    def __init__(self, png_dir: Path):
        self.parts: list[str] = []
        self.png_dir = png_dir
        self.pngs: list[Path] = []

    def add(self, *parts: str) -> None:
        self.parts.extend(parts)

    def figure(self, fig, name: str, alt: str, caption: str = "") -> None:
        data = png_bytes(fig)
        self.png_dir.mkdir(parents=True, exist_ok=True)
        path = self.png_dir / f"{name}.png"
        path.write_bytes(data)
        self.pngs.append(path)
        encoded = base64.b64encode(data).decode("ascii")
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self.add(
            f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">{cap}</figure>'
        )

    def missing(self, text: str) -> None:
        self.add(f'<p class="missing">{html.escape(text)}</p>')

    def html(self, title: str) -> str:
        head = (
            '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        )
        return head + "\n".join(self.parts) + "\n</body>\n</html>\n"


def table(header: list[str], rows: list[list[Any]], css_class: str = "") -> str:
    """Cells are formatted with `fmt` unless already a `Raw` HTML string; numbers right-aligned."""

    def cell(v: Any) -> str:
        if isinstance(v, RawNumber):
            return f'<td class="num">{v}</td>'
        if isinstance(v, Raw):
            return f"<td>{v}</td>"
        return f'<td class="num">{fmt(v)}</td>' if _num(v) is not None else f"<td>{fmt(v)}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>\n" for row in rows)
    cls = f' class="{css_class}"' if css_class else ""
    return f"<table{cls}>\n<tr>{head}</tr>\n{body}</table>"


class Raw(str):
    """HTML that a table cell shows as is."""


class RawNumber(Raw):
    """A number already formatted (e.g. a percentage): shown as is, aligned as a number."""


def metrics_table(metrics: dict) -> str:
    return table(["metric", "value"], [[k, v] for k, v in metrics.items()])


def _card(label: str, value: str, sub: str = "") -> str:
    sub_html = f'<div class="sub">{html.escape(sub)}</div>' if sub else ""
    return (
        f'<div class="card"><div class="label">{html.escape(label)}</div>'
        f'<div class="value">{html.escape(value)}</div>{sub_html}</div>'
    )


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _g(value: float | None, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def headline_cards(run: Run) -> str:
    sft_eos = final_value(run, "sft", "eos_rate")
    # held-out test pairs when the RM stage had a test_file (the figure recipes report), else the eval pairs
    rm_split = "test" if final_value(run, "rm", "test_accuracy") is not None else "eval"
    rm_acc = final_value(run, "rm", f"{rm_split}_accuracy")
    rm_base = final_value(run, "rm", "baseline_test_accuracy" if rm_split == "test" else "baseline_accuracy")
    first = final_value(run, "ppo", "scores_first")
    if first is None and run.ppo_history:
        first = _num(run.ppo_history[0].get("objective/scores"))
    last = _first(final_value(run, "ppo", "scores_last"), final_value(run, "ppo", "objective/scores"))
    kl = _first(final_value(run, "ppo", "kl_last"), final_value(run, "ppo", "objective/kl"))
    target = kl_target(run)
    beta = final_value(run, "ppo", "objective/kl_coef")
    gold, rm_win = final_value(run, "eval", "gold_win_rate"), final_value(run, "eval", "rm_win_rate")
    wall = sum(
        _num((e or {}).get("wall_time_s")) or 0.0
        for e in (run.pipeline or {}).values()
        if isinstance(e, dict)
    )
    no_rm = without_reward_model(run)
    accuracy = accuracy_cards(run)  # with no gold, held-out accuracy takes the gold win rate's place
    cards = [
        *([_card("SFT EOS rate", _g(sft_eos, ".1%"), "responses that stop")] if planned(run, "sft") else []),
        *([_card(f"RM {rm_split} accuracy", _g(rm_acc, ".1%"),
                 f"bag-of-words baseline {_g(rm_base, '.1%')}, chance 50%" if rm_base is not None else "chance 50%")]
          if planned(run, "rm") else []),
        _card("PPO score" if no_rm else "PPO RM score", f"{_g(first)} → {_g(last)}",
              "first → last step" + ("; the reward function's (no reward model)" if no_rm else "")),
        _card("PPO KL", _g(kl), f"target {_g(target)}, β = {_g(beta)}" if target is not None else f"fixed β = {_g(beta)}"),
        *estimator_card(run),
        *accuracy,
        *([] if accuracy and gold is None else [_card("Gold win rate", _g(gold, ".1%"),
            f"vs SFT; RM win rate {_g(rm_win, '.1%')}" if rm_win is not None else "vs SFT")]),
    ]  # fmt: skip
    sentiment = final_value(run, "eval", "sentiment_win_rate")
    fluency = final_value(run, "eval", "fluency_perplexity")
    if sentiment is not None and fluency is not None:  # the fluency-aware gold's parts
        fluency_sft = final_value(run, "eval", "fluency_perplexity_baseline")
        cards.append(
            _card("Sentiment win rate", _g(sentiment, ".1%"), "vs SFT, the gold's sentiment part alone")
        )
        cards.append(
            _card("Fluency perplexity", _g(fluency), f"SFT {_g(fluency_sft)}; lower reads more fluent")
        )
    if wall:
        cards.append(_card("Wall time", f"{wall / 60:.1f} min", "all stages"))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _pm(value: float | None, stderr: float | None) -> str:
    """A fraction as a percentage, ± its standard error when there is one: "62.5% ± 4.0%"."""
    return _g(value, ".1%") + ("" if value is None or stderr is None else f" ± {stderr:.1%}")


def accuracy_cards(run: Run) -> list[str]:
    """Held-out accuracy, sampled and greedy: the final evaluation's policy vs baseline (eval/metrics.json), ±
    standard errors; without it, PPO's first → last held-out evaluation (ppo/eval_log.jsonl). None measured
    (a task without a verifier): no card."""
    cards = []
    for key, kind in ACCURACY_KINDS:
        policy = final_value(run, "eval", key)
        if policy is not None:
            baseline = _pm(
                final_value(run, "eval", f"{key}_baseline"),
                final_value(run, "eval", f"{key}_stderr_baseline"),
            )
            cards.append(
                _card(
                    f"Held-out accuracy, {kind}",
                    _pm(policy, final_value(run, "eval", f"{key}_stderr")),
                    f"policy; {baseline_name(run)} {baseline}",
                )
            )
            continue
        step, _, y, se = accuracy_points(run.eval_log, key)
        if len(step):
            cards.append(
                _card(
                    f"Held-out accuracy, {kind}",
                    f"{y[0]:.1%} → {y[-1]:.1%}",
                    f"PPO's evaluations, step {step[0]:g} → {step[-1]:g}; ± {_g(_num(se[-1]), '.1%')} last",
                )
            )
    return cards


def baseline_name(run: Run) -> str:
    """What the evaluation compares the policy with: the SFT model, or the model PPO started from when the
    run has no SFT stage (`stages: [ppo, eval]`)."""
    return "SFT baseline" if planned(run, "sft") else "starting model"


def estimator_card(run: Run) -> list[str]:
    """The card that says how the PPO stage made its advantages (none without a PPO config)."""
    if "ppo/config.yaml" not in run.configs:
        return []
    estimator = str(config_value(run, "ppo", "advantage_estimator") or DEFAULT_ESTIMATOR)
    row = ESTIMATORS.get(estimator)  # None: a name this version does not know
    critic = "GAE over a value function" if row is not None and row.critic else "no value function"
    k = config_value(run, "ppo", "samples_per_prompt")
    sub = f"{critic}; {k} samples / prompt" if k not in (None, 1) else critic
    return [_card("Advantage estimator", str(estimator), sub)]


def _skipped(run: Run, stage: str, files: list[str]) -> str:
    """Why a section has no data: the stage was not part of the run, or which files are missing."""
    if not planned(run, stage):
        return (
            f"The {stage} stage is not part of this run (pipeline_config.yaml stages: {run.stages_planned})."
            + _instead(run, stage)
        )
    return "Missing: " + ", ".join(f"{run.name}/{f}" for f in files) + " — section skipped."


def _instead(run: Run, stage: str) -> str:
    """What took the place of a stage the run left out: the model PPO started from, the score it maximised."""
    if stage == "sft" and config_value(run, "ppo", "model_name_or_path"):
        return f" PPO started from {config_value(run, 'ppo', 'model_name_or_path')}, also its reference."
    if stage == "rm" and without_reward_model(run) and config_value(run, "ppo", "reward_fn"):
        return f" PPO's score is the reward function {config_value(run, 'ppo', 'reward_fn')} alone."
    return ""


def skip_section(page: Page, run: Run, stage: str, files: list[str]) -> None:
    """A section without data: one grey line when its stage is not part of the run, else the missing files."""
    if planned(run, stage):
        page.missing(_skipped(run, stage, files))
    else:
        page.add(f'<p class="note">{html.escape(_skipped(run, stage, files))}</p>')


def _wall_time(run: Run, stage: str) -> str:
    entry = (run.pipeline or {}).get(stage)
    seconds = _num(entry.get("wall_time_s")) if isinstance(entry, dict) else None
    return "" if seconds is None else f'<p class="meta">wall time {seconds:.1f} s</p>'


def section_sft(page: Page, run: Run) -> None:
    page.add('<h2 id="sft">1. Supervised fine-tuning</h2>', _wall_time(run, "sft"))
    if run.sft_log and len(series(run.sft_log, "loss")[0]) + len(series(run.sft_log, "eval_loss")[0]):
        page.figure(
            plot_sft(run.sft_log), "sft_loss", "SFT loss", "Next-token loss on the completion tokens only."
        )
    else:
        skip_section(page, run, "sft", ["sft/train_log.json (no loss curve)"])
    if run.metrics.get("sft"):
        page.add(metrics_table(run.metrics["sft"]))


def section_rm(page: Page, run: Run) -> None:
    page.add('<h2 id="rm">2. Reward model</h2>', _wall_time(run, "rm"))
    if run.rm_log or run.metrics.get("rm"):
        page.figure(
            plot_rm(run.rm_log, run.metrics.get("rm")),
            "rm",
            "Reward model loss, accuracy and margin",
            "Held-out pairwise accuracy against chance (0.5) and a bag-of-words logistic regression.",
        )
        if not run.rm_log:
            page.missing("Missing: rm/train_log.json — only the final evaluation is plotted.")
    else:
        skip_section(page, run, "rm", ["rm/train_log.json", "rm/metrics.json"])
    if run.metrics.get("rm"):
        page.add(metrics_table(run.metrics["rm"]))


def section_ppo(page: Page, run: Run) -> None:
    page.add('<h2 id="ppo">3. PPO</h2>', _wall_time(run, "ppo"))
    if run.ppo_history:
        target = kl_target(run)
        caption = "β on the right axis of the KL panel" + (
            ", the KL target dashed." if target is not None else "."
        )
        if len(run.ppo_history) > SMOOTH_ABOVE:
            caption += " Faint: raw values; solid: centred moving average over 5% of the steps."
        left_out = [panel[0] for panel in PPO_PANELS if panel not in ppo_panels(run.ppo_history)]
        if left_out:
            caption += f" Not drawn, nothing logged for them: {', '.join(left_out)}."
        page.figure(plot_ppo(run.ppo_history, target), "ppo", "PPO curves", caption)
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
    gold, accuracy = bool(run.eval_log and len(_eval_points(run.eval_log)[0])), accuracy_logged(run.eval_log)
    if accuracy:
        section_accuracy(page, run, gold)
    if gold or not accuracy:  # with accuracy and no gold, the accuracy curves stand alone
        section_overoptimisation(page, run, gold)
    if run.ppo_samples:
        steps = sorted({s.get("step") for s in run.ppo_samples if _num(s.get("step")) is not None})
        for step in dict.fromkeys(steps[:1] + steps[-1:]):  # the first and the last logged step
            page.add(f"<h3>PPO samples at step {fmt(step)}</h3>")
            page.add(ppo_samples_table([s for s in run.ppo_samples if s.get("step") == step]))
    if run.metrics.get("ppo"):
        page.add(
            "<details><summary>Final PPO metrics</summary>", metrics_table(run.metrics["ppo"]), "</details>"
        )


def section_accuracy(page: Page, run: Run, gold: bool) -> None:
    """PPO's held-out accuracy (a task with a verifier) against step and KL."""
    page.add("<h3>Held-out accuracy against step and KL</h3>")
    verifier = (run.metrics.get("eval") or {}).get("accuracy_fn") or config_value(run, "ppo", "reward_fn")
    caption = (
        "PPO's held-out evaluations (ppo/eval_log.jsonl; step 0 is the model PPO started from): the accuracy of "
        "the run's sampling and of one greedy response per prompt, ± one standard error (shaded; bars against "
        "KL). Right: the same against KL to the reference on the held-out samples, joined in step order: what "
        "each nat away from the reference buys in held-out accuracy."
    )
    if not gold:
        caption += (
            " This run has no gold judge: held-out accuracy"
            + (f", checked by the verifier {verifier}," if verifier else "")
            + " is its held-out metric."
        )
    page.figure(plot_accuracy(run.eval_log), "accuracy", "Held-out accuracy against step and KL", caption)


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


def gold_note(run: Run) -> str | None:
    """Which LM the fluency-aware gold of this run's evaluation reads fluency with, and whether that LM is
    the run's own base model (the SFT stage started from it) or one that no stage trained. None when the
    gold is not a judge JSON with a fluency model, or its file cannot be found from here."""
    try:
        spec = config_value(run, "eval", "gold_judge")
        base = config_value(run, "sft", "model_name_or_path")
        path = Path(str(spec))
        gold = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError, OSError, AttributeError):
        return None
    if not isinstance(gold, dict) or "fluency_model" not in gold:
        return None
    lm = (path.parent / str(gold["fluency_model"])).resolve()
    own = base is not None and (
        Path(str(base)).resolve() == lm or str(base) == gold.get("fluency_model_hub_name")
    )
    if own:
        return (
            f"The gold ({spec}) reads fluency with {lm.name}, the base model this run's SFT stage started "
            f'from: fluency here means "still reads like {lm.name}", not independent English. The gold\'s '
            "sentiment part is independent of every model of the run."
        )
    return f"The gold ({spec}) reads fluency with {lm.name}, an LM that no stage of this run trained."


@dataclass(frozen=True)
class EvalRow:
    """A row of the evaluation table: `key` in eval/metrics.json (the baseline's is key + "_baseline"), its
    standard error `stderr` (+ "_baseline"), the win rate `win` (its standard error win + "_stderr"), and
    `sample`, the eval/samples.jsonl field (policy_<sample>, baseline_<sample>) whose paired differences give
    the standard error of the difference."""

    label: str
    key: str
    stderr: str | None = None
    win: str | None = None
    sample: str | None = None


MEMBERS = "rm_score_member_*"  # stands for every ensemble member's row (`eval_groups`)
EVAL_GROUPS: tuple[tuple[str, tuple[EvalRow, ...]], ...] = (
    ("Held-out accuracy (a task with a verifier: the fraction of responses it scores correct)", (
        EvalRow("accuracy, sampled (the run's sampling)", "accuracy", "accuracy_stderr", sample="correct"),
        EvalRow("accuracy, greedy (one response per prompt)", "accuracy_greedy", "accuracy_greedy_stderr",
                sample="greedy_correct"),
    )),
    ("Gold judge (stands in for people)", (
        EvalRow("gold score", "gold_score_mean", "gold_score_stderr", "gold_win_rate", "gold_score"),
    )),
    ("Sentiment (the gold's sentiment part: predicted mean human rating)", (
        EvalRow("sentiment", "sentiment_mean", "sentiment_stderr", "sentiment_win_rate", "sentiment"),
    )),
    ("Fluency (perplexity under the gold's LM; lower reads more fluent)", (
        EvalRow("fluency perplexity", "fluency_perplexity"),
    )),
    ("Reward model, ensemble and reward function (the proxy PPO maximised)", (
        EvalRow("RM score (normalised)", "rm_score_mean", "rm_score_stderr", "rm_win_rate", "rm_score"),
        EvalRow("RM member", MEMBERS),
        EvalRow("RM members' disagreement (std)", "rm_disagreement_mean"),
        EvalRow("reward function", "reward_fn_mean", "reward_fn_stderr", "reward_fn_win_rate", "reward_fn"),
        EvalRow("combined score (PPO's score)", "combined_score_mean", "combined_score_stderr",
                "combined_win_rate", "combined_score"),
    )),
    ("KL to the reference (nats / response)", (
        EvalRow("KL, temperature 1", "kl_to_ref", "kl_to_ref_stderr", sample="kl_to_ref"),
        EvalRow("KL at the sampling temperature", "kl_to_ref_at_temperature", "kl_to_ref_at_temperature_stderr"),
    )),
    ("Length and EOS", (
        EvalRow("response length (tokens, EOS included)", "response_length_mean", sample="length"),
        EvalRow("EOS rate (responses that stop)", "eos_rate", sample="eos"),
    )),
    ("Diversity (unique / total token n-grams over all responses)", (
        EvalRow("distinct-1", "distinct_1"),
        EvalRow("distinct-2", "distinct_2"),
    )),
    ("Degeneracy (fraction of responses; signs of reward hacking)", (
        EvalRow("a run of one character (4+)", "char_run_rate"),
        EvalRow("a repeated word 3-gram", "repeated_ngram_rate"),
        EvalRow("empty", "empty_rate"),
    )),
)  # fmt: skip


def _sample_value(value: Any) -> float | None:
    """A samples.jsonl field as a number: eos (a bool) counts 1 or 0."""
    return float(value) if isinstance(value, bool) else _num(value)


def paired_stderr(samples: list[dict] | None, field_name: str | None) -> float | None:
    """Standard error of the mean paired difference policy_<field> - baseline_<field> over the samples
    (sample std / sqrt(n)); None without at least two samples that hold both. A sample that holds neither is
    no pair (the greedy response is on a prompt's first sample alone); one that holds one side alone gives None."""
    if not samples or field_name is None:
        return None
    diffs = [
        (_sample_value(s.get(f"policy_{field_name}")), _sample_value(s.get(f"baseline_{field_name}")))
        for s in samples
    ]
    diffs = [pair for pair in diffs if pair != (None, None)]
    if len(diffs) < 2 or any(a is None or b is None for a, b in diffs):
        return None
    return float(np.std([a - b for a, b in diffs], ddof=1) / math.sqrt(len(diffs)))


def eval_groups(metrics: dict, samples: list[dict] | None = None) -> list[tuple[str, list[dict]]]:
    """The evaluation table's groups and rows, every row a dict: label, key, policy, baseline, difference,
    diff_stderr, paired (whether diff_stderr comes from the paired samples), win, win_stderr. A row whose
    policy and baseline are both absent (null: not measured) is left out, and so is a group with no row; the
    KL at the sampling temperature is left out at temperature 1 (it is the KL above)."""
    members = sorted(
        (
            k.removesuffix("_mean")
            for k in metrics
            if k.startswith("rm_score_member_") and k.endswith("_mean")
        ),
        key=lambda k: int(k.rsplit("_", 1)[1]),
    )
    groups = []
    for title, specs in EVAL_GROUPS:
        rows = []
        for spec in specs:
            if spec.key == MEMBERS:
                expanded = [EvalRow(f"RM member {k.rsplit('_', 1)[1]}", f"{k}_mean") for k in members]
            elif spec.key == "kl_to_ref_at_temperature" and _num(metrics.get("temperature")) == 1.0:
                expanded = []
            else:
                expanded = [spec]
            for row in expanded:
                policy, baseline = _num(metrics.get(row.key)), _num(metrics.get(row.key + "_baseline"))
                if policy is None and baseline is None:
                    continue
                both = policy is not None and baseline is not None
                paired = paired_stderr(samples, row.sample) if both else None
                se = [
                    _num(metrics.get(f"{row.stderr}{s}")) if row.stderr else None for s in ("", "_baseline")
                ]
                unpaired = math.hypot(*se) if both and None not in se else None
                rows.append({
                    "label": row.label, "key": row.key, "policy": policy, "baseline": baseline,
                    "difference": policy - baseline if both else None,
                    "diff_stderr": paired if paired is not None else unpaired, "paired": paired is not None,
                    "win": _num(metrics.get(row.win)) if row.win else None,
                    "win_stderr": _num(metrics.get(f"{row.win}_stderr")) if row.win else None,
                })  # fmt: skip
        if rows:
            groups.append((title, rows))
    return groups


def _cell(value: float | None, spec: str = ".4g", css: str = "num") -> str:
    return f'<td class="{css}">{"–" if value is None else format(value, spec)}</td>'


def eval_table(metrics: dict, samples: list[dict] | None) -> str:
    """metric | policy | baseline | difference | ± stderr | win rate | ± stderr, one header row per group."""
    head = "".join(
        f"<th>{h}</th>"
        for h in ("metric", "policy", "baseline", "difference", "± stderr", "win rate", "± stderr")
    )
    body = []
    for title, rows in eval_groups(metrics, samples):
        body.append(f'<tr class="group"><th colspan="7">{html.escape(title)}</th></tr>')
        for r in rows:
            stderr = _cell(r["diff_stderr"], ".2g")
            if r["diff_stderr"] is not None and not r["paired"]:
                stderr = stderr.replace("</td>", "†</td>")
            body.append(
                f'<tr><td>{html.escape(r["label"])}<span class="key">{html.escape(r["key"])}</span></td>'
                + _cell(r["policy"]) + _cell(r["baseline"]) + _cell(r["difference"], "+.4g") + stderr
                + _cell(r["win"], ".1%") + _cell(r["win_stderr"], ".1%") + "</tr>"
            )  # fmt: skip
    return f'<table class="eval">\n<tr>{head}</tr>\n' + "\n".join(body) + "\n</table>"


VALIDITY_CHECKS = (  # (suffix of the validity keys, what the gold is asked to prefer)
    ("shuffled", "the real sentence to its continuation's words shuffled"),
    ("repeated", "the real sentence to its most positive word written four times"),
    ("salad", "the real sentence to praise salad (its words shuffled, two praise words put in)"),
)


def validity_table(validity: dict) -> str:
    """The fluency-aware gold's checks on held-out data (metrics.json: gold_judge_validity, from the judge
    JSON; `data/make_gold.py`): how often the gold, and its sentiment part alone, prefer real sentences to
    degenerate ones, and agree with people on pairs of real sentences."""
    rows = []
    for name, what in VALIDITY_CHECKS:
        gold, sentiment = (
            validity.get(f"gold_prefers_real_over_{name}"),
            validity.get(f"sentiment_prefers_real_over_{name}"),
        )
        if _num(gold) is not None or _num(sentiment) is not None:
            nll = validity.get(f"fluency_nll_{name}_median")
            rows.append([f"prefers {what}", _pct(gold), _pct(sentiment), nll])
    if _num(validity.get("gold_agrees_with_people")) is not None:
        rows.append([
            f"agrees with people on {validity.get('pairs', '')} pairs of real sentences",
            _pct(validity.get("gold_agrees_with_people")), _pct(validity.get("sentiment_agrees_with_people")), None,
        ])  # fmt: skip
    if not rows:  # another judge's figures: as they are
        return table(["figure", "value"], [[k, v] for k, v in validity.items()])
    where = f"{validity.get('file', 'held-out data')}, {validity.get('sentences', '?')} sentences"
    real = _num(validity.get("fluency_nll_real_median"))
    header = ["the gold …", "gold", "sentiment part alone",
              "median fluency NLL" + (f" (real sentences {real:.3g})" if real is not None else "")]  # fmt: skip
    return (
        f'<p class="meta">The gold\'s validity checks on held-out data ({html.escape(where)}):</p>'
        + table(header, rows, css_class="validity")
    )


def _pct(value: Any) -> RawNumber | None:
    return RawNumber(f"{value:.1%}") if _num(value) is not None else None


def eval_meta(metrics: dict) -> str:
    """One line: how many prompts and samples, the models compared, the temperature and seed, the gold."""
    parts = []
    if metrics.get("num_pairs") is not None:
        parts.append(
            f"{metrics.get('num_prompts')} held-out prompts × {metrics.get('samples_per_prompt')} "
            f"= {metrics.get('num_pairs')} paired samples"
        )
    if metrics.get("policy_path"):
        parts.append(f"policy {metrics['policy_path']} vs baseline {metrics.get('baseline_path')}")
    for key, name in (("temperature", "temperature"), ("seed", "seed"), ("gold_judge", "gold judge")):
        if metrics.get(key) is not None:
            parts.append(f"{name} {metrics[key]}")
    accuracy = _num(metrics.get("gold_judge_heldout_accuracy"))
    if accuracy is not None:
        parts.append(f"the gold's sentiment part: held-out accuracy {accuracy:.1%}")
    if metrics.get("accuracy_fn"):
        parts.append(f"accuracy checked by {metrics['accuracy_fn']}")
    return f'<p class="meta">{html.escape("; ".join(parts))}.</p>' if parts else ""


def _verdict(value: Any) -> str:
    """A sample's correctness (a verifier's 1.0 or 0.0) as a tag; none when the sample was not checked."""
    correct = _sample_value(value)
    if correct is None:
        return ""
    return '<span class="ok">✓ correct</span>' if correct > 0 else '<span class="wrong">✗ incorrect</span>'


def _scores_line(row: dict, who: str) -> str:
    """The few scores that matter for one side of a sample: whether it is correct (a task with a verifier),
    gold (and its parts), the proxy, length/EOS."""
    items = []
    for field_name, name, spec in (
        ("gold_score", "gold", "+.2f"), ("sentiment", "sentiment", "+.2f"),
        ("fluency_perplexity", "perplexity", ".3g"), ("rm_score", "RM", "+.2f"),
        ("reward_fn", "reward fn", "+.3g"), ("combined_score", "PPO score", "+.2f"), ("kl_to_ref", "KL", ".2f"),
    ):  # fmt: skip
        value = _num(row.get(f"{who}_{field_name}"))
        if value is not None:
            items.append(f"{name} {format(value, spec)}")
    length, eos = _num(row.get(f"{who}_length")), row.get(f"{who}_eos")
    if length is not None:
        items.append(f"{length:g} tokens" + (", no EOS" if eos is False else ""))
    verdict = _verdict(row.get(f"{who}_correct"))
    return f'<span class="scores">{verdict}{" · " if verdict and items else ""}{html.escape(" · ".join(items))}</span>'


def _text(value: Any) -> str:
    """A response or prompt as it was written (whitespace kept by the CSS), escaped; an empty one marked."""
    text = "" if value is None else str(value)
    return html.escape(text) if text.strip() else '<span class="empty">(empty)</span>'


def _greedy(row: dict, who: str) -> str:
    """One side's greedy response to the prompt and whether it is correct (eval/samples.jsonl holds it on a
    prompt's first sample alone: nothing on the others)."""
    response = row.get(f"{who}_greedy_response")
    if response is None:
        return ""
    verdict = _verdict(row.get(f"{who}_greedy_correct"))
    return (
        f'<span class="greedy"><span class="key">greedy</span>{_text(response)}'
        f'{f"""<span class="scores">{verdict}</span>""" if verdict else ""}</span>'
    )


def pair_samples_table(rows: list[dict], limit: int = SAMPLE_ROWS, baseline: str = "SFT baseline") -> str:
    """Per held-out prompt: the prompt across the table, then the baseline's and the policy's responses side
    by side, each with its few scores under it and, where there is one, its greedy response (every field stays
    in eval/samples.jsonl)."""
    body = []
    for row in rows[:limit]:
        sample = f' <span class="key">sample {row["sample"]}</span>' if _num(row.get("sample")) else ""
        body.append(f'<tr class="prompt"><td colspan="2">{_text(row.get("prompt"))}{sample}</td></tr>')
        body.append(
            "<tr>" + "".join(
                f'<td><span class="response">{_text(row.get(f"{who}_response"))}</span>{_scores_line(row, who)}'
                f"{_greedy(row, who)}</td>"
                for who in ("baseline", "policy")
            ) + "</tr>"
        )  # fmt: skip
    return (
        f'<table class="texts pairs">\n<tr><th>{html.escape(baseline[:1].upper() + baseline[1:])}</th><th>PPO policy</th></tr>\n'
        + "\n".join(body)
        + "\n</table>"
    )


def ppo_samples_table(rows: list[dict], limit: int = 10) -> str:
    """PPO's logged samples (ppo/samples.jsonl): prompt, response, the score PPO gave it."""
    body = [
        f"<tr><td>{_text(r.get('query'))}</td><td>{_text(r.get('response'))}</td>{_cell(_num(r.get('score')), '+.3f')}</tr>"
        for r in rows[:limit]
    ]
    return (
        '<table class="texts ppo-samples">\n<tr><th>prompt</th><th>response</th><th>score</th></tr>\n'
        + "\n".join(body)
        + "\n</table>"
    )


def section_eval(page: Page, run: Run) -> None:
    page.add(f'<h2 id="eval">4. Evaluation: policy vs {baseline_name(run)}</h2>', _wall_time(run, "eval"))
    if not planned(run, "eval") and not run.metrics.get("eval") and not run.eval_samples:
        skip_section(page, run, "eval", [])
        return
    note = gold_note(run)
    if note:
        page.add(f'<p class="meta">{html.escape(note)}</p>')
    metrics = run.metrics.get("eval")
    if metrics:
        page.add(eval_meta(metrics), eval_table(metrics, run.eval_samples))
        page.add(
            '<p class="meta">difference: policy − baseline. ± stderr: the standard error of the mean paired '
            "difference over the samples (eval/samples.jsonl); † where the samples lack the figure: "
            "sqrt(se_policy² + se_baseline²), as if unpaired. Win rate: the fraction of pairs in which the "
            "policy's sample scores higher (ties count one half). Rows the run did not measure are left out.</p>"
        )
        validity = metrics.get("gold_judge_validity")
        if isinstance(validity, dict) and validity:
            page.add(validity_table(validity))
        page.add(
            "<details><summary>eval/metrics.json (raw)</summary>"
            f"<pre>{html.escape(json.dumps(metrics, indent=1, default=str))}</pre></details>"
        )
    else:
        page.missing(_skipped(run, "eval", ["eval/metrics.json"]))
    page.add("<h3>Before / after samples</h3>")
    if run.eval_samples:
        page.add(f'<p class="meta">First {min(SAMPLE_ROWS, len(run.eval_samples))} of {len(run.eval_samples)} '
                 f"held-out samples: the {baseline_name(run)}'s and the PPO policy's responses to the same prompt, "
                 "with their scores (every field is in eval/samples.jsonl).</p>")  # fmt: skip
        page.add(pair_samples_table(run.eval_samples, baseline=baseline_name(run)))
    else:
        page.missing(_skipped(run, "eval", ["eval/samples.jsonl"]))


# Reward-hacking watch: the samples the proxy likes far more than the gold, and the degeneracy counters

WATCH_TOP = 3  # samples shown per evaluation
WATCH_OPEN = 5  # evaluations shown open (the final and the latest PPO ones); the rest collapsed
DEGENERACY_NAMES = {
    "char_run_rate": "a run of one character (4+)",
    "repeated_ngram_rate": "a repeated word 3-gram",
    "empty_rate": "empty",
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
    out = []
    if run.eval_samples:
        rows = run.eval_samples
        sides = {
            who: (
                [{"prompt": r.get("prompt"), "response": r.get(f"{who}_response")} for r in rows],
                [_first(_num(r.get(f"{who}_combined_score")), _num(r.get(f"{who}_rm_score"))) for r in rows],
                [_num(r.get(f"{who}_gold_score")) for r in rows],
            )
            for who in ("policy", "baseline")
        }
        baseline = sides["baseline"]
        final = _watched("final evaluation", final_value(run, "eval", "kl_to_ref"), *sides["policy"],
                         reference="the SFT baseline's samples", ref=baseline)  # fmt: skip
        final["baseline"] = _watched(f"{baseline_name(run)} (final evaluation)", final_value(run, "eval", "kl_to_ref_baseline"),
                                     *baseline, reference="its own samples", ref=baseline)  # fmt: skip
        out.append(final)
    by_step: dict[float, list[dict]] = {}
    for r in run.heldout_samples or ():
        if _num(r.get("step")) is not None:
            by_step.setdefault(_num(r["step"]), []).append(r)
    kl_at = {_num(r.get("step")): _num(r.get("kl")) for r in run.eval_log or ()}
    start = by_step.get(0.0)
    ref = (
        (None, [_num(r.get("proxy")) for r in start], [_num(r.get("gold_score")) for r in start])
        if start
        else None
    )
    for step in sorted(by_step, reverse=True):
        rows = by_step[step]
        out.append(_watched(
            f"PPO step {step:g}", kl_at.get(step),
            [{"prompt": r.get("prompt"), "response": r.get("response")} for r in rows],
            [_num(r.get("proxy")) for r in rows], [_num(r.get("gold_score")) for r in rows],
            reference="the step-0 evaluation (the SFT model)", ref=ref,
        ))  # fmt: skip
    return out


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
                f"<tr>{_cell(s['gap'], '+.2f')}{_cell(s['proxy'], '+.3g')}{_cell(s['gold'], '+.3g')}"
                f'<td><span class="prompt-text">{_text(s["prompt"])}</span>'
                f'<span class="response">{_text(s["response"])}</span>{_flags(str(s["response"] or ""))}</td></tr>'
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
                     *[_pct(ev[k]) for k in DEGENERACY_KEYS]])  # fmt: skip
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
    fig, axes = _figure(1, 2, 12, 3.4)
    for ax, x_key, xlabel in (
        (axes[0, 0], "step", "PPO step"),
        (axes[0, 1], "kl", "KL to reference (nats / response)"),
    ):
        for i, (key, name) in enumerate(DEGENERACY_NAMES.items()):
            x, y = series(eval_log, key, x=x_key)
            if len(x):
                ax.plot(x, y, "o-", color=_color(i), markersize=3, label=name)
        ax.set(title=f"Degenerate responses against {'step' if x_key == 'step' else 'KL'}", xlabel=xlabel,
               ylabel="fraction of held-out responses")  # fmt: skip
        if ax.lines:
            top = max(max(line.get_ydata()) for line in ax.lines)
            ax.set_ylim(0, max(0.05, 1.15 * top))  # fractions: from 0, and a flat 0 stays at the bottom
            ax.legend(loc="best")
        else:
            _no_data(ax)
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
    page.add("<h3>Degeneracy counters</h3>")
    rates = [_num(r.get(k)) for r in run.eval_log or () for k in DEGENERACY_KEYS]
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


def section_methods(page: Page, run: Run, number: str = "6. ") -> None:
    """Only for runs with a compare stage (`llm-rlhf compare`); a sweep's compare page has it unnumbered."""
    if not run.compare_points or not run.compare_metrics:
        return
    metrics = run.compare_metrics
    page.add(
        f'<h2 id="compare">{number}Methods compared: gold reward against KL</h2>', _wall_time(run, "compare")
    )
    page.add(f'<p class="meta">{metrics.get("num_prompts")} held-out prompts (the PPO runs\' held-out set), '
             f"one gold judge ({html.escape(str(metrics.get('gold_judge')))}). Best-of-n's KL is the analytic "
             "log n − (n−1)/n; the KL measured on its samples is in the table.</p>")  # fmt: skip
    page.figure(plot_methods(run.compare_points, metrics), "methods",
                "Gold and RM score against sqrt(KL): each RL run joined in step order, DPO and best-of-n by KL")  # fmt: skip
    order = list(dict.fromkeys(p.get("method") for p in run.compare_points))  # metrics.json's keys are sorted
    best = sorted((metrics.get("best") or {}).items(), key=lambda item: _rank(order, item[0]))
    page.add("<h3>Best gold of each method</h3>", table(
        ["method", "best gold score", "at KL", "point"],
        [[method_label(m, metrics), b.get("gold_score"), b.get("kl"), b.get("label")] for m, b in best],
    ))  # fmt: skip
    fits = sorted(
        ((m, f) for m, f in (metrics.get("fits") or {}).items() if f), key=lambda item: _rank(order, item[0])
    )
    page.add("<h3>Gao et al. (2022) law fits</h3>", table(
        ["method", "form (d = sqrt KL)", "α ± se", "β ± se", "R²", "points", "fit"],
        [[method_label(m, metrics),
          "d(α − β d)" if f["form"] == "bon" else "d(α − β log d)",
          f"{f['alpha']:.3f} ± {f['alpha_stderr']:.3f}", f"{f['beta']:.3f} ± {f['beta_stderr']:.3f}",
          f["r2"], f["num_points"], "poor" if f["poor"] else "good"]
         for m, f in fits],
    ) if fits else '<p class="note">No law fitted: a fit needs 3 points with KL &gt; 0 and the SFT model\'s gold.</p>')  # fmt: skip
    rows = [[method_label(p["method"], metrics), p.get("label"), p.get("kl"), p.get("kl_measured"),
             p.get("rm_score"), p.get("gold_score"), p.get("fluency_perplexity")] for p in run.compare_points]  # fmt: skip
    page.add("<details><summary>Every point</summary>", table(
        ["method", "point", "KL", "KL measured (best-of-n)", "RM score", "gold score", "fluency perplexity"], rows
    ), "</details>")  # fmt: skip


def _rank(order: list, method: str) -> int:
    """Where `method` comes in `order` (the points' order: the RL runs, DPO, best-of-n); unknown ones last."""
    return order.index(method) if method in order else len(order)


def section_configs(page: Page, run: Run) -> None:
    page.add('<h2 id="configs">Resolved configs</h2>')
    if not run.configs:
        page.missing("Missing: pipeline_config.yaml and every <stage>/config.yaml.")
    for rel, text in run.configs.items():
        page.add(f"<details><summary>{html.escape(rel)}</summary><pre>{html.escape(text)}</pre></details>")


def _header(page: Page, title: str, folder: Path) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M")
    page.add(
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{html.escape(str(folder.resolve()))} · built {stamp} by '
        f"<code>llm-rlhf report {html.escape(str(folder))}</code></p>",
    )


def build_run_page(run: Run, png_dir: Path) -> Page:
    page = Page(png_dir)
    _header(page, f"RLHF run: {run.name}", run.path)
    page.add(headline_cards(run))
    page.add(
        '<nav><a href="#sft">SFT</a><a href="#rm">Reward model</a><a href="#ppo">PPO</a>'
        '<a href="#eval">Evaluation</a><a href="#hacking">Reward-hacking watch</a><a href="#configs">Configs</a></nav>'
    )
    if run.missing:
        page.missing("Not found in this run folder: " + ", ".join(run.missing))
    for section in (
        section_sft,
        section_rm,
        section_ppo,
        section_eval,
        section_hacking,
        section_methods,
        section_configs,
    ):
        section(page, run)
    return page


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
                if isinstance(value, str):
                    value = value.replace(str(run.path), "<run>").replace(run.name, "<run>")
                values[f"{prefix}.{key}"] = value
        flat.append(values)
    keys = [k for k in dict.fromkeys(k for values in flat for k in values)]
    rows = [(k, [values.get(k) for values in flat]) for k in keys]
    return [
        (k, vals) for k, vals in rows if len({json.dumps(v, sort_keys=True, default=str) for v in vals}) > 1
    ]


def compare_columns(runs: list[Run]) -> list[tuple[str, str]]:
    """The COMPARE_COLUMNS some run has a value for (no accuracy columns for a task without a verifier)."""
    return [
        (stage, key)
        for stage, key in COMPARE_COLUMNS
        if any(final_value(r, stage, key) is not None for r in runs)
    ]


def column_value(run: Run, stage: str, key: str) -> Any:
    """A cell of the side-by-side table: the final value; an accuracy as a percentage ± its standard error."""
    value = final_value(run, stage, key)
    if key in dict(ACCURACY_KINDS) and value is not None:
        return RawNumber(html.escape(_pm(value, final_value(run, stage, f"{key}_stderr"))))
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
        "against KL); every run is its own curve (seeds too: nothing is averaged)."
        + (
            " One colour per advantage estimator, a line style per run with it."
            if grouped
            else " One colour per run."
        ),
    )


def build_compare_page(runs: list[Run], folder: Path, png_dir: Path) -> Page:
    page = Page(png_dir)
    _header(page, f"RLHF runs side by side: {folder.resolve().name}", folder)
    page.add("<h2>Headline metrics</h2>")
    columns = compare_columns(runs)
    header = ["run", "estimator", *[f"{key} ({stage})" if stage == "ppo" else key for stage, key in columns]]
    rows = []
    for run in runs:
        link = Raw(
            f'<a href="{html.escape(run.path.relative_to(folder).as_posix())}/report.html">{html.escape(run.name)}</a>'
        )
        rows.append([link, run_estimator(run), *[column_value(run, stage, key) for stage, key in columns]])
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
            " accuracy: the final evaluation's held-out accuracy ± its standard error."
            if ("eval", "accuracy") in columns or ("eval", "accuracy_greedy") in columns
            else ""
        )
        + "</p>"
    )
    diffs = config_differences(runs)
    if diffs:
        page.add("<h2>Where the configs differ</h2>")
        page.add(table(["config key", *[r.name for r in runs]], [[k, *v] for k, v in diffs]))
    page.add("<h2>PPO curves</h2>")
    if any(r.ppo_history for r in runs):
        page.figure(plot_compare_ppo(runs), "compare_ppo", "PPO curves of every run",
                    "One colour per run; dashed lines in the KL panel are each run's KL target.")  # fmt: skip
    else:
        page.missing("No run has ppo/metrics.jsonl.")
    accuracy = any(accuracy_logged(r.eval_log) for r in runs)
    if accuracy:
        compare_accuracy(page, runs)
    if any(r.eval_log and len(_eval_points(r.eval_log)[0]) for r in runs):
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
    shared = Run(path=folder, name=folder.resolve().name)  # a sweep's compare stage runs once, in DIR/compare
    shared.pipeline = _dict(shared.json("pipeline.json", note=False))
    load_compare(shared)
    section_methods(page, shared, number="")
    notes = [f"{r.name}: {', '.join(r.missing)}" for r in runs if r.missing]
    if notes:
        page.add(
            "<h2>Missing files</h2>", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"
        )
    return page


# ---------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------


def write_report(run_dir: str | Path) -> Path:
    """Write run_dir/report.html (self-contained) and run_dir/report/*.png; return the HTML path.

    run_dir is one pipeline run, or a folder whose sub-folders are runs: then each run gets its own
    report and run_dir/report.html compares them."""
    folder = Path(run_dir)
    runs = find_runs(folder)
    with _style():
        if len(runs) > 1 or (runs and runs[0] != folder):
            loaded = []
            for path in runs:
                run = load_run(path, name=path.relative_to(folder).as_posix())
                _write(build_run_page(run, path / "report"), path / "report.html", f"RLHF run {run.name}")
                loaded.append(run)
            page = build_compare_page(loaded, folder, folder / "report")
            title = f"RLHF runs: {folder.resolve().name}"
        else:
            run = load_run(folder)
            page, title = build_run_page(run, folder / "report"), f"RLHF run {run.name}"
    return _write(page, folder / "report.html", title)


def _write(page: Page, path: Path, title: str) -> Path:
    atomic_write_text(path, page.html(title))
    return path


def cli(argv: list[str]) -> int:
    """`llm-rlhf report DIR`: rebuild DIR/report.html from the logs in DIR."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if len(argv) != 1:
        print(
            "error: usage: llm-rlhf report DIR (a pipeline run folder, or a folder of runs)", file=sys.stderr
        )
        return 2
    folder = Path(argv[0])
    if not folder.is_dir():
        print(f"error: report folder '{folder}' does not exist", file=sys.stderr)
        return 2
    if not find_runs(folder) and not looks_like_run(folder):
        print(
            f"error: '{folder}' holds no pipeline run (no pipeline.json in it or below it)", file=sys.stderr
        )
        return 2
    print(f"report: {write_report(folder)}")
    return 0
