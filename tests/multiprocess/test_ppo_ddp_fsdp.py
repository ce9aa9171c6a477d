"""Data-parallel runs on this CPU: `accelerate launch` with 2 processes (DDP, gloo backend)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import ROOT, logged, ppo_cli_args
from processes import launch

SCRIPTS = ROOT / "tests" / "scripts"

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def run_script(
    tiny_model_dir, tiny_rm_dir, prompt_file, out: Path, mode: str, num_processes: int, *, fsdp2: bool = False
) -> dict:
    """tests/scripts/ppo_ranks.py under DDP (multi_gpu.yaml) or, fsdp2, under fsdp.yaml through the patch of
    tests/scripts/fsdp2_on_cpu.py, in fp32 (mixed_precision "no") so that it compares tightly."""
    args = [
        str(SCRIPTS / "ppo_ranks.py"),
        str(tiny_model_dir),
        str(tiny_rm_dir),
        str(prompt_file),
        str(out),
        mode,
    ]
    if fsdp2:
        launch(
            [str(SCRIPTS / "fsdp2_on_cpu.py"), *args], num_processes, config="fsdp.yaml", mixed_precision="no"
        )
    else:
        launch(args, num_processes)
    return json.loads(out.read_text())


def assert_same_first_update(run: dict, one: dict) -> None:
    """`run`'s raw gradient of the first update and its step's metrics are those of the 1-process `one`."""
    import torch

    torch.testing.assert_close(torch.tensor(run["grads"]), torch.tensor(one["grads"]), atol=1e-7, rtol=1e-4)
    m1, m2 = one["metrics"][0], run["metrics"][0]
    for key in (
        "loss/policy",
        "loss/value",
        "policy/entropy",
        "objective/kl",
        "objective/scores",
        "objective/non_score_reward",
        "response_length",
        "val/explained_variance",
    ):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key


def test_first_update_two_ranks_equals_one(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """The RAW gradient (before clipping; an Adam step or clipping would hide a wrong loss scale)
    and the step's metrics of one global batch: on one process, on two, and on two with each minibatch
    as accumulated micro-batches, which all-reduce the gradients once per minibatch (`no_sync`)."""
    import torch

    one = run_script(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "one.json", "same", 1)
    two = run_script(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "two.json", "same", 2)
    acc = run_script(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "acc.json", "accumulate", 2)
    assert (one["world"], two["world"], acc["world"]) == (1, 2, 2)
    assert two["all_reduces"] > 0 and acc["all_reduces"] == two["all_reduces"]
    assert torch.tensor(one["grads"]).abs().max() > 0
    for run in (two, acc):
        assert_same_first_update(run, one)


def test_fsdp2_first_update_equals_one_process(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """fsdp.yaml (FSDP2, fp32) on 2 CPU processes: the RAW gradient of the first update on the fixed global
    batch, gathered whole from its shards, and the step's metrics are those of one process, with ordinary
    minibatches and with accumulated micro-batches (FSDP2's reduce-scatter only at a minibatch's last one).
    Adam and clipping hide a constant factor, so only the raw gradient shows a wrong scale under FSDP2
    (a 2x loss scale under FSDP2 alone would pass the other FSDP2 tests)."""
    import torch

    one = run_script(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "one.json", "same", 1)
    fsdp = run_script(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "fsdp.json", "same", 2, fsdp2=True)
    acc = run_script(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "acc.json", "accumulate", 2, fsdp2=True
    )
    assert (one["world"], fsdp["world"], acc["world"]) == (1, 2, 2)
    assert fsdp["distributed_type"] == acc["distributed_type"] == "FSDP"
    full = len(one["grads"])
    assert one["local_numel"] == full and fsdp["local_numel"] < full and acc["local_numel"] < full  # sharded
    assert torch.tensor(one["grads"]).abs().max() > 0
    for run in (fsdp, acc):
        assert_same_first_update(run, one)


def test_critic_free_estimators_two_ranks_equal_one(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """grpo, dr_grpo, rloo, pass_at_k (pass@2; 4 samples per prompt), reinforce_pp (2) and remax (1, with a
    greedy response per prompt): the same global batch of 8 episodes on one process and on two, two steps each (the second
    after the policy moved away from the reference: the KL in the loss for grpo and dr_grpo, in the reward
    for the others). The raw gradient of every update and the steps' metrics are the same: a group's
    statistics are over its own k samples whatever the number of processes (whole groups on each rank;
    REINFORCE++'s whitening over the global batch)."""
    import torch

    one = run_script(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "one.json", "estimators", 1)
    two = run_script(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "two.json", "estimators", 2)
    assert (one["world"], two["world"]) == (1, 2)
    assert (
        set(one["runs"])
        == set(two["runs"])
        == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "remax", "pass_at_k"}
    )
    for name, a in one["runs"].items():
        b = two["runs"][name]
        assert len(a["grads"]) == len(b["grads"]) == 2 and b["all_reduces"] > 0, name
        assert torch.tensor(a["grads"][1]).abs().max() > 0, name
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            # step 2 starts from weights one Adam step (lr 1e-2) apart by float rounding: |diff| < 1e-6 there
            atol = 1e-7 if step == 0 else 1e-6
            torch.testing.assert_close(
                torch.tensor(gb), torch.tensor(ga), atol=atol, rtol=1e-4, msg=f"{name} step {step + 1}"
            )
        for m1, m2 in zip(a["metrics"], b["metrics"]):
            assert not any(k.startswith("val/") or k == "loss/value" for k in m1), name
            keys = [
                "loss/policy",
                "policy/entropy",
                "objective/kl",
                "objective/scores",
                "objective/rlhf_reward",
            ]
            keys += ["response_length", "policy/approxkl", "objective/kl_coef"]
            keys += [
                k for k in ("loss/kl", "objective/greedy_scores", "objective/group_scores_std") if k in m1
            ]
            for key in keys:
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), (name, m1["step"], key)
        assert a["metrics"][1]["objective/kl"] != 0.0, name
    assert (
        "loss/kl" in one["runs"]["grpo"]["metrics"][1] and "loss/kl" not in one["runs"]["rloo"]["metrics"][1]
    )
    assert "objective/greedy_scores" in one["runs"]["remax"]["metrics"][0]


