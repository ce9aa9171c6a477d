"""Benchmark of one PPO step (`llm_rlhf.ppo.trainer.PPOTrainer.ppo_step`) on a model of a given shape.

    python benchmarks/ppo_step.py --model small                        # the reviews task's shape
    python benchmarks/ppo_step.py --model gpt2 --lora --bf16           # GPT-2 124M shape, LoRA, bf16 autocast
    python benchmarks/ppo_step.py --model gpt2 --matrix --json out.json  # {full, LoRA} x {fp32, bf16}, one process each
    python benchmarks/ppo_step.py --value_model reward                  # the separate critic (from the RM)
    python benchmarks/ppo_step.py --advantage-estimator grpo --samples-per-prompt 4 --rollout 8
                                                    # critic-free: 8 prompts x 4 samples, no value head
    python benchmarks/ppo_step.py --model-dir data/smollm2-135m-instruct --lora   # any local causal LM
    python benchmarks/ppo_step.py --model smollm2 --lora --device cuda   # SmolLM2-135M's shape on a GPU

Models are built from a config with random weights (never downloaded) and saved as HF folders in a
temporary directory: the policy (`GPT2LMHeadModel`, or `LlamaForCausalLM` of SmolLM2-135M's config for
`--model smollm2`, + a byte-level BPE tokenizer whose vocabulary has exactly the model's `vocab_size`) and
a reward model saved by `llm_rlhf.models.reward_model.save_reward_model`.
With --model-dir the policy is that folder (any causal-LM architecture) and the reward model is its
trunk with a fresh score head (`AutoModelForSequenceClassification`), as `llm-rlhf rm` starts from the
SFT model. The trainer is built by `llm_rlhf.ppo.building.build_trainer`, as `llm-rlhf ppo` does.

Per phase (generate = the sampler only: `fast_sampling.generate`, or `policy.lm.generate` for a model it does
not support; old log-probs and values = the policy forward after it, absent where the update's forward gives
them: one update per step, critic-free, the KL in the loss, `PPOTrainer.old_logprobs_from_update`;
reference; reward model; update = `train_on_rollout`): seconds, tokens per second, share of the step.
The phases are timed by wrapping the trainer's methods here; ppo.py is not changed for it.

Training-phase FLOPs (model FLOPs, gradient-checkpointing recompute not counted), summed over the
forwards that ran, each on b rows of width L (prompt + response, trimmed to the rows' real tokens) with
the LM head at K positions (the response):

    full fine-tuning:  6 * (N_trunk * b*L + N_head * b*K) + 12 * n_layer * d * b * L*L
    LoRA:              the same with 4 (forward + input gradient) for the frozen weights and 6 for the adapters
    separate critic:   + 6 * N_critic * b*L + 12 * n_layer * d * b * L*L (the critic is fully trained)

N_trunk = weights of the transformer blocks' matmuls (embeddings are look-ups), N_head = vocab * d (the
LM head, useful only at the K response positions), the last term is attention's QK^T and AV
(2 * 2 * n_layer * L * d per token forward, causal mask not halved, times 3 for forward + backward).
The no-grad forwards count 2 per weight and 4 * n_layer * d * L per token. The shapes come from forward
pre-hooks, so a batch whose responses stopped early counts the tokens it computed, not
prompt + max_new_tokens. MFU = training FLOPs / update seconds / matmul peak, where the peak is a square
matmul (`--peak-size`, 2048) timed in this process, in fp32, or in bf16 with --bf16 (only then: on a CPU
without native bf16 matmuls the bf16 peak alone takes minutes).

Peak memory: max RSS of this process (CPU) or max allocated (CUDA). Each --matrix entry runs in its own
process so the peaks do not mix.

--device (default: cuda when there is one) is where the trainer's Accelerator puts the models, and where the
matmul peak, the peak memory and the clocks are taken: on CUDA every timer waits for the queued work
(`torch.cuda.synchronize`) before it reads the clock. --threads sets torch's CPU threads on the CPU only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llm_rlhf.rl import fast_sampling  # noqa: E402

# The reviews task's base model (data/make_base_model.py defaults) and GPT-2 124M (GPT2Config() defaults);
# smollm2: SmolLM2-135M's Llama config (`smollm2_config`), not a GPT-2 shape.
SHAPES = {
    "small": dict(n_layer=4, n_head=4, n_embd=256, n_positions=128, vocab_size=4096),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257),
    "smollm2": None,
}
PHASES = ("generate", "old_logprobs_values", "reference", "reward_model", "update")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="small", help="model shape (random weights)")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the models, the matmul peak and the clocks run: cpu, cuda (default: cuda when there is one)",
    )
    p.add_argument(
        "--model-dir",
        help="use this HF causal-LM folder as the policy instead, any architecture "
        "(e.g. data/reviews/base_model, data/smollm2-135m-instruct)",
    )
    p.add_argument(
        "--prompt-file",
        help="prompts from this file (e.g. data/reviews/ppo_prompts.jsonl), encoded as `llm-rlhf ppo` does, "
        "instead of --prompt-len random tokens (a real model's response lengths depend on its prompts)",
    )
    p.add_argument("--n-layer", type=int, help="override the shape")
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--rollout", type=int, default=32, help="rollout_batch_size (prompts per step)")
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        help="samples_per_prompt (a step holds rollout x this many episodes)",
    )
    p.add_argument(
        "--advantage-estimator",
        default="gae",
        choices=("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "remax"),
        help="advantage_estimator (the critic-free ones build no value head)",
    )
    p.add_argument("--mini-batch", type=int, default=16, help="mini_batch_size (episodes)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (all prompts this long)")
    p.add_argument("--new-tokens", type=int, default=32, help="max_new_tokens")
    p.add_argument("--lora", action="store_true", help="use_lora (r=16, peft default target modules)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument(
        "--sampling-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="sampling_dtype (bfloat16: the opt-in lower-precision sampler)",
    )
    p.add_argument(
        "--sampling-compile",
        "--compile-sampler",
        action="store_true",
        help="sampling_compile (decode steps compiled, static cache; CUDA graphs on a GPU)",
    )
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument(
        "--value_model",
        "--value-model",
        choices=("policy", "reward"),
        default="policy",
        help="the critic: a value head on the policy trunk, or a separate critic from the reward model",
    )
    p.add_argument("--steps", type=int, default=3, help="timed PPO steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="untimed PPO steps first")
    p.add_argument(
        "--gen-reps", type=int, default=3, help="rounds of bare vs rollout generation, side by side"
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (on the CPU only)")
    p.add_argument("--peak-size", type=int, default=2048, help="n of the n x n matmul that defines the peak")
    p.add_argument("--profile", help="write a torch.profiler table of one extra step to this file")
    p.add_argument(
        "--matrix", action="store_true", help="run {full, LoRA} x {fp32, bf16}, each in its own process"
    )
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--workdir", help="where to build the model folders (default: a temporary folder)")
    p.add_argument("--policy-dir", help=argparse.SUPPRESS)  # set by --matrix for its children
    p.add_argument("--rm-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Building the folders
# ---------------------------------------------------------------------------------------------


def smollm2_config(*, n_layer=None, n_head=None, n_embd=None, vocab_size=None):
    """SmolLM2-135M's architecture (`rollout.py`'s SMOLLM2_CONFIG, its config.json: Llama, 30 layers, d 576,
    9 heads of 64, 3 KV heads, MLP 1536, vocabulary 49152, tied LM head) with this script's tokenizer's ids
    (<|endoftext|> = 0 is bos, eos and pad). The overrides (the tests' tiny versions) keep its proportions:
    head_dim = d / heads, the KV heads a divisor of the heads, the MLP 1536/576 of d."""
    from transformers import LlamaConfig

    spec = importlib.util.spec_from_file_location("rollout_benchmark", REPO / "benchmarks" / "rollout.py")
    rollout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rollout)
    c = dict(rollout.SMOLLM2_CONFIG, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if n_embd or n_head:
        d, heads = n_embd or c["hidden_size"], n_head or c["num_attention_heads"]
        c.update(
            intermediate_size=c["intermediate_size"] * d // c["hidden_size"],
            hidden_size=d,
            num_attention_heads=heads,
            head_dim=d // heads,
            num_key_value_heads=math.gcd(c["num_key_value_heads"], heads),
        )
    c["num_hidden_layers"] = n_layer or c["num_hidden_layers"]
    c["vocab_size"] = vocab_size or c["vocab_size"]
    return LlamaConfig(**c)


def model_config(args):
    """The policy's config: the --model-dir folder's (any architecture), SmolLM2-135M's or a GPT-2 shape."""
    from transformers import AutoConfig, GPT2Config

    if args.model_dir:
        return AutoConfig.from_pretrained(args.model_dir)
    overrides = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")}
    if args.model == "smollm2":
        return smollm2_config(**overrides)
    shape = dict(SHAPES[args.model])
    shape.update({k: v for k, v in overrides.items() if v is not None})
    return GPT2Config(**shape, bos_token_id=0, eos_token_id=0)


def build_tokenizer(vocab_size: int):
    """Byte-level BPE (GPT-2 style, `<|endoftext|>` = id 0 = bos/eos, no pad) trained on the reviews
    corpus; when the corpus yields fewer merges than vocab_size, never-seen filler tokens make up the
    rest, so the tokenizer has exactly the model's vocabulary (the LM head's full width is real)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = REPO / "data" / "reviews" / "pretrain.jsonl"
    if corpus.exists():
        texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    else:
        texts = ["The film is a delight from start to finish.", "A tedious, boring waste of time."] * 50
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|filler{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast


def build_folders(args, workdir: Path) -> tuple[Path, Path]:
    """policy folder (causal LM + tokenizer) and reward-model folder (as `llm-rlhf rm` saves it)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    from llm_rlhf.models.loading import load_tokenizer
    from llm_rlhf.models.reward_model import (
        RewardModel,
        add_pad_token,
        load_sequence_classifier,
        save_reward_model,
    )

    config = model_config(args)
    policy_dir, rm_dir = workdir / "policy", workdir / "rm"
    if (rm_dir / "config.json").exists() and not args.model_dir:  # built before in this --workdir
        saved = AutoConfig.from_pretrained(policy_dir)
        keys = ("model_type", "num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
        if all(getattr(saved, k) == getattr(config, k) for k in keys):
            return policy_dir, rm_dir
    if args.model_dir:
        policy_dir = Path(args.model_dir)
        tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    else:
        tokenizer = build_tokenizer(config.vocab_size)
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(config)
        lm.generation_config.pad_token_id = tokenizer.eos_token_id
        lm.save_pretrained(policy_dir, safe_serialization=True)
        tokenizer.save_pretrained(policy_dir)
        del lm
    torch.manual_seed(1)
    if args.model_dir:  # the trunk's weights and a fresh score head, whatever the architecture
        model = load_sequence_classifier(
            str(policy_dir), dtype="float32", trust_remote_code=False, need_head=False
        )
    else:
        labels = ("id2label", "label2id")  # the config's default two labels would contradict num_labels=1
        rm_config = {k: v for k, v in config.to_dict().items() if k not in labels}
        model = AutoModelForSequenceClassification.from_config(
            config.__class__.from_dict({**rm_config, "num_labels": 1})
        )
    rm_tokenizer = load_tokenizer(str(policy_dir))
    add_pad_token(model, rm_tokenizer)
    save_reward_model(
        RewardModel(
            model, rm_tokenizer, {"mean": 0.0, "std": 1.0, "reference_set": "benchmark: random weights"}
        ),
        rm_dir,
        merge_lora=False,
    )
    return policy_dir, rm_dir


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the device's queued work before a clock is read (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """The card (`torch.cuda.get_device_name`) or the CPU (`lscpu`'s model name) the figures were taken on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True, env={**os.environ, "LC_ALL": "C"}
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:")]
    return names[0] if names else platform.processor() or "cpu"


def matmul_peak(n: int, dtype: torch.dtype, device: torch.device, seconds: float = 1.5) -> float:
    """FLOP/s of an n x n @ n x n matmul (2 n^3 FLOPs), best of repeated timings."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # warm-up
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        sync(device)
        t = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


class PhaseTimer:
    """Exclusive seconds per phase: a phase nested in another (forward_policy inside generate) is
    subtracted from its parent, so the phases add up to at most the step time."""

    def __init__(self, device):
        self.device, self.seconds, self.stack, self.names = device, {}, [], []

    @property
    def current(self) -> str | None:
        """The innermost phase running now (None outside the timed methods)."""
        return self.names[-1] if self.names else None

    def wrap(self, fn, phase_of):
        def timed(*a, **kw):
            phase = phase_of(*a, **kw)
            if phase is None:
                return fn(*a, **kw)
            sync(self.device)
            self.stack.append(0.0)
            self.names.append(phase)
            t = time.perf_counter()
            try:
                with torch.profiler.record_function(f"phase/{phase}"):  # names the phase in --profile
                    return fn(*a, **kw)
            finally:
                sync(self.device)
                elapsed = time.perf_counter() - t
                children = self.stack.pop()
                self.names.pop()
                self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed - children
                if self.stack:
                    self.stack[-1] += elapsed

        return timed


def instrument(trainer, timer: PhaseTimer) -> None:
    in_update = {"on": False}
    lm = trainer.unwrapped_policy.lm
    lm.generate = timer.wrap(lm.generate, lambda *a, **kw: "generate")
    trainer.collector.generate = timer.wrap(trainer.collector.generate, lambda *a, **kw: "rollout_other")
    trainer.forward_policy = timer.wrap(
        trainer.forward_policy,
        lambda *a, train=False, **kw: None if in_update["on"] else "old_logprobs_values",
    )
    trainer.reference_logprobs = timer.wrap(trainer.reference_logprobs, lambda *a, **kw: "reference")
    trainer.collector.score = timer.wrap(trainer.collector.score, lambda *a, **kw: "reward_model")
    train_on_rollout = timer.wrap(trainer.train_on_rollout, lambda *a, **kw: "update")

    def update(*a, **kw):
        in_update["on"] = True
        try:
            return train_on_rollout(*a, **kw)
        finally:
            in_update["on"] = False

    trainer.train_on_rollout = update


def param_counts(model) -> dict:
    """Weights by role: trunk matmuls, LM head, embeddings (look-ups), LoRA adapters; frozen or not; and
    the shape (n_layer, d). Any causal LM or sequence classifier (its score head is counted in the trunk)."""
    counts = {"trunk": 0, "trunk_frozen": 0, "lora": 0, "embeddings": 0, "head": 0, "head_frozen": True}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    output = base.get_output_embeddings()
    head = output.weight if output is not None else None
    if head is not None:
        counts["head"], counts["head_frozen"] = head.numel(), not head.requires_grad
    head_ptr = head.data_ptr() if head is not None else None
    emb_ptrs = {m.weight.data_ptr() for m in base.modules() if isinstance(m, torch.nn.Embedding)}
    for name, p in model.named_parameters():
        if "lora_" in name:
            counts["lora"] += p.numel()
        elif p.data_ptr() == head_ptr:
            continue
        elif p.data_ptr() in emb_ptrs:
            counts["embeddings"] += p.numel()
        elif p.dim() >= 2:  # matmul weights (biases and norms are O(d) per token: not counted)
            counts["trunk"] += p.numel()
            counts["trunk_frozen"] += 0 if p.requires_grad else p.numel()
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    counts["n_layer"], counts["d"] = config.num_hidden_layers, config.hidden_size
    return counts


def forward_flops(c: dict, *, b: int, L: int, K: int, adapters: bool = True) -> float:
    """A no-grad forward of b rows of width L, the LM head at K positions: 2 FLOPs per weight per token,
    plus attention (4 * n_layer * d * L per token). adapters=False: LoRA switched off (the reference)."""
    weights = c["trunk"] + (c["lora"] if adapters else 0)
    return float(2 * weights * b * L + 2 * c["head"] * b * K + 4 * c["n_layer"] * c["d"] * b * L * L)


def training_flops(c: dict, *, b: int, L: int, K: int) -> float:
    """Forward + backward of b rows of width L (the docstring's formula): 6 per trained weight per token,
    4 per frozen one (no weight gradient), attention 12 * n_layer * d * L per token."""
    trunk = 4 * c["trunk_frozen"] + 6 * (c["trunk"] - c["trunk_frozen"])
    head = (4 if c["head_frozen"] else 6) * c["head"]
    return float(
        trunk * b * L + head * b * K + 6 * c["lora"] * b * L + 12 * c["n_layer"] * c["d"] * b * L * L
    )


class ShapeLog:
    """The shape of every forward the timed phases run, from forward pre-hooks on the networks: per phase,
    (role, b, L, K) per call; role "lm" (policy or reference), "critic" or "reward_model"; K = the LM
    head's positions (0 for the others). The FLOPs and tokens are counted on these shapes, which are
    trimmed to the rows' real tokens, not on prompt + max_new_tokens."""

    def __init__(self, timer: PhaseTimer):
        self.timer, self.calls, self.on = timer, {}, False

    def watch(self, module, role: str) -> None:
        def record(_module, args, kwargs):
            phase = self.timer.current
            if not self.on or phase in (None, "generate"):
                return
            b, L = (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape
            keep = kwargs.get("logits_to_keep", 0)
            K = 0 if role != "lm" else len(keep) if isinstance(keep, torch.Tensor) else keep or L
            self.calls.setdefault(phase, []).append((role, b, L, K))

        module.register_forward_pre_hook(record, with_kwargs=True)

    def flops(self, phase: str, nets: dict[str, dict]) -> float:
        train = phase == "update"
        total = 0.0
        for role, b, L, K in self.calls.get(phase, []):
            c = nets[role]
            if train:
                total += training_flops(c, b=b, L=L, K=K)
            else:
                total += forward_flops(c, b=b, L=L, K=K, adapters=phase != "reference")
        return total

    def tokens(self, phase: str) -> int:
        """Tokens the phase's forwards ran on (a critic reads the policy's tokens: not counted twice)."""
        role = "reward_model" if phase == "reward_model" else "lm"
        return sum(b * L for r, b, L, _ in self.calls.get(phase, []) if r == role)


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class RssSampler:
    """Max RSS while the PPO steps run (excludes the transient peak of loading the models)."""

    def __init__(self, interval=0.02):
        import psutil

        self.proc, self.interval, self.peak, self._stop = psutil.Process(), interval, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


def compare_generation(trainer, args, device, reps: int) -> dict:
    from llm_rlhf.rl.rollout import left_pad

    """Rollout generation (the trainer's `generate` minus its policy forward) vs a bare `model.generate`
    with the same model, batch, lengths and autocast, alternating so both see the same machine load."""
    lm = trainer.unwrapped_policy.lm
    tok = trainer.tokenizer
    queries = trainer.collector.queries(trainer.step)
    query, mask = left_pad(queries, tok.pad_token_id, device)  # (B, P) each
    bare_s, bare_tokens, roll_s, roll_tokens = 0.0, 0, 0.0, 0
    forward_policy = trainer.forward_policy
    for rep in range(reps):
        torch.manual_seed(rep)
        sync(device)
        t = time.perf_counter()
        with torch.no_grad(), trainer.accelerated.autocast():
            out = lm.generate(
                input_ids=query,
                attention_mask=mask,
                do_sample=True,
                max_new_tokens=args.new_tokens,
                pad_token_id=tok.pad_token_id,
            )
        sync(device)
        bare_s += time.perf_counter() - t
        bare_tokens += query.shape[0] * (out.shape[1] - query.shape[1])

        steps = {}

        def counting(inner, steps=steps):  # the sampler returns (B, P + n): n steps ran
            def sampler(*a, **kw):
                seq = inner(*a, **kw)
                steps["n"] = seq.shape[1] - query.shape[1]
                return seq

            return sampler

        trainer.forward_policy = lambda part, **kw: (torch.zeros(part.response.shape),) * 3  # generation only
        torch.manual_seed(rep)
        sync(device)
        t = time.perf_counter()
        try:  # the sampler `rollout.sample` runs: fast_sampling's, or `generate` for a model it does not support
            with mock.patch.object(fast_sampling, "generate", counting(fast_sampling.generate)):
                with mock.patch.object(lm, "generate", counting(lm.generate)):
                    trainer.collector.generate(queries)
        finally:
            trainer.forward_policy = forward_policy
        sync(device)
        roll_s += time.perf_counter() - t
        roll_tokens += query.shape[0] * steps["n"]
    return {
        "bare_generate_tokens_per_s": bare_tokens / bare_s,
        "rollout_generate_tokens_per_s": roll_tokens / roll_s,
        "rollout_vs_bare": (roll_tokens / roll_s) / (bare_tokens / bare_s),
    }


def make_prompts(args, cfg, tokenizer, vocab_size: int, n: int) -> list[list[int]]:
    """--prompt-file encoded as `llm-rlhf ppo` does, or n prompts of --prompt-len random non-special tokens."""
    from llm_rlhf.ppo import building as ppo_building

    if args.prompt_file:
        return ppo_building.load_prompt_ids(cfg, tokenizer)
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)))
    ordinary = torch.tensor([i for i in range(vocab_size) if i not in set(special.tolist())])  # (V',)
    g = torch.Generator().manual_seed(0)
    return [
        ordinary[torch.randint(len(ordinary), (args.prompt_len,), generator=g)].tolist() for _ in range(n)
    ]


