"""Tool-call traces for a short SFT before RL with the calculator, and their control without the tool.

    python data/make_tool_traces.py [--task chain_sum-t3d1 ...] [--out data/tool_traces]

SmolLM2-135M-Instruct never called the calculator when only the system prompt described it (the recipe's README:
0 tool calls in 64 held-out episodes), so the tool recipe first teaches the call's form on the rung's own
training problems. For each training prompt of data/tasks/<task>/train_prompts.jsonl (its generator's
`expression` and `answer`), two chat rows:

    tool_{train,val}.jsonl    system: the calculator's system prompt (`environments.CALCULATOR_SYSTEM_PROMPT`)
                              user: the task's question      assistant: <tool>calculator(9 + 6 + 8)</tool><result>23</result>
                                                                        Answer: 23
    answer_{train,val}.jsonl  user: the task's question      assistant: Answer: 23      (the same SFT budget, no tool)

The result in a trace is the calculator's own output (`environments.calculator`), as the environment replies in
an episode. The last N_VAL training prompts are the SFT's validation rows; the held-out prompts of the task are
never read. Deterministic: running it again writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not

from llm_rlhf.tasks.environments import CALCULATOR_SYSTEM_PROMPT, calculator  # noqa: E402

N_VAL = 32
TASKS = ("chain_sum-t3d1", "chain_sum-t2d2")


def traces(row: dict) -> tuple[dict, dict]:
    """The tool row and the answer row of one training prompt."""
    expression, answer = row["metadata"]["expression"], row["answer"]
    result = calculator(expression)
    assert result == answer, (expression, result, answer)  # the tool agrees with the generator
    user = row["messages"]
    tool = f"<tool>calculator({expression})</tool><result>{result}</result>\nAnswer: {answer}"
    return (
        {
            "messages": [
                {"role": "system", "content": CALCULATOR_SYSTEM_PROMPT},
                *user,
                {"role": "assistant", "content": tool},
            ]
        },
        {"messages": [*user, {"role": "assistant", "content": f"Answer: {answer}"}]},
    )


def write(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", nargs="*", default=list(TASKS))
    parser.add_argument("--out", type=Path, default=REPO / "data" / "tool_traces")
    args = parser.parse_args()
    for task in args.task:
        rows = [json.loads(x) for x in (REPO / "data" / "tasks" / task / "train_prompts.jsonl").open()]
        pairs = [traces(r) for r in rows]
        out = args.out / task
        out.mkdir(parents=True, exist_ok=True)
        for i, kind in enumerate(("tool", "answer")):
            write([p[i] for p in pairs[:-N_VAL]], out / f"{kind}_train.jsonl")
            write([p[i] for p in pairs[-N_VAL:]], out / f"{kind}_val.jsonl")
        print(f"{out}: {len(pairs) - N_VAL} train and {N_VAL} val rows each of tool and answer traces")


if __name__ == "__main__":
    main()
