"""The Python API: one function per stage for notebooks and scripts, on the code the `llm-rlhf` commands run.

    from llm_rlhf import PPOConfig, train_ppo
    result = train_ppo({"reward_model_path": None, "steps": 20}, policy=model, tokenizer=tokenizer,
                       reward_fn=lambda prompts, responses: [len(r) / 100 for r in responses],
                       prompts=["The film was", "I thought the plot"])
    result.model, result.value_head, result.metrics

| function             | config      | the command it is | objects it takes in place of config keys             |
|----------------------|-------------|-------------------|------------------------------------------------------|
| `train_sft`          | `SFTConfig` | `llm-rlhf sft`    | model + tokenizer, train_data, eval_data               |
| `train_reward_model` | `RMConfig`  | `llm-rlhf rm`     | model (a causal LM or a `RewardModel`) + tokenizer, train_data, eval_data, test_data |
| `train_ppo`          | `PPOConfig` | `llm-rlhf ppo`    | policy + tokenizer, reward_model (one or a list), reward_fn, prompts |
| `run_eval`           | `EvalConfig`| `llm-rlhf eval`   | policy + tokenizer, baseline (+ baseline_tokenizer), reference, reward_model, reward_fn, prompts |

`config` is a config object, a dict of its keys, or the path of a YAML recipe; the keys, their defaults and
their checks are the command's (`llm-rlhf <command> --help`). The command builds its config and calls the
same function (`llm_rlhf.interfaces.cli`), so both give the same results. Each object stands in for the config key it
replaces, and the saved config.yaml names it: `<policy>`, `<train_data>`, a function as `module:name`. Such a
config runs again once a path replaces each `<...>` (until then the command, or a function not given that
object, stops with a ConfigError naming the key). Data is a `datasets.Dataset` or a list of rows
(dicts in any schema the files accept; prompts also as plain strings or chat `messages` lists), checked
row by row as a file is. A path (a string) is accepted wherever an object is. `train_sft` and `train_ppo`
train the model they are given in place; `train_reward_model` builds the reward model on a copy of its
weights (a peft model's adapter merged in); `run_eval` samples its models in eval mode.

Every bad config key, value, path or data row raises `llm_rlhf.core.errors.UserError` (a `ConfigError` or
`DataError` for keys and rows) with the one line the command prints after `error:`. Training writes the
config's output_dir as the command does. `on_step(metrics)` sees each PPO step's metrics (the line of
metrics.jsonl) on the main process as it is logged; for SFT and the RM each log line of the Trainer
(every logging_steps). The functions return a `Trained` (model, tokenizer, value_head, metrics); `run_eval`
returns the metrics. (`run_eval`, not `evaluate`: `llm_rlhf.stages.evaluate` is the module of the stage.)
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

from peft import PeftModel
from transformers import TrainerCallback

from llm_rlhf.core.config import check_not_placeholder, config_from, load_yaml_config, placeholder
from llm_rlhf.core.data import InMemory
from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.core.utils import (
    exit_process,  # public: the end of a script under accelerate launch (docs/getting-started/python-api.md)
    use_cpu_ddp_without_gpus,
)
from llm_rlhf.models.loading import Trained
from llm_rlhf.models.reward_fn import RewardFn
from llm_rlhf.models.reward_model import RewardModel
from llm_rlhf.ppo import config as ppo_config
from llm_rlhf.stages import evaluate, ppo, reward, sft

SFTConfig = sft.Config
RMConfig = reward.Config
PPOConfig = ppo_config.Config
EvalConfig = evaluate.Config

MODELS = ("model", "policy", "baseline", "reference")  # the arguments that take a model (or its folder)

__all__ = [
    "EvalConfig",
    "PPOConfig",
    "RMConfig",
    "SFTConfig",
    "Trained",
    "UserError",
    "exit_process",
    "run_eval",
    "train_ppo",
    "train_reward_model",
    "train_sft",
]


def train_sft(
    config=None, *, model=None, tokenizer=None, train_data=None, eval_data=None, on_step=None
) -> Trained:
    """`llm-rlhf sft`: model (trained in place) and its tokenizer in place of model_name_or_path; train_data,
    eval_data (prompt/completion dicts, chat `messages` rows, `text` rows) in place of train_file, eval_file.
    Returns the model as saved (merged with merge_lora), its tokenizer and metrics.json's figures."""
    places = {"model": "model_name_or_path", "train_data": "train_file", "eval_data": "eval_file"}
    cfg, objects = _in_place_of(
        SFTConfig, config, places, model=model, train_data=train_data, eval_data=eval_data
    )
    _check_one_adapter(cfg, objects["model"], "model")
    return sft.train(cfg, tokenizer=tokenizer, callbacks=_log_callbacks(on_step), **objects)