def run_one(args) -> dict:
    from accelerate import Accelerator

    from llm_rlhf.models.loading import load_tokenizer
    from llm_rlhf.ppo import building as ppo_building
    from llm_rlhf.ppo import trainer as ppo_trainer

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    elif device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # accelerate's one process takes the current card
    tmp = tempfile.TemporaryDirectory(prefix="ppo_bench_") if not args.workdir else None
    workdir = Path(args.workdir or tmp.name)
    if args.policy_dir:
        policy_dir, rm_dir = Path(args.policy_dir), Path(args.rm_dir)
    else:
        policy_dir, rm_dir = build_folders(args, workdir)

    # The bf16 peak only when bf16 is asked for: a CPU that emulates bf16 spends minutes in it.
    peak_dtype = torch.bfloat16 if args.bf16 else torch.float32
    peak_start = matmul_peak(args.peak_size, peak_dtype, device)

    total_steps = args.warmup + args.steps + (1 if args.profile else 0) + 1
    cfg = ppo_trainer.Config(
        model_name_or_path=str(policy_dir),
        reward_model_path=str(rm_dir),
        prompt_file=args.prompt_file or "unused",  # random prompts are given as token ids below
        output_dir=str(workdir / "out"),
        steps=total_steps,
        rollout_batch_size=args.rollout,
        samples_per_prompt=args.samples_per_prompt,
        advantage_estimator=args.advantage_estimator,
        mini_batch_size=args.mini_batch,
        gradient_accumulation_steps=args.grad_accum,
        ppo_epochs=args.ppo_epochs,
        max_prompt_length=max(args.prompt_len, 64 if args.prompt_file else 0),
        skip_long=True,
        max_new_tokens=args.new_tokens,
        use_lora=args.lora,
        bf16=args.bf16,
        sampling_dtype=args.sampling_dtype,
        sampling_compile=args.sampling_compile,
        gradient_checkpointing=args.grad_ckpt,
        value_model=args.value_model,
        eval_every=0,
        save_steps=0,
        log_samples_every=0,
    )
    tokenizer = load_tokenizer(str(policy_dir), padding_side="left")
    prompts = make_prompts(args, cfg, tokenizer, len(tokenizer), args.rollout * total_steps)
    trainer = ppo_building.build_trainer(cfg, Accelerator(cpu=device.type == "cpu"), tokenizer, prompts)
    assert trainer.accelerator.device.type == device.type, (trainer.accelerator.device, device)
    load_peak_mb = peak_memory_mb(device)
    lm = trainer.unwrapped_policy.lm
    critic = trainer.accelerator.unwrap_model(trainer.critic) if trainer.critic is not None else None
    nets = {  # weights and shapes of each network a phase runs
        "lm": param_counts(lm),
        "reward_model": param_counts(trainer.collector.scorer.reward_model.model),
        **({"critic": param_counts(critic.reward_model.model)} if critic is not None else {}),
    }
    config = (lm.get_base_model() if hasattr(lm, "get_base_model") else lm).config

    for _ in range(args.warmup):
        trainer.ppo_step()
    gen = compare_generation(trainer, args, device, args.gen_reps)

    timer = PhaseTimer(device)
    instrument(trainer, timer)
    shapes = ShapeLog(timer)
    shapes.watch(lm, "lm")
    if not args.lora:
        shapes.watch(trainer.ref_model.lm, "lm")  # a frozen copy (with LoRA: the policy's own network)
    shapes.watch(trainer.collector.scorer.reward_model._trunk_and_head()[0], "reward_model")
    if critic is not None:
        shapes.watch(critic.reward_model._trunk_and_head()[0], "critic")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_seconds, lengths = [], []
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    shapes.on = True
    sampler = timer.wrap(fast_sampling.generate, lambda *a, **kw: "generate")  # what `rollout.sample` runs
    with RssSampler() as rss, mock.patch.object(fast_sampling, "generate", sampler):
        for _ in range(args.steps):
            sync(device)
            t = time.perf_counter()
            metrics = trainer.ppo_step()
            sync(device)
            step_seconds.append(time.perf_counter() - t)
            lengths.append(metrics["response_length"])
    shapes.on = False
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = {
        "user_s": usage1.ru_utime - usage0.ru_utime,
        "sys_s": usage1.ru_stime - usage0.ru_stime,
    }
    # < 1: this process did not get its threads' worth of CPU (other jobs on the machine).
    cpu["utilization"] = (cpu["user_s"] + cpu["sys_s"]) / (sum(step_seconds) * torch.get_num_threads())
    peak_end = matmul_peak(args.peak_size, peak_dtype, device)
    peak = max(peak_start, peak_end)
    n = args.steps
    step_s = sum(step_seconds) / n
    phase_s = {k: v / n for k, v in timer.seconds.items()}
    phase_s.pop("rollout_other", None)  # padding the queries, the response mask: counted in "other"
    phase_s["other"] = step_s - sum(phase_s.values())  # + shaped rewards, GAE, whitening, metrics
    tokens = {k: shapes.tokens(k) / n for k in ("old_logprobs_values", "reference", "reward_model", "update")}
    # at most: generate stops when every row has ended (ReMax: + one greedy response per prompt)
    greedy = args.rollout if args.advantage_estimator == "remax" else 0
    tokens["generate"] = (args.rollout * args.samples_per_prompt + greedy) * args.new_tokens
    phases = {}
    for k, sec in phase_s.items():
        phases[k] = {
            "seconds": sec,
            "tokens_per_s": tokens[k] / sec if k in tokens and sec > 0 else None,
            "share": sec / step_s,
        }
    train_flops = shapes.flops("update", nets) / n
    fwd = {k: shapes.flops(k, nets) / n for k in ("old_logprobs_values", "reference", "reward_model")}
    result = {
        "config": {
            "model": args.model_dir or args.model,
            "architecture": type(config).__name__.removesuffix("Config"),
            "n_layer": nets["lm"]["n_layer"],
            "n_embd": nets["lm"]["d"],
            "vocab_size": config.vocab_size,
            "params": nets,
            "value_model": args.value_model,
            "advantage_estimator": args.advantage_estimator,
            "samples_per_prompt": args.samples_per_prompt,
            "rollout": args.rollout,
            "mini_batch": args.mini_batch,
            "grad_accum": args.grad_accum,
            "ppo_epochs": args.ppo_epochs,
            "prompt_len": "file" if args.prompt_file else args.prompt_len,
            "prompt_file": args.prompt_file,
            "new_tokens": args.new_tokens,
            "lora": args.lora,
            "bf16": args.bf16,
            "sampling_dtype": args.sampling_dtype,
            "sampling_compile": args.sampling_compile,
            "grad_ckpt": args.grad_ckpt,
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "steps": n,
            "device": str(device),
            "device_name": device_name(device),
        },
        "step_seconds": step_s,
        "step_seconds_all": step_seconds,
        "phases": phases,
        "tokens_per_step": tokens,  # the tokens each phase's forwards ran on, trimmed to the real ones
        "matmul_peak_gflops": {"fp32" if not args.bf16 else "bf16": peak / 1e9},
        "matmul_peak_gflops_start_end": [peak_start / 1e9, peak_end / 1e9],
        "cpu_time_during_steps": cpu,
        "train_flops_per_step": train_flops,
        "train_gflops_per_s": train_flops / phase_s["update"] / 1e9,
        "mfu": train_flops / phase_s["update"] / peak,
        # The no-grad forwards that ran, for comparison (same peak; a GRPO step with one update has no
        # old-policy forward: `PPOTrainer.old_logprobs_from_update`).
        "forward_mfu": {k: flops / phase_s[k] / peak for k, flops in fwd.items() if phase_s.get(k)},
        "generation": gen,
        "peak_memory_mb": peak_memory_mb(device),
        "peak_memory_mb_after_load": load_peak_mb,
        "peak_rss_mb_during_steps": rss.peak / 2**20 if device.type == "cpu" else None,
        "response_length": sum(lengths) / n,
        "load_avg_1min": os.getloadavg()[0],
    }
    if args.profile:
        result["profile_file"] = profile_step(trainer, args.profile, device)
    if tmp is not None:
        tmp.cleanup()
    return result


