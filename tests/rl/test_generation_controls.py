"""Generation controls and chat prompts: stop strings, min_new_tokens and chat `messages` prompts, in sampling,
PPO, evaluation and the judge (on two processes: tests/multiprocess/test_ppo_options_on_two_processes.py).

The invariant behind the first two: the sampled tokens come from the distribution whose log-probs PPO uses.
A stop string only cuts a response after sampling (the kept tokens are the draws made without it); under
min_new_tokens EOS cannot be drawn early, and every log-prob computation masks it the same way. Both are
checked against what the sampler itself drew from (its processed scores), not against our own forward.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers import (
    CHATS,
    COLON_CHAT_TEMPLATE,
    RENDERED,
    SENTIMENT_JUDGE,
    STOP_STRINGS,
    bos_model_dir,
    code_blocks,
    doc_section,
    eval_config,
    multinomial_draw,
    naive_end,
    naive_inverse_cdf_draw,
    naive_sample,
    ppo_config,
    recording_rollouts,
    tiny_ppo_trainer,
    write_jsonl,
)
from transformers import AutoTokenizer

from llm_rlhf.core.config import parse_config, save_config
from llm_rlhf.core.data import load_prompt_dataset
from llm_rlhf.core.errors import ConfigError, DataError
from llm_rlhf.evaluation import measures
from llm_rlhf.interfaces import cli
from llm_rlhf.models.gold import judge_details, load_judge
from llm_rlhf.models.loading import Reference, freeze, load_causal_lm, load_tokenizer
from llm_rlhf.models.reward_model import load_reward_model
from llm_rlhf.models.scoring import Scorer
from llm_rlhf.ppo import building as ppo_building
from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.rl import fast_sampling, ppo_math, token_math
from llm_rlhf.rl.rollout import (
    Samples,
    Sampling,
    completes_stop_string,
    encode_prompt,
    left_pad,
    response_logprobs_and_values,
    sample,
    stop_string_ends,
)
from llm_rlhf.stages import evaluate, ppo

PROMPTS = ["The film is", "A gorgeous", "It's a terrible movie", "The acting"]
# --- fixtures and references -------------------------------------------------------------------------


def record_sampled_scores(monkeypatch) -> list:
    """Make the sampler (`fast_sampling.generate`, what `rollout.sample` runs) also keep what it drew each
    token from: per step, the (B, V) probabilities after every logits processor (min_new_tokens) and the
    temperature, as log-probabilities (logits of the same softmax). Returns the list each call appends to."""
    calls, generate, draw = [], fast_sampling.generate, fast_sampling.draw_tokens

    def recording_generate(*args, **kwargs):
        calls.append([])
        return generate(*args, **kwargs)

    def recording_draw(probs):
        calls[-1].append(probs.log())  # (B, V)
        return draw(probs)

    monkeypatch.setattr(fast_sampling, "generate", recording_generate)
    monkeypatch.setattr(fast_sampling, "draw_tokens", recording_draw)
    return calls


def sampled_logprobs(scores, response: torch.Tensor) -> torch.Tensor:
    """log p(y_t) under the distribution the sampler drew token t from: (B, T), T = the steps it ran."""
    logp = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in scores], dim=1)  # (B, T, V)
    return logp.gather(-1, response[:, : logp.shape[1], None]).squeeze(-1)  # (B, T)


def load_lm(folder):
    tokenizer = load_tokenizer(str(folder), padding_side="left")
    return freeze(load_causal_lm(str(folder))), tokenizer


# --- the cut, token by token ----------------------------------------------------------------------------


def test_completes_stop_string():
    assert completes_stop_string("The fi", "The film", ["film"])
    assert not completes_stop_string("The film", "The film is", ["The", "film"])  # already there
    assert completes_stop_string("The film", "The film is", ["The", "m i"])  # straddles the new token
    assert completes_stop_string("ab\ufffd", "abc", ["bc"])  # an unfinished character decoded whole
    assert not completes_stop_string("", "abc", [])


def test_stop_string_ends_hand_examples(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    ids = tokenizer("stopped now")["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == ["s", "t", "o", "p", "p", "e", "d", " no", "w"]
    response = torch.tensor([ids])  # (1, 9)
    mask = torch.ones_like(response, dtype=torch.bool)

    def end(stop_strings, min_new_tokens=0, mask=mask):
        stops = stop_string_ends(tokenizer, response, mask, stop_strings, min_new_tokens=min_new_tokens)
        assert stops.sum() <= 1
        return int(stops.int().argmax()) if stops.any() else None

    assert end(["pped"]) == 6  # completed by "d", over four tokens
    assert end(["d n"]) == 7  # " no" completes it and runs past it: the whole token is kept
    assert end(["o"]) == 2
    assert end(["o"], min_new_tokens=3) == 2  # the third token may end the response
    assert end(["o"], min_new_tokens=4) == 7  # the "o" of token 2 is ignored, the next one ends it
    assert end(["w", "e"]) == 5  # the first of several
    assert end(["xyz"]) is None
    assert end(["e"], mask=torch.arange(9)[None] < 4) is None  # only the tokens the mask marks are read

    # the response mask ends at the stop token, as at an EOS (token_math.response_mask_from_tokens)
    stops = stop_string_ends(tokenizer, response, mask, ["pped"])
    got = token_math.response_mask_from_tokens(
        response=response, eos_token_id=tokenizer.eos_token_id, stops=stops
    )
    assert got.tolist() == [[True] * 7 + [False] * 2]


# --- sampling -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("min_new_tokens", [0, 3])
def test_stop_strings_only_cut_the_draws(eos_prone_dir, min_new_tokens):
    """With the same random numbers, sampling with stop strings keeps exactly the tokens drawn without them,
    up to and including the token completing the first stop string (none before min_new_tokens); rows
    that end at EOS or max_new_tokens first are unchanged."""
    lm, tokenizer = load_lm(eos_prone_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    query, query_mask = left_pad([encode_prompt(tokenizer, p) for p in PROMPTS * 10], pad)  # (40, P)
    plain_sampling = Sampling(max_new_tokens=10, temperature=1.0, min_new_tokens=min_new_tokens)
    torch.manual_seed(0)
    plain = sample(lm, tokenizer, query, query_mask, plain_sampling)
    torch.manual_seed(0)
    cut = sample(
        lm,
        tokenizer,
        query,
        query_mask,
        dataclasses.replace(plain_sampling, stop_strings=tuple(STOP_STRINGS)),
    )
    R = cut.response.shape[1]
    kinds = {"stop": 0, "eos": 0, "truncated": 0}
    for b in range(query.shape[0]):
        drawn = plain.response[b][plain.response_mask[b]].tolist()  # up to and including the first EOS
        text_tokens = drawn[:-1] if plain.ended_with_eos(eos)[b] else drawn
        n = naive_end(tokenizer, text_tokens, STOP_STRINGS, min_new_tokens)
        kept = cut.response[b][cut.response_mask[b]].tolist()
        if n is not None:
            kinds["stop"] += 1
            assert kept == drawn[:n] and bool(cut.stopped[b])
            assert torch.all(cut.response[b, n:] == pad) and not cut.response_mask[b, n:].any()
        else:
            kinds["eos" if plain.ended_with_eos(eos)[b] else "truncated"] += 1
            assert kept == drawn and not cut.stopped[b]
        assert len(kept) >= min_new_tokens
        assert bool(cut.ended(eos)[b]) == (n is not None or bool(plain.ended_with_eos(eos)[b]))
    assert R <= plain.response.shape[1]
    assert kinds["stop"] > 0 and kinds["eos"] > 0, kinds  # the test has teeth


@pytest.mark.parametrize("path", ["generate", "fast"])
def test_min_new_tokens_draws_from_the_eos_masked_softmax(eos_prone_dir, path, monkeypatch):
    """On both sampling paths (`tests/rl/test_sampling.py`): generate's multinomial draws, the fast path's
    inverse-CDF draws."""
    if path == "generate":
        monkeypatch.setattr(fast_sampling, "supports", lambda lm: False)
    lm, tokenizer = load_lm(eos_prone_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    query, query_mask = left_pad([encode_prompt(tokenizer, "The film is")] * 64, pad)  # no padding
    free_sampling = Sampling(max_new_tokens=8, temperature=0.9, top_k=0, top_p=1.0)
    torch.manual_seed(5)
    got = sample(lm, tokenizer, query, query_mask, dataclasses.replace(free_sampling, min_new_tokens=3))
    torch.manual_seed(5)
    with torch.no_grad():
        expected = naive_sample(
            lm,
            query,
            steps=8,
            temperature=0.9,
            eos=eos,
            pad=pad,
            min_new_tokens=3,
            draw=multinomial_draw if path == "generate" else naive_inverse_cdf_draw,
        )
    assert torch.equal(got.response[:, : expected.shape[1]], expected)
    assert got.response_mask.sum(-1).min() >= 3  # EOS no earlier than the third token
    assert got.ended_with_eos(eos).any()
    torch.manual_seed(5)
    free = sample(lm, tokenizer, query, query_mask, free_sampling)
    assert free.response_mask.sum(-1).min() < 3  # without it some responses are shorter: the test has teeth


# --- PPO: the log-probs of the sampling distribution, the score of the cut response ------------------------


@pytest.mark.parametrize(
    "stop_strings, min_new_tokens",
    [(STOP_STRINGS, 0), ([], 3), (STOP_STRINGS, 3)],
    ids=["stop", "min", "both"],
)
def test_ppo_logprobs_are_those_generate_sampled_from(
    eos_prone_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch, stop_strings, min_new_tokens
):
    """The real PPO rollout (`PPOTrainer.rollout`): its old log-probs, recomputed by the PPO forward on the cut
    responses, are the log-probs of the distribution the sampler drew each kept token from; the reference's
    equal them exactly at the first step (KL = 0); the RM scores each response as cut."""
    cfg = ppo_config(
        eos_prone_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        rollout_batch_size=16,
        mini_batch_size=8,
        max_new_tokens=10,
        temperature=0.8,
        stop_strings=stop_strings,
        min_new_tokens=min_new_tokens,
    )
    trainer = tiny_ppo_trainer(cfg)
    eos = trainer.tokenizer.eos_token_id
    calls = record_sampled_scores(monkeypatch)
    torch.manual_seed(0)
    rollout, _ = trainer.rollout(trainer.collector.queries(trainer.step))
    (scores,) = calls
    mask = rollout.response_mask
    T = len(scores)
    assert not mask[:, T:].any()  # every kept token was drawn in one of the recorded steps
    expected = sampled_logprobs(scores, rollout.response)  # (B, T)
    torch.testing.assert_close(
        rollout.logprobs[:, :T][mask[:, :T]], expected[mask[:, :T]], atol=2e-5, rtol=1e-5
    )
    assert torch.equal(rollout.ref_logprobs[mask], rollout.logprobs[mask])  # policy == reference: KL = 0
    lengths = mask.sum(-1)
    assert lengths.min() >= min_new_tokens
    if min_new_tokens:
        # without the EOS mask the forward gives other log-probs where EOS was masked: the test has teeth
        unmasked = response_logprobs_and_values(
            trainer.unwrapped_policy,
            rollout.trimmed(),
            Sampling(10, temperature=cfg.temperature),
            entropy="none",
        )[0]  # (B, R')
        early = mask[:, :min_new_tokens]
        assert (unmasked[:, :min_new_tokens] - expected[:, :min_new_tokens])[early].abs().min() > 1e-3
    if stop_strings:
        stopped = rollout.stopped.nonzero().flatten().tolist()
        assert stopped and not rollout.stopped.all()
        for b in range(len(lengths)):
            ids = rollout.response[b][mask[b]].tolist()
            if rollout.ended_with_eos(eos)[b]:
                assert (
                    not rollout.stopped[b]
                    and naive_end(trainer.tokenizer, ids[:-1], stop_strings, min_new_tokens) is None
                )
            else:
                assert naive_end(trainer.tokenizer, ids, stop_strings, min_new_tokens) == (
                    len(ids) if rollout.stopped[b] else None
                )
        for b in stopped:  # the score of prompt + the response up to its stop token, alone and unpadded
            query = rollout.query[b][rollout.query_mask[b].bool()][None]  # (1, P_b)
            response = rollout.response[b, : lengths[b]][None]  # (1, L_b)
            alone = Samples(
                query=query,
                query_mask=torch.ones_like(query),
                response=response,
                response_mask=torch.ones_like(response, dtype=torch.bool),
            )
            assert trainer.collector.score(alone).scores.item() == pytest.approx(
                rollout.scores[b].item(), abs=1e-5
            )


def test_ppo_steps_with_stop_strings_and_min_new_tokens(
    eos_prone_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """Two real PPO steps: finite metrics, KL = 0 and ratio = 1 before the first update (the same EOS mask in
    the rollout and the training forward), response_length and eos_rate those of the rollout, and the EOS
    trick treating a stop string as an end (no penalty) like an EOS."""
    cfg = ppo_config(
        eos_prone_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        rollout_batch_size=16,
        mini_batch_size=16,
        ppo_epochs=1,
        max_new_tokens=10,
        stop_strings=STOP_STRINGS,
        min_new_tokens=2,
        eos_penalty=-3.0,
    )
    trainer = tiny_ppo_trainer(cfg)
    eos = trainer.tokenizer.eos_token_id
    rollouts, ended, shaped = recording_rollouts(trainer), [], ppo_math.shaped_rewards

    def recording_shaped(**kw):
        ended.append(kw["ended_with_eos"])
        return shaped(**kw)

    monkeypatch.setattr(ppo_trainer.ppo_math, "shaped_rewards", recording_shaped)
    metrics = [trainer.ppo_step() for _ in range(2)]
    assert metrics[0]["objective/kl"] == 0.0
    assert metrics[0]["policy/ratio"] == 1.0 and metrics[0]["policy/approxkl"] == 0.0
    for m, r, e in zip(metrics, rollouts, ended):
        assert all(math.isfinite(v) for v in m.values()), m
        lengths = r.response_mask.sum(-1).float()
        assert lengths.min() >= 2
        assert m["response_length"] == pytest.approx(lengths.mean().item())
        assert torch.equal(e, r.stopped | r.ended_with_eos(eos))  # the EOS trick's "ended"
        assert m["eos_rate"] == pytest.approx(e.float().mean().item())
        assert r.stopped.any() and not (r.stopped & r.ended_with_eos(eos)).any()
    assert not torch.equal(rollouts[0].response, rollouts[1].response)


# --- evaluation and the judge see the cut text ----------------------------------------------------------


def test_eval_scores_the_cut_responses(eos_prone_dir, tiny_model_dir, tiny_rm_dir):
    """`sample_and_score` (llm-rlhf eval, PPO's held-out evaluation, compare): the text the judge is given and
    the RM score are those of the response up to its stop token, `eos` counts a stop string as an end, and
    the KL is PPO's: sum_t of the EOS-masked log-probs of the policy minus the reference's."""
    lm, tokenizer = load_lm(eos_prone_dir)
    ref = freeze(load_causal_lm(str(tiny_model_dir)))
    rm = freeze(load_reward_model(str(tiny_rm_dir)))
    seen = []

    def judge(prompts, responses):
        seen.extend(responses)
        return [float(len(r)) for r in responses]

    sampling = Sampling(
        max_new_tokens=10, temperature=1.0, stop_strings=tuple(STOP_STRINGS), min_new_tokens=2
    )
    prompts = PROMPTS * 3
    draws = measures.PairedSampling(sampling, seed=3, batch_size=len(prompts))
    records = measures.sample_and_score(
        lm,
        tokenizer,
        prompts,
        draws,
        measures=measures.Measures(Scorer(rm), judge),
        reference=measures.KLReference(ref),
    )
    batch = measures.sample_batch(lm, tokenizer, prompts, sampling, seed=3)  # the same draws (seed + batch 0)
    eos = tokenizer.eos_token_id
    assert seen == [r["response"] for r in records]
    assert any(batch.stopped) and not all(batch.stopped)
    at_one = dataclasses.replace(sampling, temperature=1.0)
    logprobs = response_logprobs_and_values(Reference(lm), batch, at_one, eos_token_id=eos, entropy="none")[0]
    ref_logprobs = response_logprobs_and_values(
        Reference(ref), batch, at_one, eos_token_id=eos, entropy="none"
    )[0]
    kl = ppo_math.masked_sum(logprobs - ref_logprobs, batch.response_mask, dim=-1)  # (B,)
    for b, record in enumerate(records):
        ids = batch.response[b][batch.response_mask[b]].tolist()
        text_ids = ids[:-1] if batch.ended_with_eos(eos)[b] else ids
        assert record["response_ids"] == text_ids and len(text_ids) >= 2
        assert record["response"] == tokenizer.decode(text_ids, skip_special_tokens=True)
        assert record["eos"] == bool(batch.ended(eos)[b]) and record["gold_score"] == len(record["response"])
        if batch.stopped[b]:
            assert naive_end(tokenizer, text_ids, STOP_STRINGS, 2) == len(text_ids)
        query = batch.query[b][batch.query_mask[b].bool()][None]  # (1, P_b)
        alone = Samples(
            query=query,
            query_mask=torch.ones_like(query),
            response=torch.tensor([ids]),
            response_mask=torch.ones((1, len(ids)), dtype=torch.bool),
        )
        assert record["rm_score"] == pytest.approx(Scorer(rm)(alone, tokenizer).rm_score.item(), abs=1e-5)
        assert record["kl_to_ref"] == pytest.approx(kl[b].item(), abs=1e-4)
    summary = measures.summarize_records(records)
    assert summary["eos_rate"] == pytest.approx(float(batch.ended(eos).float().mean()))


# --- chat prompts -----------------------------------------------------------------------------------------


def test_chat_prompts_are_rendered_with_the_template_and_one_bos(tmp_path):
    """A tokenizer that adds BOS (Llama-style) and a template that writes it too: the prompt keeps the
    template's tokens with one BOS, in PPO's prompts as in the data layer's."""
    folder = bos_model_dir(tmp_path / "bos_model")
    tokenizer = load_tokenizer(str(folder))
    tokenizer.chat_template = "{{ bos_token }}" + COLON_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    tokenizer = load_tokenizer(str(folder))
    bos = tokenizer.bos_token_id
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    prompts = list(load_prompt_dataset(path, tokenizer, max_prompt_length=64)["prompt"])
    assert prompts == RENDERED  # the template's text, its "<s>" left to the tokenizer
    expected = [tokenizer("<s>" + text, add_special_tokens=False)["input_ids"] for text in RENDERED]
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in expected)
    assert [encode_prompt(tokenizer, p) for p in prompts] == expected
    cfg = parse_config(ppo_trainer.Config, ["--prompt_file", str(path), "--max_prompt_length", "64"])
    assert ppo_building.load_prompt_ids(cfg, tokenizer) == expected

    tokenizer.chat_template = COLON_CHAT_TEMPLATE  # a template without the BOS: the tokenizer adds it, once
    assert [
        encode_prompt(tokenizer, p)
        for p in load_prompt_dataset(path, tokenizer, max_prompt_length=64)["prompt"]
    ] == expected


