"""Gold against KL for the alignment methods (`llm_rlhf.stages.compare`): best-of-n on a tiny model, checked
against the samples it is built from."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, SENTIMENT_JUDGE, pipeline_argv, run_pipeline

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.core.utils import read_json
from llm_rlhf.evaluation.measures import Measures, PairedSampling, sample_and_score
from llm_rlhf.models.gold import GoldJudge
from llm_rlhf.models.loading import freeze, load_causal_lm, load_tokenizer
from llm_rlhf.models.reward_model import load_reward_model
from llm_rlhf.models.scoring import Scorer
from llm_rlhf.rl import reward_math
from llm_rlhf.rl.rollout import Sampling
from llm_rlhf.stages import compare


def test_best_of_n_points_are_the_expectations_over_the_samples(tiny_model_dir, tiny_rm_dir, prompt_file):
    model = freeze(load_causal_lm(str(tiny_model_dir)))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    reward_model = freeze(load_reward_model(str(tiny_rm_dir)))
    judge = GoldJudge.load(SENTIMENT_JUDGE)
    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()][:3]
    N, draws = 8, PairedSampling(Sampling(max_new_tokens=6), seed=3, batch_size=8)
    points = compare.best_of_n_points(
        model,
        tokenizer,
        prompts,
        draws,
        measures=Measures(Scorer(reward_model), judge),
        ns=[1, 2, 8],
        num_samples=N,
    )
    # The same samples, drawn again by the evaluation's own sampler with the same seeds.
    records = sample_and_score(
        model,
        tokenizer,
        [p for p in prompts for _ in range(N)],
        draws,
        measures=Measures(Scorer(reward_model), judge),
    )
    rm = torch.tensor([r["rm_score"] for r in records]).view(3, N)
    gold = torch.tensor([r["gold_score"] for r in records]).view(3, N)
    by_n = {p["n"]: p for p in points}
    # n = 1 is the SFT model itself: the plain means, KL 0.
    assert by_n[1]["rm_score"] == pytest.approx(rm.mean().item(), abs=1e-6)
    assert by_n[1]["gold_score"] == pytest.approx(gold.mean().item(), abs=1e-6)
    assert by_n[1]["kl"] == 0.0 and by_n[1]["kl_measured"] == pytest.approx(0.0, abs=1e-12)
    # n = N keeps each prompt's best-scored sample (the RM scores of the 8 samples of a prompt do not tie here).
    assert all(len(set(row.tolist())) == N for row in rm)
    best = rm.argmax(1)
    assert by_n[8]["rm_score"] == pytest.approx(rm.max(1).values.mean().item(), abs=1e-6)
    assert by_n[8]["gold_score"] == pytest.approx(gold[torch.arange(3), best].mean().item(), abs=1e-6)
    assert by_n[2]["kl"] == reward_math.best_of_n_kl(2)
    assert by_n[1]["rm_score"] <= by_n[2]["rm_score"] <= by_n[8]["rm_score"]
    with pytest.raises(ValueError, match="num_samples"):
        compare.best_of_n_points(
            model,
            tokenizer,
            prompts,
            draws,
            measures=Measures(Scorer(reward_model), judge),
            ns=[16],
            num_samples=N,
        )


@pytest.mark.slow
def test_compare_stage_puts_ppo_dpo_and_best_of_n_on_one_plot(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, monkeypatch, capsys
):
    """The pipeline's optional compare stage after SFT, RM and PPO (held-out evaluations at every step):
    one DPO run per beta, best-of-n from the SFT model, the laws fitted, the report's section."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    argv = pipeline_argv(out, tiny_model_dir, sft_files, pref_files, prompt_file)
    dpo_tiny = {
        "train_file": str(pref_files[0]),
        "eval_file": str(pref_files[0]),
        "max_length": 48,
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "warmup_ratio": 0,
        "logging_steps": 1,
        "eval_steps": 0,
        "save_steps": 2,
    }
    compare_overrides = {
        "dpo": dpo_tiny,
        "dpo_betas": [0.1, 1.0],
        "best_of_n": [1, 2, 3, 4],
        "best_of_n_samples": 4,
    }
    (i,) = [i for i, arg in enumerate(argv) if arg.startswith("--ppo=")]  # the tiny PPO keys, plus these
    ppo_keys = {
        **yaml.safe_load(argv[i].removeprefix("--ppo=")),
        "steps": 3,
        "save_steps": 0,
        "eval_every": 1,
    }
    argv[i] = f"--ppo={json.dumps(ppo_keys)}"
    argv += ["--stages", "[sft, rm, ppo, compare]", "--compare", json.dumps(compare_overrides)]
    run_pipeline(argv)
    folder = out / "compare"
    points = [json.loads(line) for line in (folder / "points.jsonl").read_text().splitlines()]
    ppo_log = [json.loads(line) for line in (out / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    by_method = {m: [p for p in points if p["method"] == m] for m in compare.METHODS}
    # PPO: its held-out evaluations, step 0 (the SFT model, KL 0) to step 3
    assert [p["label"] for p in by_method["ppo"]] == ["step 0", "step 1", "step 2", "step 3"]
    assert [p["gold_score"] for p in by_method["ppo"]] == [r["gold_score"] for r in ppo_log]
    assert by_method["ppo"][0]["kl"] == 0.0
    # DPO: one trained run per beta, from the SFT model, each moved away from it
    assert [p["label"] for p in by_method["dpo"]] == ["beta 0.1", "beta 1"]
    for beta, point in zip((0.1, 1.0), by_method["dpo"]):
        run = folder / f"dpo-beta-{beta:g}"
        assert yaml.safe_load((run / "config.yaml").read_text())["beta"] == beta
        assert read_json(run / "metrics.json")["global_step"] == 2
        # kl is a k1 estimate on a few samples of a model two steps away from the SFT model: either sign
        assert point["kl"] != 0 and math.isfinite(point["kl"]) and math.isfinite(point["gold_score"])
    # best-of-n: n = 1 is the SFT model; the RM score rises with n (the same samples, the best kept)
    bon = by_method["best_of_n"]
    assert [p["n"] for p in bon] == [1, 2, 3, 4] and bon[0]["kl"] == 0.0
    assert all(a["rm_score"] <= b["rm_score"] + 1e-9 for a, b in zip(bon, bon[1:]))
    metrics = read_json(folder / "metrics.json")
    fit = metrics["fits"]["best_of_n"]  # 3 points with KL > 0: fitted, flagged poor (fewer than 4)
    assert fit["form"] == "bon" and fit["poor"] and len(fit["curve"]) == 50
    d0, gold0 = fit["curve"][0]
    law = reward_math.gao_bon_law(torch.tensor(d0), alpha=fit["alpha"], beta=fit["beta"])
    assert gold0 == pytest.approx(fit["origin"] + float(law))
    assert metrics["best_of_n_best_gold"] == max(p["gold_score"] for p in bon)
    assert read_json(out / "pipeline.json")["compare"]["metrics"] == metrics
    html = (out / "report.html").read_text()
    assert "Methods compared" in html and (out / "report" / "methods.png").is_file()

    # run on its own again: the finished DPO runs are reused, not retrained
    trained = (folder / "dpo-beta-0.1" / "model.safetensors").stat().st_mtime_ns
    cfg = parse_config(compare.Config, ["--config", str(folder / "config.yaml")])
    assert compare.run(cfg)["best"] == metrics["best"]
    assert (folder / "dpo-beta-0.1" / "model.safetensors").stat().st_mtime_ns == trained
    # a DPO run killed before its first checkpoint (its folder holds only config.yaml) starts over
    killed = folder / "dpo-beta-1"
    saved_config = (killed / "config.yaml").read_text()
    shutil.rmtree(killed)
    killed.mkdir()
    (killed / "config.yaml").write_text(saved_config)
    compare.run(cfg)
    assert read_json(killed / "metrics.json")["global_step"] == 2


def test_the_laws_start_at_ppos_step_0_whatever_its_kl():
    """The origin is the step-0 evaluation (the SFT model) even when its KL is not exactly 0 (bf16)."""
    log = [{"step": 0, "kl": 3e-7, "gold_score": -1.2}, {"step": 10, "kl": 4.0, "gold_score": 0.5}]
    assert compare.sft_origin(log) == -1.2
    assert compare.sft_origin(log[1:]) is None
    points = [{"kl": kl, "gold_score": -1.2 + 0.3 * kl**0.5} for kl in (1.0, 4.0, 9.0, 16.0)]
    fit = compare.law_fit(points, compare.sft_origin(log), "bon")
    assert (
        fit["origin"] == -1.2
        and fit["alpha"] == pytest.approx(0.3)
        and fit["beta"] == pytest.approx(0.0, abs=1e-9)
    )


def test_compare_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="best_of_n_samples"):
        compare.Config(best_of_n=[1, 128], best_of_n_samples=64)
    with pytest.raises(ConfigError, match="dpo_betas"):
        compare.Config(dpo_betas=[0.1, 0.1])
    with pytest.raises(ConfigError, match="unknown DPO key 'betta'"):
        compare.dpo_config(compare.Config(output_dir=str(tmp_path), dpo={"betta": 1}), 0.1)
    ppo_dir = tmp_path / "ppo"
    ppo_dir.mkdir()
    (ppo_dir / "config.yaml").write_text("eval_every: 0\n")
    with pytest.raises(UserError, match="eval_every > 0"):
        compare.ppo_settings(ppo_dir)


def _heldout_run(folder: Path, prompt_file: Path, **keys) -> Path:
    """A finished PPO run as compare reads it: config.yaml (held-out evaluation on) and eval_log.jsonl."""
    folder.mkdir(parents=True)
    config = {"eval_every": 2, "eval_prompt_file": str(prompt_file), "eval_num_prompts": 2, **keys}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "eval_log.jsonl").write_text(json.dumps({"step": 0, "kl": 0.0, "gold_score": 0.1}) + "\n")
    return folder


