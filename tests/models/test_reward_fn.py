"""Reward functions (`reward_fn: module:callable`): loading and checking them, where their score enters PPO
(alone, or beside the RM score with a weight), a tiny policy learning a rule-based reward through the real
PPOTrainer, the one-line errors before any training step, evaluation, and two processes."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import reward_fns
import torch
from helpers import REWARD_FNS, ROOT, build_model, code_blocks, doc_section, ppo_config, tiny_ppo_trainer

from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.evaluation import measures
from llm_rlhf.evaluation.hacking import DEGENERACY_KEYS, degeneracy_rates
from llm_rlhf.interfaces import cli
from llm_rlhf.models.loading import load_tokenizer
from llm_rlhf.models.reward_fn import (
    PROBE_RESPONSES,
    RewardFn,
    check_scores,
    decode_texts,
    load_reward_fn,
    probe,
)
from llm_rlhf.models.reward_model import load_reward_model
from llm_rlhf.models.scoring import Scorer
from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.stages import evaluate, ppo

KEYWORD_FILE = "tests/reward_fns.py:keyword"  # the file form, relative to the repo root


REWARD_FN_ONLY = dict(
    reward_fn="reward_fns:keyword", eval_every=0, gold_judge="none", kl_target=6.0, kl_horizon=10000
)


def ppo_cfg(model_dir, prompt_file, out, **kw) -> ppo_trainer.Config:
    """`helpers.ppo_config` with no reward model: the keyword function alone scores (`kw` wins)."""
    return ppo_config(model_dir, None, prompt_file, out, **{**REWARD_FN_ONLY, **kw})


# --- loading and checking ------------------------------------------------------------------------


def test_load_forms(tmp_path, monkeypatch):
    """module:function, module:Class (built once), a .py file (relative or absolute), and a module in the
    current directory that is not on the python path (the `llm-rlhf` entry point does not add it)."""
    prompts, responses = ["a", "b"], ["the end", ""]
    assert load_reward_fn("reward_fns:keyword")(prompts, responses) == [2.0, 0.0]
    assert load_reward_fn("reward_fns:Keyword")(prompts, responses) == [2.0, 0.0]
    monkeypatch.chdir(ROOT)
    assert load_reward_fn(KEYWORD_FILE)(prompts, responses) == [2.0, 0.0]
    assert load_reward_fn(f"{REWARD_FNS}:length")(prompts, responses) == [0.7, 0.0]
    (tmp_path / "my_rewards_here.py").write_text(
        "def fn(prompts, responses):\n    return [7.0] * len(responses)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert str(tmp_path) not in sys.path
    assert load_reward_fn("my_rewards_here:fn")(prompts, responses) == [7.0, 7.0]
    assert str(tmp_path) not in sys.path, "the current directory is on the path only while importing"


@pytest.mark.parametrize(
    ("named", "message"),
    [
        (
            "no_such_module_xyz:fn",
            "reward_fn 'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz'",
        ),
        ("reward_fns:nope", "reward_fn 'reward_fns:nope': 'reward_fns' has no attribute 'nope'"),
        ("reward_fns:not_callable", "reward_fn 'reward_fns:not_callable': float is not callable"),
        (
            "missing_dir/rewards.py:fn",
            "reward_fn 'missing_dir/rewards.py:fn': no such file 'missing_dir/rewards.py'",
        ),
        ("reward_fns", "reward_fn 'reward_fns': expected 'module:callable' or 'path/to/file.py:callable'"),
        ("reward_fns:1x", "reward_fn 'reward_fns:1x': expected 'module:callable'"),
    ],
)
def test_load_errors_are_one_line_naming_the_callable(named, message):
    with pytest.raises(UserError) as e:
        load_reward_fn(named)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_check_scores():
    """One finite number per response, from a list, tuple, numpy array or 1-D tensor; else one line naming
    the callable and the first bad index."""
    assert check_scores([1, 2.5], 2, "m:f") == [1.0, 2.5]
    assert check_scores((np.float32(1.5), torch.tensor(2.0)), 2, "m:f") == [1.5, 2.0]
    assert check_scores(np.array([1.0, 2.0]), 2, "m:f") == [1.0, 2.0]
    assert check_scores(torch.tensor([3.0, 4.0]), 2, "m:f") == [3.0, 4.0]
    cases = [
        ([1.0], "reward_fn 'm:f' returned 1 scores for 2 responses"),
        ([1.0, math.nan], "reward_fn 'm:f': score 1 is nan (NaN or infinite)"),
        ([math.inf, math.nan], "reward_fn 'm:f': score 0 is inf (NaN or infinite)"),
        ([1.0, "2"], "reward_fn 'm:f': score 1 is '2' (str), not a number"),
        ([None, 1.0], "reward_fn 'm:f': score 0 is None (NoneType), not a number"),
        (None, "reward_fn 'm:f' returned NoneType; expected a list of 2 numbers, one per response"),
        ("ab", "reward_fn 'm:f' returned str; expected a list of 2 numbers, one per response"),
        (1.0, "reward_fn 'm:f' returned float; expected a list of 2 numbers, one per response"),
    ]
    for out, message in cases:
        with pytest.raises(UserError) as e:
            check_scores(out, 2, "m:f")
        assert str(e.value) == message


def test_a_raising_function_is_one_line_with_its_place():
    with pytest.raises(UserError) as e:
        load_reward_fn("reward_fns:raises")(["a"], ["b"])
    line = str(e.value)
    assert line.startswith("reward_fn 'reward_fns:raises' raised ZeroDivisionError: float division by zero (")
    assert "reward_fns.py:" in line and "\n" not in line
    assert isinstance(e.value.__cause__, ZeroDivisionError)  # kept for a debugger


def test_probe_calls_once_with_dummy_responses():
    calls = []

    def fn(prompts, responses):
        calls.append((prompts, responses))
        return [0.0] * len(responses)

    probe(RewardFn(fn, "m:fn"), ["The film", "A tedious", "unused"])
    assert calls == [(["The film"] * 2 + ["A tedious"] * 2, list(PROBE_RESPONSES) * 2)]


def test_decode_texts_layout(tiny_model_dir):
    """What the function reads of a batch laid out as in PPO:

    query     pad pad q q | r r EOS pad      -> prompt: the real query tokens' text
    response  (left pad)  | r r r r (no EOS)  -> response: the real response tokens' text, no EOS
    """
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    q0, q1 = tok("The film")["input_ids"], tok("It's a wonderful movie")["input_ids"]
    r0, r1 = tok(" is good")["input_ids"], tok(" and sharp script")["input_ids"]
    P, R = max(len(q0), len(q1)), max(len(r0) + 1, len(r1)) + 1
    query, qmask = torch.full((2, P), tok.pad_token_id), torch.zeros((2, P), dtype=torch.long)
    response, rmask = torch.full((2, R), tok.pad_token_id), torch.zeros((2, R), dtype=torch.bool)
    for i, (q, r) in enumerate([(q0, r0 + [tok.eos_token_id]), (q1, r1)]):
        query[i, P - len(q) :], qmask[i, P - len(q) :] = torch.tensor(q), 1
        response[i, : len(r)], rmask[i, : len(r)] = torch.tensor(r), True
    prompts, responses = decode_texts(tok, query, qmask, response, rmask)
    assert prompts == ["The film", "It's a wonderful movie"]
    assert responses == [" is good", " and sharp script"]


def test_decode_texts_gives_back_the_prompt_string(tiny_model_dir):
    """A Llama-style tokenizer that adds a BOS: the prompt text is the string `encode_prompt` encoded (the
    BOS it added dropped), special-token text inside it kept (a chat template writes some)."""
    from tokenizers.processors import TemplateProcessing

    from llm_rlhf.rl.rollout import encode_prompt, left_pad

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    texts = ["user: The film<|endoftext|>assistant:", "A tedious"]
    queries = [encode_prompt(tok, t) for t in texts]
    assert all(q[0] == bos for q in queries)
    query, qmask = left_pad(queries, tok.pad_token_id)
    empty = torch.zeros((2, 0), dtype=torch.bool)
    assert decode_texts(tok, query, qmask, empty.long(), empty) == (texts, ["", ""])


def test_config_checks_name_the_key():
    with pytest.raises(
        ConfigError,
        match="^config key 'reward_model_path': is none and neither reward_fn, environment nor teacher_model_path is set",
    ):
        ppo_trainer.Config(reward_model_path="none")
    with pytest.raises(ConfigError, match="^config key 'value_model': 'reward' initialises the critic"):
        ppo_trainer.Config(reward_model_path=None, reward_fn="m:f", value_model="reward")
    with pytest.raises(ConfigError, match="^config key 'reward_fn_weight'"):
        ppo_trainer.Config(reward_fn="m:f", reward_fn_weight=math.nan)
    with pytest.raises(ConfigError, match="^reward_fn 'no_colon'"):
        ppo_trainer.Config(reward_fn="no_colon")
    with pytest.raises(ConfigError, match="^reward_fn 'x'"):
        evaluate.Config(reward_fn="x")
    assert (
        ppo_trainer.Config(reward_model_path=None, reward_fn="any_module:fn").reward_fn_weight == 1.0
    )  # no import yet


# --- PPO --------------------------------------------------------------------------------------------


def test_tiny_policy_learns_a_keyword_reward(tiny_model_dir, prompt_file, tmp_path):
    """No reward model: the score is the keyword count alone. Through the real PPOTrainer the policy's mean
    count rises from ~0.7 to ~4 in 16 steps (seeds 0-4 all end at 4-6; the first 4 steps average <= 1.1)."""
    cfg = ppo_cfg(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        steps=16,
        rollout_batch_size=16,
        mini_batch_size=8,
        ppo_epochs=4,
        learning_rate=3e-3,
        kl_controller="fixed",
        init_kl_coef=0.01,
    )
    trainer = tiny_ppo_trainer(cfg)
    assert trainer.collector.scorer.reward_model is None
    history = [trainer.ppo_step() for _ in range(cfg.steps)]
    counts = [m["objective/reward_fn"] for m in history]
    assert all(m["objective/scores"] == pytest.approx(m["objective/reward_fn"], abs=1e-6) for m in history)
    assert "objective/rm_score" not in history[0]
    first, last = np.mean(counts[:4]), np.mean(counts[-4:])
    assert last > 2 * first and last > first + 1.0, counts


def test_combined_score_is_rm_plus_weighted_fn(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """scores = RM score + reward_fn_weight * reward_fn, per sequence: checked against an RM loaded apart and
    the function called on texts decoded apart, at the place PPO uses them (the scores given to
    `ppo_math.shaped_rewards`), and in the step's logged means."""
    weight = 0.5
    cfg = ppo_cfg(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        reward_model_path=str(tiny_rm_dir),
        reward_fn="reward_fns:length",
        reward_fn_weight=weight,
        steps=1,
    )
    trainer = tiny_ppo_trainer(cfg)
    seen = {}
    rollout_fn, shaped = trainer.rollout, ppo_trainer.ppo_math.shaped_rewards

    def recording_rollout(*args, **kwargs):
        seen["rollout"] = rollout_fn(*args, **kwargs)
        return seen["rollout"]

    def recording_shaped(**kw):
        seen["scores"] = kw["scores"].clone()
        return shaped(**kw)

    trainer.rollout = recording_rollout
    monkeypatch.setattr(ppo_trainer.ppo_math, "shaped_rewards", recording_shaped)
    metrics = trainer.ppo_step()

    (rollout, _), tok = seen["rollout"], trainer.tokenizer
    rm = Scorer(load_reward_model(str(tiny_rm_dir)))(rollout, tok).rm_score  # (B,) an RM of its own
    prompts = [
        tok.decode(q[m.bool()], skip_special_tokens=True) for q, m in zip(rollout.query, rollout.query_mask)
    ]
    responses = [
        tok.decode(r[m & (r != tok.eos_token_id)], skip_special_tokens=True)
        for r, m in zip(rollout.response, rollout.response_mask)
    ]
    fn = torch.tensor(reward_fns.length(prompts, responses))
    assert fn.std() > 0 and rm.std() > 0
    torch.testing.assert_close(seen["scores"], rm + weight * fn, atol=1e-5, rtol=1e-5)
    assert metrics["objective/rm_score"] == pytest.approx(rm.mean().item(), abs=1e-5)
    assert metrics["objective/reward_fn"] == pytest.approx(fn.mean().item(), abs=1e-6)
    assert metrics["objective/scores"] == pytest.approx(
        metrics["objective/rm_score"] + weight * metrics["objective/reward_fn"], abs=1e-5
    )


