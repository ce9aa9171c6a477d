"""`llm-rlhf pipeline`: SFT -> RM -> PPO -> eval chained through their folders; a re-run skips finished
stages and resumes the interrupted one; seeds; stages without SFT and RM. (The whole pipeline under
`accelerate launch` with 2 processes: tests/multiprocess/test_stages_on_two_processes.py.)"""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import ROOT, pipeline_argv, ppo_steps, run_pipeline
from processes import interrupt_ppo_at

from llm_rlhf.core.utils import read_json

pytestmark = pytest.mark.slow  # every test here runs the whole pipeline


def test_pipeline_runs_skips_finished_and_resumes_interrupted(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, monkeypatch, capsys
):
    monkeypatch.chdir(ROOT)  # the recipe names its stage files relative to the repo root
    out = tmp_path / "run"
    argv = pipeline_argv(out, tiny_model_dir, sft_files, pref_files, prompt_file)

    # 1. killed during PPO step 3 (after the step-2 checkpoint): SFT and RM are finished, PPO is not
    restore = interrupt_ppo_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(argv)
    assert read_json(out / "pipeline.json").keys() == {"sft", "rm"}
    assert not (out / "ppo" / "metrics.json").exists() and (out / "ppo" / "checkpoints").is_dir()
    assert ppo_steps(out) == [1, 2]
    sft_mtime = (out / "sft" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()

    # 2. the same command again: SFT and RM skipped, PPO resumed from its checkpoint, then eval and report
    restore()
    run_pipeline(argv)
    printed = capsys.readouterr().out
    assert "== sft: finished earlier" in printed and "== rm: finished earlier" in printed
    assert "== ppo: interrupted earlier; resuming" in printed and "resumed from" in printed
    assert "== eval: running" in printed
    assert ppo_steps(out) == [1, 2, 3, 4], "steps 1-2 kept from the first run, 3-4 from the resumed one"
    assert (out / "sft" / "model.safetensors").stat().st_mtime_ns == sft_mtime, "SFT was not re-run"
    record = read_json(out / "pipeline.json")
    assert record.keys() == {"sft", "rm", "ppo", "eval"}
    for stage in record:
        assert record[stage]["wall_time_s"] > 0
        assert record[stage]["metrics"] == read_json(out / stage / "metrics.json")
    assert {"gold_win_rate", "rm_win_rate", "kl_to_ref"} <= record["eval"]["metrics"].keys()
    assert (out / "report.html").is_file() and (out / "pipeline_config.yaml").is_file()

    # 3. once more: nothing left to do
    run_pipeline(argv)
    printed = capsys.readouterr().out
    assert all(f"== {s}: finished earlier" in printed for s in ("sft", "rm", "ppo", "eval"))
    assert read_json(out / "pipeline.json") == record


def test_pipeline_seeds_give_one_run_per_seed(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, monkeypatch
):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "seeds"
    argv = pipeline_argv(out, tiny_model_dir, sft_files, pref_files, prompt_file, seeds="[1, 2]")
    argv += ["--stages", "[sft, rm, ppo]"]
    run_pipeline(argv)
    runs = [out / "seed-1", out / "seed-2"]
    for seed, run in zip((1, 2), runs):
        for stage in ("sft", "rm", "ppo"):
            assert yaml.safe_load((run / stage / "config.yaml").read_text())["seed"] == seed
    first = [json.loads(line) for line in (runs[0] / "ppo" / "metrics.jsonl").read_text().splitlines()]
    second = [json.loads(line) for line in (runs[1] / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert first[0]["objective/scores"] != second[0]["objective/scores"], "different seeds, different samples"
    assert (out / "report.html").is_file()

    # one seed alone (finished above, so nothing re-runs): its record, keyed by its folder like any seed run
    one = argv[: argv.index("--seeds")] + ["--seeds", "[2]"] + argv[argv.index("--seeds") + 2 :]
    records = run_pipeline(one)
    assert records.keys() == {str(out / "seed-2")}


def test_a_stage_killed_before_its_first_checkpoint_starts_over(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, monkeypatch, capsys
):
    """A stage folder without a checkpoint (killed while loading data, say) is run again from scratch
    instead of failing on `--resume: no checkpoint`."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    argv = pipeline_argv(out, tiny_model_dir, sft_files, pref_files, prompt_file, report="false")
    argv += ["--stages", "[sft]"]
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "config.yaml").write_text("output_dir: left by the killed run\n")
    run_pipeline(argv)
    assert (
        "== sft: interrupted earlier, no checkpoint to resume from; starting over" in capsys.readouterr().out
    )
    assert read_json(out / "sft" / "metrics.json")["global_step"] == 2


def test_a_sweep_over_estimators_is_compared_in_one_report_and_one_compare(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, monkeypatch
):
    """`--sweep` over advantage estimators with the report and the compare stage: SFT and RM once, each
    variant's PPO and eval in DIR/<name>; the grpo run has no value head and no value panels while the gae
    run has both; the side-by-side table names each estimator; compare runs once, over both variants."""
    from llm_rlhf.evaluation import metric_names as e
    from llm_rlhf.evaluation.hacking import DEGENERACY_KEYS, PROXY
    from llm_rlhf.interfaces import report
    from llm_rlhf.interfaces.report.evaluation import EVAL_GROUPS, MEMBERS, PASS_AT
    from llm_rlhf.interfaces.report.ppo_curves import OPTIONAL_KEYS, PPO_PANELS, ppo_panels
    from llm_rlhf.interfaces.report.samples import SCORES_SHOWN
    from llm_rlhf.ppo import metrics as m

    monkeypatch.chdir(ROOT)
    out = tmp_path / "sweep"
    variants = (
        "[{name: gae}, {name: grpo, advantage_estimator: grpo, samples_per_prompt: 2, rollout_batch_size: 2}]"
    )
    argv = pipeline_argv(out, tiny_model_dir, sft_files, pref_files, prompt_file, sweep=variants)
    compare_keys = {"dpo_betas": [], "best_of_n": [1, 2], "best_of_n_samples": 2}
    argv += ["--stages", "[sft, rm, ppo, eval, compare]", "--compare", json.dumps(compare_keys)]
    run_pipeline(argv)

    assert (out / "gae" / "ppo" / "value_head.safetensors").is_file()
    assert not (out / "grpo" / "ppo" / "value_head.safetensors").exists()
    assert read_json(out / "grpo" / "eval" / "metrics.json")["gold_win_rate"] is not None
    titles = {}
    for name in ("gae", "grpo"):
        run = report.load_run(out / name)
        titles[name] = [panel[0] for panel in ppo_panels(run.ppo_history)]
    assert {"Value loss", "Explained variance of returns"} <= set(titles["gae"])
    assert titles["grpo"] == [
        t for t in titles["gae"] if t not in ("Value loss", "Explained variance of returns")
    ]
    assert "Not drawn, nothing logged for them: Value loss" in (out / "grpo" / "report.html").read_text()
    assert "Not drawn" not in (out / "gae" / "report.html").read_text()
    html = (out / "report.html").read_text()
    headline = html[html.index("<h2>Headline metrics</h2>") :]
    headline = headline[: headline.index("</table>")]
    rows = [row for row in headline.split("<tr>")[2:]]
    assert [row.split("<td>")[2].split("</td>")[0] for row in rows] == ["gae", "grpo, k = 2"]

    # compare: once, in DIR/compare, both variants' held-out evaluations as methods of their own
    assert not (out / "gae" / "compare").exists() and not (out / "grpo" / "compare").exists()
    points = [json.loads(line) for line in (out / "compare" / "points.jsonl").read_text().splitlines()]
    for method, name in (("ppo", "gae"), ("grpo", "grpo")):
        heldout = [
            json.loads(line) for line in (out / name / "ppo" / "eval_log.jsonl").read_text().splitlines()
        ]
        assert [p["gold_score"] for p in points if p["method"] == method] == [
            r["gold_score"] for r in heldout
        ]
    metrics = read_json(out / "compare" / "metrics.json")
    assert (
        metrics["runs"]["ppo"]["name"] == "gae" and metrics["runs"]["grpo"]["advantage_estimator"] == "grpo"
    )
    assert {"ppo", "grpo", "best_of_n"} <= metrics["best"].keys()
    assert read_json(out / "pipeline.json")["compare"]["metrics"] == metrics
    assert "Methods compared" in html and "grpo (grpo, k = 2, along its run)" in html
    assert (out / "report" / "methods.png").is_file()

    # one vocabulary: every name the report reads (ppo_metrics, eval_metrics) is one a real run wrote
    # a gae run logs every panel's keys but the episodes' (no environment)
    assert titles["gae"] == [panel[0] for panel in PPO_PANELS if panel[2][0] not in OPTIONAL_KEYS]
    assert {m.SCORES_FIRST, m.SCORES_LAST, m.KL_LAST, m.KL_TARGET} <= read_json(
        out / "gae" / "ppo" / "metrics.json"
    ).keys()
    figures = read_json(out / "gae" / "eval" / "metrics.json")
    ensemble = (MEMBERS, e.RM_DISAGREEMENT_MEAN)  # written with a reward-model ensemble alone
    pass_at = (
        PASS_AT,
    )  # a row per pass@k, written with pass_at_k alone (tests/evaluation/test_pass_at_k.py)
    rows = [row for _, group in EVAL_GROUPS for row in group if row.key not in (*ensemble, *pass_at)]
    read = {
        name + side for row in rows for name in (row.key, row.stderr) if name for side in ("", e.BASELINE)
    }
    read |= {name for row in rows if row.win for name in (row.win, row.win + e.STDERR)}
    assert read <= figures.keys()
    line = report.parse_jsonl((out / "gae" / "ppo" / "eval_log.jsonl").read_text())[0]
    assert {e.LOG_STEP, e.LOG_KL, e.RM_SCORE, e.GOLD_SCORE, *e.ACCURACY_KEYS, *DEGENERACY_KEYS} <= line.keys()
    sample = report.parse_jsonl((out / "gae" / "eval" / "samples.jsonl").read_text())[0]
    fields = [f for f, _, _ in SCORES_SHOWN] + [e.RESPONSE, e.LENGTH, e.EOS, e.CORRECT, e.GREEDY_RESPONSE]
    assert {
        e.PROMPT,
        e.SAMPLE,
        *(e.side(who, f) for who in ("policy", "baseline") for f in fields),
    } <= sample.keys()
    heldout = report.parse_jsonl((out / "gae" / "ppo" / "eval_samples.jsonl").read_text())[0]
    assert {e.LOG_STEP, e.PROMPT, e.RESPONSE, e.GOLD_SCORE, PROXY} <= heldout.keys()


def test_stages_without_sft_and_rm_start_ppo_from_its_recipe_model_and_score_with_a_rule(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, monkeypatch
):
    """`stages: [ppo, eval]` (a sweep of two estimators): nothing is chained from SFT or RM folders that the run
    does not make. PPO starts from the model its recipe names, scores with the reward function alone, and
    evaluation compares the policy with that starting model (also the KL reference); no sft/ or rm/ folder
    or link is made."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "rule"
    argv = pipeline_argv(out, tiny_model_dir, sft_files, pref_files, prompt_file, report="false")
    start = {
        "model_name_or_path": str(tiny_model_dir),
        "reward_model_path": "none",
        "reward_fn": "reward_fns:length",
    }
    variants = (
        "[{name: gae}, {name: rloo, advantage_estimator: rloo, samples_per_prompt: 2, rollout_batch_size: 2}]"
    )
    argv = [a if not a.startswith("--ppo=") else a[:-1] + ", " + json.dumps(start)[1:] for a in argv]
    argv += ["--stages", "[ppo, eval]", "--sweep", variants]
    records = run_pipeline(argv)

    assert not (out / "sft").exists() and not (out / "rm").exists()
    for name in ("gae", "rloo"):
        run = out / name
        assert sorted(p.name for p in run.iterdir()) == [
            "eval",
            "pipeline.json",
            "pipeline_config.yaml",
            "ppo",
        ]
        ppo_cfg = yaml.safe_load((run / "ppo" / "config.yaml").read_text())
        assert ppo_cfg["model_name_or_path"] == str(tiny_model_dir)
        assert ppo_cfg["reward_model_path"] in (None, "none") and ppo_cfg["reward_fn"] == "reward_fns:length"
        eval_cfg = yaml.safe_load((run / "eval" / "config.yaml").read_text())
        assert eval_cfg["policy_path"] == str(run / "ppo") and eval_cfg["baseline_path"] == str(
            tiny_model_dir
        )
        assert (
            eval_cfg["reward_model_path"] in (None, "none") and eval_cfg["reward_fn"] == "reward_fns:length"
        )
        metrics = records[str(run)]["eval"]["metrics"]
        assert metrics["reference_path"] == str(tiny_model_dir) and metrics["rm_win_rate"] is None
        assert metrics["reward_fn_mean"] is not None and metrics["kl_to_ref_baseline"] == 0.0
    assert set(records) == {str(out / "gae"), str(out / "rloo")}, "no shared run: nothing is shared"
