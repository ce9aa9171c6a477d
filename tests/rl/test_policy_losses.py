"""The policy-loss table (`llm_rlhf/rl/policy_losses.py`): its names are the config's choices and
the help's, no code outside it branches on a loss's name, each row's facts agree with its function (the clip
keys it reads, one ratio per response, its paper's aggregation), and the config reads the row: the clip keys
a loss does not read are errors naming the key, `loss_aggregation` null is the row's, an explicit one wins
with a note where it departs from the paper. The math and its worked examples (SAPO's too) are
tests/rl/test_loss_family.py; the losses through the trainer tests/ppo/test_loss_options.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import (
    F64,
    REWARD_FNS,
    names_compared_outside,
    ppo_cli_args,
    ppo_config,
)

from llm_rlhf.core.config import format_help
from llm_rlhf.core.errors import ConfigError
from llm_rlhf.ppo.config import Config
from llm_rlhf.rl import estimators, loss_math, ppo_math
from llm_rlhf.rl.estimators import names
from llm_rlhf.rl.policy_losses import CLIP_KEYS, DEFAULT_LOSS, LOSSES, POLICY_LOSSES, ROWS, LossInputs


def grpo(**kw) -> Config:
    """A grpo config (one advantage per response: every loss is accepted), `kw` wins."""
    return ppo_config(
        "m", "rm", "p.jsonl", "out", **{"advantage_estimator": "grpo", "samples_per_prompt": 2, **kw}
    )


def wild_inputs(**clip) -> LossInputs:
    """A minibatch where every clip binds somewhere: per-response advantages of both signs, log-ratios of
    std 0.5 (some responses' mean beyond any clip tried below) and one ratio of e^2 under a negative A (the
    dual clip at c = 3 and 5 binds differently there)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([5, 3, 4, 2, 5, 1]).unsqueeze(1)  # (6, 5)
    old = 0.5 * torch.randn(6, 5, generator=g, dtype=F64)
    logprobs = old + 0.5 * torch.randn(6, 5, generator=g, dtype=F64)
    logprobs[1, 0] = old[1, 0] + 2.0  # rho = e^2 on a response with A < 0
    a = torch.tensor([0.8, -1.2, 0.5, -0.3, -0.9, 1.5], dtype=F64)
    advantages = ppo_math.token_advantages(advantages=a, response_mask=mask)
    base = dict(cliprange_low=0.2, cliprange_high=0.28, dual_clip=3.0)
    return LossInputs(
        logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, **{**base, **clip}
    )


# --- the table is the config's choices ------------------------------------------------------------------


def test_table_is_the_accepted_names_and_the_help():
    assert POLICY_LOSSES == tuple(LOSSES) == tuple(row.name for row in ROWS)
    assert DEFAULT_LOSS in LOSSES and Config().policy_loss == DEFAULT_LOSS
    with pytest.raises(ConfigError, match=f"must be one of {', '.join(POLICY_LOSSES)}$"):
        Config(policy_loss="ppo")
    text = " ".join(format_help(Config).split())
    for row in ROWS:
        assert f"'{row.name}' ({row.description}" in text
        assert f"{row.aggregation} for {row.name}" in text  # loss_aggregation's null, per loss


def test_no_branch_on_a_loss_name_outside_the_table():
    """Outside `llm_rlhf/rl/policy_losses.py` no comparison names a policy loss (`x == "gspo"`,
    `"gspo" in row.policy_losses`, `x in ("ppo_clip", ...)`): what a loss is, is its row."""
    assert names_compared_outside("policy_losses.py", POLICY_LOSSES) == []


