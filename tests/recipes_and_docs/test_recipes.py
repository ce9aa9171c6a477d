"""Every recipe under recipes/ is executed: each YAML parses through its stage's Config (an unknown key
fails), the stage files of a recipe chain into each other, the README commands name files that exist, and
each recipe's stages run a couple of steps with a tiny local model and small data files substituted on the
command line (the way a user points a recipe at their own model)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import (
    FIXTURES,
    ROOT,
    SENTIMENT_JUDGE,
    TAGGED_CHAT_TEMPLATE,
    build_model,
    flags,
    tiny_chat_model,
    tiny_overrides,
)

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.utils import read_json
from llm_rlhf.interfaces import cli, pipeline
from llm_rlhf.ppo.config import Config
from llm_rlhf.stages import compare, dpo, evaluate, reward, sft

RECIPES = ROOT / "recipes"
HH_FIXTURE = FIXTURES / "hh_rlhf.jsonl"
CONFIGS = {
    "sft": sft.Config,
    "rm": reward.Config,
    "ppo": Config,
    "eval": evaluate.Config,
    "pipeline": pipeline.Config,
}
OPTIONAL = {"dpo": dpo.Config, "compare": compare.Config}  # stage files only some recipes have (reviews)
VARIANTS = {  # a stage's recipe with other keys (smollm2-arithmetic: DAPO's PPO; reviews: the smoke run)
    "dapo": Config,
    "smoke": pipeline.Config,
}
SHARED = "gym"  # recipes/gym/: the stage files the checkable-task recipes share (tests/recipes_and_docs/test_stage_files.py)
NAMES = sorted(p.name for p in RECIPES.iterdir() if p.is_dir() and p.name != SHARED)
YAMLS = sorted(RECIPES.glob("*/*.yaml"))


GYM_RECIPES = [
    name for name in NAMES if name.startswith("gym-")
]  # reasoning-gym tasks (tests/tasks/test_tasks.py)
RULE_RECIPES = [
    "smollm2-arithmetic",
    *GYM_RECIPES,
]  # stages [ppo, eval]: RL from a rule, from an instruct model
CHAINED_RECIPES = [name for name in NAMES if name not in RULE_RECIPES]  # sft -> rm -> ppo -> eval


def test_the_recipes_are_the_documented_ones():
    """The recipes of the table in docs/getting-started/recipes.md; a gym recipe (`gym-*`, one per trained reasoning-gym task) is checked
    by tests/tasks/test_tasks.py: its pipeline names a task of data/tasks/tasks.yaml."""
    assert [name for name in NAMES if name not in GYM_RECIPES] == [
        "gpt2-hh",
        "gpt2-reviews",
        "reviews",
        "reviews-lora",
        "smollm2-arithmetic",
        "smollm2-reviews",
    ]
    for name in NAMES:
        assert {"pipeline.yaml", "README.md"} <= {p.name for p in (RECIPES / name).iterdir()}, name
        cfg = parse_config(pipeline.Config, ["--config", str(RECIPES / name / "pipeline.yaml")])
        for stage in cfg.stages:  # each stage's file: the recipe's own, or the shared one of recipes/gym/
            stage_file = ROOT / getattr(cfg, f"{stage}_config")
            assert stage_file.parent in (RECIPES / name, RECIPES / SHARED) and stage_file.is_file(), (
                name,
                stage,
            )
        assert (cfg.stages == ["ppo", "eval"]) == (name in RULE_RECIPES), name


def test_the_rule_recipe_evaluates_against_its_starting_model_with_its_verifier(monkeypatch):
    """smollm2-arithmetic has no SFT or RM stage: PPO starts from the instruct model, scores with the verifier
    alone, and both the eval file and the pipeline compare the policy with that model on the same score."""
    monkeypatch.chdir(ROOT)
    folder = RECIPES / "smollm2-arithmetic"
    ppo_cfg = parse_config(Config, ["--config", str(folder / "ppo.yaml")])
    eval_cfg = parse_config(evaluate.Config, ["--config", str(folder / "eval.yaml")])
    piped = pipeline.stage_config(
        parse_config(pipeline.Config, ["--config", str(folder / "pipeline.yaml")]), "eval"
    )
    verifier = "llm_rlhf.tasks.arithmetic:reward"
    assert ppo_cfg.reward_fn == ppo_cfg.accuracy_fn == verifier and ppo_cfg.reward_model_path in (
        None,
        "none",
    )
    for cfg in (eval_cfg, piped):
        assert cfg.policy_path == ppo_cfg.output_dir and cfg.baseline_path == ppo_cfg.model_name_or_path
        assert cfg.reward_fn == cfg.accuracy_fn == verifier and cfg.reward_model_path in (None, "none")
        assert cfg.reference_path is None, "the KL is to the baseline: the instruct model PPO started from"
    assert piped.output_dir == eval_cfg.output_dir


def recipe_pipeline(name: str) -> pipeline.Config:
    return parse_config(pipeline.Config, ["--config", str(RECIPES / name / "pipeline.yaml")])


def stage_configs(name: str) -> dict:
    """A recipe's ppo and eval configs as its stage files give them, or, where its pipeline names a task (a gym
    recipe: the stage files hold no prompt file or verifier), as its pipeline resolves them."""
    folder, cfg = RECIPES / name, recipe_pipeline(name)
    if cfg.task is not None:
        return {stage: pipeline.stage_config(cfg, stage) for stage in ("ppo", "eval")}
    return {
        "ppo": parse_config(Config, ["--config", str(folder / "ppo.yaml")]),
        "eval": parse_config(evaluate.Config, ["--config", str(folder / "eval.yaml")]),
    }


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_recipe_parses(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their files relative to the repo root
    if path.parent.name == SHARED:  # a shared stage file runs alone on its own task
        parse_config(CONFIGS[path.stem], ["--config", str(path)])
        return
    recipe = recipe_pipeline(path.parent.name)
    if path.stem != "pipeline" and recipe.task is not None:
        # a gym recipe's stage file: its task's files and verifier come from the pipeline
        assert getattr(recipe, f"{path.stem}_config") == str(path.relative_to(ROOT))
        pipeline.stage_config(recipe, path.stem)
        return
    cfg = parse_config({**CONFIGS, **OPTIONAL, **VARIANTS}[path.stem], ["--config", str(path)])
    if path.stem in ("pipeline", "smoke"):
        for stage in cfg.stages:  # each stage's recipe file through its Config, with the chaining keys
            pipeline.stage_config(cfg, stage)


@pytest.mark.parametrize(
    "path", sorted(RECIPES.glob("*/*/pipeline.yaml")), ids=lambda p: str(p.relative_to(RECIPES))
)
def test_every_sweep_variant_builds_its_stage_configs(path, monkeypatch):
    """A recipe's sub-pipeline (a sweep of estimators, losses, pass@k, a generalisation run): every variant's
    stages through their Configs, as `llm-rlhf pipeline` builds them before the first stage runs."""
    monkeypatch.chdir(ROOT)
    cfg = parse_config(pipeline.Config, ["--config", str(path)])
    runs = pipeline.sweep_runs(cfg) if cfg.sweep else [cfg]  # a sweep's shared SFT / RM run first
    names = {Path(run.output_dir).name for run in runs}
    assert {variant["name"] for variant in cfg.sweep or []} <= names
    for run in runs:
        for stage in run.stages:
            pipeline.stage_config(run, stage)


@pytest.mark.parametrize("name", CHAINED_RECIPES)
def test_the_stage_files_of_a_recipe_chain(name):
    """Run one stage at a time (no pipeline) and each still reads the previous stage's output folder."""
    folder = RECIPES / name
    cfg = {
        stage: parse_config(CONFIGS[stage], ["--config", str(folder / f"{stage}.yaml")]) for stage in CONFIGS
    }
    run = Path("runs") / name
    assert cfg["pipeline"].output_dir == str(run)
    assert [getattr(cfg["pipeline"], f"{s}_config") for s in ("sft", "rm", "ppo", "eval")] == [
        f"recipes/{name}/{s}.yaml" for s in ("sft", "rm", "ppo", "eval")
    ]
    assert [cfg[s].output_dir for s in ("sft", "rm", "ppo", "eval")] == [
        str(run / s) for s in ("sft", "rm", "ppo", "eval")
    ]
    assert cfg["rm"].model_name_or_path == cfg["ppo"].model_name_or_path == str(run / "sft")
    assert cfg["ppo"].reward_model_path == cfg["eval"].reward_model_path == str(run / "rm")
    assert (cfg["eval"].policy_path, cfg["eval"].baseline_path) == (str(run / "ppo"), str(run / "sft"))
    assert cfg["sft"].merge_lora, "RM and PPO read a plain HF folder; PPO's reference is the SFT model"
    for stage, config in OPTIONAL.items():
        if (folder / f"{stage}.yaml").is_file():
            optional = parse_config(config, ["--config", str(folder / f"{stage}.yaml")])
            chained = pipeline.chained_paths(run)[stage]
            assert {key: getattr(optional, key) for key in chained} == chained, stage
            assert getattr(cfg["pipeline"], f"{stage}_config") == f"recipes/{name}/{stage}.yaml"