def test_ppo_eval_and_judge_take_chat_prompts(chat_model_dir, tiny_rm_dir, tmp_path):
    """The commands on a prompt file of chat `messages` rows: PPO (rollouts, logged samples and held-out
    evaluation, with a stop string at the line end as for a chat model), eval, and judge (`--tokenizer`)."""
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    out = tmp_path / "ppo"
    argv = [
        "ppo",
        "--model_name_or_path",
        str(chat_model_dir),
        "--reward_model_path",
        str(tiny_rm_dir),
        "--prompt_file",
        str(chats),
        "--eval_prompt_file",
        str(chats),
        "--eval_every",
        "1",
        "--eval_num_prompts",
        "3",
        "--gold_judge",
        SENTIMENT_JUDGE,
        "--output_dir",
        str(out),
        "--steps",
        "1",
        "--rollout_batch_size",
        "4",
        "--mini_batch_size",
        "4",
        "--ppo_epochs",
        "1",
        "--max_new_tokens",
        "6",
        "--max_prompt_length",
        "40",
        "--log_samples_every",
        "1",
        "--num_log_samples",
        "3",
        "--save_steps",
        "0",
        "--stop_strings",
        '["\\n"]',
        "--min_new_tokens",
        "1",
    ]
    assert cli.main(argv) == 0
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["query"] for s in logged[:3]] == RENDERED
    assert len((out / "eval_log.jsonl").read_text().splitlines()) == 2  # before the first step and after it
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["objective/kl"] == 0.0
    saved = parse_config(ppo_trainer.Config, ["--config", str(out / "config.yaml")])
    assert (saved.stop_strings, saved.min_new_tokens) == (["\n"], 1)

    evaluated = evaluate.run(
        evaluate.Config(
            policy_path=str(chat_model_dir),
            baseline_path=str(chat_model_dir),
            reward_model_path=str(tiny_rm_dir),
            gold_judge=SENTIMENT_JUDGE,
            prompt_file=str(chats),
            num_prompts=None,
            max_prompt_length=40,
            max_new_tokens=6,
            stop_strings=["\n"],
            min_new_tokens=1,
            output_dir=str(tmp_path / "eval"),
            print_samples=0,
        )
    )
    assert evaluated["num_prompts"] == 3 and evaluated["gold_win_rate"] == 0.5
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples] == RENDERED
    assert all(s["policy_length"] >= 1 for s in samples)

    responses = [" a delight.", " and funny.", " is wooden."]
    rows = write_jsonl(
        tmp_path / "rows.jsonl",
        [{"messages": m, "response": r, "id": i} for i, (m, r) in enumerate(zip(CHATS, responses))],
    )
    judged_file = tmp_path / "judged.jsonl"
    argv = [
        "judge",
        "--input_file",
        str(rows),
        "--output_file",
        str(judged_file),
        "--gold_judge",
        SENTIMENT_JUDGE,
        "--tokenizer",
        str(chat_model_dir),
        "--show",
        "0",
    ]
    assert cli.main(argv) == 0
    judged = [json.loads(line) for line in judged_file.read_text().splitlines()]
    assert [r["prompt"] for r in judged] == RENDERED and [r["id"] for r in judged] == [0, 1, 2]
    expected = judge_details(load_judge(SENTIMENT_JUDGE), RENDERED, responses)["gold_score"]
    assert [r["gold_score"] for r in judged] == pytest.approx(expected)