def train_reward_model(
    config=None, *, model=None, tokenizer=None, train_data=None, eval_data=None, test_data=None, on_step=None
) -> Trained:
    """`llm-rlhf rm`: model, a causal LM (a peft model: its adapter merged, as `llm-rlhf rm` needs the SFT
    folder merged) or a `RewardModel` to train further, and its tokenizer (a `RewardModel`'s own by default)
    in place of model_name_or_path; the reward model is built on a copy of its weights, so `model` stays as it
    is. Preference pairs (prompt/chosen/rejected dicts, chosen/rejected dialogues, prompt + ranked) in place of
    train_file, eval_file, test_file. Returns the normalised `RewardModel` (what `train_ppo(reward_model=...)`
    takes), its tokenizer and metrics.json's figures."""
    places = {
        "model": "model_name_or_path",
        "train_data": "train_file",
        "eval_data": "eval_file",
        "test_data": "test_file",
    }
    arguments = dict(model=model, train_data=train_data, eval_data=eval_data, test_data=test_data)
    cfg, objects = _in_place_of(RMConfig, config, places, **arguments)
    if objects["model"] is not None and cfg.use_lora and not cfg.merge_lora:
        raise ConfigError(
            "config key 'merge_lora': a LoRA reward model on a model object must be saved merged (an adapter "
            "folder names the folder of its base model, and the object has none); set merge_lora: true"
        )
    return reward.train(cfg, tokenizer=tokenizer, callbacks=_log_callbacks(on_step), **objects)


def train_ppo(
    config=None, *, policy=None, tokenizer=None, reward_model=None, reward_fn=None, prompts=None, on_step=None
) -> Trained:
    """`llm-rlhf ppo`: policy (a causal LM, trained in place; the reference is a frozen copy of it as given)
    and its tokenizer in place of model_name_or_path; reward_model (a `RewardModel` or a list: an ensemble)
    in place of reward_model_path; reward_fn, any callable (prompts, responses) -> list[float] (a lambda
    works), in place of the config's reward_fn; prompts (strings, chat `messages` lists, dicts, a Dataset)
    in place of prompt_file. Returns the policy's LM, its tokenizer, its value head (None without one) and
    metrics.json's figures: the last step's policy, or with keep_best the best held-out evaluation's weights
    loaded into it (metrics' returned_step; `llm_rlhf.stages.ppo`)."""
    cfg, objects = _policy_and_scorer(
        PPOConfig, config, "model_name_or_path", policy, reward_model, reward_fn, prompts
    )
    _check_one_adapter(cfg, objects["policy"], "policy")
    if objects["reward_model"] is not None and cfg.value_model == "reward":
        raise ConfigError(
            "config key 'value_model': 'reward' loads the critic from reward_model_path; give the reward "
            "model as a folder there, not as an object"
        )
    return ppo.train(cfg, tokenizer=tokenizer, on_step=on_step, **objects)


