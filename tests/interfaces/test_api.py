"""The Python API (`llm_rlhf.interfaces.api`): the same code path as the commands, objects in place of paths,
one exception type with the command's message, on_step, the documented example (docs/getting-started/python-api.md). (A script of the API on two
processes: tests/multiprocess/test_stages_on_two_processes.py.)"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT, code_blocks, doc_section, preference_rows, read_jsonl, write_jsonl
from safetensors.torch import load_file

import llm_rlhf
from llm_rlhf.core.errors import ConfigError, DataError, UserError
from llm_rlhf.interfaces import cli
from llm_rlhf.models.loading import load_causal_lm, load_tokenizer

TINY_PPO = dict(
    steps=2,
    rollout_batch_size=4,
    mini_batch_size=2,
    ppo_epochs=1,
    max_new_tokens=6,
    save_steps=0,
    eval_every=0,
    log_samples_every=0,
    learning_rate=1e-3,
)


def error_line(capsys, argv: list[str]) -> str:
    """What `llm-rlhf ARGV` prints after `error: ` (exit code 2)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0].removeprefix("error: ")


def without_times(rows: list[dict]) -> list[dict]:
    """Every logged figure but the clock's (time/*, tokens_per_s)."""
    return [
        {k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_per_s"))} for row in rows
    ]


# --- the public names ------------------------------------------------------------------------------------


def test_public_names_are_the_stages():
    from llm_rlhf.ppo import config as ppo_config
    from llm_rlhf.stages import evaluate, reward, sft

    assert llm_rlhf.SFTConfig is sft.Config and llm_rlhf.RMConfig is reward.Config
    assert llm_rlhf.PPOConfig is ppo_config.Config and llm_rlhf.EvalConfig is evaluate.Config
    assert llm_rlhf.UserError is UserError
    assert set(cli.API.values()) <= set(llm_rlhf.__all__)
    with pytest.raises(AttributeError):
        llm_rlhf.train_dpo  # noqa: B018


@pytest.mark.parametrize("command", ["sft", "rm", "ppo", "eval"])
def test_the_command_calls_the_api_with_its_config(command, monkeypatch):
    from llm_rlhf.interfaces import api

    calls = []
    monkeypatch.setattr(api, cli.API[command], lambda cfg: calls.append(cfg))
    assert cli.main([command, "--seed", "7"]) == 0
    stage = importlib.import_module(cli.COMMANDS[command][0])
    assert len(calls) == 1 and type(calls[0]) is stage.Config and calls[0].seed == 7


# --- errors: one type, the command's line ----------------------------------------------------------------


def test_bad_key_and_value_raise_the_commands_message(capsys):
    with pytest.raises(ConfigError) as bad_value:
        llm_rlhf.PPOConfig(steps=0)
    assert str(bad_value.value) == error_line(capsys, ["ppo", "--steps", "0"])
    with pytest.raises(ConfigError) as bad_key:
        llm_rlhf.train_ppo({"stpes": 3})
    assert str(bad_key.value) == "config: unknown key 'stpes'; did you mean 'steps'?"
    assert (
        error_line(capsys, ["ppo", "--stpes", "3"])
        == "command line: unknown key 'stpes'; did you mean 'steps'?"
    )
    with pytest.raises(ConfigError, match=r"^config: 'max_steps' = 'four' is not a valid int$"):
        llm_rlhf.SFTConfig(max_steps="four")
    assert llm_rlhf.SFTConfig(learning_rate="1e-3").learning_rate == 1e-3  # converted as a YAML value is


def test_bad_data_row_raises_the_commands_message(tiny_model_dir, tmp_path, capsys):
    rows = [{"prompt": "the film"}, {"prompt": 7}]
    bad = write_jsonl(tmp_path / "prompts.jsonl", rows)
    keys = dict(
        model_name_or_path=str(tiny_model_dir),
        reward_model_path="none",
        reward_fn="reward_fns:length",
        output_dir=str(tmp_path / "out"),
        **TINY_PPO,
    )
    command = error_line(capsys, ["ppo", *[f"--{k}={v}" for k, v in keys.items()], "--prompt_file", str(bad)])
    with pytest.raises(DataError) as api:
        llm_rlhf.train_ppo(keys, prompts=rows)
    assert str(api.value) == command.replace(str(bad), "prompts")
    assert str(api.value).startswith("prompts, row 2, field 'prompt': ")
    assert not (tmp_path / "out").exists()  # stopped before anything was written


def test_a_broken_reward_function_stops_before_training(tiny_model_dir, tmp_path):
    name = "test_api:test_a_broken_reward_function_stops_before_training.locals.lambda"  # the lambda's own
    with pytest.raises(
        UserError, match=rf"^reward_fn '{name}' raised ZeroDivisionError: division by zero \(test_api"
    ):
        llm_rlhf.train_ppo(
            {**TINY_PPO, "reward_model_path": None, "output_dir": str(tmp_path / "out")},
            policy=str(tiny_model_dir),
            prompts=["the film", "a plot"],
            reward_fn=lambda prompts, responses: [1 / 0 for _ in responses],
        )
    assert not (tmp_path / "out").exists()


def test_a_model_in_another_dtype_is_a_config_error(tiny_model_dir, tmp_path):
    half = load_causal_lm(str(tiny_model_dir), dtype="bfloat16")
    with pytest.raises(
        ConfigError, match=r"^config key 'dtype': is float32 but the model's weights are bfloat16"
    ):
        llm_rlhf.train_sft(
            {"output_dir": str(tmp_path)}, model=half, tokenizer=load_tokenizer(str(tiny_model_dir))
        )


# --- objects in place of paths, on_step ---------------------------------------------------------------------


def test_ppo_with_objects_calls_on_step_once_per_step(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """A loaded policy, a reward model object and a lambda beside it, prompts as chat-free strings: the run
    logs and saves as the command does, and on_step sees each step's line of metrics.jsonl once."""
    from llm_rlhf.models.reward_model import load_reward_model

    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()]
    policy = load_causal_lm(str(tiny_model_dir))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    seen = []
    result = llm_rlhf.train_ppo(
        {**TINY_PPO, "output_dir": str(tmp_path / "ppo")},
        policy=policy,
        tokenizer=load_tokenizer(str(tiny_model_dir)),
        reward_model=[load_reward_model(tiny_rm_dir), load_reward_model(tiny_rm_dir)],
        reward_fn=lambda prompts, responses: [len(r) / 10 for r in responses],
        prompts=prompts,
        on_step=seen.append,
    )
    logged = read_jsonl(tmp_path / "ppo" / "metrics.jsonl")
    assert [m["step"] for m in seen] == [1, 2] and seen == logged
    assert "objective/scores_member_1" in logged[0] and "objective/reward_fn" in logged[0]
    assert result.model is policy  # trained in place
    assert any(not torch.equal(before[k], v.cpu()) for k, v in policy.state_dict().items())  # on its device
    head = load_file(tmp_path / "ppo" / "value_head.safetensors")
    assert all(torch.equal(head[k], v.cpu()) for k, v in result.value_head.state_dict().items())
    assert result.metrics == json.loads((tmp_path / "ppo" / "metrics.json").read_text())
    saved = (tmp_path / "ppo" / "config.yaml").read_text()
    assert (
        "reward_fn: test_api:test_ppo_with_objects_calls_on_step_once_per_step.locals.lambda" in saved
        and "model_name_or_path: <policy>" in saved
    )


def test_ppo_trains_the_adapter_of_a_peft_policy(tiny_model_dir, prompt_file, tmp_path):
    """A policy with a LoRA adapter: the adapter and the value head train, the base weights do not, and the
    reference is the policy as given (KL 0 at the first step)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"
    )
    policy = get_peft_model(load_causal_lm(str(tiny_model_dir)), lora)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    keys = {
        **TINY_PPO,
        "reward_model_path": None,
        "prompt_file": str(prompt_file),
        "output_dir": str(tmp_path / "p"),
    }
    tokenizer = load_tokenizer(str(tiny_model_dir))
    with pytest.raises(ConfigError, match=r"^config key 'use_lora': the policy already holds a peft adapter"):
        llm_rlhf.train_ppo(
            {**keys, "use_lora": True}, policy=policy, tokenizer=tokenizer, reward_fn="reward_fns:length"
        )
    result = llm_rlhf.train_ppo(keys, policy=policy, tokenizer=tokenizer, reward_fn="reward_fns:length")
    assert isinstance(result.model, PeftModel) and result.metrics["objective/kl"] != 0
    assert read_jsonl(tmp_path / "p" / "metrics.jsonl")[0]["objective/kl"] == 0.0
    changed = {k for k, v in policy.state_dict().items() if not torch.equal(before[k], v.cpu())}
    assert changed and all("lora_" in k for k in changed)
    assert {k for k in before if "lora_B" in k} <= changed


def test_sft_on_dicts_with_on_step(tiny_model_dir, tmp_path):
    rows = [
        {"prompt": "the film was", "completion": " good and fun"},
        {"prompt": "a plot", "completion": " that bored"},
    ]
    seen = []
    result = llm_rlhf.train_sft(
        {
            "output_dir": str(tmp_path / "sft"),
            "max_steps": 3,
            "per_device_train_batch_size": 2,
            "logging_steps": 1,
            "eval_steps": 0,
            "num_samples": 2,
            "max_new_tokens": 4,
            "max_length": 32,
        },
        model=str(tiny_model_dir),
        train_data=rows * 4,
        eval_data=rows,
        on_step=seen.append,
    )
    losses = [m for m in seen if "loss" in m]
    assert [m["step"] for m in losses] == [1, 2, 3]
    assert losses == [m for m in read_jsonl(tmp_path / "sft" / "log.jsonl") if "loss" in m]
    assert result.metrics["global_step"] == 3 and result.metrics["train_examples"] == 8
    with pytest.raises(DataError, match=r"^train_data, row 2, field 'completion': "):
        llm_rlhf.train_sft(
            {"output_dir": str(tmp_path / "bad")},
            model=str(tiny_model_dir),
            train_data=[rows[0], {"prompt": "x", "completion": None}],
        )


def test_reward_model_object_scores_as_its_folder(tiny_model_dir, prompt_file, tmp_path):
    """train_reward_model on a list of pairs (on_step with its log lines); run_eval with the returned object
    gives the metrics run_eval gives with the folder it saved, prompts given as a list of strings."""
    from helpers import SENTIMENT_JUDGE, preference_rows

    rows = preference_rows()
    seen = []
    rm = llm_rlhf.train_reward_model(
        {
            "model_name_or_path": str(tiny_model_dir),
            "output_dir": str(tmp_path / "rm"),
            "max_steps": 2,
            "per_device_train_batch_size": 4,
            "logging_steps": 1,
            "eval_steps": 0,
            "max_length": 48,
        },
        train_data=rows * 4,
        eval_data=rows,
        test_data=rows,
        on_step=seen.append,
    )
    assert [m["step"] for m in seen if "loss" in m] == [1, 2]
    assert rm.metrics["train_pairs"] == 4 * len(rows) and rm.metrics["test_pairs"] == len(rows)
    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()][:4]
    keys = dict(
        policy_path=str(tiny_model_dir),
        baseline_path=str(tiny_model_dir),
        gold_judge=SENTIMENT_JUDGE,
        num_prompts=4,
        max_new_tokens=6,
    )
    by_object = llm_rlhf.run_eval(
        {**keys, "output_dir": str(tmp_path / "a")}, reward_model=rm.model, prompts=prompts
    )
    by_folder = llm_rlhf.run_eval(
        {**keys, "output_dir": str(tmp_path / "b"), "reward_model_path": str(tmp_path / "rm")},
        prompts=prompts,
    )
    assert by_object["rm_score_mean"] is not None
    for key in ("rm_score_mean", "rm_win_rate", "gold_score_mean", "kl_to_ref"):
        assert by_object[key] == by_folder[key], key


# --- models as objects where the command takes folders: the same results -------------------------------------

TINY_RM = dict(
    max_steps=2, per_device_train_batch_size=4, logging_steps=1, eval_steps=0, max_length=48, test_file=None
)


def without_runtimes(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("runtime_s")}


def same_weights(folder_a: Path, folder_b: Path, name: str = "model.safetensors") -> bool:
    a, b = load_file(folder_a / name), load_file(folder_b / name)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def lora_policy(tiny_model_dir):
    """The tiny GPT-2 with a LoRA adapter whose B matrices are not zero, so merging it changes the weights."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"
    )
    torch.manual_seed(3)  # lora_A's initialisation: each call builds the same model
    model = get_peft_model(load_causal_lm(str(tiny_model_dir)), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["causal_lm", "peft", "use_lora", "reward_model"])
