"""The compare page's runs averaged over seeds (`llm_rlhf.interfaces.report.seeds`): the
math against hand-computed values, the grouping by config (not by folder name), the table and the figure."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from helpers import write_jsonl
from report_runs import PNG_MAGIC, between, write_file

from llm_rlhf.interfaces.report import load_run, write_report
from llm_rlhf.interfaces.report.figures import plot_style
from llm_rlhf.interfaces.report.page import Page
from llm_rlhf.interfaces.report.seeds import (
    COMMON_LABEL,
    group_evaluations,
    group_labels,
    mean_stderr_text,
    name_stem,
    plot_seed_groups,
    responses_sampled,
    section_seeds,
    seed_groups,
    seed_mean_stderr,
    shared_steps,
    wall_seconds,
)


@dataclasses.dataclass(frozen=True)
class Curves:
    """What a seed run logged: time/step `step_seconds`; held-out evaluations at `evaluated`, accuracy rising
    linearly from 0.2 at step 0 to `final` at step 8 (greedy 0.1 above it) and KL from 0 to `kl`;
    sampled_per_trained: dynamic sampling's ratio (logged on every step when given)."""

    final: float = 0.6
    kl: float = 1.0
    step_seconds: float = 2.0
    evaluated: tuple = (0, 4, 8)
    sampled_per_trained: float | None = None


def make_seed_run(
    run: Path, *, seed: int, estimator: str = "grpo", learning_rate: float = 2e-4, **curves
) -> Path:
    """A finished run of a task with a verifier, PPO from the run's own SFT model (a path under the run: the
    same in every seed once masked): 8 PPO steps of 32 responses each, its figures those of `Curves(**curves)`."""
    figures = Curves(**curves)
    final, kl, step_seconds = figures.final, figures.kl, figures.step_seconds
    evaluated, sampled_per_trained = figures.evaluated, figures.sampled_per_trained
    k = 4 if estimator != "gae" else 1
    history = [
        {
            "step": s,
            "episodes": 32 * s,
            "objective/scores": 0.1 * s,
            "objective/kl": 0.1 * s,
            "time/step": step_seconds,
            "time/generate": step_seconds / 2,
            "time/score": 0.0,
            "time/train": step_seconds / 2,
        }
        for s in range(1, 9)
    ]
    if sampled_per_trained is not None:
        history = [{**row, "sampling/sampled_per_trained": sampled_per_trained} for row in history]
    log = [
        {
            "step": s,
            "kl": kl * s / 8,
            "accuracy": 0.2 + (final - 0.2) * s / 8,
            "accuracy_stderr": 0.05,
            "accuracy_greedy": 0.3 + (final - 0.2) * s / 8,
            "accuracy_greedy_stderr": 0.05,
        }
        for s in evaluated
    ]
    write_file(run / "pipeline.json", json.dumps({"ppo": {"wall_time_s": 30.0, "metrics": history[-1]}}))
    write_file(run / "pipeline_config.yaml", f"output_dir: {run}\nstages: [ppo]\n")
    write_file(run / "ppo" / "metrics.json", json.dumps(history[-1]))
    write_file(
        run / "ppo" / "config.yaml",
        (
            f"model_name_or_path: {run / 'sft'}\nreward_model_path: none\noutput_dir: {run / 'ppo'}\n"
            f"advantage_estimator: {estimator}\nsamples_per_prompt: {k}\nseed: {seed}\nrollout_batch_size: {32 // k}\n"
            f"learning_rate: {learning_rate}\neval_every: 4\n"
        ),
    )
    write_jsonl(run / "ppo" / "metrics.jsonl", history)
    write_jsonl(run / "ppo" / "eval_log.jsonl", log)
    write_jsonl(
        run / "ppo" / "samples.jsonl", [{"step": 1, "query": "1 + 1 =", "response": " 2", "score": 1.0}]
    )
    return run


