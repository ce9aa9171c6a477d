"""Our GRPO step against TRL's `GRPOTrainer` at the same shape and settings, alternated in one process.

    python benchmarks/grpo_vs_trl.py --shape tiny       # 2-layer 128-dim GPT-2, 16 prompts x 4 x 16 tokens
    python benchmarks/grpo_vs_trl.py --shape smollm2    # SmolLM2-135M + LoRA r=16, 8 prompts x 4 x 24 tokens
    python benchmarks/grpo_vs_trl.py --shape smollm2 --device cuda --bf16   # both on a GPU, bf16 autocast
    python benchmarks/grpo_vs_trl.py --shape smollm2 --device cuda --trl-continuous-batching

Ours: `llm_rlhf.ppo.trainer.PPOTrainer.ppo_step`, the trainer built by `llm_rlhf.ppo.building.build_trainer` as
`llm-rlhf ppo` and `benchmarks/ppo_step.py` build it (the model folders, tokenizer, prompts and phase timers
are ppo_step.py's).
TRL's: `trl.GRPOTrainer.train()` (TRL 1.16, transformers generation, no vLLM), one optimiser step per batch.
Each TRL step ends in a callback that runs one of our steps, so the two alternate (TRL, ours, TRL, ours, ...)
and see the same machine load. A TRL step is the time from the end of our previous step to the end of its own
(everything `Trainer` does per step: the batch, generation, reward, reference, update, its bookkeeping); ours
is one `ppo_step()` call (sampling, reference, reward, update, metrics). The first --warmup steps of each are
not timed. It prints the median step of each and the ratio ours / TRL, and our step's phases (the medians of
ppo_step.py's exclusive phase timers).

The settings that must match (and do, below):

| | ours (`llm_rlhf.ppo.config.Config`) | TRL (`GRPOConfig`) |
|---|---|---|
| advantage | `advantage_estimator: grpo`: (r - mean) / (std + 1e-4), std with n - 1, per group | `scale_rewards: "group"` (the same formula) |
| group size | `samples_per_prompt: 4` | `num_generations: 4` |
| batch | `rollout_batch_size` prompts x k, `mini_batch_size` = all of them, `ppo_epochs: 1` | `per_device_train_batch_size` = prompts x k completions, `gradient_accumulation_steps: 1`, `steps_per_generation: 1`, `num_iterations: 1` |
| loss aggregation | token mean over the (global) minibatch | `loss_type: "dapo"` (normalised by the active tokens of the global batch; "bnpo" is the same with one process and no accumulation; "grpo" is the mean of per-sequence means) |
| clipped ratio | `cliprange: 0.2` | `epsilon: 0.2` (`epsilon_high` None: the same) |
| KL | `kl_in_loss` (grpo's default): `init_kl_coef` * k3 per token in the loss, `kl_controller: fixed` | `beta` * k3 per token in the loss (always fixed) |
| beta | 0.04 | 0.04 |
| sampling | temperature 1, top_k 0, top_p 1, `max_new_tokens` | temperature 1, top_k 0, top_p 1, `max_completion_length` |
| reward | `reward_fn` = `reward` below, no reward model | `reward_funcs=[reward]` |
| optimiser | AdamW lr 1e-5, eps 1e-5, weight decay 0, constant schedule, `max_grad_norm: 1.0` | the same (`adamw_torch_fused`, `adam_epsilon`, `lr_scheduler_type: constant`) |
| dropout | off (the policy stays in eval mode) | `disable_dropout: True` |
| activations | kept (`gradient_checkpointing: false`, the default) | `gradient_checkpointing: False` (GRPOConfig's default is True) |
| LoRA (smollm2) | `use_lora`, r 16, alpha 32, dropout 0, q_proj and v_proj; the reference = adapter disabled | `peft_config` the same; the reference = adapter disabled |

Both trainers run on --device (default: cuda when there is one): ours through its Accelerator, TRL's through
`GRPOConfig(use_cpu=...)` (a single card: the current one). Both models are float32 with no autocast (TRL's
`bf16` is set False: GRPOConfig turns it on by itself otherwise), or with --bf16 both in bf16 mixed precision:
float32 weights, the forwards under bf16 autocast (accelerate's `mixed_precision: bf16` for both, one
process-wide accelerate state; ours also with its `bf16: true`, the same autocast). Neither sets TF32
(torch's default: off; the JSON records it). On the CPU both run on the same thread count (`--threads`); on
CUDA every clock waits for the queued work (`torch.cuda.synchronize`) first. With one optimiser step per
batch neither trainer runs a separate forward for the old policy: TRL takes the ratio against the detached
log-probs of the update's forward, and so does ours (`PPOTrainer.old_logprobs_from_update`).

--trl-continuous-batching: TRL generates with transformers' continuous batching engine
(`use_transformers_continuous_batching`, `generate_batch`, paged attention) instead of its default
`generate`; ours is unchanged. With --bf16 TRL then casts the policy's weights to bfloat16 before generating
(`GRPOTrainer._generate_single_turn`), so it no longer trains float32 weights: compare it in float32.

The tiny shape (GPT-2, n_layer 2, n_head 4, n_embd 128, vocabulary 4096, prompts of 16 random tokens) is
ppo_step.py's `--model small` with the issue's overrides. The smollm2 shape is the arithmetic recipe's
(`recipes/smollm2-arithmetic/ppo.yaml`: 8 prompts x 4 responses of 24 tokens, LoRA r=16) with one update per
step and prompts of 48 random tokens (the recipe's chat prompts are 43-58); it uses `data/smollm2-135m-instruct`
when the folder is there, else a model of SmolLM2-135M's config with random weights and ppo_step.py's
byte-level tokenizer of the same vocabulary size (the output says which). The prompts are random token ids
decoded to text; both trainers encode that text with `tokenizer(text)` (TRL's `_tokenize_prompts`, our
`rollout.encode_prompt`), so they see the same token ids.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(REPO))


def load_script(name: str):
    """A benchmark script of this folder as a module (ppo_step.py: its helpers, not copies)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ppo_step = load_script("ppo_step")