def test_reward_model_on_a_model_object_equals_its_folder(kind, tiny_model_dir, tiny_rm_dir, tmp_path):
    """train_reward_model(model=...) trains what model_name_or_path=<the folder of that model> trains: the same
    saved weights and metrics. A causal LM (the score head drawn as from the folder), a peft model (its adapter
    merged; the folder: the merged model saved), a new LoRA adapter on it (saved merged), a RewardModel trained
    further. The object given is left as it was."""
    from peft import PeftModel

    from llm_rlhf.models.reward_model import load_reward_model

    tokenizer = load_tokenizer(str(tiny_model_dir))
    keys, folder = dict(TINY_RM), tiny_model_dir
    if kind == "causal_lm":
        model = load_causal_lm(str(tiny_model_dir))
    elif kind == "peft":
        model = lora_policy(tiny_model_dir)
        folder = tmp_path / "merged"  # what `llm-rlhf sft --merge_lora true` would have saved
        copy = lora_policy(tiny_model_dir).merge_and_unload()
        copy.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    elif kind == "use_lora":
        model = load_causal_lm(str(tiny_model_dir))
        keys.update(use_lora=True, merge_lora=True, lora_target_modules=["c_attn"], learning_rate=1e-2)
    else:
        model, tokenizer, folder = load_reward_model(tiny_rm_dir), None, tiny_rm_dir
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = dict(train_data=preference_rows() * 4, eval_data=preference_rows())

    by_folder = llm_rlhf.train_reward_model(
        {**keys, "model_name_or_path": str(folder), "output_dir": str(tmp_path / "folder")}, **data
    )
    by_object = llm_rlhf.train_reward_model(
        {**keys, "output_dir": str(tmp_path / "object")}, model=model, tokenizer=tokenizer, **data
    )
    assert same_weights(tmp_path / "folder", tmp_path / "object")
    assert without_runtimes(by_object.metrics) == without_runtimes(by_folder.metrics)
    assert by_object.metrics["train_loss"] > 0 and by_object.metrics["global_step"] == 2
    trains_all = by_object.metrics["trainable_parameters"] == sum(
        p.numel() for p in by_object.model.parameters()
    )
    assert trains_all == (kind != "use_lora")  # with use_lora: the adapter and the score head
    scores = [
        r.model(*r.tokenizer(["The film is good"], return_tensors="pt").to(r.model.device).values())
        for r in (by_folder, by_object)
    ]
    assert torch.equal(*scores)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # trained a copy
    assert isinstance(model, PeftModel) == (kind == "peft")  # the caller's adapter is not merged away
    assert "model_name_or_path: <model>" in (tmp_path / "object" / "config.yaml").read_text()


