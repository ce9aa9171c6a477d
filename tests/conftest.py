"""Shared fixtures: tiny models saved as HF folders, small data files, a reward model trained by `llm-rlhf rm`
itself. The builders behind them live in `helpers.py` (imported by the tests as `from helpers import ...`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SENTENCES, build_model, preference_rows, write_jsonl

torch.set_num_threads(2)


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
    rows = preference_rows()
    return write_jsonl(tmp_path / "prefs_train.jsonl", rows * 8), write_jsonl(
        tmp_path / "prefs_val.jsonl", rows
    )


@pytest.fixture(scope="session")
def tiny_rm_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A reward model trained for a few steps from the tiny GPT-2 by `llm-rlhf rm` itself."""
    from llm_rlhf.stages import reward

    tmp = tmp_path_factory.mktemp("rm")
    train = write_jsonl(tmp / "prefs.jsonl", preference_rows() * 4)
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
