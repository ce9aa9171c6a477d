"""Unbiased pass@k (Chen et al. 2021) in `llm-rlhf eval` and PPO's held-out evaluation: the estimator against
its worked example and every k-subset of the samples, its standard error over the prompts, the figures of
both commands against the verdicts they wrote, the report's rows and curves, and the config errors."""

from __future__ import annotations

import itertools
import math
import re
import statistics

import pytest
from helpers import eval_config, ppo_config, read_jsonl

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.errors import ConfigError
from llm_rlhf.evaluation import measures
from llm_rlhf.interfaces import cli
from llm_rlhf.interfaces.report.accuracy import accuracy_kinds
from llm_rlhf.interfaces.report.evaluation import EVAL_GROUPS, expand
from llm_rlhf.ppo.config import Config as PPOConfig
from llm_rlhf.stages import evaluate, ppo

EVEN = "reward_fns:even_length"  # tests/reward_fns.py: 1.0 iff the response has an even number of characters


def even(responses: list[str]) -> list[float]:
    return [float(len(r) % 2 == 0) for r in responses]


def pass_at_k_by_subsets(verdicts: list[float], k: int) -> float:
    """The fraction of the k-subsets of one prompt's samples that hold a correct one."""
    subsets = list(itertools.combinations(verdicts, k))
    return sum(any(s) for s in subsets) / len(subsets)


def per_prompt_pass(verdicts: list[float], n: int, k: int) -> list[float]:
    return [pass_at_k_by_subsets(verdicts[i : i + n], k) for i in range(0, len(verdicts), n)]


# --- the estimator -----------------------------------------------------------------------------------------


def test_worked_example_n_4_c_2():
    assert [measures.pass_at_k(4, 2, k) for k in (1, 2, 3, 4)] == pytest.approx([1 / 2, 5 / 6, 1.0, 1.0])


@pytest.mark.parametrize("n", [1, 2, 5, 10])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample_and_the_binomial_form(n):
    for c in range(n + 1):
        verdicts = [1.0] * c + [0.0] * (n - c)
        for k in range(1, n + 1):
            estimate = measures.pass_at_k(n, c, k)
            assert estimate == pytest.approx(pass_at_k_by_subsets(verdicts, k), abs=1e-12)
            assert estimate == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert measures.pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))


@pytest.mark.parametrize(("n", "c", "k"), [(4, 2, 5), (4, 2, 0), (4, 5, 2), (4, -1, 1)])
def test_pass_at_k_refuses_what_it_cannot_estimate(n, c, k):
    with pytest.raises(ValueError, match=rf"got n = {n}, c = {c}, k = {k}"):
        measures.pass_at_k(n, c, k)


def test_pass_at_k_stderr_is_over_the_prompts_and_pass_at_1_is_the_accuracy():
    """3 prompts x 4 samples with 2, 4 and 0 correct: pass@2 per prompt 5/6, 1, 0; the stderr their sd over
    sqrt(3); pass@1 equals the accuracy and its stderr over the prompts."""
    verdicts = [1.0, 0.0, 1.0, 0.0] + [1.0] * 4 + [0.0] * 4
    mean, stderr = measures.pass_at_k_and_stderr(verdicts, 4, 2)
    assert mean == pytest.approx((5 / 6 + 1 + 0) / 3)
    assert stderr == pytest.approx(statistics.stdev([5 / 6, 1.0, 0.0]) / math.sqrt(3))
    assert measures.pass_at_k_and_stderr(verdicts, 4, 1) == pytest.approx(
        measures.mean_and_stderr_over_prompts(verdicts, 4)
    )
    with pytest.raises(ValueError, match=r"pass@5 needs k <= samples_per_prompt \(4\)"):
        measures.pass_at_k_and_stderr(verdicts, 4, 5)
    with pytest.raises(ValueError, match="samples_per_prompt=5"):
        measures.pass_at_k_and_stderr(verdicts, 5, 1)


# --- the commands ------------------------------------------------------------------------------------------


