"""`llm-rlhf eval`: the metric helpers against hand-computed values, and runs on tiny models: a policy
compared with itself (KL exactly 0, win rates exactly 0.5), determinism, and `evaluate_policy`."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from helpers import DEVICE, SENTIMENT_JUDGE, approx_numbers, eval_config

from llm_rlhf.core.errors import UserError
from llm_rlhf.evaluation import measures
from llm_rlhf.models.loading import freeze, load_causal_lm, load_tokenizer
from llm_rlhf.models.scoring import Scorer
from llm_rlhf.rl.rollout import Sampling
from llm_rlhf.stages import evaluate

# --- pure helpers ---------------------------------------------------------------------------------


def test_win_rate_counts_ties_half():
    assert measures.win_rate([3.0, 1.0, 2.0, 2.0], [1.0, 1.0, 5.0, 0.0]) == 0.625  # win, tie, loss, win
    assert measures.win_rate([1.0, 2.0], [1.0, 2.0]) == 0.5
    assert measures.win_points([0.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError):
        measures.win_rate([1.0], [1.0, 2.0])


def test_distinct_n_hand_example():
    sequences = [[1, 2, 1, 2], [1, 3]]
    assert measures.distinct_n(sequences, 1) == 3 / 6  # {1, 2, 3} of 6 tokens
    assert measures.distinct_n(sequences, 2) == 3 / 4  # (1,2) (2,1) (1,2) (1,3): 3 unique of 4
    assert measures.distinct_n([[7]], 2) == 0.0


def test_config_rejects_bad_values():
    with pytest.raises(UserError, match="temperature"):
        evaluate.Config(temperature=0.0)
    with pytest.raises(UserError, match="samples_per_prompt"):
        evaluate.Config(samples_per_prompt=0)


# --- runs on tiny models ----------------------------------------------------------------------------


def test_policy_against_itself(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """Same model, paired seeds: identical samples, so KL is exactly 0 and both win rates exactly 0.5."""
    out = tmp_path / "eval"
    metrics = evaluate.run(
        eval_config(
            tiny_model_dir,
            tiny_model_dir,
            prompt_file,
            out,
            reward_model_path=str(tiny_rm_dir),
            samples_per_prompt=2,
        )
    )
    assert metrics["kl_to_ref"] == 0.0 and metrics["kl_to_ref_at_temperature"] == 0.0
    assert metrics["gold_win_rate"] == 0.5 and metrics["rm_win_rate"] == 0.5
    for key in ("gold_score_mean", "rm_score_mean", "response_length_mean", "eos_rate", "distinct_1"):
        assert metrics[key] == metrics[key + "_baseline"]
    assert 1 <= metrics["response_length_mean"] <= 6
    assert metrics["num_pairs"] == 24 and metrics["gold_judge_heldout_accuracy"] >= 0.75

    written = json.loads((out / "metrics.json").read_text())
    assert written == approx_numbers(metrics)
    for key in ("gold_win_rate", "rm_win_rate", "kl_to_ref", "gold_score_mean", "rm_score_mean"):
        assert written[key] is not None
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 24 and [s["sample"] for s in samples[:4]] == [0, 1, 0, 1]
    for key in evaluate.SAMPLE_KEYS:
        assert all(s[f"policy_{key}"] == s[f"baseline_{key}"] for s in samples), key
    assert samples[0]["policy_response"] != samples[1]["policy_response"]  # two different samples
    assert (out / "config.yaml").is_file()


def test_a_model_that_is_its_own_reference_is_run_once_for_its_kl(
    tiny_model_dir, other_model_dir, prompt_file, tmp_path, monkeypatch
):
    """The baseline that is the reference: one forward of its samples for kl_to_ref instead of two,
    KL exactly 0; the policy, another model, still gets both forwards and KL > 0."""
    forwards = []
    real = measures.response_logits
    monkeypatch.setattr(measures, "response_logits", lambda m, b: forwards.append(m) or real(m, b))
    kw = dict(gold_judge="none", num_prompts=4, batch_size=4, samples_per_prompt=1)
    metrics = evaluate.run(eval_config(other_model_dir, tiny_model_dir, prompt_file, tmp_path / "a", **kw))
    assert metrics["kl_to_ref_baseline"] == 0.0 and metrics["kl_to_ref"] > 0
    policy, baseline = (
        forwards[0],
        forwards[2],
    )  # the policy's batch: its forward, the reference's; then the baseline's
    assert len(forwards) == 3 and forwards[1] is baseline and policy is not baseline


@pytest.mark.slow
def test_different_policy_is_deterministic(tiny_model_dir, other_model_dir, prompt_file, tmp_path):
    """A policy that differs from the reference: KL > 0 on its samples, the baseline (= reference) has KL
    exactly 0, the KL at the sampling temperature is reported apart, and two runs agree exactly."""
    kw = dict(temperature=0.7, gold_judge="none", num_prompts=6, batch_size=3)
    first = evaluate.run(eval_config(other_model_dir, tiny_model_dir, prompt_file, tmp_path / "a", **kw))
    second = evaluate.run(eval_config(other_model_dir, tiny_model_dir, prompt_file, tmp_path / "b", **kw))
    first.pop("time_s"), second.pop("time_s")
    assert first == second
    assert (tmp_path / "a" / "samples.jsonl").read_text() == (tmp_path / "b" / "samples.jsonl").read_text()
    assert first["kl_to_ref"] > 0 and first["kl_to_ref_baseline"] == 0.0
    assert first["kl_to_ref_at_temperature"] != first["kl_to_ref"]
    assert (
        first["gold_win_rate"] is None and first["gold_score_mean"] is None and first["rm_win_rate"] is None
    )

    reseeded = evaluate.run(
        eval_config(other_model_dir, tiny_model_dir, prompt_file, tmp_path / "c", seed=1, **kw)
    )
    assert (tmp_path / "c" / "samples.jsonl").read_text() != (tmp_path / "a" / "samples.jsonl").read_text()
    assert reseeded["kl_to_ref"] != first["kl_to_ref"]


def over_prompts(values: list[float], k: int) -> tuple[float, float]:
    """Mean of every value, and sd / sqrt(n) over the n prompts' means (k consecutive values per prompt)."""
    means = [statistics.fmean(values[i : i + k]) for i in range(0, len(values), k)]
    return statistics.fmean(values), statistics.stdev(means) / math.sqrt(len(means))


