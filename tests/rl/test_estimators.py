"""The critic-free advantage estimators through the PPO stage: grpo, dr_grpo, rloo, reinforce_pp
and remax on the same rollout, KL, clipped update and checkpoints as gae; group sampling
(samples_per_prompt), where the KL goes (kl_in_loss), ReMax's greedy baseline, no value function, and the
config errors. The math itself is tested in tests/rl/test_group_advantages.py and tests/rl/test_ppo_math.py;
the two-process equivalence in tests/multiprocess/test_ppo_ddp_fsdp.py."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import signal

import pytest
import torch
from helpers import (
    COLON_CHAT_TEMPLATE,
    SENTIMENT_JUDGE,
    names_compared_outside,
    perturb,
    ppo_cli_args,
    ppo_config,
    record_raw_grads,
    recording_rollouts,
    tiny_ppo_trainer,
    with_chat_template,
)
from processes import ppo_command

from llm_rlhf.core.config import format_help, parse_config
from llm_rlhf.core.errors import ConfigError
from llm_rlhf.interfaces import cli
from llm_rlhf.models.loading import load_causal_lm
from llm_rlhf.ppo import building as ppo_building
from llm_rlhf.ppo import rollouts as ppo_rollouts
from llm_rlhf.ppo.config import Config, batch_sizes
from llm_rlhf.rl import ppo_math
from llm_rlhf.rl.estimators import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_KEYS,
    ESTIMATORS,
    ROWS,
    SAMPLER_CORRECTIONS,
    AdvantageInputs,
)
from llm_rlhf.stages import ppo

CRITIC_FREE = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "remax", "pass_at_k")
K = {"grpo": 4, "dr_grpo": 4, "rloo": 4, "reinforce_pp": 2, "remax": 2, "pass_at_k": 4}  # samples per prompt


def estimator_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, estimator, **kw):
    """2 prompts x k samples per rollout (8 or 4 episodes), minibatches of 4 episodes; pass_at_k for pass@(k // 2)."""
    k = kw.pop("samples_per_prompt", K.get(estimator, 1))
    if estimator == "pass_at_k":
        kw.setdefault("pass_k", max(1, k // 2))
    base = dict(
        advantage_estimator=estimator, samples_per_prompt=k, rollout_batch_size=8 // k, mini_batch_size=4
    )
    return ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, **{**base, **kw})


# --- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "key", "says"),
    [
        ({"advantage_estimator": "ppo"}, "advantage_estimator", "must be one of gae, grpo, dr_grpo"),
        ({"advantage_estimator": "grpo"}, "samples_per_prompt", "must be >= 2 for advantage_estimator grpo"),
        (
            {"advantage_estimator": "dr_grpo"},
            "samples_per_prompt",
            "must be >= 2 for advantage_estimator dr_grpo",
        ),
        ({"advantage_estimator": "rloo"}, "samples_per_prompt", "must be >= 2 for advantage_estimator rloo"),
        ({"samples_per_prompt": 0}, "samples_per_prompt", "must be >= 1"),
        (
            {"advantage_estimator": "rloo", "samples_per_prompt": 2, "value_model": "reward"},
            "value_model",
            r"'reward' is not used by advantage_estimator rloo \(only by gae\)",
        ),
        (
            {"advantage_estimator": "grpo", "samples_per_prompt": 4, "whiten_rewards": True},
            "whiten_rewards",
            r"True is not used by advantage_estimator grpo \(only by gae\)",
        ),
        (
            {"samples_per_prompt": 3, "rollout_batch_size": 4, "mini_batch_size": 8},
            "mini_batch_size",
            r"must divide the episodes of a rollout, rollout_batch_size \* samples_per_prompt \(12\)",
        ),
    ],
)
def test_config_errors_name_the_key(values, key, says):
    with pytest.raises(ConfigError, match=f"^config key '{key}': {says}"):
        Config(**values)


def test_a_group_that_fills_the_minibatch_is_accepted():
    """mini_batch_size counts episodes: 4 prompts x 3 samples in minibatches of 6 (not a multiple of k)."""
    cfg = Config(samples_per_prompt=3, rollout_batch_size=4, mini_batch_size=6, advantage_estimator="rloo")
    sizes = batch_sizes(
        rollout_batch_size=4,
        mini_batch_size=6,
        gradient_accumulation_steps=2,
        ppo_epochs=2,
        steps=5,
        num_processes=2,
        samples_per_prompt=cfg.samples_per_prompt,
    )
    assert (sizes.prompts_per_process, sizes.rollout_per_process, sizes.num_mini_batches) == (4, 12, 2)
    assert (sizes.micro_batch_per_process, sizes.optimizer_steps_per_ppo_step) == (3, 4)
    assert (sizes.prompts_per_step, sizes.episodes_per_step, sizes.total_episodes) == (8, 24, 120)


@pytest.mark.parametrize(
    ("estimator", "kl_in_loss", "in_loss"),
    [
        ("gae", None, False),
        ("grpo", None, True),
        ("dr_grpo", None, True),
        ("rloo", None, False),
        ("reinforce_pp", None, False),
        ("remax", None, False),
        ("pass_at_k", None, True),
        ("gae", True, True),
        ("grpo", False, False),
    ],
)
def test_kl_placement_defaults_to_the_published_form(estimator, kl_in_loss, in_loss):
    cfg = Config(advantage_estimator=estimator, samples_per_prompt=2, kl_in_loss=kl_in_loss)
    assert cfg.kl_penalty_in_loss is in_loss
    assert cfg.kl_in_loss is kl_in_loss  # resolved, not written back


# --- keys the chosen estimator does not read ------------------------------------------------------------

SET = {
    "gamma": 0.99,
    "lam": 0.9,
    "vf_coef": 0.5,
    "cliprange_value": 0.3,
    "whiten_rewards": True,
    "value_model": "reward",
    "pass_k": 2,
}  # a value other than the default of each key an estimator may ignore
IGNORED = [(row.name, key) for row in ROWS for key in row.ignored_keys]


def test_every_ignored_key_has_a_value_to_set_and_the_critic_free_rows_ignore_gamma_and_the_critic():
    assert {key for _, key in IGNORED} == set(SET)
    assert {name for name, key in IGNORED if key == "gamma"} == set(CRITIC_FREE)
    assert {name for name, key in IGNORED if key == "pass_k"} == set(ADVANTAGE_ESTIMATORS) - {"pass_at_k"}
    for row in ROWS:
        assert (set(CRITIC_KEYS) <= set(row.ignored_keys)) is (not row.critic), row.name


@pytest.mark.parametrize(("estimator", "key"), IGNORED)
def test_a_key_the_estimator_ignores_is_an_error_naming_it(estimator, key):
    """Set to another value than its default it is one ConfigError naming the key; at its default (a recipe
    that spells out every key, a run's saved config.yaml) it is accepted; the estimator that reads it (gae;
    pass_at_k for pass_k) takes it."""
    group = dict(advantage_estimator=estimator, samples_per_prompt=2)
    with pytest.raises(ConfigError) as e:
        Config(**group, **{key: SET[key]})
    default = getattr(Config(), key)
    user = "pass_at_k" if key == "pass_k" else "gae"
    assert str(e.value) == (
        f"config key '{key}': {SET[key]!r} is not used by advantage_estimator {estimator} (only by {user}): "
        f"remove it or leave it at its default {default!r}"
    )
    assert getattr(Config(**group, **{key: default}), key) == default
    reader = dict(advantage_estimator=user, samples_per_prompt=4)
    assert getattr(Config(**reader, **{key: SET[key]}), key) == SET[key]


def test_ignored_keys_through_the_command_and_a_recipe(tmp_path, capsys):
    """`llm-rlhf ppo` stops with one line naming the key and exit code 2, before anything is written; a YAML
    recipe is refused the same way."""
    out = tmp_path / "run"
    argv = ["ppo", "--advantage_estimator", "reinforce_pp", "--gamma", "0.99", "--output_dir", str(out)]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "error: config key 'gamma': 0.99 is not used by advantage_estimator reinforce_pp (only by gae): remove "
        "it or leave it at its default 1.0\n"
    )
    assert not out.exists()
    recipe = tmp_path / "ppo.yaml"
    recipe.write_text("advantage_estimator: grpo\nsamples_per_prompt: 4\nvf_coef: 0.2\nlam: 0.95\n")
    with pytest.raises(
        ConfigError, match=r"^config key 'vf_coef': 0.2 is not used by advantage_estimator grpo"
    ):
        parse_config(Config, ["--config", str(recipe)])
    recipe.write_text("advantage_estimator: grpo\nsamples_per_prompt: 4\nvf_coef: 0.1\nlam: 0.95\n")
    assert parse_config(Config, ["--config", str(recipe)]).vf_coef == 0.1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--init_kl_coef", "-0.1"], "must be >= 0"),
        (
            ["--init_kl_coef", "0"],
            "is 0 with kl_controller 'adaptive', which multiplies beta at each step and so keeps it at 0",
        ),
    ],
)
def test_kl_coefficient_errors_name_the_key(argv, says, capsys):
    with pytest.raises(ConfigError, match=f"^config key 'init_kl_coef': {says}"):
        parse_config(Config, argv)
    assert cli.main(["ppo", *argv]) == 2
    assert capsys.readouterr().err.startswith(f"error: config key 'init_kl_coef': {says}")
    assert Config(init_kl_coef=0.0, kl_controller="fixed").init_kl_coef == 0.0  # no KL penalty: fixed at 0