def run_eval(config=None, **objects: Any) -> dict[str, Any] | None:
    """`llm-rlhf eval`: causal LMs in place of folders, by keyword (`evaluate.EvalObjects`' fields; any other
    name is a TypeError): policy and its tokenizer (policy_path), baseline (baseline_path) with
    baseline_tokenizer (default: the policy's, for a baseline of the policy's vocabulary, as an SFT model and
    its PPO policy are), reference (reference_path; it shares the policy's tokenizer, as kl_to_ref needs);
    without a reference the baseline is the reference, as without reference_path. They are sampled in eval
    mode and otherwise left as they are. reward_model, reward_fn and prompts as in `train_ppo`. Returns
    metrics.json's figures (None on all but the main process)."""
    given = evaluate.EvalObjects(**objects)  # the keywords checked by name, as a signature would
    baseline = given.baseline
    if given.baseline_tokenizer is not None and (
        baseline is None or isinstance(baseline, (str, os.PathLike))
    ):
        raise UserError(
            "baseline_tokenizer: it goes with a baseline object (a folder holds its own tokenizer)"
        )
    cfg, models = _policy_and_scorer(
        EvalConfig,
        config,
        "policy_path",
        given.policy,
        given.reward_model,
        given.reward_fn,
        given.prompts,
        baseline=("baseline_path", baseline),
        reference=("reference_path", given.reference),
    )
    return evaluate.run(cfg, tokenizer=given.tokenizer, baseline_tokenizer=given.baseline_tokenizer, **models)


# ---------------------------------------------------------------------------------------------------
# Objects in place of config keys
# ---------------------------------------------------------------------------------------------------


def _policy_and_scorer(cls, config, policy_key: str, policy, reward_model, reward_fn, prompts, **models):
    """`_in_place_of` for PPO and evaluation: a policy sampled on prompts, scored by RMs and a function.
    models: more models, name=(config key, model) (evaluation's baseline and reference)."""
    places = {
        "policy": policy_key,
        "reward_model": "reward_model_path",
        "reward_fn": "reward_fn",
        "prompts": "prompt_file",
    }
    places.update({name: key for name, (key, _) in models.items()})
    arguments = dict(policy=policy, reward_model=reward_model, reward_fn=reward_fn, prompts=prompts)
    arguments.update({name: model for name, (_, model) in models.items()})
    return _in_place_of(cls, config, places, **arguments)


def _in_place_of(
    cls: type, config: Any, places: dict[str, str], **arguments: Any
) -> tuple[Any, dict[str, Any]]:
    """The config (`_config`) with each argument given set in the config key `places` names for it, and the
    objects for the stage's `train` (None for an argument given as a path, or not given)."""
    use_cpu_ddp_without_gpus()  # under `accelerate launch` on CPUs: one DDP run, as the command sets up
    keys, objects = {}, {}
    for name, value in arguments.items():
        if name in MODELS:
            described, objects[name] = _model_key(places[name], name, value)
        elif name == "reward_model":
            described, objects[name] = _reward_model_key(value)
        elif name == "reward_fn":
            described, objects[name] = _reward_fn_key(value)
        else:
            described, objects[name] = _data_key(places[name], name, value)
        keys.update(described)
    cfg = _config(cls, config, keys)
    for name in MODELS:
        _check_dtype(cfg, objects.get(name), name)
    return cfg, objects


def _config(cls: type, config: Any, keys: dict[str, Any]):
    """`config` (an object, a dict or a YAML path) with `keys` (what the objects stand in for) set, checked as
    the command checks it. Keys are set before the checks run, so a config that is whole only with its
    objects (no reward_model_path, a reward_fn object) passes."""
    if config is None:
        config = {}
    where = os.fspath(config) if isinstance(config, (str, os.PathLike)) else "config"
    if isinstance(config, (str, os.PathLike)):
        config = load_yaml_config(config, [f.name for f in dataclasses.fields(cls)])
    if not keys:
        cfg = config_from(cls, config)
    elif isinstance(config, cls):
        cfg = dataclasses.replace(config, **keys)
    elif isinstance(config, dict):
        cfg = cls(**{**config, **keys})
    else:
        cfg = config_from(cls, config)  # the one error for any other type
    for field in dataclasses.fields(cls):  # a saved config.yaml run again: its objects must be given again
        if field.name not in keys:
            check_not_placeholder(field.name, getattr(cfg, field.name), where)
    return cfg