@pytest.mark.parametrize("name", NAMES)
def test_ppo_and_eval_recipes_spell_out_the_same_generation_controls(name, monkeypatch):
    """Both files name stop_strings and min_new_tokens, and agree on them and on the sampling
    settings: the evaluation must sample from the distribution PPO trained, and end responses where it did."""
    import yaml

    monkeypatch.chdir(ROOT)
    keys = {"temperature", "top_k", "top_p", "stop_strings", "min_new_tokens"}
    recipe = recipe_pipeline(name)
    written = {
        stage: set(yaml.safe_load((ROOT / getattr(recipe, f"{stage}_config")).read_text()))
        for stage in ("ppo", "eval")
    }
    assert {"stop_strings", "min_new_tokens"} <= written["ppo"] & written["eval"]
    cfg = stage_configs(name)
    assert {k: getattr(cfg["ppo"], k) for k in keys} == {k: getattr(cfg["eval"], k) for k in keys}


def test_the_reviews_recipe_has_dpo_and_compare_stage_files():
    assert (RECIPES / "reviews" / "dpo.yaml").is_file() and (RECIPES / "reviews" / "compare.yaml").is_file()


def test_readme_commands_name_files_that_exist():
    readmes = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *(RECIPES / name / "README.md" for name in NAMES),
    ]
    text = "\n".join(readme.read_text() for readme in readmes)
    named = re.findall(r"--config (recipes/\S+?\.yaml)", text)
    named += re.findall(r"--config_file (\S+?\.yaml)", text)  # accelerate configs
    named = [
        path for path in named if not path.startswith("recipes/mine/")
    ]  # your-data.md's own copy (cp -r)
    assert len(named) >= 4 * 5
    assert [path for path in named if not (ROOT / path).is_file()] == []


