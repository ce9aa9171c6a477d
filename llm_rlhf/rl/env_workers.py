"""Environments in worker processes: every call bounded in time, memory and output, whatever its code does.

    EnvironmentWorkers(make, timeout=, memory_mb=, max_reply_chars=)
        prepare(n)      n live worker processes, all free, forked from the calling (main) thread before a round
                        of episodes (a worker killed in the last round forked again)
        __call__()      an environment built in a free worker, as the `EnvironmentInWorker` proxy of it
        close()         the workers stopped
    EnvironmentInWorker  reset(prompt), step(turn), stop_strings, reply_role, name: calls over a pipe

A thread can be abandoned but not stopped: a step that never returns, spins or holds the GIL (a regular
expression) kept running, and one abandoned thread a round piled up (25 rounds of 16 episodes with a tool that
never returns: 2 -> 329 threads, 1.05 -> 4.4 GB of virtual memory). A process can be stopped. Each episode's
environment lives in its own worker process (one per episode of a round, reused across rounds), forked from the
trainer, so it sees the same classes, verifier and imports without pickling them; a call is a message, its
answer is waited for on the pipe (no thread in the trainer), and a worker that does not answer within
`environment_timeout` is killed (SIGKILL) and forked again before the next round. In the worker:
- memory: the address space is capped at its size when forked + `environment_memory_mb` (RLIMIT_AS), so an
  allocation beyond raises MemoryError there (reported like any error) instead of growing the trainer's machine;
- output: a reply is cut to `max_reply_chars` characters before it crosses the pipe (the trainer then cuts it
  to max_reply_tokens tokens), so a reply of gigabytes is never copied;
- errors: anything raised (SystemExit too) comes back as one line, "raised <type>: <first line>"; a worker
  that dies (os._exit, a signal) is "ended its process (exit code N)".
The forked worker must not run torch's parallel kernels (forked after OpenMP started, they may hang): the
calls are bounded anyway, and `environment_process: false` runs environments in threads instead.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

from llm_rlhf.rl.episodes import EnvironmentCallError, InAnotherProcess, Step, one_line, shown


def cap_address_space(memory_mb: int) -> None:
    """RLIMIT_AS = this process's virtual size now + memory_mb (Linux; elsewhere nothing)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
    except (ImportError, OSError):
        return
    limit = pages * os.sysconf("SC_PAGE_SIZE") + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


# what the trainer reads of an environment after its episode (a tool environment's `calls` and `used`:
# `rollouts.EpisodeCollector.episode_stats`, `episodes.episode_record`), sent back with every answer
STATISTICS = ("calls", "used")


def statistics(environment: Any) -> dict[str, Any]:
    """The STATISTICS attributes the environment has, as they are now (none where reading one raises)."""
    out = {}
    for name in STATISTICS:
        try:
            if hasattr(environment, name):
                out[name] = getattr(environment, name)
        except Exception:
            pass
    return out


def read_attribute(environment: Any, name: str, default: Any) -> tuple[str, Any]:
    """("value", environment.name or default) or ("raised", (type name, first line)) if reading it raised."""
    try:
        return "value", getattr(environment, name, default)
    except BaseException as e:
        return "raised", (type(e).__name__, one_line(e))


def cut_step(step: Any, max_reply_chars: int) -> Any:
    """A Step whose str reply is cut to max_reply_chars characters; anything else as it is."""
    if isinstance(step, Step) and isinstance(step.reply, str) and len(step.reply) > max_reply_chars:
        return Step(reply=step.reply[:max_reply_chars], reward=step.reward, done=step.done)
    return step


def die_with_the_trainer(trainer_end) -> None:
    """The worker ends with the trainer: it closes its copy of the trainer's end of its pipe (so the pipe reads
    EOF once the trainer is gone; a worker forked later closes nothing else, and ends first, at its own EOF) and
    asks Linux for SIGKILL when the trainer's thread that forked it exits (PR_SET_PDEATHSIG). An orphaned worker
    would keep the trainer's stdout open, and `accelerate launch` waits for it."""
    trainer_end.close()
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(conn, trainer_end, make: Callable[[], Any], memory_mb: int, max_reply_chars: int) -> None:
    """The worker's loop: ("build",) -> the environment's name and attributes; ("reset", prompt) and
    ("step", turn) -> the method's result; each answered ("ok", value) or ("error", one line)."""
    die_with_the_trainer(trainer_end)
    cap_address_space(memory_mb)
    environment = None
    while True:
        try:
            kind, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if kind == "build":
                environment = None  # the last episode's environment goes before the next is built
                environment = make()
                value = {
                    "name": type(environment).__name__,
                    "stop_strings": read_attribute(environment, "stop_strings", ()),
                    "reply_role": read_attribute(environment, "reply_role", "user"),
                }
            elif kind == "reset":
                environment.reset(*args)
                value = None  # what reset returns is not read
            else:
                value = cut_step(environment.step(*args), max_reply_chars)
            answer = ("ok", value, statistics(environment))
        except BaseException as e:  # the environment's own error (sys.exit too), as one line
            answer = ("error", f"raised {type(e).__name__}: {one_line(e)}".rstrip(": "), {})
        try:
            conn.send(answer)
        except BaseException as e:  # e.g. a value that cannot be pickled
            conn.send(("error", f"returned {shown(answer[1])}, which could not be sent: {one_line(e)}", {}))


