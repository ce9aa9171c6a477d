"""Two kernels the stages choose on a CPU, each timed against what it replaces, at the main job's shapes.

1. SFT's loss LM head (`llm_rlhf.training.compact_lm_head`): TRL 1.16's chunked kernel over every position of a
   (batch x length) micro-batch against the LM head at the labelled positions only, forward + backward of the
   log-probs with the entropy for the metrics; --vocab/--hidden give the head (SmolLM2: 49,152 x 576).
2. Attention (`llm_rlhf.models.loading.use_eager_attention`): SDPA against the eager form (two matmuls, a float32
   softmax) in bf16, forward + backward at a training shape and forward at a decode step (one query).

    python benchmarks/cpu_kernels.py                          # the main job's shapes
    python benchmarks/cpu_kernels.py --positions 1024 --labelled 640 --batch 32 --length 45

Prints the CPU (`lscpu`'s model name), then one line per comparison: the medians of --reps timed calls (after two
untimed ones) and the ratio. Times are from this process alone; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from trl.kernels import ChunkedLogProbFunction

from llm_rlhf.rl.token_math import logprobs_and_entropy_from_logits


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown CPU"


def median_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def lm_head_pair(args) -> tuple:
    """(TRL's kernel over every position, the head at the labelled positions): each a call doing forward and
    backward under bf16 autocast, as SFT's step does."""
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden) * 0.02  # frozen (tied embeddings under LoRA)
    hidden_all = torch.randn(args.positions, args.hidden)
    targets_all = torch.randint(0, args.vocab, (args.positions,))
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)

    def trl():
        h = hidden_all.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = ChunkedLogProbFunction.apply(
                h, weight, None, targets_all, 1.0, 32768, None, 1.0, ("log_probs", "entropy", "is_top1")
            )[0]
        (-logp.sum()).backward()

    def compact():
        h = hidden_all[: args.labelled].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head(h)
        logp, _ = logprobs_and_entropy_from_logits(
            logits=logits.float()[None], labels=targets_all[None, : args.labelled], entropy_grad=False
        )
        (-logp.sum()).backward()

    return trl, compact


def attention_pairs(args) -> list[tuple[str, object, object]]:
    """(name, SDPA call, eager call) in bf16: a training shape forward + backward, a decode step forward."""
    torch.manual_seed(0)
    dt, b, heads, t, d = torch.bfloat16, args.batch, args.heads, args.length, args.head_dim
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]  # (1, 1, T, T)

    def eager(q, k, v, mask):
        scores = (q @ k.transpose(-1, -2)) * d**-0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dt) @ v

    q, k, v = (torch.randn(b, heads, t, d, dtype=dt, requires_grad=True) for _ in range(3))

    def train_sdpa():
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal).sum().backward()

    def train_eager():
        eager(q, k, v, causal).sum().backward()

    q1, kc, vc = (torch.randn(b, heads, n, d, dtype=dt) for n in (1, t, t))
    seen = torch.ones(1, 1, 1, t, dtype=torch.bool)

    @torch.no_grad()
    def decode_sdpa():
        F.scaled_dot_product_attention(q1, kc, vc, attn_mask=seen)

    @torch.no_grad()
    def decode_eager():
        eager(q1, kc, vc, seen)

    return [
        (f"attention fwd+bwd ({b}, {heads}, {t}, {d}) bf16", train_sdpa, train_eager),
        (f"attention decode step ({b}, {heads}, 1 of {t}, {d}) bf16", decode_sdpa, decode_eager),
    ]


def main(argv=None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--positions", type=int, default=1024, help="SFT micro-batch positions (16 x 64)")
    parser.add_argument("--labelled", type=int, default=640, help="of them, positions with a label")
    parser.add_argument("--batch", type=int, default=32, help="attention: sequences (an RM step's 16 pairs)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--length", type=int, default=45)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 = as it is")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}; {torch.get_num_threads()} threads; torch {torch.__version__}", flush=True)
    trl, compact = lm_head_pair(args)
    rows = [
        (
            f"SFT loss LM head fwd+bwd: TRL's kernel at {args.positions} positions vs "
            f"the head at {args.labelled} labelled (V={args.vocab}, H={args.hidden}) bf16",
            trl,
            compact,
        )
    ]
    rows += attention_pairs(args)
    medians = {}
    for name, before, after in rows:
        slow, fast = median_ms(before, args.reps), median_ms(after, args.reps)
        print(f"{name}: {slow:.2f} ms -> {fast:.2f} ms ({slow / fast:.2f}x)", flush=True)
        medians[name] = (slow, fast)
    return medians


if __name__ == "__main__":
    main()
