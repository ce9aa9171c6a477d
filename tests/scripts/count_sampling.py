"""Run `llm-rlhf ppo ARGS...` under `accelerate launch`, counting on each process the calls of `sample`
(every `generate` of PPO's rollouts, its logged samples and the held-out evaluation).

    python count_sampling.py OUT_DIR ARGS...

Writes OUT_DIR/sample_calls_<rank>.json. With sharded parameters (ZeRO-3, FSDP) each call is a series of
collectives, so every process must make the same calls.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from llm_rlhf.evaluation import measures
from llm_rlhf.interfaces import cli
from llm_rlhf.ppo import rollouts as ppo_rollouts


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    calls = [0]
    for module in (ppo_rollouts, measures):  # PPO's rollout collector; evaluation's and held-out sampling
        original = module.sample

        def counted(*a, _original=original, **kw):
            calls[0] += 1
            return _original(*a, **kw)

        module.sample = counted
    code = cli.main(args)
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sample_calls_{rank}.json").write_text(json.dumps(calls[0]))
    cli.exit_process(code)  # after the file: a data-parallel process ends with os._exit


if __name__ == "__main__":
    main()