# prompts x completions x new tokens, prompt length, LoRA
SHAPES = {
    "tiny": dict(prompts=16, samples=4, new_tokens=16, prompt_len=16, lora=False),
    "smollm2": dict(prompts=8, samples=4, new_tokens=24, prompt_len=48, lora=True),
}
BETA, CLIP, LR, ADAM_EPS, LORA_R, LORA_ALPHA = 0.04, 0.2, 1e-5, 1e-5, 16, 32
LORA_TARGETS = ["q_proj", "v_proj"]


def reward(prompts, completions, **kwargs) -> list[float]:
    """The rule both trainers score with (no reward model): the number of letters 'e' in the response, over
    10. Our reward_fn interface is (prompts, responses); TRL's passes more keyword arguments."""
    return [c.count("e") / 10 for c in completions]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each trainer")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where both trainers run: cpu, cuda (default: cuda when there is one)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="both trainers in bf16 mixed precision (float32 weights, bf16 autocast); default float32",
    )
    p.add_argument(
        "--sampling-compile",
        action="store_true",
        help="ours samples with its compiled decode steps (sampling_compile: CUDA graphs on a GPU); TRL's "
        "generation is unchanged. The first --warmup step compiles",
    )
    p.add_argument(
        "--trl-continuous-batching",
        action="store_true",
        help="TRL generates with transformers' continuous batching (use_transformers_continuous_batching)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (on the CPU only)")
    p.add_argument("--prompts", type=int, help="override the shape: prompts per step")
    p.add_argument("--samples", type=int, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, help="max new tokens")
    p.add_argument("--prompt-len", type=int, help="random tokens per prompt")
    p.add_argument("--vocab-size", type=int, help="the tiny GPT-2's vocabulary (default 4096)")
    p.add_argument(
        "--smollm2-dir",
        default=str(REPO / "data" / "smollm2-135m-instruct"),
        help="SmolLM2-135M-Instruct folder (random weights of its config when missing)",
    )
    p.add_argument(
        "--old-forward",
        action="store_true",
        help="our step with its separate old-policy forward "
        "(`PPOTrainer.old_logprobs_from_update` off): what skipping it saves",
    )
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--workdir", help="where to build the model folder (default: a temporary folder)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def build_policy(args, workdir: Path) -> tuple[Path, str]:
    """The policy folder (model + tokenizer) and where its weights come from."""
    from transformers import AutoModelForCausalLM

    if args.shape == "smollm2" and Path(args.smollm2_dir).is_dir():
        return Path(args.smollm2_dir), str(args.smollm2_dir)
    folder = workdir / "policy"
    torch.manual_seed(0)
    if args.shape == "smollm2":  # ppo_step.py's `--model smollm2`
        shape = argparse.Namespace(model="smollm2", n_layer=None, n_head=None, n_embd=None, vocab_size=None)
        source = f"random weights of SmolLM2-135M's config ({args.smollm2_dir} missing)"
    else:
        shape = argparse.Namespace(model="small", n_layer=2, n_head=4, n_embd=128, vocab_size=args.vocab_size)
        source = "random weights"
    lm = AutoModelForCausalLM.from_config(
        ppo_step.model_config(argparse.Namespace(**vars(shape), model_dir=None))
    )
    tokenizer = ppo_step.build_tokenizer(lm.config.vocab_size)
    lm.generation_config.pad_token_id = tokenizer.eos_token_id
    lm.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder, source


