"""Write the embedded "arithmetic" task's prompt files: seeded, deterministic, no download (~1 s).

    python data/make_arithmetic.py [--out data/arithmetic]

`train_prompts.jsonl` (PPO's prompts) and `eval_prompts.jsonl` (the held-out problems), rows

    {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "answer": 7, "kind": "add"}

made by `llm_rlhf.tasks.arithmetic.make_splits` with the constants below: the problems and phrasings are the
module's `KINDS`, and its verifier (`--reward_fn llm_rlhf.tasks.arithmetic:reward`) reads the problem back from the
prompt, so `answer` and `kind` are for people (per-kind accuracy, the before/after table), never for the
reward. No problem is on both sides (3 + 4 and 4 + 3 are one problem); `data/arithmetic/README.md` has the
mix, the verifier's rule and the instruct model's baseline accuracy. Running it again writes the same bytes
(`tests/tasks/test_arithmetic.py` compares a fresh run with the committed files).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not

from llm_rlhf.tasks.arithmetic import make_splits, prompt_row  # noqa: E402

SEED = 0
N_TRAIN = 2000
N_EVAL = 76  # 27 of the 55 'add', 27 of the 55 'sub', 22 of the 45 'mul' problems: about half of each kind
MIX = {"add": 1.0, "sub": 1.0, "mul": 0.8}  # relative weights of the kinds, train and held-out
DEFAULT_OUT = REPO / "data" / "arithmetic"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def build(out: Path) -> dict[str, Counter]:
    """Write both files into `out`; returns the rows per kind of each."""
    train, held_out = make_splits(seed=SEED, n_train=N_TRAIN, n_eval=N_EVAL, mix=MIX)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train_prompts.jsonl", [prompt_row(p) for p in train])
    write_jsonl(out / "eval_prompts.jsonl", [prompt_row(p) for p in held_out])
    return {"train": Counter(p.kind for p in train), "eval": Counter(p.kind for p in held_out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the two files")
    args = parser.parse_args()
    for split, counts in build(args.out).items():
        print(
            f"{split}: {sum(counts.values())} rows ({', '.join(f'{k} {n}' for k, n in sorted(counts.items()))})"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
