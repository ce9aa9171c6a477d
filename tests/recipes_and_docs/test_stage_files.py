"""Every stage file of the checkable-task recipes (recipes/gym/ and recipes/gym-*/, nested folders included), and
the PPO and eval files of the other recipes that no other test runs alone, run alone with their stage's command, as
a user who copies one would run it: `llm-rlhf ppo --config FILE`, with only the model folders swapped for tiny
local ones (a chat Llama for SmolLM2's recipes, the tests' GPT-2 and its reward model for the reviews recipes) and
the budget cut to a step. Their task, prompt files, verifier, environment and sampling keys are the files' own.
(The other recipes' SFT, RM and PPO files run one command at a time in tests/recipes_and_docs/test_recipes.py, the
DPO recipe in tests/stages/test_dpo.py, the DAPO variant in test_recipes.py; the compare files read a PPO run.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, SENTIMENT_JUDGE, TAGGED_CHAT_TEMPLATE, flags, tiny_chat_model

from llm_rlhf.core.utils import read_json
from llm_rlhf.interfaces import cli

RECIPES = ROOT / "recipes"
GYM_FILES = sorted(
    p for folder in sorted(RECIPES.glob("gym*")) for p in folder.rglob("*.yaml") if p.name != "pipeline.yaml"
)


OTHER_FILES = [
    RECIPES / name
    for name in (
        "reviews/eval.yaml",
        "gpt2-reviews/eval.yaml",
        "reviews-lora/ppo.yaml",
        "reviews-lora/eval.yaml",
        "smollm2-arithmetic/ppo.yaml",
        "smollm2-arithmetic/eval.yaml",
    )
]


def command_of(path: Path) -> str:
    """The command a stage file is written for: its name (sft, ppo, eval), or eval for a generalisation or
    probe file (a trained policy measured on other prompts)."""
    if path.parent.name == "generalise" or path.stem == "probe":
        return "eval"
    return path.stem


def tiny_keys(command: str, values: dict, model: Path, out: Path) -> dict:
    """The keys that swap in the tiny model and cut the budget; every other key is the file's. The length
    limits are raised: the tiny byte-level tokenizer spends several of its tokens on one of SmolLM2's."""
    if command == "sft":
        return {
            "model_name_or_path": model,
            "output_dir": out,
            "max_steps": 1,
            "per_device_train_batch_size": 2,
            "warmup_ratio": 0,
            "logging_steps": 1,
            "eval_steps": 0,
            "save_steps": 1,
            "num_samples": 1,
            "max_new_tokens": 4,
            "max_length": 2048,
        }
    if command == "ppo":
        return {
            "model_name_or_path": model,
            "output_dir": out,
            "steps": 1,
            "save_steps": 0,
            "log_samples_every": 0,
            "eval_num_prompts": 4,
            "max_prompt_length": 1024,
        }
    assert command == "eval", command
    return {
        "policy_path": model,
        "baseline_path": model,
        "output_dir": out,
        "num_prompts": 4,
        "batch_size": 4,
        "max_prompt_length": 1024,
    }


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    """A tiny Llama with a chat template and room for the tasks' prompts under its byte-level tokenizer."""
    return tiny_chat_model(tmp_path_factory.mktemp("chat_llama"), TAGGED_CHAT_TEMPLATE, n_positions=2048)