def prompt_texts(args, tokenizer, n: int) -> list[str]:
    """n prompts: ppo_step.py's random token ids (--prompt-len each), decoded to text."""
    ids = ppo_step.make_prompts(
        argparse.Namespace(prompt_file=None, prompt_len=args.prompt_len), None, tokenizer, len(tokenizer), n
    )
    return [tokenizer.decode(row) for row in ids]


def our_trainer(args, policy_dir: Path, texts: list[str], workdir: Path, total_steps: int):
    """`llm_rlhf.ppo.building.build_trainer` on the settings of the docstring's table, on --device."""
    from accelerate import Accelerator

    from llm_rlhf.models.loading import load_tokenizer
    from llm_rlhf.models.reward_fn import RewardFn
    from llm_rlhf.ppo import building as ppo_building
    from llm_rlhf.ppo import trainer as ppo_trainer
    from llm_rlhf.rl.rollout import encode_prompt

    tokenizer = load_tokenizer(str(policy_dir), padding_side="left")
    queries = [encode_prompt(tokenizer, t) for t in texts]
    cfg = ppo_trainer.Config(
        model_name_or_path=str(policy_dir),
        reward_model_path=None,
        reward_fn="benchmarks/grpo_vs_trl.py:reward",  # given loaded below
        prompt_file="unused",  # the prompts are given as token ids
        output_dir=str(workdir / "ours"),
        steps=total_steps,
        advantage_estimator="grpo",
        samples_per_prompt=args.samples,
        rollout_batch_size=args.prompts,
        mini_batch_size=args.prompts * args.samples,
        gradient_accumulation_steps=1,
        ppo_epochs=1,
        max_prompt_length=max(len(q) for q in queries),
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        kl_controller="fixed",
        init_kl_coef=BETA,
        cliprange=CLIP,
        learning_rate=LR,
        adam_eps=ADAM_EPS,
        weight_decay=0.0,
        max_grad_norm=1.0,
        use_lora=args.lora,
        lora_r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        lora_target_modules=LORA_TARGETS if args.lora else None,
        bf16=args.bf16,
        sampling_compile=args.sampling_compile,
        eval_every=0,
        save_steps=0,
        log_samples_every=0,
    )
    reward_fn = RewardFn(reward, cfg.reward_fn)
    # TRL's Trainer makes an Accelerator of its own, with mixed_precision "bf16" or "no": accelerate's state is
    # one per process, so ours must say the same (else "AcceleratorState has already been initialized").
    accelerator = Accelerator(cpu=args.device.type == "cpu", mixed_precision="bf16" if args.bf16 else "no")
    trainer = ppo_building.build_trainer(cfg, accelerator, tokenizer, queries, reward_fn)
    assert trainer.accelerator.device.type == args.device.type, (trainer.accelerator.device, args.device)
    return trainer, queries


def trl_config(args, workdir: Path, total_steps: int):
    """TRL's GRPOConfig on the settings of the docstring's table, on --device, in --bf16 or float32."""
    from trl import GRPOConfig

    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        max_steps=total_steps,
        per_device_train_batch_size=args.prompts * args.samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.samples,
        num_iterations=1,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=BETA,
        epsilon=CLIP,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=LR,
        adam_epsilon=ADAM_EPS,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused",
        disable_dropout=True,
        gradient_checkpointing=False,  # GRPOConfig's default is True; ours is off (`gradient_checkpointing`)
        use_vllm=False,
        use_transformers_continuous_batching=args.trl_continuous_batching,
        use_cpu=args.device.type == "cpu",
        bf16=args.bf16,  # GRPOConfig's default is True: set either way
        fp16=False,
        model_init_kwargs={"dtype": "float32"},  # the weights; --bf16 is autocast, as ours
        save_strategy="no",
        report_to="none",
        logging_steps=10,
        log_completions=False,
        seed=0,
    )
    # ACCELERATE_MIXED_PRECISION (set by `accelerate launch`) would override bf16=False: refused, not mixed
    want = "bf16" if args.bf16 else "no"
    assert config.mixed_precision == want, f"TRL's mixed precision is {config.mixed_precision}, not {want}"
    return config