# --- each row agrees with its function -------------------------------------------------------------------


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_each_row_agrees_with_its_function(row):
    """clip_keys: a key the row reads changes its losses, one it does not read changes nothing;
    response_advantages: its ratio is one per response; aggregations: known modes; plain: only a row that
    reads every clip key (PPO's symmetric clip is its default)."""
    x = wild_inputs()
    losses, stats = row.token_losses(x)
    mask = x.response_mask
    assert losses.shape == mask.shape and (losses[~mask] == 0).all() and losses.isfinite().all()
    for key, other in (("cliprange_low", 0.05), ("cliprange_high", 0.05), ("dual_clip", 5.0)):
        changed, _ = row.token_losses(dataclasses.replace(x, **{key: other}))
        assert (not torch.equal(changed, losses)) is (key in row.clip_keys), key
    assert set(row.clip_keys) <= set(CLIP_KEYS)
    assert all(d is None for d, key in zip(row.clip_defaults, CLIP_KEYS) if key not in row.clip_keys)
    same = torch.isclose(stats.ratio, stats.ratio[:, :1], rtol=1e-12, atol=0)  # (B, T), up to float rounding
    one_ratio = bool((same | ~mask).all())
    assert one_ratio is row.response_advantages
    assert row.aggregations and set(row.aggregations) <= set(loss_math.LOSS_AGGREGATIONS)
    assert row.aggregation == row.aggregations[0]
    assert not row.plain or set(row.clip_keys) == set(CLIP_KEYS)
    assert row.sampler_correction  # every loss today takes the TIS / MIS weights


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_the_config_reads_the_row(row):
    """loss_aggregation null is the row's; an explicit one wins, with a note where it is not the paper's; the
    clip ranges resolve to the row's defaults; the plain update only for a plain row at its defaults."""
    cfg = grpo(policy_loss=row.name)
    assert cfg.policy_loss_row is row and cfg.loss_aggregation is None
    assert cfg.aggregation == row.aggregation and cfg.notes == ()
    assert cfg.plain_policy_loss is (row.plain and row.aggregation == "token_mean")
    for side, (resolved, default) in enumerate(zip((cfg.clip_low, cfg.clip_high), row.clip_defaults)):
        if CLIP_KEYS[side] in row.clip_keys:
            assert resolved == (cfg.cliprange if default is None else default)
    for aggregation in loss_math.LOSS_AGGREGATIONS:
        explicit = grpo(policy_loss=row.name, loss_aggregation=aggregation)
        assert explicit.aggregation == aggregation
        notes = explicit.notes
        assert (notes == ()) is (aggregation in row.aggregations)
        if notes:
            assert f"loss_aggregation {aggregation}" in notes[0] and row.name in notes[0]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
@pytest.mark.parametrize("key", CLIP_KEYS)
def test_a_clip_key_the_loss_does_not_read_is_an_error_naming_it(row, key):
    value = 3.0 if key == "dual_clip" else 0.1
    if key in row.clip_keys:
        assert getattr(grpo(policy_loss=row.name, **{key: value}), key) == value
        return
    with pytest.raises(ConfigError) as e:
        grpo(policy_loss=row.name, **{key: value})
    assert f"config key '{key}'" in str(e.value) and f"policy_loss {row.name}" in str(e.value)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
@pytest.mark.parametrize("estimator", estimators.ROWS, ids=lambda r: r.name)
def test_a_loss_of_one_ratio_per_response_needs_one_advantage_per_response(row, estimator):
    keys = dict(
        policy_loss=row.name,
        advantage_estimator=estimator.name,
        samples_per_prompt=max(2, estimator.min_samples_per_prompt),
    )
    if estimator.response_advantages or not row.response_advantages:
        assert ppo_config("m", "rm", "p.jsonl", "out", **keys).policy_loss_row is row
        return
    with pytest.raises(ConfigError, match="config key 'policy_loss'"):
        ppo_config("m", "rm", "p.jsonl", "out", **keys)


def test_gspo_defaults_to_its_papers_aggregation():
    """On the worked example GSPO's objective is the mean over responses, -0.250275; the token mean
    (the aggregation of the other losses) gives -0.000233 (the responses' losses weighted by their lengths cancel)."""
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    ratios = torch.tensor([[1.3, 0.9, 1.0, 1.0], [1.1, 0.7, 1.0, 1.25]], dtype=F64)
    x = LossInputs(
        logprobs=ratios.log(),
        old_logprobs=torch.zeros_like(ratios),
        advantages=ppo_math.token_advantages(
            advantages=torch.tensor([1.0, -0.5], dtype=F64), response_mask=mask
        ),
        response_mask=mask,
        cliprange_low=3e-4,
        cliprange_high=4e-4,
        dual_clip=None,
    )
    losses, _ = LOSSES["gspo"].token_losses(x)

    def loss(aggregation):
        n = loss_math.loss_normaliser(loss_mask=mask, aggregation=aggregation, max_new_tokens=4)
        return loss_math.aggregate_loss(
            token_losses=losses, loss_mask=mask, aggregation=aggregation, normaliser=n
        )

    gspo = grpo(policy_loss="gspo")
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    assert abs(loss(gspo.aggregation).item() - -0.250275) < 5e-7
    token_mean = grpo(policy_loss="gspo", loss_aggregation="token_mean")
    assert abs(loss(token_mean.aggregation).item() - -0.000233) < 5e-7
    assert token_mean.notes and "seq_mean_token_mean" in token_mean.notes[0]


