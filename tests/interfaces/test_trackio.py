"""report_to trackio (the local-first tracker TRL recommends): an SFT run (TRL's trainer, transformers'
TrackioCallback) and a PPO run (our writer) each write their metrics into trackio's local database under
$TRACKIO_DIR, in project llm_rlhf, each run named by its output_dir. Each run is its own process, as a user
runs it (trackio reads TRACKIO_DIR when it is imported)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest
from helpers import ROOT, flags, ppo_cli_args
from processes import process_env

pytestmark = pytest.mark.slow


def logged(db, run: str) -> list[dict]:
    """The metrics trackio stored for `run`, in step order: each row's step and its metrics."""
    rows = sqlite3.connect(db).execute(
        "select step, metrics from metrics where run_name = ? order by step", (run,)
    )
    return [{"step": step, **json.loads(metrics)} for step, metrics in rows]


def test_sft_and_ppo_write_their_metrics_to_trackio(tiny_model_dir, sft_files, prompt_file, tmp_path):
    env = {**process_env(), "TRACKIO_DIR": str(tmp_path / "trackio")}
    sft_out, ppo_out = tmp_path / "sft", tmp_path / "ppo"
    train, val = sft_files
    sft_args = dict(
        model_name_or_path=tiny_model_dir,
        train_file=train,
        eval_file=val,
        output_dir=sft_out,
        max_steps=4,
        per_device_train_batch_size=4,
        max_length=32,
        logging_steps=1,
        eval_steps=0,
        save_steps=1000,
        report_to="trackio",
    )
    ppo_args = ppo_cli_args(tiny_model_dir, "none", prompt_file, ppo_out, 2, save_steps=0)
    ppo_args += ["--reward_fn", "tests/reward_fns.py:keyword", "--report_to", "trackio"]
    for args in (["-m", "llm_rlhf", "sft", *flags(sft_args)], ppo_args):
        result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
    db = tmp_path / "trackio" / "llm_rlhf.db"
    assert db.is_file(), os.listdir(tmp_path / "trackio")
    ppo = logged(db, str(ppo_out))
    assert [m["step"] for m in ppo] == [1, 2]
    ours = [json.loads(line) for line in (ppo_out / "metrics.jsonl").read_text().splitlines()]
    assert all(
        m["objective/kl"] == o["objective/kl"] and m["loss/policy"] == o["loss/policy"]
        for m, o in zip(ppo, ours)
    )
    sft = logged(db, str(sft_out))
    losses = [m["train/loss"] for m in sft if "train/loss" in m]
    assert len(losses) == 4, sft
    trained = [json.loads(line) for line in (sft_out / "log.jsonl").read_text().splitlines()]
    assert losses == pytest.approx([r["loss"] for r in trained if "loss" in r])


def test_a_missing_trackio_is_one_line(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """report_to trackio without the package: a ConfigError naming the extra, before any model is loaded."""
    import importlib.util

    from llm_rlhf.core.config import check_report_to_installed
    from llm_rlhf.core.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"'report_to': 'trackio' is not installed \(pip install 'llm-rlhf\[trackio\]'\)"
    ):
        check_report_to_installed("trackio")
