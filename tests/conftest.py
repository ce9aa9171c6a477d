"""Shared fixtures: tiny models saved as HF folders, small data files, a reward model trained by `llm-rlhf rm`
itself, and the fixtures that tests of several folders share (a second policy, an EOS-prone model, a chat
model, ensemble members). The builders behind them live in `helpers.py` (imported by the tests as
`from helpers import ...`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    COLON_CHAT_TEMPLATE,
    SENTENCES,
    build_model,
    eos_prone_model,
    perturbed_member,
    preference_rows,
    with_chat_template,
    write_jsonl,
)

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


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """A second tiny GPT-2 (other weights, the same tokenizer): a policy that differs from the baseline."""
    return build_model(tmp_path_factory.mktemp("tiny_gpt2_other"), "gpt2", seed=1)


@pytest.fixture(scope="module")
def eos_prone_dir(tmp_path_factory) -> Path:
    """The tiny GPT-2 whose responses end early (`eos_prone_model`)."""
    return eos_prone_model(tmp_path_factory.mktemp("tiny_gpt2_eos"))


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny GPT-2 whose tokenizer has a chat template (COLON_CHAT_TEMPLATE), as an instruct model's."""
    folder = tmp_path_factory.mktemp("tiny_gpt2_chat") / "model"
    return with_chat_template(tiny_model_dir, folder, COLON_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def members(tiny_rm_dir, tmp_path_factory) -> list[str]:
    """Three reward models that disagree: the tiny RM and two copies with heads and normalisations of their own."""
    tmp = tmp_path_factory.mktemp("members")
    return [
        str(tiny_rm_dir),
        str(perturbed_member(tiny_rm_dir, tmp / "m1", seed=1, mean=0.3, std=2.0)),
        str(perturbed_member(tiny_rm_dir, tmp / "m2", seed=2, mean=-0.2, std=0.5)),
    ]
