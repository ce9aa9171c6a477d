"""Reward-model ensembles (Coste et al. 2024): the combine rules against hand-computed values,
K = 1 identical to one reward model, PPO steps and evaluation through the real code paths with members
that disagree (each normalised with its own statistics), members with another tokenizer, config errors,
the pipeline training the members (seeds, bootstrap resamples). (Two data-parallel processes:
tests/multiprocess/test_ppo_options_on_two_processes.py.)"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import yaml
from helpers import (
    ROOT,
    SENTENCES,
    doc_section,
    eos_rows,
    eval_config,
    pipeline_argv,
    ppo_config,
    recording_rollouts,
    scores_alone,
    tiny_ppo_trainer,
    train_tokenizer,
)

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.errors import ConfigError
from llm_rlhf.core.utils import read_json
from llm_rlhf.interfaces import cli, pipeline
from llm_rlhf.models.loading import load_tokenizer, shares_vocab
from llm_rlhf.models.reward_model import (
    RewardEnsemble,
    RewardModel,
    add_pad_token,
    encode_pair,
    end_with_eos,
    last_token_index,
    load_reward_model,
    load_reward_models,
    save_reward_model,
)
from llm_rlhf.models.scoring import Scorer, scored_as
from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.rl import ppo_math, reward_math
from llm_rlhf.stages import evaluate, reward

TIMES = ("time/", "tokens_per_s")


# ---------------------------------------------------------------------------------------------------
# The combine rules (pure)
# ---------------------------------------------------------------------------------------------------

# K = 4 members, B = 2 sequences: column 0 is 0, 0, 2, 2 (mean 1, population std 1, min 0); column 1 is
# -1, -1, 3, 3 (mean 1, population std 2, min -1). The sample std would be 1.1547 and 2.3094.
S = torch.tensor([[0.0, -1.0], [0.0, -1.0], [2.0, 3.0], [2.0, 3.0]])


def combine(mode: str, coef: float = 1.0, scores: torch.Tensor = S) -> torch.Tensor:
    return reward_math.combine_member_scores(member_scores=scores, combine=mode, uncertainty_coef=coef)


def test_combine_modes_against_hand_computed_values():
    assert combine("mean").tolist() == [1.0, 1.0]
    assert combine("min").tolist() == [0.0, -1.0]
    assert reward_math.member_disagreement(member_scores=S).tolist() == [
        1.0,
        2.0,
    ]  # population std, not 1.15, 2.31
    assert combine("uncertainty", 0.5).tolist() == [1.0 - 0.5 * 1.0, 1.0 - 0.5 * 2.0]  # [0.5, 0.0]
    assert combine("uncertainty", 1.0).tolist() == [0.0, -1.0]
    assert combine("uncertainty", 0.0).tolist() == combine("mean").tolist()
    two = torch.tensor([[1.0, 0.0], [3.0, 0.0]])  # the docstring's example
    assert [combine(m, 1.0, two).tolist() for m in ("mean", "min", "uncertainty")] == [[2, 0], [1, 0], [1, 0]]


def test_one_member_is_returned_exactly_by_every_mode():
    one = torch.tensor([[0.123456789, -2.5, 7.25]])  # (K=1, B=3)
    assert torch.equal(reward_math.member_disagreement(member_scores=one), torch.zeros(3))
    for mode in reward_math.ENSEMBLE_COMBINES:
        assert torch.equal(combine(mode, 3.0, one), one[0]), mode


def test_unknown_combine_mode_raises():
    with pytest.raises(ValueError, match="median"):
        combine("median")


# ---------------------------------------------------------------------------------------------------
# Members: the tiny RM and copies whose head and normalisation differ (`members`, conftest.py), and an RM
# over another tokenizer
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_tokenizer_member(tmp_path_factory) -> str:
    """An RM (random head) over a tokenizer of its own: another vocabulary than the tiny models'."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    tokenizer = train_tokenizer(list(reversed(SENTENCES)) * 3, vocab_size=300)
    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=1, n_head=2, num_labels=1
    )
    model = GPT2ForSequenceClassification(config)
    add_pad_token(model, tokenizer)
    folder = tmp_path_factory.mktemp("other_tok_rm")
    save_reward_model(RewardModel(model, tokenizer, {"mean": 0.1, "std": 1.5}), folder, merge_lora=False)
    return str(folder)