# ---------------------------------------------------------------------------------------------------
# Running the stages on a tiny model
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hh_model_dir(tmp_path_factory) -> Path:
    """The tiny GPT-2 with room for the HH fixture's dialogues (up to ~120 tokens of the tiny tokenizer)."""
    return build_model(tmp_path_factory.mktemp("tiny_gpt2_128"), "gpt2", n_positions=128)


def run_stage(stage: str, recipe: str, values: dict) -> None:
    assert cli.main([stage, "--config", str(RECIPES / recipe / f"{stage}.yaml"), *flags(values)]) == 0


def assert_stage_outputs(out: Path) -> None:
    """The SFT, RM and PPO folders hold what the next stage (and plain transformers) loads."""
    from transformers import AutoModelForCausalLM

    from llm_rlhf.models.reward_model import load_reward_model, score_pairs

    sft_metrics, rm_metrics = read_json(out / "sft" / "metrics.json"), read_json(out / "rm" / "metrics.json")
    assert sft_metrics["global_step"] == 2 and rm_metrics["global_step"] == 2
    assert {"eval_loss", "eval_perplexity", "eos_rate"} <= sft_metrics.keys()
    assert {"eval_accuracy", "eval_margin", "score_mean", "score_std"} <= rm_metrics.keys()
    AutoModelForCausalLM.from_pretrained(out / "sft")
    scores = score_pairs(load_reward_model(out / "rm"), ["The film", "The film"], [" is great.", " is bad."])
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    ppo_lines = [json.loads(line) for line in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ppo_lines] == [1, 2]
    assert ppo_lines[0]["objective/kl"] == 0.0, "policy == reference (the SFT model) before the first update"
    ppo_metrics = read_json(out / "ppo" / "metrics.json")
    assert {"objective/scores", "objective/kl", "objective/kl_coef", "kl_last"} <= ppo_metrics.keys()
    policy = AutoModelForCausalLM.from_pretrained(out / "ppo")
    assert policy.config.vocab_size > 0 and (out / "ppo" / "value_head.safetensors").is_file()


