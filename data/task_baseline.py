"""The accuracy of a model on reasoning-gym task folders' held-out prompts, greedy and sampled, by each
folder's verifier: the base model measured on candidate rungs before choosing a ladder of tasks.

    python data/task_baseline.py data/tasks/chain_sum-t3d1 [more folders] [--model data/smollm2-135m-instruct] \\
        [--max_new_tokens 48] [--samples 1] [--limit 64] [--out rows.jsonl]

Prompts, sampling and standard errors as `data/arithmetic_baseline.py` (whose `generate` this uses: chat
prompts rendered with the model's template, greedy `do_sample=False`, sampled at temperature 1 from the
full softmax; standard error over problems). Per folder it prints the accuracy (`verifier.py:accuracy`),
the mean reward (`verifier.py:reward`, with the generator's partial credit), and the share of responses
that wrote an "Answer:" line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not
sys.path.insert(0, str(REPO / "data"))

from arithmetic_baseline import generate, mean_and_stderr  # noqa: E402

from llm_rlhf.core.data import load_prompt_dataset  # noqa: E402
from llm_rlhf.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from llm_rlhf.tasks.gym import answer_line, load_verifiers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--model", default=str(REPO / "data" / "smollm2-135m-instruct"))
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--samples", type=int, default=1, help="sampled responses per problem")
    parser.add_argument("--limit", type=int, default=64, help="only the first N held-out problems")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSONL of every problem's responses")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model).eval()
    torch.set_grad_enabled(False)
    rows_out = []
    for folder in args.folders:
        start = time.time()
        reward, accuracy = load_verifiers(folder)
        prompts = load_prompt_dataset(folder / "eval_prompts.jsonl", tokenizer, max_prompt_length=512)[
            "prompt"
        ]
        prompts = prompts[: args.limit]
        torch.manual_seed(args.seed)
        greedy = generate(
            model,
            tokenizer,
            prompts,
            sample=False,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
        )
        sampled = [
            generate(
                model,
                tokenizer,
                prompts,
                sample=True,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
            )
            for _ in range(args.samples)
        ]  # (samples, n)
        greedy_acc = accuracy(prompts, greedy)
        sampled_acc = [accuracy(prompts, s) for s in sampled]  # (samples, n)
        sampled_reward = [reward(prompts, s) for s in sampled]
        per_problem = [statistics.fmean(col) for col in zip(*sampled_acc)]  # (n,)
        formatted = statistics.fmean(answer_line(r) is not None for s in sampled for r in s)
        g, g_se = mean_and_stderr(greedy_acc)
        s, s_se = mean_and_stderr(per_problem)
        mean_reward = statistics.fmean(x for row in sampled_reward for x in row)
        print(
            f"{folder.name}: n {len(prompts)}, sampled {s:.3f} ± {s_se:.3f}, greedy {g:.3f} ± {g_se:.3f}, "
            f"sampled reward {mean_reward:.3f}, 'Answer:' in {formatted:.2f} of sampled, greedy "
            f"{statistics.fmean(answer_line(r) is not None for r in greedy):.2f} "
            f"({args.max_new_tokens} new tokens, {args.samples} sample(s), {time.time() - start:.0f} s)",
            flush=True,
        )
        for i, prompt in enumerate(prompts):
            rows_out.append(
                {
                    "task": folder.name,
                    "prompt": prompt,
                    "greedy": greedy[i],
                    "greedy_correct": greedy_acc[i],
                    "sampled": [x[i] for x in sampled],
                    "sampled_correct": [x[i] for x in sampled_acc],
                }
            )
    if args.out is not None:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows_out), encoding="utf-8")


if __name__ == "__main__":
    main()
