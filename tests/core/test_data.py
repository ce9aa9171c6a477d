"""The data layer: every schema, every file type, every bad input with its exact message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FIXTURES, ROOT, TAGGED_CHAT_TEMPLATE, flags, write_jsonl

from llm_rlhf.core import data
from llm_rlhf.core.data import load_preference_dataset, load_prompt_dataset, load_rows, load_sft_dataset
from llm_rlhf.core.errors import DataError
from llm_rlhf.interfaces import cli
from llm_rlhf.models.loading import load_tokenizer

CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "How is the film?"},
    {"role": "assistant", "content": "A delight."},
]


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))  # fresh per test: some tests set a chat template


@pytest.fixture()
def chat_tokenizer(tokenizer):
    tokenizer.chat_template = TAGGED_CHAT_TEMPLATE
    return tokenizer


def rows_of(dataset) -> list[dict]:
    return dataset.to_list()


# ---------------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------------


def test_prompt_completion(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "The film", "completion": " is fine.", "id": 1}])
    assert rows_of(load_sft_dataset(path, tokenizer, max_length=32)) == [
        {"prompt": "The film", "completion": " is fine."}  # extra columns are dropped, no EOS added here
    ]


def test_text_becomes_an_empty_prompt(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "The film is fine."}])
    assert rows_of(load_sft_dataset(path, tokenizer, max_length=32)) == [
        {"prompt": "", "completion": "The film is fine."}
    ]


def test_messages_render_with_the_chat_template(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    (row,) = rows_of(load_sft_dataset(path, chat_tokenizer, max_length=64))
    assert row["prompt"] == "<|user|>Hi\n<|assistant|>Hello\n<|user|>How is the film?\n<|assistant|>"
    assert row["completion"] == "A delight.\n"  # the last assistant turn (as the template renders it)


def test_messages_without_a_chat_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError) as e:
        load_sft_dataset(path, tokenizer, max_length=64)
    assert str(e.value) == (
        f"{path}: rows are chat 'messages' but the tokenizer has no chat template; set "
        "`tokenizer.chat_template` (or use a chat model's tokenizer), or convert the rows to prompt/completion"
    )


def test_prompt_chosen_rejected(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "The film", "chosen": " is great", "rejected": " is bad"}]
    )
    assert rows_of(load_preference_dataset(path, tokenizer, max_length=32)) == [
        {"prompt": "The film", "chosen": " is great", "rejected": " is bad"}
    ]


def test_hh_style_splits_at_the_last_assistant_tag(tmp_path, tokenizer):
    dialogue = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Any good film?"
    path = write_jsonl(
        tmp_path / "hh.jsonl",
        [
            {
                "chosen": dialogue + "\n\nAssistant: Sure, try Up.",
                "rejected": dialogue + "\n\nAssistant: Sure. No.",
            }
        ],
    )
    (row,) = rows_of(load_preference_dataset(path, tokenizer, max_length=64))
    assert row == {
        "prompt": dialogue + "\n\nAssistant:",
        "chosen": " Sure, try Up.",
        "rejected": " Sure. No.",
    }


def test_hh_style_plain_text_splits_at_a_word_boundary():
    assert data.split_shared_prompt("The film is great", "The film is grim") == (
        "The film is",
        " great",
        " grim",
    )


def test_ranked_expands_to_all_pairs(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "r.jsonl",
        [{"prompt": "P", "ranked": ["b", "a", "d", "c"]}, {"prompt": "Q", "ranked": ["x", "y"]}],
    )
    pairs = rows_of(load_preference_dataset(path, tokenizer, max_length=32))
    assert len(pairs) == 4 * 3 // 2 + 1
    assert [(p["chosen"], p["rejected"]) for p in pairs if p["prompt"] == "P"] == [
        ("b", "a"),
        ("b", "d"),
        ("b", "c"),
        ("a", "d"),
        ("a", "c"),
        ("d", "c"),
    ]


def test_prompt_dataset_schemas(tmp_path, chat_tokenizer):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "The film", "extra": 1}])
    assert rows_of(load_prompt_dataset(p, chat_tokenizer, max_prompt_length=8)) == [{"prompt": "The film"}]
    t = write_jsonl(tmp_path / "t.jsonl", [{"text": "The film"}])
    assert rows_of(load_prompt_dataset(t, chat_tokenizer, max_prompt_length=8)) == [{"prompt": "The film"}]
    m = write_jsonl(tmp_path / "m.jsonl", [{"messages": CHAT}, {"messages": CHAT[:1]}])
    assert rows_of(load_prompt_dataset(m, chat_tokenizer, max_prompt_length=64)) == [
        {"prompt": "<|user|>Hi\n<|assistant|>Hello\n<|user|>How is the film?\n<|assistant|>"},
        {"prompt": "<|user|>Hi\n<|assistant|>"},
    ]


def test_csv_parquet_and_json_array_files(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "The film", "completion": " is fine, 1."}, {"prompt": "A", "completion": " story"}]
    csv_path = tmp_path / "d.csv"
    csv_path.write_text('prompt,completion\nThe film," is fine, 1."\nA, story\n', encoding="utf-8")
    pq_path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), pq_path)
    json_path = tmp_path / "d.json"
    json_path.write_text(json.dumps(rows), encoding="utf-8")
    for path in (csv_path, pq_path, json_path):
        assert rows_of(load_sft_dataset(path, tokenizer, max_length=32)) == rows, path

    prefs = tmp_path / "p.csv"
    prefs.write_text("prompt,chosen,rejected\nThe film, is great, is bad\n", encoding="utf-8")
    assert rows_of(load_preference_dataset(prefs, tokenizer, max_length=32)) == [
        {"prompt": "The film", "chosen": " is great", "rejected": " is bad"}
    ]


def test_load_rows_keeps_every_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "margin": 1.5}, {"prompt": "b", "margin": 0.5}])
    dataset = load_rows(path)
    assert dataset.column_names == ["prompt", "margin"] and dataset["margin"] == [1.5, 0.5]


def test_the_reviews_files_load(tokenizer):
    root = ROOT / "data" / "reviews"
    if not (root / "sft_train.jsonl").exists():
        pytest.skip("data/reviews not built")
    assert load_sft_dataset(root / "sft_val.jsonl", tokenizer, max_length=512).column_names == [
        "prompt",
        "completion",
    ]
    assert len(load_preference_dataset(root / "prefs_val.jsonl", tokenizer, max_length=512)) > 0


# ---------------------------------------------------------------------------------------------------
# HH rows (Anthropic/hh-rlhf): chosen/rejected dialogues for SFT, RM and PPO prompts
# ---------------------------------------------------------------------------------------------------

HH_FILE = FIXTURES / "hh_rlhf.jsonl"
HH_TURN_1 = "\n\nHuman: Hi there.\n\nAssistant: Hello! How can I help?"
HH_PROMPT_2 = HH_TURN_1 + "\n\nHuman: Can you recommend a book about space?\n\nAssistant:"


def test_hh_rows_for_sft_are_the_chosen_dialogue_split_at_the_last_assistant_tag(tokenizer):
    rows = rows_of(load_sft_dataset(HH_FILE, tokenizer, max_length=256))
    assert len(rows) == 18
    assert rows[:2] == [
        {
            "prompt": "\n\nHuman: What is a good movie to watch tonight?\n\nAssistant:",
            "completion": " I'd suggest a warm comedy, something light and funny.",
        },
        {"prompt": HH_PROMPT_2, "completion": " Cosmos by Carl Sagan is a wonderful, readable start."},
    ]


def test_hh_rows_give_the_same_prompt_to_sft_rm_and_ppo(tokenizer):
    sft_rows = load_sft_dataset(HH_FILE, tokenizer, max_length=256)
    pairs = load_preference_dataset(HH_FILE, tokenizer, max_length=256)
    prompts = load_prompt_dataset(HH_FILE, tokenizer, max_prompt_length=256)
    assert sft_rows["prompt"] == pairs["prompt"] == prompts["prompt"]
    assert pairs[1] == {"prompt": HH_PROMPT_2, "chosen": sft_rows[1]["completion"], "rejected": " No."}
    assert [r["prompt"] + r["completion"] for r in rows_of(sft_rows)] == [
        json.loads(line)["chosen"] for line in HH_FILE.read_text().splitlines()
    ]


def test_hh_format_is_detected_or_required(tmp_path, tokenizer):
    assert load_sft_dataset(HH_FILE, tokenizer, max_length=256, data_format="hh")["prompt"][1] == HH_PROMPT_2
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(DataError) as e:
        load_sft_dataset(path, tokenizer, max_length=32, data_format="hh")
    assert str(e.value) == f"{path}, row 1, field 'chosen': missing (or null)"


def test_skip_long_leaves_out_long_prompts_and_prints_the_count(tokenizer, capsys):
    # prompt lengths (tokens): the nine 1-turn dialogues 36-44, the nine 2-turn ones 77-88
    sft_rows = load_sft_dataset(HH_FILE, tokenizer, max_length=64, skip_long=True)
    assert capsys.readouterr().out == (
        f"{HH_FILE}: skipped 9 of 18 examples whose prompt is too long: max_length=64 leaves room for at most "
        "62 prompt tokens (plus one response token and the EOS)\n"
    )
    pairs = load_preference_dataset(HH_FILE, tokenizer, max_length=64, skip_long=True)
    assert capsys.readouterr().out.startswith(f"{HH_FILE}: skipped 9 of 18 pairs whose prompt is too long: ")
    prompts = load_prompt_dataset(HH_FILE, tokenizer, max_prompt_length=62, skip_long=True)
    assert capsys.readouterr().out == (
        f"{HH_FILE}: skipped 9 of 18 prompts that are too long: the limit is max_prompt_length=62\n"
    )
    assert sft_rows["prompt"] == pairs["prompt"] == prompts["prompt"]
    assert len(prompts) == 9 and HH_PROMPT_2 not in prompts["prompt"]
    assert len(load_prompt_dataset(HH_FILE, tokenizer, max_prompt_length=88, skip_long=True)) == 18
    assert capsys.readouterr().out == "", "nothing left out, nothing printed"


@pytest.mark.parametrize("rows", ["hh", "prompt"])
def test_skip_long_off_is_an_error_naming_the_row(rows, tmp_path, tokenizer):
    """A prompt longer than max_prompt_length, without skip_long: one line naming the file, the row, the
    field and the length (an HH dialogue's prompt, and a plain prompt row)."""
    if rows == "hh":
        path, limit, row, tokens = HH_FILE, 62, 2, 88
    else:
        path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "The film is a delight from start to finish."}])
        limit, row, tokens = 4, 1, 11
    with pytest.raises(DataError) as e:
        load_prompt_dataset(path, tokenizer, max_prompt_length=limit)
    assert str(e.value) == (
        f"{path}, row {row}, field 'prompt': {tokens} tokens is too long: the limit is "
        f"max_prompt_length={limit}; shorten the prompt or raise the limit"
    )