def test_mean_and_standard_error_over_seeds_by_hand():
    """(0.5, 0.6, 0.8): mean 19/30; sd^2 = ((-4/30)^2 + (-1/30)^2 + (5/30)^2) / 2 = 7/300, se = sqrt(7/300 / 3)
    = sqrt(7)/30; one seed has no spread (NaN); the same as the statistics module's n - 1 formula."""
    mean, se = seed_mean_stderr([[0.5, 1.0], [0.6, 1.0], [0.8, 1.0]])  # (S=3, N=2)
    assert mean == pytest.approx([19 / 30, 1.0]) and se == pytest.approx([math.sqrt(7) / 30, 0.0])
    values = [0.31, 0.47, 0.52, 0.38]
    _, se4 = seed_mean_stderr(np.array(values)[:, None])
    assert se4[0] == pytest.approx(statistics.stdev(values) / math.sqrt(4))
    one_mean, one_se = seed_mean_stderr([[0.5, 0.7]])
    assert list(one_mean) == [0.5, 0.7] and np.isnan(one_se).all()
    assert mean_stderr_text([0.5, 0.6, 0.8], ".1%") == "63.3% ± 8.8% [50.0%, 60.0%, 80.0%]"
    assert mean_stderr_text([16.0, 20.0, 24.0], ".0f", seeds=False) == "20 ± 2"  # se = 4 / sqrt(3)


def test_responses_sampled_seconds_and_shared_steps_by_hand():
    """Dynamic sampling's ratio multiplies the responses trained; seconds add up; steps shared by every seed."""
    sampled = responses_sampled(episodes=[32, 64, 96], sampled_per_trained=[1.5, 1.25, 1.0])
    assert list(sampled) == [48.0, 80.0, 96.0]
    assert list(wall_seconds(step_seconds=[2.0, 3.0, 4.0])) == [2.0, 5.0, 9.0]
    assert shared_steps([[0, 4, 8], [0, 4], [8, 4, 0]]) == [0, 4] and shared_steps([]) == []


def seed_folder(folder: Path) -> list:
    """Folder names that say nothing (r1 ... r7): grpo seeds 2, 0, 1; gae seeds 1, 0 (seed 1 evaluated up to
    step 4 only: still running); rloo seed 0 alone; grpo seed 0 with another learning rate."""
    make_seed_run(folder / "r1", seed=2, final=0.8, kl=1.7, step_seconds=3.0)
    make_seed_run(folder / "r2", seed=0, final=0.5, kl=1.0, step_seconds=2.0)
    make_seed_run(folder / "r3", seed=1, final=0.6, kl=1.2, step_seconds=2.5)
    make_seed_run(
        folder / "r4", seed=1, estimator="gae", final=0.4, evaluated=(0, 4), sampled_per_trained=1.5
    )
    make_seed_run(folder / "r5", seed=0, estimator="gae", final=0.6, sampled_per_trained=1.25)
    make_seed_run(folder / "r6", seed=0, estimator="rloo")
    make_seed_run(folder / "r7", seed=0, learning_rate=1e-4)
    return [load_run(folder / f"r{i}", name=f"r{i}") for i in range(1, 8)]


def test_runs_differing_only_by_seed_are_grouped_by_config(tmp_path):
    """Grouped by the PPO config with seed and output paths left out: the grpo seeds together (in seed order),
    the gae seeds together, rloo and the other learning rate alone; labelled by what differs."""
    runs = seed_folder(tmp_path)
    groups = seed_groups(runs)
    assert [[run.name for run in group] for group in groups] == [
        ["r2", "r3", "r1"],
        ["r5", "r4"],
        ["r6"],
        ["r7"],
    ]
    assert group_labels(groups[:2]) == [
        "advantage_estimator: grpo, samples_per_prompt: 4, rollout_batch_size: 8",
        "advantage_estimator: gae, samples_per_prompt: 1, rollout_batch_size: 32",
    ]
    assert group_labels([groups[0], groups[3]]) == ["learning_rate: 0.0002", "learning_rate: 0.0001"]
    assert group_labels(groups[:1]) == ["grpo, k = 4"]  # one group: its estimator
    # four groups: a key is left out where the group holds the value most groups share (grpo, k 4, 8 prompts,
    # lr 2e-4), so each variant is named by what it changed and the base by COMMON_LABEL
    assert group_labels(groups) == [
        COMMON_LABEL,
        "advantage_estimator: gae, samples_per_prompt: 1, rollout_batch_size: 32",
        "advantage_estimator: rloo",
        "learning_rate: 0.0001",
    ]


