"""`score_texts` and `llm-rlhf score`: batched scoring of prompt/response pairs with a saved RM."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import write_jsonl

from llm_rlhf.interfaces.cli import main
from llm_rlhf.models.reward_model import (
    RewardModel,
    add_pad_token,
    load_reward_model,
    load_sequence_classifier,
    save_reward_model,
)
from llm_rlhf.stages.score import score_texts

PAIRS = [
    ("The film", " is a delight from start to finish."),
    ("The film", " is a dull and lifeless mess."),
    ("", "A tedious, boring waste of time."),
    ("It's a", " wonderful movie that everyone should see, a joy to watch, great performances."),
    ("Bad writing", " makes this a chore."),
]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tiny_model_dir):
    """A saved (untrained) RM folder with a stored normalisation, as `llm-rlhf rm` writes it."""
    from llm_rlhf.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    torch.manual_seed(0)
    model = load_sequence_classifier(
        str(tiny_model_dir), dtype="float32", trust_remote_code=False, need_head=False
    )
    add_pad_token(model, tokenizer)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    folder = tmp_path_factory.mktemp("rm")
    normalization = {"mean": 0.25, "std": 0.5, "reference_set": "test", "n": 5}
    save_reward_model(RewardModel(model, tokenizer, normalization), folder, merge_lora=False)
    return folder


def test_score_texts_is_normalised_and_independent_of_batch_size(rm_dir):
    rm = load_reward_model(rm_dir)
    prompts, responses = [p for p, _ in PAIRS], [r for _, r in PAIRS]
    one = score_texts(rm, prompts, responses, batch_size=1)
    many = score_texts(rm, prompts, responses, batch_size=3)
    assert len(one) == len(PAIRS) and all(isinstance(s, float) for s in one)
    assert one == pytest.approx(many, abs=1e-5)
    tokenizer = rm.tokenizer
    ids = tokenizer(prompts[0] + responses[0])["input_ids"] + [tokenizer.eos_token_id]
    with torch.no_grad():
        raw = rm(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).item()
    assert one[0] == pytest.approx((raw - 0.25) / 0.5, abs=1e-5)


def test_score_command_writes_every_row_with_its_score(tmp_path, rm_dir, capsys):
    rows = [{"prompt": p, "response": r, "id": i} for i, (p, r) in enumerate(PAIRS)]
    src, dst = write_jsonl(tmp_path / "pairs.jsonl", rows), tmp_path / "scored.jsonl"
    code = main(
        [
            "score",
            "--model_path",
            str(rm_dir),
            "--input_file",
            str(src),
            "--output_file",
            str(dst),
            "--batch_size",
            "2",
        ]
    )
    assert code == 0
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in out] == list(range(len(PAIRS)))  # input order and fields kept
    expected = score_texts(load_reward_model(rm_dir), [p for p, _ in PAIRS], [r for _, r in PAIRS])
    assert [r["score"] for r in out] == pytest.approx(expected, abs=1e-5)
    assert [r["raw_score"] for r in out] == pytest.approx([0.25 + 0.5 * s for s in expected], abs=1e-5)
    assert "wrote 5 scored rows" in capsys.readouterr().out


def test_score_command_errors_name_the_row_and_write_nothing(tmp_path, rm_dir, capsys):
    dst = tmp_path / "scored.jsonl"
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"prompt": "A", "response": " b"}, {"prompt": "A", "response": ""}]
    )
    assert (
        main(["score", "--model_path", str(rm_dir), "--input_file", str(bad), "--output_file", str(dst)]) == 2
    )
    assert "bad.jsonl, row 2, field 'response'" in capsys.readouterr().err
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "A", "response": " b"}])
    assert (
        main(
            [
                "score",
                "--model_path",
                str(tmp_path / "nope"),
                "--input_file",
                str(good),
                "--output_file",
                str(dst),
            ]
        )
        == 2
    )
    assert "no such folder" in capsys.readouterr().err
    assert (
        main(["score", "--model_path", str(rm_dir), "--input_file", str(good)]) == 2
    )  # output_file is required
    assert "output_file" in capsys.readouterr().err
    assert not dst.exists()
