"""report.html from synthetic run folders: one run, several runs side by side, a run with files missing."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from helpers import write_jsonl
from report_runs import EVAL_METRICS, IMG, PNG_MAGIC, between, make_run, visible_titles, write_file

from llm_rlhf.interfaces import cli, report
from llm_rlhf.interfaces.report import find_runs, parse_jsonl, write_report
from llm_rlhf.interfaces.report.evaluation import EVAL_GROUPS, MEMBERS, PASS_AT, eval_groups, expand
from llm_rlhf.interfaces.report.figures import plot_style
from llm_rlhf.interfaces.report.hacking_watch import WATCH_TOP
from llm_rlhf.interfaces.report.overoptimisation import eval_points
from llm_rlhf.interfaces.report.ppo_curves import (
    COMPARE_PANELS,
    PPO_PANELS,
    compare_panels,
    plot_ppo,
    ppo_panels,
)
from llm_rlhf.interfaces.report.runs import kl_target, run_estimator


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
DISTILL_PANEL = "Distillation: reverse KL to the teacher, teacher's share of the step (right)"


def test_a_critic_free_run_has_no_value_panels_and_names_its_estimator(tmp_path):
    """A grpo run logs no value statistics: its PPO figure leaves the value panels out (no empty "no data"
    panels), the caption says which, and the card names the estimator; a gae run keeps every panel but the
    episodes' (no environment)."""
    gae = report.load_run(make_run(tmp_path / "gae"))
    grpo = report.load_run(make_run(tmp_path / "grpo", estimator="grpo", k=4))
    every = [panel[0] for panel in PPO_PANELS if panel[0] not in [*EPISODE_PANELS, DISTILL_PANEL]]
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
    distilled = "Reverse KL to the teacher"
    assert [p[1] for p in compare_panels([gae, grpo])] == [p[1] for p in COMPARE_PANELS if p[1] != distilled]
    assert "Value loss" not in [p[1] for p in compare_panels([grpo, grpo])]


def test_a_distillation_run_draws_the_teachers_kl_and_share(tmp_path):
    """A run with a teacher logs objective/distill_kl, time/teacher and its share: its PPO figure has the
    distillation panel (the KL against step, the share on the right), its stacked time panel the teacher's
    seconds, and side by side the reverse KL gets a panel while one run distils."""
    from llm_rlhf.interfaces.report.ppo_curves import _time_panel

    grpo = report.load_run(make_run(tmp_path / "grpo", estimator="grpo", k=4))
    distilled = report.load_run(make_run(tmp_path / "distill", estimator="grpo", k=4, distill=True))
    titles = [panel[0] for panel in ppo_panels(distilled.ppo_history)]
    assert DISTILL_PANEL in titles and DISTILL_PANEL not in [p[0] for p in ppo_panels(grpo.ppo_history)]
    with plot_style():
        fig = plot_ppo(distilled.ppo_history, 6.0)
        assert DISTILL_PANEL in visible_titles(fig)
        ax = next(a for a in fig.axes if a.get_title() == DISTILL_PANEL)
        assert list(ax.lines[0].get_ydata()) == [0.5 / s for s in range(1, 13)]
        twin = next(a for a in fig.axes if a is not ax and a.bbox.bounds == ax.bbox.bounds)
        assert list(twin.lines[0].get_ydata()) == [0.4 / 3.4] * 12
        import matplotlib.pyplot as plt

        _, time_ax = plt.subplots()
        _time_panel(time_ax, distilled.ppo_history)
        assert "teacher" in [t.get_text() for t in time_ax.legend().get_texts()]
    assert "Reverse KL to the teacher" in [p[1] for p in compare_panels([grpo, distilled])]
    assert "Reverse KL to the teacher" not in [p[1] for p in compare_panels([grpo, grpo])]


def test_overoptimisation_curve_of_a_run_without_a_reward_model(tmp_path):
    """A PPO run on a reward function alone logs rm_score null in its held-out evaluations: the gold is still
    drawn against KL (the rows were dropped, and the figure with them)."""
    run = make_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    write_jsonl(run / "ppo" / "eval_log.jsonl", [{**r, "rm_score": None, "reward_fn": 0.3} for r in rows])
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
    headline = between(text, "<h2>Headline metrics</h2>")
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
    write_file(run / "pipeline.json", json.dumps({"sft": {"wall_time_s": 1.0, "metrics": {"eos_rate": 0.5}}}))
    write_file(run / "pipeline_config.yaml", "stages: [sft, rm, ppo]\n")
    text = write_report(run).read_text()
    assert IMG not in text
    assert "sft/train_log.json" in text and "ppo/metrics.jsonl" in text and "ppo/eval_log.jsonl" in text
    assert "eval stage is not part of this run" in text
    assert "50.0%" in text  # the SFT EOS rate from pipeline.json's copy of the stage metrics