# --- the table agrees with what the estimators do ---------------------------------------------------------


def table_inputs(*, scale: float = 1.0) -> AdvantageInputs:
    """A rollout of 2 prompts x 4 responses of different lengths: a KL-like reward on every token and a score
    at the last one, old values and greedy scores; all multiplied by `scale`."""
    g = torch.Generator().manual_seed(0)
    B, R, k = 8, 5, 4
    lengths = torch.tensor([5, 3, 4, 2, 5, 1, 4, 3])
    mask = torch.arange(R)[None, :] < lengths[:, None]  # (B, R) each response a prefix of its row
    rewards = -0.1 * torch.rand(B, R, generator=g, dtype=torch.float64)  # (B, R)
    rewards[torch.arange(B), lengths - 1] += torch.randn(B, generator=g, dtype=torch.float64)  # the scores
    values = torch.randn(B, R, generator=g, dtype=torch.float64)
    greedy = torch.randn(B // k, generator=g, dtype=torch.float64)  # (P,)
    return AdvantageInputs(
        rewards=scale * torch.where(mask, rewards, 0),
        response_mask=mask,
        values=scale * values,
        baseline=scale * greedy,
        samples_per_prompt=k,
        gamma=1.0,
        lam=0.95,
        reduce_sum=None,
    )


def test_table_is_the_accepted_names_and_the_help():
    assert ADVANTAGE_ESTIMATORS == tuple(ESTIMATORS) == tuple(row.name for row in ROWS)
    assert ADVANTAGE_ESTIMATORS == ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "remax", "pass_at_k")
    assert tuple(r for r in ADVANTAGE_ESTIMATORS if r != "gae") == CRITIC_FREE
    with pytest.raises(ConfigError, match=f"must be one of {', '.join(ADVANTAGE_ESTIMATORS)}$"):
        Config(advantage_estimator="ppo")
    text = format_help(Config)
    for row in ROWS:
        assert f"'{row.name}' ({row.description})" in " ".join(text.split())


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_each_row_agrees_with_its_advantage_function(row):
    """critic: returns for a value loss; min_samples_per_prompt: a group of one is refused below it;
    std_scaling: rewards 3x larger give the same advantages when divided by a std, 3x larger otherwise;
    greedy_baseline: the greedy scores move the advantages; ignored gamma and lam change nothing;
    'gspo' accepted where the advantage is one number per response."""
    x = table_inputs()
    advantages, returns = row.advantages(x)
    mask = x.response_mask
    assert advantages.shape == mask.shape and (advantages[~mask] == 0).all()
    assert (returns is not None) is row.critic
    if row.min_samples_per_prompt >= 2:
        with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
            row.advantages(dataclasses.replace(x, samples_per_prompt=1))
    else:
        row.advantages(dataclasses.replace(x, samples_per_prompt=1, baseline=x.baseline.repeat_interleave(4)))
    scaled, _ = row.advantages(table_inputs(scale=3.0))
    expected = advantages if row.std_scaling in ("batch", "group") else 3 * advantages
    assert row.std_scaling in ("batch", "group", "none")
    # grpo's std carries eps = 1e-4 and the whitening 1e-8 under the root: equal to their relative size
    torch.testing.assert_close(scaled, expected, rtol=1e-3, atol=1e-6)
    moved, _ = row.advantages(dataclasses.replace(x, baseline=x.baseline + 1.0))
    assert (not torch.equal(moved, advantages)) is row.greedy_baseline
    for key, other in (("gamma", 0.9), ("lam", 0.5)):
        changed, _ = row.advantages(dataclasses.replace(x, **{key: other}))
        assert torch.equal(changed, advantages) is (key in row.ignored_keys), key
    one_per_response = bool((advantages == advantages[:, :1]).logical_or(~mask).all())
    assert row.response_advantages is one_per_response  # what a sequence-level ratio (gspo) needs
    assert row.dynamic_sampling is (row.min_samples_per_prompt >= 2)  # only a group baseline ties in a group
    assert set(row.corrections) == set(SAMPLER_CORRECTIONS)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_each_row_builds_a_value_function_only_with_a_critic(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, row
):
    """`llm-rlhf ppo`'s models: a value head on the policy for a row with a critic, none for the others; the KL
    in the loss where the row puts it (`kl_in_loss` null)."""
    cfg = estimator_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        row.name,
        samples_per_prompt=max(2, row.min_samples_per_prompt),
    )
    models = ppo_building.build_models(cfg)
    assert (models.policy.value_head is not None) is row.critic and models.critic is None
    assert cfg.estimator is row and cfg.kl_penalty_in_loss is row.kl_in_loss


