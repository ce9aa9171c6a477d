"""Static KV cache and torch.compile for the decode step: measured here, not used by the sampler.

    python benchmarks/static_cache.py                                  # SmolLM2, batch 8 and 32, this CPU
    python benchmarks/static_cache.py --device cuda --batches 32       # on a GPU (CUDA graphs)

`fast_sampling.decode` grows transformers' `DynamicCache` by one column per token (a concatenation per layer)
and its attention mask with it, so every decode step has new shapes. A static cache (`StaticCache`, keys and
values preallocated for prompt + new tokens, written in place) with an attention mask of fixed width gives
every step the same shapes, which is what `torch.compile(dynamic=False)` needs to compile the step once (and,
on CUDA, `mode="reduce-overhead"` to replay it as a CUDA graph). Per batch size, three loops of `--new-tokens`
decode steps after the same eager prefill of a `--prompt-len`-token random prompt, the tokens drawn by
`fast_sampling.draw_tokens` from the same seeds:

    eager-dynamic    the model's forward with DynamicCache, the mask grown per step (what the sampler runs)
    eager-static     the same forward with StaticCache(max_cache_len = prompt + new tokens), a fixed-width mask
    compiled-static  eager-static's step through torch.compile(dynamic=False); the first call compiles

The eager loops run inside `fast_sampling.decoding_weights` as the sampler does (LoRA merged; on AMD CPUs the
weights prepacked for oneDNN); the compiled one with prepacking off (inductor cannot lower the prepacked op; it
packs weights itself). Printed per loop: ms per decode forward (the median over steps and calls after the first;
on CUDA each step is timed after the GPU's queued work), the wall time of the first call (compilation
included), how many drawn tokens differ from eager-dynamic's (same seeds), and the largest difference of the
logits from eager-dynamic's when both are fed eager-dynamic's tokens. The logits agree up to float rounding
(another summation order: ~1e-4 on SmolLM2's logits of up to ~40), and a draw whose uniform falls within
that of a boundary of the cumulative distribution flips, after which its row continues differently: with
49,152 tokens of non-negligible probability that is a fraction of a percent of the draws.
Models: those of `benchmarks/rollout.py` (`--model`).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollout as bench  # noqa: E402  (benchmarks/rollout.py: models, device clock)

from llm_rlhf.rl import fast_sampling  # noqa: E402

MODES = ("eager-dynamic", "eager-static", "compiled-static")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=bench.MODELS)
    p.add_argument("--batches", default="8,32", help="comma-separated batch sizes")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument(
        "--calls", type=int, default=4, help="decode loops per mode and batch (the first warms up)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--reviews-dir", default=str(bench.REPO / "data" / "reviews" / "base_model"))
    p.add_argument("--smollm2-dir", default=str(bench.REPO / "data" / "smollm2-135m-instruct"))
    p.add_argument("--lora-r", type=int, default=16)
    return p.parse_args(argv)


def decode_loop(forward, inner, query, new_tokens: int, *, static: bool, seed: int, forced=None):
    """Prefill `query` (B, P) eagerly, then `new_tokens` decode steps through `forward`; returns (tokens (B, N),
    seconds per decode forward, logits (B, N, V) of the N positions sampled from). static: StaticCache and an
    attention mask of width P + N throughout (zeros ahead of the current token); else DynamicCache and a mask of
    width P + t + 1 at step t. forced (B, N): feed these tokens instead of the drawn ones (teacher forcing)."""
    from transformers import DynamicCache, StaticCache

    device = query.device
    B, P = query.shape
    N = new_tokens
    key = "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
    cache = (
        StaticCache(config=inner.config, max_cache_len=P + N) if static else DynamicCache(config=inner.config)
    )
    mask = torch.zeros(B, P + N, dtype=torch.long, device=device)  # (B, P + N): ones up to the current token
    mask[:, :P] = 1
    positions = torch.arange(P, device=device).expand(B, P)  # (B, P)
    torch.manual_seed(seed)
    out = inner(
        input_ids=query,
        attention_mask=mask if static else mask[:, :P],
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{key: cache},
    )
    tokens, seconds, logits = [], [], []
    for t in range(N):
        logits.append(out.logits[:, -1].float())  # (B, V); a copy: a CUDA graph's output is overwritten
        token = fast_sampling.draw_tokens(torch.softmax(logits[-1], dim=-1))  # (B,)
        token = token if forced is None else forced[:, t]
        tokens.append(token)
        bench.synchronize(device)
        start = time.perf_counter()
        mask[:, P + t] = 1
        out = forward(
            input_ids=token[:, None],
            attention_mask=mask if static else mask[:, : P + t + 1],
            position_ids=torch.full((B, 1), P + t, device=device),
            use_cache=True,
            logits_to_keep=1,
            **{key: cache},
        )
        bench.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return torch.stack(tokens, 1), seconds, torch.stack(logits, 1)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    lm, source = bench.build_model(args.model, args)
    lm = lm.to(device)
    inner = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    compiled = None
    if "compiled-static" in modes:
        compiled = torch.compile(
            inner.forward, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else None
        )
    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    )
    print(
        f"# static cache benchmark: {args.model} ({source}), {where}; prompt {args.prompt_len} + "
        f"{args.new_tokens} new tokens, {args.calls} calls per mode (the first warms up)\n"
    )
    print(
        "| batch | mode | ms / decode forward | first call s | draws differing from eager-dynamic's | "
        "max abs logit difference (same tokens fed) |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    results = []
    with torch.no_grad():
        for batch in [int(b) for b in args.batches.split(",")]:
            g = torch.Generator().manual_seed(batch)
            query = torch.randint(0, inner.config.vocab_size, (batch, args.prompt_len), generator=g).to(
                device
            )
            reference = reference_logits = None
            for mode in modes:
                forward = compiled if mode == "compiled-static" else inner.forward
                with fast_sampling.decoding_weights(lm, prepack=False if mode == "compiled-static" else None):
                    times, first = [], None
                    static = mode != "eager-dynamic"
                    for call in range(args.calls):
                        start = time.perf_counter()
                        tokens, seconds, _ = decode_loop(
                            forward, inner, query, args.new_tokens, static=static, seed=call
                        )
                        if call == 0:
                            first = time.perf_counter() - start
                        else:
                            times += seconds
                    if reference is None:  # the first mode is the reference (eager-dynamic by default)
                        reference = tokens
                    # teacher forcing: the reference's tokens fed, to compare the logits position by position
                    _, _, logits = decode_loop(
                        forward, inner, query, args.new_tokens, static=static, seed=0, forced=reference
                    )
                    if reference_logits is None:
                        reference_logits = logits
                differing = int((tokens != reference).sum())  # the last calls: the same seed
                gap = float((logits - reference_logits).abs().max())
                ms = 1000 * statistics.median(times) if times else float("nan")
                results.append(
                    {
                        "batch": batch,
                        "mode": mode,
                        "ms_per_forward": ms,
                        "first_call_s": first,
                        "draws_differing": differing,
                        "draws": tokens.numel(),
                        "max_logit_difference": gap,
                    }
                )
                print(
                    f"| {batch} | {mode} | {ms:.1f} | {first:.1f} | {differing} of {tokens.numel()} | "
                    f"{gap:.1e} |",
                    flush=True,
                )
    return results


if __name__ == "__main__":
    main()