@pytest.mark.parametrize("recipe", ["reviews", "gpt2-reviews"])
@pytest.mark.slow
def test_reviews_recipes_run_sft_rm_ppo(recipe, tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file):
    data = {"sft": sft_files[0], "prefs": pref_files[0], "prompts": prompt_file}
    overrides = tiny_overrides(tiny_model_dir, data, tmp_path, max_length=48)
    for stage in ("sft", "rm", "ppo"):
        run_stage(stage, recipe, overrides[stage])
    assert_stage_outputs(tmp_path)
    assert read_json(tmp_path / "ppo" / "metrics.json")["step"] == 2


@pytest.mark.slow
def test_gpt2_hh_recipe_runs_on_hh_rows(tmp_path, hh_model_dir, capsys):
    """SFT on the chosen dialogues, the RM on the pairs, PPO and eval on the dialogue prompts, all from the
    same HH rows; in every stage the recipe's skip_long leaves out (and counts) the dialogues that are too
    long for the tiny model's limits."""
    data = {"sft": HH_FIXTURE, "prefs": HH_FIXTURE, "prompts": HH_FIXTURE}
    overrides = tiny_overrides(hh_model_dir, data, tmp_path, max_length=128)
    overrides["sft"]["max_length"] = 64  # the 2-turn dialogues' prompts (77-88 tokens) do not fit
    overrides["rm"]["max_length"] = 72  # 1-turn prompts (36-44 tokens) fit, 3 of their pairs whole
    overrides["ppo"].update(max_prompt_length=64, log_samples_every=1)
    overrides["eval"]["max_prompt_length"] = 64
    del overrides["ppo"]["eval_prompt_file"]  # the recipe's: none (no gold judge for dialogues)
    run_stage("sft", "gpt2-hh", overrides["sft"])
    skipped = f"{HH_FIXTURE}: skipped 9 of 18 examples whose prompt is too long: max_length=64 leaves room"
    assert capsys.readouterr().out.count(skipped) == 2  # train_file and eval_file
    samples = [json.loads(line) for line in (tmp_path / "sft" / "samples.jsonl").read_text().splitlines()]
    assert all(
        s["prompt"].startswith("\n\nHuman:") and s["prompt"].endswith("\n\nAssistant:") for s in samples
    )
    run_stage("rm", "gpt2-hh", overrides["rm"])
    skipped = f"{HH_FIXTURE}: skipped 9 of 18 pairs whose prompt is too long: max_length=72 leaves room"
    assert capsys.readouterr().out.count(skipped) == 3  # train_file, eval_file and test_file
    rm_metrics = read_json(tmp_path / "rm" / "metrics.json")
    assert (rm_metrics["train_pairs"], rm_metrics["train_pairs_too_long"]) == (3, 6)
    assert rm_metrics["eval_pairs"] == rm_metrics["test_pairs"] == 9, "evaluated on every pair left"
    for stage in ("ppo", "eval"):
        run_stage(stage, "gpt2-hh", overrides[stage])
        skipped = (
            f"{HH_FIXTURE}: skipped 9 of 18 prompts that are too long: the limit is max_prompt_length=64"
        )
        assert capsys.readouterr().out.count(skipped) == 1, stage
    assert_stage_outputs(tmp_path)
    queries = [
        json.loads(line)["query"] for line in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()
    ]
    assert queries and all(q.endswith("\n\nAssistant:") and q.count("\n\nHuman:") == 1 for q in queries)
    assert read_json(tmp_path / "eval" / "metrics.json")["num_prompts"] == 4  # of the 9 left