def test_no_branch_on_an_estimator_name_outside_the_table():
    """Outside `llm_rlhf/rl/estimators.py` no comparison names an estimator (`x == "gae"`, `x in ("grpo", ...)`):
    what an estimator is, is its row."""
    assert names_compared_outside("estimators.py", ADVANTAGE_ESTIMATORS) == []


# --- every estimator trains the policy, and nothing else ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_each_estimator_trains_every_parameter_without_a_value_function(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, estimator
):
    """Two steps through `llm-rlhf ppo`'s run (a checkpoint after the first): every trainable parameter
    changes; no value head is built, logged, checkpointed or saved."""
    out = tmp_path / "run"
    cfg = estimator_config(
        tiny_model_dir, tiny_rm_dir, prompt_file, out, estimator, save_steps=1, eval_every=0
    )
    trainer = tiny_ppo_trainer(cfg)
    assert trainer.unwrapped_policy.value_head is None and trainer.critic is None
    before = {
        n: p.detach().clone() for n, p in trainer.unwrapped_policy.named_parameters() if p.requires_grad
    }
    metrics = [trainer.ppo_step() for _ in range(cfg.steps)]
    unchanged = [n for n, p in trainer.unwrapped_policy.named_parameters() if torch.equal(p, before[n])]
    assert before and not unchanged, unchanged
    for m in metrics:
        assert not [k for k in m if k.startswith("val/") or k == "loss/value"], m
        assert ("loss/kl" in m) is cfg.kl_penalty_in_loss
        assert m["episodes"] == m["step"] * 8
        for key in (
            "objective/scores",
            "objective/kl",
            "objective/kl_coef",
            "loss/policy",
            "policy/clipfrac",
        ):
            assert key in m
    assert metrics[0]["objective/kl"] == 0.0  # policy == reference before the first update
    assert metrics[1]["objective/kl"] != 0.0  # the policy moved
    assert metrics[1]["objective/kl_coef"] != metrics[0]["objective/kl_coef"]  # the adaptive controller

    ppo.run(cfg)  # the command: checkpoints and the final folder
    assert not (out / "value_head.safetensors").exists() and not (out / "critic").exists()
    from safetensors.torch import load_file

    saved = load_file(out / "checkpoints" / "step-1" / "policy_trainable.safetensors")
    assert saved and all(name.startswith("lm.") for name in saved)
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 2 and not any(k.startswith("val/") for k in logged[-1])