def test_reward_model_object_with_an_unmerged_lora_is_a_config_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'merge_lora': a LoRA reward model on a model object"):
        llm_rlhf.train_reward_model(
            {**TINY_RM, "use_lora": True, "output_dir": str(tmp_path / "rm")},
            model=load_causal_lm(str(tiny_model_dir)),
            tokenizer=load_tokenizer(str(tiny_model_dir)),
            train_data=preference_rows(),
            eval_data=preference_rows(),
        )
    assert not (tmp_path / "rm").exists()


@pytest.fixture()
def eval_models(tiny_model_dir, tmp_path) -> tuple[Path, Path, Path]:
    """A policy, a baseline and a reference: three tiny GPT-2s of one tokenizer with different weights."""
    from helpers import build_model

    return tiny_model_dir, build_model(tmp_path / "baseline", seed=1), build_model(tmp_path / "ref", seed=2)


def eval_keys(policy: Path, prompt_file: Path) -> dict:
    from helpers import SENTIMENT_JUDGE

    return dict(
        policy_path=str(policy),
        reward_model_path=None,
        gold_judge=SENTIMENT_JUDGE,
        prompt_file=str(prompt_file),
        num_prompts=6,
        max_new_tokens=6,
        print_samples=0,
    )


def without_paths(metrics: dict) -> dict:
    """Every figure of an evaluation but its time and the model paths (folders or `<baseline>`)."""
    return {k: v for k, v in metrics.items() if k != "time_s" and not k.endswith("_path")}