def test_score_clip_acts_on_the_sum(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """The function's score is clipped (score_clip) like an RM score: after the sum, before the rewards."""
    cfg = ppo_cfg(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        reward_fn="reward_fns:length",
        reward_fn_weight=10.0,
        score_clip=2.0,
        steps=1,
    )
    trainer = tiny_ppo_trainer(cfg)
    seen, shaped = {}, ppo_trainer.ppo_math.shaped_rewards

    def recording_shaped(**kw):
        seen["scores"] = kw["scores"].clone()
        return shaped(**kw)

    monkeypatch.setattr(ppo_trainer.ppo_math, "shaped_rewards", recording_shaped)
    metrics = trainer.ppo_step()
    assert metrics["objective/scores"] > 2.0, "the sum before the clip is logged"
    assert seen["scores"].max() == 2.0 and seen["scores"].min() >= -2.0


def test_run_with_reward_fn_only_writes_the_usual_outputs(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """`llm-rlhf ppo` without a reward model, the function loaded from the current directory; held-out
    evaluation logs the function's score (and no RM score)."""
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "cwd_rewards.py").write_text(
        "def ends_with_e(prompts, responses):\n    return [float(r.endswith('e')) for r in responses]\n"
    )
    monkeypatch.chdir(tmp_path / "cwd")
    out = tmp_path / "run"
    cfg = ppo_cfg(
        tiny_model_dir,
        prompt_file,
        out,
        reward_fn="cwd_rewards:ends_with_e",
        eval_every=1,
        eval_prompt_file=str(prompt_file),
        eval_num_prompts=4,
        log_samples_every=1,
    )
    ppo.run(cfg)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(0 <= m["objective/reward_fn"] <= 1 for m in lines)
    heldout = [json.loads(x) for x in (out / "eval_log.jsonl").read_text().splitlines()]
    assert len(heldout) == 3 and all(r["rm_score"] is None and 0 <= r["reward_fn"] <= 1 for r in heldout)
    # each held-out sample, for the report's reward-hacking watch: the proxy is PPO's score (no RM: the
    # weighted function), no gold; the degeneracy rates of each evaluation are those of its samples
    rows = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(r["proxy"] == cfg.reward_fn_weight * float(r["response"].endswith("e")) for r in rows)
    assert all(r["gold_score"] is None and r["reward_fn"] == float(r["response"].endswith("e")) for r in rows)
    for record in heldout:
        responses = [r["response"] for r in rows if r["step"] == record["step"]]
        assert {k: record[k] for k in DEGENERACY_KEYS} == degeneracy_rates(responses)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all(s["score"] == float(s["response"].endswith("e")) for s in samples)
    assert (out / "model.safetensors").is_file() and (out / "metrics.json").is_file()
    assert "reward_fn: cwd_rewards:ends_with_e" in (out / "config.yaml").read_text()


@pytest.mark.parametrize(
    ("named", "message"),
    [
        (
            "no_such_module_xyz:fn",
            "error: reward_fn 'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz'",
        ),
        (
            "reward_fns:wrong_length",
            "error: reward_fn 'reward_fns:wrong_length' returned 3 scores for 4 responses",
        ),
        (
            "reward_fns:returns_nan",
            "error: reward_fn 'reward_fns:returns_nan': score 1 is nan (NaN or infinite)",
        ),
        (
            "reward_fns:raises",
            "error: reward_fn 'reward_fns:raises' raised ZeroDivisionError: float division by zero (",
        ),
    ],
)
def test_broken_function_stops_ppo_before_anything(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, capsys, monkeypatch, named, message
):
    """One line on stderr, exit code 2, no output folder: the import and the probe run before any model is
    loaded (`build_trainer` is never reached)."""
    monkeypatch.setattr(ppo, "build_trainer", lambda *a, **kw: pytest.fail("models were built"))
    out = tmp_path / "run"
    argv = [
        "ppo",
        "--model_name_or_path",
        str(tiny_model_dir),
        "--reward_model_path",
        str(tiny_rm_dir),
        "--reward_fn",
        named,
        "--prompt_file",
        str(prompt_file),
        "--output_dir",
        str(out),
        "--eval_every",
        "0",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not out.exists()


def test_bad_scores_in_training_stop_before_the_update(tiny_model_dir, prompt_file, tmp_path):
    """A function that passes the probe and returns NaN on the first rollout: the one-line error at the score
    phase of step 1, before any parameter moves."""
    trainer = tiny_ppo_trainer(
        ppo_cfg(tiny_model_dir, prompt_file, tmp_path, reward_fn="reward_fns:NanAfterProbe")
    )
    trainer.collector.scorer.reward_fn.fn.calls = 1  # as if probed
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_policy.named_parameters()}
    with pytest.raises(UserError) as e:
        trainer.ppo_step()
    assert str(e.value) == "reward_fn 'reward_fns:NanAfterProbe': score 2 is nan (NaN or infinite)"
    assert trainer.step == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.unwrapped_policy.named_parameters())


