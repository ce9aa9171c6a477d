"""`llm-rlhf ARGS...`, killed with SIGKILL (kill -9: no handler, no flush, no clean-up) as PPO step N starts.

    python kill_at_step.py N ARGS...      (ARGS: what follows `-m llm_rlhf`)

What stays on disk is what a crash leaves: the checkpoints written before and the log lines of steps 1..N-1.
"""

from __future__ import annotations

import os
import signal
import sys

from llm_rlhf.interfaces import cli
from llm_rlhf.ppo import trainer as ppo_trainer


def main() -> None:
    kill_at, args = int(sys.argv[1]), sys.argv[2:]
    ppo_step = ppo_trainer.PPOTrainer.ppo_step

    def killed_at_step(self):
        if self.step + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return ppo_step(self)

    ppo_trainer.PPOTrainer.ppo_step = killed_at_step
    cli.exit_process(cli.main(args))


if __name__ == "__main__":
    main()
