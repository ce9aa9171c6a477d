"""Our on-policy distillation step against TRL's `DistillationTrainer` at the same shape, each in its own process.

    python benchmarks/distill_vs_trl.py --shape tiny       # 2-layer 128-dim GPT-2 student and teacher, 16 x 16 tokens
    python benchmarks/distill_vs_trl.py --shape smollm2    # SmolLM2-135M-Instruct + LoRA r=16, 32 chat prompts x 32
    python benchmarks/distill_vs_trl.py --shape smollm2 --teacher runs/gym-chain_sum-t2d1/ppo --steps 5 --warmup 1
    python benchmarks/distill_vs_trl.py --shape smollm2 --device cuda --bf16 --json distill.json

Ours: `llm_rlhf.ppo.trainer.PPOTrainer.ppo_step` with a teacher (`teacher_model_path`, `distill_loss: reverse_kl`),
built by `llm_rlhf.ppo.building.build_trainer` as `llm-rlhf ppo` builds it. TRL's: `trl.DistillationTrainer.train()`
(TRL 1.16, transformers generation, no vLLM), one optimiser step per batch. The parent process builds the model
folders (tiny) and then runs `--only ours` and `--only trl` as subprocesses, one after the other, on the same
folders, prompts, thread count and device: each side has its process (its own allocator, accelerate state and
peak memory) and prints one JSON line, which the parent reads. A TRL step is the time from the end of the
previous step to the end of its own (a `TrainerCallback`: everything `Trainer` does per step: the batch,
generation, the teacher, the update, its bookkeeping); ours is one `ppo_step()` call (sampling, the forwards,
the teacher, the update, metrics). The first --warmup steps of each are not timed. The parent prints the
median step of each, the ratio ours / TRL, and our step's phases: the medians of its metrics time/generate
(sampling + the old-policy forward), time/score (the reference forward + the zero scores), time/teacher,
time/train and time/teacher_share, and of ppo_step.py's exclusive phase timers (the sampler, the old-policy
forward, the reference, the update), so the forwards TRL does not run (below) are seen on their own.

The settings that must match (and do, below, except where the table says otherwise):

| | ours (`llm_rlhf.ppo.config.Config`) | TRL (`DistillationConfig`) |
|---|---|---|
| signal | `teacher_model_path`, `distill_coef: 1.0`, `distill_loss: reverse_kl`; no reward model, no reward_fn: the score is 0 and the teacher's signal the whole reward | `beta: 1.0` (reverse KL); no reward |
| divergence | **not the same estimator**: the per-token reward -(log pi(y_t) - log pi_teacher(y_t)) on the sampled tokens (the reverse KL's one-sample estimate), REINFORCE++ returns, PPO's clipped ratio | the exact reverse KL over the whole vocabulary at every completion position (`ChunkedDivergenceFunction`), its analytic gradient |
| advantage | `advantage_estimator: reinforce_pp` (gamma 1 returns, whitened over the batch) | none (a loss, no policy gradient) |
| batch | `rollout_batch_size` prompts x `samples_per_prompt: 1`, `mini_batch_size` = all of them, `ppo_epochs: 1` | `per_device_train_batch_size` = the prompts, `gradient_accumulation_steps: 1` |
| loss aggregation | token mean over the minibatch | token sum / the batch's completion tokens (`num_items_in_batch`) |
| reference KL | none: `init_kl_coef: 0.0`, `kl_controller: fixed` (but its forward still runs, below) | none (DistillationTrainer has no reference) |
| sampling | temperature 1, top_k 0, top_p 1, `max_new_tokens` | temperature 1, top_k 0, top_p 1, `max_completion_length` |
| optimiser | AdamW lr 1e-5, eps 1e-5, weight decay 0, constant schedule, `max_grad_norm: 1.0` | the same (`adamw_torch_fused`, `adam_epsilon`, `lr_scheduler_type: constant`) |
| dropout | off (the policy stays in eval mode; the teacher is frozen in eval mode) | `disable_dropout: True` (the teacher in eval mode) |
| activations | kept (`gradient_checkpointing: false`, the default) | `gradient_checkpointing: False` (DistillationConfig's default is True) |
| LoRA (smollm2) | `use_lora`, r 16, alpha 32, dropout 0, q_proj and v_proj | `peft_config` the same |
| teacher | `teacher_model_path` loaded in the run's dtype (float32), on --device | the same folder, `teacher_model_init_kwargs: {dtype: float32}` |
| prompts | the same texts (below), the same token ids (checked) | the same |

The forwards are not the same work, and cannot be made so with the library unchanged: TRL runs the teacher's
no-grad forward and the student's training forward (+ backward) and nothing else. Ours also runs (a) the
rollout's no-grad old-policy forward: `PPOTrainer.old_logprobs_from_update` is off with a teacher, since the
distillation rewards read the old log-probs before the update; and (b) the reference forward
(`PPOTrainer.rollout` calls `reference_logprobs` on every step, whatever `init_kl_coef`; with LoRA it is the
policy's network with the adapter disabled): 3 no-grad forwards + 1 training forward against TRL's 1 + 1.
Their seconds are ppo_step.py's phases `old_logprobs_values` and `reference` in the output. The estimators
differ too (the table's "divergence" row): ours scores the sampled token only (its log-softmax over the
vocabulary is computed either way), TRL projects both models' hidden states onto the whole vocabulary in
chunks. The prompts are the same pool: ours visits it in its seeded permutation
(`RolloutCollector.queries`), TRL in `RepeatSampler`'s (`shuffle_dataset`, seed 0), so a step's 32 prompts
are not the same set on both sides (each side sees every prompt of the pool once over the run); the draws
differ too, so the completions may stop at EOS at other lengths: the output gives both sides' mean
completion length.

Both trainers run on --device (default: cuda when there is one): ours through its Accelerator, TRL's through
`DistillationConfig(use_cpu=...)`. Both are float32 with no autocast (TRL's `bf16` is set False:
DistillationConfig turns it on by itself otherwise), or with --bf16 both in accelerate's bf16 mixed precision
(float32 weights; ours also with its `bf16: true`). **--bf16 is not the same precision on both sides**: ours
runs every forward (sampling, old policy, reference, teacher, update) under bf16 autocast; TRL's generation
runs under it (accelerate's autocast on the model's `forward`), but its loss calls the student's and the
teacher's backbones directly (`DistillationTrainer._compute_loss`, through `_ForwardRedirection`), which
bypasses that `forward`, so the teacher's and the student's training forwards stay float32 (checked with
forward hooks on TRL 1.16 / transformers 5.25, CPU); it is TRL's behaviour, left as it is, so compare the two
in float32 first. On the CPU both run on --threads threads; on CUDA every clock waits for the queued work
(`torch.cuda.synchronize`) first.

The tiny shape: GPT-2 (n_layer 2, n_head 4, n_embd 128, vocabulary 4096; ppo_step.py's `--model small` with
these overrides and its byte-level tokenizer), a teacher of the same config with other random weights and the
same tokenizer, 16 prompts of 16 random tokens decoded to text, 16 new tokens. The smollm2 shape: the student
`data/smollm2-135m-instruct` (`data/make_smollm2.py`), the teacher --teacher (default
`runs/gym-chain_sum-t2d1/ppo`, the rung's RL policy, when that folder is there, else the student's folder
itself: a teacher equal to the student, the output says which; the divergence is then 0 on both sides, the
work per step the same; a --teacher must be a whole causal LM folder, not an adapter), 32 prompts x 1
completion x 32 new tokens per step; the prompts are the first (warmup + steps) x 32 rows of `data/tasks/chain_sum-t2d1/train_prompts.jsonl`
with a chat "messages" list, rendered with the tokenizer's chat template (`add_generation_prompt=True`) to
text, as `llm-rlhf ppo` renders chat prompts; both trainers encode that text with `tokenizer(text)` (TRL's
`_tokenize_prompts` on a plain-text "prompt" column, our `rollout.encode_prompt`), and the parent checks that
both sides' token ids are the same (a hash of them from each side).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import statistics
import subprocess
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

# prompts (x 1 completion) x new tokens, prompt length (tiny: random tokens; smollm2: the task's chat prompts), LoRA
SHAPES = {
    "tiny": dict(prompts=16, new_tokens=16, prompt_len=16, lora=False),
    "smollm2": dict(prompts=32, new_tokens=32, prompt_len=None, lora=True),
}
LR, ADAM_EPS, LORA_R, LORA_ALPHA = 1e-5, 1e-5, 16, 32
LORA_TARGETS = ["q_proj", "v_proj"]
SMOLLM2_DIR = REPO / "data" / "smollm2-135m-instruct"
TASK_PROMPTS = REPO / "data" / "tasks" / "chain_sum-t2d1" / "train_prompts.jsonl"
DEFAULT_TEACHER = REPO / "runs" / "gym-chain_sum-t2d1" / "ppo"
# our metrics whose medians are reported (`llm_rlhf.ppo.metrics`)
OUR_METRICS = ("time/generate", "time/score", "time/teacher", "time/train", "time/step", "time/teacher_share")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each trainer")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each first")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where both trainers run: cpu, cuda (default: cuda when there is one)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="both trainers in accelerate's bf16 mixed precision (float32 weights, bf16 autocast; TRL's loss "
        "forwards bypass it and stay float32: the docstring); default float32",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (on the CPU only)")
    p.add_argument("--prompts", type=int, help="override the shape: prompts per step")
    p.add_argument("--new-tokens", type=int, help="max new tokens")
    p.add_argument("--prompt-len", type=int, help="tiny: random tokens per prompt")
    p.add_argument("--vocab-size", type=int, default=4096, help="the tiny GPT-2's vocabulary")
    p.add_argument("--student", default=str(SMOLLM2_DIR), help="smollm2: the student's folder")
    p.add_argument(
        "--teacher",
        help=f"smollm2: the teacher's folder, a whole causal LM with the student's vocabulary (default: "
        f"{DEFAULT_TEACHER.relative_to(REPO)} when it is there, else the student's folder)",
    )
    p.add_argument(
        "--prompt-file", default=str(TASK_PROMPTS), help="smollm2: chat prompts (JSONL, 'messages')"
    )
    p.add_argument("--only", choices=("ours", "trl"), help=argparse.SUPPRESS)  # the subprocesses' side
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--workdir", help="where to build the model folders (default: a temporary folder)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------------------------------------
# The models and the prompts (the parent builds the folders, each side reads them)
# ---------------------------------------------------------------------------------------------


def tiny_folders(args, workdir: Path) -> tuple[Path, Path]:
    """The tiny student and teacher folders (GPT-2 of the docstring's shape, the same tokenizer, other random
    weights), built once by the parent; a folder already there (the subprocesses) is reused."""
    from transformers import AutoModelForCausalLM

    student, teacher = workdir / "student", workdir / "teacher"
    if (teacher / "config.json").exists():
        return student, teacher
    shape = argparse.Namespace(
        model="small", n_layer=2, n_head=4, n_embd=128, vocab_size=args.vocab_size, model_dir=None
    )
    config = ppo_step.model_config(shape)
    tokenizer = ppo_step.build_tokenizer(config.vocab_size)
    for seed, folder in ((0, student), (1, teacher)):
        torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(config)
        lm.generation_config.pad_token_id = tokenizer.eos_token_id
        lm.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    return student, teacher


def folders(args, workdir: Path) -> tuple[Path, Path, str]:
    """(student, teacher, where the teacher comes from) for --shape."""
    if args.shape == "tiny":
        student, teacher = tiny_folders(args, workdir)
        return student, teacher, "random weights (seed 1), the student's config and tokenizer"
    student = Path(args.student)
    if not (student / "config.json").exists():
        raise SystemExit(f"--shape smollm2 needs the student folder {student} (python data/make_smollm2.py)")
    if args.teacher:
        return student, Path(args.teacher), f"--teacher {args.teacher}"
    if (DEFAULT_TEACHER / "config.json").exists():
        return student, DEFAULT_TEACHER, f"{DEFAULT_TEACHER.relative_to(REPO)} (the rung's RL policy)"
    return student, student, f"the student's own folder ({DEFAULT_TEACHER.relative_to(REPO)} is not there)"


def prompt_texts(args, tokenizer, n: int) -> list[str]:
    """n prompt texts: tiny, ppo_step.py's random token ids (--prompt-len each) decoded; smollm2, the first n
    rows of --prompt-file with a chat "messages" list, rendered with the chat template and its generation
    prompt (as `llm-rlhf ppo` renders a chat prompt: `core.data`)."""
    if args.shape == "tiny":
        ids = ppo_step.make_prompts(
            argparse.Namespace(prompt_file=None, prompt_len=args.prompt_len),
            None,
            tokenizer,
            len(tokenizer),
            n,
        )
        return [tokenizer.decode(row) for row in ids]
    texts = []
    for line in Path(args.prompt_file).read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line.strip() else {}
        if isinstance(row.get("messages"), list) and row["messages"]:
            texts.append(
                tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            )
        if len(texts) == n:
            return texts
    raise SystemExit(f"{args.prompt_file}: {len(texts)} rows with 'messages', {n} needed (prompts x steps)")


def ids_hash(ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------
# Ours
# ---------------------------------------------------------------------------------------------


def our_trainer(args, student: Path, teacher: Path, texts: list[str], workdir: Path, total_steps: int):
    """`llm_rlhf.ppo.building.build_trainer` on the settings of the docstring's table, on --device."""
    from accelerate import Accelerator

    from llm_rlhf.models.loading import load_tokenizer
    from llm_rlhf.ppo import building as ppo_building
    from llm_rlhf.ppo import trainer as ppo_trainer
    from llm_rlhf.rl.rollout import encode_prompt

    tokenizer = load_tokenizer(str(student), padding_side="left")
    queries = [encode_prompt(tokenizer, t) for t in texts]
    cfg = ppo_trainer.Config(
        model_name_or_path=str(student),
        reward_model_path=None,
        reward_fn=None,  # no score: the teacher's signal is the whole reward
        teacher_model_path=str(teacher),
        distill_coef=1.0,
        distill_loss="reverse_kl",
        prompt_file="unused",  # the prompts are given as token ids
        output_dir=str(workdir / "ours"),
        steps=total_steps,
        advantage_estimator="reinforce_pp",
        samples_per_prompt=1,
        rollout_batch_size=args.prompts,
        mini_batch_size=args.prompts,
        gradient_accumulation_steps=1,
        ppo_epochs=1,
        max_prompt_length=max(len(q) for q in queries),
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        kl_controller="fixed",
        init_kl_coef=0.0,
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
        eval_every=0,
        save_steps=0,
        log_samples_every=0,
    )
    accelerator = Accelerator(cpu=args.device.type == "cpu", mixed_precision="bf16" if args.bf16 else "no")
    trainer = ppo_building.build_trainer(cfg, accelerator, tokenizer, queries)
    assert trainer.accelerator.device.type == args.device.type, (trainer.accelerator.device, args.device)
    assert trainer.teacher is not None and not trainer.old_logprobs_from_update
    return trainer, queries


