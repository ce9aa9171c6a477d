"""Running the toolkit in processes of their own, the one way tests do it: `launch` (`accelerate launch` with
N processes on the CPU), `pairs_stage_on_two_processes` (rm, dpo), `process_env`, `ppo_command` (`llm-rlhf ppo` in
a process of its own, or killed with SIGKILL at a step), `interrupt_ppo_at` and `killed_and_resumed` (Ctrl-C in a
step, then --resume)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, SCRIPTS, flags, logged


def process_env() -> dict:
    """The environment of a command a test starts: one thread per process, and this checkout's llm_rlhf
    first on the path (not another installed copy)."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": pythonpath}


def launch(
    args: list[str],
    num_processes: int = 2,
    *,
    config: str = "multi_gpu.yaml",
    mixed_precision: str | None = None,
    check: bool = True,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """`accelerate launch` as a user runs it, from the repo root: a config file of accelerate_configs/ (DDP by
    default; on this CPU over gloo) with `num_processes`, or a single CPU process. `args`: a script and its
    arguments, or `-m llm_rlhf <command> ...`. `mixed_precision` overrides the config file's, as
    `accelerate launch --mixed_precision` does. check: the launch must succeed (else the returned process is
    the caller's to judge). timeout: seconds before the launch is killed (subprocess.TimeoutExpired)."""
    if num_processes > 1:
        head = [
            "--config_file",
            str(ROOT / "accelerate_configs" / config),
            "--num_processes",
            str(num_processes),
        ]
    else:
        head = ["--cpu", "--num_processes", "1"]
    if mixed_precision is not None:
        head += ["--mixed_precision", mixed_precision]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *head, *args]
    result = subprocess.run(cmd, cwd=ROOT, env=process_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def pairs_stage_on_two_processes(stage: str, model_dir: Path, pref_files, out: Path, *extra: str) -> None:
    """`llm-rlhf STAGE` (a stage trained on `preference_rows` pairs: rm, dpo) from `model_dir` under `launch`
    with 2 processes (DDP), `pref_files` = (train, eval), then the flags `extra`: 6 steps of 4 pairs per
    process, evaluated and logged every 3 steps, into `out`. Asserts that it trained ONE model with DDP
    (not two copies): 6 steps cover 48 of the 40 training pairs, epoch 1.2."""
    train, val = pref_files
    values = dict(
        model_name_or_path=model_dir,
        train_file=train,
        eval_file=val,
        output_dir=out,
        max_steps=6,
        max_length=32,
        per_device_train_batch_size=4,
        eval_steps=3,
        logging_steps=3,
    )
    launch(["-m", "llm_rlhf", stage, *flags(values), *extra], 2)
    assert json.loads((out / "metrics.json").read_text())["global_step"] == 6
    epochs = [json.loads(line)["epoch"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert math.isclose(max(epochs), 1.2, rel_tol=1e-6), epochs


def interrupt_ppo_at(monkeypatch, step: int):
    """Make `PPOTrainer.ppo_step` raise KeyboardInterrupt (a user's Ctrl-C) when the trainer's step counter is
    `step`, i.e. as PPO step `step` + 1 starts: the steps before it are logged and checkpointed as usual.
    Returns the function that puts the real `ppo_step` back."""
    from llm_rlhf.ppo import trainer as ppo_trainer

    original = ppo_trainer.PPOTrainer.ppo_step

    def dies_at(self):
        if self.step == step:
            raise KeyboardInterrupt("killed")
        return original(self)

    monkeypatch.setattr(ppo_trainer.PPOTrainer, "ppo_step", dies_at)
    return lambda: monkeypatch.setattr(ppo_trainer.PPOTrainer, "ppo_step", original)


def killed_and_resumed(make_config, out: Path, monkeypatch) -> tuple[list[dict], list[dict]]:
    """A PPO run of `make_config(folder, **kw)` uninterrupted into out/a, and into out/b killed as step 4
    starts (KeyboardInterrupt inside `ppo_step`: nothing final written) and resumed from its last checkpoint.
    Returns both runs' metrics.jsonl lines, for the caller to compare (an exact resume gives the same figures)."""
    from llm_rlhf.stages import ppo

    ppo.run(make_config(out / "a"))
    restore = interrupt_ppo_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        ppo.run(make_config(out / "b"))
    restore()
    assert not (out / "b" / "metrics.json").exists()  # nothing final was written
    ppo.run(make_config(out / "b", resume=True))
    return tuple(logged(out / d) for d in "ab")


def ppo_command(args: list[str], *more: str, kill_at: int | None = None) -> subprocess.CompletedProcess:
    """`python -m llm_rlhf ppo ...` (`args` from `ppo_cli_args`, then `more`) in a process of its own from the
    repo root, as a user runs it; with `kill_at` N the same command through tests/scripts/kill_at_step.py,
    which kills its own process with SIGKILL as step N starts (kill -9: nothing is written on the way out)."""
    if kill_at is not None:  # ["-m", "llm_rlhf", "ppo", ...] -> [kill_at_step.py, N, "ppo", ...]
        args = [str(SCRIPTS / "kill_at_step.py"), str(kill_at), *args[2:]]
    return subprocess.run(
        [sys.executable, *args, *more],
        cwd=ROOT,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