def test_a_sweeps_groups_are_named_by_their_variant_names(tmp_path):
    """Folders named as a sweep names them ("gae-seed0", ...): each group is its variant's name without the seed,
    not every key in which the configs differ; names that do not share a stem within a group (seed-0 and seed-1
    of one config; r1, r2 ...) fall back to the keys."""
    assert [name_stem(n) for n in ("gae-seed2", "lr1e-4_seed_0", "seed-1", "cispo.seed10", "r1")] == [
        "gae",
        "lr1e-4",
        "",
        "cispo",
        "r1",
    ]
    names = ("gae", "remax", "grpo", "rloo")  # the folder names of a sweep of the estimators
    runs = [
        load_run(
            make_seed_run(tmp_path / f"{name}-seed{seed}", seed=seed, estimator=name),
            name=f"{name}-seed{seed}",
        )
        for name in names
        for seed in (0, 1)
    ]
    groups = seed_groups(runs)
    assert group_labels(groups) == ["gae", "remax", "grpo", "rloo"]
    unnamed = [load_run(run.path, name=f"seed-{i % 2}") for i, run in enumerate(runs)]
    assert group_labels(seed_groups(unnamed)) == [
        "advantage_estimator: gae, samples_per_prompt: 1, rollout_batch_size: 32",
        "advantage_estimator: remax",
        "advantage_estimator: grpo",
        "advantage_estimator: rloo",
    ]


def test_group_evaluations_at_the_steps_every_seed_made(tmp_path):
    """The gae group's second seed evaluated up to step 4: its evaluations stop there; responses count dynamic
    sampling's discards (episodes x ratio), seconds add time/step."""
    runs = seed_folder(tmp_path)
    grpo, gae = seed_groups(runs)[:2]
    ev = group_evaluations(grpo, "accuracy")
    assert list(ev["step"]) == [0, 4, 8] and ev["accuracy"].shape == (3, 3)
    np.testing.assert_allclose(ev["accuracy"][:, -1], [0.5, 0.6, 0.8])  # seeds 0, 1, 2
    np.testing.assert_allclose(ev["kl"][:, -1], [1.0, 1.2, 1.7])
    np.testing.assert_allclose(ev["responses"], [[0, 128, 256]] * 3)
    np.testing.assert_allclose(ev["seconds"], [[0, 8, 16], [0, 10, 20], [0, 12, 24]])
    ev = group_evaluations(gae, "accuracy_greedy")
    assert list(ev["step"]) == [0, 4]
    np.testing.assert_allclose(ev["responses"][:, -1], [128 * 1.25, 128 * 1.5])  # seeds 0, 1
    np.testing.assert_allclose(ev["accuracy"][:, -1], [0.3 + 0.2, 0.3 + 0.1])


@pytest.mark.slow
def test_the_compare_page_has_the_seed_table_and_figure(tmp_path):
    """The written HTML: a row per averaged group with mean ± se and the seeds' values, the figure; the runs
    left alone named."""
    seed_folder(tmp_path / "sweep")
    text = write_report(tmp_path / "sweep").read_text(encoding="utf-8")
    section = between(text, "<h2>Over seeds: held-out accuracy, mean ± standard error</h2>")
    rows = section.split("<tr>")[2:]
    assert len(rows) == 2 and "advantage_estimator: grpo" in rows[0] and "advantage_estimator: gae" in rows[1]
    assert "<td>0, 1, 2</td>" in rows[0] and "<td>0, 1</td>" in rows[1]
    assert "63.3% ± 8.8% [50.0%, 60.0%, 80.0%]" in rows[0] and "73.3% ± 8.8% [60.0%, 70.0%, 90.0%]" in rows[0]
    kl_se = statistics.stdev([1.0, 1.2, 1.7]) / math.sqrt(3)
    assert f"1.3 ± {kl_se:.3g} [1, 1.2, 1.7]" in rows[0] and f"{kl_se:.3g}" == "0.208"
    assert ">256<" in rows[0] and "20 ± 2" in rows[0]  # equal responses: one number; seconds 16, 20, 24
    # gae at step 4 (its second seed's last evaluation): accuracy 0.4 and 0.3, responses 160 and 192 differ
    assert '<td class="num">8</td>' in rows[0] and '<td class="num">4</td>' in rows[1]
    assert "35.0% ± 5.0% [40.0%, 30.0%]" in rows[1] and "176 ± 16 [160, 192]" in rows[1]
    assert "Not averaged (no other seed of the same config): r6, r7." in text
    assert (tmp_path / "sweep" / "report" / "compare_seeds.png").read_bytes().startswith(PNG_MAGIC)
    assert 'alt="Each group&#x27;s held-out accuracy, the mean over its seeds' in text
    # the headline table of PPO-only runs: each run's last held-out evaluation (r4 stopped at step 4)
    rows = between(text, "<h2>Headline metrics</h2>").split("<tr>")[2:]
    headline = {row.split("</a>")[0].rsplit(">", 1)[-1]: row for row in rows}
    assert "accuracy, held-out during PPO" in text and "80.0% ± 5.0% (step 8)" in headline["r1"]
    assert "30.0% ± 5.0% (step 4)" in headline["r4"] and "90.0% ± 5.0% (step 8)" in headline["r1"]  # greedy