@pytest.mark.parametrize(
    "key, value",
    [
        ("eval_num_prompts", 3),
        ("eval_prompt_file", "other"),
        ("temperature", 0.7),
        ("stop_strings", ["\n"]),
        ("gold_judge", "sentiment"),
        ("max_prompt_length", 16),
    ],
)
def test_more_ppo_dirs_must_be_evaluated_as_ppo_dir_is(tmp_path, prompt_file, key, value):
    """A further run whose held-out points were drawn on other prompts, sampled otherwise or judged by another
    gold is refused before anything is loaded, naming the key and the setting; one evaluated alike is taken
    (another estimator, KL coefficient or sampling_compile: how the steps run, not what they draw)."""
    if value == "other":
        value = str(shutil.copy(prompt_file, tmp_path / "other.jsonl"))
    main = _heldout_run(tmp_path / "runs" / "gae" / "ppo", prompt_file)
    alike = _heldout_run(
        tmp_path / "runs" / "grpo" / "ppo",
        prompt_file,
        advantage_estimator="rloo",
        samples_per_prompt=2,
        init_kl_coef=0.5,
        sampling_compile=True,
    )
    differs = _heldout_run(tmp_path / "runs" / "rloo-x", prompt_file, **{key: value})
    cfg = compare.Config(ppo_dir=str(main), more_ppo_dirs=[str(alike)], output_dir=str(tmp_path / "out"))
    ppo_cfg, _ = compare.ppo_settings(main)
    [(name, folder, run_cfg, log)] = compare.more_runs(cfg, ppo_cfg)
    assert (name, folder, run_cfg.advantage_estimator, log[0]["gold_score"]) == (
        "grpo",
        str(alike),
        "rloo",
        0.1,
    )
    cfg = dataclasses.replace(cfg, more_ppo_dirs=[str(alike), str(differs)])
    with pytest.raises(ConfigError, match=rf"'more_ppo_dirs': '{differs}' has {key} .*not be comparable"):
        compare.run(cfg)
    assert not (tmp_path / "out").exists()


