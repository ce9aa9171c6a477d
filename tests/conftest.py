"""Shared fixtures: a tokenizer trained in-process and tiny models saved as HF folders.

Nothing here touches the network: tests load these folders through the same `from_pretrained` code
that users run on `gpt2` or a local checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SENTENCES = [
    "The film is a delight from start to finish.",
    "The film is a dull and lifeless mess.",
    "A gorgeous, moving and funny story.",
    "A tedious, boring waste of time.",
    "The acting is superb and the script is sharp.",
    "The acting is wooden and the script is lazy.",
    "It's a wonderful movie that everyone should see.",
    "It's a terrible movie that nobody should see.",
    "Great performances make this a joy to watch.",
    "Bad writing makes this a chore to sit through.",
]

torch.set_num_threads(2)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def build_tokenizer(folder: Path):
    """A byte-level BPE trained on SENTENCES, GPT-2 style: `<|endoftext|>` is bos/eos, no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 5, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.save_pretrained(folder)
    return fast


def build_model(folder: Path, kind: str = "gpt2", seed: int = 0, n_positions: int = 64) -> Path:
    """A tiny randomly initialised causal LM plus the tokenizer, saved as an HF folder (safetensors)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(folder)
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=n_positions,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=eos,
            eos_token_id=eos,
        )
        model = GPT2LMHeadModel(config)
    elif kind == "llama":
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=n_positions,
            bos_token_id=eos,
            eos_token_id=eos,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    else:
        raise ValueError(kind)
    model.generation_config.pad_token_id = eos
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Path of a tiny GPT-2 HF folder (model + tokenizer without a pad token)."""
    return build_model(tmp_path_factory.mktemp("tiny_gpt2"), "gpt2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Path of a tiny Llama-style HF folder."""
    return build_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture()
def sft_files(tmp_path) -> tuple[Path, Path]:
    """prompt/completion train and val JSONL built from SENTENCES."""
    rows = []
    for s in SENTENCES:
        words = s.split(" ")
        rows.append({"prompt": " ".join(words[:3]), "completion": " " + " ".join(words[3:])})
    return write_jsonl(tmp_path / "sft_train.jsonl", rows * 4), write_jsonl(
        tmp_path / "sft_val.jsonl", rows[:4]
    )


@pytest.fixture()
def pref_files(tmp_path) -> tuple[Path, Path]:
    """prompt/chosen/rejected pairs: the positive sentence of each pair in SENTENCES is chosen."""
    rows = []
    for good, bad in zip(SENTENCES[0::2], SENTENCES[1::2]):
        gw, bw = good.split(" "), bad.split(" ")
        rows.append(
            {"prompt": " ".join(gw[:2]), "chosen": " " + " ".join(gw[2:]), "rejected": " " + " ".join(bw[2:])}
        )
    return write_jsonl(tmp_path / "prefs_train.jsonl", rows * 8), write_jsonl(
        tmp_path / "prefs_val.jsonl", rows
    )


@pytest.fixture(scope="session")
def tiny_rm_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A reward model trained for a few steps from the tiny GPT-2 by `llm-rlhf rm` itself."""
    from llm_rlhf import reward

    tmp = tmp_path_factory.mktemp("rm")
    rows = []
    for good, bad in zip(SENTENCES[0::2], SENTENCES[1::2]):
        gw, bw = good.split(" "), bad.split(" ")
        rows.append(
            {"prompt": " ".join(gw[:2]), "chosen": " " + " ".join(gw[2:]), "rejected": " " + " ".join(bw[2:])}
        )
    train = write_jsonl(tmp / "prefs.jsonl", rows * 4)
    cfg = reward.Config(
        model_name_or_path=str(tiny_model_dir),
        train_file=str(train),
        eval_file=str(train),
        test_file=str(train),
        output_dir=str(tmp / "rm"),
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=1,
        eval_steps=100,
        save_steps=100,
        max_length=48,
    )
    reward.run(cfg)
    return tmp / "rm"


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> Path:
    rows = [{"prompt": " ".join(s.split(" ")[:k])} for s in SENTENCES for k in (2, 3)]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", rows)