def test_eval_reports_pass_at_k_of_both_models_from_their_verdicts(
    tiny_model_dir, other_model_dir, prompt_file, tmp_path
):
    """4 samples per prompt, pass_at_k [1, 2, 4]: each model's pass_at_<k> is the mean over the 12 prompts of
    the fraction of k-subsets of its samples.jsonl verdicts holding a correct one, the stderr over the prompts;
    pass@1 is the accuracy; the report's evaluation table has a row per k."""
    out = tmp_path / "eval"
    metrics = evaluate.run(
        eval_config(
            other_model_dir,
            tiny_model_dir,
            prompt_file,
            out,
            gold_judge="none",
            samples_per_prompt=4,
            accuracy_fn=EVEN,
            pass_at_k=[1, 2, 4],
        )
    )
    rows = read_jsonl(out / "samples.jsonl")
    assert len(rows) == 48
    for who, suffix in (("policy", ""), ("baseline", "_baseline")):
        correct = [r[f"{who}_correct"] for r in rows]
        assert correct == even([r[f"{who}_response"] for r in rows])
        for k in (1, 2, 4):
            per_prompt = per_prompt_pass(correct, 4, k)
            assert metrics[f"pass_at_{k}{suffix}"] == pytest.approx(statistics.fmean(per_prompt))
            assert metrics[f"pass_at_{k}_stderr{suffix}"] == pytest.approx(
                statistics.stdev(per_prompt) / math.sqrt(12)
            )
        assert metrics["pass_at_1" + suffix] == pytest.approx(metrics["accuracy" + suffix])
        assert metrics["pass_at_1" + suffix] < metrics["pass_at_2" + suffix] < metrics["pass_at_4" + suffix]
    (pass_rows,) = [
        expand(row, metrics) for _, rows_ in EVAL_GROUPS for row in rows_ if row.label == "pass@k"
    ]
    assert [(r.label, r.key, r.stderr) for r in pass_rows] == [
        (f"pass@{k} (unbiased, from 4 samples)", f"pass_at_{k}", f"pass_at_{k}_stderr") for k in (1, 2, 4)
    ]


def test_ppo_heldout_reports_pass_at_k_and_training_is_unchanged(tiny_model_dir, prompt_file, tmp_path):
    """eval_samples_per_prompt 4, eval_pass_at_k [1, 3]: each held-out evaluation samples 4 responses to each
    of its 3 prompts (eval_samples.jsonl, prompt-major), and eval_log.jsonl's pass_at_<k> is computed from their
    verdicts; the greedy responses stay one per prompt; the training is that of the run without pass@k; the
    report draws a curve per pass@k."""
    kw = dict(
        reward_fn="reward_fns:length", eval_every=1, eval_prompt_file=str(prompt_file), eval_num_prompts=3
    )
    on = ppo_config(
        tiny_model_dir,
        None,
        prompt_file,
        tmp_path / "on",
        accuracy_fn=EVEN,
        eval_samples_per_prompt=4,
        eval_pass_at_k=[1, 3],
        **kw,
    )
    ppo.run(on)
    ppo.run(ppo_config(tiny_model_dir, None, prompt_file, tmp_path / "off", accuracy_fn=EVEN, **kw))
    log = read_jsonl(tmp_path / "on" / "eval_log.jsonl")
    samples = read_jsonl(tmp_path / "on" / "eval_samples.jsonl")
    for record in log:
        rows = [s for s in samples if s["step"] == record["step"]]
        assert len(rows) == 12 and len({s["prompt"] for s in rows[:4]}) == 1  # 4 samples of each prompt
        correct = even([s["response"] for s in rows])
        for k in (1, 3):
            per_prompt = per_prompt_pass(correct, 4, k)
            assert record[f"pass_at_{k}"] == pytest.approx(statistics.fmean(per_prompt))
            assert record[f"pass_at_{k}_stderr"] == pytest.approx(statistics.stdev(per_prompt) / math.sqrt(3))
        assert record["pass_at_1"] == pytest.approx(record["accuracy"])
    off = read_jsonl(tmp_path / "off" / "eval_log.jsonl")
    assert all("pass_at_1" not in record for record in off)
    assert log[0]["accuracy_greedy"] == off[0]["accuracy_greedy"]  # the same greedy response per prompt
    for a, b in zip(*(read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("on", "off"))):
        assert {k: v for k, v in a.items() if not k.startswith(("time/", "tokens_per_s"))} == {
            k: v for k, v in b.items() if not k.startswith(("time/", "tokens_per_s"))
        }
    assert [kind for _, kind in accuracy_kinds(log)] == ["sampled", "greedy", "pass@1", "pass@3"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--pass_at_k", "[5]", "--samples_per_prompt", "4", "--accuracy_fn", EVEN],
            r"pass@5 needs k <= samples_per_prompt \(4\)",
        ),
        (["--pass_at_k", "[2]", "--samples_per_prompt", "4"], r"needs accuracy_fn"),
        (["--pass_at_k", "[0]", "--accuracy_fn", EVEN], r"0 is not an integer >= 1"),
        (["--pass_at_k", "[2, 2]", "--samples_per_prompt", "2", "--accuracy_fn", EVEN], r"lists a k twice"),
    ],
)
def test_eval_pass_at_k_errors_are_one_line_naming_the_key(argv, says, capsys, tmp_path):
    out = tmp_path / "eval"
    assert cli.main(["eval", *argv, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: config key 'pass_at_k': ")
    assert re.search(says, err) and not out.exists()


def test_ppo_eval_pass_at_k_errors_name_the_key():
    with pytest.raises(
        ConfigError, match=r"^config key 'eval_pass_at_k': pass@2 needs k <= eval_samples_per_prompt \(1\)"
    ):
        PPOConfig(eval_pass_at_k=[2], accuracy_fn=EVEN)
    with pytest.raises(ConfigError, match=r"^config key 'eval_samples_per_prompt': must be >= 1"):
        parse_config(PPOConfig, ["--eval_samples_per_prompt", "0"])
