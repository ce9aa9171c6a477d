"""The command blocks of the README and of the docs' guides run: each page's commands with the tiny models, small
files and a short budget put first on the command line (the page's own flags win)."""

from __future__ import annotations

import json

import pytest
from helpers import (
    COLON_CHAT_TEMPLATE,
    ROOT,
    code_blocks,
    doc_section,
    perturb,
    pipeline_argv,
    tiny_chat_model,
)

from llm_rlhf.interfaces import cli

# --- the guides ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_readme_commands_run(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    """docs/guides/estimators.md: each of its commands with the tiny models, small files and a two-step budget
    put first on the command line (the page's own flags win)."""

    (block, *_) = code_blocks(doc_section("guides/estimators.md"), "bash")
    commands = [line.split() for line in block.splitlines()]
    estimators = [c[c.index("--advantage_estimator") + 1] for c in commands]
    assert estimators == ["grpo", "reinforce_pp", "rloo", "remax"]
    monkeypatch.chdir(tmp_path)
    tiny = dict(
        model_name_or_path=tiny_model_dir,
        reward_model_path=tiny_rm_dir,
        prompt_file=prompt_file,
        steps=2,
        rollout_batch_size=4,
        mini_batch_size=4,
        ppo_epochs=1,
        max_new_tokens=6,
        save_steps=0,
        log_samples_every=0,
        eval_every=0,
    )
    first = [item for key, value in tiny.items() for item in (f"--{key}", str(value))]
    for (_, stage, *flags), estimator in zip(commands, estimators):
        flags = [f.replace("recipes/", str(ROOT / "recipes") + "/") for f in flags]
        assert cli.main([stage, *first, *flags]) == 0, flags
        out = tmp_path / flags[flags.index("--output_dir") + 1]
        saved = (out / "config.yaml").read_text()
        assert f"advantage_estimator: {estimator}" in saved
        logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        k = 4 if "--samples_per_prompt" in flags else 1
        assert logged[-1]["episodes"] == 2 * (16 if k == 4 else 4) * k
        assert ("loss/kl" in logged[-1]) is (estimator in ("grpo", "rloo"))


@pytest.mark.slow
def test_readme_distillation_command_runs(tmp_path, monkeypatch):
    """docs/guides/distillation.md's command on the task's own prompts, with a tiny chat model (a Llama
    with a chat template) first on the command line and, where the command names the rung-1 policy, the same
    model moved off it by seeded noise (the same tokenizer): two steps of pure distillation (the task's reward
    computed and weighted 0), the reverse KL to the teacher and its seconds logged."""
    from transformers import AutoModelForCausalLM

    (block,) = code_blocks(doc_section("guides/distillation.md"), "bash")
    (command,) = [line.split() for line in block.splitlines()]
    _, stage, *flags = command
    teacher = tmp_path / flags[flags.index("--teacher_model_path") + 1]
    student = tiny_chat_model(tmp_path / "student", COLON_CHAT_TEMPLATE)
    tiny_chat_model(teacher, COLON_CHAT_TEMPLATE)
    lm = AutoModelForCausalLM.from_pretrained(teacher)
    perturb(lm, seed=3, scale=0.5)
    lm.save_pretrained(teacher, safe_serialization=True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(ROOT / "data")  # the task's files, which recipes read from the repo root
    tiny = dict(
        model_name_or_path=student,
        steps=2,
        rollout_batch_size=2,
        mini_batch_size=8,
        max_new_tokens=6,
        eval_every=0,
    )
    first = [item for key, value in tiny.items() for item in (f"--{key}", str(value))]
    flags = [f.replace("recipes/", str(ROOT / "recipes") + "/") for f in flags]
    assert cli.main([stage, *first, *flags]) == 0
    out = tmp_path / flags[flags.index("--output_dir") + 1]
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2]
    assert all(m["objective/distill_kl"] != 0 and m["time/teacher"] > 0 for m in logged)
    assert all(m["objective/scores"] == 0 for m in logged) and "objective/reward_fn" in logged[0]


# --- the README -----------------------------------------------------------------------------------------------


def readme_pipeline_commands() -> dict[str, str]:
    """The README's opening: the main job's and the smoke run's `llm-rlhf pipeline` commands, by their label."""
    text = (ROOT / "README.md").read_text()
    opening = text[: text.index("\n## ")]
    main_block = opening[opening.index("**Main job**") :].split("```bash\n")[1].split("```")[0]
    smoke = opening[opening.index("**Smoke run**") :].split("`llm-rlhf pipeline")[1].split("`")[0]
    return {
        "main": main_block.strip().split(" && ")[-1],
        "smoke": "llm-rlhf pipeline" + smoke,
    }


@pytest.mark.slow
def test_the_main_job_and_the_smoke_run_as_the_readme_writes_them(
    tiny_model_dir, tiny_llama_dir, sft_files, pref_files, prompt_file, tmp_path, monkeypatch
):
    """The README's main command (SmolLM2 through the pipeline) with a tiny Llama in SmolLM2's place, the
    adapters in its last block, and its smoke run with the tiny GPT-2: each exits 0 with every stage's output
    and the report."""
    commands = readme_pipeline_commands()
    assert commands == {
        "main": "llm-rlhf pipeline --config recipes/smollm2-reviews/pipeline.yaml",
        "smoke": "llm-rlhf pipeline --config recipes/reviews/smoke.yaml",
    }
    monkeypatch.chdir(ROOT)  # the recipes name their stage files relative to the repo root
    one_block = {stage: {"lora_layers": 1} for stage in ("sft", "rm", "ppo")}  # SmolLM2's last 10 of 30
    for name, model, keys in (("main", tiny_llama_dir, one_block), ("smoke", tiny_model_dir, None)):
        _, command, *flags = commands[name].split()
        out = tmp_path / name
        config = ROOT / flags[flags.index("--config") + 1]
        argv = pipeline_argv(out, model, sft_files, pref_files, prompt_file, config=config, keys=keys)
        assert cli.main([command, *argv]) == 0, name
        for stage in ("sft", "rm", "ppo", "eval"):
            assert (out / stage / "metrics.json").is_file(), (name, stage)
        assert (out / "report.html").is_file(), name
