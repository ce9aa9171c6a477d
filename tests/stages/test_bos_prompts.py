"""A prompt is tokenised the same way in SFT, the RM, PPO and evaluation, BOS included where the
tokenizer adds one (Llama-style tokenizers do; GPT-2's and SmolLM2's do not)."""

from __future__ import annotations

from helpers import bos_model_dir, write_jsonl

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.data import load_sft_dataset
from llm_rlhf.evaluation.measures import sample_batch
from llm_rlhf.models.loading import load_causal_lm, load_tokenizer
from llm_rlhf.models.reward_model import encode_pair
from llm_rlhf.ppo import building as ppo_building
from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.rl.rollout import Sampling, encode_prompt
from llm_rlhf.stages import dpo, sft

PROMPTS = ["The film is", "A tedious, boring"]
COMPLETIONS = [" a delight from start to finish.", " waste."]


def test_every_stage_sees_the_bos(tmp_path):
    folder = bos_model_dir(tmp_path / "bos_model")
    tokenizer = load_tokenizer(str(folder))
    bos = tokenizer.bos_token_id
    expected = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in expected)  # the tokenizer really adds it
    assert [encode_prompt(tokenizer, p) for p in PROMPTS] == expected

    # SFT: the rows TRL's trainer trains on start with the prompt's ids, BOS first
    rows = [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    dataset = load_sft_dataset(path, tokenizer, max_length=32)
    cfg = parse_config(sft.Config, ["--output_dir", str(tmp_path / "sft"), "--max_length", "32"])
    trainer = sft.build_trainer(cfg, load_causal_lm(str(folder)), tokenizer, dataset, dataset)
    for i, ids in enumerate(expected):
        assert trainer.train_dataset[i]["input_ids"][: len(ids)] == ids

    # RM: prompt + response, BOS once at the start
    for p, c, ids in zip(PROMPTS, COMPLETIONS, expected):
        scored = encode_pair(tokenizer, p, c)
        assert scored[: len(ids)] == ids and scored.count(bos) == 1

    # DPO: TRL's prompt ids are the prompt's (BOS first), prompt + response ids are the RM's, BOS once
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl",
        [{"prompt": p, "chosen": c, "rejected": " no."} for p, c in zip(PROMPTS, COMPLETIONS)],
    )
    dpo_cfg = dpo.Config(
        model_name_or_path=str(folder),
        train_file=str(pairs),
        eval_file=str(pairs),
        output_dir=str(tmp_path / "dpo"),
        max_length=32,
        eval_steps=0,
    )
    inputs = dpo.load_inputs(dpo_cfg)
    trainer = dpo.build_trainer(dpo_cfg, inputs.model, inputs.ref_model, tokenizer, inputs.train, None)
    for i, (p, c, ids) in enumerate(zip(PROMPTS, COMPLETIONS, expected)):
        row = trainer.train_dataset[i]
        assert row["prompt_ids"] == ids
        assert row["prompt_ids"] + row["chosen_ids"] == encode_pair(tokenizer, p, c)
        assert (row["prompt_ids"] + row["rejected_ids"]).count(bos) == 1

    # PPO's prompts
    prompt_file = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    ppo_cfg = parse_config(
        ppo_trainer.Config, ["--prompt_file", str(prompt_file), "--output_dir", str(tmp_path / "ppo")]
    )
    assert ppo_building.load_prompt_ids(ppo_cfg, tokenizer) == expected

    # evaluation's queries (left-padded)
    tokenizer.pad_token = tokenizer.eos_token
    samples = sample_batch(
        load_causal_lm(str(folder)), tokenizer, PROMPTS, Sampling(max_new_tokens=3), seed=0
    )
    for row, ids in enumerate(expected):
        query = samples.query[row][samples.query_mask[row].bool()].tolist()
        assert query == ids
