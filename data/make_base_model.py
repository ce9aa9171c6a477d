"""Build the base model of the "reviews" task: a byte-level BPE tokenizer and a small GPT-2, both from scratch.

    python data/make_base_model.py --data data/reviews --out data/reviews/base_model [--steps N --seed S]

1. Tokenizer: byte-level BPE exactly like gpt2 (no prefix space, ``<|endoftext|>`` is bos, eos and unk,
   NO pad token), trained with ``tokenizers`` on ``pretrain.jsonl``, saved as a transformers
   ``GPT2Tokenizer``.
2. Model: ``GPT2LMHeadModel`` from a ``GPT2Config``, pretrained with next-token cross-entropy on
   ``pretrain.jsonl``, every sentence followed by ``<|endoftext|>`` and starting at position 0 (the way
   the pipeline prompts it: the opening words of a sentence, no bos). Batches group sentences of similar
   length and are right-padded; padded positions are masked out of attention and labels.
   AdamW, linear warmup then cosine decay, gradient clipping.
3. Held-out loss on the val movie sentences (``sft_val.jsonl``, prompt + completion), never trained on.
4. Saved with ``save_pretrained`` (safetensors) in float16 with the tokenizer and a generation config,
   plus a model card (``README.md``) with the numbers of this run and a few samples.

Seeded and single-process; ``torch.set_num_threads(--threads)`` (2 on the reference machine).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Tokenizer,
)

EOS = "<|endoftext|>"
SAMPLE_PROMPTS = ("The film is", "A", "This movie", "It's a", "The acting")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("data/reviews"), help="folder of make_reviews.py output")
    p.add_argument("--out", type=Path, default=Path("data/reviews/base_model"), help="output model folder")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="sentences per step")
    p.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=200, help="linear warmup steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="0: a few epochs on a small corpus underfit rather than overfit",
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-positions", type=int, default=128, help="context length; longer sentences are cut")
    p.add_argument("--eval-every", type=int, default=500, help="steps between held-out evaluations")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    return p.parse_args()


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_tokenizer(texts: list[str], vocab_size: int) -> GPT2Tokenizer:
    """Byte-level BPE as in gpt2: the 256 byte symbols, then merges learnt on ``texts``; id 0 = ``<|endoftext|>``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bpe = json.loads(tok.to_str())["model"]
    return GPT2Tokenizer(
        vocab=bpe["vocab"],
        merges=[tuple(m) for m in bpe["merges"]],
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=None,
    )


def encode(tokenizer: GPT2Tokenizer, texts: list[str], max_len: int) -> list[list[int]]:
    """Token ids of ``text + <|endoftext|>``, cut to ``max_len`` (the few longer ones lose their tail)."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [(x + [tokenizer.eos_token_id])[:max_len] for x in ids]


def collate(seqs: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence. pad_id is only a placeholder: it is masked from attention and labels."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # the model shifts: position t predicts t+1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def batches(seqs: list[list[int]], batch_size: int, rng: random.Random):
    """Endless length-grouped batches: shuffle, sort within chunks of 50 batches by length, shuffle the batches."""
    while True:
        order = list(range(len(seqs)))
        rng.shuffle(order)
        chunk = 50 * batch_size
        epoch = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start : start + chunk], key=lambda i: len(seqs[i]))
            epoch += [part[j : j + batch_size] for j in range(0, len(part), batch_size)]
        rng.shuffle(epoch)
        for idx in epoch:
            yield [seqs[i] for i in idx]


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine decay to ``peak * min_ratio`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def mean_token_loss(model, seqs: list[list[int]], pad_id: int, batch_size: int = 64) -> float:
    """Mean next-token cross-entropy (nats per token, ``<|endoftext|>`` included) over all tokens of ``seqs``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    ordered = sorted(seqs, key=len)
    for start in range(0, len(ordered), batch_size):
        batch = collate(ordered[start : start + batch_size], pad_id)
        n = int((batch["labels"][:, 1:] != -100).sum())  # predicted tokens: every real token but the first
        total += float(model(**batch).loss) * n
        count += n
    model.train(was_training)
    return total / count


