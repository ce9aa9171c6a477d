"""Run `llm-rlhf ppo ARGS...` under `accelerate launch`, recording on each process every rollout PPO trains on:
its query tokens (padding dropped), response tokens, response_mask, `stopped` (a stop string ended the row),
`ended` (EOS or a stop string: what the EOS trick and the eos_rate metric count) and the old and reference
log-probs PPO trains with.

    python record_rollouts.py OUT_DIR ARGS...

Writes OUT_DIR/rollouts_<rank>.json: one record per PPO step, in order.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from llm_rlhf.interfaces import cli
from llm_rlhf.ppo import trainer as ppo_trainer


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    records = []
    original = ppo_trainer.PPOTrainer.rollout

    def recorded(self, queries, *args, **kwargs):  # times: as `ppo_step` passes it
        rollout, scores = original(self, queries, *args, **kwargs)
        eos = self.tokenizer.eos_token_id
        records.append(
            {
                "query": [q[m.bool()].tolist() for q, m in zip(rollout.query, rollout.query_mask)],
                "response": rollout.response.tolist(),
                "logprobs": rollout.logprobs.tolist(),
                "ref_logprobs": rollout.ref_logprobs.tolist(),
                "response_mask": rollout.response_mask.tolist(),
                "stopped": rollout.stopped.tolist(),
                "ended": rollout.ended(eos).tolist(),
            }
        )
        return rollout, scores

    ppo_trainer.PPOTrainer.rollout = recorded
    code = cli.main(args)
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rollouts_{rank}.json").write_text(json.dumps(records))
    cli.exit_process(code)  # after the file: a data-parallel process ends with os._exit


if __name__ == "__main__":
    main()