def test_more_ppo_dirs_need_names_of_their_own(tmp_path):
    """A run is a method named by its folder: two runs of one name, or a run named like a method, would be
    drawn as one."""
    with pytest.raises(ConfigError, match="more_ppo_dirs.*'grpo' is taken"):
        compare.Config(more_ppo_dirs=["a/grpo/ppo", "b/grpo"])
    with pytest.raises(ConfigError, match="more_ppo_dirs.*'dpo' is taken"):
        compare.Config(more_ppo_dirs=["runs/dpo"])


def test_dpo_and_best_of_n_are_scored_by_the_scorer_ppo_trained_against(
    tmp_path, tiny_model_dir, tiny_rm_dir, prompt_file, monkeypatch
):
    """compare's proxy is the PPO run's scorer, built from its config.yaml: here an ensemble of two RMs
    combined with min, plus a reward function with its weight (not the first RM alone). DPO's point (a
    finished run, reused) and best-of-n's points equal the PPO trainer's own scorer on the same responses:
    rm_score the ensemble's combined score, reward_fn the function's, best-of-n keeping the response with the
    highest PPO score (rm_score + reward_fn_weight * reward_fn)."""
    from helpers import ppo_config, tiny_ppo_trainer

    from llm_rlhf.core.config import save_config
    from llm_rlhf.evaluation.measures import sample_batch
    from llm_rlhf.models.reward_model import save_reward_model

    monkeypatch.chdir(tmp_path)
    # member 0 where the compare recipe names its RM (runs/reviews/rm): what a compare scoring with it alone finds
    member_0 = shutil.copytree(tiny_rm_dir, tmp_path / "runs" / "reviews" / "rm")
    rm = load_reward_model(tiny_rm_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        rm.model.score.weight.normal_(0.0, 0.5)  # member 1: a head and a normalisation of its own
    rm.normalization = {"mean": 4.0, "std": 1.0, "reference_set": "test", "n": 1}
    save_reward_model(rm, tmp_path / "rm-1", merge_lora=False)
    ppo_dir = tmp_path / "ppo"
    ppo_cfg = ppo_config(
        tiny_model_dir,
        None,
        prompt_file,
        ppo_dir,
        reward_model_path=[str(member_0), str(tmp_path / "rm-1")],
        ensemble_combine="min",
        reward_fn="reward_fns:length",
        reward_fn_weight=0.5,
        eval_every=1,
        eval_prompt_file=str(prompt_file),
        eval_num_prompts=3,
        max_new_tokens=6,
    )
    save_config(ppo_cfg, ppo_dir)
    (ppo_dir / "eval_log.jsonl").write_text(json.dumps({"step": 0, "kl": 0.0, "gold_score": 0.1}) + "\n")
    out = tmp_path / "compare"
    shutil.copytree(tiny_model_dir, out / "dpo-beta-0.1")  # a finished DPO run (reused): the SFT model itself
    (out / "dpo-beta-0.1" / "metrics.json").write_text("{}")
    cfg = compare.Config(
        sft_path=str(tiny_model_dir),
        ppo_dir=str(ppo_dir),
        output_dir=str(out),
        dpo_config=None,
        dpo_betas=[0.1],
        best_of_n=[1, 4],
        best_of_n_samples=4,
    )
    compare.run(cfg)
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]

    trainer = tiny_ppo_trainer(ppo_cfg)  # PPO's scorer, built as `llm-rlhf ppo` builds it
    sft, tokenizer = freeze(load_causal_lm(str(tiny_model_dir))), load_tokenizer(str(tiny_model_dir))
    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()][:3]
    draws = PairedSampling(Sampling.of(ppo_cfg), seed=ppo_cfg.seed, batch_size=ppo_cfg.heldout_batch_size)
    rows, B = [p for p in prompts for _ in range(4)], draws.batch_size  # best-of-n's N = 4 samples per prompt
    batches = [
        sample_batch(sft, tokenizer, rows[s : s + B], draws.sampling, seed=draws.seed + b)
        for b, s in enumerate(range(0, len(rows), B))
    ]
    scores = [trainer.collector.score(batch) for batch in batches]
    rm_score, fn, proxy = (
        torch.cat([getattr(s, k) for s in scores]).double().view(3, 4)
        for k in ("rm_score", "reward_fn", "scores")
    )
    member_0_alone = torch.cat([Scorer(load_reward_model(member_0))(b, tokenizer).rm_score for b in batches])
    differs = (rm_score.flatten().float() - member_0_alone).abs() > 1e-3  # (12,) where member 1 is the min
    assert differs.any() and not differs.all()
    bon = {p["n"]: p for p in points if p["method"] == "best_of_n"}
    for n in (1, 4):
        # (3, 4): n = 4 keeps the highest PPO score
        weights = reward_math.best_of_n_weights(rewards=proxy, n=n)
        assert bon[n]["rm_score"] == pytest.approx(compare.expectation(weights, rm_score), abs=1e-5)
        assert bon[n]["reward_fn"] == pytest.approx(compare.expectation(weights, fn), abs=1e-9)
    assert bon[4]["rm_score"] + 0.5 * bon[4]["reward_fn"] > bon[1]["rm_score"] + 0.5 * bon[1]["reward_fn"]
    [dpo] = [p for p in points if p["method"] == "dpo"]  # one response per prompt, drawn as PPO's evaluation
    expected = trainer.collector.score(sample_batch(sft, tokenizer, prompts, draws.sampling, seed=draws.seed))
    assert dpo["rm_score"] == pytest.approx(expected.rm_score.mean().item(), abs=1e-5)
    assert dpo["reward_fn"] == pytest.approx(expected.reward_fn.mean().item(), abs=1e-9)