def profile_step(trainer, path: str, device: torch.device) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        trainer.ppo_step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    table_shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50, max_shapes_column_width=60
    )
    Path(path).write_text(table + "\n\nby input shape:\n" + table_shapes + "\n\n" + ops_by_phase(prof))
    return path


def ops_by_phase(prof, top: int = 12) -> str:
    """Self CPU time of each op inside each benchmark phase (the phase is the nearest enclosing
    `phase/...` record_function), the top ops per phase, largest first."""
    totals: dict[str, dict[str, float]] = {}
    for event in prof.events():
        parent, phase = event.cpu_parent, None
        while parent is not None:
            if parent.name.startswith("phase/"):
                phase = parent.name[len("phase/") :]
                break
            parent = parent.cpu_parent
        if phase is None or event.name.startswith("phase/"):
            continue
        ops = totals.setdefault(phase, {})
        ops[event.name] = ops.get(event.name, 0.0) + event.self_cpu_time_total / 1e6
    lines = []
    for phase, ops in totals.items():
        total = sum(ops.values())
        lines.append(f"phase {phase}: {total:.3f} s self CPU time in ops")
        for name, sec in sorted(ops.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {name:55s} {sec:8.3f} s  {100 * sec / total:5.1f}%")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def label(r: dict) -> str:
    c = r["config"]
    return (
        f"{c['model']} ({c['architecture']}) {'LoRA' if c['lora'] else 'full'} {'bf16' if c['bf16'] else 'fp32'}"
        + (" ckpt" if c["grad_ckpt"] else "")
        + (" sampling bf16" if c.get("sampling_dtype") == "bfloat16" else "")
        + (" sampling compiled" if c.get("sampling_compile") else "")
        + (" + critic from the RM" if c["value_model"] == "reward" else "")
        + (
            f" {c['advantage_estimator']} k={c['samples_per_prompt']}"
            if c.get("advantage_estimator", "gae") != "gae" or c.get("samples_per_prompt", 1) != 1
            else ""
        )
    )


def where(c: dict) -> str:
    """The device the figures are of: the card, or the CPU and its threads."""
    name = c.get("device_name", c.get("device", "cpu"))
    return f"{name}, {c['threads']} threads" if c.get("threads") else name


def format_table(results: list[dict]) -> str:
    lines = []
    for r in results:
        c = r["config"]
        lines.append(
            f"## {label(r)}: rollout {c['rollout']} prompts x {c.get('samples_per_prompt', 1)}, prompt {c['prompt_len']} + {c['new_tokens']} new tokens, "
            f"minibatch {c['mini_batch']}, {c['ppo_epochs']} PPO epoch(s), {c['steps']} timed steps, "
            f"{where(c)}, load {r['load_avg_1min']:.1f}, CPU utilisation "
            f"{r['cpu_time_during_steps']['utilization']:.2f} (sys {r['cpu_time_during_steps']['sys_s']:.1f} s); "
            f"mean response {r['response_length']:.1f} tokens"
        )
        lines.append("| phase | seconds | tokens/s | share |")
        lines.append("|---|---:|---:|---:|")
        for k, v in r["phases"].items():
            tps = f"{v['tokens_per_s']:,.0f}" if v["tokens_per_s"] else ""
            lines.append(f"| {k} | {v['seconds']:.3f} | {tps} | {100 * v['share']:.1f}% |")
        lines.append(f"| **step** | {r['step_seconds']:.3f} | | 100% |")
        g = r["generation"]
        (peak,) = r["matmul_peak_gflops"].values()
        lines.append(
            f"\ntraining: {r['train_gflops_per_s']:.1f} GFLOP/s = MFU {100 * r['mfu']:.1f}% of the "
            f"{peak:.0f} GFLOP/s {'bf16' if c['bf16'] else 'fp32'} matmul peak; forwards: "
            + ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["forward_mfu"].items())
        )
        lines.append(
            f"generation: rollout {g['rollout_generate_tokens_per_s']:,.0f} tok/s vs bare generate "
            f"{g['bare_generate_tokens_per_s']:,.0f} tok/s = {g['rollout_vs_bare']:.2f}x"
        )
        lines.append(
            f"peak memory: {r['peak_memory_mb']:,.0f} MB (after loading {r['peak_memory_mb_after_load']:,.0f} MB"
            + (
                f", max RSS during the steps {r['peak_rss_mb_during_steps']:,.0f} MB"
                if r["peak_rss_mb_during_steps"]
                else ""
            )
            + ")\n"
        )
    return "\n".join(lines)