def run_ours(args, student: Path, teacher: Path, texts: list[str], workdir: Path) -> dict:
    total = args.warmup + args.steps
    trainer, queries = our_trainer(args, student, teacher, texts, workdir, total)
    device, sync = args.device, ppo_step.sync
    timer = ppo_step.PhaseTimer(device)
    ppo_step.instrument(trainer, timer)
    seconds, metrics, phases = [], [], []
    for _ in range(total):
        timer.seconds.clear()
        sampler = timer.wrap(ppo_step.fast_sampling.generate, lambda *a, **kw: "generate")
        with mock.patch.object(ppo_step.fast_sampling, "generate", sampler):
            sync(device)
            t = time.perf_counter()
            m = trainer.ppo_step()
            sync(device)
            seconds.append(time.perf_counter() - t)
        metrics.append(m)
        phases.append({k: v for k, v in timer.seconds.items() if k != "rollout_other"})
    timed = slice(args.warmup, None)
    return {
        "seconds": seconds[timed],
        "metrics_median": {k: median([m[k] for m in metrics[timed] if k in m]) for k in OUR_METRICS},
        "phases_median": {k: median([p.get(k, 0.0) for p in phases[timed]]) for k in phases[-1]},
        "mean_completion_tokens": median([m["response_length"] for m in metrics[timed]]),
        "distill_kl": [m["objective/distill_kl"] for m in metrics],
        "prompt_ids": ids_hash(queries),
        "mean_prompt_tokens": sum(map(len, queries)) / len(queries),
    }


