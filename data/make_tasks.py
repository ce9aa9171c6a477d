"""Write the reasoning-gym tasks' folders: seeded, deterministic, offline (needs `.[tasks]`).

    python data/make_tasks.py [--tasks data/tasks/tasks.yaml] [--only NAME ...] [--out data/tasks]

Each task of the YAML (`llm_rlhf.tasks.gym.Task`: dataset, config, seed, n_train, n_eval, extract, instruction)
becomes `<out>/<name>/` with train_prompts.jsonl, eval_prompts.jsonl, task.json (the task, the reasoning-gym
version, the command) and verifier.py (`reward_fn: <out>/<name>/verifier.py:reward`, `accuracy_fn:
...:accuracy`; a recipe's pipeline.yaml names the task once, `task: <name>`, and its stages read these files);
`llm_rlhf/tasks/gym.py` says how, `data/tasks/README.md` how to add a task. Running it again writes the same bytes
(`tests/tasks/test_tasks.py` compares a fresh run with the committed folders).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not

from llm_rlhf.tasks.gym import load_tasks, write_task  # noqa: E402

DEFAULT_TASKS = REPO / "data" / "tasks" / "tasks.yaml"
DEFAULT_OUT = REPO / "data" / "tasks"
COMMAND = "python data/make_tasks.py"


def build(tasks_file: Path, out: Path, only: list[str] | None = None) -> list[Path]:
    """Write the folders of the tasks in `tasks_file` (those named in `only`, when given) under `out`."""
    tasks = load_tasks(tasks_file)
    unknown = sorted(set(only or ()) - {t.name for t in tasks})
    if unknown:
        raise SystemExit(f"--only: no task {unknown} in {tasks_file}")
    return [write_task(t, out, command=COMMAND) for t in tasks if not only or t.name in only]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    parser.add_argument("--only", nargs="*", default=None, help="only these task names")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for folder in build(args.tasks, args.out, args.only):
        print(f"{folder}: {(folder / 'task.json').stat().st_size} bytes of provenance")


if __name__ == "__main__":
    main()