@torch.no_grad()
def sample(model, tokenizer, prompts, *, seed: int, max_new_tokens: int = 40) -> list[tuple[str, str, bool]]:
    """(prompt, continuation, ended with eos) for temperature-1 top-k-50 samples, one prompt at a time."""
    torch.manual_seed(seed)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        gen = model.generate(
            **ids,
            do_sample=True,
            temperature=1.0,
            top_k=50,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.eos_token_id,
        )
        new = gen[0, ids["input_ids"].shape[1] :].tolist()  # response tokens only
        ended = tokenizer.eos_token_id in new
        out.append((prompt, tokenizer.decode(new, skip_special_tokens=True), ended))
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.time()

    texts = [row["text"] for row in read_jsonl(args.data / "pretrain.jsonl")]
    val_texts = [row["prompt"] + row["completion"] for row in read_jsonl(args.data / "sft_val.jsonl")]
    train_movie = [row["prompt"] + row["completion"] for row in read_jsonl(args.data / "sft_train.jsonl")]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    tokenizer.model_max_length = args.n_positions
    eos = tokenizer.eos_token_id
    print(f"tokenizer: {len(tokenizer)} tokens, eos id {eos}, pad {tokenizer.pad_token}", flush=True)

    train_seqs = encode(tokenizer, texts, args.n_positions)
    n_cut = sum(
        len(s) + 1 > args.n_positions for s in tokenizer(texts, add_special_tokens=False)["input_ids"]
    )
    val_seqs = encode(tokenizer, val_texts, args.n_positions)
    train_probe = encode(tokenizer, train_movie[: len(val_texts)], args.n_positions)  # same size as val
    n_tokens = sum(len(s) for s in train_seqs)
    print(
        f"pretrain: {len(train_seqs)} sentences, {n_tokens} tokens; val: {len(val_seqs)} sentences",
        flush=True,
    )

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=eos,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]  # no decay on biases and LayerNorms
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    model.train()
    stream = batches(train_seqs, args.batch_size, rng)
    recent, seen_tokens, history = [], 0, []
    t_train = time.time()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(
                step, peak=args.lr, warmup=args.warmup, total=args.steps, min_ratio=args.min_lr_ratio
            )
        batch = collate(next(stream), eos)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-100:]
        seen_tokens += int(batch["attention_mask"].sum())
        if (step + 1) % 50 == 0 or step == 0:
            elapsed = time.time() - t_train
            print(
                f"step {step + 1}/{args.steps}  loss {sum(recent) / len(recent):.3f}  "
                f"lr {optimizer.param_groups[0]['lr']:.2e}  epoch {seen_tokens / n_tokens:.2f}  "
                f"{seen_tokens / elapsed:.0f} tok/s  {elapsed / 60:.1f} min",
                flush=True,
            )
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_loss = mean_token_loss(model, val_seqs, eos)
            history.append((step + 1, sum(recent) / len(recent), val_loss))
            print(f"eval step {step + 1}: val loss {val_loss:.3f} (ppl {math.exp(val_loss):.1f})", flush=True)
    train_minutes = (time.time() - t_train) / 60

    final_train = sum(recent) / len(recent)
    probe_loss = mean_token_loss(model, train_probe, eos)
    val_loss = mean_token_loss(model, val_seqs, eos)

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos)
    model.to(torch.float16).save_pretrained(args.out)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(args.out)

    # Round trip: reload as a user would, in float32, and sample from it.
    loaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    loaded_tok = AutoTokenizer.from_pretrained(args.out)
    assert loaded_tok.pad_token is None and loaded_tok.eos_token == EOS
    loaded_val = mean_token_loss(loaded, val_seqs, eos)
    shown = sample(loaded, loaded_tok, SAMPLE_PROMPTS, seed=args.seed)
    eval_prompts = [row["prompt"] for row in read_jsonl(args.data / "eval_prompts.jsonl")][:64]
    eos_rate = sum(ended for _, _, ended in sample(loaded, loaded_tok, eval_prompts, seed=args.seed)) / len(
        eval_prompts
    )
    total_minutes = (time.time() - t_start) / 60
    for prompt, text, ended in shown:
        print(f"sample: {prompt!r} -> {text!r}{'  <eos>' if ended else ''}")
    print(f"val loss float32 {val_loss:.4f}, reloaded from float16 {loaded_val:.4f}; eos rate {eos_rate:.2f}")

    write_card(
        args,
        config=config,
        n_params=n_params,
        n_sentences=len(train_seqs),
        n_tokens=n_tokens,
        n_val=len(val_seqs),
        final_train=final_train,
        probe_loss=probe_loss,
        val_loss=loaded_val,
        history=history,
        samples=shown,
        eos_rate=eos_rate,
        n_eos_prompts=len(eval_prompts),
        train_minutes=train_minutes,
        total_minutes=total_minutes,
        epochs=seen_tokens / n_tokens,
        n_cut=n_cut,
        command=shlex.join(["python", "data/make_base_model.py", *sys.argv[1:]]),
    )
    size_mb = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file()) / 2**20
    print(f"saved {args.out} ({size_mb:.1f} MB) in {total_minutes:.1f} min", flush=True)


