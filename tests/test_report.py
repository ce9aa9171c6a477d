"""report.html from synthetic run folders: one run, several runs side by side, a run with files missing."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from llm_rlhf import cli, report
from llm_rlhf.report import find_runs, parse_jsonl, write_report

IMG = "data:image/png;base64,"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _jsonl(path: Path, rows: list[dict]) -> None:
    _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def make_run(run: Path, *, kl_coef: float = 0.1, steps: int = 12) -> Path:
    """Every file a finished pipeline run writes, with small fake logs."""
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
    ppo_metrics = {**history[-1], "scores_first": 0.1, "scores_last": 0.1 * steps, "kl_last": history[-1]["objective/kl"], "kl_target": 6.0}  # fmt: skip
    eval_metrics = {"gold_win_rate": 0.62, "rm_win_rate": 0.8, "kl_to_ref": 4.2, "gold_score_mean": 0.3,
                    "rm_score_mean": 1.1, "baseline_gold_score_mean": 0.1, "distinct_1": 0.4}  # fmt: skip
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
    _write(
        run / "ppo" / "config.yaml", f"output_dir: {run / 'ppo'}\ninit_kl_coef: {kl_coef}\nkl_target: 6.0\n"
    )
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
        {"prompt": f"Prompt number {i}", "policy_response": f" great movie {i}", "baseline_response": f" bad {i}",
         "policy_gold": 0.9, "baseline_gold": 0.2, "policy_rm": 1.5, "baseline_rm": -0.3}
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
    # before/after samples: the first 20 of 25 rows, every key as a column
    assert "Prompt number 0" in text and "Prompt number 19" in text and "Prompt number 20" not in text
    assert "<th>policy_gold</th>" in text and "<th>baseline_rm</th>" in text
    # PPO samples of the first and the last logged step
    assert "The film q10" in text and "The film q121" in text
    # resolved configs, headline numbers, the missing-file note absent
    assert "marker_sft: yes-sft" in text and "kl_target: 6.0" in text and "pipeline_config.yaml" in text
    assert "62.0%" in text and "71.0%" in text and "97.0%" in text  # gold win rate, RM accuracy, SFT EOS rate
    assert "RM eval accuracy" in text  # no test_file in this run: the card says which pairs it scored
    assert 'class="missing"' not in text


def test_overoptimisation_curve_of_a_run_without_a_reward_model(tmp_path):
    """A PPO run on a reward function alone logs rm_score null in its held-out evaluations: the gold is still
    drawn against KL (the rows were dropped, and the figure with them)."""
    run = make_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    _jsonl(run / "ppo" / "eval_log.jsonl", [{**r, "rm_score": None, "reward_fn": 0.3} for r in rows])
    step, kl, rm, gold = report._eval_points(
        [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    )
    assert list(kl) == [r["kl"] for r in rows] and list(gold) == [r["gold_score"] for r in rows]
    assert np.isnan(rm).all()
    text = write_report(run).read_text(encoding="utf-8")
    assert text.count(IMG) == 4
    assert (run / "report" / "overoptimisation.png").read_bytes().startswith(PNG_MAGIC)


def test_a_run_without_held_out_evaluation_says_how_to_get_the_curve(tmp_path):
    """The default recipe runs PPO with eval_every: 0: the report says the curve was not asked for and how to
    ask for it, instead of flagging a missing file."""
    run = make_run(tmp_path / "run")
    (run / "ppo" / "eval_log.jsonl").unlink()
    text = write_report(run).read_text(encoding="utf-8")
    assert "eval_log.jsonl (no over-optimisation curve)" in text  # eval_every not in this config: missing
    config = run / "ppo" / "config.yaml"
    config.write_text(config.read_text() + "eval_every: 0\n")
    text = write_report(run).read_text(encoding="utf-8")
    assert "Held-out evaluation during PPO was off in this run" in text and "eval_every: 10" in text
    assert "eval_log.jsonl (no over-optimisation curve)" not in text


@pytest.mark.slow
def test_runs_side_by_side(tmp_path):
    sweep = tmp_path / "sweep"
    make_run(sweep / "kl_coef-0.02", kl_coef=0.02)
    make_run(sweep / "kl_coef-0.2", kl_coef=0.2, steps=40)  # > 30 points: smoothed curves
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
    # the config key the runs differ in; output_dir (the run's own folder) is not a difference
    assert "ppo.init_kl_coef" in text and "ppo.output_dir" not in text
    for name in ("compare_ppo", "compare_overoptimisation"):
        assert (sweep / "report" / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert 'src="http' not in text


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

    from llm_rlhf.report import smooth

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
    from llm_rlhf.report import gold_note, load_run

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