def test_rank_with_empty_or_truncated_responses_does_not_hang(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    result = run_script(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "deg.json", "degenerate", 2)
    assert len(result["metrics"]) == 2
    assert 0 < result["metrics"][0]["eos_rate"] < 1  # one rank all EOS at once, the other never


def linear_lr(steps: int, optimizer_steps_per_step: int = 2, learning_rate: float = 1e-3) -> list[float]:
    """The lr logged after PPO step k = 1..steps under lr_scheduler_type: linear (ppo_cli_args: 2 minibatches
    of one epoch per step): learning_rate * (1 - i / total) after optimiser step i."""
    total = steps * optimizer_steps_per_step
    return [learning_rate * (1 - k * optimizer_steps_per_step / total) for k in range(1, steps + 1)]


def assert_same_logs(a: list[dict], b: list[dict]) -> None:
    """Run b (interrupted and resumed) logged, step by step, what the uninterrupted run a logged (timings
    aside)."""
    for ma, mb in zip(a, b):
        for k, v in ma.items():
            if not k.startswith(("time/", "tokens_per_s")):
                assert mb[k] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), (ma["step"], k)


def fsdp2_ppo(
    tiny_model_dir, tiny_rm_dir, prompt_file, out: Path, steps: int, extra: list[str], **launch_kw
) -> list[dict]:
    """`llm-rlhf ppo` (ppo_cli_args, then `extra`) under fsdp.yaml on 2 CPU processes through the patch of
    tests/scripts/fsdp2_on_cpu.py (accelerate enables FSDP only with an accelerator device); the metrics it
    logged. `launch_kw`: e.g. mixed_precision, passed to `launch`."""
    args = ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, out, steps)[2:] + extra
    launch([str(SCRIPTS / "fsdp2_on_cpu.py"), *args], 2, config="fsdp.yaml", **launch_kw)
    return logged(out)


def assert_same_final_weights(a: Path, b: Path, initial: Path) -> dict:
    """The final policies in folders a and b (model.safetensors) have the initial model's tensors, a some
    changed by training, b the same as a. Returns the initial state dict."""
    import torch
    from safetensors.torch import load_file

    final_a, final_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    start = load_file(initial / "model.safetensors")
    assert final_a.keys() == start.keys() == final_b.keys()
    assert any(not torch.equal(final_a[k], start[k]) for k in start)
    for k in start:
        torch.testing.assert_close(final_b[k], final_a[k], atol=1e-6, rtol=1e-5, msg=k)
    return start


def test_linear_lr_two_ranks_equals_one(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """lr_scheduler_type: linear advances once per optimiser step on every process, whatever their number:
    the lr after each step on 2 processes is that of 1 process and the closed form. accelerate's scheduler
    wrapper stepped it once per process, so on 2 it reached 0 halfway through the run."""

    def logged_lr(out, num_processes):
        args = ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, out, 3)
        launch(args + ["--lr_scheduler_type", "linear", "--save_steps", "0"], num_processes)
        return [m["lr"] for m in logged(out)]

    one, two = logged_lr(tmp_path / "one", 1), logged_lr(tmp_path / "two", 2)
    assert one == pytest.approx(linear_lr(3), rel=1e-12, abs=1e-15)
    assert two == one


