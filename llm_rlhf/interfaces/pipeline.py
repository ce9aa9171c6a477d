"""The whole pipeline in one command: SFT -> RM -> PPO -> evaluation (and the report).

    llm-rlhf pipeline --config recipes/reviews/pipeline.yaml [--output_dir DIR] [--ppo "{steps: 10}"]

Each stage's config is its recipe file (`sft_config`, `rm_config`, ...) plus this config's per-stage
overrides; the chaining keys are set here so each stage reads the previous stage's output folder:

    DIR/sft  <- base model                      DIR/rm   <- DIR/sft
    DIR/ppo  <- DIR/sft (policy, reference), DIR/rm
    DIR/eval <- DIR/ppo vs DIR/sft, scored by DIR/rm and the gold judge
    DIR/dpo  <- DIR/sft (policy, reference), the RM stage's pairs   (optional: `stages: [sft, dpo]`)
    DIR/compare <- DIR/sft, DIR/ppo (its scorer)  (optional: PPO, DPO per beta and best-of-n on one gold-vs-KL
                                                plot; PPO needs eval_every > 0)

A sweep (`sweep: [{name: gae}, {name: grpo, advantage_estimator: grpo, samples_per_prompt: 4}]`): SFT, RM
(and DPO) once in DIR, each variant's PPO and eval in DIR/<name>; with the compare stage, compare runs once
after every variant, in DIR/compare, over all of them (DIR/<first>/ppo its ppo_dir, the other variants'
PPO runs its more_ppo_dirs), so DPO and best-of-n are computed once and every variant is on one plot.

A reward-model ensemble (`rm_members: K`): the RM stage runs K times, member 0 in DIR/rm and member k in
DIR/rm-<k>, member k seeded with the RM seed + k (and with `rm_bootstrap`, trained on its own bootstrap
resample of the pairs); PPO gets the list [DIR/rm, DIR/rm-1, ...] as reward_model_path. compare scores with
the PPO run's own scorer (its config.yaml: the members, their combine and its reward_fn).

Evaluation scores the policy as its PPO stage did: eval takes the keys that decide a sample's score from PPO's
resolved config (`scoring.scored_as`: the scorer's keys, reward_model_path, the ensemble keys, reward_fn and
reward_fn_weight, and where a response ends, stop_strings and min_new_tokens), so a sweep variant that trains
on one member of an ensemble, or with a reward function, is evaluated on that score; it takes PPO's verifier
(accuracy_fn) too; `eval:` overrides still win.

A reasoning-gym task (`task: chain_sum-t2d1`, a task of data/tasks/tasks.yaml): PPO's prompt_file,
eval_prompt_file, reward_fn and accuracy_fn and evaluation's prompt_file, reward_fn and accuracy_fn are the
files of data/tasks/<task>/ (`llm_rlhf.tasks.gym.task_keys`), so a recipe names its task once; a
stage file that sets one of them too is a ConfigError, and `ppo:` / `eval:` overrides still win.

Only the stages of the run are chained: without `sft` in `stages` PPO (and RM, DPO, compare) start from
their recipes' model_name_or_path, without `rm` PPO scores with its recipe's reward_model_path and reward_fn,
and evaluation's baseline is then PPO's starting model (e.g. `stages: [ppo, eval]`: PPO straight from an
instruct model with a rule as the reward, the instruct model the reference and the baseline).

A stage whose folder holds `metrics.json` is finished and skipped; a stage folder without it was
interrupted and is resumed. `DIR/pipeline.json` records each stage's wall time and headline metrics.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import PartialState

from llm_rlhf.core.config import _coerce, format_config, help_field, load_yaml_config, require, save_config
from llm_rlhf.core.errors import ConfigError
from llm_rlhf.core.utils import atomic_write_json, last_checkpoint
from llm_rlhf.interfaces.report import write_report
from llm_rlhf.models.scoring import scored_as
from llm_rlhf.rl.episodes import episode_keys
from llm_rlhf.stages import compare, dpo, evaluate, ppo, reward, sft
from llm_rlhf.tasks.gym import task_keys

STAGES = ("sft", "rm", "ppo", "eval")  # the default stages, in order
OPTIONAL_STAGES = ("dpo", "compare")  # run only when `stages` names them
# each has Config and run(cfg)
MODULES = {"sft": sft, "rm": reward, "ppo": ppo, "eval": evaluate, "dpo": dpo, "compare": compare}


@dataclass
class Config:
    output_dir: str = help_field(
        "runs/reviews", "Run folder: one sub-folder per stage, pipeline.json and the report."
    )
    stages: list[str] = help_field(
        list(STAGES),
        "Stages to run, in order (a subset of sft, rm, ppo, eval, dpo, compare; dpo needs only sft, compare "
        "sft, rm and a ppo run with eval_every > 0).",
    )
    sft_config: str = help_field("recipes/reviews/sft.yaml", "Recipe of the SFT stage.")
    rm_config: str = help_field("recipes/reviews/rm.yaml", "Recipe of the reward-model stage.")
    ppo_config: str = help_field("recipes/reviews/ppo.yaml", "Recipe of the PPO stage.")
    eval_config: str | None = help_field(None, "Recipe of the evaluation stage (null: its defaults).")
    dpo_config: str = help_field("recipes/reviews/dpo.yaml", "Recipe of the DPO stage (when stages name it).")
    compare_config: str | None = help_field(
        "recipes/reviews/compare.yaml",
        "Recipe of the compare stage (when stages name it; null: its defaults).",
    )
    task: str | None = help_field(
        None,
        "A reasoning-gym task of data/tasks/tasks.yaml, e.g. chain_sum-t2d1: PPO's prompt_file, eval_prompt_file, "
        "reward_fn and accuracy_fn and evaluation's prompt_file, reward_fn and accuracy_fn are the files of "
        "data/tasks/<task>/ (its prompts and verifier); the stage files must not set them. null: none.",
    )
    sft: dict = help_field({}, "Overrides of SFT config keys, e.g. {num_train_epochs: 2}.")
    rm: dict = help_field({}, "Overrides of reward-model config keys.")
    ppo: dict = help_field({}, "Overrides of PPO config keys, e.g. {steps: 20}.")
    eval: dict = help_field({}, "Overrides of evaluation config keys.")
    dpo: dict = help_field({}, "Overrides of DPO config keys, e.g. {beta: 0.2}.")
    compare: dict = help_field({}, "Overrides of compare config keys, e.g. {dpo_betas: [0.1, 1.0]}.")
    report: bool = help_field(True, "Write DIR/report.html at the end.")
    shared_dir: str | None = help_field(
        None, "Internal to sweeps: the folder whose sft/ and rm/ this run links to."
    )
    shared_stages: list[str] = help_field(
        [], "Internal to sweeps: the stages of the shared run (which of sft/ and rm/ exist to link to)."
    )
    rm_members: int = help_field(
        1,
        "Reward models to train (an ensemble): member 0 in DIR/rm, member k in DIR/rm-<k> with the RM seed + k; "
        "PPO and eval read the list. 1 = one reward model.",
    )
    rm_bootstrap: bool = help_field(
        False,
        "Train each ensemble member on its own bootstrap resample of the training pairs (the RM key "
        "bootstrap_seed = the member's seed); false = every member on every pair, members differ by seed.",
    )
    seeds: list[int] | None = help_field(
        None, "Run the whole pipeline once per seed, in DIR/seed-<s> (every stage gets the seed)."
    )
    sweep: list[dict] | None = help_field(
        None,
        "PPO variants sharing one SFT and RM: a list of {name: ..., <ppo key>: value, ...}; each runs PPO and "
        "evaluation in DIR/<name>. E.g. no KL penalty vs fixed beta vs adaptive KL, or one advantage_estimator "
        "each. With the compare stage, compare runs once in DIR/compare with every variant on its plot.",
    )

    def __post_init__(self):
        unknown = [s for s in self.stages if s not in STAGES + OPTIONAL_STAGES]
        require(
            not unknown, "stages", f"unknown stage(s) {unknown}; choose from {list(STAGES + OPTIONAL_STAGES)}"
        )
        require(not (self.seeds and self.sweep), "sweep", "give either seeds or sweep, not both")
        require(self.rm_members >= 1, "rm_members", f"must be >= 1, got {self.rm_members}")
        for i, variant in enumerate(self.sweep or []):
            require(
                isinstance(variant, dict) and isinstance(variant.get("name"), str),
                "sweep",
                f"entry {i + 1} needs a 'name' (it names the run folder)",
            )


def rm_member_dirs(folder: Path, rm_members: int) -> list[Path]:
    """The RM folders of a run: DIR/rm, then DIR/rm-1 ... DIR/rm-<K-1> for an ensemble."""
    return [folder / "rm"] + [folder / f"rm-{k}" for k in range(1, rm_members)]


def chained_paths(
    out: Path, shared: Path | None = None, rm_members: int = 1, upstream: tuple[str, ...] = ("sft", "rm")
) -> dict[str, dict[str, Any]]:
    """The keys that connect the stages: each reads the previous stage's output folder (a sweep variant
    reads the SFT and RM of the shared folder). With rm_members > 1, PPO and eval read the list of the
    members' folders. upstream: which of sft and rm the run has; a stage it lacks chains nothing (the
    reading stages keep their recipes' keys)."""
    base = shared or out
    members = [str(p) for p in rm_member_dirs(base, rm_members)]
    reward_model_path = members[0] if rm_members == 1 else members
    from_sft = {"model_name_or_path": str(base / "sft")} if "sft" in upstream else {}
    from_rm = {"reward_model_path": reward_model_path} if "rm" in upstream else {}
    return {
        "sft": {"output_dir": str(out / "sft")},
        "rm": {**from_sft, "output_dir": str(out / "rm")},
        "ppo": {**from_sft, **from_rm, "output_dir": str(out / "ppo")},
        "eval": {
            "policy_path": str(out / "ppo"),
            **({"baseline_path": str(base / "sft")} if "sft" in upstream else {}),
            **from_rm,
            "output_dir": str(out / "eval"),
        },
        "dpo": {**from_sft, "output_dir": str(out / "dpo")},
        "compare": {
            **({"sft_path": str(base / "sft")} if "sft" in upstream else {}),
            "ppo_dir": str(out / "ppo"),
            "output_dir": str(out / "compare"),
        },
    }