def test_skip_long_with_every_prompt_too_long(tokenizer):
    with pytest.raises(DataError) as e:
        load_prompt_dataset(HH_FILE, tokenizer, max_prompt_length=8, skip_long=True)
    assert str(e.value) == f"{HH_FILE}: every prompt is too long: the limit is max_prompt_length=8"


BAD_HH = {
    "no assistant tag": (
        {"chosen": "\n\nHuman: Hi\n\nHuman: Any good film?", "rejected": "\n\nHuman: Hi"},
        "{f}, row 2, field 'chosen': no '\\n\\nAssistant:' tag to split the dialogue at (HH rows end with an "
        "assistant turn)",
    ),
    "nothing after the tag": (
        {"chosen": "\n\nHuman: Hi\n\nAssistant: ", "rejected": "\n\nHuman: Hi\n\nAssistant: Go."},
        "{f}, row 2, field 'chosen': nothing after the last '\\n\\nAssistant:' to learn from",
    ),
    "chosen not a string": (
        {"chosen": ["\n\nHuman: Hi"], "rejected": "\n\nHuman: Hi\n\nAssistant: Go."},
        "{f}, row 2, field 'chosen': expected a string, got list (['\\n\\nHuman: Hi'])",
    ),
}


@pytest.mark.parametrize("case", list(BAD_HH))
def test_bad_hh_row_for_sft(case, tmp_path, tokenizer):
    row, message = BAD_HH[case]
    good = json.loads(HH_FILE.read_text().splitlines()[0])
    path = write_jsonl(tmp_path / "hh.jsonl", [good, row])
    with pytest.raises(DataError) as e:
        load_sft_dataset(path, tokenizer, max_length=256, data_format="hh")
    assert str(e.value) == message.format(f=path)