def test_resume_with_two_ranks(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """2 ranks: run 3 steps straight; elsewhere run 2 steps, then resume to 3 from the step-1 checkpoint."""
    launch(ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "a", 3), 2)
    launch(ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "b", 2), 2)
    assert (tmp_path / "b" / "checkpoints" / "step-1").is_dir()
    launch(
        ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "b", 3) + ["--resume", "true"], 2
    )
    a, b = logged(tmp_path / "a"), logged(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3]
    assert_same_logs(a, b)


def test_two_ranks_exit_cleanly_with_tensorboard_written(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """2 ranks with report_to tensorboard: every rank exits 0 without aborting in gloo's teardown at exit
    (`cli.exit_process` skips the interpreter's finalization), and the TensorBoard events of every step are
    on disk with the values of metrics.jsonl although no exit handler runs (the run closes its writer)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    args = ppo_cli_args(
        tiny_model_dir, tiny_rm_dir, prompt_file, out, 2, save_steps=0, report_to="tensorboard"
    )
    result = launch(args, 2)
    assert "terminate called" not in result.stderr + result.stdout
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    metrics = logged(out)
    for key in ("objective/scores", "objective/kl", "loss/policy"):
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == [1, 2], key
        assert [e.value for e in scalars] == pytest.approx([m[key] for m in metrics], rel=1e-5, abs=1e-7), key


def test_compiled_sampling_with_two_ranks(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """sampling_compile under DDP (2 CPU processes over gloo): every rank compiles its own decode step and
    samples the policy's distribution (objective/kl_sampler ~0, KL 0 at the first step), and the run ends."""
    out = tmp_path / "compiled"
    args = ppo_cli_args(
        tiny_model_dir, tiny_rm_dir, prompt_file, out, 2, save_steps=0, sampling_compile="true"
    )
    launch(args, 2)
    metrics = logged(out)
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0]["objective/kl"] == 0.0
    assert all(abs(m["objective/kl_sampler"]) < 1e-5 for m in metrics)
    assert (out / "model.safetensors").is_file() or (out / "adapter_model.safetensors").is_file()


def test_separate_critic_with_two_ranks(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """value_model: reward under DDP: two minibatches per epoch (DDP's reducer fails on the second one when
    a parameter, e.g. an unused policy value head, took no part in the loss), a checkpoint, and the
    trained critic in the final folder instead of a value head."""
    from safetensors.torch import load_file

    out = tmp_path / "critic"
    launch(
        ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, out, 2)
        + ["--value_model", "reward", "--ppo_epochs", "2"],
        2,
    )
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (out / "value_head.safetensors").exists()
    assert (out / "checkpoints" / "step-1" / "critic_trainable.safetensors").is_file()
    trained, initial = (
        load_file(out / "critic" / "model.safetensors"),
        load_file(tiny_rm_dir / "model.safetensors"),
    )
    assert trained.keys() == initial.keys()
    changed = [k for k in trained if not torch_equal(trained[k], initial[k])]
    assert "score.weight" in changed and len(changed) > len(trained) // 2


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a, b)


def test_every_rank_samples_for_logs_and_evaluation(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """Logged samples and held-out evaluation sample on every process (the main one writes), so every
    process enters the same generate calls: a collective with ZeRO-3 / FSDP sharded parameters."""
    out = tmp_path / "run"
    args = ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, out, 2)
    args = [str(ROOT / "tests" / "scripts" / "count_sampling.py"), str(tmp_path / "calls"), *args[2:]]
    args += ["--eval_every", "1", "--eval_prompt_file", str(prompt_file), "--eval_num_prompts", "4"]
    args += ["--log_samples_every", "1", "--gold_judge", "none"]
    launch(args, 2)
    calls = [json.loads((tmp_path / "calls" / f"sample_calls_{r}.json").read_text()) for r in (0, 1)]
    assert calls[0] == calls[1] >= 2 + 2 + 3, calls  # 2 rollouts, 2 logged samples, 3 evaluations
    assert len((out / "eval_log.jsonl").read_text().splitlines()) == 3
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2 * 3