def test_eval_baseline_and_reference_objects_equal_their_folders(eval_models, prompt_file, tmp_path):
    """run_eval(baseline=..., reference=...) gives the metrics of baseline_path / reference_path: the baseline
    with the policy's tokenizer or with its own (baseline_tokenizer); without a reference the baseline is it."""
    policy, baseline, ref = eval_models
    keys = eval_keys(policy, prompt_file)
    by_folder = llm_rlhf.run_eval(
        {
            **keys,
            "baseline_path": str(baseline),
            "reference_path": str(ref),
            "output_dir": str(tmp_path / "f"),
        }
    )
    by_objects = llm_rlhf.run_eval(
        {**keys, "output_dir": str(tmp_path / "o")},
        baseline=load_causal_lm(str(baseline)),
        reference=load_causal_lm(str(ref)),
    )
    own_tokenizer = llm_rlhf.run_eval(
        {**keys, "reference_path": str(ref), "output_dir": str(tmp_path / "t")},
        baseline=load_causal_lm(str(baseline)),
        baseline_tokenizer=load_tokenizer(str(baseline)),
    )
    assert 0 not in (
        by_folder["kl_to_ref"],
        by_folder["kl_to_ref_baseline"],
    )  # three models (k1: either sign)
    # the gold judged two different models (0.5 is a possible win rate of 6 prompts: on a GPU's draws it was)
    assert by_folder["gold_win_rate"] is not None
    assert by_folder["gold_score_mean"] != by_folder["gold_score_mean_baseline"]
    assert without_paths(by_objects) == without_paths(by_folder)
    assert without_paths(own_tokenizer) == without_paths(by_folder)
    assert (by_objects["baseline_path"], by_objects["reference_path"]) == ("<baseline>", "<reference>")
    assert read_jsonl(tmp_path / "o" / "samples.jsonl") == read_jsonl(tmp_path / "f" / "samples.jsonl")

    alone = llm_rlhf.run_eval(
        {**keys, "output_dir": str(tmp_path / "a")}, baseline=load_causal_lm(str(baseline))
    )
    assert alone["reference_path"] == "<baseline>" and alone["kl_to_ref_baseline"] == 0.0  # its own reference
    assert alone["gold_win_rate"] == by_folder["gold_win_rate"]