def test_the_note_is_printed_at_the_start_of_the_run(tiny_model_dir, prompt_file, tmp_path, capsys):
    """`llm-rlhf ppo` prints each `Config.notes` line as `note: ...` (main process), beside the config."""
    from llm_rlhf.interfaces import cli

    args = ppo_cli_args(
        tiny_model_dir,
        None,
        prompt_file,
        tmp_path / "run",
        steps=1,
        advantage_estimator="grpo",
        samples_per_prompt=2,
        rollout_batch_size=2,
        mini_batch_size=4,
        ppo_epochs=1,
        reward_fn=REWARD_FNS + ":even_length",
        eval_every=0,
        policy_loss="gspo",
        loss_aggregation="token_mean",
    )
    assert args[:3] == ["-m", "llm_rlhf", "ppo"] and cli.main(args[2:]) == 0
    out = capsys.readouterr().out
    assert "note: loss_aggregation token_mean is not the form of policy_loss gspo's paper" in out


# --- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        (dict(policy_loss="gspo"), "policy_loss"),  # gae: per-token advantages
        (dict(policy_loss="gspo", advantage_estimator="reinforce_pp"), "policy_loss"),
        (dict(policy_loss="ppo"), "policy_loss"),
        (dict(dynamic_sampling=True), "dynamic_sampling"),  # gae: no group baseline
        (dict(dynamic_sampling=True, advantage_estimator="remax"), "dynamic_sampling"),
        (dict(dynamic_sampling=True, advantage_estimator="grpo", samples_per_prompt=1), "samples_per_prompt"),
        (dict(dynamic_sampling_max_rounds=0), "dynamic_sampling_max_rounds"),
        (dict(sampler_correction="tis", sampler_correction_cap=0.5), "sampler_correction_cap"),
        (dict(sampler_correction="is"), "sampler_correction"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(dual_clip=3.0, policy_loss="cispo"), "dual_clip"),
        (dict(cliprange_low=0.1, policy_loss="cispo"), "cliprange_low"),
        (dict(cliprange_high=0.0), "cliprange_high"),
        (dict(overlong_buffer=9), "overlong_buffer"),  # max_new_tokens 8
        (dict(overlong_buffer=-1), "overlong_buffer"),
        (dict(overlong_penalty=-1.0), "overlong_penalty"),
        (dict(loss_aggregation="sum"), "loss_aggregation"),
    ],
)
def test_bad_combinations_are_one_line_config_errors(keys, named):
    with pytest.raises(ConfigError) as e:
        ppo_config("m", "rm", "p.jsonl", "out", **keys)
    assert f"config key '{named}'" in str(e.value) and "\n" not in str(e.value)


def test_the_command_rejects_gspo_with_gae_in_one_line(capsys):
    from llm_rlhf.interfaces import cli

    assert cli.main(["ppo", "--policy_loss", "gspo", "--advantage_estimator", "gae"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: config key 'policy_loss'") and "\n" not in err


def test_help_says_which_estimators_accept_each_option():
    text = " ".join(format_help(Config).split())
    assert f"Zheng et al. 2025; {names(r for r in estimators.ROWS if r.response_advantages)} only" in text
    assert (
        f"{names(r for r in estimators.ROWS if r.dynamic_sampling)} only, with samples_per_prompt >= 2"
        in text
    )
    for key in (
        "cliprange_low",
        "cliprange_high",
        "dual_clip",
        "loss_aggregation",
        "sampler_correction",
        "sampler_correction_cap",
        "overlong_buffer",
        "overlong_penalty",
        "mask_truncated",
        "dynamic_sampling_max_rounds",
    ):
        assert f"--{key} (" in text, key


def test_clip_ranges_resolve_per_policy_loss():
    cfg = lambda **kw: ppo_config("m", "rm", "p.jsonl", "out", **kw)  # noqa: E731
    assert (cfg().clip_low, cfg().clip_high, cfg().plain_policy_loss) == (0.2, 0.2, True)
    assert (cfg(cliprange=0.1).clip_low, cfg(cliprange_high=0.28).clip_high) == (0.1, 0.28)
    gspo = cfg(policy_loss="gspo", advantage_estimator="grpo", samples_per_prompt=2)
    assert (gspo.clip_low, gspo.clip_high, gspo.plain_policy_loss) == (3e-4, 4e-4, False)
    assert cfg(policy_loss="cispo").clip_high == 0.2 and not cfg(mask_truncated=True).plain_policy_loss