def test_system_prompt_is_the_system_turn_of_prompts_without_one_in_ppo_and_eval(
    chat_model_dir, tiny_rm_dir, tmp_path
):
    """`system_prompt` (the recipes' shorter system message) goes in front of every chat prompt that
    has no system turn of its own, in PPO's rollouts and held-out evaluation and in the eval stage, and is
    saved with the run's config; a prompt with its own system turn keeps it."""
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    with_system = [
        "system: Be brief.\nuser: The film is\nassistant:",
        "system: Be kind.\nuser: A gorgeous\nassistant:",  # its own system turn, kept
        "system: Be brief.\nuser: The acting\nassistant:",
    ]
    out = tmp_path / "ppo"
    argv = [
        "ppo",
        "--model_name_or_path",
        str(chat_model_dir),
        "--reward_model_path",
        str(tiny_rm_dir),
        "--prompt_file",
        str(chats),
        "--eval_prompt_file",
        str(chats),
        "--eval_every",
        "1",
        "--eval_num_prompts",
        "3",
        "--gold_judge",
        "none",
        "--output_dir",
        str(out),
        "--steps",
        "1",
        "--rollout_batch_size",
        "3",
        "--mini_batch_size",
        "3",
        "--ppo_epochs",
        "1",
        "--max_new_tokens",
        "4",
        "--max_prompt_length",
        "40",
        "--log_samples_every",
        "1",
        "--num_log_samples",
        "3",
        "--save_steps",
        "0",
        "--system_prompt",
        "Be brief.",
    ]
    assert cli.main(argv) == 0
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["query"] for s in logged[:3]) == sorted(with_system)
    heldout = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in heldout} == set(with_system)
    assert (
        parse_config(ppo_trainer.Config, ["--config", str(out / "config.yaml")]).system_prompt == "Be brief."
    )

    common = dict(
        policy_path=str(chat_model_dir),
        baseline_path=str(chat_model_dir),
        reward_model_path=str(tiny_rm_dir),
        prompt_file=str(chats),
        num_prompts=None,
        max_prompt_length=40,
        max_new_tokens=4,
        print_samples=0,
        gold_judge="none",
    )
    evaluate.run(evaluate.Config(**common, system_prompt="", output_dir=str(tmp_path / "eval")))
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples] == [
        "system: \nuser: The film is\nassistant:",  # '' = an empty system turn
        "system: Be kind.\nuser: A gorgeous\nassistant:",
        "system: \nuser: The acting\nassistant:",
    ]

    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "The film is"}])
    with pytest.raises(DataError, match=f"{plain}: system_prompt is set, but these prompts are not chat"):
        evaluate.run(
            evaluate.Config(
                **{**common, "prompt_file": str(plain)},
                system_prompt="Be brief.",
                output_dir=str(tmp_path / "eval-plain"),
            )
        )
    assert not (tmp_path / "eval-plain" / "metrics.json").exists()


