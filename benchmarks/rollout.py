"""Rollout benchmark: sampling speed against this machine's limit.

    python benchmarks/rollout.py                         # reviews 4M, SmolLM2 full, SmolLM2 + LoRA; batch 8/32/64
    python benchmarks/rollout.py --models smollm2-lora --batches 32 --reps 3

For each model and batch size, `llm_rlhf.rl.rollout.sample` (what PPO, held-out evaluation and best-of-n run)
samples `--new-tokens` tokens after a `--prompt-len`-token prompt of random token ids, on two paths in the
same process, alternated (generate, fast, generate, fast, ...) so both see the same load:

    generate   transformers' `generate` (the path taken where `fast_sampling.supports` answers False)
    fast       `fast_sampling.generate` (the default: its own decode loop, inverse-CDF draws, LoRA merged and
               weights prepacked for decoding)

and with `--paths all` the steps between them, each adding one idea to the path before it:

    loop             `fast_sampling.decode` with generate's draw (torch.multinomial), the weights as they are
    loop+draw        + inverse-CDF draws (`fast_sampling.draw_tokens`)
    loop+draw+merge  + LoRA merged into a copy of the weights (`decoding_weights(prepack=False)`)
    fast-bf16        the fast path with `sampling_dtype: bfloat16` (the opt-in: every linear layer from a
                     bfloat16 copy; another distribution, so its KL to the policy is printed too)
    fast-compiled    the fast path with `sampling_compile: true` (the opt-in: decode steps with a static KV
                     cache through torch.compile, CUDA graphs on a GPU; the first call compiles, which the
                     median step leaves out)

Per path: ms per decode step (the median interval between the starts of consecutive forwards of the model,
so one step = drawing a token + the forward that feeds it back; the prefill is left out; no warm-up call,
the median is robust to the first steps), and tokens per second of the whole `sample` call (B * new tokens /
wall time, prefill and set-up included; the best of the timed calls). On the paths that record the sampler's
log-probs (fast, fast-bf16), also the sampler-vs-policy KL per token of the last call: the mean over the
sampled tokens of log q(y_t) - log pi(y_t), pi from the float32 forward PPO computes its log-probs with
(`rollout.response_logprobs_and_values`); ~1e-7 for fp32 sampling.

The roofline of one decode step at batch B, with N = the weights of every matmul (the LM head included, tied
or not; LoRA's adapters included), L = the sequence length at the step:

    FLOPs = 2 * N * B + 4 * n_layer * d_attn * L * B        (matmuls + attention's QK^T and AV)
    bytes = 4 * N + 2 * 4 * n_layer * d_kv * L * B          (every fp32 weight read once + the KV cache)
    roofline = max(FLOPs / peak, bytes / bandwidth)

with peak = an fp32 `--peak-size` square matmul and bandwidth = a `--bandwidth-mib` fp32 copy (bytes read +
written), both timed by this script (best of repeats, before the models run). ratio = measured / roofline (1 is
the limit). The models: `--reviews-dir` (the reviews task's 4M GPT-2, committed in data/), `--smollm2-dir`
(SmolLM2-135M-Instruct, `python data/make_smollm2.py`; when the folder is missing, a model of its config with
random weights, which runs the same matmuls: the table says which), and SmolLM2 with a rank-16 LoRA on q_proj
and v_proj (peft, unmerged, eval mode: as PPO holds it). `--device cuda` runs the models, the peak matmul
and the copy on a GPU (the decode-step clock waits for the GPU's queued work at each step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llm_rlhf.models.loading import Reference  # noqa: E402
from llm_rlhf.rl import fast_sampling  # noqa: E402
from llm_rlhf.rl.rollout import Sampling, response_logprobs_and_values, sample  # noqa: E402

MODELS = ("reviews", "smollm2", "smollm2-lora")
CPU = torch.device("cpu")
PATHS = ("generate", "fast")
# The ideas of the fast sampler one at a time (`--paths all`), each path adding one to the one before it.
ABLATION = ("generate", "loop", "loop+draw", "loop+draw+merge", "fast", "fast-bf16", "fast-compiled")
# SmolLM2-135M-Instruct's config.json (the architecture; no weights), for a clone without the folder.
SMOLLM2_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    vocab_size=49152,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--batches", default="8,32,64", help="comma-separated batch sizes")
    p.add_argument(
        "--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(ABLATION)}; or all"
    )
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--reps", type=int, default=2, help="timed `sample` calls per model, batch and path")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--device", default="cpu", help="where the models, the peak matmul and the copy run (cpu, cuda)"
    )
    p.add_argument("--reviews-dir", default=str(REPO / "data" / "reviews" / "base_model"))
    p.add_argument("--smollm2-dir", default=str(REPO / "data" / "smollm2-135m-instruct"))
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument(
        "--peak-size", type=int, default=2048, help="n of the n x n fp32 matmul that defines the peak"
    )
    p.add_argument("--bandwidth-mib", type=int, default=256, help="size of the copied buffer")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a CPU has nothing to wait for)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(n: int, seconds: float = 1.0, device: torch.device = CPU) -> float:
    """FLOP/s of an fp32 n x n @ n x n matmul (2 n^3 FLOPs), best of the timings in `seconds` (on CUDA in
    torch's default precision for fp32 matmuls: TF32 off)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    torch.mm(a, b)  # warm-up
    synchronize(device)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def copy_bandwidth(mib: int, repeats: int = 5, device: torch.device = CPU) -> float:
    """Bytes/s of copying an fp32 buffer of `mib` MiB into another (bytes read + bytes written), best of
    `repeats`."""
    a = torch.ones(mib * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    b.copy_(a)  # warm-up: the pages exist
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best


def build_model(name: str, args):
    """(lm, description) in eval mode, fp32, on the CPU (`bench_model` moves it to --device)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if name == "reviews":
        return AutoModelForCausalLM.from_pretrained(
            args.reviews_dir, dtype=torch.float32
        ).eval(), args.reviews_dir
    folder = Path(args.smollm2_dir)
    if folder.is_dir():
        lm, source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), str(folder)
    else:
        torch.manual_seed(0)
        lm, source = LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)), f"random weights ({folder} missing)"
    if name == "smollm2-lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]
        )
        lm = get_peft_model(lm, config)
        source += f" + LoRA r={args.lora_r} on q_proj, v_proj (unmerged)"
    return lm.eval(), source


def matmul_weights(lm) -> int:
    """N: the weights of every linear layer (nn.Linear, GPT-2's Conv1D, LoRA's A and B), the LM head included
    even when it is tied to the embedding (a decode step multiplies by it)."""
    from transformers.pytorch_utils import Conv1D

    return sum(m.weight.numel() for m in lm.modules() if type(m) in (torch.nn.Linear, Conv1D))


def attention_dims(lm) -> tuple[int, int, int]:
    """(n_layer, d_attn = heads * head_dim, d_kv = kv heads * head_dim) from the model's config."""
    c = lm.config
    n_layer = getattr(c, "num_hidden_layers", None) or c.n_layer
    d = getattr(c, "hidden_size", None) or c.n_embd
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    head_dim = getattr(c, "head_dim", None) or d // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return n_layer, heads * head_dim, kv_heads * head_dim


def roofline_seconds(lm, *, batch: int, length: int, peak: float, bandwidth: float) -> dict:
    """The limit of one decode step at sequence length `length` (module docstring)."""
    N = matmul_weights(lm)
    n_layer, d_attn, d_kv = attention_dims(lm)
    flops = 2 * N * batch + 4 * n_layer * d_attn * length * batch
    nbytes = 4 * N + 2 * 4 * n_layer * d_kv * length * batch
    return {
        "flops": flops,
        "bytes": nbytes,
        "seconds": max(flops / peak, nbytes / bandwidth),
        "bound": "compute" if flops / peak > nbytes / bandwidth else "memory",
    }


class StepClock:
    """Start times of every forward of `module` (a pre-hook), to time decode steps inside `sample`; on CUDA
    each after the work queued before it has finished, so an interval is a step's device time, not its launch."""

    def __init__(self, module, device: torch.device = CPU):
        self.starts: list[float] = []
        self.device = device
        self.handle = module.register_forward_pre_hook(lambda *_: self.tick())

    def tick(self) -> None:
        synchronize(self.device)
        self.starts.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        """Intervals between consecutive forward starts after the first (the prefill): one per decode step."""
        return [b - a for a, b in zip(self.starts[1:], self.starts[2:])]


class Tokens:
    """What `sample` reads of a tokenizer: the ids of EOS and padding (no stop strings here)."""

    def __init__(self, lm):
        eos = lm.config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.pad_token_id = self.eos_token_id


def on_path(path: str):
    """A context in which `rollout.sample` runs `path` (module docstring)."""
    multinomial = lambda probs: torch.multinomial(probs, num_samples=1).squeeze(1)  # noqa: E731
    as_they_are = lambda lm, **kw: nullcontext()  # noqa: E731
    merge_only = lambda lm, original=fast_sampling.decoding_weights, **kw: original(lm, prepack=False)  # noqa: E731
    patches = {
        "generate": {"supports": lambda lm: False},
        "loop": {"draw_tokens": multinomial, "decoding_weights": as_they_are},
        "loop+draw": {"decoding_weights": as_they_are},
        "loop+draw+merge": {"decoding_weights": merge_only},
        "fast": {},
        "fast-bf16": {},
        "fast-compiled": {},
    }[path]
    return mock.patch.multiple(fast_sampling, **patches) if patches else nullcontext()


def sample_once(lm, tokens, query, path: str, new_tokens: int, clock: StepClock) -> dict:
    """One `rollout.sample` call on `path`; its wall time, decode-step intervals, response width and samples."""
    clock.starts.clear()
    sampling = Sampling(
        max_new_tokens=new_tokens,
        sampling_dtype="bfloat16" if path == "fast-bf16" else "float32",
        sampling_compile=path == "fast-compiled",
    )
    compiled = fast_sampling.compiled_step

    def timed_step(model):  # the compiled steps call the model's forward function: no module hook sees them
        step = compiled(model)

        def run(*args, **kwargs):
            clock.tick()
            return step(*args, **kwargs)

        return run

    with on_path(path), mock.patch.object(fast_sampling, "compiled_step", timed_step):
        synchronize(query.device)
        t = time.perf_counter()
        out = sample(lm, tokens, query, torch.ones_like(query), sampling)
        synchronize(query.device)
        wall = time.perf_counter() - t
    return {
        "wall": wall,
        "steps": clock.step_seconds(),
        "width": out.response.shape[1],
        "samples": out,
        "sampling": sampling,
    }


def sampler_kl(lm, tokens, run: dict) -> float | None:
    """KL(q || pi) per token of one call's samples: mean over response tokens of log q(y_t) - log pi(y_t), q the
    sampler's (`Samples.sampler_logprobs`), pi the float32 forward's; None where the path records no q."""
    samples = run["samples"]
    if samples.sampler_logprobs is None:
        return None
    logprobs, _, _ = response_logprobs_and_values(
        Reference(lm), samples, run["sampling"], eos_token_id=tokens.eos_token_id, entropy="none"
    )
    mask = samples.response_mask
    return float((samples.sampler_logprobs - logprobs)[mask].double().mean())


def bench_model(name: str, args, *, peak: float, bandwidth: float) -> dict:
    device = torch.device(args.device)
    lm, source = build_model(name, args)
    lm = lm.to(device)
    inner = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    clock = StepClock(inner, device)
    tokens = Tokens(inner)
    paths = list(ABLATION) if args.paths == "all" else args.paths.split(",")
    vocab = inner.config.vocab_size
    result = {"model": name, "source": source, "matmul_weights": matmul_weights(lm), "batches": {}}
    with torch.no_grad():
        for batch in [int(b) for b in args.batches.split(",")]:
            g = torch.Generator().manual_seed(batch)
            query = torch.randint(0, vocab, (batch, args.prompt_len), generator=g).to(device)  # (B, P) ids
            runs = {path: [] for path in paths}
            for rep in range(args.reps):  # alternated, so both paths see the same load
                for path in paths if rep % 2 == 0 else paths[::-1]:
                    torch.manual_seed(rep)
                    runs[path].append(sample_once(lm, tokens, query, path, args.new_tokens, clock))
            # the mean length over the decode steps: prompt + half the new tokens
            roof = roofline_seconds(
                lm, batch=batch, length=args.prompt_len + args.new_tokens // 2, peak=peak, bandwidth=bandwidth
            )
            entry = {
                "roofline_ms": 1000 * roof["seconds"],
                "bound": roof["bound"],
                "flops_per_step": roof["flops"],
                "bytes_per_step": roof["bytes"],
                "paths": {},
            }
            for path, rs in runs.items():
                step = statistics.median(s for r in rs for s in r["steps"])
                new = max(batch * r["width"] / r["wall"] for r in rs)  # the best call: the first one warms up
                entry["paths"][path] = {
                    "ms_per_step": 1000 * step,
                    "tokens_per_s": new,
                    "ratio_to_roofline": step / roof["seconds"],
                    "kl_sampler_per_token": sampler_kl(lm, tokens, rs[-1]),
                }
            result["batches"][batch] = entry
            print(format_rows(name, batch, entry), flush=True)
    return result


def format_rows(name: str, batch: int, entry: dict) -> str:
    rows = []
    for path, p in entry["paths"].items():
        kl = "-" if p["kl_sampler_per_token"] is None else f"{p['kl_sampler_per_token']:.1e}"
        rows.append(
            f"| {name} | {batch} | {path} | {p['ms_per_step']:.1f} | {p['tokens_per_s']:,.0f} | "
            f"{entry['roofline_ms']:.1f} ({entry['bound']}) | **{p['ratio_to_roofline']:.2f}** | {kl} |"
        )
    return "\n".join(rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    device = torch.device(args.device)
    peak = matmul_peak(args.peak_size, device=device)
    bandwidth = copy_bandwidth(args.bandwidth_mib, device=device)
    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    )
    for path in ABLATION if args.paths == "all" else args.paths.split(","):
        on_path(path)  # an unknown path fails here, not after minutes
    print(
        f"# rollout benchmark: {where}, load {os.getloadavg()[0]:.1f}; fp32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s ({args.peak_size}^3), copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); "
        f"prompt {args.prompt_len} + {args.new_tokens} new tokens, {args.reps} timed calls per path\n"
    )
    print(
        "| model | batch | path | ms / decode step | tokens/s | roofline ms (bound) | measured / roofline "
        "| KL(sampler, policy) / token |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    results = [bench_model(name, args, peak=peak, bandwidth=bandwidth) for name in args.models.split(",")]
    for r in results:
        print(f"\n{r['model']}: {r['source']}, {r['matmul_weights'] / 1e6:.1f}M matmul weights")
    out = {
        "threads": torch.get_num_threads(),
        "device": where,
        "matmul_peak_gflops": peak / 1e9,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "config": vars(args),
        "models": results,
        "seconds": time.perf_counter() - start,
    }
    print(f"\n{out['seconds']:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