def test_eval_win_rates_and_standard_errors_are_over_prompts(
    tiny_model_dir, other_model_dir, prompt_file, tmp_path
):
    """12 prompts x 3 samples: every win rate is the mean of the win points (1, 1/2, 0) of the 36 pairs, and
    its stderr and every score's stderr is the one over the 12 prompts' means, read back from samples.jsonl
    (a prompt's samples share the prompt: not independent draws), as for accuracy. Fails if a stderr is
    taken over the samples."""
    k, out = 3, tmp_path / "eval"
    metrics = evaluate.run(
        eval_config(
            other_model_dir,
            tiny_model_dir,
            prompt_file,
            out,
            samples_per_prompt=k,
            reward_fn="reward_fns:length",
        )
    )
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 36 and [r["sample"] for r in rows[:4]] == [0, 1, 2, 0]
    for key in ("gold_score", "reward_fn", "combined_score"):  # sentiment: measured with a fluency gold only
        a, b = [r[f"policy_{key}"] for r in rows], [r[f"baseline_{key}"] for r in rows]
        points = measures.win_points(a, b)
        name = key.removesuffix("_score")
        mean, stderr = over_prompts(points, k)
        assert metrics[f"{name}_win_rate"] == pytest.approx(mean), key
        assert metrics[f"{name}_win_rate_stderr"] == pytest.approx(stderr), key
        assert stderr != pytest.approx(statistics.stdev(points) / 6), f"{key}: not over the samples"
    for key in ("gold_score", "reward_fn", "combined_score", "kl_to_ref"):
        for who, suffix in (("policy", ""), ("baseline", "_baseline")):
            mean, stderr = over_prompts([r[f"{who}_{key}"] for r in rows], k)
            assert metrics[(key if key == "kl_to_ref" else f"{key}_mean") + suffix] == pytest.approx(mean)
            assert metrics[f"{key}_stderr{suffix}"] == pytest.approx(stderr, abs=1e-12), (key, who)
    assert json.loads((out / "metrics.json").read_text()) == approx_numbers(metrics)


def test_evaluate_policy_matches_the_command(
    tiny_model_dir, other_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """The in-training entry point gives the command's policy figures and leaves the global RNG alone."""
    from llm_rlhf.models.gold import GoldJudge
    from llm_rlhf.models.reward_model import load_reward_model

    metrics = evaluate.run(
        eval_config(
            other_model_dir,
            tiny_model_dir,
            prompt_file,
            tmp_path / "eval",
            reward_model_path=str(tiny_rm_dir),
        )
    )
    tokenizer = load_tokenizer(str(other_model_dir))
    policy = load_causal_lm(str(other_model_dir)).to(
        DEVICE
    )  # where the command ran: its draws are the device's
    policy.train()
    prompts = evaluate.load_prompt_texts(
        eval_config(other_model_dir, tiny_model_dir, prompt_file, tmp_path), tokenizer
    )
    torch.manual_seed(123)
    state = torch.get_rng_state()
    result = measures.evaluate_policy(
        policy=policy,
        tokenizer=tokenizer,
        prompts=prompts,
        draws=measures.PairedSampling(Sampling(max_new_tokens=6), seed=0, batch_size=5),
        measures=measures.Measures(
            Scorer(freeze(load_reward_model(str(tiny_rm_dir)).to(DEVICE))), GoldJudge.load(SENTIMENT_JUDGE)
        ),
        reference=measures.KLReference(freeze(load_causal_lm(str(tiny_model_dir)).to(DEVICE))),
    )
    assert torch.equal(torch.get_rng_state(), state)
    assert policy.training  # restored
    for key in (
        "gold_score_mean",
        "rm_score_mean",
        "kl_to_ref",
        "response_length_mean",
        "eos_rate",
        "distinct_2",
    ):
        assert result[key] == pytest.approx(metrics[key], abs=1e-6), key


def test_bad_inputs_fail_before_anything_is_written(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(UserError, match="num_prompts=99"):
        evaluate.run(eval_config(tiny_model_dir, tiny_model_dir, prompt_file, out, num_prompts=99))
    with pytest.raises(UserError, match="gold_judge"):
        evaluate.run(eval_config(tiny_model_dir, tiny_model_dir, prompt_file, out, gold_judge="nope"))
    with pytest.raises(UserError, match="reward model"):
        evaluate.run(
            eval_config(
                tiny_model_dir, tiny_model_dir, prompt_file, out, reward_model_path=str(tmp_path / "x")
            )
        )
    assert not out.exists()


def test_cli_eval(tiny_model_dir, prompt_file, tmp_path):
    from llm_rlhf.interfaces.cli import main

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
        SENTIMENT_JUDGE,
        "--prompt_file",
        str(prompt_file),
        "--num_prompts",
        "4",
        "--max_new_tokens",
        "4",
        "--print_samples",
        "0",
        "--output_dir",
        str(out),
    ]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["gold_win_rate"] == 0.5 and metrics["kl_to_ref"] == 0.0 and metrics["rm_win_rate"] is None