def test_the_checkable_task_recipes_share_their_stage_files():
    """Recipes that differ only in their task share recipes/gym/ppo.yaml and eval.yaml; each names its task."""
    pipelines = sorted(RECIPES.glob("gym-*/pipeline.yaml"))
    assert len(pipelines) == 5
    for path in pipelines:
        cfg = yaml.safe_load(path.read_text())
        assert cfg["task"] == path.parent.name.removeprefix("gym-"), path
        assert (cfg["ppo_config"], cfg["eval_config"]) == ("recipes/gym/ppo.yaml", "recipes/gym/eval.yaml"), (
            path
        )
    assert not list(RECIPES.glob("gym-*/ppo.yaml")) and not list(RECIPES.glob("gym-*/eval.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("path", GYM_FILES + OTHER_FILES, ids=lambda p: str(p.relative_to(RECIPES)))
def test_a_stage_file_runs_alone(path, chat_llama, tiny_model_dir, tiny_rm_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the files name their data relative to the repo root, as the README runs them
    command, values = command_of(path), yaml.safe_load(path.read_text())
    out = tmp_path / command
    chat = "smollm2" in str(values.get("model_name_or_path", values.get("baseline_path", "")))
    keys = tiny_keys(command, values, chat_llama if chat else tiny_model_dir, out)
    if not chat:  # the reviews recipes: the tests' GPT-2 (64 positions), its reward model, the sentiment gold
        keys.update(reward_model_path=tiny_rm_dir, gold_judge=SENTIMENT_JUDGE, max_new_tokens=16)
        keys["max_prompt_length"] = values.get("max_prompt_length", 32)
    assert cli.main([command, "--config", str(path.relative_to(ROOT)), *flags(keys)]) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    for key, value in values.items():  # the file's own keys, untouched but for the swapped ones
        if key not in keys:
            assert config[key] == value, key
    if command == "sft":
        assert read_json(out / "metrics.json")["global_step"] == 1
        return
    task = values.get("task")
    if task is not None:  # the task's files fill the keys the file leaves out
        assert config["prompt_file"].startswith(f"data/tasks/{task}/")
        assert config["accuracy_fn"] == f"data/tasks/{task}/verifier.py:accuracy"
    assert Path(config["prompt_file"]).is_file()
    if command == "ppo":
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == [1]
    else:
        metrics = read_json(out / "metrics.json")
        assert metrics["num_prompts"] == 4
    if path in GYM_FILES or "arithmetic" in path.parent.name:  # a verifier: accuracy measured
        assert config["accuracy_fn"] is not None
        if command == "eval":
            assert metrics["accuracy"] is not None


def test_a_task_fills_the_keys_a_stage_file_leaves_out(monkeypatch):
    """`task` names data/tasks/<task>/'s prompt files, reward function and verifier; `--task` on the command line
    picks another; a key the file or the command line sets keeps its value; an unwritten task is one error."""
    from llm_rlhf.core.config import parse_config
    from llm_rlhf.core.errors import ConfigError
    from llm_rlhf.ppo.config import Config as PPOConfig
    from llm_rlhf.stages.evaluate import Config as EvalConfig

    monkeypatch.chdir(ROOT)
    ppo = parse_config(PPOConfig, ["--config", "recipes/gym/ppo.yaml"])
    folder = "data/tasks/chain_sum-t2d1"
    assert (ppo.task, ppo.prompt_file, ppo.eval_prompt_file) == (
        "chain_sum-t2d1",
        f"{folder}/train_prompts.jsonl",
        f"{folder}/eval_prompts.jsonl",
    )
    assert (ppo.reward_fn, ppo.accuracy_fn) == (
        f"{folder}/verifier.py:reward",
        f"{folder}/verifier.py:accuracy",
    )
    other = parse_config(EvalConfig, ["--config", "recipes/gym/eval.yaml", "--task", "leg_counting-a1"])
    assert other.prompt_file == "data/tasks/leg_counting-a1/eval_prompts.jsonl"
    assert other.accuracy_fn == "data/tasks/leg_counting-a1/verifier.py:accuracy"
    mine = parse_config(PPOConfig, ["--config", "recipes/gym/ppo.yaml", "--prompt_file", "mine.jsonl"])
    assert mine.prompt_file == "mine.jsonl" and mine.eval_prompt_file == f"{folder}/eval_prompts.jsonl"
    with pytest.raises(ConfigError, match="task 'no-such-task': no data/tasks/no-such-task/task.json"):
        PPOConfig(task="no-such-task")