def write_card(args, *, config, history, samples, **m) -> None:
    """The model card: what the model is, how it was trained, the numbers of this very run."""
    files = sorted(f for f in args.out.iterdir() if f.is_file() and f.name != "README.md")
    size_mb = sum(f.stat().st_size for f in files) / 2**20
    rows = "\n".join(f"| {s} | {t:.3f} | {v:.3f} |" for s, t, v in history)
    shown = "\n".join(
        f"- **{p}**{t}{'  `<|endoftext|>`' if e else '  (no eos within 40 tokens)'}" for p, t, e in samples
    )
    card = f"""# reviews base model: a small GPT-2 trained from scratch

The base model of the embedded "reviews" task (see `data/README.md`): a byte-level BPE tokenizer and a
{m["n_params"] / 1e6:.2f}M-parameter GPT-2, both trained on this repository's `data/reviews/pretrain.jsonl`
only (no downloaded weights). It writes review-like sentences and stops with `<|endoftext|>`; it is meant
to be SFT-ed, reward-modelled and PPO-ed by the toolkit on a CPU, not to be a good language model.

Load it like any checkpoint (weights are stored in float16; load them in float32 for training):

```python
model = AutoModelForCausalLM.from_pretrained("data/reviews/base_model", dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained("data/reviews/base_model")
```

## Tokenizer
`GPT2Tokenizer` (transformers 5, backed by `tokenizers`), byte-level BPE exactly as gpt2: no prefix
space, {config.vocab_size} tokens (256 bytes + merges + `<|endoftext|>` = id {config.eos_token_id}),
`<|endoftext|>` is bos, eos and unk, and there is **no pad token** (like gpt2: the toolkit must pick a pad
token itself and must not mask the real eos out of the labels). No bos is added when encoding.
`model_max_length` = {config.n_positions}.

## Architecture
`GPT2LMHeadModel`: n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd},
n_positions={config.n_positions} (context length), vocab {config.vocab_size}, tied input/output embeddings,
dropout {args.dropout}; {m["n_params"]:,} parameters; {size_mb:.1f} MB on disk (float16 safetensors +
tokenizer). `generation_config.json`: bos = eos = {config.eos_token_id}, no pad.

## Training
- Data: `pretrain.jsonl`, {m["n_sentences"]:,} sentences / {m["n_tokens"]:,} tokens (train-split movie
  review sentences + all Amazon, NYT-editorial and tweet sentences of Hutto & Gilbert 2014, MIT).
  Each sentence is followed by `<|endoftext|>` and starts at position 0 ({m["n_cut"]} sentences longer than
  {config.n_positions} tokens are cut). Length-grouped batches of {args.batch_size}
  sentences, right-padded, padding masked out of attention and labels.
- Next-token cross-entropy; AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr
  {args.lr}, {args.warmup} warmup steps then cosine to {args.lr * args.min_lr_ratio:g}; gradient norm clipped
  at 1.0; {args.steps} steps (~{m["epochs"]:.1f} epochs), seed {args.seed}, float32 on CPU.
- Held-out data: the {m["n_val"]:,} val-split movie sentences (`sft_val.jsonl`, prompt + completion), never
  trained on.

## Results
| step | train loss (mean of last 100 steps) | held-out loss (val movie sentences) |
|---|---|---|
{rows}

Final, nats per token, `<|endoftext|>` included:
- train loss (mean of the last 100 training steps): {m["final_train"]:.3f}
- train movie sentences (first {m["n_val"]:,} of `sft_train.jsonl`, eval mode): {m["probe_loss"]:.3f}
- held-out val movie sentences, reloaded float16 -> float32: **{m["val_loss"]:.3f}** (perplexity {math.exp(m["val_loss"]):.1f})
- sampling (temperature 1, top-k 50, at most 40 new tokens) from the first {m["n_eos_prompts"]} prompts of
  `eval_prompts.jsonl`: {m["eos_rate"]:.0%} end with `<|endoftext|>`.

Samples (temperature 1, top-k 50, seed {args.seed}, bold = prompt):

{shown}

## Rebuild
```bash
python data/make_reviews.py --out data/reviews          # if the jsonl files are missing
{m["command"]}
```
Built in {m["total_minutes"]:.1f} min ({m["train_minutes"]:.1f} min of training) on a 2-core CPU
(torch {torch.__version__}, {args.threads} torch thread(s), Python {platform.python_version()}) while other jobs
shared the machine, so the time is noisy. The run is seeded; the same machine and library versions give the same weights.

## License and data
Weights and tokenizer are derived from the VADER ICWSM-2014 sentences (MIT, C.J. Hutto; Hutto & Gilbert
2014, ICWSM-14); see `data/README.md` and, from the repository root,
`../shared/data/vader_icwsm2014/PROVENANCE.md`.
"""
    (args.out / "README.md").write_text(card, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