def test_bad_hh_row_for_prompts(tmp_path, tokenizer):
    row, message = BAD_HH["no assistant tag"]
    good = json.loads(HH_FILE.read_text().splitlines()[0])
    path = write_jsonl(tmp_path / "hh.jsonl", [good, row])
    with pytest.raises(DataError) as e:
        load_prompt_dataset(path, tokenizer, max_prompt_length=256)
    assert str(e.value) == message.format(f=path)
    ended = write_jsonl(tmp_path / "ended.jsonl", [good, BAD_HH["nothing after the tag"][0]])
    assert load_prompt_dataset(ended, tokenizer, max_prompt_length=256)["prompt"][1] == (
        "\n\nHuman: Hi\n\nAssistant:"
    ), "a prompt needs no response after it"


@pytest.mark.parametrize("stage", ["sft", "reward", "ppo", "evaluate"])
def test_stage_config_keys_for_hh(stage):
    import importlib

    from llm_rlhf.core.config import parse_config
    from llm_rlhf.core.errors import ConfigError

    config = importlib.import_module(f"llm_rlhf.stages.{stage}").Config
    cfg = parse_config(config, ["--data_format", "hh", "--skip_long"])
    assert (cfg.data_format, cfg.skip_long) == ("hh", True)
    assert (config().data_format, config().skip_long) == ("auto", False)
    with pytest.raises(ConfigError) as e:
        parse_config(config, ["--data_format", "anthropic"])
    assert str(e.value) == "config key 'data_format': must be one of auto, hh"


