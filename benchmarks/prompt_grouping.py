"""Does sampling prompts grouped by length pay?

    python benchmarks/prompt_grouping.py                   # SmolLM2, the first 32 arithmetic training prompts

`rollout.sample` of the same prompts, 24 new tokens, three ways, alternated per repetition: as one
left-padded batch (what PPO does), sorted by length in one batch, and sorted and split into `--groups`
batches of similar length (less left padding, smaller batches). Prints the wall seconds of each.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llm_rlhf.core.data import load_prompt_dataset  # noqa: E402
from llm_rlhf.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from llm_rlhf.rl.rollout import Sampling, encode_prompt, left_pad, sample  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(REPO / "data" / "smollm2-135m-instruct"))
    p.add_argument("--prompt-file", default=str(REPO / "data" / "arithmetic" / "train_prompts.jsonl"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--max-prompt-length", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict[str, list[float]]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model_dir, padding_side="left")
    lm = load_causal_lm(args.model_dir).eval()
    rows = load_prompt_dataset(args.prompt_file, tokenizer, max_prompt_length=args.max_prompt_length)[
        "prompt"
    ]
    ids = [encode_prompt(tokenizer, p) for p in list(rows)[: args.prompts]]
    lengths = [len(q) for q in ids]
    print(
        f"{len(ids)} prompts of {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(ids):.1f}), "
        f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads"
    )
    ordered = sorted(ids, key=len)
    size = -(-len(ordered) // args.groups)  # ceil
    ways = {
        "one batch": [ids],
        "sorted, one batch": [ordered],
        f"sorted, {args.groups} batches": [ordered[i : i + size] for i in range(0, len(ordered), size)],
    }
    sampling = Sampling(max_new_tokens=args.new_tokens)
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    with torch.no_grad():
        for rep in range(args.reps):
            for way, batches in ways.items():
                torch.manual_seed(rep)
                start = time.perf_counter()
                for batch in batches:
                    query, mask = left_pad(batch, tokenizer.pad_token_id)
                    sample(lm, tokenizer, query, mask, sampling, pad_to_max_new_tokens=True)
                seconds[way].append(time.perf_counter() - start)
    for way, s in seconds.items():
        print(f"{way}: " + ", ".join(f"{x:.2f}" for x in s) + " s")
    return seconds


if __name__ == "__main__":
    main()
