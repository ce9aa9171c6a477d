"""Run under `accelerate launch` with 1 or 2 processes: episodes of several turns on a global batch of prompts.

    python episode_ranks.py MODEL_DIR PROMPT_FILE OUT_JSON
    python fsdp2_on_cpu.py episode_ranks.py MODEL_DIR PROMPT_FILE OUT_JSON      (under fsdp.yaml: FSDP2)
    (under deepspeed_zero3.yaml: ZeRO-3, every parameter partitioned and none kept live, as ppo_ranks.py sets it)

A trainer with the Chatty environment of tests/envs.py (turns pause at a vowel, a reply after each, 3 turns at
most)
is built as `llm-rlhf ppo` builds it; its room plays the 8 global prompts of step 0 greedily (each rank its
contiguous 8 / world), so the episodes are fixed by the weights and comparable across process counts while the
ranks take different numbers of turns (the room agrees on the turns with a global sum each turn). Then one PPO
step (sampled episodes) runs, to show no rank waits on another. OUT_JSON (main process): the world size, the distributed type and, per
global prompt, the episode's query, response ids, response_mask, env_mask and turns, gathered from every rank.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: envs.py, helpers.py
from helpers import ppo_config  # noqa: E402

from llm_rlhf.core.utils import use_cpu_ddp_without_gpus  # noqa: E402
from llm_rlhf.interfaces import cli  # noqa: E402
from llm_rlhf.models.loading import load_tokenizer  # noqa: E402
from llm_rlhf.ppo import building as ppo_building  # noqa: E402


def main() -> None:
    model_dir, prompt_file, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    use_cpu_ddp_without_gpus()
    accelerator = Accelerator()
    plugin = accelerator.state.deepspeed_plugin
    if (
        plugin is not None and plugin.zero_stage == 3
    ):  # every parameter partitioned, none kept live (as ppo_ranks.py)
        plugin.deepspeed_config["zero_optimization"].update(
            stage3_param_persistence_threshold=0, stage3_max_live_parameters=0, stage3_max_reuse_distance=0
        )
    cfg = ppo_config(
        model_dir,
        None,
        prompt_file,
        out.parent / "run",
        environment="tests/envs.py:Chatty",
        max_turns=3,
        max_episode_tokens=24,
        max_new_tokens=8,
        max_reply_tokens=6,
        gold_judge="none",
        rollout_batch_size=8 // accelerator.num_processes,
        mini_batch_size=4 // accelerator.num_processes,
        steps=1,
    )
    tokenizer = load_tokenizer(cfg.model_name_or_path, padding_side="left")
    trainer = ppo_building.build_trainer(
        cfg, accelerator, tokenizer, ppo_building.load_prompt_ids(cfg, tokenizer)
    )
    greedy = dataclasses.replace(trainer.sampling, temperature=0.0)
    samples = trainer.collector.generate(trainer.collector.queries(0), sampling=greedy)
    rows = [
        {
            "query": q[m.bool()].tolist(),
            "response": r.tolist(),
            "response_mask": rm.tolist(),
            "env_mask": em.tolist(),
            "turns": int(t),
        }
        for q, m, r, rm, em, t in zip(
            samples.query,
            samples.query_mask,
            samples.response,
            samples.response_mask,
            samples.env_mask,
            samples.turns,
        )
    ]
    rows = gather_object(rows)  # every rank's, in rank order: the global prompts in order
    torch.manual_seed(accelerator.process_index)
    metrics = trainer.ppo_step()
    if accelerator.is_main_process:
        record = {"world": accelerator.num_processes, "episodes": rows, "metrics": metrics}
        out.write_text(json.dumps({**record, "distributed_type": str(accelerator.distributed_type)}))
    accelerator.wait_for_everyone()
    cli.exit_process(0)


if __name__ == "__main__":
    main()
