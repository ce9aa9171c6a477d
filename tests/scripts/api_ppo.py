"""Run under `accelerate launch`: a user's script that trains with the Python API.

    python api_ppo.py MODEL_DIR PROMPT_FILE OUT_DIR

PPO from the model folder on PROMPT_FILE's prompts (read here, passed as a list of strings) with a lambda as
the reward function, 2 steps of 4 prompts per process, into OUT_DIR. Each process writes the metrics its
on_step saw to OUT_DIR/on_step.rank<i>.json (the main process: every step's; the others: none).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accelerate import PartialState

from llm_rlhf import exit_process, train_ppo

model_dir, prompt_file, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()]
seen = []
result = train_ppo(
    {
        "model_name_or_path": model_dir,
        "reward_model_path": None,
        "output_dir": str(out),
        "steps": 2,
        "rollout_batch_size": 4,
        "mini_batch_size": 2,
        "ppo_epochs": 1,
        "max_new_tokens": 6,
        "save_steps": 0,
        "eval_every": 0,
        "log_samples_every": 0,
    },
    prompts=prompts,
    reward_fn=lambda prompts, responses: [len(r) / 10 for r in responses],
    on_step=seen.append,
)
state = PartialState()
assert state.num_processes == 2, state.num_processes
(out / f"on_step.rank{state.process_index}.json").write_text(json.dumps(seen))
exit_process(0)  # as the commands end (docs/getting-started/python-api.md)