# --- the advantages: each group's own samples, the rollout's rewards -------------------------------------


def naive_advantages(
    estimator: str, rewards: list[float], k: int, baseline: list[float] | None
) -> list[float]:
    """One advantage per response from the sequence rewards, group by group, written out (each estimator's
    formula)."""
    out = []
    for p in range(len(rewards) // k):
        r = rewards[p * k : (p + 1) * k]
        mean = sum(r) / k
        for i in range(k):
            if estimator == "grpo":
                std = (sum((x - mean) ** 2 for x in r) / (k - 1)) ** 0.5
                out.append((r[i] - mean) / (std + 1e-4))
            elif estimator == "dr_grpo":
                out.append(r[i] - mean)
            elif estimator == "rloo":
                out.append(r[i] - sum(r[j] for j in range(k) if j != i) / (k - 1))
            elif estimator == "pass_at_k":  # pass@(k // 2) weights, each subset's best wherever i is in it,
                subsets = list(itertools.combinations(range(k), k // 2))  # then GRPO's normalisation
                share = [
                    sum(max(r[j] for j in s) for s in subsets if m in s) / len(subsets) for m in range(k)
                ]
                centred = [v - sum(share) / k for v in share]
                std = (sum(v**2 for v in centred) / (k - 1)) ** 0.5
                out.append(centred[i] / (std + 1e-4))
            else:  # remax
                out.append(r[i] - baseline[p])
    return out


def sequence_rewards(rollout, beta: float) -> list[float]:
    """score - beta * sum_t (log pi - log pi_ref) over each response (the KL in the reward, k1)."""
    kl = ((rollout.logprobs - rollout.ref_logprobs) * rollout.response_mask).double().sum(-1)
    return (rollout.scores.double() - beta * kl).tolist()


def recording_advantages(trainer) -> list:
    """Keep the advantages (B, R) each `train_on_rollout` call is given."""
    kept, real = [], trainer.train_on_rollout

    def train_on_rollout(rollout, advantages, returns):
        kept.append(advantages)
        return real(rollout, advantages, returns)

    trainer.train_on_rollout = train_on_rollout
    return kept


@pytest.mark.slow
@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_advantages_are_each_groups_own(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, estimator):
    """3 prompts x 4 samples, in minibatches of 6 and micro-batches of 2 (neither a multiple of k = 4), on the
    second step (the policy has moved: the sequence rewards hold -beta * KL, the KL in the reward): rows
    p*k .. p*k + k - 1 hold prompt p, and the advantages `train_on_rollout` gets are the estimators' formulas over
    exactly those rows, written out group by group (ReMax: against the greedy response to prompt p, its
    score and KL measured as the samples' are; REINFORCE++: gamma = 1 returns whitened over the batch)."""
    k, beta = 4, 0.5
    cfg = estimator_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        estimator,
        samples_per_prompt=k,
        rollout_batch_size=3,
        mini_batch_size=6,
        gradient_accumulation_steps=3,
        kl_in_loss=False,
        kl_controller="fixed",
        init_kl_coef=beta,
        learning_rate=1e-2,
    )
    trainer = tiny_ppo_trainer(cfg)
    trainer.ppo_step()
    queries = trainer.collector.queries(trainer.step)
    rollouts, advantages = recording_rollouts(trainer), recording_advantages(trainer)
    metrics = trainer.ppo_step()
    rollout, (given,) = rollouts[0], advantages
    mask = rollout.response_mask
    for row in range(len(queries) * k):
        assert rollout.query[row][rollout.query_mask[row].bool()].tolist() == queries[row // k], row
    groups = [rollout.scores[p * k : (p + 1) * k] for p in range(len(queries))]
    expected_std = sum(float(g.std()) for g in groups) / len(groups)
    assert metrics["objective/group_scores_std"] == pytest.approx(expected_std, rel=1e-5)
    assert metrics["objective/groups_tied"] == sum(bool((g == g[0]).all()) for g in groups) / len(groups)
    if estimator == "reinforce_pp":
        rewards = torch.zeros_like(rollout.logprobs, dtype=torch.float64)
        for b in range(mask.shape[0]):
            tokens = mask[b].nonzero().flatten().tolist()
            for t in tokens:
                rewards[b, t] = -beta * float(rollout.logprobs[b, t] - rollout.ref_logprobs[b, t])
            rewards[b, tokens[-1]] += float(rollout.scores[b])
        returns = rewards.flip(-1).cumsum(-1).flip(-1)[mask]  # every row's mask is a prefix
        expected = torch.zeros_like(rewards)
        expected[mask] = (returns - returns.mean()) / returns.std()
        torch.testing.assert_close(given.double(), expected, atol=1e-4, rtol=1e-4)
        return
    baseline = None
    if estimator == "remax":
        greedy = rollouts[1]
        assert greedy.query.shape[0] == len(queries)
        for p, q in enumerate(queries):
            assert greedy.query[p][greedy.query_mask[p].bool()].tolist() == q
        baseline = sequence_rewards(greedy, beta)
    rewards = sequence_rewards(rollout, beta)
    assert len(set(round(r, 4) for r in rewards)) > len(queries), "the samples of a prompt differ"
    expected = torch.tensor(naive_advantages(estimator, rewards, k, baseline), dtype=torch.float64)
    torch.testing.assert_close(given.double(), torch.where(mask, expected[:, None], 0), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_micro_batches_not_aligned_with_groups_give_the_same_updates(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """grpo, 3 prompts x 4 samples, minibatches of 12: one micro-batch, or 4 micro-batches of 3 that cut
    every group. The raw gradients of both epochs (before clipping) are the same: the group statistics are
    taken over the whole rollout before any minibatch."""
    grads = {}
    for ga in (1, 4):
        cfg = estimator_config(
            tiny_model_dir,
            tiny_rm_dir,
            prompt_file,
            tmp_path / str(ga),
            "grpo",
            samples_per_prompt=4,
            rollout_batch_size=3,
            mini_batch_size=12,
            gradient_accumulation_steps=ga,
            max_grad_norm=1e9,
            steps=1,
        )
        trainer = tiny_ppo_trainer(cfg)
        grads[ga] = []
        record_raw_grads(trainer, grads[ga])
        trainer.ppo_step()
    assert len(grads[1]) == len(grads[4]) == 2 and grads[1][0].abs().max() > 0
    (a1, a2), (b1, b2) = grads[1], grads[4]
    torch.testing.assert_close(b1, a1, atol=1e-7, rtol=1e-4)  # the same weights: float32 summation order only
    # The second epoch's weights come from an Adam step on those first gradients, which differ by the summation
    # order of 1 vs 4 micro-batches (~2e-8 here); Adam divides by sqrt(v), so a weight whose gradient is tiny
    # moves by a step of full size either way and the rounding difference grows: compare the second gradients
    # to their own scale (1e-5 of the largest entry, ~1e-6 here; a group statistic over the wrong responses
    # changes entries by their own size, median ~4e-4).
    torch.testing.assert_close(b2, a2, atol=1e-5 * float(a2.abs().max()), rtol=1e-4)


# --- where the KL goes --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["gae", "rloo", "remax"])
def test_kl_in_the_loss(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch, estimator):
    """kl_in_loss true: the rewards hold the score alone (gae's GAE sees it at the last token, rloo's and
    remax's advantages are those of the scores) and the loss adds beta * k3, beta being the controller's
    value at the rollout; the controller still follows the observed KL (k1)."""
    cfg = estimator_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        estimator,
        kl_in_loss=True,
        learning_rate=1e-2,
        init_kl_coef=0.3,
    )
    trainer = tiny_ppo_trainer(cfg)
    first = trainer.ppo_step()
    seen = {"kl_coef": [], "rewards": []}
    kl_loss, shaped = ppo_math.kl_loss, ppo_math.shaped_rewards

    def recording_kl_loss(**kw):
        seen["kl_coef"].append(kw["kl_coef"])
        return kl_loss(**kw)

    def recording_shaped(**kw):
        out = shaped(**kw)
        seen["rewards"].append((kw, out[0]))
        return out

    monkeypatch.setattr(ppo_math, "kl_loss", recording_kl_loss)
    monkeypatch.setattr(ppo_math, "shaped_rewards", recording_shaped)
    rollouts = recording_rollouts(trainer)
    second = trainer.ppo_step()
    beta = second["objective/kl_coef"]
    assert beta != first["objective/kl_coef"], "the adaptive controller moved after step 1"
    assert second["objective/kl"] != 0.0 and second["loss/kl"] > 0.0
    assert seen["kl_coef"] and set(seen["kl_coef"]) == {beta}
    for (kw, rewards), rollout in zip(seen["rewards"], rollouts):
        mask = rollout.response_mask
        assert kw["kl_coef"] == 0.0
        last = mask.sum(-1) - 1
        expected = torch.zeros_like(rewards)
        expected[torch.arange(len(last)), last] = rollout.scores
        assert torch.equal(rewards, expected)
    # logged as the objective with the KL penalised: -beta * KL per sequence
    assert second["objective/non_score_reward"] == pytest.approx(-beta * second["objective/kl"], rel=1e-5)


def row_tokens(rollout, b: int) -> tuple[list[int], list[int]]:
    """Row b's real query and response tokens (no padding)."""
    query = rollout.query[b][rollout.query_mask[b].bool()].tolist()
    response = rollout.response[b][rollout.response_mask[b]].tolist()
    return query, response


def response_logprobs_alone(lm, query: list[int], response: list[int]) -> torch.Tensor:
    """log p(y_t | x, y_<t) of each response token, the row alone (no padding), at temperature 1. (T,)"""
    ids = torch.tensor([query + response])
    logits = lm(input_ids=ids).logits[0, len(query) - 1 : -1]  # (T, V): position t predicts response token t
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_kl_in_the_loss_gradient_is_beta_times_the_gradient_of_token_mean_k3(
    tiny_model_dir, prompt_file, tmp_path
):
    """grpo with its KL in the loss and a constant score (every group tied: every advantage 0, the policy loss
    has zero gradient), the policy moved off the reference: the raw gradient of the one update (before
    clipping) is beta * grad of the token mean of k3 over the minibatch, computed here row by row with the
    reference loaded again from its folder, and it is not zero. Fails if k3 is detached (zero gradient) or
    taken against the old policy (zero at the first epoch, where the policy is the old one)."""
    beta = 0.5
    cfg = ppo_config(
        tiny_model_dir,
        None,
        prompt_file,
        tmp_path,
        reward_fn="reward_fns:half",
        advantage_estimator="grpo",
        samples_per_prompt=4,
        rollout_batch_size=2,
        mini_batch_size=8,
        ppo_epochs=1,
        steps=1,
        kl_controller="fixed",
        init_kl_coef=beta,
        max_grad_norm=1e9,
    )
    assert cfg.kl_penalty_in_loss
    trainer = tiny_ppo_trainer(cfg)
    perturb(trainer.unwrapped_policy, seed=0)
    before = copy.deepcopy(trainer.unwrapped_policy)  # the weights the update's gradient is taken at
    rollouts, raw = recording_rollouts(trainer), []
    record_raw_grads(trainer, raw)
    metrics = trainer.ppo_step()
    assert metrics["objective/groups_tied"] == 1.0 and metrics["loss/kl"] > 0
    assert len(raw) == 1, "one optimiser step"

    rollout, reference = rollouts[0], load_causal_lm(str(tiny_model_dir)).eval()
    k3_sum, tokens = 0.0, int(rollout.response_mask.sum())
    for b in range(rollout.query.shape[0]):
        query, response = row_tokens(rollout, b)
        logp = response_logprobs_alone(before.lm, query, response)  # (T,) with grad
        with torch.no_grad():
            ref = response_logprobs_alone(reference, query, response)  # (T,)
        k3_sum = k3_sum + (torch.exp(ref - logp) - (ref - logp) - 1).sum()
    (beta * k3_sum / tokens).backward()
    expected = torch.cat([p.grad.flatten() for p in before.parameters() if p.requires_grad])
    assert expected.abs().max() > 1e-4 and raw[0].abs().max() > 1e-4
    torch.testing.assert_close(raw[0], expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4)


# --- ReMax's greedy baseline ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_remax_baseline_is_the_greedy_response(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """Each step samples the rollout, then one greedy response per prompt (the same sampler at temperature 0,
    which draws no random number, so the sampling stream is that of any other estimator): each of its tokens
    is the argmax of the policy's next-token logits."""
    from llm_rlhf.rl.rollout import response_logits

    cfg = estimator_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, "remax", max_new_tokens=6)
    trainer = tiny_ppo_trainer(cfg)
    calls, real_sample = [], ppo_rollouts.sample

    def counting(lm, tokenizer, query, query_mask, sampling, **kw):
        calls.append((query.shape[0], sampling.temperature))
        return real_sample(lm, tokenizer, query, query_mask, sampling, **kw)

    monkeypatch.setattr(ppo_rollouts, "sample", counting)  # the rollout collector's sampler
    rollouts = recording_rollouts(trainer)
    policy_at_rollout = copy.deepcopy(trainer.unwrapped_policy.lm)
    metrics = trainer.ppo_step()
    assert calls == [(8, 1.0), (4, 0.0)]
    assert "objective/greedy_scores" in metrics
    greedy = rollouts[1]
    logits = response_logits(policy_at_rollout, greedy)  # (P, R, V)
    mask = greedy.response_mask
    assert torch.equal(logits.argmax(-1)[mask], greedy.response[mask])
    state = torch.get_rng_state()
    trainer.collector.generate(trainer.collector.queries(trainer.step), sampling=trainer.greedy)
    assert torch.equal(torch.get_rng_state(), state)


# --- exact resume after kill -9 -----------------------------------------------------------------------------


@pytest.mark.slow
def test_grpo_killed_and_resumed_ends_bit_identical(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """grpo, 2 prompts x 4 samples, held-out evaluation every 2 steps, a checkpoint every 2 steps. One run
    goes 4 steps straight; another is killed with SIGKILL as step 4 starts (step 3 logged, the step-2
    checkpoint on disk), then resumed with --resume true: its logs and its final weights are those of the
    uninterrupted run, bit for bit (the same sampling stream, group by group, from the checkpoint's RNG), the
    held-out accuracy (accuracy_fn, with its greedy pass) included."""
    from safetensors.torch import load_file

    def command(out, *more, kill_at=None):
        args = ppo_cli_args(
            tiny_model_dir,
            tiny_rm_dir,
            prompt_file,
            out,
            4,
            advantage_estimator="grpo",
            samples_per_prompt=4,
            rollout_batch_size=2,
            mini_batch_size=4,
            save_steps=2,
            eval_every=2,
            eval_prompt_file=prompt_file,
            eval_num_prompts=4,
            gold_judge=SENTIMENT_JUDGE,
            lr_scheduler_type="linear",
            accuracy_fn="tests/reward_fns.py:even_length",
        )
        return ppo_command(args, *more, kill_at=kill_at)

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess_ok(command(straight))
    crash = command(killed, kill_at=4)
    assert crash.returncode == -signal.SIGKILL, crash.stderr[-2000:]
    assert len((killed / "metrics.jsonl").read_text().splitlines()) == 3
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step-2"]
    assert not (killed / "metrics.json").exists()
    resumed = subprocess_ok(command(killed, "--resume", "true"))
    assert "resumed from" in resumed.stdout

    for name in ("metrics.jsonl", "eval_log.jsonl"):
        a, b = ([json.loads(x) for x in (d / name).read_text().splitlines()] for d in (straight, killed))
        assert [m["step"] for m in b] == [m["step"] for m in a] and len(a) == (
            4 if name == "metrics.jsonl" else 3
        )
        assert name == "metrics.jsonl" or all(m["accuracy_greedy"] is not None for m in a)
        for ma, mb in zip(a, b):
            assert {k: v for k, v in mb.items() if not k.startswith(("time/", "tokens_per_s"))} == {
                k: v for k, v in ma.items() if not k.startswith(("time/", "tokens_per_s"))
            }, ma["step"]
    final_a, final_b = (load_file(d / "model.safetensors") for d in (straight, killed))
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(final_a[k], initial[k]) for k in initial)
    assert not (killed / "value_head.safetensors").exists()


def subprocess_ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# --- what works with gae works with each estimator -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("estimator", "setting"),
    [
        ("grpo", "lora_and_stop_strings"),
        ("dr_grpo", "chat_prompts"),
        ("rloo", "reward_fn_alone"),
        ("reinforce_pp", "reward_model_and_reward_fn"),
        ("remax", "ensemble"),
    ],
)
def test_estimators_with_the_options_of_gae(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, estimator, setting
):
    """`llm-rlhf ppo`'s run, 2 steps with held-out evaluation before and after each: LoRA, stop strings and
    min_new_tokens, chat `messages` prompts (the tokenizer's template), a reward function alone or added to
    the RM's score, an RM ensemble; the final folder holds the policy and nothing of a value function."""
    import shutil

    from helpers import write_jsonl

    kw = {}
    if setting == "lora_and_stop_strings":
        kw = dict(use_lora=True, stop_strings=["e", "a"], min_new_tokens=2)
    elif setting == "chat_prompts":
        chat_model = with_chat_template(tiny_model_dir, tmp_path / "chat_model", COLON_CHAT_TEMPLATE)
        chats = [
            [{"role": "user", "content": p}] for p in ("The film is", "A gorgeous", "The acting", "It's a")
        ]
        chat_file = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in chats])
        kw = dict(model_name_or_path=str(chat_model), eval_prompt_file=str(chat_file))
        prompt_file = chat_file
    elif setting == "reward_fn_alone":
        kw = dict(reward_model_path=None, reward_fn="reward_fns:keyword")
    elif setting == "reward_model_and_reward_fn":
        kw = dict(reward_fn="reward_fns:length", reward_fn_weight=0.5)
    else:
        second = tmp_path / "member"
        shutil.copytree(tiny_rm_dir, second)
        kw = dict(reward_model_path=[str(tiny_rm_dir), str(second)], ensemble_combine="min")
    out = tmp_path / "run"
    kw = {"eval_prompt_file": str(prompt_file), **kw}
    cfg = estimator_config(
        tiny_model_dir, tiny_rm_dir, prompt_file, out, estimator, eval_every=1, eval_num_prompts=4, **kw
    )
    final = ppo.run(cfg)
    assert final["step"] == 2 and not any(k.startswith("val/") for k in final)
    assert len((out / "eval_log.jsonl").read_text().splitlines()) == 3  # steps 0, 1, 2
    assert (out / "model.safetensors").is_file() and not (out / "value_head.safetensors").exists()
    if setting == "lora_and_stop_strings":
        assert (out / "adapter" / "adapter_config.json").is_file()
    if setting in ("reward_fn_alone", "reward_model_and_reward_fn"):
        assert "objective/reward_fn" in final
    if setting == "ensemble":
        assert "objective/scores_member_1" in final and "objective/greedy_scores" in final