def upstream_stages(cfg: Config) -> tuple[str, ...]:
    """Which of sft and rm feed this run's later stages: its own, or for a sweep variant the shared run's."""
    return tuple(s for s in ("sft", "rm") if s in cfg.stages or s in cfg.shared_stages)


def stage_config(cfg: Config, stage: str) -> Any:
    """recipe file < task keys < chaining keys < this config's overrides for `stage`; validated by the stage's
    Config."""
    stage_cls = MODULES[stage].Config
    valid = [f.name for f in dataclasses.fields(stage_cls)]
    recipe = getattr(cfg, f"{stage}_config")
    values: dict[str, Any] = load_yaml_config(recipe, valid) if recipe else {}
    if cfg.task is not None:  # the task's files and verifier, named once in the pipeline
        from_task = task_keys(cfg.task, stage)
        twice = sorted(set(from_task) & set(values))
        if twice:
            raise ConfigError(
                f"{recipe}: {', '.join(twice)} come from the pipeline's task '{cfg.task}'; drop them from the "
                f"stage file (or override them in the pipeline's '{stage}:' block)"
            )
        if from_task:  # the stage fills them from its `task` key (`evaluation.sampling_keys.fill_from_task`)
            values["task"] = cfg.task
    shared = Path(cfg.shared_dir) if cfg.shared_dir else None
    upstream = upstream_stages(cfg)
    values.update(chained_paths(Path(cfg.output_dir), shared, cfg.rm_members, upstream)[stage])
    if stage == "eval":  # the policy is judged by the score PPO maximised, on responses cut as PPO cut them
        ppo_cfg = stage_config(cfg, "ppo")
        values.update(scored_as(ppo_cfg), accuracy_fn=ppo_cfg.accuracy_fn)  # and by PPO's verifier
        if ppo_cfg.environment is not None:  # episodes played as PPO played them, on prompts rendered alike
            values.update(episode_keys(ppo_cfg), system_prompt=ppo_cfg.system_prompt)
        if "sft" not in upstream:  # no SFT stage: the policy is compared with the model PPO started from
            values["baseline_path"] = ppo_cfg.model_name_or_path
    if stage == "dpo":  # the preference pairs the RM stage trains on (its recipe and overrides)
        values.update(rm_pairs(cfg))
    overrides = getattr(cfg, stage)
    for key in overrides:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"pipeline key '{stage}': unknown {stage} key '{key}'{hint}")
    values.update(overrides)
    # compare's DPO runs train on the RM's pairs too, unless its own `dpo` block says otherwise
    if stage == "compare":
        values["dpo"] = {**rm_pairs(cfg), **(values.get("dpo") or {})}
    hints = typing.get_type_hints(stage_cls)  # the same type checks as the command line
    values = {k: _coerce(k, v, hints[k], f"pipeline stage '{stage}'") for k, v in values.items()}
    return stage_cls(**values)