BAD_ROWS = [
    ({"messages": [{"role": "user"}]}, "field 'messages[0].content': missing (or null)"),
    (
        {"messages": [{"role": "user", "content": 3}]},
        "field 'messages[0].content': expected a string, got int (3)",
    ),
    ({"messages": "The film is"}, "field 'messages': expected a non-empty list of {role, content} turns"),
    ({"messages": ["The film is"]}, "field 'messages[0]': expected a {role, content} object, got str"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS, ids=["no-content", "int-content", "string", "string-turn"])
def test_a_bad_messages_row_is_one_line_naming_file_row_and_field(
    chat_model_dir, tiny_rm_dir, tmp_path, capsys, row, message
):
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"messages": CHATS[0], "response": "x"}, {**row, "response": "y"}]
    )
    commands = {
        "ppo": [
            "--model_name_or_path",
            str(chat_model_dir),
            "--reward_model_path",
            str(tiny_rm_dir),
            "--prompt_file",
            str(bad),
            "--eval_every",
            "0",
            "--output_dir",
            str(tmp_path / "ppo"),
        ],
        "eval": [
            "--policy_path",
            str(chat_model_dir),
            "--baseline_path",
            str(chat_model_dir),
            "--reward_model_path",
            "none",
            "--gold_judge",
            SENTIMENT_JUDGE,
            "--prompt_file",
            str(bad),
            "--output_dir",
            str(tmp_path / "eval"),
        ],
        "judge": [
            "--input_file",
            str(bad),
            "--output_file",
            str(tmp_path / "judged.jsonl"),
            "--gold_judge",
            SENTIMENT_JUDGE,
            "--tokenizer",
            str(chat_model_dir),
        ],
    }
    for command, argv in commands.items():
        assert cli.main([command, *argv]) == 2, command
        assert capsys.readouterr().err == f"error: {bad}, row 2, {message}\n", command
    assert not any((tmp_path / name).exists() for name in ("ppo", "eval", "judged.jsonl"))