# ---------------------------------------------------------------------------------------------
# TRL's
# ---------------------------------------------------------------------------------------------


def trl_config(args, workdir: Path, total_steps: int):
    """TRL's DistillationConfig on the settings of the docstring's table, on --device, in --bf16 or float32."""
    from trl import DistillationConfig

    config = DistillationConfig(
        output_dir=str(workdir / "trl"),
        max_steps=total_steps,
        per_device_train_batch_size=args.prompts,
        gradient_accumulation_steps=1,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=1.0,  # the reverse KL
        learning_rate=LR,
        adam_epsilon=ADAM_EPS,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused",
        disable_dropout=True,
        gradient_checkpointing=False,  # DistillationConfig's default is True; ours is off
        use_vllm=False,
        use_cpu=args.device.type == "cpu",
        bf16=args.bf16,  # DistillationConfig's default is True: set either way
        fp16=False,
        model_init_kwargs={"dtype": "float32"},  # the weights; --bf16 is autocast, as ours
        teacher_model_init_kwargs={"dtype": "float32"},
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


def run_trl(args, student: Path, teacher: Path, texts: list[str], workdir: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationTrainer

    total = args.warmup + args.steps
    device, sync = args.device, ppo_step.sync
    tokenizer = AutoTokenizer.from_pretrained(student)
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
    seconds, lengths, mark, holder = [], [], {"t": 0.0}, {}

    class Clock(TrainerCallback):
        """Each TRL step's time, from the end of the previous one, and its mean completion length."""

        def on_train_begin(self, *a, **kw):
            sync(device)
            mark["t"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            sync(device)
            seconds.append(time.perf_counter() - mark["t"])
            lengths.append(holder["trainer"]._metrics["train"]["completions/mean_length"][-1])
            mark["t"] = time.perf_counter()

    trainer = DistillationTrainer(
        model=str(student),
        teacher_model=str(teacher),
        args=trl_config(args, workdir, total),
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tokenizer,
        callbacks=[Clock()],
        peft_config=peft_config,
    )
    holder["trainer"] = trainer
    # the token ids of `DistillationTrainer._tokenize_prompts` for a plain-text "prompt" column
    ids = [tokenizer(text=t)["input_ids"] for t in texts]
    trainer.train()
    timed = slice(args.warmup, None)
    return {
        "seconds": seconds[timed],
        "mean_completion_tokens": median(lengths[timed]),
        "prompt_ids": ids_hash(ids),
        "mean_prompt_tokens": sum(map(len, ids)) / len(ids),
    }


# ---------------------------------------------------------------------------------------------
# One side (a subprocess) and the parent
# ---------------------------------------------------------------------------------------------


def run_side(args) -> None:
    """--only ours|trl: one trainer's steps, printed as one JSON line on stdout."""
    if args.device.type == "cpu":
        torch.set_num_threads(args.threads)
    elif args.device.type == "cuda" and args.device.index is not None:
        torch.cuda.set_device(args.device)
    workdir = Path(args.workdir)
    student, teacher, _ = folders(args, workdir)
    from llm_rlhf.models.loading import load_tokenizer

    texts = prompt_texts(args, load_tokenizer(str(student)), args.prompts * (args.warmup + args.steps))
    run = run_ours if args.only == "ours" else run_trl
    result = {"side": args.only, **run(args, student, teacher, texts, workdir)}
    result["threads"] = torch.get_num_threads() if args.device.type == "cpu" else None
    print(json.dumps(result), flush=True)


def side_argv(args, side: str, workdir: Path) -> list[str]:
    """The subprocess's command line: this run's settings, its side and the shared folder."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--only", side, "--workdir", str(workdir)]
    argv += ["--shape", args.shape, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += ["--device", str(args.device), "--threads", str(args.threads), "--prompts", str(args.prompts)]
    argv += ["--new-tokens", str(args.new_tokens), "--vocab-size", str(args.vocab_size)]
    argv += ["--student", args.student, "--prompt-file", args.prompt_file]
    if args.prompt_len is not None:
        argv += ["--prompt-len", str(args.prompt_len)]
    if args.teacher:
        argv += ["--teacher", args.teacher]
    if args.bf16:
        argv.append("--bf16")
    return argv


def launch(args, side: str, workdir: Path) -> dict:
    """One side in its own process (stderr passed through); its JSON line."""
    proc = subprocess.run(side_argv(args, side, workdir), stdout=subprocess.PIPE, text=True, cwd=REPO)
    for line in reversed(proc.stdout.splitlines()):
        try:
            out = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(out, dict) and out.get("side") == side and proc.returncode == 0:
            return out
    sys.stdout.write(proc.stdout[-4000:])
    raise SystemExit(f"the {side} side failed (exit status {proc.returncode})")


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.only:
        run_side(args)
        return None
    tmp = tempfile.TemporaryDirectory(prefix="distill_vs_trl_") if not args.workdir else None
    workdir = Path(args.workdir or tmp.name)
    student, teacher, teacher_source = folders(args, workdir)  # built here once, read by both sides
    sides = {side: launch(args, side, workdir) for side in ("ours", "trl")}
    ours, trl = sides["ours"], sides["trl"]
    assert ours["prompt_ids"] == trl["prompt_ids"], "both trainers must see the same prompt tokens"
    result = {
        "shape": args.shape,
        "student": str(student) if args.shape == "smollm2" else "random weights (seed 0)",
        "teacher": teacher_source,
        "config": {k: getattr(args, k) for k in ("prompts", "new_tokens", "prompt_len", "lora")},
        "device": str(args.device),
        "device_name": ppo_step.device_name(args.device),
        "dtype": "bfloat16 autocast, float32 weights" if args.bf16 else "float32",
        "threads": ours["threads"],
        "mean_prompt_tokens": ours["mean_prompt_tokens"],
        "steps": args.steps,
        "warmup": args.warmup,
        "seconds": {"ours": ours["seconds"], "trl": trl["seconds"]},
        "median_ours": median(ours["seconds"]),
        "median_trl": median(trl["seconds"]),
        "mean_completion_tokens": {
            "ours": ours["mean_completion_tokens"],
            "trl": trl["mean_completion_tokens"],
        },
        "our_metrics_median": ours["metrics_median"],
        "our_phases_median": ours["phases_median"],
        "our_distill_kl": ours["distill_kl"],
    }
    result["ratio"] = result["median_ours"] / result["median_trl"]
    c, m = result["config"], result["our_metrics_median"]
    print(
        f"## On-policy distillation step, {args.shape}: student {result['student']}, teacher {teacher_source}; "
        f"{c['prompts']} prompts x 1 completion x {c['new_tokens']} new tokens, prompts of "
        f"{result['mean_prompt_tokens']:.1f} tokens{', LoRA r=16' if c['lora'] else ''}; {args.steps} timed steps "
        f"each (after {args.warmup}), each trainer in its own process"
    )
    print(
        f"on {result['device_name']} ({result['device']}"
        + (f", {result['threads']} threads" if result["threads"] else "")
        + f"), {result['dtype']}; mean completion tokens: ours {ours['mean_completion_tokens']:.1f}, "
        f"TRL {trl['mean_completion_tokens']:.1f}"
    )
    print(f"ours (llm_rlhf ppo_step):  median {result['median_ours']:.4f} s  {fmt(ours['seconds'])}")
    print(f"TRL DistillationTrainer:   median {result['median_trl']:.4f} s  {fmt(trl['seconds'])}")
    print(f"ratio ours / TRL: {result['ratio']:.3f}")
    print(
        "our step's metrics (medians, s): "
        + ", ".join(f"{k} {m[k]:.4f}" for k in OUR_METRICS if k != "time/teacher_share")
        + f"; teacher's share {m['time/teacher_share']:.1%}"
    )
    print(
        "our phases (ppo_step.py's timers, medians, s): "
        + ", ".join(f"{k} {v:.4f}" for k, v in result["our_phases_median"].items())
        + " (old_logprobs_values and reference: the forwards TRL does not run)"
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
