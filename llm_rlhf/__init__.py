"""llm_rlhf: the classic RLHF pipeline (SFT -> reward model -> PPO) on Hugging Face libraries.

The Python API (`llm_rlhf.interfaces.api`): `SFTConfig`, `RMConfig`, `PPOConfig`, `EvalConfig`, `train_sft`,
`train_reward_model`, `train_ppo`, `run_eval`, `Trained`, `UserError` and `exit_process`. They are imported on
first use, so `import llm_rlhf` stays light (the stages import torch, transformers and TRL); `dir(llm_rlhf)`
lists them all the same, so a notebook's tab completion finds them.
"""

import importlib

__version__ = "0.1.0"

API = (
    "SFTConfig",
    "RMConfig",
    "PPOConfig",
    "EvalConfig",
    "train_sft",
    "train_reward_model",
    "train_ppo",
    "run_eval",
    "Trained",
    "UserError",
    "exit_process",
)
__all__ = list(API)


def __getattr__(name: str):
    if name in API:
        return getattr(importlib.import_module("llm_rlhf.interfaces.api"), name)
    raise AttributeError(f"module 'llm_rlhf' has no attribute '{name}'")


def __dir__() -> list[str]:
    """The module's own names and the lazy API (PEP 562), without `importlib`, which is no part of it."""
    return sorted({*globals(), *API} - {"importlib"})
