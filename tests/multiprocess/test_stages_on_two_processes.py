"""The stages and the pipeline under `accelerate launch` with 2 processes on this CPU (DDP over gloo): SFT, the
reward model and DPO each train one model (not two copies), the pipeline chains its stages with one set of
outputs, and a user's script of the Python API runs once per process with one run's folder."""

from __future__ import annotations

import json

import pytest
from helpers import SCRIPTS, pipeline_argv, ppo_steps, read_jsonl
from processes import launch, pairs_stage_on_two_processes

from llm_rlhf.core.utils import read_json
from llm_rlhf.models.reward_model import load_reward_model


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sft_under_accelerate_launch_with_two_processes(tmp_path, tiny_model_dir, sft_files):
    """`accelerate launch` with the repo's DDP config: 2 CPU processes (gloo), one set of outputs."""
    out = tmp_path / "run"
    argv = [
        "--model_name_or_path",
        str(tiny_model_dir),
        "--train_file",
        str(sft_files[0]),
        "--eval_file",
        str(sft_files[1]),
        "--output_dir",
        str(out),
        "--max_length",
        "32",
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "4",
        "--save_steps",
        "2",
        "--eval_steps",
        "2",
        "--num_samples",
        "2",
        "--max_new_tokens",
        "4",
    ]
    launch(["-m", "llm_rlhf", "sft", *argv], 2)
    metrics = read_json(out / "metrics.json")
    assert metrics["global_step"] == 4
    epochs = [
        r["epoch"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "train_loss" in r
    ]
    assert epochs == [pytest.approx(4 * 4 * 2 / 40)], "4 steps x 4 sequences x 2 processes over 40 examples"
    assert (out / "model.safetensors").exists() and (out / "checkpoints" / "checkpoint-4").is_dir()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rm_two_process_ddp_run_on_cpu(tmp_path, tiny_model_dir, pref_files):
    """`accelerate launch` with 2 processes trains one model with DDP (not two copies): 6 steps of 4 pairs
    per process cover 48 of the 40 training pairs, epoch 1.2 (asserted by the helper); the folder loads as a
    reward model."""
    out = tmp_path / "rm"
    pairs_stage_on_two_processes("rm", tiny_model_dir, pref_files, out, "--test_file", str(pref_files[1]))
    load_reward_model(out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dpo_two_process_ddp_run_on_cpu(tmp_path, tiny_model_dir, pref_files):
    """`accelerate launch` with 2 processes trains one model with DDP (not two copies): 6 steps of 4 pairs
    per process cover 48 of the 40 training pairs, epoch 1.2 (asserted by the helper)."""
    pairs_stage_on_two_processes("dpo", tiny_model_dir, pref_files, tmp_path / "dpo")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pipeline_under_accelerate_launch_with_two_processes(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file
):
    """docs/guides/distributed.md's multi-GPU command on this CPU: every stage data-parallel over 2 processes,
    one set of outputs, the pipeline's own prints and files from the main process only."""
    out = tmp_path / "ddp"
    argv = pipeline_argv(out, tiny_model_dir, sft_files, pref_files, prompt_file, report="false")
    proc = launch(["-m", "llm_rlhf", "pipeline", *argv], 2)
    assert proc.stdout.count("== sft: running") == 1 and proc.stdout.count("== eval: running") == 1
    record = read_json(out / "pipeline.json")
    assert record.keys() == {"sft", "rm", "ppo", "eval"}
    assert proc.stdout.count("batch sizes:") == 1 and "'num_processes': 2" in proc.stdout
    ppo_metrics = read_json(out / "ppo" / "metrics.json")
    assert ppo_steps(out) == [1, 2, 3, 4]
    assert ppo_metrics["episodes"] == 4 * 4 * 2, "4 steps x rollout 4 per process x 2 processes"
    assert 0.0 <= record["eval"]["metrics"]["gold_win_rate"] <= 1.0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_script_using_the_api_runs_on_two_processes(tiny_model_dir, prompt_file, tmp_path):
    """tests/scripts/api_ppo.py under `accelerate launch` with 2 processes (DDP over gloo): one PPO run whose
    rollouts are 2 x 4 episodes, on_step on the main process only, the same folder as the command writes."""
    out = tmp_path / "ppo"
    launch([str(SCRIPTS / "api_ppo.py"), str(tiny_model_dir), str(prompt_file), str(out)])
    steps = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    assert [m["episodes"] for m in steps] == [8, 16]  # one run of 2 x 4 episodes a step, not two runs of 4
    assert json.loads((out / "on_step.rank0.json").read_text()) == steps  # the main process's calls
    assert json.loads((out / "on_step.rank1.json").read_text()) == []  # none on the other process
    assert (out / "model.safetensors").is_file() and (out / "value_head.safetensors").is_file()