def test_the_seed_figure_draws_the_means(tmp_path):
    """A row per accuracy kind, against responses, KL and seconds; the line is the seeds' mean at the x's mean,
    the band ± se."""
    groups = seed_groups(seed_folder(tmp_path))[:2]
    kinds = [("accuracy", "sampled"), ("accuracy_greedy", "greedy")]
    with plot_style():
        fig = plot_seed_groups(groups, ["grpo", "gae"], kinds)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        f"Held-out accuracy, {kind}, against {x}"
        for kind in ("sampled", "greedy")
        for x in ("responses sampled", "KL", "wall seconds")
    ]
    by_responses, by_kl, by_seconds = fig.axes[:3]
    line = {ln.get_label(): ln for ln in by_responses.lines}["grpo (3 seeds)"]
    np.testing.assert_allclose(line.get_xdata(), [0, 128, 256])
    np.testing.assert_allclose(line.get_ydata(), [0.2, (0.35 + 0.4 + 0.5) / 3, 19 / 30])
    band = by_responses.collections[0].get_paths()[0].vertices[:, 1]
    assert band.max() == pytest.approx(19 / 30 + math.sqrt(7) / 30)
    kl_line = {c.get_label(): c.lines[0] for c in by_kl.containers}["grpo (3 seeds)"]
    np.testing.assert_allclose(kl_line.get_xdata(), [0, (0.5 + 0.6 + 0.85) / 3, 3.9 / 3])
    seconds = {ln.get_label(): ln for ln in by_seconds.lines}["gae (2 seeds)"]
    np.testing.assert_allclose(seconds.get_xdata(), [0, 8])  # gae: 2 s a step, to step 4


def test_a_folder_without_seeds_in_common_says_so(tmp_path):
    """Two estimators, one seed each: one line, no table, no figure; the same when the seeds of a config have no
    held-out accuracy."""
    runs = [
        load_run(make_seed_run(tmp_path / "a", seed=0), name="a"),
        load_run(make_seed_run(tmp_path / "b", seed=0, estimator="gae"), name="b"),
    ]
    page = Page(tmp_path / "png")
    section_seeds(page, runs)
    text = page.html("t")
    assert "No two runs differ only by their seed" in text and "<table" not in text and not page.pngs
    html = write_report(tmp_path).read_text(encoding="utf-8")
    assert (
        "No two runs differ only by their seed" in html
        and "<h2>Held-out accuracy against step and KL" in html
    )
    assert not (tmp_path / "report" / "compare_seeds.png").exists()
    # two seeds of a config whose evaluations measured no accuracy (another run's did): one line as well
    for seed in (1, 2):
        path = make_seed_run(tmp_path / f"c{seed}", seed=seed, estimator="rloo")
        rows = [{"step": s, "kl": 0.1 * s} for s in (0, 4, 8)]
        write_jsonl(path / "ppo" / "eval_log.jsonl", rows)
        runs.append(load_run(path, name=f"c{seed}"))
    page = Page(tmp_path / "png")
    section_seeds(page, runs)
    assert "evaluated no held-out accuracy: nothing to average" in page.html("t") and not page.pngs
