"""The accuracy of a model on the "arithmetic" task's held-out problems, greedy and sampled, by the verifier.

    python data/arithmetic_baseline.py [--model data/smollm2-135m-instruct] \\
        [--prompts data/arithmetic/eval_prompts.jsonl] [--max_new_tokens 24] [--samples 1] [--out rows.jsonl] \\
        [--system_prompt TEXT]

The prompts are read as `llm-rlhf ppo` reads them (`load_prompt_dataset`: chat `messages` rendered with the
model's chat template and its generation prompt, token ids as `tokenizer(prompt)`), each response is cut
after its first EOS and decoded without special tokens, and `llm_rlhf.tasks.arithmetic.reward` scores it:
accuracy = the mean of the verifier's rewards.
- greedy: one response per problem, `do_sample=False`;
- sampled: `--samples` responses per problem from the full softmax (`do_sample=True, temperature=1.0,
  top_k=0, top_p=1.0`, given explicitly so a model's generation config cannot truncate), as PPO samples.
Standard error: over problems, of each problem's mean reward (sd / sqrt(n), sd with n - 1); with several
samples per problem this counts a problem once, not each sample as independent. `--out` writes one row
per problem (kind, prompt, answer, the greedy and sampled responses and rewards) for tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not

from llm_rlhf.core.data import load_prompt_dataset  # noqa: E402
from llm_rlhf.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from llm_rlhf.tasks.arithmetic import parse_problem, prompt_answer, reward  # noqa: E402


def generate(model, tokenizer, prompts: list[str], *, sample: bool, max_new_tokens: int, batch_size: int):
    """One response per prompt (the text before its first EOS), in batches of left-padded prompts."""
    responses = []
    for start in range(0, len(prompts), batch_size):
        ids = [tokenizer(p)["input_ids"] for p in prompts[start : start + batch_size]]
        width = max(map(len, ids))
        query = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids])  # (B, P)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])  # (B, P) left padding
        controls = (
            dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        )
        with torch.no_grad():
            out = model.generate(
                input_ids=query,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **controls,
            )
        for row in out[:, width:].tolist():  # (B, R) the response tokens
            row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            responses.append(tokenizer.decode(row, skip_special_tokens=True))
    return responses


def mean_and_stderr(per_problem: list[float]) -> tuple[float, float]:
    n = len(per_problem)
    sd = statistics.stdev(per_problem) if n > 1 else 0.0
    return statistics.fmean(per_problem), sd / math.sqrt(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "data" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", default=str(REPO / "data" / "arithmetic" / "eval_prompts.jsonl"))
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--samples", type=int, default=1, help="sampled responses per problem")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--system_prompt",
        default=None,
        help="the system turn of every prompt (as the config key; '' = empty)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSONL of every problem's responses")
    args = parser.parse_args()

    start = time.time()
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model).eval()
    prompts = load_prompt_dataset(
        args.prompts, tokenizer, max_prompt_length=512, system_prompt=args.system_prompt
    )["prompt"][: args.limit]
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
    greedy_scores = reward(prompts, greedy)
    sampled_scores = [reward(prompts, s) for s in sampled]  # (samples, n)
    per_problem = [statistics.fmean(col) for col in zip(*sampled_scores)]  # (n,) each problem's sampled mean
    kinds = [parse_problem(p)[0] for p in prompts]

    n = len(prompts)
    print(
        f"model {args.model}; {n} problems of {args.prompts}; {args.max_new_tokens} new tokens; seed {args.seed}"
    )
    mean, se = mean_and_stderr(greedy_scores)
    print(f"greedy  accuracy {mean:.3f} ± {se:.3f}")
    mean, se = mean_and_stderr(per_problem)
    print(
        f"sampled accuracy {mean:.3f} ± {se:.3f} ({args.samples} per problem; temperature 1, top_k 0, top_p 1)"
    )
    for kind in sorted(set(kinds)):
        index = [i for i, k in enumerate(kinds) if k == kind]
        g = statistics.fmean(greedy_scores[i] for i in index)
        s = statistics.fmean(per_problem[i] for i in index)
        print(f"  {kind:<6} {len(index):>4} problems: greedy {g:.3f}, sampled {s:.3f}")
    print(f"{time.time() - start:.0f} s")
    if args.out is not None:
        with args.out.open("w", encoding="utf-8") as f:
            for i, prompt in enumerate(prompts):
                row = {
                    "kind": kinds[i],
                    "prompt": prompt,
                    "answer": prompt_answer(prompt),
                    "greedy": greedy[i],
                    "greedy_reward": greedy_scores[i],
                    "sampled": [s[i] for s in sampled],
                    "sampled_rewards": [s[i] for s in sampled_scores],
                }
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
