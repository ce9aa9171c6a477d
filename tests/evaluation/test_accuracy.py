"""Held-out accuracy by a verifier (`accuracy_fn`) in `llm-rlhf eval` and PPO's held-out evaluation:
the figures against hand-computed means and standard errors over the prompts, greedy responses against an
independent greedy decode (transformers' `generate`, do_sample=False), the checks on the verifier, the
pipeline's eval stage taking PPO's, and the real arithmetic verifier end to end through the command."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from helpers import (
    COLON_CHAT_TEMPLATE,
    ROOT,
    approx_numbers,
    eval_config,
    ppo_config,
    read_jsonl,
    tiny_chat_model,
)

from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.evaluation import measures
from llm_rlhf.models.loading import load_causal_lm, load_tokenizer
from llm_rlhf.stages import evaluate, ppo
from llm_rlhf.tasks.arithmetic import prompt_answer, reward

EVEN = "reward_fns:even_length"  # tests/reward_fns.py: 1.0 iff the response has an even number of characters


def even(responses: list[str]) -> list[float]:
    return [float(len(r) % 2 == 0) for r in responses]


def hf_greedy(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Independent greedy decoding: each prompt alone (no padding) through transformers' `generate` with
    do_sample=False, cut before the first EOS, decoded without special tokens."""
    tokenizer = load_tokenizer(str(model_dir))
    lm = load_causal_lm(str(model_dir)).eval()
    eos = tokenizer.eos_token_id
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # (1, P)
        with torch.no_grad():
            sequence = lm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        response = sequence[0, ids.shape[1] :].tolist()
        response = response[: response.index(eos)] if eos in response else response
        out.append(tokenizer.decode(response, skip_special_tokens=True))
    return out


# --- the pure helper ---------------------------------------------------------------------------------------


def test_stderr_is_over_prompts_not_samples():
    """3 prompts x 2 samples: per-prompt means (0.5, 1, 0), mean 0.5, sd 0.5, stderr 0.5 / sqrt(3); over the 6
    samples as if independent it would be sqrt(0.3) / sqrt(6)."""
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    mean, stderr = measures.mean_and_stderr_over_prompts(values, 2)
    assert mean == 0.5 and stderr == pytest.approx(0.5 / math.sqrt(3))
    assert measures.mean_and_stderr(values)[1] == pytest.approx(math.sqrt(0.3) / math.sqrt(6))
    assert measures.mean_and_stderr_over_prompts(values, 1) == measures.mean_and_stderr(values)
    with pytest.raises(ValueError, match="samples_per_prompt=4"):
        measures.mean_and_stderr_over_prompts(values, 4)


# --- llm-rlhf eval -----------------------------------------------------------------------------------------


def test_eval_reports_accuracy_of_the_samples_and_of_greedy_responses(
    tiny_model_dir, other_model_dir, prompt_file, tmp_path
):
    """Two samples per prompt: accuracy is the mean of the verifier's verdicts on samples.jsonl's responses,
    its stderr the one over the 12 prompts' means (not over the 24 samples); the greedy responses are
    transformers' greedy decode, one per prompt, repeated on both of its sample lines."""
    out = tmp_path / "eval"
    metrics = evaluate.run(
        eval_config(
            other_model_dir,
            tiny_model_dir,
            prompt_file,
            out,
            gold_judge="none",
            samples_per_prompt=2,
            accuracy_fn=EVEN,
        )
    )
    rows = read_jsonl(out / "samples.jsonl")
    assert len(rows) == 24 and [r["sample"] for r in rows[:4]] == [0, 1, 0, 1]
    prompts = [r["prompt"] for r in rows[::2]]
    for who, model, suffix in (("policy", other_model_dir, ""), ("baseline", tiny_model_dir, "_baseline")):
        correct = [r[f"{who}_correct"] for r in rows]
        assert correct == even([r[f"{who}_response"] for r in rows]), who
        per_prompt = [(a + b) / 2 for a, b in zip(correct[::2], correct[1::2])]  # (12,)
        assert metrics["accuracy" + suffix] == pytest.approx(statistics.fmean(correct))
        assert 0 < metrics["accuracy" + suffix] < 1, "the verifier finds both right and wrong samples"
        stderr = metrics["accuracy_stderr" + suffix]
        assert stderr == pytest.approx(statistics.stdev(per_prompt) / math.sqrt(12))
        assert stderr != pytest.approx(statistics.stdev(correct) / math.sqrt(24)), "not over the samples"

        greedy = [r[f"{who}_greedy_response"] for r in rows[::2]]
        assert [r[f"{who}_greedy_response"] for r in rows[1::2]] == greedy  # one per prompt, on both lines
        assert greedy == hf_greedy(model, prompts, max_new_tokens=6), who
        greedy_correct = [r[f"{who}_greedy_correct"] for r in rows[::2]]
        assert greedy_correct == even(greedy)
        assert metrics["accuracy_greedy" + suffix] == pytest.approx(statistics.fmean(greedy_correct))
        assert metrics["accuracy_greedy_stderr" + suffix] == pytest.approx(
            statistics.stdev(greedy_correct) / math.sqrt(12)
        )
    assert [r["policy_greedy_response"] for r in rows] != [r["baseline_greedy_response"] for r in rows]
    assert metrics["accuracy_fn"] == EVEN
    assert json.loads((out / "metrics.json").read_text()) == approx_numbers(metrics)
    text = evaluate.format_metrics(metrics)
    for key in ("accuracy", "accuracy_greedy"):
        a, b = metrics[key], metrics[key + "_baseline"]
        se_a, se_b = metrics[key + "_stderr"], metrics[key + "_stderr_baseline"]
        assert f"{key:<24}{a:>10.4f}{b:>10.4f}  (+/- {se_a:.4f} / {se_b:.4f})" in text.splitlines()


