"""Environments in worker processes (`rl.env_workers`, `environment_process: true`, the default): what no thread
can bound is bounded — a step that holds the GIL, spins, allocates, never returns or ends its process — with the
same one-line notes as the threads give, and no thread or process left behind across rounds."""

from __future__ import annotations

import os
import threading
import time

import envs
import pytest
from envs import play
from helpers import ppo_config, tiny_ppo_trainer

from llm_rlhf.models.loading import load_tokenizer
from llm_rlhf.rl.env_workers import EnvironmentWorkers
from llm_rlhf.rl.episodes import ENVIRONMENT, EpisodeLimits
from llm_rlhf.tasks.environments import environment_factory


def in_workers(env, timeout=0.5, memory_mb=256, max_reply_tokens=64):
    return EnvironmentWorkers(
        env, timeout=timeout, memory_mb=memory_mb, max_reply_chars=64 * max_reply_tokens
    )


def failures(played) -> list[str]:
    return [e.error for e in played if e.error is not None]


def children() -> int:
    """Live child processes of this one."""
    import multiprocessing

    return len(multiprocessing.active_children())


@pytest.mark.parametrize(
    "env, reason",
    [
        (envs.HoldsTheGil, "step did not return within 0.5 s"),
        (envs.Spins, "step did not return within 0.5 s"),
        (envs.Hangs, "step did not return within 0.5 s"),
        (envs.Allocates, "step raised MemoryError"),
        (envs.Dies, "step ended its process (exit code 7)"),
        (envs.Exits, "step raised SystemExit: 3"),
        (envs.Raises, "step raised RuntimeError: the environment broke"),
        (envs.RaisesUnprintable, "step raised Unprintable: (its message could not be read: str() raised)"),
        (envs.NotAStep, "step returned str 'a string', not a Step"),
        (envs.ResetFails, "reset raised RuntimeError: no board"),
    ],
    ids=lambda x: getattr(x, "__name__", "")[:20],
)
def test_a_misbehaving_environment_in_a_worker_ends_its_episode_in_time_with_a_note(
    tiny_model_dir, capsys, env, reason
):
    """Each case ends its episodes with the note the threads give (or a bound they cannot give), within the
    timeout and a kill, whatever the step does to its process."""
    workers = in_workers(env)
    start = time.monotonic()
    _, played = play(tiny_model_dir, workers, environment_timeout=0.5)
    took = time.monotonic() - start
    workers.close()
    assert set(failures(played)) == {reason}
    assert took < 15  # a GIL-holding or spinning step took 7.3 s against a 0.3 s timeout in a thread
    name = env.__name__
    assert f"note: environment {name} {reason}" in capsys.readouterr().err


def test_a_reply_of_megabytes_is_cut_in_the_worker_and_a_value_that_cannot_cross_is_named(tiny_model_dir):
    """A reply of 4 MB crosses the pipe as 64 x max_reply_tokens characters and is then cut to max_reply_tokens
    tokens (and the cut mark), as in a thread; a step whose value cannot be pickled ends its episode, named."""
    workers = in_workers(envs.Megabytes, max_reply_tokens=5)
    _, played = play(tiny_model_dir, workers, max_reply_tokens=5, max_episode_tokens=80)
    workers.close()
    tok = load_tokenizer(str(tiny_model_dir))
    cut = len(tok(" [cut]", add_special_tokens=False)["input_ids"])
    replies = [ids for e in played for owner, ids in e.pieces if owner == ENVIRONMENT]
    assert not failures(played) and replies and all(len(ids) == 5 + cut for ids in replies)
    assert envs.Megabytes().step("").reply[: 64 * 5] == "x " * 160  # what crossed: the first 320 characters
    workers = in_workers(envs.ReturnsALambda)
    _, played = play(tiny_model_dir, workers)
    workers.close()
    (reason,) = set(failures(played))
    assert reason.startswith(
        "step returned <function ReturnsALambda.step.<locals..., which could not be sent: "
    )


def test_an_attribute_that_raises_in_the_worker_reads_as_in_the_trainer(tiny_model_dir):
    from llm_rlhf.core.errors import UserError

    workers = in_workers(envs.StopStringsRaise)
    with pytest.raises(UserError, match="StopStringsRaise: reading stop_strings raised KeyError: 'stop'"):
        play(tiny_model_dir, workers)
    workers.close()


def test_25_rounds_with_a_tool_that_never_returns_leave_threads_processes_and_memory_flat(tiny_model_dir):
    """The issue's measurement, smaller: rounds of 4 episodes whose every step hangs. Threads: back to where they
    were after each round (the calls' threads end with the worker's deadline); processes: the 4 workers (killed
    and forked again each round); the trainer's memory: flat."""
    workers = in_workers(envs.Hangs, timeout=0.2)
    threads_before = threading.active_count()
    rss = []
    for _ in range(25):
        _, played = play(tiny_model_dir, workers, environment_timeout=0.2)
        assert set(failures(played)) == {"step did not return within 0.2 s"}
        assert threading.active_count() == threads_before
        assert children() <= 2
        with open(f"/proc/{os.getpid()}/statm") as f:
            rss.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    workers.close()
    assert children() == 0
    assert rss[-1] - rss[2] < 64 * 2**20  # no growth per round beyond noise


def test_ppo_builds_its_environments_in_workers_by_default_and_in_threads_when_asked(
    tiny_model_dir, prompt_file, tmp_path
):
    """environment_process (default true) goes from the config to the factory; false keeps the plain factory."""
    for process in (True, False):
        cfg = ppo_config(
            tiny_model_dir,
            None,
            prompt_file,
            tmp_path / str(process),
            environment="tests/envs.py:Echo",
            max_turns=2,
            max_episode_tokens=24,
            max_new_tokens=8,
            gold_judge="none",
            eval_every=0,
            environment_process=process,
            environment_memory_mb=512,
        )
        make = environment_factory(cfg.environment, limits=EpisodeLimits.of(cfg))
        assert isinstance(make, EnvironmentWorkers) == process
        trainer = tiny_ppo_trainer(cfg)
        assert isinstance(trainer.collector.make_environment, EnvironmentWorkers) == process
        metrics = trainer.ppo_step()
        assert metrics["env/error_rate"] == 0


def test_a_tool_environments_counts_reach_the_trainer_from_its_worker(tiny_model_dir):
    """`calls` and `used` of the calculator (what env/tool_call_rate and the records read) come back with every
    answer of its worker."""
    limits = EpisodeLimits(3, 24, environment_process=True)
    make = environment_factory("calculator", limits=limits)
    assert isinstance(make, EnvironmentWorkers)
    _, played = play(tiny_model_dir, make)
    make.close()
    assert played and all(type(e.environment.calls) is int for e in played)
    assert all(type(e.environment.used) is bool for e in played)
    with pytest.raises(AttributeError):
        getattr(played[0].environment, "not_a_statistic")  # noqa: B009  only the statistics are read