# DPO (the dpo stage and compare's DPO runs) trains on the pairs of the run's resolved RM config; `dpo:` overrides win
DPO_FROM_RM = ("train_file", "eval_file", "train_split", "eval_split", "data_format")


def rm_pairs(cfg: Config) -> dict[str, Any]:
    """The data keys (`DPO_FROM_RM`) of the run's resolved RM stage: the pairs DPO trains on."""
    rm_cfg = stage_config(cfg, "rm")
    return {key: getattr(rm_cfg, key) for key in DPO_FROM_RM}


def rm_member_configs(cfg: Config, rm_cfg) -> list[tuple[str, Any]]:
    """(name, config) of each RM the run trains: ("rm", the RM stage's config) alone, or for an ensemble
    also ("rm-<k>", the same config with output_dir DIR/rm-<k> and seed + k), k = 1 .. rm_members - 1.
    With rm_bootstrap every member (the first too) trains on its own resample: bootstrap_seed = its seed."""
    out = Path(cfg.output_dir)
    jobs = []
    for k, folder in enumerate(rm_member_dirs(out, cfg.rm_members)):
        seed = rm_cfg.seed + k
        member = dataclasses.replace(rm_cfg, output_dir=str(folder), seed=seed)
        if cfg.rm_bootstrap:
            member = dataclasses.replace(member, bootstrap_seed=seed)
        jobs.append((folder.name, member))
    return jobs