def test_judge_needs_a_tokenizer_with_a_chat_template_for_messages_rows(tiny_model_dir, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"messages": CHATS[0], "response": " good."}])
    argv = [
        "judge",
        "--input_file",
        str(rows),
        "--output_file",
        str(tmp_path / "o.jsonl"),
        "--gold_judge",
        SENTIMENT_JUDGE,
    ]
    assert cli.main(argv) == 2
    assert "set --tokenizer to the policy's model" in capsys.readouterr().err
    assert cli.main([*argv, "--tokenizer", str(tiny_model_dir)]) == 2
    assert "has no chat template" in capsys.readouterr().err


# --- configs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [ppo_trainer.Config, evaluate.Config])
def test_generation_control_keys_are_checked_and_round_trip(config, tmp_path):
    cfg = parse_config(config, ["--stop_strings", '["\\n\\n", " The end"]', "--min_new_tokens", "2"])
    assert (cfg.stop_strings, cfg.min_new_tokens) == (["\n\n", " The end"], 2)
    assert parse_config(config, ["--config", str(save_config(cfg, tmp_path))]) == cfg  # config.yaml reloads
    assert (config().stop_strings, config().min_new_tokens) == ([], 0)  # off by default
    for argv, key in [
        (["--stop_strings", "[1]"], "stop_strings"),
        (["--stop_strings", '[""]'], "stop_strings"),
        (["--min_new_tokens", "-1"], "min_new_tokens"),
        (["--min_new_tokens", "9", "--max_new_tokens", "8"], "min_new_tokens"),
    ]:
        with pytest.raises(ConfigError, match=f"^config key '{key}': "):
            parse_config(config, argv)


