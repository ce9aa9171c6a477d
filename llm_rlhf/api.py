"""The Python API: one function per stage for notebooks and scripts, on the code the `llm-rlhf` commands run.

    from llm_rlhf import PPOConfig, train_ppo
    result = train_ppo({"reward_model_path": None, "steps": 20}, policy=model, tokenizer=tokenizer,
                       reward_fn=lambda prompts, responses: [len(r) / 100 for r in responses],
                       prompts=["The film was", "I thought the plot"])
    result.model, result.value_head, result.metrics

| function             | config      | the command it is | objects it takes in place of config keys             |
|----------------------|-------------|-------------------|------------------------------------------------------|
| `train_sft`          | `SFTConfig` | `llm-rlhf sft`    | model + tokenizer, train_data, eval_data               |
| `train_reward_model` | `RMConfig`  | `llm-rlhf rm`     | train_data, eval_data, test_data                       |
| `train_ppo`          | `PPOConfig` | `llm-rlhf ppo`    | policy + tokenizer, reward_model (one or a list), reward_fn, prompts |
| `run_eval`           | `EvalConfig`| `llm-rlhf eval`   | policy + tokenizer, reward_model, reward_fn, prompts    |

`config` is a config object, a dict of its keys, or the path of a YAML recipe; the keys, their defaults and
their checks are the command's (`llm-rlhf <command> --help`). The command builds its config and calls the
same function (`llm_rlhf.cli`), so both give the same results. Each object stands in for the config key it
replaces, and the saved config.yaml names it: `<policy>`, `<train_data>`, a function as `module:name`. Data is a `datasets.Dataset` or a list of rows
(dicts in any schema the files accept; prompts also as plain strings or chat `messages` lists), checked
row by row as a file is. A path (a string) is accepted wherever an object is.

Every bad config key, value, path or data row raises `llm_rlhf.errors.UserError` (a `ConfigError` or
`DataError` for keys and rows) with the one line the command prints after `error:`. Training writes the
config's output_dir as the command does. `on_step(metrics)` sees each PPO step's metrics (the line of
metrics.jsonl) on the main process as it is logged; for SFT and the RM each log line of the Trainer
(every logging_steps). The functions return a `Trained` (model, tokenizer, value_head, metrics); `run_eval`
returns the metrics. (`run_eval`, not `evaluate`: `llm_rlhf.evaluate` is the module of the stage.)
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from llm_rlhf import evaluate, ppo, ppo_run, reward, sft
from llm_rlhf.config import config_from, load_yaml_config
from llm_rlhf.data import InMemory
from llm_rlhf.errors import ConfigError, UserError
from llm_rlhf.models import Trained
from llm_rlhf.reward_fn import RewardFn
from llm_rlhf.reward_model import RewardModel
from llm_rlhf.utils import use_cpu_ddp_without_gpus

SFTConfig = sft.Config
RMConfig = reward.Config
PPOConfig = ppo.Config
EvalConfig = evaluate.Config

__all__ = [
    "EvalConfig",
    "PPOConfig",
    "RMConfig",
    "SFTConfig",
    "Trained",
    "UserError",
    "run_eval",
    "train_ppo",
    "train_reward_model",
    "train_sft",
]


def train_sft(
    config: Any = None,
    *,
    model=None,
    tokenizer=None,
    train_data=None,
    eval_data=None,
    on_step: Callable[[dict], Any] | None = None,
) -> Trained:
    """`llm-rlhf sft`: model (trained in place) and its tokenizer in place of model_name_or_path; train_data,
    eval_data (prompt/completion dicts, chat `messages` rows, `text` rows) in place of train_file, eval_file.
    Returns the model as saved (merged with merge_lora), its tokenizer and metrics.json's figures."""
    use_cpu_ddp_without_gpus()  # under `accelerate launch` on CPUs: one DDP run, as the command
    keys, model = _model_key("model_name_or_path", "model", model)
    keys, train_data = _data_key(keys, "train_file", "train_data", train_data)
    keys, eval_data = _data_key(keys, "eval_file", "eval_data", eval_data)
    cfg = _config(SFTConfig, config, keys)
    _check_dtype(cfg, model, "model")
    return sft.train(
        cfg,
        model=model,
        tokenizer=tokenizer,
        train_data=train_data,
        eval_data=eval_data,
        callbacks=_log_callbacks(on_step),
    )