def test_greedy_draws_nothing_random_and_off_means_null(
    tiny_model_dir, other_model_dir, prompt_file, tmp_path
):
    """Another seed changes the samples, not the greedy responses; without accuracy_fn every accuracy key is
    null and the sample lines carry null verdicts."""
    kw = dict(gold_judge="none", num_prompts=6, batch_size=3, accuracy_fn=EVEN)
    evaluate.run(eval_config(other_model_dir, tiny_model_dir, prompt_file, tmp_path / "a", **kw))
    evaluate.run(eval_config(other_model_dir, tiny_model_dir, prompt_file, tmp_path / "b", seed=1, **kw))
    a, b = read_jsonl(tmp_path / "a" / "samples.jsonl"), read_jsonl(tmp_path / "b" / "samples.jsonl")
    assert [r["policy_response"] for r in a] != [r["policy_response"] for r in b]
    for key in ("policy_greedy_response", "baseline_greedy_response", "policy_greedy_correct"):
        assert [r[key] for r in a] == [r[key] for r in b], key

    kw.pop("accuracy_fn")
    off = evaluate.run(eval_config(other_model_dir, tiny_model_dir, prompt_file, tmp_path / "off", **kw))
    for key in measures.ACCURACY_KEYS:
        assert off[key] is None and off[key + "_baseline"] is None, key
    assert off["accuracy_fn"] is None and "accuracy" not in evaluate.format_metrics(off)
    for row in read_jsonl(tmp_path / "off" / "samples.jsonl"):
        assert {k: v for k, v in row.items() if "correct" in k or "greedy" in k} == {
            "policy_correct": None,
            "baseline_correct": None,
            "policy_greedy_response": None,
            "policy_greedy_correct": None,
            "baseline_greedy_response": None,
            "baseline_greedy_correct": None,
        }