@pytest.mark.parametrize(
    "command, keys",
    [
        ("ppo", ["stop_strings", "min_new_tokens"]),
        ("eval", ["stop_strings", "min_new_tokens"]),
        ("judge", ["tokenizer"]),
    ],
)
def test_help_documents_the_new_keys(command, keys, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    for key in keys:
        assert f"--{key} (" in out, key
    names = {"ppo": ppo_trainer.Config, "eval": evaluate.Config}.get(command)
    if names is not None:
        assert {f.name for f in dataclasses.fields(names)} >= set(keys)


@pytest.mark.parametrize("config", [ppo_trainer.Config, evaluate.Config])
def test_the_readme_example_is_a_valid_config(config, tmp_path):
    """The YAML block of docs/guides/generation.md parses in both stages."""
    (block,) = code_blocks(doc_section("guides/generation.md"), "yaml")
    recipe = tmp_path / "example.yaml"
    recipe.write_text(block)
    cfg = parse_config(config, ["--config", str(recipe)])
    assert (cfg.stop_strings, cfg.min_new_tokens) == (["\n\nHuman:"], 4)


def test_a_response_that_would_run_past_the_models_positions_is_a_config_error(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """The tiny GPT-2 has 64 positions: the longest prompt plus max_new_tokens beyond them stops PPO and eval
    with one line naming max_new_tokens and the sum, before anything is written (GPT-2 would fail with an index
    error in the middle of sampling); at the limit both run."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()]
    longest = max(len(encode_prompt(tokenizer, p)) for p in prompts)
    too_many = 64 - longest + 1
    says = (
        rf"^config key 'max_new_tokens': the longest prompt \({longest} tokens\) \+ max_new_tokens "
        rf"\({too_many}\) = 65 exceeds the 64 positions of"
    )
    kw = dict(max_new_tokens=too_many, eval_every=0)  # the training prompts only
    out = tmp_path / "ppo"
    with pytest.raises(ConfigError, match=says + " the policy; lower max_new_tokens or max_prompt_length$"):
        ppo.run(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, **kw))
    assert not out.exists()
    out = tmp_path / "eval"
    with pytest.raises(ConfigError, match=says):
        evaluate.run(
            eval_config(
                tiny_model_dir,
                tiny_model_dir,
                prompt_file,
                out,
                max_new_tokens=too_many,
                num_prompts=len(prompts),
            )
        )
    assert not out.exists()
    kw.update(max_new_tokens=too_many - 1, steps=1)  # at the limit: it runs
    ppo.run(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "at-limit", **kw))