def train_reward_model(
    config: Any = None,
    *,
    train_data=None,
    eval_data=None,
    test_data=None,
    on_step: Callable[[dict], Any] | None = None,
) -> Trained:
    """`llm-rlhf rm`: preference pairs (prompt/chosen/rejected dicts, chosen/rejected dialogues, prompt +
    ranked) in place of train_file, eval_file, test_file. Returns the normalised `RewardModel` (what
    `train_ppo(reward_model=...)` takes), its tokenizer and metrics.json's figures."""
    use_cpu_ddp_without_gpus()  # under `accelerate launch` on CPUs: one DDP run, as the command
    keys, train_data = _data_key({}, "train_file", "train_data", train_data)
    keys, eval_data = _data_key(keys, "eval_file", "eval_data", eval_data)
    keys, test_data = _data_key(keys, "test_file", "test_data", test_data)
    cfg = _config(RMConfig, config, keys)
    return reward.train(
        cfg,
        train_data=train_data,
        eval_data=eval_data,
        test_data=test_data,
        callbacks=_log_callbacks(on_step),
    )


def train_ppo(
    config: Any = None,
    *,
    policy=None,
    tokenizer=None,
    reward_model=None,
    reward_fn=None,
    prompts=None,
    on_step: Callable[[dict], Any] | None = None,
) -> Trained:
    """`llm-rlhf ppo`: policy (a causal LM, trained in place; the reference is a frozen copy of it as given)
    and its tokenizer in place of model_name_or_path; reward_model (a `RewardModel` or a list: an ensemble)
    in place of reward_model_path; reward_fn, any callable (prompts, responses) -> list[float] (a lambda
    works), in place of the config's reward_fn; prompts (strings, chat `messages` lists, dicts, a Dataset)
    in place of prompt_file. Returns the policy's LM, its tokenizer, its value head (None without one) and
    metrics.json's figures."""
    use_cpu_ddp_without_gpus()  # under `accelerate launch` on CPUs: one DDP run, as the command
    keys, policy = _model_key("model_name_or_path", "policy", policy)
    keys, reward_model = _reward_model_key(keys, reward_model)
    keys, reward_fn = _reward_fn_key(keys, reward_fn)
    keys, prompts = _data_key(keys, "prompt_file", "prompts", prompts)
    cfg = _config(PPOConfig, config, keys)
    _check_dtype(cfg, policy, "policy")
    if reward_model is not None and cfg.value_model == "reward":
        raise ConfigError(
            "config key 'value_model': 'reward' loads the critic from reward_model_path; give the reward "
            "model as a folder there, not as an object"
        )
    return ppo_run.train(
        cfg,
        policy=policy,
        tokenizer=tokenizer,
        reward_model=reward_model,
        reward_fn=reward_fn,
        prompts=prompts,
        on_step=on_step,
    )


def run_eval(
    config: Any = None, *, policy=None, tokenizer=None, reward_model=None, reward_fn=None, prompts=None
) -> dict[str, Any] | None:
    """`llm-rlhf eval`: policy and its tokenizer in place of policy_path (the baseline and the reference are
    the config's folders), reward_model, reward_fn and prompts as in `train_ppo`. Returns metrics.json's
    figures (None on all but the main process)."""
    use_cpu_ddp_without_gpus()  # under `accelerate launch` on CPUs: one DDP run, as the command
    keys, policy = _model_key("policy_path", "policy", policy)
    keys, reward_model = _reward_model_key(keys, reward_model)
    keys, reward_fn = _reward_fn_key(keys, reward_fn)
    keys, prompts = _data_key(keys, "prompt_file", "prompts", prompts)
    cfg = _config(EvalConfig, config, keys)
    _check_dtype(cfg, policy, "policy")
    return evaluate.run(
        cfg,
        policy=policy,
        tokenizer=tokenizer,
        reward_model=reward_model,
        reward_fn=reward_fn,
        prompts=prompts,
    )


# ---------------------------------------------------------------------------------------------------
# Objects in place of config keys
# ---------------------------------------------------------------------------------------------------