def test_ppo_and_eval_read_their_prompt_files_with_the_stage_keys(tiny_model_dir, tokenizer, capsys):
    """PPO's prompt_file and eval_prompt_file and evaluation's prompt_file: data_format and skip_long reach
    the loader (skipped rows counted, the rest used); without skip_long the error names the row. The RM's
    three pair files are run by the gpt2-hh recipe test."""
    from llm_rlhf.core.config import parse_config
    from llm_rlhf.evaluation import measures
    from llm_rlhf.ppo import building as ppo_building
    from llm_rlhf.ppo import trainer as ppo_trainer
    from llm_rlhf.stages import evaluate

    keys = ["--max_prompt_length", "62", "--data_format", "hh"]
    ppo_cfg = parse_config(
        ppo_trainer.Config,
        [
            *keys,
            "--model_name_or_path",
            str(tiny_model_dir),
            "--prompt_file",
            str(HH_FILE),
            "--eval_prompt_file",
            str(HH_FILE),
            "--gold_judge",
            "none",
            "--eval_num_prompts",
            "100",
        ],
    )
    eval_cfg = parse_config(evaluate.Config, [*keys, "--prompt_file", str(HH_FILE), "--num_prompts", "9"])
    loaders = {
        "ppo prompt_file": lambda cfg: ppo_building.load_prompt_ids(cfg, tokenizer),
        "ppo eval_prompt_file": lambda cfg: measures.load_heldout_inputs(cfg)[0],
        "eval prompt_file": lambda cfg: evaluate.load_prompt_texts(cfg, tokenizer),
    }
    skipped = f"{HH_FILE}: skipped 9 of 18 prompts that are too long: the limit is max_prompt_length=62\n"
    for what, load in loaders.items():
        cfg = eval_cfg if what.startswith("eval") else ppo_cfg
        cfg.skip_long = True
        assert len(load(cfg)) == 9, what
        assert capsys.readouterr().out == skipped, what
        cfg.skip_long = False
        with pytest.raises(DataError) as e:
            load(cfg)
        assert str(e.value).startswith(f"{HH_FILE}, row 2, field 'prompt': 88 tokens is too long: "), what


# ---------------------------------------------------------------------------------------------------
# Bad input: one message naming file, row and field
# ---------------------------------------------------------------------------------------------------

GOOD = {"prompt": "The film", "completion": " is fine."}