def _model_key(key: str, name: str, model) -> tuple[dict[str, Any], Any]:
    """A model object is named `<name>` (the argument) in the config: the folder it was loaded from need not
    hold the weights it has now (a model train_sft returned)."""
    if model is None:
        return {}, None
    if isinstance(model, (str, os.PathLike)):
        return {key: os.fspath(model)}, None
    return {key: placeholder(name)}, model


def _check_one_adapter(cfg, model, name: str) -> None:
    """A peft model trains its own adapter (PPO's reference: the model without it), so use_lora, a new
    adapter, does not apply. (The reward model merges one: `train_reward_model`.)"""
    if isinstance(model, PeftModel) and cfg.use_lora:
        raise ConfigError(
            f"config key 'use_lora': the {name} already holds a peft adapter, which is trained as it is; "
            "set use_lora: false"
        )


def _check_dtype(cfg, model, name: str) -> None:
    """A model object's weights in the config's dtype: the command loads its folders so (transformers would
    load a folder in the dtype its config.json names, float16 for some, which does not train on a CPU), and an
    object must give what its folder gives."""
    if model is None:
        return
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dtype != cfg.dtype:
        raise ConfigError(
            f"config key 'dtype': is {cfg.dtype} but the {name}'s weights are {dtype}; load it with "
            f"dtype=torch.{cfg.dtype} or set dtype: {dtype}"
        )


def _data_key(key: str, name: str, data) -> tuple[dict[str, Any], InMemory | None]:
    if data is None:
        return {}, None
    if isinstance(data, (str, os.PathLike)):
        return {key: os.fspath(data)}, None
    return {key: f"<{name}>"}, InMemory(name, data)


def _reward_model_key(reward_model) -> tuple[dict[str, Any], Any]:
    """One `RewardModel` or a list of them (an ensemble); folders (strings) set reward_model_path."""
    if reward_model is None:
        return {}, None
    members = reward_model if isinstance(reward_model, (list, tuple)) else [reward_model]
    if all(isinstance(m, (str, os.PathLike)) for m in members):
        paths = [os.fspath(m) for m in members]
        return {"reward_model_path": paths if isinstance(reward_model, (list, tuple)) else paths[0]}, None
    for m in members:
        if not isinstance(m, RewardModel):
            raise UserError(
                f"reward_model: expected a RewardModel (what train_reward_model returns) or a list of them, "
                f"got {type(m).__name__}"
            )
    if isinstance(reward_model, (list, tuple)):
        names = [placeholder(f"reward_model {k}") for k in range(len(members))]
        return {"reward_model_path": names}, list(members)
    return {"reward_model_path": placeholder("reward_model")}, reward_model


def _reward_fn_key(fn) -> tuple[dict[str, Any], RewardFn | None]:
    """A callable as the config's reward_fn: named `module:qualified_name` (a lambda `module:lambda`), the
    name its errors and the saved config give; a string is read as the command reads the key."""
    if fn is None:
        return {}, None
    if isinstance(fn, str):
        return {"reward_fn": fn}, None
    if not callable(fn):
        raise UserError(
            f"reward_fn: expected a callable (prompts, responses) -> list[float], got {type(fn).__name__}"
        )
    if isinstance(fn, RewardFn):
        return {"reward_fn": fn.spec}, fn
    name = re.sub(r"[^\w.]", "", getattr(fn, "__qualname__", type(fn).__qualname__))  # <lambda> -> lambda
    spec = f"{getattr(fn, '__module__', None) or 'python'}:{name}"
    return {"reward_fn": spec}, RewardFn(fn, spec)


class _OnLog(TrainerCallback):
    """on_step(metrics) with each log line of a Trainer (the line of log.jsonl), on the main process."""

    def __init__(self, on_step: Callable[[dict], Any]):
        self.on_step = on_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.on_step({"step": state.global_step, "epoch": state.epoch, **logs})


def _log_callbacks(on_step: Callable[[dict], Any] | None) -> list[TrainerCallback]:
    return [_OnLog(on_step)] if on_step is not None else []