def _config(cls: type, config: Any, keys: dict[str, Any]):
    """`config` (an object, a dict or a YAML path) with `keys` (what the objects stand in for) set, checked as
    the command checks it. Keys are set before the checks run, so a config that is whole only with its
    objects (no reward_model_path, a reward_fn object) passes."""
    if config is None:
        config = {}
    if isinstance(config, (str, os.PathLike)):
        config = load_yaml_config(config, [f.name for f in dataclasses.fields(cls)])
    if not keys:
        return config_from(cls, config)
    if isinstance(config, cls):
        return dataclasses.replace(config, **keys)
    if isinstance(config, dict):
        return cls(**{**config, **keys})
    return config_from(cls, config)  # the one error for any other type


def _model_key(key: str, name: str, model) -> tuple[dict[str, Any], Any]:
    """A model object is named `<name>` (the argument) in the config: the folder it was loaded from need not
    hold the weights it has now (a model train_sft returned)."""
    if model is None:
        return {}, None
    if isinstance(model, (str, os.PathLike)):
        return {key: os.fspath(model)}, None
    return {key: f"<{name}>"}, model


def _check_dtype(cfg, model, name: str) -> None:
    """A model object's weights in the config's dtype: the command loads them so, and transformers loads a
    folder in the dtype its config.json names (float16 for some), which does not train on a CPU."""
    if model is None:
        return
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dtype != cfg.dtype:
        raise ConfigError(
            f"config key 'dtype': is {cfg.dtype} but the {name}'s weights are {dtype}; load it with "
            f"dtype=torch.{cfg.dtype} or set dtype: {dtype}"
        )


def _data_key(keys: dict[str, Any], key: str, name: str, data) -> tuple[dict[str, Any], InMemory | None]:
    if data is None:
        return keys, None
    if isinstance(data, (str, os.PathLike)):
        return {**keys, key: os.fspath(data)}, None
    return {**keys, key: f"<{name}>"}, InMemory(name, data)


def _reward_model_key(keys: dict[str, Any], reward_model) -> tuple[dict[str, Any], Any]:
    """One `RewardModel` or a list of them (an ensemble); folders (strings) set reward_model_path."""
    if reward_model is None:
        return keys, None
    members = reward_model if isinstance(reward_model, (list, tuple)) else [reward_model]
    if all(isinstance(m, (str, os.PathLike)) for m in members):
        paths = [os.fspath(m) for m in members]
        return {
            **keys,
            "reward_model_path": paths if isinstance(reward_model, (list, tuple)) else paths[0],
        }, None
    for m in members:
        if not isinstance(m, RewardModel):
            raise UserError(
                f"reward_model: expected a RewardModel (what train_reward_model returns) or a list of them, "
                f"got {type(m).__name__}"
            )
    if isinstance(reward_model, (list, tuple)):
        names = [f"<reward_model {k}>" for k in range(len(members))]
        return {**keys, "reward_model_path": names}, list(members)
    return {**keys, "reward_model_path": "<reward_model>"}, reward_model


def _reward_fn_key(keys: dict[str, Any], fn) -> tuple[dict[str, Any], RewardFn | None]:
    """A callable as the config's reward_fn: named `module:qualified_name` (a lambda `module:lambda`), the
    name its errors and the saved config give; a string is a spec as the command takes it."""
    if fn is None:
        return keys, None
    if isinstance(fn, str):
        return {**keys, "reward_fn": fn}, None
    if not callable(fn):
        raise UserError(
            f"reward_fn: expected a callable (prompts, responses) -> list[float], got {type(fn).__name__}"
        )
    if isinstance(fn, RewardFn):
        return {**keys, "reward_fn": fn.spec}, fn
    name = re.sub(r"[^\w.]", "", getattr(fn, "__qualname__", type(fn).__qualname__))  # <lambda> -> lambda
    spec = f"{getattr(fn, '__module__', None) or 'python'}:{name}"
    return {**keys, "reward_fn": spec}, RewardFn(fn, spec)


class _OnLog(TrainerCallback):
    """on_step(metrics) with each log line of a Trainer (the line of log.jsonl), on the main process."""

    def __init__(self, on_step: Callable[[dict], Any]):
        self.on_step = on_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.on_step({"step": state.global_step, "epoch": state.epoch, **logs})


def _log_callbacks(on_step: Callable[[dict], Any] | None) -> list[TrainerCallback]:
    return [_OnLog(on_step)] if on_step is not None else []