def write_bytes(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


BAD_SFT = {
    "missing field": (
        lambda d: write_jsonl(d / "f.jsonl", [GOOD, {"prompt": "The film"}]),
        "{f}, row 2, field 'completion': missing (or null)",
    ),
    "wrong type": (
        lambda d: write_jsonl(d / "f.jsonl", [GOOD, GOOD, {"prompt": 5, "completion": " x"}]),
        "{f}, row 3, field 'prompt': expected a string, got int (5)",
    ),
    "empty string": (
        lambda d: write_jsonl(d / "f.jsonl", [{"prompt": "The film", "completion": ""}]),
        "{f}, row 1, field 'completion': is an empty string",
    ),
    "whitespace only": (
        lambda d: write_jsonl(d / "f.jsonl", [{"prompt": "  ", "completion": " x"}]),
        "{f}, row 1, field 'prompt': is only whitespace",
    ),
    "undecodable bytes": (
        lambda d: write_bytes(
            d / "f.jsonl", b'{"prompt": "a", "completion": " b"}\n{"prompt": "\xff", "completion": " b"}\n'
        ),
        "{f}, row 2: not valid UTF-8 (byte 0xff at offset 48); save the file as UTF-8",
    ),
    "unparsable JSON line": (
        lambda d: write_bytes(
            d / "f.jsonl", b'{"prompt": "a", "completion": " b"}\n\n{"prompt": "a" "completion": " b"}\n'
        ),
        "{f}, row 3: not valid JSON (Expecting ',' delimiter at column 16)",
    ),
    "not an object": (
        lambda d: write_bytes(d / "f.jsonl", b'["a", "b"]\n'),
        "{f}, row 1: expected a JSON object per line, got list",
    ),
    "empty dataset": (lambda d: write_bytes(d / "f.jsonl", b"\n"), "{f}: empty dataset: no rows"),
    "missing file": (lambda d: d / "nope.jsonl", "{f}: no such file"),
    "unknown schema": (
        lambda d: write_jsonl(d / "f.jsonl", [{"question": "a", "answer": "b"}]),
        "{f}: no SFT schema found: expected columns prompt/completion, messages, text or chosen/rejected; found "
        "question, answer",
    ),
    "prompt too long": (
        lambda d: write_jsonl(
            d / "f.jsonl",
            [GOOD, {"prompt": "The film is a delight from start to finish.", "completion": " x"}],
        ),
        "{f}, row 2, field 'prompt': 11 tokens is too long: max_length=10 leaves room for at most 8 prompt tokens "
        "(plus one response token and the EOS); shorten the prompt or raise the limit",
    ),
    "empty CSV cell (row = line)": (
        lambda d: write_bytes(d / "f.csv", b"prompt,completion\nThe film, is fine\nThe film,\n"),
        "{f}, row 3, field 'completion': is an empty string",
    ),
    "chat turn without content": (
        lambda d: write_jsonl(
            d / "f.jsonl", [{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}]
        ),
        "{f}, row 1, field 'messages[0].content': missing (or null)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SFT))
def test_bad_sft_input(case, tmp_path, chat_tokenizer):
    make, message = BAD_SFT[case]
    path = make(tmp_path)
    with pytest.raises(DataError) as e:
        load_sft_dataset(path, chat_tokenizer, max_length=10)
    assert str(e.value) == message.format(f=path)


def test_prompt_length_count_is_what_the_tokenizer_says(tokenizer):
    assert (
        len(tokenizer("The film is a delight from start to finish.")["input_ids"]) == 11
    )  # pins the case above


BAD_PREFERENCES = {
    "chosen == rejected": (
        [{"prompt": "The film", "chosen": " is great", "rejected": " is great"}],
        "{f}, row 1, field 'rejected': identical to 'chosen': a pair needs two different responses",
    ),
    "HH-style identical": (
        [{"chosen": "Human: a Assistant: b", "rejected": "Human: a Assistant: b"}],
        "{f}, row 1, field 'rejected': identical to 'chosen': a pair needs two different responses",
    ),
    "HH-style nothing shared": (
        [{"chosen": "Great", "rejected": "Bad"}],
        "{f}, row 1, field 'chosen': shares no prefix with 'rejected' to use as the prompt (HH-style rows are "
        "full texts: a common dialogue followed by two responses)",
    ),
    "missing rejected": (
        [{"prompt": "The film", "chosen": " is great"}],
        "{f}, row 1, field 'rejected': missing (or null)",
    ),
    "ranked duplicates": (
        [{"prompt": "P", "ranked": ["a", "b", "a"]}],
        "{f}, row 1, field 'ranked[2]': identical to 'ranked[0]': a pair needs two different responses",
    ),
    "ranked too short": (
        [{"prompt": "P", "ranked": ["a"]}],
        "{f}, row 1, field 'ranked': expected a list of at least 2 responses, best first",
    ),
    "ranked wrong type": (
        [{"prompt": "P", "ranked": ["a", 3]}],
        "{f}, row 1, field 'ranked[1]': expected a string, got int (3)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PREFERENCES))
def test_bad_preference_input(case, tmp_path, tokenizer):
    rows, message = BAD_PREFERENCES[case]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_preference_dataset(path, tokenizer, max_length=32)
    assert str(e.value) == message.format(f=path)


def test_mixed_column_types_in_load_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": 3}])
    with pytest.raises(DataError) as e:
        load_rows(path)
    assert str(e.value) == f"{path}, row 3, field 'prompt': is int here but str in earlier rows"


def test_hub_failure_is_one_line(monkeypatch, tokenizer):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError(
            "Couldn't reach 'someone/reviews' on the Hub (LocalEntryNotFoundError)\nmore detail"
        )

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as e:
        load_sft_dataset("someone/reviews", tokenizer, max_length=32)
    assert str(e.value) == (
        "someone/reviews: cannot load hub dataset (split 'train'): Couldn't reach 'someone/reviews' on the Hub "
        "(LocalEntryNotFoundError). Local files need a .jsonl/.json/.csv/.parquet suffix"
    )


def test_hub_dataset_rows_are_numbered(monkeypatch, tokenizer):
    import datasets

    hub = datasets.Dataset.from_list([GOOD, {"prompt": "x", "completion": None}])
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: hub)
    with pytest.raises(DataError) as e:
        load_sft_dataset("someone/reviews", tokenizer, max_length=32, split="validation")
    assert str(e.value) == "someone/reviews[validation], row 2, field 'completion': missing (or null)"


# ---------------------------------------------------------------------------------------------------
# Through the CLI: exit code 2, one line, nothing written
# ---------------------------------------------------------------------------------------------------


def sft_argv(model_dir, train_file, eval_file, out, **keys) -> list[str]:
    """`sft` with its model, data files and output folder (and `keys`) as command-line flags."""
    values = dict(model_name_or_path=model_dir, train_file=train_file, eval_file=eval_file, output_dir=out)
    return ["sft", *flags({**values, **keys})]


@pytest.mark.parametrize("case", ["missing field", "undecodable bytes", "prompt too long", "empty dataset"])
def test_cli_bad_data_exits_2_and_writes_nothing(case, tmp_path, tiny_model_dir, sft_files, capsys):
    make, message = BAD_SFT[case]
    bad = make(tmp_path)
    out = tmp_path / "run"
    code = cli.main(sft_argv(tiny_model_dir, bad, sft_files[1], out, max_length=10))
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"error: {message.format(f=bad)}\n"
    assert "Traceback" not in err
    assert not out.exists()


def test_cli_missing_model_folder(tmp_path, sft_files, capsys):
    out = tmp_path / "run"
    code = cli.main(
        [
            "sft",
            "--model_name_or_path",
            str(tmp_path / "no_model"),
            "--train_file",
            str(sft_files[0]),
            "--eval_file",
            str(sft_files[1]),
            "--output_dir",
            str(out),
        ]
    )
    assert code == 2
    assert capsys.readouterr().err == f"error: model_name_or_path '{tmp_path / 'no_model'}': no such folder\n"
    assert not out.exists()


@pytest.mark.slow
def test_cli_subprocess_bad_row(tmp_path, tiny_model_dir, sft_files):
    """The real entry point: exit code 2, the last stderr line is the error, no traceback anywhere."""
    import subprocess
    import sys

    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD, {"prompt": "The film", "completion": 3}])
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "llm_rlhf", *sft_argv(tiny_model_dir, bad, sft_files[1], out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"error: {bad}, row 2, field 'completion': expected a string, got int (3)"
    )
    assert "Traceback" not in proc.stderr
    assert not out.exists()
