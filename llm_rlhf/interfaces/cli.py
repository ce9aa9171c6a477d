"""`llm-rlhf <command> [--config recipe.yaml] [--key value ...]`: one subcommand per stage.

Every stage module exposes `Config` (a flat dataclass) and `run(cfg)`, and is imported only when its
command runs (the stages import torch, transformers and TRL). The commands of the Python API (`API`: sft,
rm, ppo, eval) build the config and call its function (`llm_rlhf.interfaces.api`), so a script and the command run
one code path. Bad input (config, data,
paths) ends with one line `error: ...` on stderr and exit code 2, before any output is written.
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

from llm_rlhf.core.config import format_help, parse_config
from llm_rlhf.core.errors import UserError
from llm_rlhf.core.utils import exit_process, use_cpu_ddp_without_gpus

COMMANDS = {
    "sft": (
        "llm_rlhf.stages.sft",
        "Supervised fine-tuning: next-token loss on the completion tokens only (EOS included).",
    ),
    "rm": (
        "llm_rlhf.stages.reward",
        "Reward model: a scalar head on the causal LM trained with the Bradley-Terry loss.",
    ),
    "dpo": (
        "llm_rlhf.stages.dpo",
        "DPO: the SFT model trained directly on the preference pairs (no RM, no PPO), TRL's DPOTrainer.",
    ),
    "score": ("llm_rlhf.stages.score", "Score a JSONL of prompt/response pairs with a saved reward model."),
    "ppo": (
        "llm_rlhf.stages.ppo",
        "PPO with a value head, a frozen reference and an adaptive KL controller.",
    ),
    "eval": (
        "llm_rlhf.stages.evaluate",
        "Compare a policy with a baseline on held-out prompts (RM, gold judge, KL).",
    ),
    "judge": (
        "llm_rlhf.stages.judge",
        "Score prompt/response rows with the gold evaluation (sentiment and fluency).",
    ),
    "compare": (
        "llm_rlhf.stages.compare",
        "PPO, DPO (a beta sweep) and best-of-n on one gold-vs-KL plot, with Gao et al.'s laws fitted.",
    ),
    "pipeline": (
        "llm_rlhf.interfaces.pipeline",
        "SFT -> RM -> PPO -> evaluation, each stage reading the previous output.",
    ),
    "report": (
        "llm_rlhf.interfaces.report",
        "Rebuild report.html of a pipeline run from its logs: llm-rlhf report DIR.",
    ),
}


API = {"sft": "train_sft", "rm": "train_reward_model", "ppo": "train_ppo", "eval": "run_eval"}


def usage() -> str:
    available = {name: (mod, text) for name, (mod, text) in COMMANDS.items() if importlib.util.find_spec(mod)}
    lines = ["usage: llm-rlhf <command> [--config recipe.yaml] [--key value ...]", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, (_, text) in available.items()]
    lines += ["", "`llm-rlhf <command> --help` lists every config key of that command with its default."]
    return "\n".join(lines)


def entry() -> NoReturn:
    """The `llm-rlhf` command and `python -m llm_rlhf`: `main`, then the process ends with its code."""
    exit_process(main())


def main(argv: list[str] | None = None) -> int:
    """Run `llm-rlhf ARGV...` (default: sys.argv) in this process; its exit code (0, 2 for bad input, 130 when
    interrupted). It returns on every process: the `llm-rlhf` command (`entry`) then ends the process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS or importlib.util.find_spec(COMMANDS[name][0]) is None:
        print(f"error: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        use_cpu_ddp_without_gpus()
    except ModuleNotFoundError as e:  # a DeepSpeed launch where deepspeed is not installed
        print(f"error: {e}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        if hasattr(module, "cli"):  # commands with their own argument form (e.g. `report DIR`)
            return module.cli(rest) or 0
        if any(a in ("-h", "--help") for a in rest):
            print(f"llm-rlhf {name}: {COMMANDS[name][1]}\n")
            doc = sys.modules[module.Config.__module__].__doc__  # where the keys are declared (ppo/config.py)
            print((doc or "").strip() + "\n")
            print("config keys (defaults < --config YAML < --key value flags):")
            print(format_help(module.Config))
            return 0
        cfg = parse_config(module.Config, rest)
        if name in API:
            getattr(importlib.import_module("llm_rlhf.interfaces.api"), API[name])(cfg)
        else:
            module.run(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: the last checkpoint is kept; rerun with --resume true to continue", file=sys.stderr
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
