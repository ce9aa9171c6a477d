"""Rounds of episodes whose every step never returns, in threads and in worker processes (`environment_process`):
the trainer's threads, child processes and memory after each round.

    python benchmarks/hung_environment.py --rounds 25 --episodes 16 --timeout 0.3

Each round plays `--episodes` episodes of one turn on data/reviews/base_model (the 4M GPT-2) with an environment
whose step sleeps forever (`Hangs`), through `llm_rlhf.rl.episodes.run_episodes`; printed per mode: the threads
(`threading.active_count`), live child processes, virtual memory and RSS (/proc/self/statm) before the first
round and after rounds 1, 5, 10, ..., and the seconds a round took (median).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import threading
import time

import torch
from transformers import AutoModelForCausalLM

from llm_rlhf.models.loading import load_tokenizer
from llm_rlhf.rl.env_workers import EnvironmentWorkers
from llm_rlhf.rl.episodes import EpisodeLimits, Step, run_episodes
from llm_rlhf.rl.rollout import Sampling

MODEL = "data/reviews/base_model"


class Hangs:
    def reset(self, prompt):
        pass

    def step(self, turn):
        threading.Event().wait()  # forever
        return Step(reply="late")


def memory() -> tuple[float, float]:
    """(virtual, resident) GiB of this process."""
    with open("/proc/self/statm") as f:
        vm, rss = (int(x) * os.sysconf("SC_PAGE_SIZE") / 2**30 for x in f.read().split()[:2])
    return vm, rss


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--timeout", type=float, default=0.3)
    p.add_argument("--modes", default="process,thread")
    args = p.parse_args()
    tok = load_tokenizer(MODEL, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    queries = [tok("The film is")["input_ids"]] * args.episodes
    sampling = Sampling(max_new_tokens=8)
    print(
        f"{cpu_name()}, torch {torch.__version__}; {args.rounds} rounds of {args.episodes} episodes, timeout {args.timeout} s"
    )
    for mode in args.modes.split(","):
        limits = EpisodeLimits(1, 32, environment_timeout=args.timeout)
        make = (
            EnvironmentWorkers(Hangs, timeout=args.timeout, memory_mb=256, max_reply_chars=4096)
            if mode == "process"
            else Hangs
        )
        vm, rss = memory()
        print(
            f"{mode}: before: threads {threading.active_count()}, children 0, VM {vm:.2f} GiB, RSS {rss:.2f} GiB"
        )
        seconds = []
        for r in range(1, args.rounds + 1):
            t = time.perf_counter()
            run_episodes(lm, tok, queries, make, sampling, limits)
            seconds.append(time.perf_counter() - t)
            if r in (1, args.rounds) or r % 5 == 0:
                vm, rss = memory()
                print(
                    f"{mode}: after round {r}: threads {threading.active_count()}, children "
                    f"{len(multiprocessing.active_children())}, VM {vm:.2f} GiB, RSS {rss:.2f} GiB"
                )
        print(f"{mode}: a round took {statistics.median(seconds):.2f} s (median)")
        if mode == "process":
            make.close()


if __name__ == "__main__":
    main()