def test_eval_model_objects_that_cannot_read_the_policys_ids(eval_models, prompt_file, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    policy, _, _ = eval_models
    keys = {**eval_keys(policy, prompt_file), "output_dir": str(tmp_path / "e")}
    small = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=64, n_embd=8, n_layer=1, n_head=1))
    rows = len(load_tokenizer(str(policy)))
    with pytest.raises(
        UserError,
        match=rf"^baseline: its embeddings have 16 rows, fewer than the {rows} tokens "
        r"of the policy's tokenizer; give the baseline's own as baseline_tokenizer$",
    ):
        llm_rlhf.run_eval(keys, baseline=small)
    with pytest.raises(
        UserError, match=r"^reference: its embeddings have 16 rows.*needs a reference of the "
    ):
        llm_rlhf.run_eval({**keys, "baseline_path": str(policy)}, reference=small)
    with pytest.raises(UserError, match=r"^baseline_tokenizer: it goes with a baseline object"):
        llm_rlhf.run_eval(keys, baseline_tokenizer=load_tokenizer(str(policy)))
    assert not (tmp_path / "e").exists()


# --- a config.yaml of the Python API names its objects: the command says to replace them ---------------------


def test_a_saved_config_with_objects_runs_again_once_paths_replace_them(
    eval_models, prompt_file, tmp_path, capsys
):
    """An evaluation with a baseline object saves `baseline_path: <baseline>`: the command stops on it with one
    line naming the key (not "no such folder" from deep inside), so does the API without that object, and the
    API runs the saved config again with the object given again; a reward-model list names each member."""
    import yaml

    from llm_rlhf.core.config import parse_config

    policy, baseline, _ = eval_models
    first = llm_rlhf.run_eval(
        {**eval_keys(policy, prompt_file), "output_dir": str(tmp_path / "first")},
        baseline=load_causal_lm(str(baseline)),
    )
    capsys.readouterr()  # the evaluation's progress bars
    saved = tmp_path / "first" / "config.yaml"
    values = yaml.safe_load(saved.read_text())
    assert values["baseline_path"] == "<baseline>"
    held = (
        "which held a live object in the Python API (a config.yaml cannot store it); replace it with a path"
    )
    assert error_line(capsys, ["eval", "--config", str(saved)]) == (
        f"{saved}: 'baseline_path' is '<baseline>', {held}"
    )
    with pytest.raises(ConfigError) as api:
        llm_rlhf.run_eval(saved)
    assert str(api.value) == f"{saved}: 'baseline_path' is '<baseline>', {held}"
    values["output_dir"] = str(tmp_path / "again")
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(values))
    rerun = llm_rlhf.run_eval(again, baseline=load_causal_lm(str(baseline)))
    assert without_paths(rerun) == without_paths(first)
    argv = [
        "eval",
        "--config",
        str(saved),
        "--baseline_path",
        str(baseline),
        "--output_dir",
        str(tmp_path / "cli"),
    ]
    assert cli.main(argv) == 0
    assert without_paths(json.loads((tmp_path / "cli" / "metrics.json").read_text())) == without_paths(first)

    capsys.readouterr()
    ensemble = tmp_path / "ppo.yaml"
    ensemble.write_text(yaml.safe_dump({"reward_model_path": ["<reward_model 0>", "<reward_model 1>"]}))
    assert error_line(capsys, ["ppo", "--config", str(ensemble)]) == (
        f"{ensemble}: 'reward_model_path' is '<reward_model 0>', {held}"
    )
    stop = parse_config(llm_rlhf.EvalConfig, ["--stop_strings", '["<|im_end|>", "<end_of_turn>"]'])
    assert stop.stop_strings == ["<|im_end|>", "<end_of_turn>"]  # only path keys hold placeholders