# --- evaluation -------------------------------------------------------------------------------------


def test_eval_with_reward_fn_only(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """`llm-rlhf eval` with no RM and no gold judge: reward_fn_* beside the (null) rm_* figures, the means
    and per-sample values equal to the function on the written responses, the combined score the weighted
    function, and a policy against itself wins exactly half."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--policy_path",
        str(tiny_model_dir),
        "--baseline_path",
        str(tiny_model_dir),
        "--reward_model_path",
        "none",
        "--gold_judge",
        "none",
        "--reward_fn",
        KEYWORD_FILE,
        "--reward_fn_weight",
        "0.5",
        "--prompt_file",
        str(prompt_file),
        "--num_prompts",
        "8",
        "--max_new_tokens",
        "8",
        "--print_samples",
        "2",
        "--output_dir",
        str(out),
    ]
    assert cli.main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    expected = reward_fns.keyword([s["prompt"] for s in samples], [s["policy_response"] for s in samples])
    assert [s["policy_reward_fn"] for s in samples] == expected
    assert [s["policy_combined_score"] for s in samples] == [0.5 * x for x in expected]
    assert metrics["reward_fn_mean"] == pytest.approx(np.mean(expected)) and sum(expected) > 0
    assert metrics["combined_score_mean"] == pytest.approx(0.5 * np.mean(expected))
    assert metrics["reward_fn_win_rate"] == 0.5 and metrics["combined_win_rate"] == 0.5
    assert metrics["rm_win_rate"] is None and metrics["rm_score_mean"] is None
    assert metrics["reward_fn"] == KEYWORD_FILE


def test_eval_reward_fn_beside_the_rm(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):

    other = build_model(tmp_path / "other", "gpt2", seed=1)
    cfg = evaluate.Config(
        policy_path=str(other),
        baseline_path=str(tiny_model_dir),
        reward_model_path=str(tiny_rm_dir),
        gold_judge="none",
        reward_fn="reward_fns:length",
        reward_fn_weight=2.0,
        prompt_file=str(prompt_file),
        num_prompts=8,
        max_new_tokens=8,
        output_dir=str(tmp_path / "e"),
    )
    metrics = evaluate.run(cfg)
    samples = [json.loads(x) for x in (tmp_path / "e" / "samples.jsonl").read_text().splitlines()]
    for who in ("policy", "baseline"):
        fn = reward_fns.length([], [s[f"{who}_response"] for s in samples])
        assert [s[f"{who}_reward_fn"] for s in samples] == fn
        for s, f in zip(samples, fn):
            assert s[f"{who}_combined_score"] == pytest.approx(s[f"{who}_rm_score"] + 2.0 * f)
    wins = measures.win_rate(
        [s["policy_reward_fn"] for s in samples], [s["baseline_reward_fn"] for s in samples]
    )
    assert metrics["reward_fn_win_rate"] == wins
    assert metrics["rm_score_mean"] is not None and metrics["reward_fn_mean_baseline"] is not None


def test_eval_bad_reward_fn_writes_nothing(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """A failed import or a probe that returns the wrong number of scores stops eval before any model
    loads (as in PPO), with the one-line error and no output."""
    out = tmp_path / "eval"
    monkeypatch.setattr(
        evaluate, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded before the check")
    )
    for named in ("no_such_module_xyz:fn", "reward_fns:wrong_length"):
        cfg = evaluate.Config(
            policy_path=str(tiny_model_dir),
            baseline_path=str(tiny_model_dir),
            reward_model_path=None,
            gold_judge="none",
            reward_fn=named,
            prompt_file=str(prompt_file),
            num_prompts=4,
            max_new_tokens=4,
            output_dir=str(out),
        )
        with pytest.raises(UserError, match=f"^reward_fn '{named}'"):
            evaluate.run(cfg)
    assert not out.exists()


# --- the documented example ---------------------------------------------------------------------------


def test_readme_example_runs(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    """docs/guides/reward-functions.md: its my_rewards.py and each of its commands, with the tiny models, small
    files and a two-step budget put first on the command line (the page's own flags win)."""
    page = doc_section("guides/reward-functions.md")
    (code,), (block,) = code_blocks(page, "python"), code_blocks(page, "bash")
    commands = [line.split() for line in block.splitlines()]
    assert [c[:2] for c in commands] == [["llm-rlhf", "ppo"], ["llm-rlhf", "ppo"], ["llm-rlhf", "eval"]]
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    concise = load_reward_fn("my_rewards:concise")
    assert concise(["p"] * 3, ["Fine.", "Fine", "x" * 90 + "."]) == [1.0, 0.0, pytest.approx(1.0 - 0.02 * 11)]
    tiny = {
        "ppo": dict(
            model_name_or_path=tiny_model_dir,
            reward_model_path=tiny_rm_dir,
            prompt_file=prompt_file,
            steps=2,
            rollout_batch_size=4,
            mini_batch_size=2,
            ppo_epochs=1,
            max_new_tokens=6,
            save_steps=0,
            log_samples_every=0,
            eval_every=0,
        ),
        "eval": dict(
            policy_path=tmp_path / "ppo-1",
            baseline_path=tiny_model_dir,
            reward_model_path=tiny_rm_dir,
            gold_judge="none",
            prompt_file=prompt_file,
            num_prompts=4,
            max_new_tokens=6,
            output_dir=tmp_path / "eval",
        ),
    }
    for i, (_, stage, *flags) in enumerate(commands):
        flags = [f.replace("recipes/", str(ROOT / "recipes") + "/") for f in flags]
        values = {**tiny[stage], **({"output_dir": tmp_path / f"ppo-{i}"} if stage == "ppo" else {})}
        first = [item for key, value in values.items() for item in (f"--{key}", str(value))]
        assert cli.main([stage, *first, *flags]) == 0, (stage, flags)
    with_rm, fn_only = (
        [json.loads(x) for x in (tmp_path / f"ppo-{i}" / "metrics.jsonl").read_text().splitlines()]
        for i in (0, 1)
    )
    assert all("objective/rm_score" in m for m in with_rm) and all(
        "objective/rm_score" not in m for m in fn_only
    )
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["reward_fn"] == "my_rewards:concise" and metrics["reward_fn_weight"] == 0.5
    assert metrics["combined_score_mean"] == pytest.approx(
        metrics["rm_score_mean"] + 0.5 * metrics["reward_fn_mean"], abs=1e-9
    )