def test_a_graded_or_broken_verifier_stops_before_anything_is_written(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(UserError) as e:
        evaluate.run(
            eval_config(tiny_model_dir, tiny_model_dir, prompt_file, out, accuracy_fn="reward_fns:half")
        )
    assert str(e.value) == (
        "accuracy_fn 'reward_fns:half': score 0 is 0.5; a verifier returns 1.0 (correct) or 0.0 (wrong) "
        "(the accuracy of a graded score is meaningless)"
    )
    with pytest.raises(UserError, match=r"^accuracy_fn 'reward_fns:raises' raised ZeroDivisionError"):
        evaluate.run(
            eval_config(tiny_model_dir, tiny_model_dir, prompt_file, out, accuracy_fn="reward_fns:raises")
        )
    with pytest.raises(UserError, match=r"^accuracy_fn 'reward_fns:nope': 'reward_fns' has no attribute"):
        evaluate.run(
            eval_config(tiny_model_dir, tiny_model_dir, prompt_file, out, accuracy_fn="reward_fns:nope")
        )
    assert not out.exists()
    with pytest.raises(ConfigError, match="accuracy_fn 'no_colon'"):
        evaluate.Config(accuracy_fn="no_colon")
    with pytest.raises(ConfigError, match="accuracy_fn 'no_colon'"):
        ppo_config(
            tiny_model_dir, None, prompt_file, tmp_path, reward_fn="reward_fns:length", accuracy_fn="no_colon"
        )
    ppo_out = tmp_path / "ppo"
    cfg = ppo_config(
        tiny_model_dir,
        None,
        prompt_file,
        ppo_out,
        reward_fn="reward_fns:length",
        eval_every=1,
        eval_prompt_file=str(prompt_file),
        accuracy_fn="reward_fns:half",
    )
    with pytest.raises(UserError, match=r"^accuracy_fn 'reward_fns:half': score 0 is 0.5;"):
        ppo.run(cfg)
    assert not ppo_out.exists()


# --- PPO's held-out evaluation -----------------------------------------------------------------------------


def test_ppo_eval_log_has_accuracy_and_training_is_unchanged(tiny_model_dir, prompt_file, tmp_path):
    """eval_log.jsonl at steps 0, 1, 2: accuracy is the verifier's mean over that evaluation's samples
    (eval_samples.jsonl), accuracy_greedy at step 0 that of the initial model's greedy responses; and the run
    trains exactly as the same run without accuracy_fn (the greedy pass is outside the training RNG stream)."""
    kw = dict(
        reward_fn="reward_fns:length", eval_every=1, eval_prompt_file=str(prompt_file), eval_num_prompts=6
    )
    ppo.run(ppo_config(tiny_model_dir, None, prompt_file, tmp_path / "on", accuracy_fn=EVEN, **kw))
    ppo.run(ppo_config(tiny_model_dir, None, prompt_file, tmp_path / "off", **kw))

    log = read_jsonl(tmp_path / "on" / "eval_log.jsonl")
    samples = read_jsonl(tmp_path / "on" / "eval_samples.jsonl")
    assert [r["step"] for r in log] == [0, 1, 2]
    for record in log:
        responses = [s["response"] for s in samples if s["step"] == record["step"]]
        correct = even(responses)
        assert len(correct) == 6
        assert record["accuracy"] == pytest.approx(statistics.fmean(correct))
        assert record["accuracy_stderr"] == pytest.approx(statistics.stdev(correct) / math.sqrt(6))
        assert 0 <= record["accuracy_greedy"] <= 1 and record["accuracy_greedy_stderr"] >= 0
    prompts = [s["prompt"] for s in samples if s["step"] == 0]
    greedy = even(hf_greedy(tiny_model_dir, prompts, max_new_tokens=8))  # ppo_config: 8 new tokens
    assert log[0]["accuracy_greedy"] == pytest.approx(statistics.fmean(greedy))
    assert log[0]["accuracy_greedy_stderr"] == pytest.approx(statistics.stdev(greedy) / math.sqrt(6))

    off = read_jsonl(tmp_path / "off" / "eval_log.jsonl")
    measured = (*measures.ACCURACY_KEYS, "best_step")  # the watch ranks by accuracy where there is one
    for a, b in zip(log, off):
        assert all(b[key] is None for key in measures.ACCURACY_KEYS)
        assert {k: v for k, v in a.items() if k not in measured} == {
            k: v for k, v in b.items() if k not in measured
        }
    for a, b in zip(*(read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("on", "off"))):
        assert {k: v for k, v in a.items() if not k.startswith(("time/", "tokens_per_s"))} == {
            k: v for k, v in b.items() if not k.startswith(("time/", "tokens_per_s"))
        }


def test_eval_batch_size_gives_runs_of_other_rollout_shapes_the_same_heldout_draws(
    tiny_model_dir, prompt_file, tmp_path
):
    """The step-0 evaluation (policy == the initial model) of two runs with 8 and 4 prompts a rollout: the same
    samples and figures with eval_batch_size 3 (batches of 3 drawn after seeding with seed + b), and without it
    other samples (batches of rollout_batch_size). eval_batch_size is checked when the config is built."""
    kw = dict(
        reward_fn="reward_fns:length",
        steps=1,
        eval_every=1,
        eval_prompt_file=str(prompt_file),
        eval_num_prompts=6,
        accuracy_fn=EVEN,
    )
    for name, rollout, eval_batch in [("r8", 8, 3), ("r4", 4, 3), ("r8-own", 8, None), ("r4-own", 4, None)]:
        cfg = ppo_config(
            tiny_model_dir,
            None,
            prompt_file,
            tmp_path / name,
            rollout_batch_size=rollout,
            eval_batch_size=eval_batch,
            **kw,
        )
        assert cfg.heldout_batch_size == (eval_batch or rollout)
        ppo.run(cfg)

    def step0(name):
        record = read_jsonl(tmp_path / name / "eval_log.jsonl")[0]
        samples = [
            s["response"] for s in read_jsonl(tmp_path / name / "eval_samples.jsonl") if s["step"] == 0
        ]
        return samples, record

    assert step0("r8") == step0("r4")
    assert step0("r8-own")[0] != step0("r4-own")[0]
    assert step0("r8")[0] != step0("r8-own")[0]
    with pytest.raises(ConfigError, match="eval_batch_size"):
        ppo_config(tiny_model_dir, None, prompt_file, tmp_path / "bad", eval_batch_size=0, **kw)


# --- the pipeline ------------------------------------------------------------------------------------------


def test_pipeline_eval_takes_ppos_accuracy_fn(tmp_path, monkeypatch):
    from llm_rlhf.interfaces import pipeline

    monkeypatch.chdir(ROOT)  # the default recipe paths are relative to the repo root
    cfg = pipeline.Config(output_dir=str(tmp_path), ppo={"accuracy_fn": "llm_rlhf.tasks.arithmetic:reward"})
    assert pipeline.stage_config(cfg, "eval").accuracy_fn == "llm_rlhf.tasks.arithmetic:reward"
    assert pipeline.stage_config(pipeline.Config(output_dir=str(tmp_path)), "eval").accuracy_fn is None
    own = pipeline.Config(
        output_dir=str(tmp_path),
        ppo={"accuracy_fn": "llm_rlhf.tasks.arithmetic:reward"},
        eval={"accuracy_fn": EVEN},
    )
    assert pipeline.stage_config(own, "eval").accuracy_fn == EVEN  # eval's overrides win


# --- the arithmetic verifier through the command -----------------------------------------------------------


def test_arithmetic_verifier_through_llm_rlhf_eval(tmp_path):
    """`llm-rlhf eval --accuracy_fn llm_rlhf.tasks.arithmetic:reward` on the committed held-out problems (chat rows,
    rendered with a tiny model's chat template): every verdict is the verifier's on the rendered prompt and
    the response, and the figures are their means."""
    from llm_rlhf.interfaces.cli import main

    model = tiny_chat_model(
        tmp_path / "chat_model", COLON_CHAT_TEMPLATE, n_positions=256, kind="gpt2"
    )  # long prompts
    problems_file = ROOT / "data" / "arithmetic" / "eval_prompts.jsonl"
    problems = read_jsonl(problems_file)[:4]  # the first 4 in file order
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--policy_path",
        str(model),
        "--baseline_path",
        str(model),
        "--reward_model_path",
        "none",
        "--gold_judge",
        "none",
        "--prompt_file",
        str(problems_file),
        "--num_prompts",
        "4",
        "--max_prompt_length",
        "200",
        "--max_new_tokens",
        "8",
        "--samples_per_prompt",
        "2",
        "--accuracy_fn",
        "llm_rlhf.tasks.arithmetic:reward",
        "--print_samples",
        "0",
        "--output_dir",
        str(out),
    ]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    rows = read_jsonl(out / "samples.jsonl")
    assert len(rows) == 8 and metrics["accuracy_fn"] == "llm_rlhf.tasks.arithmetic:reward"
    for row, problem in zip(rows[::2], problems):
        assert row["prompt"].startswith("user: ") and row["prompt"].endswith("\nassistant:")
        assert prompt_answer(row["prompt"]) == problem["answer"]  # the verifier reads the rendered problem
    for who in ("policy", "baseline"):
        prompts, responses = [r["prompt"] for r in rows], [r[f"{who}_response"] for r in rows]
        assert [r[f"{who}_correct"] for r in rows] == reward(prompts, responses)
        greedy = [r[f"{who}_greedy_response"] for r in rows[::2]]
        assert [r[f"{who}_greedy_correct"] for r in rows[::2]] == reward(prompts[::2], greedy)
    assert metrics["accuracy"] == pytest.approx(statistics.fmean(r["policy_correct"] for r in rows))
    assert metrics["accuracy_greedy"] == pytest.approx(
        statistics.fmean(r["policy_greedy_correct"] for r in rows)
    )
    assert metrics["accuracy"] == metrics["accuracy_baseline"]  # the same model, the same seeds
    assert metrics["accuracy_greedy"] == metrics["accuracy_greedy_baseline"]