def trl_trainer(args, policy_dir: Path, texts: list[str], workdir: Path, total_steps: int, callback):
    """TRL's GRPOTrainer on `trl_config`."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=LORA_R,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
    trainer = GRPOTrainer(
        model=str(policy_dir),
        reward_funcs=[reward],
        args=trl_config(args, workdir, total_steps),
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tokenizer,
        callbacks=[callback],
        peft_config=peft_config,
    )
    return trainer, tokenizer


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> dict:
    from transformers import TrainerCallback

    args = parse_args(argv)
    device = args.device
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    elif device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # both trainers' accelerate state takes the current card
    tmp = tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") if not args.workdir else None
    workdir = Path(args.workdir or tmp.name)
    policy_dir, source = build_policy(args, workdir)
    total = args.warmup + args.steps
    from llm_rlhf.models.loading import load_tokenizer

    texts = prompt_texts(args, load_tokenizer(str(policy_dir)), args.prompts * total)

    ours, queries = our_trainer(args, policy_dir, texts, workdir, total)
    timer = ppo_step.PhaseTimer(device)
    sync = ppo_step.sync  # on CUDA: the queued work done before each clock is read
    ppo_step.instrument(ours, timer)
    times = {"trl": [], "ours": []}
    phases: list[dict[str, float]] = []
    mark = {"t": 0.0}

    class Alternate(TrainerCallback):
        """After each TRL step: its time, then one of our steps, timed."""

        def on_train_begin(self, *a, **kw):
            sync(device)
            mark["t"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            sync(device)
            times["trl"].append(time.perf_counter() - mark["t"])
            timer.seconds.clear()
            sampler = timer.wrap(ppo_step.fast_sampling.generate, lambda *a, **kw: "generate")
            with mock.patch.object(ppo_step.fast_sampling, "generate", sampler):
                t = time.perf_counter()
                ours.ppo_step()
                sync(device)
                times["ours"].append(time.perf_counter() - t)
            phases.append({k: v for k, v in timer.seconds.items() if k != "rollout_other"})
            mark["t"] = time.perf_counter()

    trl, trl_tokenizer = trl_trainer(args, policy_dir, texts, workdir, total, Alternate())
    trl_ids = [trl_tokenizer(text=t)["input_ids"] for t in texts]
    assert trl_ids == queries, "both trainers must see the same prompt tokens"
    skip = ours.old_logprobs_from_update and not args.old_forward
    with mock.patch.object(type(ours), "old_logprobs_from_update", skip):  # the library's class, restored
        trl.train()

    timed = {k: v[args.warmup :] for k, v in times.items()}
    result = {
        "shape": args.shape,
        "model": source,
        "config": {k: getattr(args, k) for k in ("prompts", "samples", "new_tokens", "prompt_len", "lora")},
        "device": str(device),
        "device_name": ppo_step.device_name(device),
        "dtype": "bfloat16 autocast, float32 weights" if args.bf16 else "float32",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else None,
        "trl_generation": "continuous batching" if args.trl_continuous_batching else "generate",
        "our_sampling": "compiled decode steps" if args.sampling_compile else "eager",
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "mean_prompt_tokens": sum(map(len, queries)) / len(queries),
        "steps": args.steps,
        "old_forward_skipped": skip,
        "seconds": timed,
        "median_ours": median(timed["ours"]),
        "median_trl": median(timed["trl"]),
        "our_phases_median": {k: median([p.get(k, 0.0) for p in phases[args.warmup :]]) for k in phases[-1]},
    }
    result["ratio"] = result["median_ours"] / result["median_trl"]
    c = result["config"]
    print(
        f"## GRPO step, {args.shape}: {source}; {c['prompts']} prompts x {c['samples']} completions x "
        f"{c['new_tokens']} new tokens, prompts of {result['mean_prompt_tokens']:.1f} tokens"
        f"{', LoRA r=16' if c['lora'] else ''}; {args.steps} timed steps each, alternated; our old-policy "
        f"forward {'skipped' if result['old_forward_skipped'] else 'run'}"
    )
    print(
        f"on {result['device_name']} ({result['device']}"
        + (f", {result['threads']} threads" if result["threads"] else "")
        + f"), {result['dtype']}; TRL's generation: {result['trl_generation']}; ours: {result['our_sampling']}"
    )
    print(f"ours (llm_rlhf ppo_step): median {result['median_ours']:.4f} s  {fmt(timed['ours'])}")
    print(f"TRL GRPOTrainer:          median {result['median_trl']:.4f} s  {fmt(timed['trl'])}")
    print(f"ratio ours / TRL: {result['ratio']:.3f}")
    print(
        "our phases (medians, s): "
        + ", ".join(f"{k} {v:.4f}" for k, v in result["our_phases_median"].items())
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return result


def fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


if __name__ == "__main__":
    main()
