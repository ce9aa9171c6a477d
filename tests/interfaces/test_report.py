"""report.html from synthetic run folders: one run, several runs side by side, a run with files missing."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from llm_rlhf.interfaces import cli, report
from llm_rlhf.interfaces.report import find_runs, parse_jsonl, ppo_curves, write_report
from llm_rlhf.interfaces.report.accuracy import (
    accuracy_logged,
    accuracy_points,
    plot_accuracy,
    plot_compare_accuracy,
    run_styles,
)
from llm_rlhf.interfaces.report.cards import accuracy_cards
from llm_rlhf.interfaces.report.evaluation import EVAL_GROUPS, MEMBERS, eval_groups
from llm_rlhf.interfaces.report.figures import nth_color, plot_style
from llm_rlhf.interfaces.report.hacking_watch import WATCH_TOP
from llm_rlhf.interfaces.report.overoptimisation import eval_points
from llm_rlhf.interfaces.report.ppo_curves import (
    COMPARE_PANELS,
    PPO_PANELS,
    compare_panels,
    plot_compare_ppo,
    plot_ppo,
    ppo_panels,
)
from llm_rlhf.interfaces.report.runs import kl_target, run_estimator

IMG = "data:image/png;base64,"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _jsonl(path: Path, rows: list[dict]) -> None:
    _write(path, "".join(json.dumps(r) + "\n" for r in rows))


# eval/metrics.json of a run without a reward function or an ensemble (their keys null or absent), as
# `llm-rlhf eval` writes it
EVAL_METRICS = {
    "gold_win_rate": 0.62, "gold_win_rate_stderr": 0.031, "sentiment_win_rate": 0.7, "sentiment_win_rate_stderr": 0.03,
    "rm_win_rate": 0.8, "rm_win_rate_stderr": 0.025, "reward_fn_win_rate": None, "reward_fn_win_rate_stderr": None,
    "combined_win_rate": None, "combined_win_rate_stderr": None,
    "gold_score_mean": 0.3, "gold_score_stderr": 0.05, "sentiment_mean": 0.9, "sentiment_stderr": 0.06,
    "rm_score_mean": 1.1, "rm_score_stderr": 0.1, "reward_fn_mean": None, "reward_fn_stderr": None,
    "combined_score_mean": None, "combined_score_stderr": None, "kl_to_ref": 4.2, "kl_to_ref_stderr": 0.3,
    "kl_to_ref_at_temperature": 4.2, "kl_to_ref_at_temperature_stderr": 0.3, "fluency_perplexity": 61.0,
    "response_length_mean": 12.5, "eos_rate": 0.97, "distinct_1": 0.4, "distinct_2": 0.8,
    "char_run_rate": 0.125, "repeated_ngram_rate": 0.0625, "empty_rate": 0.0,
    "gold_score_mean_baseline": 0.1, "gold_score_stderr_baseline": 0.04, "sentiment_mean_baseline": 0.5,
    "sentiment_stderr_baseline": 0.05, "rm_score_mean_baseline": -0.1, "rm_score_stderr_baseline": 0.1,
    "reward_fn_mean_baseline": None, "reward_fn_stderr_baseline": None, "combined_score_mean_baseline": None,
    "combined_score_stderr_baseline": None, "kl_to_ref_baseline": 0.0, "kl_to_ref_stderr_baseline": 0.0,
    "kl_to_ref_at_temperature_baseline": 0.0, "kl_to_ref_at_temperature_stderr_baseline": 0.0,
    "fluency_perplexity_baseline": 55.0, "response_length_mean_baseline": 11.0, "eos_rate_baseline": 0.98,
    "distinct_1_baseline": 0.45, "distinct_2_baseline": 0.85, "char_run_rate_baseline": 0.0,
    "repeated_ngram_rate_baseline": 0.0, "empty_rate_baseline": 0.0,
    "num_prompts": 25, "samples_per_prompt": 1, "num_pairs": 25, "policy_path": "runs/x/ppo",
    "baseline_path": "runs/x/sft", "reward_model_path": "runs/x/rm", "reward_fn": None, "reward_fn_weight": 1.0,
    "gold_judge": "data/reviews/gold.json", "gold_judge_heldout_accuracy": 0.83,
    "gold_judge_validity": {
        "file": "data/reviews/gold_test.jsonl", "sentences": 1053, "gold_prefers_real_over_shuffled": 0.998,
        "gold_prefers_real_over_repeated": 0.935, "gold_prefers_real_over_salad": 0.928,
        "sentiment_prefers_real_over_shuffled": 0.504, "sentiment_prefers_real_over_repeated": 0.49,
        "sentiment_prefers_real_over_salad": 0.016, "fluency_nll_real_median": 4.52,
        "fluency_nll_shuffled_median": 7.88, "fluency_nll_repeated_median": 5.02, "fluency_nll_salad_median": 8.13,
        "pairs": 884, "gold_agrees_with_people": 0.838, "sentiment_agrees_with_people": 0.862,
    },
    "temperature": 1.0, "seed": 0, "time_s": 20.0,
}  # fmt: skip


VALUE_KEYS = ("loss/value", "val/clipfrac", "val/explained_variance", "val/mean")  # gae alone logs these


def make_run(run: Path, *, kl_coef: float = 0.1, steps: int = 12, estimator: str = "gae", k: int = 1) -> Path:
    """Every file a finished pipeline run writes, with small fake logs. A critic-free `estimator` logs no
    value statistics and its ppo/config.yaml names it (a gae run's config, as before the key existed, does not)."""
    sft_metrics = {"eval_loss": 2.1, "eval_perplexity": 8.17, "eos_rate": 0.97}
    rm_metrics = {"eval_accuracy": 0.71, "eval_margin": 0.9, "baseline_accuracy": 0.66, "score_mean": 0.1}
    history = []
    for step in range(1, steps + 1):
        kl = 0.5 * step / (1 + 10 * kl_coef)
        history.append(
            {
                "step": step, "episodes": 16 * step, "objective/scores": 0.1 * step,
                "objective/scores_std": 0.5, "objective/kl": kl, "objective/kl_coef": kl_coef,
                "objective/non_score_reward": -kl_coef * kl, "objective/rlhf_reward": 0.1 * step - kl_coef * kl,
                "objective/entropy": 20.0 - step, "val/explained_variance": 0.05 * step, "val/mean": 0.2,
                "response_length": 12.0 + step % 3, "eos_rate": 0.9, "time/generate": 1.0, "time/score": 0.2,
                "time/train": 2.0, "time/step": 3.4, "tokens_per_s": 60.0, "policy/approxkl": 0.01,
                "policy/clipfrac": 0.05, "loss/policy": -0.01, "loss/value": 0.3 / step, "val/clipfrac": 0.1,
                "policy/entropy": 2.5, "policy/ratio": 1.0, "lr": 1e-5,
            }
        )  # fmt: skip
    if estimator != "gae":
        history = [{k: v for k, v in row.items() if k not in VALUE_KEYS} for row in history]
    ppo_metrics = {**history[-1], "scores_first": 0.1, "scores_last": 0.1 * steps, "kl_last": history[-1]["objective/kl"], "kl_target": 6.0}  # fmt: skip
    eval_metrics = EVAL_METRICS
    _write(run / "pipeline.json", json.dumps({
        "sft": {"wall_time_s": 60.0, "metrics": sft_metrics}, "rm": {"wall_time_s": 30.0, "metrics": rm_metrics},
        "ppo": {"wall_time_s": 300.0, "metrics": ppo_metrics}, "eval": {"wall_time_s": 20.0, "metrics": eval_metrics},
    }))  # fmt: skip
    _write(
        run / "pipeline_config.yaml",
        f"output_dir: {run}\nstages: [sft, rm, ppo, eval]\nppo:\n  init_kl_coef: {kl_coef}\n",
    )
    for stage, metrics in (
        ("sft", sft_metrics),
        ("rm", rm_metrics),
        ("ppo", ppo_metrics),
        ("eval", eval_metrics),
    ):
        _write(run / stage / "metrics.json", json.dumps(metrics))
        _write(
            run / stage / "config.yaml", f"output_dir: {run / stage}\nseed: 0\nmarker_{stage}: yes-{stage}\n"
        )
    ppo_config = f"output_dir: {run / 'ppo'}\ninit_kl_coef: {kl_coef}\nkl_target: 6.0\n"
    if estimator != "gae":
        ppo_config += f"advantage_estimator: {estimator}\nsamples_per_prompt: {k}\n"
    _write(run / "ppo" / "config.yaml", ppo_config)
    sft_log = [{"loss": 3.0 - 0.1 * s, "step": s, "learning_rate": 1e-4} for s in range(1, 11)]
    sft_log += [
        {"eval_loss": 2.5, "step": 5},
        {"eval_loss": 2.1, "step": 10},
        {"train_loss": 2.5, "step": 10},
    ]
    _write(run / "sft" / "train_log.json", json.dumps(sft_log))
    rm_log = [
        {"loss": 0.7 - 0.02 * s, "accuracy": 0.5 + 0.02 * s, "margin": 0.1 * s, "step": s}
        for s in range(1, 11)
    ]
    rm_log += [{"eval_loss": 0.6, "eval_accuracy": 0.71, "eval_margin": 0.9, "step": 10}]
    _write(run / "rm" / "train_log.json", json.dumps(rm_log))
    _jsonl(run / "ppo" / "metrics.jsonl", history)
    _jsonl(run / "ppo" / "samples.jsonl", [
        {"step": s, "query": f"The film q{s}{i}", "response": f" resp{s}{i}", "score": 0.1 * s} for s in (1, steps) for i in range(2)
    ])  # fmt: skip
    _jsonl(run / "ppo" / "eval_log.jsonl", [
        {"step": s, "kl": 0.5 * s, "rm_score": 0.2 * s, "gold_score": 0.1 * s - 0.01 * s * s} for s in range(0, steps + 1, 3)
    ])  # fmt: skip
    _jsonl(run / "eval" / "samples.jsonl", [
        {"prompt": f"Prompt number {i}", "sample": 0, "policy_response": f" great movie {i}", "baseline_response": f" bad {i}",
         "policy_gold_score": 0.9 - 0.01 * i, "baseline_gold_score": 0.2, "policy_rm_score": 1.5 + 0.02 * i,
         "baseline_rm_score": -0.3 + 0.01 * i, "policy_reward_fn": None, "baseline_reward_fn": None,
         "policy_combined_score": None, "baseline_combined_score": None, "policy_length": 4, "baseline_length": 3,
         "policy_eos": True, "baseline_eos": i % 2 == 0}
        for i in range(25)
    ])  # fmt: skip
    return run


def test_single_run_report_is_self_contained(tmp_path):
    run = make_run(tmp_path / "run")
    html_path = write_report(run)
    assert html_path == run / "report.html"
    text = html_path.read_text(encoding="utf-8")
    # sft loss, rm, ppo grid, over-optimisation curve: each embedded and written as a PNG
    assert text.count(IMG) == 4
    for name in ("sft_loss", "rm", "ppo", "overoptimisation"):
        assert (run / "report" / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert (
        'src="http' not in text and 'href="http' not in text and "<script" not in text and "<link" not in text
    )
    # before/after samples: the first 20 of 25 rows, the baseline's and the policy's response side by side
    assert "Prompt number 0" in text and "Prompt number 19" in text and "Prompt number 20" not in text
    assert "<th>SFT baseline</th><th>PPO policy</th>" in text and "<th>policy_gold_score</th>" not in text
    assert "gold +0.90 · RM +1.50 · 4 tokens" in text and "3 tokens, no EOS" in text  # sample 0's scores
    # PPO samples of the first and the last logged step
    assert "The film q10" in text and "The film q121" in text
    # resolved configs, headline numbers, the missing-file note absent
    assert "marker_sft: yes-sft" in text and "kl_target: 6.0" in text and "pipeline_config.yaml" in text
    assert "62.0%" in text and "71.0%" in text and "97.0%" in text  # gold win rate, RM accuracy, SFT EOS rate
    assert "RM eval accuracy" in text  # no test_file in this run: the card says which pairs it scored
    assert 'class="missing"' not in text


VALUE_PANELS = ["Value loss", "Explained variance of returns"]
EPISODE_PANELS = ["Episodes: turns, tool-call rate (right)", "Environment reward"]  # runs with an environment


def visible_titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title()]


def test_a_critic_free_run_has_no_value_panels_and_names_its_estimator(tmp_path):
    """A grpo run logs no value statistics: its PPO figure leaves the value panels out (no empty "no data"
    panels), the caption says which, and the card names the estimator; a gae run keeps every panel but the
    episodes' (no environment)."""
    gae = report.load_run(make_run(tmp_path / "gae"))
    grpo = report.load_run(make_run(tmp_path / "grpo", estimator="grpo", k=4))
    every = [panel[0] for panel in PPO_PANELS if panel[0] not in EPISODE_PANELS]
    assert [panel[0] for panel in ppo_panels(gae.ppo_history)] == every
    assert [panel[0] for panel in ppo_panels(grpo.ppo_history)] == [t for t in every if t not in VALUE_PANELS]
    with plot_style():
        assert visible_titles(plot_ppo(gae.ppo_history, 6.0)) == every
        assert visible_titles(plot_ppo(grpo.ppo_history, 6.0)) == [t for t in every if t not in VALUE_PANELS]
    assert run_estimator(gae) == "gae" and run_estimator(grpo) == "grpo, k = 4"
    text = write_report(grpo.path).read_text(encoding="utf-8")
    assert "Not drawn, nothing logged for them: Value loss, Explained variance of returns." in text
    assert 'Advantage estimator</div><div class="value">grpo</div>' in text and "4 samples / prompt" in text
    text = write_report(gae.path).read_text(encoding="utf-8")
    assert "Not drawn" not in text and 'Advantage estimator</div><div class="value">gae</div>' in text
    # side by side: the value panels stay while one run has a value function, and go when none has
    assert [p[1] for p in compare_panels([gae, grpo])] == [p[1] for p in COMPARE_PANELS]
    assert "Value loss" not in [p[1] for p in compare_panels([grpo, grpo])]


def test_overoptimisation_curve_of_a_run_without_a_reward_model(tmp_path):
    """A PPO run on a reward function alone logs rm_score null in its held-out evaluations: the gold is still
    drawn against KL (the rows were dropped, and the figure with them)."""
    run = make_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    _jsonl(run / "ppo" / "eval_log.jsonl", [{**r, "rm_score": None, "reward_fn": 0.3} for r in rows])
    step, kl, rm, gold = eval_points(
        [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    )
    assert list(kl) == [r["kl"] for r in rows] and list(gold) == [r["gold_score"] for r in rows]
    assert np.isnan(rm).all()
    text = write_report(run).read_text(encoding="utf-8")
    assert text.count(IMG) == 4
    assert (run / "report" / "overoptimisation.png").read_bytes().startswith(PNG_MAGIC)


def test_a_run_without_held_out_evaluation_says_how_to_get_the_curve(tmp_path):
    """A PPO run with eval_every: 0: the report says the curve was not asked for and how to ask for it, instead
    of flagging a missing file."""
    run = make_run(tmp_path / "run")
    (run / "ppo" / "eval_log.jsonl").unlink()
    text = write_report(run).read_text(encoding="utf-8")
    assert "eval_log.jsonl (no over-optimisation curve)" in text  # eval_every not in this config: missing
    config = run / "ppo" / "config.yaml"
    config.write_text(config.read_text() + "eval_every: 0\n")
    text = write_report(run).read_text(encoding="utf-8")
    assert "Held-out evaluation during PPO was off in this run" in text and "eval_every: 10" in text
    assert "eval_log.jsonl (no over-optimisation curve)" not in text
    assert (
        'class="missing"' not in text
    )  # nor in the warning box at the top: the run was not meant to have it


@pytest.mark.slow
def test_runs_side_by_side(tmp_path):
    sweep = tmp_path / "sweep"
    make_run(sweep / "kl_coef-0.02", kl_coef=0.02)
    make_run(sweep / "kl_coef-0.2", kl_coef=0.2, steps=40, estimator="rloo", k=2)  # > 30 points: smoothed
    assert [p.name for p in find_runs(sweep)] == ["kl_coef-0.02", "kl_coef-0.2"]
    # `llm-rlhf pipeline --sweep` also records the shared SFT and RM in the sweep folder's own pipeline.json:
    # still the variants are compared
    (sweep / "pipeline.json").write_text(json.dumps({"sft": {"wall_time_s": 1.0, "metrics": {}}}))
    assert [p.name for p in find_runs(sweep)] == ["kl_coef-0.02", "kl_coef-0.2"]
    assert find_runs(sweep / "kl_coef-0.2") == [sweep / "kl_coef-0.2"]
    text = write_report(sweep).read_text()
    assert text.count(IMG) == 2
    for name in ("kl_coef-0.02", "kl_coef-0.2"):
        assert f'href="{name}/report.html"' in text
        assert (sweep / name / "report.html").exists() and (sweep / name / "report" / "ppo.png").exists()
    for column in (
        "gold_win_rate",
        "rm_win_rate",
        "kl_to_ref",
        "gold_score_mean",
        "rm_score_mean",
        "objective/kl_coef",
    ):
        assert column in text
    headline = _between(text, "<h2>Headline metrics</h2>")
    assert (
        "<th>estimator</th>" in headline and "<td>gae</td>" in headline and "<td>rloo, k = 2</td>" in headline
    )
    # the config key the runs differ in; output_dir (the run's own folder) is not a difference
    assert "ppo.init_kl_coef" in text and "ppo.output_dir" not in text
    for name in ("compare_ppo", "compare_overoptimisation"):
        assert (sweep / "report" / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    # no verifier: no accuracy column or figure (the columns no run has a value for are left out)
    assert "accuracy" not in headline and not (sweep / "report" / "compare_accuracy.png").exists()
    assert 'src="http' not in text
    assert "final evaluation on held-out prompts (vs the SFT baseline). The ppo columns" in text


def test_missing_files_are_named_not_fatal(tmp_path):
    run = tmp_path / "partial"
    _write(run / "pipeline.json", json.dumps({"sft": {"wall_time_s": 1.0, "metrics": {"eos_rate": 0.5}}}))
    _write(run / "pipeline_config.yaml", "stages: [sft, rm, ppo]\n")
    text = write_report(run).read_text()
    assert IMG not in text
    assert "sft/train_log.json" in text and "ppo/metrics.jsonl" in text and "ppo/eval_log.jsonl" in text
    assert "eval stage is not part of this run" in text
    assert "50.0%" in text  # the SFT EOS rate from pipeline.json's copy of the stage metrics


def test_rm_without_eval_entries_plots_final_metrics(tmp_path):
    run = make_run(tmp_path / "run")
    rows = [r for r in json.loads((run / "rm" / "train_log.json").read_text()) if "eval_accuracy" not in r]
    _write(run / "rm" / "train_log.json", json.dumps(rows))
    (run / "sft" / "train_log.json").unlink()
    _jsonl(run / "sft" / "log.jsonl", [{"step": 1, "epoch": 0.1, "loss": 3.0}, {"step": 2, "loss": 2.0}])
    text = write_report(run).read_text()
    assert text.count(IMG) == 4  # SFT loss from log.jsonl, RM with the final eval as a marker


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_cli_errors(tmp_path, capsys, make):
    folder = tmp_path / "nothing"
    if make == "empty":
        folder.mkdir()
    assert cli.main(["report", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_cli_rebuilds_report_escaping_text_and_skipping_broken_lines(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    _jsonl(
        run / "eval" / "samples.jsonl", [{"prompt": "<script>alert(1)</script>", "policy_response": "a & b"}]
    )
    with open(run / "ppo" / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "objective/sco')  # the half-written last line of an interrupted run
    assert cli.main(["report", str(run)]) == 0
    assert str(run / "report.html") in capsys.readouterr().out
    text = (run / "report.html").read_text()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "a &amp; b" in text
    assert text.count(IMG) == 4
    assert len(parse_jsonl((run / "ppo" / "metrics.jsonl").read_text())) == 12


def test_smooth_matches_loop():
    import numpy as np

    from llm_rlhf.interfaces.report.numbers import smooth

    rng = np.random.default_rng(0)
    y = rng.normal(size=40)
    y[[3, 17, 18]] = np.nan
    for window in (1, 3, 7):
        h = window // 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of an all-NaN window is NaN
            naive = [np.nanmean(y[max(0, i - h) : i + h + 1]) for i in range(len(y))]
        np.testing.assert_allclose(smooth(y, window), naive)
    np.testing.assert_allclose(smooth(np.arange(50.0), 9)[4:-4], np.arange(50.0)[4:-4])  # no lag on a trend


def test_gold_note_says_whose_fluency_lm_the_gold_reads(tmp_path, monkeypatch):
    """The evaluation section names the gold's fluency LM and says when it is the run's own base model."""
    from llm_rlhf.interfaces.report import load_run
    from llm_rlhf.interfaces.report.evaluation import gold_note

    monkeypatch.chdir(tmp_path)  # config paths are relative to where the pipeline ran
    (tmp_path / "lm").mkdir()
    (tmp_path / "judges").mkdir()
    (tmp_path / "judges" / "gold.json").write_text(
        json.dumps({"fluency_model": "../lm", "fluency_model_hub_name": "org/lm"})
    )
    run = make_run(tmp_path / "run")
    (run / "eval" / "config.yaml").write_text("gold_judge: judges/gold.json\n")
    for base, own in (("lm", True), ("org/lm", True), ("other_model", False)):
        (run / "sft" / "config.yaml").write_text(f"model_name_or_path: {base}\n")
        note = gold_note(load_run(run))
        assert note is not None and "reads fluency with lm" in note
        assert ("the base model this run's SFT stage started from" in note) is own
        assert ("no stage of this run trained" in note) is not own
    assert "reads fluency with lm" in write_report(run).read_text(encoding="utf-8")
    (run / "eval" / "config.yaml").write_text("gold_judge: judges/missing.json\n")
    assert gold_note(load_run(run)) is None  # a sentiment-only or unreadable gold: no note


def test_rm_card_shows_the_test_pairs_when_the_stage_had_them(tmp_path):
    run = make_run(tmp_path / "run")
    metrics = json.loads((run / "rm" / "metrics.json").read_text())
    metrics.update(test_accuracy=0.834, baseline_test_accuracy=0.812)
    (run / "rm" / "metrics.json").write_text(json.dumps(metrics))
    text = write_report(run).read_text(encoding="utf-8")
    assert "RM test accuracy" in text and "83.4%" in text and "81.2%" in text
    assert "RM eval accuracy" not in text


def _between(text: str, start: str, end: str = "</table>") -> str:
    """The part of text from the first `start` to the `end` after it."""
    i = text.index(start)
    return text[i : text.index(end, i)]


def test_evaluation_table_is_grouped_and_leaves_out_what_was_not_measured(tmp_path):
    run = make_run(tmp_path / "run")
    text = write_report(run).read_text(encoding="utf-8")
    table = _between(text, '<table class="eval">')
    groups = [g.split("</th>")[0] for g in table.split('<tr class="group"><th colspan="7">')[1:]]
    assert [g.split(" (")[0] for g in groups] == [
        "Gold judge", "Sentiment", "Fluency", "Reward model, ensemble and reward function",
        "KL to the reference", "Length and EOS", "Diversity", "Degeneracy",
    ]  # fmt: skip
    keys = [k.split("</span>")[0] for k in table.split('<span class="key">')[1:]]
    assert keys == [
        "gold_score_mean", "sentiment_mean", "fluency_perplexity", "rm_score_mean", "kl_to_ref",
        "response_length_mean", "eos_rate", "distinct_1", "distinct_2", "char_run_rate", "repeated_ngram_rate",
        "empty_rate",
    ]  # fmt: skip
    # null in metrics.json (no reward function), absent (no ensemble), or the same figure (temperature 1): no row
    for unused in ("reward_fn", "combined", "rm_score_member", "rm_disagreement", "kl_to_ref_at_temperature"):
        assert unused not in table, unused
    # the gold row: policy, baseline, difference, the paired difference's stderr, the win rate and its stderr.
    # samples.jsonl: policy gold 0.9 - 0.01 i, baseline 0.2 -> differences 0.7 - 0.01 i, i = 0..24
    diffs = 0.7 - 0.01 * np.arange(25)
    stderr = np.std(diffs, ddof=1) / 5
    gold_row = _between(table, "gold score", "</tr>")
    assert [c.split(">")[1] for c in gold_row.split("<td")[1:]] == [
        "0.3</td", "0.1</td", "+0.2</td", f"{stderr:.2g}</td", "62.0%</td", "3.1%</td"
    ]  # fmt: skip
    (rows,) = [rows for title, rows in eval_groups(EVAL_METRICS, None) if title.startswith("Gold")]
    assert (
        rows[0]["diff_stderr"] == pytest.approx(np.hypot(0.05, 0.04)) and not rows[0]["paired"]
    )  # no samples
    # the gold's validity figures: a small table of their own; the raw metrics.json collapsed
    validity = _between(text, '<table class="validity">')
    assert "99.8%" in validity and "50.4%" in validity and "884 pairs" in validity and "83.8%" in validity
    assert "gold_judge_validity" not in table and "<summary>eval/metrics.json (raw)</summary>" in text
    # an ensemble with a reward function: each member, the disagreement and the function's rows in their group
    metrics = {**EVAL_METRICS, "rm_score_member_1_mean": 1.2, "rm_score_member_1_mean_baseline": 0.0,
               "rm_score_member_0_mean": 1.0, "rm_score_member_0_mean_baseline": 0.1, "rm_disagreement_mean": 0.3,
               "rm_disagreement_mean_baseline": 0.2, "reward_fn_mean": 0.7, "reward_fn_mean_baseline": 0.4,
               "reward_fn_win_rate": 0.66, "temperature": 0.7}  # fmt: skip
    groups = dict(eval_groups(metrics, None))
    rm_group = groups["Reward model, ensemble and reward function (the proxy PPO maximised)"]
    assert [r["key"] for r in rm_group] == [
        "rm_score_mean", "rm_score_member_0_mean", "rm_score_member_1_mean", "rm_disagreement_mean", "reward_fn_mean"
    ]  # fmt: skip
    assert rm_group[-1]["difference"] == pytest.approx(0.3) and rm_group[-1]["win"] == 0.66
    kl_group = groups["KL to the reference (nats / response)"]
    assert [r["key"] for r in kl_group] == ["kl_to_ref", "kl_to_ref_at_temperature"]  # sampled at 0.7: both


def test_hacking_watch_lists_the_samples_with_the_largest_proxy_gold_gap(tmp_path):
    """Held-out samples with known scores: at step 0 (the SFT model) proxy and gold are -1 or +1 (mean 0,
    std 1), so at step 10 the standardised gap is proxy - gold; the padded response has the largest."""
    run = make_run(tmp_path / "run")
    padded = " it is..................... splendid cinema."
    step0 = [{"step": 0, "prompt": f"Opening {i}", "response": f" fine {i}.", "proxy": (-1) ** i,
              "gold_score": (-1) ** (i // 2), "kl_to_ref": 0.0} for i in range(8)]  # fmt: skip
    step10 = [{"step": 10, "prompt": f"Opening {i}", "response": f" good {i}.", "proxy": 0.5 + 0.1 * i,
               "gold_score": 0.4, "kl_to_ref": 2.0} for i in range(8)]  # fmt: skip
    step10[3].update(response=padded, proxy=2.05, gold_score=-1.5)
    _jsonl(run / "ppo" / "eval_samples.jsonl", step0 + step10)
    _jsonl(run / "ppo" / "eval_log.jsonl", [
        {"step": 0, "kl": 0.0, "rm_score": 0.0, "gold_score": 0.0, "char_run_rate": 0.0, "repeated_ngram_rate": 0.0, "empty_rate": 0.0},
        {"step": 10, "kl": 2.0, "rm_score": 0.9, "gold_score": 0.1, "char_run_rate": 0.125, "repeated_ngram_rate": 0.0, "empty_rate": 0.0},
    ])  # fmt: skip
    text = write_report(run).read_text(encoding="utf-8")
    watch = _between(text, '<table class="texts watch">')
    sections = {
        s.split("</th>")[0].split(" · ")[0]: s for s in watch.split('<tr class="group"><th colspan="4">')[1:]
    }
    assert list(sections) == ["final evaluation", "PPO step 10", "PPO step 0"]  # newest first
    top = sections["PPO step 10"].split("<tr>")[1]  # its first sample row: the largest gap
    assert '<td class="num">+3.55</td><td class="num">+2.05</td><td class="num">-1.5</td>' in top
    assert padded in top and '<span class="flag">char run</span>' in top
    assert "standardised by the step-0 evaluation (the SFT model)" in sections["PPO step 10"]
    assert sections["PPO step 10"].count("<tr>") == WATCH_TOP
    # the final evaluation: the policy's RM score rises (1.5 + 0.02 i) as its gold falls (0.9 - 0.01 i)
    assert "Prompt number 24" in sections["final evaluation"].split("<tr>")[1]
    # the degeneracy counters: drawn against step and KL, and tabulated per evaluation (the SFT baseline's too)
    assert (run / "report" / "degeneracy.png").read_bytes().startswith(PNG_MAGIC)
    counters = _between(text, '<table class="counters">')
    assert [r.split("</td>")[0] for r in counters.split("<tr><td>")[1:]] == [
        "PPO step 0", "PPO step 10", "SFT baseline (final evaluation)", "final evaluation"
    ]  # fmt: skip
    assert "12.5%" in _between(counters, "PPO step 10", "</tr>")  # 1 of 8 responses with a character run
    # no response tripped a counter: a sentence instead of flat lines at 0
    rows = [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    _jsonl(run / "ppo" / "eval_log.jsonl", [{**r, "char_run_rate": 0.0} for r in rows])
    text = write_report(run).read_text(encoding="utf-8")
    assert "tripped a counter" in text and 'alt="Degenerate responses' not in text


def test_hacking_watch_without_a_gold_says_there_is_no_gap(tmp_path):
    run = make_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    _jsonl(
        run / "eval" / "samples.jsonl",
        [{**r, "policy_gold_score": None, "baseline_gold_score": None} for r in rows],
    )
    rows = [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    _jsonl(
        run / "ppo" / "eval_log.jsonl", [{**r, "gold_score": None} for r in rows]
    )  # PPO's gold_judge: none
    text = write_report(run).read_text(encoding="utf-8")
    assert "no proxy−gold gap to rank" in text and '<table class="texts watch">' not in text
    assert '<table class="counters">' in text
    assert (
        "have no gold score or no KL" in text and 'class="missing"' not in text
    )  # the log is there, not missing


def test_the_evaluation_table_reads_the_keys_eval_writes():
    """Every metric, baseline and standard-error key of the table's rows is one `measures.summarize_records` (or, for
    held-out accuracy, `measures.accuracy_figures`) writes (a renamed key would drop its row silently: rows
    without a value are left out)."""
    from llm_rlhf.evaluation import measures

    record = {"prompt": "p", "response": " fine.", "response_ids": [1, 2], "length": 3, "eos": True,
              "kl_to_ref": 0.1, "kl_to_ref_at_temperature": 0.1, "rm_score": 0.5, "rm_member_scores": [0.4, 0.6],
              "rm_disagreement": 0.1, "gold_score": 0.2, "sentiment": 0.3, "fluency_nll": 4.0,
              "fluency_perplexity": 54.6, "reward_fn": 1.0, "combined_score": 1.5}  # fmt: skip
    written = {**measures.summarize_records([record, record]), **measures.summarize_records([record, record], "_baseline")}
    verdicts = [{**record, "correct": 1.0}, {**record, "correct": 0.0}]  # issue 25: the verifier's figures
    for suffix in ("", "_baseline"):
        written.update(measures.accuracy_figures(verdicts, verdicts[:1], samples_per_prompt=2, suffix=suffix))
    for _, rows in EVAL_GROUPS:
        for row in rows:
            if row.key == MEMBERS:  # an ensemble of two: rm_score_member_0_mean, rm_score_member_1_mean
                assert {"rm_score_member_0_mean", "rm_score_member_1_mean_baseline"} <= written.keys()
                continue
            assert row.key in written and row.key + "_baseline" in written, row.key
            if row.stderr:
                assert row.stderr in written and row.stderr + "_baseline" in written, row.stderr


# A run of the arithmetic task (issue 25): PPO straight from the instruct model on the verifier's reward (no SFT,
# no RM stage, no gold judge); held-out accuracy in PPO's evaluations and in the final evaluation.
ACCURACY_EVAL = {
    "accuracy": 0.875, "accuracy_stderr": 0.125, "accuracy_greedy": 0.75, "accuracy_greedy_stderr": 0.25,
    "accuracy_baseline": 0.5, "accuracy_stderr_baseline": 0.189, "accuracy_greedy_baseline": 0.5,
    "accuracy_greedy_stderr_baseline": 0.289, "accuracy_fn": "llm_rlhf.tasks.arithmetic:reward",
    "gold_win_rate": None, "gold_win_rate_stderr": None, "rm_win_rate": None, "rm_win_rate_stderr": None,
    "reward_fn_win_rate": 0.6875, "reward_fn_win_rate_stderr": 0.12, "combined_win_rate": 0.6875,
    "combined_win_rate_stderr": 0.12, "gold_score_mean": None, "gold_score_stderr": None, "rm_score_mean": None,
    "rm_score_stderr": None, "reward_fn_mean": 0.875, "reward_fn_stderr": 0.125, "combined_score_mean": 0.875,
    "combined_score_stderr": 0.125, "kl_to_ref": 1.5, "kl_to_ref_stderr": 0.2, "kl_to_ref_at_temperature": 1.5,
    "kl_to_ref_at_temperature_stderr": 0.2, "fluency_perplexity": None, "response_length_mean": 6.0,
    "eos_rate": 1.0, "distinct_1": 0.2, "distinct_2": 0.4, "char_run_rate": 0.0, "repeated_ngram_rate": 0.0,
    "empty_rate": 0.0, "gold_score_mean_baseline": None, "gold_score_stderr_baseline": None,
    "rm_score_mean_baseline": None, "rm_score_stderr_baseline": None, "reward_fn_mean_baseline": 0.5,
    "reward_fn_stderr_baseline": 0.189, "combined_score_mean_baseline": 0.5, "combined_score_stderr_baseline": 0.189,
    "kl_to_ref_baseline": 0.0, "kl_to_ref_stderr_baseline": 0.0, "kl_to_ref_at_temperature_baseline": 0.0,
    "kl_to_ref_at_temperature_stderr_baseline": 0.0, "fluency_perplexity_baseline": None,
    "response_length_mean_baseline": 14.0, "eos_rate_baseline": 1.0, "distinct_1_baseline": 0.3,
    "distinct_2_baseline": 0.6, "char_run_rate_baseline": 0.0, "repeated_ngram_rate_baseline": 0.0,
    "empty_rate_baseline": 0.0, "num_prompts": 4, "samples_per_prompt": 2, "num_pairs": 8,
    "policy_path": "runs/arith/ppo", "baseline_path": "data/smollm2-135m-instruct", "reward_model_path": "none",
    "reward_fn": "llm_rlhf.tasks.arithmetic:reward", "reward_fn_weight": 1.0, "gold_judge": "none",
    "gold_judge_heldout_accuracy": None, "gold_judge_validity": None, "temperature": 1.0, "seed": 0, "time_s": 30.0,
}  # fmt: skip


def accuracy_log(steps: int = 12, every: int = 4, lift: float = 0.04) -> list[dict]:
    """ppo/eval_log.jsonl of an arithmetic run: accuracy rises by `lift` a step from 0.2 (greedy 0.4), KL
    0.1 a step; no gold judge, no reward model."""
    return [
        {"step": s, "kl": 0.1 * s, "kl_stderr": 0.01, "gold_score": None, "rm_score": None, "reward_fn": 0.2 + lift * s,
         "accuracy": 0.2 + lift * s, "accuracy_stderr": 0.05, "accuracy_greedy": min(1.0, 0.4 + lift * s),
         "accuracy_greedy_stderr": 0.07, "char_run_rate": 0.0, "repeated_ngram_rate": 0.0, "empty_rate": 0.0}
        for s in range(0, steps + 1, every)
    ]  # fmt: skip


def make_accuracy_run(
    run: Path, *, estimator: str = "gae", k: int = 1, steps: int = 12, lift: float = 0.04, seed: int = 0
) -> Path:
    """Every file a finished `stages: [ppo, eval]` run of the arithmetic task writes, with small fake logs."""
    history = [
        {"step": s, "objective/scores": 0.2 + 0.03 * s, "objective/kl": 0.1 * s, "objective/kl_coef": 0.05,
         "objective/rlhf_reward": 0.2 + 0.03 * s - 0.005 * s, "objective/entropy": 8.0 - 0.3 * s,
         "response_length": 14.0 - 0.5 * s, "eos_rate": 1.0, "time/generate": 2.0, "time/score": 0.1,
         "time/train": 3.0, "time/step": 5.2, "tokens_per_s": 40.0, "policy/approxkl": 0.01,
         "policy/clipfrac": 0.05, "loss/policy": -0.01, "policy/entropy": 0.6, "policy/ratio": 1.0}
        for s in range(1, steps + 1)
    ]  # fmt: skip
    if estimator == "gae":
        history = [{**row, "loss/value": 0.1, "val/explained_variance": 0.3} for row in history]
    ppo_metrics = {**history[-1], "scores_first": 0.23, "scores_last": history[-1]["objective/scores"], "kl_last": 0.1 * steps}  # fmt: skip
    _write(run / "pipeline.json", json.dumps({
        "ppo": {"wall_time_s": 600.0, "metrics": ppo_metrics}, "eval": {"wall_time_s": 30.0, "metrics": ACCURACY_EVAL},
    }))  # fmt: skip
    _write(run / "pipeline_config.yaml", f"output_dir: {run}\nstages: [ppo, eval]\n")
    _write(run / "ppo" / "metrics.json", json.dumps(ppo_metrics))
    _write(run / "eval" / "metrics.json", json.dumps(ACCURACY_EVAL))
    _write(run / "ppo" / "config.yaml", (
        f"output_dir: {run / 'ppo'}\nmodel_name_or_path: data/smollm2-135m-instruct\nreward_model_path: none\n"
        f"reward_fn: llm_rlhf.tasks.arithmetic:reward\ngold_judge: none\neval_every: 4\nseed: {seed}\n"
        f"advantage_estimator: {estimator}\nsamples_per_prompt: {k}\n"
    ))  # fmt: skip
    _write(run / "eval" / "config.yaml", f"output_dir: {run / 'eval'}\ngold_judge: none\n")
    _jsonl(run / "ppo" / "metrics.jsonl", history)
    _jsonl(run / "ppo" / "eval_log.jsonl", accuracy_log(steps, 4, lift))
    _jsonl(run / "ppo" / "samples.jsonl", [
        {"step": s, "query": f"What is {s} + 1?", "response": f" {s + 1}", "score": 1.0} for s in (1, steps)
    ])  # fmt: skip
    samples = []
    for i in range(4):  # 4 prompts x 2 samples; the greedy responses on each prompt's first sample alone
        for j in range(2):
            first = j == 0
            policy, baseline = i + 3 + ((i, j) == (3, 1)), i + 4 - j  # the policy's last sample wrong, every
            greedy = i + 3 + i % 2  # baseline's sample 1 right; the baseline's greedy right on even i, the
            policy_greedy = i + 3 + (i == 3)  # policy's on all but the last prompt
            samples.append({
                "prompt": f"What is {i} + 3? Answer with just the number.", "sample": j,
                "policy_response": f" {policy}", "baseline_response": f" The answer is {baseline}.",
                "policy_correct": float(policy == i + 3), "baseline_correct": float(baseline == i + 3),
                "policy_greedy_response": f" {policy_greedy}" if first else None,
                "policy_greedy_correct": float(policy_greedy == i + 3) if first else None,
                "baseline_greedy_response": f" It is {greedy}." if first else None,
                "baseline_greedy_correct": float(greedy == i + 3) if first else None,
                "policy_reward_fn": float(policy == i + 3), "baseline_reward_fn": float(baseline == i + 3),
                "policy_gold_score": None, "baseline_gold_score": None, "policy_rm_score": None,
                "baseline_rm_score": None, "policy_combined_score": float(policy == i + 3),
                "baseline_combined_score": float(baseline == i + 3), "policy_length": 2, "baseline_length": 6,
                "policy_eos": True, "baseline_eos": True,
            })  # fmt: skip
    _jsonl(run / "eval" / "samples.jsonl", samples)
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
    cards = _between(text, '<div class="cards">', "<nav>")
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
    table = _between(text, '<table class="eval">')
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
        cells = _cells(_between(table, f'<span class="key">{key}</span>', "</tr>"))  # after the label
        assert cells[:4] == [*row, f"{np.std(diffs, ddof=1) / np.sqrt(len(diffs)):.2g}"], key
    assert "accuracy checked by llm_rlhf.tasks.arithmetic:reward" in text
    # the samples: every checked response tagged, the greedy responses on the prompts' first rows
    pairs = _between(text, '<table class="texts pairs">')
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
    assert "accuracy" not in _between(text, '<table class="eval">') and "Held-out accuracy" not in text
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
    assert seeds == [(nth_color(0), "-"), (nth_color(0), "--"), (nth_color(1), "-"),
                     (nth_color(1), "--"), (nth_color(0), ":")]  # fmt: skip
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
    assert styles == [(nth_color(0), "-"), (nth_color(0), "--"), (nth_color(1), "-"),
                      (nth_color(1), "--"), (nth_color(2), "-")]  # fmt: skip


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
    headline = _between(text, "<h2>Headline metrics</h2>")
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


def test_a_fixed_beta_run_shows_no_kl_target(tmp_path):
    """With `kl_controller: fixed` nothing aims at kl_target (its default is still in the config): the KL card
    says "fixed β" and the KL panel draws no target line; an adaptive run keeps both."""
    adaptive = make_run(tmp_path / "adaptive")
    fixed = make_run(tmp_path / "fixed")
    config = fixed / "ppo" / "config.yaml"
    config.write_text(config.read_text() + "kl_controller: fixed\n")
    assert kl_target(report.load_run(adaptive)) == 6.0
    assert kl_target(report.load_run(fixed)) is None
    report.write_report(adaptive)
    report.write_report(fixed)
    adaptive_html, fixed_html = ((run / "report.html").read_text() for run in (adaptive, fixed))
    assert "target 6, β = 0.1" in adaptive_html and "the KL target dashed" in adaptive_html
    assert (
        "fixed β = 0.1" in fixed_html
        and "target 6" not in fixed_html
        and "KL target dashed" not in fixed_html
    )
