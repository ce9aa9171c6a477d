"""Reading a run folder: the files of each stage (`Run`, `load_run`), which sub-folders are runs
(`find_runs`), and the facts the sections ask of a run (final metrics, config keys, the KL target, the
estimator).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llm_rlhf.core.config import is_off
from llm_rlhf.evaluation import metric_names
from llm_rlhf.evaluation.hacking import WATCH_KEYS, watch_fields
from llm_rlhf.interfaces.report.numbers import num
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.rl.estimators import DEFAULT_ESTIMATOR

STAGES = ("sft", "rm", "ppo", "eval")


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
    run.pipeline = as_dict(run.json("pipeline.json"))
    pipeline_config = run.text("pipeline_config.yaml")
    if pipeline_config is not None:
        run.configs["pipeline_config.yaml"] = pipeline_config
        run.stages_planned = _planned_stages(pipeline_config)
    for stage in STAGES:
        text = run.text(f"{stage}/config.yaml", note=False)
        if text is not None:
            run.configs[f"{stage}/config.yaml"] = text
        stage_metrics = as_dict(run.json(f"{stage}/metrics.json", note=False))
        if stage_metrics is None:  # pipeline.json keeps a copy of each finished stage's metrics
            stage_metrics = as_dict((as_dict((run.pipeline or {}).get(stage)) or {}).get("metrics"))
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
    run.compare_metrics = as_dict(run.json("compare/metrics.json", note=False))


def heldout_off(run: Run) -> bool:
    """The PPO stage's config turned held-out evaluation off (eval_every: 0 or no eval_prompt_file): such a run
    has no ppo/eval_log.jsonl to miss."""
    config = yaml.safe_load(run.configs.get("ppo/config.yaml") or "") or {}
    return isinstance(config, dict) and (
        config.get("eval_every") == 0 or ("eval_prompt_file" in config and config["eval_prompt_file"] is None)
    )


def as_dict(value: Any) -> dict | None:
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


def final_value(run: Run, stage: str, key: str) -> float | None:
    """A stage's final metric; for PPO keys, the last logged step when metrics.json lacks it."""
    value = num((run.metrics.get(stage) or {}).get(key))
    if value is None and stage == "ppo" and run.ppo_history:
        value = num(run.ppo_history[-1].get(key))
    return value


def config_value(run: Run, stage: str, key: str) -> Any:
    """A key of the stage's resolved config (`<stage>/config.yaml`), None when the file or key is absent."""
    return (yaml.safe_load(run.configs.get(f"{stage}/config.yaml") or "") or {}).get(key)


def masked_run(value: Any, run: Run) -> Any:
    """A config value with the run's own folder (its path, its name) written "<run>": the paths every run
    writes under itself (output_dir) read the same in every run."""
    if isinstance(value, str):
        return value.replace(str(run.path), "<run>").replace(run.name, "<run>")
    return value


def differing_keys(configs: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """(key, the value in each config) of the keys whose values differ between the configs, in the order the
    keys first appear; a key a config lacks is None there."""
    keys = list(dict.fromkeys(k for config in configs for k in config))
    rows = [(k, [config.get(k) for config in configs]) for k in keys]
    return [
        (k, vals) for k, vals in rows if len({json.dumps(v, sort_keys=True, default=str) for v in vals}) > 1
    ]


def kl_target(run: Run) -> float | None:
    """The PPO run's KL target; None with a fixed beta (`kl_controller: fixed`), where nothing aims at it."""
    if config_value(run, "ppo", "kl_controller") == "fixed":
        return None
    return final_value(run, "ppo", ppo_metrics.KL_TARGET)


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


SEED_SUFFIX = re.compile(r"[-_.]?seed[-_.]?\d+$")  # a sweep variant's name ends in its seed: "gspo-seed1"


def name_stem(name: str) -> str:
    """A run's folder name without its seed suffix: "gae-seed2" -> "gae", "lr1e-4_seed_0" -> "lr1e-4";
    a name that is only a seed ("seed-1") -> ""."""
    return SEED_SUFFIX.sub("", name)


def run_estimator(run: Run) -> str | None:
    """The estimator of a run's PPO stage (`estimator_text`), None when the run has no ppo/config.yaml."""
    if "ppo/config.yaml" not in run.configs:
        return None
    return estimator_text(
        config_value(run, "ppo", "advantage_estimator"), config_value(run, "ppo", "samples_per_prompt")
    )


def baseline_name(run: Run) -> str:
    """What the evaluation compares the policy with: the SFT model, or the model PPO started from when the
    run has no SFT stage (`stages: [ppo, eval]`)."""
    return "SFT baseline" if planned(run, "sft") else "starting model"


def heldout_alarm(run: Run) -> dict | None:
    """The reward-hacking alarm over PPO's held-out evaluations (`hacking.watch_fields`): {"step": where it
    fired (None: quiet), "rules", "reasons", "best_step", "steps": the evaluated steps, "stopped": stop_on_alarm
    stopped the run there, "returned_step": the step of the policy the run returned (None when metrics.json
    does not say)}. Read from the last line of ppo/eval_log.jsonl, the run's own verdict; a log written before
    the alarm existed is read again with watch_fields (its older lines lack the collapse counters and the
    standard errors: fewer rules can fire). None without a held-out log."""
    log = [r for r in run.eval_log or () if num(r.get(metric_names.LOG_STEP)) is not None]
    if not log:
        return None
    if all(key in log[-1] for key in WATCH_KEYS):
        fields = {key: log[-1][key] for key in WATCH_KEYS}
    else:
        weight = num(config_value(run, "ppo", "reward_fn_weight"))
        fields = watch_fields(log, reward_fn_weight=1.0 if weight is None else weight)
    final = run.metrics.get("ppo") or {}
    return {
        "step": fields[metric_names.LOG_ALARM_STEP],
        "rules": list(fields[metric_names.LOG_ALARM_RULES] or []),
        "reasons": list(fields[metric_names.LOG_ALARM_REASONS] or []),
        "best_step": fields[metric_names.LOG_BEST_STEP],
        "steps": [num(r[metric_names.LOG_STEP]) for r in log],
        "stopped": final.get(ppo_metrics.STOPPED_ON_ALARM) is True,
        "returned_step": num(final.get(ppo_metrics.RETURNED_STEP)),
    }


def final_alarm(run: Run) -> dict | None:
    """The alarm's counter rules on the final evaluation (eval/metrics.json, `evaluate.final_alarm`): {"rules",
    "reasons"}; None when metrics.json does not hold them (an older evaluation, or none)."""
    metrics = run.metrics.get("eval") or {}
    if not isinstance(metrics.get(metric_names.ALARM_RULES), list):
        return None
    return {
        "rules": list(metrics[metric_names.ALARM_RULES]),
        "reasons": list(metrics.get(metric_names.ALARM_REASONS) or []),
    }