def run(cfg: Config) -> dict[str, Any]:
    """One pipeline run, or one per seed, or a sweep of PPO variants; then the report over all of them."""
    out = Path(cfg.output_dir)
    if cfg.seeds:
        runs = [seed_run(cfg, seed) for seed in cfg.seeds]
    elif cfg.sweep:
        runs = sweep_runs(cfg)
    else:
        runs = [cfg]
    for run_cfg in runs:  # every stage config of every run is checked before any work starts
        for stage in run_cfg.stages:
            stage_config(run_cfg, stage)
    records = {}
    for run_cfg in runs:
        records[run_cfg.output_dir] = run_one(run_cfg)
    if cfg.report and PartialState().is_main_process:
        print(f"report: {write_report(out)}")
    return records if cfg.seeds or cfg.sweep else records[cfg.output_dir]


def seed_run(cfg: Config, seed: int) -> Config:
    """The same pipeline in DIR/seed-<seed>, every stage seeded with `seed`."""
    seeded = [
        s
        for s in STAGES + OPTIONAL_STAGES
        if "seed" in {f.name for f in dataclasses.fields(MODULES[s].Config)}
    ]
    overrides = {stage: {**getattr(cfg, stage), "seed": seed} for stage in seeded}  # compare: PPO's seed
    return dataclasses.replace(
        cfg, output_dir=str(Path(cfg.output_dir) / f"seed-{seed}"), seeds=None, report=False, **overrides
    )


def sweep_runs(cfg: Config) -> list[Config]:
    """SFT and RM (and DPO) once in DIR; each PPO variant (and its evaluation) in DIR/<name>, whose sft/ and
    rm/ are links to the shared ones (so every variant folder is a complete run for the report). With the
    compare stage, compare runs once, last, in DIR/compare, over every variant: the first variant's PPO run
    is its ppo_dir, the others' are more_ppo_dirs (before any the `compare:` overrides name)."""
    out = Path(cfg.output_dir)
    shared = dataclasses.replace(
        cfg, stages=[s for s in cfg.stages if s in ("sft", "rm", "dpo")], sweep=None, report=False
    )
    runs = [shared] if shared.stages else []  # e.g. `stages: [ppo, eval]`: nothing shared to run first
    for variant in cfg.sweep:
        ppo_overrides = {**cfg.ppo, **{k: v for k, v in variant.items() if k != "name"}}
        folder = out / variant["name"]
        runs.append(
            dataclasses.replace(
                cfg,
                output_dir=str(folder),
                stages=[s for s in cfg.stages if s in ("ppo", "eval")],
                sweep=None,
                report=False,
                ppo=ppo_overrides,
                shared_dir=str(out),
                shared_stages=shared.stages,
            )
        )
    if "compare" in cfg.stages:
        ppo_dirs = [str(out / variant["name"] / "ppo") for variant in cfg.sweep]
        more = [*ppo_dirs[1:], *cfg.compare.get("more_ppo_dirs", [])]
        compare_keys = {**cfg.compare, "ppo_dir": ppo_dirs[0], "more_ppo_dirs": more}
        runs.append(dataclasses.replace(shared, stages=[*shared.stages, "compare"], compare=compare_keys))
    return runs