def separate_scores(paths: list[str], sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each member loaded alone by `load_reward_model` (its own normalisation) scoring the ids, every row
    ending with EOS (`end_with_eos`: a truncated response gets one): (K, B)."""
    scores = []
    with torch.no_grad():
        for p in paths:
            rm = load_reward_model(p)
            eos = rm.tokenizer.eos_token_id
            finished = sequence[torch.arange(len(sequence)), last_token_index(mask)] == eos  # (B,)
            scores.append(rm.score(*end_with_eos(sequence, mask, eos_token_id=eos, finished=finished)))
    return torch.stack(scores)


def test_members_disagree_and_keep_their_own_normalisation(members, tiny_model_dir, prompt_file):
    ensemble = load_reward_models(members, combine="mean")
    assert isinstance(ensemble, RewardEnsemble) and [m.std for m in ensemble.members] == [
        load_reward_model(members[0]).std,
        2.0,
        0.5,
    ]
    tokenizer = load_tokenizer(str(tiny_model_dir))
    rows = [tokenizer(s)["input_ids"] + [tokenizer.eos_token_id] for s in SENTENCES[:4]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    got = ensemble.member_scores(ids, mask, tokenizer)  # (K, B)
    torch.testing.assert_close(got, separate_scores(members, ids, mask), atol=1e-6, rtol=1e-6)
    assert reward_math.member_disagreement(member_scores=got).min() > 0.01  # the members disagree


def test_a_member_with_another_tokenizer_reads_the_text(tiny_rm_dir, other_tokenizer_member, tiny_model_dir):
    """Members need not share the policy's tokenizer: one with another vocabulary decodes the policy's ids
    and re-encodes the text its own way (`RewardModel.score_tokens`), the other reads the ids."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    other = load_reward_model(other_tokenizer_member)
    assert not shares_vocab(tokenizer, other.tokenizer)
    ensemble = load_reward_models([str(tiny_rm_dir), other_tokenizer_member], combine="min")
    rows = [tokenizer(s)["input_ids"] + [tokenizer.eos_token_id] for s in SENTENCES[4:8]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left-padded, as a rollout's query
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    got = ensemble.member_scores(ids, mask, tokenizer)
    torch.testing.assert_close(got[0], load_reward_model(tiny_rm_dir).score(ids, mask), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], other.score_tokens(ids, mask, tokenizer), atol=1e-6, rtol=1e-6)
    assert torch.equal(ensemble.combine(got), got.min(dim=0).values)


def test_every_member_reads_a_stopped_or_truncated_response_ending_with_its_own_eos(
    tiny_rm_dir, other_tokenizer_member, tiny_model_dir
):
    """For an RM with another vocabulary and for an ensemble: a response cut by a stop string or
    truncated at max_new_tokens is scored as its text followed by the member's own EOS (the text re-encoded
    by the member's tokenizer, as in RM training), through the one Scorer."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    same, other = load_reward_model(tiny_rm_dir), load_reward_model(other_tokenizer_member)
    samples, with_eos = eos_rows(tokenizer)
    texts = [tokenizer.decode(r[:-1], clean_up_tokenization_spaces=False) for r in with_eos]
    other_rows = [encode_pair(other.tokenizer, t, "") for t in texts]  # each ends with the other RM's EOS
    assert all(r[-1] == other.tokenizer.eos_token_id for r in other_rows)
    with torch.no_grad():
        expected = torch.stack([scores_alone(same, with_eos), scores_alone(other, other_rows)])  # (2, 3)
    got = Scorer(other)(samples, tokenizer).scores  # an RM with another vocabulary alone
    torch.testing.assert_close(got, expected[1], atol=1e-5, rtol=1e-5)
    ensemble = load_reward_models([str(tiny_rm_dir), other_tokenizer_member], combine="mean")
    scores = Scorer(ensemble)(samples, tokenizer)
    torch.testing.assert_close(scores.member_scores, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores.scores, expected.mean(0), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------
# PPO through the real trainer
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mean", "min", "uncertainty"])
def test_ppo_step_with_an_ensemble_scores_and_logs_every_member(
    members, tiny_model_dir, prompt_file, tmp_path, mode
):
    cfg = ppo_config(
        tiny_model_dir,
        members[0],
        prompt_file,
        tmp_path,
        reward_model_path=members,
        ensemble_combine=mode,
        ensemble_uncertainty_coef=0.5,
        ppo_epochs=1,
    )
    trainer = tiny_ppo_trainer(cfg)
    assert (
        isinstance(trainer.collector.scorer.reward_model, RewardEnsemble)
        and len(trainer.collector.scorer.reward_model.members) == 3
    )
    rollouts = recording_rollouts(trainer)
    metrics = trainer.ppo_step()
    rollout = rollouts[0]
    expected = separate_scores(members, rollout.sequence, rollout.attention_mask)  # (3, B)
    combined = combine(mode, 0.5, expected)
    torch.testing.assert_close(rollout.scores, combined, atol=1e-5, rtol=1e-5)
    for k in range(3):
        assert metrics[f"objective/scores_member_{k}"] == pytest.approx(float(expected[k].mean()), abs=1e-5)
    disagreement = reward_math.member_disagreement(member_scores=expected)
    assert metrics["objective/scores_disagreement"] == pytest.approx(float(disagreement.mean()), abs=1e-5)
    assert metrics["objective/scores_disagreement"] > 0.01
    assert metrics["objective/scores"] == pytest.approx(float(combined.mean()), abs=1e-5)
    assert metrics["objective/kl"] == 0.0  # the first step's invariants hold with an ensemble too
    if mode != "mean":  # min and mean - 0.5 std lie below the mean wherever the members disagree
        assert (combined < expected.mean(dim=0) - 1e-4).all()


def test_one_member_list_equals_one_reward_model_exactly(tiny_rm_dir, tiny_model_dir, prompt_file, tmp_path):
    """reward_model_path: [rm] goes through the ensemble code and gives the same PPO run as 'rm', bit for
    bit, in every mode; it logs the one member (equal to the score) and a disagreement of 0."""
    single = tiny_ppo_trainer(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "a"))
    plain = [single.ppo_step() for _ in range(2)]
    listed = tiny_ppo_trainer(
        ppo_config(
            tiny_model_dir,
            tiny_rm_dir,
            prompt_file,
            tmp_path / "b",
            reward_model_path=[str(tiny_rm_dir)],
            ensemble_combine="uncertainty",
            ensemble_uncertainty_coef=2.0,
        )
    )
    assert isinstance(listed.collector.scorer.reward_model, RewardEnsemble)
    ensembled = [listed.ppo_step() for _ in range(2)]
    for a, b in zip(plain, ensembled):
        for key, value in a.items():
            if not key.startswith(TIMES):
                assert b[key] == value or (math.isnan(value) and math.isnan(b[key])), key
        assert b["objective/scores_member_0"] == pytest.approx(a["objective/scores"], abs=1e-6)
        assert b["objective/scores_disagreement"] == 0.0
        assert set(b) - set(a) == {"objective/scores_member_0", "objective/scores_disagreement"}


def test_ppo_run_with_an_ensemble_logs_members_in_training_and_heldout(
    members, tiny_model_dir, prompt_file, tmp_path
):
    """`llm-rlhf ppo` with a YAML list on the command line: members in metrics.jsonl, eval_log.jsonl and
    the saved config; the held-out rm_score is the combined one."""
    out = tmp_path / "run"
    argv = [
        "ppo",
        "--model_name_or_path",
        str(tiny_model_dir),
        "--reward_model_path",
        f"[{', '.join(members[:2])}]",
        "--ensemble_combine",
        "min",
        "--prompt_file",
        str(prompt_file),
        "--output_dir",
        str(out),
        "--steps",
        "2",
        "--rollout_batch_size",
        "4",
        "--mini_batch_size",
        "2",
        "--ppo_epochs",
        "1",
        "--max_new_tokens",
        "6",
        "--save_steps",
        "0",
        "--log_samples_every",
        "1",
        "--eval_every",
        "1",
        "--eval_prompt_file",
        str(prompt_file),
        "--eval_num_prompts",
        "4",
        "--gold_judge",
        "none",
    ]
    assert cli.main(argv) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["reward_model_path"] == members[:2]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for m in steps:
        assert {
            "objective/scores_member_0",
            "objective/scores_member_1",
            "objective/scores_disagreement",
        } <= set(m)
    evals = [json.loads(line) for line in (out / "eval_log.jsonl").read_text().splitlines()]
    assert len(evals) == 3
    for record in evals:
        assert record["rm_score"] <= min(record["rm_score_member_0"], record["rm_score_member_1"]) + 1e-6
        assert record["rm_disagreement"] > 0
    assert "objective/scores_member_1" in read_json(out / "metrics.json")


def test_ensemble_and_reward_fn_add_up_in_ppo(members, tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """With a reward function beside the ensemble: scores = combined + reward_fn_weight * reward_fn per
    sequence, at the place PPO uses them (the scores given to `ppo_math.shaped_rewards`); the step logs the
    combined score as objective/rm_score, the function, and every member."""
    import reward_fns

    weight = 0.5
    cfg = ppo_config(
        tiny_model_dir,
        members[0],
        prompt_file,
        tmp_path,
        reward_model_path=members,
        ensemble_combine="min",
        reward_fn="reward_fns:length",
        reward_fn_weight=weight,
        ppo_epochs=1,
    )
    trainer = tiny_ppo_trainer(cfg)
    rollouts, seen, shaped = recording_rollouts(trainer), {}, ppo_math.shaped_rewards

    def recording_shaped(**kw):
        seen["scores"] = kw["scores"].clone()
        return shaped(**kw)

    monkeypatch.setattr(ppo_trainer.ppo_math, "shaped_rewards", recording_shaped)
    metrics = trainer.ppo_step()
    rollout, tok = rollouts[0], trainer.tokenizer
    combined = combine("min", 1.0, separate_scores(members, rollout.sequence, rollout.attention_mask))  # (B,)
    responses = [
        tok.decode(r[m & (r != tok.eos_token_id)], skip_special_tokens=True)
        for r, m in zip(rollout.response, rollout.response_mask)
    ]
    fn = torch.tensor(reward_fns.length([], responses))
    assert fn.std() > 0
    torch.testing.assert_close(seen["scores"], combined + weight * fn, atol=1e-5, rtol=1e-5)
    assert metrics["objective/rm_score"] == pytest.approx(float(combined.mean()), abs=1e-5)
    assert metrics["objective/reward_fn"] == pytest.approx(float(fn.mean()), abs=1e-6)
    assert metrics["objective/scores"] == pytest.approx(float((combined + weight * fn).mean()), abs=1e-5)
    assert {f"objective/scores_member_{k}" for k in range(3)} | {"objective/scores_disagreement"} <= set(
        metrics
    )


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------


def test_eval_with_an_ensemble_reports_each_member_and_the_combined_score(
    members, tiny_model_dir, prompt_file, tmp_path
):
    kw = dict(gold_judge="none", num_prompts=6, batch_size=3)
    ensemble = evaluate.run(
        eval_config(
            tiny_model_dir,
            tiny_model_dir,
            prompt_file,
            tmp_path / "ens",
            reward_model_path=members,
            ensemble_combine="uncertainty",
            ensemble_uncertainty_coef=0.5,
            **kw,
        )
    )
    for k, path in enumerate(members):  # each member's mean is that member's own evaluation
        alone = evaluate.run(
            eval_config(
                tiny_model_dir, tiny_model_dir, prompt_file, tmp_path / f"m{k}", reward_model_path=path, **kw
            )
        )
        assert ensemble[f"rm_score_member_{k}_mean"] == pytest.approx(alone["rm_score_mean"], abs=1e-5)
    samples = [json.loads(line) for line in (tmp_path / "ens" / "samples.jsonl").read_text().splitlines()]
    member_scores = torch.tensor([s["policy_rm_member_scores"] for s in samples]).T  # (K, N)
    combined = combine("uncertainty", 0.5, member_scores)  # (N,)
    assert [s["policy_rm_score"] for s in samples] == pytest.approx(combined.tolist(), abs=1e-5)
    assert ensemble["rm_score_mean"] == pytest.approx(float(combined.mean()), abs=1e-5)
    spread = reward_math.member_disagreement(member_scores=member_scores)
    assert (
        ensemble["rm_disagreement_mean"] == pytest.approx(float(spread.mean()), abs=1e-5) and spread.min() > 0
    )
    assert ensemble["rm_win_rate"] == 0.5  # policy = baseline: the combined scores tie pair by pair
    written = read_json(tmp_path / "ens" / "metrics.json")
    assert written["reward_model_path"] == members and written["ensemble_combine"] == "uncertainty"
    assert "rm_score_member_2_mean_baseline" in written


def test_eval_ensemble_and_reward_fn_add_up(members, tiny_model_dir, prompt_file, tmp_path):
    """combined_score = rm_score + reward_fn_weight * reward_fn, rm_score the ensemble's combined score."""
    import reward_fns

    metrics = evaluate.run(
        eval_config(
            tiny_model_dir,
            tiny_model_dir,
            prompt_file,
            tmp_path / "e",
            reward_model_path=members[:2],
            ensemble_combine="mean",
            reward_fn="reward_fns:length",
            reward_fn_weight=2.0,
            gold_judge="none",
            num_prompts=6,
            batch_size=3,
        )
    )
    samples = [json.loads(line) for line in (tmp_path / "e" / "samples.jsonl").read_text().splitlines()]
    fn = reward_fns.length([], [s["policy_response"] for s in samples])
    for s, f in zip(samples, fn):
        assert s["policy_rm_score"] == pytest.approx(sum(s["policy_rm_member_scores"]) / 2, abs=1e-6)
        assert s["policy_combined_score"] == pytest.approx(s["policy_rm_score"] + 2.0 * f, abs=1e-6)
    assert metrics["combined_score_mean"] == pytest.approx(
        metrics["rm_score_mean"] + 2.0 * metrics["reward_fn_mean"], abs=1e-5
    )


# ---------------------------------------------------------------------------------------------------
# Config errors: one line naming the key
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [ppo_trainer.Config, evaluate.Config])
@pytest.mark.parametrize(
    "values, key",
    [
        ({"reward_model_path": []}, "reward_model_path"),
        ({"reward_model_path": ["a", "a"]}, "reward_model_path"),
        ({"reward_model_path": ["a", "none"]}, "reward_model_path"),
        ({"ensemble_combine": "median"}, "ensemble_combine"),
        ({"ensemble_uncertainty_coef": -0.1}, "ensemble_uncertainty_coef"),
        ({"ensemble_uncertainty_coef": math.inf}, "ensemble_uncertainty_coef"),
    ],
)
def test_bad_ensemble_keys_are_config_errors_naming_the_key(config, values, key):
    with pytest.raises(ConfigError) as info:
        config(**values)
    message = str(info.value)
    assert message.startswith(f"config key '{key}':") and "\n" not in message


