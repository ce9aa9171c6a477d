"""DeepSpeed ZeRO-2 and ZeRO-3 for real on 2 CPU processes (gloo), launched with the project's own
accelerate_configs/deepspeed_zero2.yaml and deepspeed_zero3.yaml. `llm-rlhf` turns DeepSpeed on
without GPUs itself (`utils.run_deepspeed_on_cpu`); the scripts here change nothing of how accelerate runs
DeepSpeed (they read the raw gradients and set ZeRO-3's thresholds, see each script's docstring)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import ROOT, SENTENCES, flags, logged, ppo_cli_args, preference_rows, write_jsonl
from processes import launch

SCRIPTS = ROOT / "tests" / "scripts"


def first_updates(model_dir, rm_dir, prompt_file, out: Path, config: str | None) -> dict:
    """tests/scripts/ppo_ranks.py in mode gae_grpo on one process (config None) or on 2 under `config`, in
    fp32 (--mixed_precision no) so that it compares tightly; what it wrote."""
    args = [
        str(SCRIPTS / "ppo_ranks.py"),
        str(model_dir),
        str(rm_dir),
        str(prompt_file),
        str(out),
        "gae_grpo",
    ]
    if config is None:
        launch(args, 1)
    else:
        # ZeRO-3 samples with ranks of different lengths at the end: it hung before the synced decode
        launch(args, 2, config=config, mixed_precision="no", timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero2_and_zero3_first_updates_equal_one_process_and_ddp(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """The fixed global batch of tests/scripts/ppo_ranks.py (8 episodes; each rank its half) on one process,
    and on 2 under DDP (multi_gpu.yaml), ZeRO-2 and ZeRO-3: the RAW gradient (before clipping; gathered whole
    from DeepSpeed's partitions) of gae's first update (value head) and of grpo's two updates (the second
    after an Adam step) and the steps' metrics are those of one process, so DeepSpeed's are DDP's. Under
    ZeRO-3 each process holds about half the parameters, and sampling with rank 0's responses ending at once
    and rank 1's running to max_new_tokens ends (without the synced decode their collectives go out of step:
    a hang or gloo's "Connection reset by peer")."""
    import torch

    one = first_updates(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "one.json", None)
    assert one["world"] == 1 and torch.tensor(one["grads"]).abs().max() > 0
    full = len(one["grads"])
    for config in ("multi_gpu.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"):
        run = first_updates(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / f"{config}.json", config)
        kind = "MULTI_CPU" if config == "multi_gpu.yaml" else "DEEPSPEED"
        assert (run["world"], run["distributed_type"]) == (2, kind), config
        torch.testing.assert_close(
            torch.tensor(run["grads"]), torch.tensor(one["grads"]), atol=1e-7, rtol=1e-4, msg=config
        )
        for key in (
            "loss/policy",
            "loss/value",
            "objective/kl",
            "objective/scores",
            "val/explained_variance",
        ):
            assert run["metrics"][0][key] == pytest.approx(one["metrics"][0][key], rel=1e-4, abs=1e-6), key
        a, b = one["grpo"], run["grpo"]
        assert len(a["grads"]) == len(b["grads"]) == 2
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            atol = 1e-7 if step == 0 else 1e-6  # step 2: weights one Adam step (lr 1e-2) apart by rounding
            torch.testing.assert_close(
                torch.tensor(gb), torch.tensor(ga), atol=atol, rtol=1e-4, msg=f"{config} grpo {step + 1}"
            )
        for m1, m2 in zip(a["metrics"], b["metrics"]):
            assert "loss/value" not in m2
            for key in ("loss/policy", "loss/kl", "objective/kl", "objective/scores", "policy/approxkl"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), (config, m1["step"], key)
        assert a["metrics"][1]["objective/kl"] != 0.0
        if config == "deepspeed_zero3.yaml":
            assert run["local_numel"] < 0.6 * full  # partitioned (persistence threshold 0)
            assert run["sampled_lengths"] == b["sampled_lengths"] == [1, 6]  # rank 0: EOS; rank 1: 6 tokens
        else:
            assert run["local_numel"] == full  # DDP; ZeRO-2 partitions gradients and optimizer states only


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero3_lora_first_update_equals_one_process(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """PPO with a LoRA adapter (tests/scripts/ppo_ranks.py MODE lora: gae, value head; the reference is the
    policy with the adapter disabled) on the fixed global batch, on one process and on 2 under ZeRO-3 with
    every parameter partitioned, the adapter's included: the RAW gradient of the first update (before
    clipping; gathered whole from DeepSpeed's partitions: the adapter and the value head, the only trainable
    parameters) and the step's metrics are one process's; KL is 0 at the first step (the reference forward
    with the adapter disabled runs on the partitioned network), and the sampling with rank 0's responses
    ending at once and rank 1's running to max_new_tokens ends. The policy saved after the update with
    merge_lora false (under ZeRO-3 gathered from the partitions into a whole copy) is what one process
    saves: adapter/ (the adapter's weights after one Adam step, equal within fp32 rounding) and the value
    head, no merged model; the adapter loads onto the start model with peft."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    args = [str(SCRIPTS / "ppo_ranks.py"), str(tiny_model_dir), str(tiny_rm_dir), str(prompt_file)]
    launch([*args, str(tmp_path / "one.json"), "lora"], 1)
    one = json.loads((tmp_path / "one.json").read_text())
    launch(
        [*args, str(tmp_path / "zero3.json"), "lora"],
        2,
        config="deepspeed_zero3.yaml",
        mixed_precision="no",
        timeout=600,
    )
    run = json.loads((tmp_path / "zero3.json").read_text())
    assert (one["world"], run["world"], run["distributed_type"]) == (1, 2, "DEEPSPEED")
    grads, expected = torch.tensor(run["grads"]), torch.tensor(one["grads"])
    assert expected.abs().max() > 0 and len(expected) == one["local_numel"]
    torch.testing.assert_close(grads, expected, atol=1e-7, rtol=1e-4)
    for key in ("loss/policy", "loss/value", "objective/kl", "objective/scores", "val/explained_variance"):
        assert run["metrics"][0][key] == pytest.approx(one["metrics"][0][key], rel=1e-4, abs=1e-6), key
    assert run["metrics"][0]["objective/kl"] == one["metrics"][0]["objective/kl"] == 0.0
    assert run["local_numel"] < 0.6 * len(expected)  # the adapter and the head partitioned too
    assert run["sampled_lengths"] == [1, 6]  # rank 0: EOS; rank 1: 6 tokens
    for name in ("adapter/adapter_model.safetensors", "value_head.safetensors"):
        saved, expected_saved = load_file(tmp_path / "zero3" / name), load_file(tmp_path / "one" / name)
        assert saved.keys() == expected_saved.keys()
        for k in expected_saved:
            torch.testing.assert_close(saved[k], expected_saved[k], atol=1e-6, rtol=1e-4, msg=k)
    assert not (tmp_path / "zero3" / "model.safetensors").exists()  # merge_lora false: the adapter alone
    PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "zero3" / "adapter"
    )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "config, extra",
    [
        # gae with the value head, full weights; held-out evaluation and logged samples sample under ZeRO-3
        (
            "deepspeed_zero3.yaml",
            ["--eval_every", "1", "--eval_num_prompts", "4", "--log_samples_every", "1"],
        ),
        # a critic-free estimator with LoRA, under ZeRO-2 and under ZeRO-3 (the adapter partitioned too)
        (
            "deepspeed_zero2.yaml",
            ["--advantage_estimator", "grpo", "--samples_per_prompt", "2", "--rollout_batch_size", "2"]
            + ["--use_lora", "true", "--lora_r", "4"],
        ),
        (
            "deepspeed_zero3.yaml",
            ["--advantage_estimator", "grpo", "--samples_per_prompt", "2", "--rollout_batch_size", "2"]
            + ["--use_lora", "true", "--lora_r", "4"]
            + ["--eval_every", "1", "--eval_num_prompts", "4", "--log_samples_every", "1"],
        ),
    ],
    ids=["zero3-gae", "zero2-grpo-lora", "zero3-grpo-lora"],
)
def test_ppo_under_deepspeed_resumes_and_saves_one_hf_folder(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, config, extra
):
    """`llm-rlhf ppo` with the DeepSpeed file as shipped (bf16) on 2 CPU processes: 2 steps with the engine's
    own checkpoint every step; then, in another folder holding only step 1's checkpoint and log line, a
    resume to step 2 logs what the uninterrupted run logged and saves the same weights; the final policy is
    one plain HF folder that `from_pretrained` loads. With LoRA the folder is the merged policy and adapter/
    holds the adapter: the start model (in the engine's bf16) with that adapter merged is the saved policy
    (under ZeRO-3 both come from the partitions gathered at the end)."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    extra = extra + ["--eval_prompt_file", str(prompt_file), "--gold_judge", "none"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch(ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, a, 2) + extra, 2, config=config)
    ckpt = a / "checkpoints" / "step-1" / "deepspeed" / "pytorch_model"
    states = sorted(p.name for p in ckpt.glob("*optim_states.pt"))
    assert len(states) == 2 and "zero_pp_rank_1" in states[1]  # each rank its partition of the optimizer
    shutil.copytree(a / "checkpoints" / "step-1", b / "checkpoints" / "step-1")
    (b / "metrics.jsonl").write_text((a / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    launch(
        ppo_cli_args(tiny_model_dir, tiny_rm_dir, prompt_file, b, 2) + extra + ["--resume", "true"],
        2,
        config=config,
    )
    first, resumed = logged(a), logged(b)
    assert [m["step"] for m in first] == [m["step"] for m in resumed] == [1, 2]
    assert first[0]["objective/kl"] == 0.0 and first[1]["objective/kl"] != 0.0
    for k, v in first[1].items():
        if not k.startswith(("time/", "tokens_per_s")):
            assert resumed[1][k] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), k
    final_a, final_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    start = load_file(tiny_model_dir / "model.safetensors")
    assert final_a.keys() == final_b.keys() == start.keys()
    assert any(not torch.equal(final_a[k].float(), start[k]) for k in start)  # trained
    for k in start:
        torch.testing.assert_close(final_b[k], final_a[k], msg=k)
    model = AutoModelForCausalLM.from_pretrained(a)
    assert model.config.vocab_size == start["transformer.wte.weight"].shape[0]
    assert (a / "value_head.safetensors").is_file() == ("--advantage_estimator" not in extra)
    if "--use_lora" in extra:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        # the adapter in bf16 as saved (peft would upcast it, and round the merge differently)
        lora = PeftModel.from_pretrained(base, a / "adapter", autocast_adapter_dtype=False)
        merged = lora.merge_and_unload().state_dict()
        moved = [k for k in start if not torch.equal(merged[k], start[k].to(torch.bfloat16))]
        assert moved  # the adapter is not zero
        for k in start:
            assert torch.equal(final_a[k], merged[k]), k
    if "--eval_every" in extra:
        assert len((a / "samples.jsonl").read_text().splitlines()) > 0
        assert len((a / "eval_log.jsonl").read_text().splitlines()) == 3  # steps 0, 1, 2


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"], ids=["zero2", "zero3"])
def test_pipeline_sft_rm_ppo_eval_and_dpo_under_deepspeed(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, config
):
    """`llm-rlhf pipeline` (SFT and RM through TRL's trainers, then PPO and evaluation) under
    deepspeed_zero2.yaml and deepspeed_zero3.yaml on 2 CPU processes, fp32 (`--mixed_precision no`: the
    Trainer's bf16 needs a GPU): each stage trains with DeepSpeed's engine (its checkpoints hold one ZeRO
    partition of the optimizer state per process) and ends in a plain HF folder that `from_pretrained`
    loads, and the evaluation (the main process alone) writes its figures. Under ZeRO-3 the evaluation hung
    before it loaded its models outside `zero.Init` (the stages before it leave accelerate's DeepSpeed
    config registered with transformers). Then, under ZeRO-2, `llm-rlhf dpo` from the SFT folder (DPO under
    ZeRO-3: test_sft_rm_dpo_under_zero2_and_zero3_*)."""
    from helpers import pipeline_argv
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = tmp_path / "pipeline"
    argv = pipeline_argv(out, tiny_model_dir, sft_files, pref_files, prompt_file, report="false")
    proc = launch(["-m", "llm_rlhf", "pipeline", *argv], 2, config=config, mixed_precision="no", timeout=600)
    assert proc.stdout.count("== eval: running") == 1
    assert json.loads((out / "eval" / "metrics.json").read_text())["gold_win_rate"] is not None
    for stage in ("sft", "rm"):
        (step,) = (out / stage / "checkpoints").glob("checkpoint-*/global_step*")
        assert sorted(p.name for p in step.glob("zero_pp_rank_*_optim_states.pt")) == [
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ], stage
    assert (out / "ppo" / "checkpoints" / "step-2" / "deepspeed" / "latest").is_file()
    AutoModelForCausalLM.from_pretrained(out / "sft")
    AutoModelForSequenceClassification.from_pretrained(out / "rm", num_labels=1)
    AutoModelForCausalLM.from_pretrained(out / "ppo")
    assert json.loads((out / "ppo" / "metrics.json").read_text())["episodes"] == 4 * 4 * 2
    if config == "deepspeed_zero3.yaml":
        return
    # DPO (TRL's DPOTrainer, its frozen reference beside the engine) from the SFT folder, under ZeRO-2 too
    dpo = tmp_path / "dpo"
    values = dict(
        model_name_or_path=out / "sft",
        train_file=pref_files[0],
        eval_file=pref_files[1],
        output_dir=dpo,
        max_steps=4,
        max_length=32,
        per_device_train_batch_size=4,
        eval_steps=2,
        logging_steps=2,
    )
    launch(["-m", "llm_rlhf", "dpo", *flags(values)], 2, config="deepspeed_zero2.yaml", mixed_precision="no")
    (step,) = (dpo / "checkpoints").glob("checkpoint-4/global_step4")
    assert len(list(step.glob("zero_pp_rank_*_optim_states.pt"))) == 2
    assert json.loads((dpo / "metrics.json").read_text())["global_step"] == 4
    AutoModelForCausalLM.from_pretrained(dpo)


STAGES = ("sft", "rm", "dpo")
UNCHECKPOINTED = ("num_tokens", "eval_num_tokens")  # TRL's token counters restart at 0 on resume


def stage_runs(model_dir, files, out: Path, config: str | None, *extra: str) -> dict:
    """tests/scripts/trainer_stage_ranks.py on one process (config None) or on 2 under `config`, fp32
    (--mixed_precision no: the Trainer's bf16 needs a GPU, and fp32 compares tightly); what it wrote.
    extra: the script's optional argument (lora)."""
    args = [str(SCRIPTS / "trainer_stage_ranks.py"), str(model_dir), *map(str, files), str(out), *extra]
    if config is None:
        launch(args, 1)
    else:
        launch(args, 2, config=config, mixed_precision="no", timeout=600)
    return json.loads((out / "ranks.json").read_text())


def logged_lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "log.jsonl").read_text().splitlines()]


def same_figures(got: dict, expected: dict) -> None:
    """The figures two log lines share, runtimes and TRL's token counters aside, equal within fp32 rounding."""
    for key, value in expected.items():
        if not key.endswith(("_runtime", "_per_second")) and key not in UNCHECKPOINTED:
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def stage_inputs(tiny_model_dir, tmp_path: Path) -> tuple[Path, tuple[Path, ...]]:
    """The tiny model with dropout off (one process and two draw no masks) and the script's four files: SFT
    rows and preference pairs, each training file exactly one global batch (8 rows)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    (model_dir / "config.json").write_text(json.dumps(config))
    sft_rows = [
        {"prompt": " ".join(s.split(" ")[:3]), "completion": " " + " ".join(s.split(" ")[3:])}
        for s in SENTENCES
    ]
    pairs = preference_rows()
    files = (
        write_jsonl(tmp_path / "sft_train.jsonl", sft_rows[:8]),
        write_jsonl(tmp_path / "sft_val.jsonl", sft_rows[:4]),
        write_jsonl(tmp_path / "prefs_train.jsonl", (pairs * 2)[:8]),
        write_jsonl(tmp_path / "prefs_val.jsonl", pairs),
    )
    return model_dir, files


def check_stage_runs(run: dict, one: dict, out: Path, one_out: Path, config: str | None, start: dict) -> None:
    """Per stage, a run of tests/scripts/trainer_stage_ranks.py (written to `out`) against one process's
    (`one`, written to `one_out`): the first raw gradient, the first logged loss and grad norm; the resumed
    run's step 2 and evaluation equal the uninterrupted run's; the final folders hold the same weights,
    trained away from `start`, and load with `from_pretrained`."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kind = {None: "NO", "multi_gpu.yaml": "MULTI_CPU"}.get(config, "DEEPSPEED")
    assert (run["world"], run["distributed_type"]) == (1 if config is None else 2, kind)
    for stage in STAGES:
        grad, expected = torch.tensor(run[stage]["grad"]), torch.tensor(one[stage]["grad"])
        assert expected.abs().max() > 0
        torch.testing.assert_close(grad, expected, atol=1e-7, rtol=1e-4, msg=f"{config} {stage}")
        first, resumed = logged_lines(out / stage / "a"), logged_lines(out / stage / "b")
        for key in ("loss", "grad_norm"):
            assert first[0][key] == pytest.approx(logged_lines(one_out / stage / "a")[0][key], rel=1e-5), (
                config,
                stage,
                key,
            )
        assert [m["step"] for m in resumed[:2]] == [2, 2] and "eval_loss" in resumed[1]
        same_figures(resumed[0], first[1])  # step 2's training figures
        same_figures(resumed[1], first[2])  # step 2's evaluation
        if config == "deepspeed_zero3.yaml":
            assert run[stage]["local_numel"] < 0.6 * len(grad)  # partitioned
        else:
            assert run[stage]["local_numel"] == len(grad)  # ZeRO-2 partitions gradients, optimizer only
        if kind == "DEEPSPEED":
            (step,) = (out / stage / "a" / "checkpoints" / "checkpoint-1").glob("global_step1")
            assert len(list(step.glob("zero_pp_rank_*_optim_states.pt"))) == 2, (config, stage)
        final_a = load_file(out / stage / "a" / "model.safetensors")
        final_b = load_file(out / stage / "b" / "model.safetensors")
        assert final_a.keys() == final_b.keys()
        assert any(not torch.equal(final_a[k], start[k]) for k in start if k in final_a)  # trained
        for k in final_a:
            torch.testing.assert_close(final_b[k], final_a[k], msg=f"{config} {stage} {k}")
        if stage == "rm":
            AutoModelForSequenceClassification.from_pretrained(out / stage / "a", num_labels=1)
        else:
            AutoModelForCausalLM.from_pretrained(out / stage / "a")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sft_rm_dpo_under_zero2_and_zero3_equal_one_process_and_ddp_resume_and_save(tiny_model_dir, tmp_path):
    """SFT, RM and DPO (TRL's trainers) through tests/scripts/trainer_stage_ranks.py: 2 steps on a training
    set of exactly one global batch (8 rows: the split across processes cannot change a correctly scaled
    gradient), on one process and on 2 under DDP (multi_gpu.yaml), ZeRO-2 and ZeRO-3 (every parameter
    partitioned, nothing kept live: each process holds half the parameters, and a forward on the main process
    alone after training would hang). The RAW gradient of the first update (before clipping; gathered whole
    from DeepSpeed's partitions) and the logged loss and grad norm equal one process's; a run resumed from
    step 1's checkpoint (the engine's, one ZeRO partition of the optimizer state per process) logs step 2
    and its evaluation as the uninterrupted run did and saves the same weights; the final folder is one plain
    HF folder that `from_pretrained` loads. Dropout is off so that one process and two draw no masks."""
    from safetensors.torch import load_file

    model_dir, files = stage_inputs(tiny_model_dir, tmp_path)
    start = load_file(model_dir / "model.safetensors")
    one = stage_runs(model_dir, files, tmp_path / "one", None)
    assert one["world"] == 1
    for config in (None, "multi_gpu.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"):
        out = tmp_path / (config or "one")
        run = one if config is None else stage_runs(model_dir, files, out, config)
        check_stage_runs(run, one, out, tmp_path / "one", config, start)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sft_rm_dpo_with_lora_under_zero2_and_zero3_resume_and_save(tiny_model_dir, tmp_path):
    """The same with a LoRA adapter in every stage (the script's `lora`: merged into the saved folder; the
    RM's score head trained in full beside it; DPO's reference the policy with the adapter disabled), on one
    process and on 2 under ZeRO-2 and ZeRO-3 (every parameter partitioned, the adapter's included): the first
    raw gradient (the trainable parameters') equals one process's, the resume continues exactly, and the
    merged folder (under ZeRO-3 gathered from the partitions at the end, `trainer_stage.whole_model`: a whole
    peft copy on the main process) loads with `from_pretrained`."""
    from safetensors.torch import load_file

    model_dir, files = stage_inputs(tiny_model_dir, tmp_path)
    start = load_file(model_dir / "model.safetensors")
    one = stage_runs(model_dir, files, tmp_path / "one", None, "lora")
    assert len(one["sft"]["grad"]) < 0.25 * sum(v.numel() for v in start.values())  # the adapter only
    check_stage_runs(one, one, tmp_path / "one", tmp_path / "one", None, start)
    for config in ("deepspeed_zero2.yaml", "deepspeed_zero3.yaml"):
        run = stage_runs(model_dir, files, tmp_path / config, config, "lora")
        check_stage_runs(run, one, tmp_path / config, tmp_path / "one", config, start)


def test_trainer_stages_run_lora_under_zero3_and_refuse_a_precision_mismatch_in_one_line(monkeypatch):
    """SFT, RM and DPO under a DeepSpeed launch (accelerate passes the config in ACCELERATE_* variables):
    LoRA passes the checks under ZeRO-3 (it runs there: test_sft_rm_dpo_with_lora_*) and
    ZeRO-2; a bf16 key that disagrees with the launch's mixed_precision is refused."""
    from llm_rlhf.core.errors import ConfigError
    from llm_rlhf.stages import sft
    from llm_rlhf.training.hf_stage import check_deepspeed_launch

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    check_deepspeed_launch(bf16=False)
    assert sft.Config(use_lora=True).training_arguments()["bf16"] is False  # what every stage's start from
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    check_deepspeed_launch(bf16=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(
        ConfigError, match="config key 'bf16' is false but the DeepSpeed launch's mixed_precision"
    ):
        check_deepspeed_launch(bf16=False)
    check_deepspeed_launch(bf16=True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    check_deepspeed_launch(bf16=False)


def test_deepspeed_launch_without_deepspeed_stops_in_one_line(monkeypatch, capsys):
    """`llm-rlhf` launched with a DeepSpeed config (2 processes, no GPU) where deepspeed is not installed:
    one line saying how to install it, exit code 2, accelerate left as it was."""
    import accelerate.state

    from llm_rlhf.interfaces import cli

    init = accelerate.state.AcceleratorState.__init__
    monkeypatch.setitem(sys.modules, "deepspeed.comm.torch", None)  # import fails as if not installed
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under `accelerate launch --num_processes 2`
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # what `llm-rlhf` sets there; undone after the test
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["sft", "--help"]) == 2
    assert capsys.readouterr().err == (
        "error: the accelerate config says distributed_type: DEEPSPEED, but deepspeed is not installed: "
        "pip install -e '.[deepspeed]'\n"
    )
    assert accelerate.state.AcceleratorState.__init__ is init


def test_outside_zero_init_steps_out_of_a_registered_zero3_config_and_back():
    """What the eval stage runs in (`accelerated.outside_zero_init`): with a ZeRO-3 config registered with
    transformers (as a ZeRO-3 stage earlier in the process leaves it; `from_pretrained` then builds under
    zero.Init), transformers sees no ZeRO-3 inside; the registration is back after, and without one nothing
    changes. The pipeline test's zero3 case runs it for real."""
    from transformers.integrations import (
        HfDeepSpeedConfig,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    from llm_rlhf.models.accelerated import outside_zero_init

    with outside_zero_init():
        assert not is_deepspeed_zero3_enabled()
    registered = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        with outside_zero_init():
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()
        del registered