def run_one(cfg: Config) -> dict[str, Any]:
    """The stages of one run, in order. Under `accelerate launch` every process runs every stage (each
    stage is data-parallel on its own); only the main process writes the pipeline's own files."""
    state = PartialState()
    out = Path(cfg.output_dir)
    jobs = []  # (name, stage, config): the stages in order, the RM stage once per ensemble member
    for stage in cfg.stages:
        stage_cfg = stage_config(cfg, stage)
        members = rm_member_configs(cfg, stage_cfg) if stage == "rm" else [(stage, stage_cfg)]
        jobs += [(name, stage, member_cfg) for name, member_cfg in members]
    if state.is_main_process:
        print(format_config(cfg))
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out, "pipeline_config.yaml")
    state.wait_for_everyone()
    record_path = out / "pipeline.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    if (
        cfg.shared_stages and state.is_main_process
    ):  # a sweep variant: link the shared SFT and RM stages into this run folder
        shared_record = json.loads((Path(cfg.shared_dir) / "pipeline.json").read_text())
        rm_dirs = [p.name for p in rm_member_dirs(out, cfg.rm_members)] if "rm" in cfg.shared_stages else []
        for stage in ["sft"] * ("sft" in cfg.shared_stages) + rm_dirs:
            link = out / stage
            if not link.exists():
                link.symlink_to(Path("..") / stage, target_is_directory=True)
            if stage in shared_record:
                record[stage] = shared_record[stage]
    for name, stage, stage_cfg in jobs:
        stage_dir = Path(stage_cfg.output_dir)
        if (stage_dir / "metrics.json").exists():
            state.print(f"== {name}: finished earlier ({stage_dir}); skipped")
            continue
        if stage_dir.exists() and hasattr(stage_cfg, "resume") and has_checkpoint(stage, stage_dir):
            stage_cfg = dataclasses.replace(stage_cfg, resume=True)
            state.print(f"== {name}: interrupted earlier; resuming in {stage_dir}")
        elif stage_dir.exists():
            state.print(
                f"== {name}: interrupted earlier, no checkpoint to resume from; starting over in {stage_dir}"
            )
        else:
            state.print(f"== {name}: running in {stage_dir}")
        start = time.perf_counter()
        MODULES[stage].run(stage_cfg)
        state.wait_for_everyone()
        metrics = json.loads((stage_dir / "metrics.json").read_text())
        record[name] = {"wall_time_s": round(time.perf_counter() - start, 1), "metrics": metrics}
        if state.is_main_process:
            atomic_write_json(record_path, record)
    state.print(summary(record))
    return record


def has_checkpoint(stage: str, stage_dir: Path) -> bool:
    """Whether an interrupted stage left a checkpoint to resume from (PPO's step-N, a Trainer's checkpoint-N)."""
    return last_checkpoint(stage_dir, "step" if stage == "ppo" else "checkpoint") is not None


HEADLINES = {
    "sft": ("eval_loss", "eval_perplexity", "eos_rate"),
    "rm": ("eval_accuracy", "eval_margin", "baseline_accuracy"),
    "ppo": ("scores_first", "scores_last", "kl_last", "kl_target", "objective/kl_coef"),
    "eval": ("gold_win_rate", "rm_win_rate", "kl_to_ref", "gold_score_mean", "rm_score_mean"),
    "dpo": ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"),
    "compare": ("ppo_best_gold", "dpo_best_gold", "best_of_n_best_gold"),
}


def summary(record: dict[str, Any]) -> str:
    lines = ["", "stage  wall time  metrics"]
    for stage, entry in record.items():
        shown = ", ".join(
            f"{k}={entry['metrics'][k]:.4g}"
            for k in HEADLINES.get(stage.split("-")[0], ())  # rm-<k>: an ensemble member
            if isinstance(entry["metrics"].get(k), (int, float))
        )
        lines.append(f"{stage:<6} {entry['wall_time_s']:>7.1f} s  {shown}")
    return "\n".join(lines)
