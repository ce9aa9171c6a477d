"""The "arithmetic" task (llm_rlhf/tasks/arithmetic.py, data/arithmetic): the verifier's answer rule against
adversarial responses, reading the problem back from a rendered chat prompt, the split, the committed files."""

from __future__ import annotations

import itertools
import json
import random
from fractions import Fraction

import pytest
import torch
from helpers import ROOT, TAGGED_CHAT_TEMPLATE, load_script, smollm2_chat

from llm_rlhf.core.data import load_prompt_dataset
from llm_rlhf.core.errors import UserError
from llm_rlhf.models.loading import load_tokenizer
from llm_rlhf.models.reward_fn import decode_texts, load_reward_fn, probe
from llm_rlhf.rl.rollout import encode_prompt, left_pad
from llm_rlhf.tasks import arithmetic
from llm_rlhf.tasks.arithmetic import (
    INSTRUCTIONS,
    KIND,
    KINDS,
    Problem,
    final_answer,
    make_splits,
    numbers,
    parse_problem,
    reward,
)

DATA = ROOT / "data" / "arithmetic"
VERIFIER = "llm_rlhf.tasks.arithmetic:reward"


def read(name: str) -> list[dict]:
    with (DATA / name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------------
# the answer rule


@pytest.mark.parametrize(
    "response, answer, score",
    [
        ("3 + 4 = 7", 7, 1.0),  # a worked answer is read at its end
        ("The answer is 7.", 7, 1.0),  # trailing punctuation
        ("7", 7, 1.0),
        ("**7**!", 7, 1.0),
        ("(7)", 7, 1.0),
        ("7 7 7", 7, 1.0),  # the answer repeated
        ("The answer is 7\n\n", 7, 1.0),
        ("7 or 8", 7, 0.0),  # several numbers: only the last counts
        ("The answer is 7, not 8.", 7, 0.0),
        (" ".join(str(n) for n in range(200)), 7, 0.0),  # listing many numbers does not score
        (" ".join(str(n) for n in range(200)) + " 7", 7, 1.0),  # ... unless the last one is the answer
        ("123", 12, 0.0),  # the answer inside a longer number
        ("1234", 23, 0.0),
        ("12", 123, 0.0),
        ("x12", 12, 0.0),  # digits inside a word are no number
        ("12th", 12, 0.0),
        ("The 3rd", 3, 0.0),
        ("-7", -7, 1.0),  # negative numbers
        ("= -7.", -7, 1.0),
        ("\u22127", -7, 1.0),  # the minus sign U+2212
        ("-7", 7, 0.0),
        ("7", -7, 0.0),
        ("12-7", -7, 0.0),  # after a digit the minus is an operator: the number is 7
        ("12-7", 7, 1.0),
        ("no number here", 7, 0.0),  # no number
        ("", 0, 0.0),
        ("seven", 7, 0.0),  # words are not numbers
        ("1,234", 1234, 1.0),  # thousands groups
        ("3,4", 4, 1.0),  # not a thousands group: a list, last 4
        ("12.0", 12, 1.0),  # an integer written with a decimal part
        ("12.5", 12, 0.0),
        ("1.2.3", 3, 0.0),  # a dotted run is no number
        (".5", 5, 0.0),
        ("0", 0, 1.0),
        ("007", 7, 1.0),  # the value counts, not the spelling
    ],
)
def test_answer_rule(response, answer, score):
    prompt = f"What is {answer} + 0?" if answer >= 0 else f"What is 0 - {-answer}?"
    assert reward([smollm2_chat(prompt)], [response]) == [score]


def test_numbers_in_order():
    assert numbers("3 + 4 = 7, not -2 or 1,000.50 (x9, 2nd)") == [3, 4, 7, -2, Fraction(100050, 100)]
    assert final_answer("nothing") is None
    assert final_answer("5 - 3 = 2") == 2


# ---------------------------------------------------------------------------------------------------
# the problem read back from the prompt


def test_every_phrasing_reads_back_as_its_problem():
    """Every problem of every kind, in every phrasing, order and instruction, parses back to exactly its kind and
    operands, and no other phrasing matches its text."""
    checked = 0
    for kind in KINDS:
        for operands in itertools.product(*kind.ranges):
            if not kind.valid(*operands):
                continue
            for phrasing, instruction in itertools.product(
                range(len(kind.phrasings)), range(len(INSTRUCTIONS))
            ):
                problem = Problem(kind.name, operands, phrasing, instruction)
                matches = [(k.name, p) for k, p in arithmetic.PATTERNS if p.search(problem.text)]
                assert len(matches) == 1, (problem.text, matches)
                assert parse_problem(smollm2_chat(problem.text)) == (kind.name, operands)
                checked += 1
    assert checked > 1000  # the loop ran over the tables


def test_the_prompt_around_the_problem_does_not_matter():
    for prompt in (
        "What is 3 + 4?",  # a plain prompt
        smollm2_chat("What is 3 + 4?"),
        "<|user|>What is 3 + 4?\n<|assistant|>",
        smollm2_chat("What   is 3 +\n4?"),  # whitespace a tokenizer or template may change
        smollm2_chat("What is 9 * 9?", "What is 3 + 4?", answers=("81",)),  # the last problem asked counts
    ):
        assert reward([prompt] * 3, ["7", "3 + 4 = 7.", "8"]) == [1.0, 1.0, 0.0], prompt


def test_operands_are_whole_numbers_in_the_prompt():
    assert parse_problem("What is 13 + 4?") == ("add", (13, 4))  # read as written, not "3 + 4"
    assert reward([smollm2_chat("What is 13 + 4?")], ["17"]) == [1.0]
    assert parse_problem(smollm2_chat("What is 12 - 15?")) == ("sub", (12, 15))  # not generated; still exact
    assert reward([smollm2_chat("What is 12 - 15?")], ["-3"]) == [1.0]


def test_a_prompt_without_a_problem_is_an_error():
    """A prompt of another task raises (a run on the wrong prompt file would otherwise train on all zeros);
    through the reward-function loader it is one line naming the function."""
    with pytest.raises(ValueError, match=r"prompt 1 asks no arithmetic problem.*'The film is'"):
        reward([smollm2_chat("What is 3 + 4?"), "The film is"], ["7", "7"])
    loaded = load_reward_fn(VERIFIER)
    with pytest.raises(
        UserError, match=r"^reward_fn 'llm_rlhf.tasks.arithmetic:reward' raised ValueError: prompt 0 "
    ):
        loaded(["What is three plus four?"], ["7"])


def test_loads_as_a_reward_function():
    loaded = load_reward_fn(VERIFIER)
    prompts = [smollm2_chat("What is 3 + 4?"), smollm2_chat("Subtract 2 from 9.")]
    assert probe(loaded, prompts) == [0.0, 0.0, 0.0, 0.0]  # the dummy responses hold no number
    assert loaded(prompts, ["7", "The answer is 7."]) == [1.0, 1.0]


def test_the_committed_prompts_score_through_the_ppo_path(tmp_path, tiny_model_dir):
    """Held-out rows rendered by a chat template (load_prompt_dataset), tokenized and decoded back the way
    PPO hands them to a reward function (encode_prompt, decode_texts): the row's answer scores 1, and 0 once
    changed by one."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.chat_template = TAGGED_CHAT_TEMPLATE
    rows = read("eval_prompts.jsonl")[:16]
    dataset = load_prompt_dataset(DATA / "eval_prompts.jsonl", tokenizer, max_prompt_length=128)
    prompts = dataset["prompt"][:16]
    query, query_mask = left_pad([encode_prompt(tokenizer, p) for p in prompts], tokenizer.eos_token_id)
    eos = tokenizer.eos_token_id
    for shift, expected in ((0, 1.0), (1, 0.0)):
        texts = [f"The answer is {row['answer'] + shift}." for row in rows]
        ids = [tokenizer(t)["input_ids"] + [eos] for t in texts]
        response = torch.full((len(ids), max(map(len, ids)) + 2), eos)  # (B, R) right-padded
        response_mask = torch.zeros_like(response, dtype=torch.bool)  # (B, R) up to and including the EOS
        for i, r in enumerate(ids):
            response[i, : len(r)] = torch.tensor(r)
            response_mask[i, : len(r)] = True
        seen_prompts, seen_responses = decode_texts(tokenizer, query, query_mask, response, response_mask)
        assert seen_responses == texts
        assert reward(seen_prompts, seen_responses) == [expected] * len(rows)


# ---------------------------------------------------------------------------------------------------
# the split and the committed files


MIX = {"add": 1.0, "sub": 2.0, "mul": 1.0}


def test_split_is_seeded_and_shares_no_problem():
    train, held_out = make_splits(seed=3, n_train=500, n_eval=48, mix=MIX)
    assert (train, held_out) == make_splits(seed=3, n_train=500, n_eval=48, mix=MIX)
    assert held_out != make_splits(seed=4, n_train=500, n_eval=48, mix=MIX)[1]
    assert not {p.key for p in train} & {p.key for p in held_out}
    assert len({p.key for p in held_out}) == 48  # each held-out problem once
    assert sorted(p.kind for p in held_out) == sorted(["add"] * 12 + ["sub"] * 24 + ["mul"] * 12)
    assert {p.kind for p in train} == set(MIX)
    state = random.getstate()
    make_splits(seed=3, n_train=10, n_eval=4, mix=MIX)
    assert random.getstate() == state  # no global random state used or changed


def test_commuted_operands_are_one_problem():
    assert Problem("add", (3, 4), 0).key == Problem("add", (4, 3), 1).key
    assert Problem("sub", (9, 4), 0).key != Problem("sub", (4, 9), 0).key
    with pytest.raises(ValueError, match="keep at least half"):
        make_splits(seed=0, n_train=10, n_eval=23, mix={"mul": 1.0})  # 45 'mul' problems in all


def test_committed_files():
    train, held_out = read("train_prompts.jsonl"), read("eval_prompts.jsonl")
    assert len(held_out) >= 70 and len(train) >= 1000
    keys = {}
    for name, rows in (("train", train), ("eval", held_out)):
        keys[name] = set()
        for i, row in enumerate(rows):
            assert set(row) == {"messages", "answer", "kind"}, (name, i)
            (turn,) = row["messages"]
            assert turn["role"] == "user"
            kind, operands = parse_problem(smollm2_chat(turn["content"]))
            assert (kind, KIND[kind].answer(*operands)) == (row["kind"], row["answer"]), (name, i)
            keys[name].add(arithmetic.problem_key(kind, operands))
    assert not keys["train"] & keys["eval"]  # train and held-out share no problem
    assert len(keys["eval"]) == len(held_out)


def test_committed_files_match_the_script(tmp_path, monkeypatch):
    module = load_script(ROOT / "data" / "make_arithmetic.py", monkeypatch=monkeypatch)
    module.build(tmp_path)
    for name in ("train_prompts.jsonl", "eval_prompts.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