# --- one code path: the command and the API give the same run ------------------------------------------------


def test_cli_and_api_give_the_same_ppo_run(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    keys = dict(
        model_name_or_path=str(tiny_model_dir),
        reward_model_path=str(tiny_rm_dir),
        prompt_file=str(prompt_file),
        **TINY_PPO,
    )
    argv = ["ppo", *[f"--{k}={v}" for k, v in keys.items()], "--output_dir", str(tmp_path / "cli")]
    assert cli.main(argv) == 0
    llm_rlhf.train_ppo({**keys, "output_dir": str(tmp_path / "api")})
    objects = dict(policy=load_causal_lm(str(tiny_model_dir)), tokenizer=load_tokenizer(str(tiny_model_dir)))
    llm_rlhf.train_ppo({**keys, "output_dir": str(tmp_path / "objects")}, **objects)
    runs = [tmp_path / name for name in ("cli", "api", "objects")]
    logs = [without_times(read_jsonl(run / "metrics.jsonl")) for run in runs]
    assert logs[0] == logs[1] == logs[2] and len(logs[0]) == 2
    for name in ("model.safetensors", "value_head.safetensors"):
        weights = [load_file(run / name) for run in runs]
        assert all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0]), name


# --- the documented example, two processes -----------------------------------------------------------------


def test_readme_example_runs(tiny_model_dir, tmp_path, monkeypatch):
    """docs/getting-started/python-api.md's example, as written, with the tiny GPT-2 for the repository's base
    model and the output folder in tmp_path."""
    (code,) = code_blocks(doc_section("getting-started/python-api.md"), "python")
    for path in ('"data/reviews/base_model"', '"runs/api"', '"data/reviews/gold_judge.json"'):
        assert path in code
    code = code.replace('"data/reviews/base_model"', repr(str(tiny_model_dir))).replace(
        '"runs/api"', repr(str(tmp_path / "api"))
    )
    monkeypatch.chdir(ROOT)  # data/reviews/gold_judge.json, as the page runs it from the repository root
    scope: dict = {}
    exec(compile(code, "python-api.md", "exec"), scope)
    assert (
        len(scope["scores"]) == 2 and scope["ppo"].value_head is not None and scope["grpo"].value_head is None
    )
    assert scope["metrics"] == json.loads((tmp_path / "api" / "eval" / "metrics.json").read_text())
    for stage in ("sft", "rm", "ppo", "grpo", "eval"):
        assert (tmp_path / "api" / stage / "metrics.json").is_file(), stage
    assert "advantage_estimator: grpo" in (tmp_path / "api" / "grpo" / "config.yaml").read_text()
    assert "reward_model_path: <reward_model>" in (tmp_path / "api" / "ppo" / "config.yaml").read_text()
    assert "model_name_or_path: <model>" in (tmp_path / "api" / "rm" / "config.yaml").read_text()