def test_rm_without_eval_entries_plots_final_metrics(tmp_path):
    run = make_run(tmp_path / "run")
    rows = [r for r in json.loads((run / "rm" / "train_log.json").read_text()) if "eval_accuracy" not in r]
    write_file(run / "rm" / "train_log.json", json.dumps(rows))
    (run / "sft" / "train_log.json").unlink()
    write_jsonl(run / "sft" / "log.jsonl", [{"step": 1, "epoch": 0.1, "loss": 3.0}, {"step": 2, "loss": 2.0}])
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
    write_jsonl(
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


def test_evaluation_table_is_grouped_and_leaves_out_what_was_not_measured(tmp_path):
    run = make_run(tmp_path / "run")
    text = write_report(run).read_text(encoding="utf-8")
    table = between(text, '<table class="eval">')
    groups = [g.split("</th>")[0] for g in table.split('<tr class="group"><th colspan="7">')[1:]]
    assert [g.split(" (")[0] for g in groups] == [
        "Gold judge",
        "Sentiment",
        "Fluency",
        "Reward model, ensemble and reward function",
        "KL to the reference",
        "Length and EOS",
        "Diversity",
        "Degeneracy",
    ]
    keys = [k.split("</span>")[0] for k in table.split('<span class="key">')[1:]]
    assert keys == [
        "gold_score_mean",
        "sentiment_mean",
        "fluency_perplexity",
        "rm_score_mean",
        "kl_to_ref",
        "response_length_mean",
        "eos_rate",
        "distinct_1",
        "distinct_2",
        "char_run_rate",
        "repeated_ngram_rate",
        "empty_rate",
    ]
    # null in metrics.json (no reward function), absent (no ensemble), or the same figure (temperature 1): no row
    for unused in ("reward_fn", "combined", "rm_score_member", "rm_disagreement", "kl_to_ref_at_temperature"):
        assert unused not in table, unused
    # the gold row: policy, baseline, difference, the paired difference's stderr, the win rate and its stderr.
    # samples.jsonl: policy gold 0.9 - 0.01 i, baseline 0.2 -> differences 0.7 - 0.01 i, i = 0..24
    diffs = 0.7 - 0.01 * np.arange(25)
    stderr = np.std(diffs, ddof=1) / 5
    gold_row = between(table, "gold score", "</tr>")
    assert [c.split(">")[1] for c in gold_row.split("<td")[1:]] == [
        "0.3</td",
        "0.1</td",
        "+0.2</td",
        f"{stderr:.2g}</td",
        "62.0%</td",
        "3.1%</td",
    ]
    (rows,) = [rows for title, rows in eval_groups(EVAL_METRICS, None) if title.startswith("Gold")]
    assert (
        rows[0]["diff_stderr"] == pytest.approx(np.hypot(0.05, 0.04)) and not rows[0]["paired"]
    )  # no samples
    # the gold's validity figures: a small table of their own; the raw metrics.json collapsed
    validity = between(text, '<table class="validity">')
    assert "99.8%" in validity and "50.4%" in validity and "884 pairs" in validity and "83.8%" in validity
    assert "gold_judge_validity" not in table and "<summary>eval/metrics.json (raw)</summary>" in text
    # an ensemble with a reward function: each member, the disagreement and the function's rows in their group
    metrics = {
        **EVAL_METRICS,
        "rm_score_member_1_mean": 1.2,
        "rm_score_member_1_mean_baseline": 0.0,
        "rm_score_member_0_mean": 1.0,
        "rm_score_member_0_mean_baseline": 0.1,
        "rm_disagreement_mean": 0.3,
        "rm_disagreement_mean_baseline": 0.2,
        "reward_fn_mean": 0.7,
        "reward_fn_mean_baseline": 0.4,
        "reward_fn_win_rate": 0.66,
        "temperature": 0.7,
    }
    groups = dict(eval_groups(metrics, None))
    rm_group = groups["Reward model, ensemble and reward function (the proxy PPO maximised)"]
    assert [r["key"] for r in rm_group] == [
        "rm_score_mean",
        "rm_score_member_0_mean",
        "rm_score_member_1_mean",
        "rm_disagreement_mean",
        "reward_fn_mean",
    ]
    assert rm_group[-1]["difference"] == pytest.approx(0.3) and rm_group[-1]["win"] == 0.66
    kl_group = groups["KL to the reference (nats / response)"]
    assert [r["key"] for r in kl_group] == ["kl_to_ref", "kl_to_ref_at_temperature"]  # sampled at 0.7: both


def test_hacking_watch_lists_the_samples_with_the_largest_proxy_gold_gap(tmp_path):
    """Held-out samples with known scores: at step 0 (the SFT model) proxy and gold are -1 or +1 (mean 0,
    std 1), so at step 10 the standardised gap is proxy - gold; the padded response has the largest."""
    run = make_run(tmp_path / "run")
    padded = " it is..................... splendid cinema."
    step0 = [
        {
            "step": 0,
            "prompt": f"Opening {i}",
            "response": f" fine {i}.",
            "proxy": (-1) ** i,
            "gold_score": (-1) ** (i // 2),
            "kl_to_ref": 0.0,
        }
        for i in range(8)
    ]
    step10 = [
        {
            "step": 10,
            "prompt": f"Opening {i}",
            "response": f" good {i}.",
            "proxy": 0.5 + 0.1 * i,
            "gold_score": 0.4,
            "kl_to_ref": 2.0,
        }
        for i in range(8)
    ]
    step10[3].update(response=padded, proxy=2.05, gold_score=-1.5)
    write_jsonl(run / "ppo" / "eval_samples.jsonl", step0 + step10)
    write_jsonl(
        run / "ppo" / "eval_log.jsonl",
        [
            {
                "step": 0,
                "kl": 0.0,
                "rm_score": 0.0,
                "gold_score": 0.0,
                "char_run_rate": 0.0,
                "repeated_ngram_rate": 0.0,
                "empty_rate": 0.0,
            },
            {
                "step": 10,
                "kl": 2.0,
                "rm_score": 0.9,
                "gold_score": 0.1,
                "char_run_rate": 0.125,
                "repeated_ngram_rate": 0.0,
                "empty_rate": 0.0,
            },
        ],
    )
    text = write_report(run).read_text(encoding="utf-8")
    watch = between(text, '<table class="texts watch">')
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
    counters = between(text, '<table class="counters">')
    assert [r.split("</td>")[0] for r in counters.split("<tr><td>")[1:]] == [
        "PPO step 0",
        "PPO step 10",
        "SFT baseline (final evaluation)",
        "final evaluation",
    ]
    assert "12.5%" in between(counters, "PPO step 10", "</tr>")  # 1 of 8 responses with a character run
    # no response tripped a counter: a sentence instead of flat lines at 0
    rows = [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    write_jsonl(run / "ppo" / "eval_log.jsonl", [{**r, "char_run_rate": 0.0} for r in rows])
    text = write_report(run).read_text(encoding="utf-8")
    assert "tripped a counter" in text and 'alt="Degenerate responses' not in text


def test_hacking_watch_without_a_gold_says_there_is_no_gap(tmp_path):
    run = make_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    write_jsonl(
        run / "eval" / "samples.jsonl",
        [{**r, "policy_gold_score": None, "baseline_gold_score": None} for r in rows],
    )
    rows = [json.loads(line) for line in (run / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    write_jsonl(
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

    record = {
        "prompt": "p",
        "response": " fine.",
        "response_ids": [1, 2],
        "length": 3,
        "eos": True,
        "kl_to_ref": 0.1,
        "kl_to_ref_at_temperature": 0.1,
        "rm_score": 0.5,
        "rm_member_scores": [0.4, 0.6],
        "rm_disagreement": 0.1,
        "gold_score": 0.2,
        "sentiment": 0.3,
        "fluency_nll": 4.0,
        "fluency_perplexity": 54.6,
        "reward_fn": 1.0,
        "combined_score": 1.5,
    }
    written = {
        **measures.summarize_records([record, record]),
        **measures.summarize_records([record, record], "_baseline"),
    }
    verdicts = [{**record, "correct": 1.0}, {**record, "correct": 0.0}]  # a verifier's figures
    for suffix in ("", "_baseline"):
        written.update(
            measures.accuracy_figures(
                verdicts, verdicts[:1], samples_per_prompt=2, suffix=suffix, pass_at=[2]
            )
        )
    for _, rows in EVAL_GROUPS:
        for row in rows:
            if row.key == MEMBERS:  # an ensemble of two: rm_score_member_0_mean, rm_score_member_1_mean
                assert {"rm_score_member_0_mean", "rm_score_member_1_mean_baseline"} <= written.keys()
                continue
            if row.key == PASS_AT:  # a row per pass@k: pass_at_2, its stderr, each with the baseline's
                (expanded,) = expand(row, {**written, "samples_per_prompt": 2})
                assert {expanded.key, expanded.stderr} == {"pass_at_2", "pass_at_2_stderr"}
                assert {"pass_at_2_baseline", "pass_at_2_stderr_baseline"} <= written.keys()
                continue
            assert row.key in written and row.key + "_baseline" in written, row.key
            if row.stderr:
                assert row.stderr in written and row.stderr + "_baseline" in written, row.stderr


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