def test_fsdp2_ppo_with_two_ranks(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """accelerate_configs/fsdp.yaml (FSDP2) on 2 CPU processes over gloo (`fsdp2_ppo`): sampling, logged
    samples, held-out evaluation, sharded checkpoints, a resume, and the final policy as one full HF folder.
    The resumed run logs what the uninterrupted one logged and saves the same weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    extra = ["--eval_every", "2", "--eval_prompt_file", str(prompt_file), "--eval_num_prompts", "4"]
    extra += ["--log_samples_every", "2", "--gold_judge", "none"]
    a = fsdp2_ppo(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "a", 3, extra)
    fsdp2_ppo(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "b", 2, extra)
    ckpt = tmp_path / "b" / "checkpoints" / "step-1"
    assert (ckpt / "sharded" / ".metadata").is_file() and len(list((ckpt / "sharded").glob("*.distcp"))) == 2
    b = fsdp2_ppo(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "b", 3, extra + ["--resume", "true"])
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    assert a[0]["objective/kl"] == 0.0
    assert_same_logs(a, b)
    assert len((tmp_path / "a" / "eval_log.jsonl").read_text().splitlines()) == 2  # steps 0 and 2
    assert (tmp_path / "a" / "samples.jsonl").is_file()
    initial = assert_same_final_weights(tmp_path / "a", tmp_path / "b", tiny_model_dir)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "a").config.vocab_size == len(
        initial["transformer.wte.weight"]
    )
    assert set(load_file(tmp_path / "a" / "value_head.safetensors")) == {"summary.weight", "summary.bias"}


def test_fsdp2_grpo_with_two_ranks(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """grpo (2 prompts x 2 samples per process) under fsdp.yaml on 2 CPU processes (`fsdp2_ppo`): sharded
    checkpoints without a value head, a resume that logs what the uninterrupted run logged and saves the
    same weights, a final folder without value_head.safetensors."""
    extra = ["--advantage_estimator", "grpo", "--samples_per_prompt", "2", "--rollout_batch_size", "2"]
    extra += ["--eval_every", "2", "--eval_prompt_file", str(prompt_file), "--eval_num_prompts", "4"]
    extra += ["--gold_judge", "none"]
    a = fsdp2_ppo(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "a", 3, extra)
    fsdp2_ppo(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "b", 2, extra)
    assert (tmp_path / "b" / "checkpoints" / "step-1" / "sharded" / ".metadata").is_file()
    b = fsdp2_ppo(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "b", 3, extra + ["--resume", "true"])
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    assert a[0]["objective/kl"] == 0.0 and a[-1]["episodes"] == 3 * 2 * 2 * 2
    for m in a:
        assert not any(k.startswith("val/") or k == "loss/value" for k in m) and "loss/kl" in m
    assert_same_logs(a, b)
    assert_same_final_weights(tmp_path / "a", tmp_path / "b", tiny_model_dir)
    assert not (tmp_path / "a" / "value_head.safetensors").exists()


@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_fsdp2_first_step_kl_zero_ratio_one(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, mixed_precision
):
    """fsdp.yaml on 2 CPU processes (the same patch), in bf16 (the file's setting) and in fp32: with bf16 the
    prepared policy computes in bf16 (accelerate's FSDP2 MixedPrecisionPolicy and autocast), and so must the
    reference and the RM, or KL != 0 and rho != 1 before the first update. One minibatch per
    step, so step 1's ratio and approx-KL are those of the first minibatch, before any update. The linear LR
    schedule decays once per optimiser step here too (it is not accelerate's to step)."""
    extra = ["--mini_batch_size", "4", "--save_steps", "0", "--lr_scheduler_type", "linear"]
    first, second = fsdp2_ppo(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, 2, extra, mixed_precision=mixed_precision
    )
    assert first["objective/kl"] == 0.0
    assert first["policy/ratio"] == 1.0 and first["policy/approxkl"] == 0.0
    assert first["policy/clipfrac"] == 0.0
    for m in (first, second):
        assert all(math.isfinite(m[k]) for k in ("loss/policy", "loss/value", "objective/scores")), m
    assert second["objective/kl"] != 0.0  # the policy moved and the KL sees it
    lrs = [first["lr"], second["lr"]]
    assert lrs == pytest.approx(linear_lr(2, optimizer_steps_per_step=1), rel=1e-12, abs=1e-15)


def test_reusing_the_frozen_blocks_on_two_ranks_trains_as_the_full_forwards(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """reuse_frozen_blocks under DDP (adapters in block 1 of 2, block 0's output reused): two steps on 2 ranks log
    the metrics and save the adapter of the 2-rank run whose every forward runs both blocks, up to float
    rounding (the trimmed micro-batches differ in width from the chunks block 0 ran on)."""
    import torch
    from safetensors.torch import load_file

    runs = {}
    for reuse in ("true", "false"):
        out = tmp_path / reuse
        args = ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, out, 2, save_steps=0)
        launch(args + ["--use_lora", "true", "--lora_layers", "1", "--reuse_frozen_blocks", reuse], 2)
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[reuse] = metrics, load_file(out / "adapter" / "adapter_model.safetensors")
    (reused, reused_adapter), (full, full_adapter) = runs["true"], runs["false"]
    assert len(reused) == len(full) == 2
    for a, b in zip(reused, full):
        for key in ("objective/scores", "objective/kl", "loss/policy", "loss/value", "policy/approxkl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert full_adapter.keys() == reused_adapter.keys() and full_adapter
    for name, p in full_adapter.items():
        torch.testing.assert_close(reused_adapter[name], p, rtol=1e-4, atol=1e-6)