@pytest.mark.slow
def test_reviews_lora_pipeline(tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, monkeypatch):
    """The pipeline command on the LoRA recipe: the SFT adapter is merged into a plain folder, the RM is an
    adapter on that merged model, PPO's adapter sits on it too (so its reference is the SFT model)."""
    from safetensors.torch import load_file

    data = {"sft": sft_files[0], "prefs": pref_files[0], "prompts": prompt_file}
    chained = pipeline.chained_paths(tmp_path)  # the folders the pipeline passes from stage to stage
    argv = [
        "pipeline",
        "--config",
        str(RECIPES / "reviews-lora" / "pipeline.yaml"),
        "--output_dir",
        str(tmp_path),
        "--report",
        "false",
    ]
    for stage, values in tiny_overrides(tiny_model_dir, data, tmp_path, max_length=48).items():
        own = {key: value for key, value in values.items() if key not in chained[stage]}
        argv.append(f"--{stage}={json.dumps(own, default=str)}")  # e.g. --sft={"max_steps": 2, ...}
    monkeypatch.chdir(ROOT)  # pipeline.yaml names the stage recipes relative to the repo root
    assert cli.main(argv) == 0

    assert read_json(tmp_path / "pipeline.json").keys() == {"sft", "rm", "ppo", "eval"}
    assert_stage_outputs(tmp_path)
    sft_dir, rm_dir, ppo_dir = tmp_path / "sft", tmp_path / "rm", tmp_path / "ppo"
    # SFT: LoRA trained and merged into a plain folder (no adapter files): the adapted layers moved, the
    # embeddings (no adapter) did not
    assert not (sft_dir / "adapter_config.json").exists()
    base, merged = load_file(tiny_model_dir / "model.safetensors"), load_file(sft_dir / "model.safetensors")
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert "transformer.h.0.attn.c_attn.weight" in changed and "transformer.wte.weight" not in changed
    # RM and PPO: adapters whose base is the merged SFT folder
    for adapter in (rm_dir, ppo_dir / "adapter"):
        config = read_json(adapter / "adapter_config.json")
        assert Path(config["base_model_name_or_path"]).resolve() == sft_dir.resolve(), adapter
        assert (adapter / "adapter_model.safetensors").is_file()
    assert (ppo_dir / "model.safetensors").is_file(), "the merged PPO policy, a plain HF folder"
    eval_metrics = read_json(tmp_path / "eval" / "metrics.json")
    assert {"rm_win_rate", "gold_win_rate", "kl_to_ref"} <= eval_metrics.keys()