class Worker:
    """One forked process that holds at most one environment at a time."""

    def __init__(self, make, memory_mb: int, max_reply_chars: int):
        context = multiprocessing.get_context("fork")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=serve, args=(child, self.conn, make, memory_mb, max_reply_chars), daemon=True
        )
        self.process.start()
        child.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def call(self, kind: str, args: tuple, timeout: float) -> tuple[Any, dict]:
        """The worker's answer to (kind, args) within `timeout` seconds and the environment's STATISTICS after
        it, else the worker killed and an EnvironmentCallError."""
        try:
            self.conn.send((kind, args))
            if not self.conn.poll(timeout):
                self.kill()
                raise EnvironmentCallError(f"did not return within {timeout:g} s")
            status, value, stats = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            # its pipe closed as it exited: joined, it is reaped within moments and its exit code is set
            if self.process is not None:
                self.process.join(1.0)
            code = self.process.exitcode if self.process is not None else None
            self.kill()
            raise EnvironmentCallError(f"ended its process (exit code {code})") from None
        if status == "error":
            raise EnvironmentCallError(value)
        return value, stats

    def kill(self) -> None:
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join()
            self.process.close()
            self.process = None
        self.conn.close()


class RemoteAttributeError(Exception):
    """Reading an attribute raised in the worker; named after the worker's exception (see `attribute`)."""


def raised(type_name: str, message: str) -> Exception:
    """An exception whose type is named as the worker's was, so the checks' one-line messages read the same."""
    return type(type_name, (RemoteAttributeError,), {})(message)


class EnvironmentInWorker(InAnotherProcess):
    """The trainer's side of an environment built in a worker: reset and step are calls over the pipe, bounded
    by `timeout`; stop_strings and reply_role are the values read in the worker when it was built, and the
    environment's STATISTICS (a tool environment's `calls`, `used`) those after its last call."""

    def __init__(self, worker: Worker, built: tuple[dict, dict], timeout: float):
        self.worker, self.timeout = worker, timeout
        self.attributes, self.statistics = built
        self.name = self.attributes["name"]

    def __getattr__(self, name: str):
        statistics = self.__dict__.get("statistics", {})
        if name in statistics:
            return statistics[name]
        raise AttributeError(name)

    def call(self, kind: str, args: tuple):
        value, self.statistics = self.worker.call(kind, args, self.timeout)
        return value

    def attribute(self, name: str):
        how, value = self.attributes[name]
        if how == "raised":
            raise raised(*value)
        return value

    stop_strings = property(lambda self: self.attribute("stop_strings"))
    reply_role = property(lambda self: self.attribute("reply_role"))

    def reset(self, prompt: str):
        return self.call("reset", (prompt,))

    def step(self, turn: str):
        return self.call("step", (turn,))


class EnvironmentWorkers:
    """What `run_episodes` takes as make_environment when environments run in processes (see the module
    docstring). make: builds one environment (in the worker); the name is make's."""

    def __init__(self, make: Callable[[], Any], *, timeout: float, memory_mb: int, max_reply_chars: int):
        self.make, self.timeout = make, timeout
        self.memory_mb, self.max_reply_chars = memory_mb, max_reply_chars
        self.__name__ = getattr(make, "__name__", type(make).__name__)
        self.workers: list[Worker] = []
        self.free: list[Worker] = []
        self.lock = threading.Lock()

    def prepare(self, n: int) -> None:
        """n live workers, all free: the dead or killed ones forked again (from this, the calling thread)."""
        self.workers = [w for w in self.workers if w.alive]
        while len(self.workers) < n:
            self.workers.append(Worker(self.make, self.memory_mb, self.max_reply_chars))
        self.free = list(self.workers)

    def __call__(self) -> EnvironmentInWorker:
        with self.lock:
            if not self.free:
                raise EnvironmentCallError("has no free worker process (prepare(n) runs before a round)")
            worker = self.free.pop()
        return EnvironmentInWorker(worker, worker.call("build", (), self.timeout), self.timeout)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers, self.free = [], []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
