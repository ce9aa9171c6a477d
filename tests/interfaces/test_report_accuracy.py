"""report.html of a task with a verifier (the arithmetic task: PPO straight from the instruct model on the
verifier's reward, no SFT, no RM stage, no gold judge): held-out accuracy in the cards, the figures and the
evaluation table, each sample marked correct or not, the reward panels named for a reward function, and the
colours and line styles of a sweep of estimators and seeds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import write_jsonl
from report_runs import IMG, PNG_MAGIC, between, make_run, visible_titles, write_file

from llm_rlhf.interfaces import report
from llm_rlhf.interfaces.report import ppo_curves, write_report
from llm_rlhf.interfaces.report.accuracy import (
    accuracy_logged,
    accuracy_points,
    plot_accuracy,
    plot_compare_accuracy,
    run_styles,
)
from llm_rlhf.interfaces.report.cards import accuracy_cards
from llm_rlhf.interfaces.report.figures import nth_color, plot_style
from llm_rlhf.interfaces.report.ppo_curves import plot_compare_ppo, plot_ppo

ACCURACY_EVAL = {
    "accuracy": 0.875,
    "accuracy_stderr": 0.125,
    "accuracy_greedy": 0.75,
    "accuracy_greedy_stderr": 0.25,
    "accuracy_baseline": 0.5,
    "accuracy_stderr_baseline": 0.189,
    "accuracy_greedy_baseline": 0.5,
    "accuracy_greedy_stderr_baseline": 0.289,
    "accuracy_fn": "llm_rlhf.tasks.arithmetic:reward",
    "gold_win_rate": None,
    "gold_win_rate_stderr": None,
    "rm_win_rate": None,
    "rm_win_rate_stderr": None,
    "reward_fn_win_rate": 0.6875,
    "reward_fn_win_rate_stderr": 0.12,
    "combined_win_rate": 0.6875,
    "combined_win_rate_stderr": 0.12,
    "gold_score_mean": None,
    "gold_score_stderr": None,
    "rm_score_mean": None,
    "rm_score_stderr": None,
    "reward_fn_mean": 0.875,
    "reward_fn_stderr": 0.125,
    "combined_score_mean": 0.875,
    "combined_score_stderr": 0.125,
    "kl_to_ref": 1.5,
    "kl_to_ref_stderr": 0.2,
    "kl_to_ref_at_temperature": 1.5,
    "kl_to_ref_at_temperature_stderr": 0.2,
    "fluency_perplexity": None,
    "response_length_mean": 6.0,
    "eos_rate": 1.0,
    "distinct_1": 0.2,
    "distinct_2": 0.4,
    "char_run_rate": 0.0,
    "repeated_ngram_rate": 0.0,
    "empty_rate": 0.0,
    "gold_score_mean_baseline": None,
    "gold_score_stderr_baseline": None,
    "rm_score_mean_baseline": None,
    "rm_score_stderr_baseline": None,
    "reward_fn_mean_baseline": 0.5,
    "reward_fn_stderr_baseline": 0.189,
    "combined_score_mean_baseline": 0.5,
    "combined_score_stderr_baseline": 0.189,
    "kl_to_ref_baseline": 0.0,
    "kl_to_ref_stderr_baseline": 0.0,
    "kl_to_ref_at_temperature_baseline": 0.0,
    "kl_to_ref_at_temperature_stderr_baseline": 0.0,
    "fluency_perplexity_baseline": None,
    "response_length_mean_baseline": 14.0,
    "eos_rate_baseline": 1.0,
    "distinct_1_baseline": 0.3,
    "distinct_2_baseline": 0.6,
    "char_run_rate_baseline": 0.0,
    "repeated_ngram_rate_baseline": 0.0,
    "empty_rate_baseline": 0.0,
    "num_prompts": 4,
    "samples_per_prompt": 2,
    "num_pairs": 8,
    "policy_path": "runs/arith/ppo",
    "baseline_path": "data/smollm2-135m-instruct",
    "reward_model_path": "none",
    "reward_fn": "llm_rlhf.tasks.arithmetic:reward",
    "reward_fn_weight": 1.0,
    "gold_judge": "none",
    "gold_judge_heldout_accuracy": None,
    "gold_judge_validity": None,
    "temperature": 1.0,
    "seed": 0,
    "time_s": 30.0,
}


def accuracy_log(steps: int = 12, every: int = 4, lift: float = 0.04) -> list[dict]:
    """ppo/eval_log.jsonl of an arithmetic run: accuracy rises by `lift` a step from 0.2 (greedy 0.4), KL
    0.1 a step; no gold judge, no reward model."""
    return [
        {
            "step": s,
            "kl": 0.1 * s,
            "kl_stderr": 0.01,
            "gold_score": None,
            "rm_score": None,
            "reward_fn": 0.2 + lift * s,
            "accuracy": 0.2 + lift * s,
            "accuracy_stderr": 0.05,
            "accuracy_greedy": min(1.0, 0.4 + lift * s),
            "accuracy_greedy_stderr": 0.07,
            "char_run_rate": 0.0,
            "repeated_ngram_rate": 0.0,
            "empty_rate": 0.0,
        }
        for s in range(0, steps + 1, every)
    ]


def make_accuracy_run(
    run: Path, *, estimator: str = "gae", k: int = 1, steps: int = 12, lift: float = 0.04, seed: int = 0
) -> Path:
    """Every file a finished `stages: [ppo, eval]` run of the arithmetic task writes, with small fake logs."""
    history = [
        {
            "step": s,
            "objective/scores": 0.2 + 0.03 * s,
            "objective/kl": 0.1 * s,
            "objective/kl_coef": 0.05,
            "objective/rlhf_reward": 0.2 + 0.03 * s - 0.005 * s,
            "objective/entropy": 8.0 - 0.3 * s,
            "response_length": 14.0 - 0.5 * s,
            "eos_rate": 1.0,
            "time/generate": 2.0,
            "time/score": 0.1,
            "time/train": 3.0,
            "time/step": 5.2,
            "tokens_per_s": 40.0,
            "policy/approxkl": 0.01,
            "policy/clipfrac": 0.05,
            "loss/policy": -0.01,
            "policy/entropy": 0.6,
            "policy/ratio": 1.0,
        }
        for s in range(1, steps + 1)
    ]
    if estimator == "gae":
        history = [{**row, "loss/value": 0.1, "val/explained_variance": 0.3} for row in history]
    ppo_metrics = {
        **history[-1],
        "scores_first": 0.23,
        "scores_last": history[-1]["objective/scores"],
        "kl_last": 0.1 * steps,
    }
    write_file(
        run / "pipeline.json",
        json.dumps(
            {
                "ppo": {"wall_time_s": 600.0, "metrics": ppo_metrics},
                "eval": {"wall_time_s": 30.0, "metrics": ACCURACY_EVAL},
            }
        ),
    )
    write_file(run / "pipeline_config.yaml", f"output_dir: {run}\nstages: [ppo, eval]\n")
    write_file(run / "ppo" / "metrics.json", json.dumps(ppo_metrics))
    write_file(run / "eval" / "metrics.json", json.dumps(ACCURACY_EVAL))
    write_file(
        run / "ppo" / "config.yaml",
        (
            f"output_dir: {run / 'ppo'}\nmodel_name_or_path: data/smollm2-135m-instruct\nreward_model_path: none\n"
            f"reward_fn: llm_rlhf.tasks.arithmetic:reward\ngold_judge: none\neval_every: 4\nseed: {seed}\n"
            f"advantage_estimator: {estimator}\nsamples_per_prompt: {k}\n"
        ),
    )
    write_file(run / "eval" / "config.yaml", f"output_dir: {run / 'eval'}\ngold_judge: none\n")
    write_jsonl(run / "ppo" / "metrics.jsonl", history)
    write_jsonl(run / "ppo" / "eval_log.jsonl", accuracy_log(steps, 4, lift))
    write_jsonl(
        run / "ppo" / "samples.jsonl",
        [
            {"step": s, "query": f"What is {s} + 1?", "response": f" {s + 1}", "score": 1.0}
            for s in (1, steps)
        ],
    )
    samples = []
    for i in range(4):  # 4 prompts x 2 samples; the greedy responses on each prompt's first sample alone
        for j in range(2):
            first = j == 0
            policy, baseline = i + 3 + ((i, j) == (3, 1)), i + 4 - j  # the policy's last sample wrong, every
            greedy = i + 3 + i % 2  # baseline's sample 1 right; the baseline's greedy right on even i, the
            policy_greedy = i + 3 + (i == 3)  # policy's on all but the last prompt
            samples.append(
                {
                    "prompt": f"What is {i} + 3? Answer with just the number.",
                    "sample": j,
                    "policy_response": f" {policy}",
                    "baseline_response": f" The answer is {baseline}.",
                    "policy_correct": float(policy == i + 3),
                    "baseline_correct": float(baseline == i + 3),
                    "policy_greedy_response": f" {policy_greedy}" if first else None,
                    "policy_greedy_correct": float(policy_greedy == i + 3) if first else None,
                    "baseline_greedy_response": f" It is {greedy}." if first else None,
                    "baseline_greedy_correct": float(greedy == i + 3) if first else None,
                    "policy_reward_fn": float(policy == i + 3),
                    "baseline_reward_fn": float(baseline == i + 3),
                    "policy_gold_score": None,
                    "baseline_gold_score": None,
                    "policy_rm_score": None,
                    "baseline_rm_score": None,
                    "policy_combined_score": float(policy == i + 3),
                    "baseline_combined_score": float(baseline == i + 3),
                    "policy_length": 2,
                    "baseline_length": 6,
                    "policy_eos": True,
                    "baseline_eos": True,
                }
            )
    write_jsonl(run / "eval" / "samples.jsonl", samples)
    return run


def test_the_reward_panels_name_a_reward_functions_score_as_such(tmp_path, monkeypatch):
    """A run scored by a reward function (reward_model_path: none) titles its reward panel and the side-by-side
    score panel as a score, not an RM's; an RM run, and a mix of the two side by side, keep "RM score"."""
    rm_run = report.load_run(make_run(tmp_path / "rm"))
    fn_run = report.load_run(make_accuracy_run(tmp_path / "fn"))
    with plot_style():
        assert visible_titles(plot_ppo(rm_run.ppo_history, 6.0))[0] == "RM score and RLHF reward"
        fig = plot_ppo(fn_run.ppo_history, None, reward_model=False)
        assert visible_titles(fig)[0] == "Score and RLHF reward"
        assert fig.axes[0].get_ylabel() == "reward (the reward function's units)"
        assert visible_titles(plot_compare_ppo([fn_run, fn_run]))[0] == "Score (reward function)"
        assert visible_titles(plot_compare_ppo([rm_run, fn_run]))[0] == "RM score"
    drawn = []  # the report draws each run's panels with its own scorer's words
    monkeypatch.setattr(ppo_curves, "plot_ppo", lambda *a, **kw: drawn.append(a[2]) or plot_ppo(*a, **kw))
    write_report(fn_run.path), write_report(rm_run.path)
    assert drawn == [False, True]