@pytest.mark.slow
def test_smollm2_recipe_runs_on_a_tiny_llama(tmp_path, tiny_llama_dir, sft_files, pref_files, prompt_file):
    """The SmolLM2 recipe (LoRA in every stage, a Llama model, the fluency-aware gold) on a tiny Llama: the
    gold's fluency LM is the tiny Llama too, as SmolLM2 is both the base and the gold's LM in the recipe."""
    from llm_rlhf.models.gold import FLUENT_FORMAT

    data = {"sft": sft_files[0], "prefs": pref_files[0], "prompts": prompt_file}
    overrides = tiny_overrides(tiny_llama_dir, data, tmp_path, max_length=48)
    gold = tmp_path / "gold.json"
    gold.write_text(
        json.dumps(
            {
                "format": FLUENT_FORMAT,
                "sentiment_judge": str(SENTIMENT_JUDGE),
                "fluency_model": str(tiny_llama_dir),
                "end_text": "\n",
                "fluency_weight": 5.0,
                "reference_nll": 4.6,
            }
        )
    )
    overrides["ppo"]["gold_judge"] = overrides["eval"]["gold_judge"] = gold
    for stage in ("sft", "rm", "ppo"):  # the recipe's adapters sit in SmolLM2's last 10 of 30 blocks
        overrides[stage]["lora_layers"] = 1  # the tiny Llama's last of 2
    for stage in ("sft", "rm", "ppo", "eval"):
        run_stage(stage, "smollm2-reviews", overrides[stage])
    assert_stage_outputs(tmp_path)
    assert not (tmp_path / "rm" / "adapter_config.json").exists()  # merged: a plain folder for PPO and eval
    assert read_json(tmp_path / "rm" / "config.json")["num_hidden_layers"] == 2
    eval_metrics = read_json(tmp_path / "eval" / "metrics.json")
    for key in ("gold_win_rate", "sentiment_win_rate", "fluency_perplexity", "fluency_perplexity_baseline"):
        assert eval_metrics[key] is not None, key
    heldout = [json.loads(line) for line in (tmp_path / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    assert heldout and all(r["fluency_perplexity"] > 1 for r in heldout)


@pytest.mark.slow
def test_the_rule_recipe_runs_through_the_pipeline_on_a_tiny_chat_llama(tmp_path, monkeypatch):
    """`llm-rlhf pipeline --config recipes/smollm2-arithmetic/pipeline.yaml` with a tiny Llama (a chat template
    of its own) in place of SmolLM2, two steps and a few held-out problems: the committed arithmetic prompts
    are rendered and verified, the held-out evaluations and the eval stage report accuracy, and the eval
    baseline is the starting model (its KL to itself 0)."""

    monkeypatch.chdir(ROOT)
    model = tiny_chat_model(tmp_path / "tiny_chat_llama", TAGGED_CHAT_TEMPLATE, n_positions=160)
    out = tmp_path / "run"
    ppo_keys = {
        "model_name_or_path": str(model),
        "steps": 2,
        "rollout_batch_size": 2,
        "mini_batch_size": 4,
        "max_prompt_length": 128,
        "max_new_tokens": 4,
        "eval_every": 1,
        "eval_num_prompts": 3,
        "save_steps": 0,
        "log_samples_every": 0,
    }
    eval_keys = {"num_prompts": 3, "samples_per_prompt": 2, "max_prompt_length": 128, "max_new_tokens": 4}
    argv = [
        "--config",
        str(RECIPES / "smollm2-arithmetic" / "pipeline.yaml"),
        "--output_dir",
        str(out),
        "--ppo",
        json.dumps(ppo_keys),
        "--eval",
        json.dumps(eval_keys),
    ]
    pipeline.run(parse_config(pipeline.Config, argv))

    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["eval", "ppo", "report"]
    heldout = [json.loads(line) for line in (out / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in heldout] == [0, 1, 2]
    for record in heldout:
        assert 0.0 <= record["accuracy"] <= 1.0 and 0.0 <= record["accuracy_greedy"] <= 1.0
    metrics = read_json(out / "eval" / "metrics.json")
    assert metrics["baseline_path"] == str(model) and metrics["kl_to_ref_baseline"] == 0.0
    assert metrics["accuracy_fn"] == "llm_rlhf.tasks.arithmetic:reward" and metrics["num_pairs"] == 6
    for key in ("accuracy", "accuracy_greedy", "accuracy_baseline", "accuracy_greedy_baseline"):
        assert 0.0 <= metrics[key] <= 1.0, key
    assert (out / "report.html").is_file()


# --- the DAPO recipe ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_dapo_recipe_runs_on_a_tiny_chat_llama(tmp_path, monkeypatch):
    """recipes/smollm2-arithmetic/dapo.yaml (grpo with clip-higher 0.2/0.28, dynamic sampling, token-mean,
    overlong shaping, no KL) on a tiny Llama with a chat template, two steps on the committed arithmetic
    prompts: it parses through PPO's Config with the DAPO keys and runs."""

    from llm_rlhf.interfaces import cli

    monkeypatch.chdir(ROOT)
    recipe = ROOT / "recipes" / "smollm2-arithmetic" / "dapo.yaml"
    cfg = parse_config(Config, ["--config", str(recipe)])
    assert (cfg.advantage_estimator, cfg.cliprange_low, cfg.cliprange_high) == ("grpo", 0.2, 0.28)
    assert cfg.dynamic_sampling and cfg.loss_aggregation == "token_mean" and cfg.overlong_buffer > 0
    model = tiny_chat_model(tmp_path / "tiny_chat_llama", TAGGED_CHAT_TEMPLATE, n_positions=160)
    out = tmp_path / "dapo"
    keys = {
        "model_name_or_path": model,
        "output_dir": out,
        "steps": 2,
        "rollout_batch_size": 2,
        "mini_batch_size": 4,
        "max_prompt_length": 128,
        "max_new_tokens": 4,
        "overlong_buffer": 2,
        "eval_every": 0,
        "save_steps": 0,
        "log_samples_every": 0,
    }
    argv = ["ppo", "--config", str(recipe)] + [a for k, v in keys.items() for a in (f"--{k}", str(v))]
    assert cli.main(argv) == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(
        "sampling/rounds" in m and "objective/overlong_penalty" in m for m in metrics
    )