def run_matrix(args) -> list[dict]:
    tmp = tempfile.TemporaryDirectory(prefix="ppo_bench_")
    workdir = Path(args.workdir or tmp.name)
    policy_dir, rm_dir = build_folders(args, workdir)
    results = []
    passthrough = [a for a in sys.argv[1:] if a not in ("--matrix", "--lora", "--bf16")]
    if "--json" in passthrough:
        i = passthrough.index("--json")
        del passthrough[i : i + 2]
    for lora in (False, True):
        for bf16 in (False, True):
            out = workdir / f"result_{lora}_{bf16}.json"
            cmd = [
                sys.executable,
                __file__,
                *passthrough,
                "--policy-dir",
                str(policy_dir),
                "--rm-dir",
                str(rm_dir),
                "--workdir",
                str(workdir / f"run_{lora}_{bf16}"),
                "--json",
                str(out),
            ]
            cmd += ["--lora"] if lora else []
            cmd += ["--bf16"] if bf16 else []
            subprocess.run(cmd, check=True)
            results.append(json.loads(out.read_text()))
    tmp.cleanup()
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    results = run_matrix(args) if args.matrix else [run_one(args)]
    if args.matrix:
        print("\n# all configurations\n")
    print(format_table(results))
    if args.matrix:
        full = {r["config"]["bf16"]: r for r in results if not r["config"]["lora"]}
        for r in results:
            if r["config"]["lora"]:
                ratio = r["peak_memory_mb"] / full[r["config"]["bf16"]]["peak_memory_mb"]
                print(f"LoRA / full peak memory ({'bf16' if r['config']['bf16'] else 'fp32'}): {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results if args.matrix else results[0], indent=2))


if __name__ == "__main__":
    main()