def _cells(row: str) -> list[str]:
    """The text of the <td> cells in a piece of a table row."""
    return [c.split(">", 1)[1].split("</td>")[0] for c in row.split("<td")[1:]]


def test_a_run_of_a_task_with_a_verifier_shows_held_out_accuracy(tmp_path):
    """A `stages: [ppo, eval]` run on the arithmetic verifier, no gold: accuracy cards (policy vs the starting
    model, ± stderr), the accuracy-vs-step and -vs-KL figure in place of the gold one, accuracy rows first in the
    evaluation table with the paired standard errors, and each sample marked correct or not."""
    run = make_accuracy_run(tmp_path / "arith")
    text = write_report(run).read_text(encoding="utf-8")
    # the PPO grid and the accuracy figure; no gold-vs-proxy figure (gold is null) and no degeneracy plot (all 0)
    assert text.count(IMG) == 2 and (run / "report" / "accuracy.png").read_bytes().startswith(PNG_MAGIC)
    assert (
        "Over-optimisation: gold and proxy reward" not in text
        and not (run / "report" / "overoptimisation.png").exists()
    )
    assert (
        "This run has no gold judge: held-out accuracy, checked by the verifier llm_rlhf.tasks.arithmetic:reward"
        in text
    )
    # no SFT, no RM stage: one grey line each, saying what took their place; their files are not "missing"
    assert 'class="missing"' not in text
    assert '<p class="note">The sft stage is not part of this run' in text
    assert "PPO started from data/smollm2-135m-instruct, also its reference." in text
    assert "PPO&#x27;s score is the reward function llm_rlhf.tasks.arithmetic:reward alone." in text
    # the cards: accuracy in the gold's place, no SFT or RM card, PPO's score named for what it is
    cards = between(text, '<div class="cards">', "<nav>")
    assert (
        '<div class="label">Held-out accuracy, sampled</div><div class="value">87.5% ± 12.5%</div><div class="sub">policy; starting model 50.0% ± 18.9%</div>'
        in cards
    )
    assert (
        '<div class="label">Held-out accuracy, greedy</div><div class="value">75.0% ± 25.0%</div><div class="sub">policy; starting model 50.0% ± 28.9%</div>'
        in cards
    )
    for absent in ("Gold win rate", "SFT EOS rate", "RM eval accuracy", "PPO RM score"):
        assert absent not in cards, absent
    assert '<div class="label">PPO score</div>' in cards
    # the evaluation table: the accuracy group first; the stderr of the difference paired over the samples, the
    # greedy one over each prompt's first sample alone (the others hold no greedy response)
    assert '<h2 id="eval">4. Evaluation: policy vs starting model</h2>' in text
    table = between(text, '<table class="eval">')
    keys = [k.split("</span>")[0] for k in table.split('<span class="key">')[1:]]
    assert keys[:2] == ["accuracy", "accuracy_greedy"] and "gold_score_mean" not in keys
    samples = [json.loads(line) for line in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    sampled = [s["policy_correct"] - s["baseline_correct"] for s in samples]
    greedy = [s["policy_greedy_correct"] - s["baseline_greedy_correct"] for s in samples if s["sample"] == 0]
    assert len(greedy) == 4
    for key, diffs, row in (
        ("accuracy", sampled, ["0.875", "0.5", "+0.375"]),
        ("accuracy_greedy", greedy, ["0.75", "0.5", "+0.25"]),
    ):
        cells = _cells(between(table, f'<span class="key">{key}</span>', "</tr>"))  # after the label
        assert cells[:4] == [*row, f"{np.std(diffs, ddof=1) / np.sqrt(len(diffs)):.2g}"], key
    assert "accuracy checked by llm_rlhf.tasks.arithmetic:reward" in text
    # the samples: every checked response tagged, the greedy responses on the prompts' first rows
    pairs = between(text, '<table class="texts pairs">')
    assert "<th>Starting model</th><th>PPO policy</th>" in pairs
    verdicts = [
        s[f"{who}_{kind}correct"]
        for s in samples
        for who in ("policy", "baseline")
        for kind in ("", "greedy_")
    ]
    assert (
        pairs.count("✓ correct") == verdicts.count(1.0) == 16
        and pairs.count("✗ incorrect") == verdicts.count(0.0) == 8
    )
    assert pairs.count('<span class="greedy">') == 8
    # the hacking watch points at the accuracy, not at "no other held-out metric"
    assert "the held-out accuracy (sections 3 and 4) is what to hold the proxy against" in text


def curves(ax) -> dict:
    """The labelled data lines of an axes: plotted lines, and the data line of each error-bar plot (whose
    label is on its container)."""
    lines = {line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")}
    return {**lines, **{c.get_label(): c.lines[0] for c in ax.containers}}


def test_the_accuracy_figure_draws_the_logged_values(tmp_path):
    """Sampled and greedy accuracy against step (± stderr shaded) and against KL (in step order, error bars)."""
    rows = accuracy_log(12, 4)
    shuffled = [
        rows[2],
        rows[0],
        {"step": 6, "kl": 0.5},
        rows[3],
        rows[1],
    ]  # out of order, one without accuracy
    shuffled[0] = {k: v for k, v in shuffled[0].items() if k != "accuracy_stderr"}  # step 8: no stderr
    step, kl, accuracy, stderr = accuracy_points(shuffled, "accuracy", "kl")
    assert list(step) == [0, 4, 8, 12] and list(kl) == pytest.approx([0.0, 0.4, 0.8, 1.2])
    assert (
        list(accuracy) == pytest.approx([0.2, 0.36, 0.52, 0.68]) and np.isnan(stderr[2]) and stderr[0] == 0.05
    )
    with plot_style():
        fig = plot_accuracy(rows)
    by_step, by_kl = fig.axes[:2]
    assert [by_step.get_title(), by_kl.get_title()] == [
        "Held-out accuracy against step",
        "Held-out accuracy against KL",
    ]
    lines = {line.get_label(): line for line in by_step.lines}
    np.testing.assert_allclose(lines["sampled"].get_xdata(), [0, 4, 8, 12])
    np.testing.assert_allclose(lines["sampled"].get_ydata(), [r["accuracy"] for r in rows])
    np.testing.assert_allclose(lines["greedy"].get_ydata(), [r["accuracy_greedy"] for r in rows])
    band = by_step.collections[0].get_paths()[0].vertices[:, 1]  # the sampled curve's ± stderr band
    assert band.min() == pytest.approx(0.2 - 0.05) and band.max() == pytest.approx(0.68 + 0.05)
    kl_lines = curves(by_kl)
    np.testing.assert_allclose(kl_lines["sampled"].get_xdata(), [r["kl"] for r in rows])
    np.testing.assert_allclose(kl_lines["greedy"].get_ydata(), [r["accuracy_greedy"] for r in rows])
    assert by_step.get_ylim() == (-0.02, 1.02) == by_kl.get_ylim()  # one scale for every accuracy panel


def test_accuracy_cards_fall_back_to_ppo_held_out_evaluations(tmp_path):
    """Without accuracy in eval/metrics.json (no eval stage, or an eval without a verifier), the cards show
    PPO's first and last held-out evaluation; a run without accuracy anywhere has no accuracy card or panel."""
    run = make_accuracy_run(tmp_path / "arith")
    metrics = {k: v for k, v in ACCURACY_EVAL.items() if not k.startswith("accuracy")}
    (run / "eval" / "metrics.json").write_text(json.dumps(metrics))
    (run / "pipeline.json").unlink()
    cards = accuracy_cards(report.load_run(run))
    assert len(cards) == 2 and "20.0% → 68.0%" in cards[0] and "step 0 → 12; ± 5.0% last" in cards[0]
    assert "40.0% → 88.0%" in cards[1]
    plain = report.load_run(make_run(tmp_path / "reviews"))
    assert accuracy_cards(plain) == [] and not accuracy_logged(plain.eval_log)
    text = write_report(plain.path).read_text(encoding="utf-8")
    assert "accuracy" not in between(text, '<table class="eval">') and "Held-out accuracy" not in text
    assert not (plain.path / "report" / "accuracy.png").exists()


def test_run_styles_colour_estimators_when_seeds_repeat_them(tmp_path):
    def runs(*estimators):
        out = []
        for i, e in enumerate(estimators):
            run = report.Run(path=tmp_path / str(i), name=str(i))
            run.configs["ppo/config.yaml"] = f"advantage_estimator: {e}\n"
            out.append(run)
        return out

    with plot_style():
        distinct = run_styles(runs("gae", "grpo", "rloo"))
        seeds = run_styles(runs("gae", "gae", "grpo", "grpo", "gae"))
        one = run_styles(runs("gae", "gae"))
    assert [c for c, _ in distinct] == [nth_color(i) for i in range(3)] and {ls for _, ls in distinct} == {
        "-"
    }
    assert seeds == [
        (nth_color(0), "-"),
        (nth_color(0), "--"),
        (nth_color(1), "-"),
        (nth_color(1), "--"),
        (nth_color(0), ":"),
    ]
    assert one == [
        (nth_color(0), "-"),
        (nth_color(1), "-"),
    ]  # a sweep of one estimator: a colour per run


def test_run_styles_colour_a_sweeps_variants_that_share_an_estimator(tmp_path):
    """GSPO and CISPO are both `grpo` runs: named "gspo-seed0", ... they get a colour per variant, not one."""
    runs = []
    for name in ("gspo-seed0", "gspo-seed1", "cispo-seed0", "cispo-seed1", "gae-seed0"):
        run = report.Run(path=tmp_path / name, name=name)
        run.configs["ppo/config.yaml"] = (
            f"advantage_estimator: {'gae' if name.startswith('gae') else 'grpo'}\n"
        )
        runs.append(run)
    with plot_style():
        styles = run_styles(runs)
    assert styles == [
        (nth_color(0), "-"),
        (nth_color(0), "--"),
        (nth_color(1), "-"),
        (nth_color(1), "--"),
        (nth_color(2), "-"),
    ]


@pytest.mark.slow
def test_a_sweep_of_estimators_and_seeds_draws_every_accuracy_curve(tmp_path):
    """Two estimators x two seeds: one curve per run (no average), a colour per estimator; accuracy ± stderr in
    the headline table; no empty gold-vs-KL section and no all-empty columns (no gold, no RM)."""
    sweep = tmp_path / "sweep"
    lifts = {"gae-s0": 0.02, "gae-s1": 0.025, "grpo-s0": 0.04, "grpo-s1": 0.045}
    for name, lift in lifts.items():
        estimator = name.split("-")[0]
        make_accuracy_run(sweep / name, estimator=estimator, k=1 if estimator == "gae" else 4, lift=lift)
    text = write_report(sweep).read_text(encoding="utf-8")
    assert "<h2>Held-out accuracy against step and KL</h2>" in text and "What the KL penalty buys" not in text
    assert (sweep / "report" / "compare_accuracy.png").read_bytes().startswith(PNG_MAGIC)
    assert "One colour per variant" in text and 'class="missing"' not in text
    headline = between(text, "<h2>Headline metrics</h2>")
    assert "<th>accuracy</th><th>accuracy_greedy</th>" in headline and headline.count("87.5% ± 12.5%") == 4
    assert "(vs the starting model)" in text and "SFT baseline" not in text  # stages [ppo, eval]: no SFT
    for empty in ("gold_win_rate", "rm_win_rate", "sentiment_win_rate", "fluency_perplexity"):
        assert f"<th>{empty}</th>" not in headline, empty
    runs = [report.load_run(sweep / name, name=name) for name in lifts]
    with plot_style():
        fig = plot_compare_accuracy(runs)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        f"Held-out accuracy, {kind}, against {x}" for kind in ("sampled", "greedy") for x in ("step", "KL")
    ]
    for ax in fig.axes:
        drawn = curves(ax)
        assert list(drawn) == list(lifts)  # every run, seeds included
        for name, lift in lifts.items():
            y = np.asarray(drawn[name].get_ydata())
            start = 0.2 if "sampled" in ax.get_title() else 0.4
            np.testing.assert_allclose(y, np.minimum(1.0, start + lift * np.array([0, 4, 8, 12])))
        assert drawn["gae-s0"].get_color() == drawn["gae-s1"].get_color() != drawn["grpo-s0"].get_color()
        assert drawn["gae-s0"].get_linestyle() != drawn["gae-s1"].get_linestyle()