def test_a_list_on_the_command_line_parses_and_a_missing_member_is_one_error_line(
    members, tiny_model_dir, prompt_file, tmp_path, capsys
):
    cfg = parse_config(ppo_trainer.Config, ["--reward_model_path", "[a, b]", "--ensemble_combine", "min"])
    assert cfg.reward_model_path == ["a", "b"] and cfg.ensemble_combine == "min"
    missing = str(tmp_path / "rm-9")
    ppo_argv = [
        "ppo",
        "--model_name_or_path",
        str(tiny_model_dir),
        "--reward_model_path",
        f"[{members[0]}, {missing}]",
        "--prompt_file",
        str(prompt_file),
        "--output_dir",
        str(tmp_path / "ppo"),
        "--eval_every",
        "0",
    ]
    eval_argv = [
        "eval",
        "--policy_path",
        str(tiny_model_dir),
        "--baseline_path",
        str(tiny_model_dir),
        "--reward_model_path",
        f"[{members[0]}, {missing}]",
        "--gold_judge",
        "none",
        "--prompt_file",
        str(prompt_file),
        "--num_prompts",
        "2",
        "--output_dir",
        str(tmp_path / "eval"),
    ]
    for argv in (ppo_argv, eval_argv):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert (
            err == f"error: reward_model_path member 1 '{missing}': no such reward model folder "
            "(train one with `llm-rlhf rm`)\n"
        )
    assert not (tmp_path / "ppo").exists() and not (tmp_path / "eval").exists()
    assert cli.main(["ppo", "--ensemble_combine", "median"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: config key 'ensemble_combine': must be one of mean, min, uncertainty"
    )


# ---------------------------------------------------------------------------------------------------
# The pipeline trains the members
# ---------------------------------------------------------------------------------------------------


def test_bootstrap_indices_are_a_seeded_resample_with_replacement():
    a, b = reward.bootstrap_indices(200, seed=1), reward.bootstrap_indices(200, seed=2)
    assert a == reward.bootstrap_indices(200, seed=1) and a != b
    assert len(a) == 200 and all(0 <= i < 200 for i in a)
    assert 100 < len(set(a)) < 160  # ~ 1 - 1/e = 63% distinct


def test_member_configs_seeds_sweeps_and_chaining(tmp_path, monkeypatch):
    """Member k in DIR/rm-<k> with seed + k (bootstrap seed = that seed), PPO and eval read the list, eval
    takes PPO's combine; a sweep variant reads the shared members, a seed run seeds its members from its seed."""
    monkeypatch.chdir(ROOT)  # the recipe names its stage files relative to the repo root
    recipes = ROOT / "recipes" / "reviews"
    cfg = parse_config(
        pipeline.Config,
        [
            "--config",
            str(recipes / "pipeline.yaml"),
            "--output_dir",
            str(tmp_path),
            "--rm_members",
            "3",
            "--rm_bootstrap",
            "true",
            "--ppo",
            "{ensemble_combine: uncertainty, ensemble_uncertainty_coef: 0.25}",
        ],
    )
    rm_cfg = pipeline.stage_config(cfg, "rm")
    jobs = pipeline.rm_member_configs(cfg, rm_cfg)
    assert [(name, c.output_dir, c.seed, c.bootstrap_seed) for name, c in jobs] == [
        ("rm", str(tmp_path / "rm"), rm_cfg.seed, rm_cfg.seed),
        ("rm-1", str(tmp_path / "rm-1"), rm_cfg.seed + 1, rm_cfg.seed + 1),
        ("rm-2", str(tmp_path / "rm-2"), rm_cfg.seed + 2, rm_cfg.seed + 2),
    ]
    varied = ("output_dir", "seed", "bootstrap_seed")
    for _, member in jobs:  # every other key is the RM stage's
        assert {k: v for k, v in dataclasses.asdict(member).items() if k not in varied} == {
            k: v for k, v in dataclasses.asdict(rm_cfg).items() if k not in varied
        }
    listed = [str(tmp_path / d) for d in ("rm", "rm-1", "rm-2")]
    ppo_cfg, eval_cfg = pipeline.stage_config(cfg, "ppo"), pipeline.stage_config(cfg, "eval")
    assert ppo_cfg.reward_model_path == eval_cfg.reward_model_path == listed
    assert (eval_cfg.ensemble_combine, eval_cfg.ensemble_uncertainty_coef) == ("uncertainty", 0.25)
    # compare scores with the PPO run's own scorer (`compare.proxy_scorer`: the listed members, combined alike)
    assert pipeline.stage_config(cfg, "compare").ppo_dir == str(tmp_path / "ppo")

    sweep = dataclasses.replace(cfg, sweep=[{"name": "fixed", "kl_controller": "fixed"}])
    shared, variant = pipeline.sweep_runs(sweep)
    assert [name for name, _ in pipeline.rm_member_configs(shared, pipeline.stage_config(shared, "rm"))] == [
        "rm",
        "rm-1",
        "rm-2",
    ]
    assert pipeline.stage_config(variant, "ppo").reward_model_path == listed  # the shared members
    assert pipeline.stage_config(variant, "ppo").kl_controller == "fixed"

    seeded = pipeline.seed_run(dataclasses.replace(cfg, seeds=[7]), 7)
    jobs = pipeline.rm_member_configs(seeded, pipeline.stage_config(seeded, "rm"))
    assert [(c.output_dir, c.seed) for _, c in jobs] == [
        (str(tmp_path / "seed-7" / d), 7 + k) for k, d in enumerate(("rm", "rm-1", "rm-2"))
    ]
    with pytest.raises(ConfigError, match="config key 'rm_members'"):
        pipeline.Config(rm_members=0)


def test_eval_scores_each_sweep_variant_as_its_ppo_did(tmp_path, monkeypatch):
    """A sweep over one RM of an ensemble vs the whole ensemble (the over-optimisation comparison): each
    variant's evaluation reads the reward model(s), combine, reward function and stop controls its PPO
    used, not the pipeline's default list; the pipeline's eval overrides still win."""
    monkeypatch.chdir(ROOT)
    recipes = ROOT / "recipes" / "reviews"
    single = str(tmp_path / "rm")
    cfg = parse_config(
        pipeline.Config,
        [
            "--config",
            str(recipes / "pipeline.yaml"),
            "--output_dir",
            str(tmp_path),
            "--rm_members",
            "3",
            "--sweep",
            f"[{{name: single, reward_model_path: {single}, reward_fn: 'reward_fns:keyword', "
            "reward_fn_weight: 0.5, stop_strings: ['.'], min_new_tokens: 2}, "
            "{name: worst, ensemble_combine: min}]",
        ],
    )
    _, single_run, worst_run = pipeline.sweep_runs(cfg)
    members = [str(tmp_path / d) for d in ("rm", "rm-1", "rm-2")]
    for run_cfg, expected_rm in ((single_run, single), (worst_run, members)):
        ppo_cfg, eval_cfg = pipeline.stage_config(run_cfg, "ppo"), pipeline.stage_config(run_cfg, "eval")
        assert ppo_cfg.reward_model_path == eval_cfg.reward_model_path == expected_rm
        assert scored_as(eval_cfg) == scored_as(ppo_cfg)  # the scorer's keys and where responses end
        assert set(scored_as(ppo_cfg)) >= {
            "reward_model_path",
            "ensemble_combine",
            "ensemble_uncertainty_coef",
            "reward_fn",
            "reward_fn_weight",
            "stop_strings",
            "min_new_tokens",
        }
    single_eval = pipeline.stage_config(single_run, "eval")
    assert (single_eval.reward_fn, single_eval.reward_fn_weight) == ("reward_fns:keyword", 0.5)
    assert (single_eval.stop_strings, single_eval.min_new_tokens) == (["."], 2)
    assert pipeline.stage_config(worst_run, "eval").ensemble_combine == "min"
    overridden = dataclasses.replace(single_run, eval={"reward_model_path": members[1], "stop_strings": []})
    eval_cfg = pipeline.stage_config(overridden, "eval")
    assert (eval_cfg.reward_model_path, eval_cfg.stop_strings) == (members[1], [])


def test_the_readme_command_sets_up_an_ensemble(tmp_path, monkeypatch):
    """docs/guides/ensembles.md's command parses, and its stages read the three members with PPO's combine."""
    import re
    import shlex

    monkeypatch.chdir(ROOT)
    section = doc_section("guides/ensembles.md")
    command = re.search(r"^llm-rlhf pipeline .*$", section, re.MULTILINE).group(0)
    argv = shlex.split(command)[2:]
    argv[argv.index("--output_dir") + 1] = str(tmp_path)
    cfg = parse_config(pipeline.Config, argv)
    members = [str(tmp_path / d) for d in ("rm", "rm-1", "rm-2")]
    assert [name for name, _ in pipeline.rm_member_configs(cfg, pipeline.stage_config(cfg, "rm"))] == [
        "rm",
        "rm-1",
        "rm-2",
    ]
    for stage in ("ppo", "eval"):
        stage_cfg = pipeline.stage_config(cfg, stage)
        assert stage_cfg.reward_model_path == members and stage_cfg.ensemble_combine == "uncertainty", stage


@pytest.mark.slow
def test_pipeline_trains_the_members_and_chains_the_list(
    tmp_path, tiny_model_dir, sft_files, pref_files, prompt_file, monkeypatch, capsys
):
    """rm_members: 2 with rm_bootstrap through the whole pipeline: two RM folders (seeds s and s + 1, each on
    its own resample), PPO and eval on the ensemble (eval with PPO's combine), member curves in the report;
    a rerun skips both members."""

    monkeypatch.chdir(ROOT)
    out = tmp_path / "ens"
    argv = pipeline_argv(
        out, tiny_model_dir, sft_files, pref_files, prompt_file, rm_members="2", rm_bootstrap="true"
    )
    i = next(i for i, a in enumerate(argv) if a.startswith("--ppo="))
    ppo_keys = {**yaml.safe_load(argv[i].removeprefix("--ppo=")), "ensemble_combine": "min"}
    argv[i] = "--ppo=" + yaml.safe_dump(ppo_keys, default_flow_style=True, width=10_000).strip()
    pipeline.run(parse_config(pipeline.Config, argv))
    record = read_json(out / "pipeline.json")
    assert record.keys() == {"sft", "rm", "rm-1", "ppo", "eval"}
    configs = {
        d: yaml.safe_load((out / d / "config.yaml").read_text()) for d in ("rm", "rm-1", "ppo", "eval")
    }
    assert configs["rm-1"]["seed"] == configs["rm"]["seed"] + 1
    assert [configs[d]["bootstrap_seed"] for d in ("rm", "rm-1")] == [
        configs["rm"]["seed"],
        configs["rm"]["seed"] + 1,
    ]
    for d in ("rm", "rm-1"):
        metrics = read_json(out / d / "metrics.json")
        assert metrics["train_pairs_distinct"] < metrics["train_pairs"]  # a resample with repeats
        assert (out / d / "reward_normalization.json").is_file()
    assert read_json(out / "rm" / "reward_normalization.json") != read_json(
        out / "rm-1" / "reward_normalization.json"
    )
    members = [str(out / "rm"), str(out / "rm-1")]
    assert configs["ppo"]["reward_model_path"] == configs["eval"]["reward_model_path"] == members
    assert configs["ppo"]["ensemble_combine"] == configs["eval"]["ensemble_combine"] == "min"
    steps = [json.loads(line) for line in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert all("objective/scores_member_1" in m and m["objective/scores_disagreement"] > 0 for m in steps)
    heldout = [json.loads(line) for line in (out / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    assert all("rm_score_member_1" in r for r in heldout)
    final = record["eval"]["metrics"]
    assert {"rm_score_member_0_mean", "rm_score_member_1_mean", "rm_disagreement_mean"} <= final.keys()
    html = (out / "report.html").read_text()
    assert "Reward-model ensemble: member scores and disagreement" in html
    capsys.readouterr()
    pipeline.run(parse_config(pipeline.Config, argv))
    printed = capsys.readouterr().out
    assert "== rm: finished earlier" in printed and "== rm-1: finished earlier" in printed
