"""The policy-loss family of issue 37 through the real PPO path (SPEC "The policy-loss family of 2025-26"; the
math and its worked examples are tests/test_loss_family.py): every key runs in a tiny-model update and does
something measurable, the defaults keep today's metric set, the aggregations and dynamic sampling are the same
with gradient accumulation and with 2 processes as with 1 (raw gradients, before clipping), LoRA and FSDP2
with an option on, a kill -9 and resume with dynamic sampling ends bit-identical, the DAPO recipe runs, and
the bad combinations are one-line ConfigErrors naming the key.

    option                   where
    policy_loss ppo_clip     test_clip_higher_logs_each_side, test_dual_clip_bounds_..., multi-process dapo
    cliprange_low/high       test_clip_higher_logs_each_side, test_cispo_..., multi-process dapo and cispo
    dual_clip                test_dual_clip_bounds_..., multi-process dapo
    policy_loss gspo         test_gspo_clips_whole_responses, multi-process gspo
    policy_loss cispo        test_cispo_keeps_the_gradient_of_clipped_tokens, LoRA, multi-process cispo
    policy_loss sapo         test_sapo_fades_the_gradient_where_ppo_clips_it (and tests/test_policy_losses.py)
    loss_aggregation         test_aggregations_..._accumulation (all three), multi-process (all three), FSDP2
    sampler_correction(+cap) test_sampler_corrections_with_bfloat16_sampling, multi-process dapo (tis), gspo (mis)
    overlong_buffer/penalty  test_overlong_penalty_in_the_rewards, multi-process dapo, the DAPO recipe
    mask_truncated           test_mask_truncated_..., multi-process dapo
    dynamic_sampling(+max)   test_dynamic_sampling_..., kill and resume, multi-process dapo, FSDP2, the recipe
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    build_model,
    launch,
    ppo_cli_args,
    ppo_config,
    record_raw_grads,
    sum_tolerance,
    tiny_ppo_trainer,
    use_fixed_responses,
)

from llm_rlhf.core.config import format_help, parse_config
from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.ppo.config import Config
from llm_rlhf.rl import loss_math, ppo_math
from llm_rlhf.rl.estimators import ROWS, names

SCRIPTS = ROOT / "tests" / "scripts"
EVEN = str(ROOT / "tests" / "reward_fns.py") + ":even_length"  # 0 / 1 scores: groups tie often
NEW_STATS = ("policy/clipfrac_low", "policy/clipfrac_high", "policy/dual_clipfrac", "sampler/", "sampling/",
             "objective/overlong_penalty")  # fmt: skip


def grpo_config(model_dir, prompt_file, out, **kw):
    """grpo with 4 prompts x 2 samples, a 0/1 reward function, no reward model and no KL penalty (so that the
    policy loss is the whole loss), one epoch over one minibatch of the 8 episodes. `kw` wins."""
    base = dict(advantage_estimator="grpo", samples_per_prompt=2, rollout_batch_size=4, mini_batch_size=8,
                ppo_epochs=1, reward_fn=EVEN, kl_controller="fixed", init_kl_coef=0.0, eval_every=0,
                max_grad_norm=1e9)  # fmt: skip
    base.update(kw)
    return ppo_config(model_dir, None, prompt_file, out, **base)


def raw_gradient(cfg, rollout, advantages) -> torch.Tensor:
    """The raw gradient (before clipping) of one update on `rollout` with `advantages` by a fresh trainer of
    `cfg` (the same initial weights for every cfg of a test)."""
    trainer = tiny_ppo_trainer(cfg)
    grads = []
    record_raw_grads(trainer, grads)
    trainer.train_on_rollout(rollout, advantages, None)
    assert len(grads) == 1
    return grads[0]


def fixed_rollout(cfg, seed: int = 0):
    """A rollout of `use_fixed_responses` (rows 0, 3, 6 truncated, the others ended with EOS at varied
    lengths) by a trainer of `cfg`, and per-response advantages ~ N(0, 1) spread over each response."""
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    a = torch.randn(rollout.scores.shape, generator=torch.Generator().manual_seed(seed))  # (B,)
    return rollout, ppo_math.token_advantages(advantages=a, response_mask=rollout.response_mask)


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
    assert f"Zheng et al. 2025; {names(r for r in ROWS if r.response_advantages)} only" in text
    assert f"{names(r for r in ROWS if r.dynamic_sampling)} only, with samples_per_prompt >= 2" in text
    for key in ("cliprange_low", "cliprange_high", "dual_clip", "loss_aggregation", "sampler_correction",
                "sampler_correction_cap", "overlong_buffer", "overlong_penalty", "mask_truncated",
                "dynamic_sampling_max_rounds"):  # fmt: skip
        assert f"--{key} (" in text, key


def test_clip_ranges_resolve_per_policy_loss():
    cfg = lambda **kw: ppo_config("m", "rm", "p.jsonl", "out", **kw)  # noqa: E731
    assert (cfg().clip_low, cfg().clip_high, cfg().plain_policy_loss) == (0.2, 0.2, True)
    assert (cfg(cliprange=0.1).clip_low, cfg(cliprange_high=0.28).clip_high) == (0.1, 0.28)
    gspo = cfg(policy_loss="gspo", advantage_estimator="grpo", samples_per_prompt=2)
    assert (gspo.clip_low, gspo.clip_high, gspo.plain_policy_loss) == (3e-4, 4e-4, False)
    assert cfg(policy_loss="cispo").clip_high == 0.2 and not cfg(mask_truncated=True).plain_policy_loss


# --- each option in the real update -------------------------------------------------------------------------


def test_defaults_keep_todays_metrics(tiny_model_dir, prompt_file, tmp_path):
    """With every key of the family at its default, a grpo step logs none of the new statistics and its
    update is `ppo_math.policy_loss`'s (runs bit-identical to before the keys: the session report)."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path)
    assert cfg.plain_policy_loss
    trainer = tiny_ppo_trainer(cfg)
    metrics = trainer.ppo_step()
    assert not [k for k in metrics if k.startswith(NEW_STATS)]
    assert "extra_prompts" not in trainer.state_dict()


def test_clip_higher_logs_each_side(tiny_model_dir, prompt_file, tmp_path):
    """cliprange_low/high (tiny, so both bind in the second epoch): policy/clipfrac_low and clipfrac_high
    are logged, bind, and add up to policy/clipfrac (a clipped token is on one side)."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, cliprange_low=1e-3, cliprange_high=2e-3,
                      ppo_epochs=2, learning_rate=1e-2)  # fmt: skip
    metrics = tiny_ppo_trainer(cfg).ppo_step()
    assert metrics["policy/clipfrac_high"] > 0 and metrics["policy/clipfrac_low"] > 0
    assert metrics["policy/clipfrac"] == pytest.approx(
        metrics["policy/clipfrac_low"] + metrics["policy/clipfrac_high"], abs=1e-6
    )
    assert "policy/dual_clipfrac" not in metrics


def test_dual_clip_bounds_the_loss_of_negative_advantages(tiny_model_dir, prompt_file, tmp_path):
    """Old log-probs 2 below the current ones: every ratio is e^2 = 7.39. A positive advantage is clipped
    above (gradient 0) either way; a negative one keeps PPO's gradient (-A * rho grows with rho) unless the
    dual clip c = 3 binds, which makes its loss the constant -3 * A: with it the policy gradient is exactly
    0, and policy/dual_clipfrac is the share of tokens with A < 0."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path)
    rollout, adv = fixed_rollout(cfg)
    shifted = dataclasses.replace(rollout, logprobs=rollout.logprobs - 2.0 * rollout.response_mask)
    plain = raw_gradient(cfg, shifted, adv)
    dual_cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, dual_clip=3.0)
    assert plain.abs().max() > 1e-4
    assert torch.equal(raw_gradient(dual_cfg, shifted, adv), torch.zeros_like(plain))
    trainer = tiny_ppo_trainer(dual_cfg)
    stats = trainer.train_on_rollout(shifted, adv, None)
    expected = ppo_math.masked_mean((adv < 0).float(), rollout.response_mask)
    assert stats["policy/dual_clipfrac"] == pytest.approx(float(expected)) and float(expected) > 0


def test_gspo_clips_whole_responses(tiny_model_dir, prompt_file, tmp_path):
    """Old log-probs shifted by 0.01 * sign(A_i) on every token of response i: each response's ratio s_i =
    e^(0.01 sign A_i) is outside GSPO's [1 - 3e-4, 1 + 4e-4] on the side where its clip binds, so every
    response is clipped and the gradient is exactly 0 (policy/clipfrac 1); ppo_clip's per-token ratios stay
    inside its 0.2 and keep their gradient."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, policy_loss="gspo")
    rollout, adv = fixed_rollout(cfg)
    shifted = dataclasses.replace(rollout, logprobs=rollout.logprobs - 0.01 * torch.sign(adv))
    assert torch.equal(raw_gradient(cfg, shifted, adv), torch.zeros_like(raw_gradient(cfg, rollout, adv)))
    plain = grpo_config(tiny_model_dir, prompt_file, tmp_path)
    assert raw_gradient(plain, shifted, adv).abs().max() > 1e-4
    stats = tiny_ppo_trainer(cfg).train_on_rollout(shifted, adv, None)
    assert (
        stats["policy/clipfrac"] == 1.0
        and stats["policy/clipfrac_low"] > 0
        and stats["policy/clipfrac_high"] > 0
    )


def test_cispo_keeps_the_gradient_of_clipped_tokens(tiny_model_dir, prompt_file, tmp_path):
    """Positive advantages, every ratio e^2 (old log-probs 2 below): PPO's clip zeroes every token's gradient;
    CISPO truncates the weight at 1 + eps_high = 1.28 and keeps the gradient, which is then 1.28 times PPO's
    at ratio 1 (d l / d log pi = -min(rho, 1.28) * A against -A)."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path)
    rollout, adv = fixed_rollout(cfg)
    adv = adv.abs()
    shifted = dataclasses.replace(rollout, logprobs=rollout.logprobs - 2.0 * rollout.response_mask)
    at_one = raw_gradient(cfg, rollout, adv)
    assert torch.equal(raw_gradient(cfg, shifted, adv), torch.zeros_like(at_one))
    cispo = grpo_config(tiny_model_dir, prompt_file, tmp_path, policy_loss="cispo", cliprange_high=0.28)
    torch.testing.assert_close(raw_gradient(cispo, shifted, adv), 1.28 * at_one, atol=1e-7, rtol=1e-5)


def test_sapo_fades_the_gradient_where_ppo_clips_it(tiny_model_dir, prompt_file, tmp_path):
    """policy_loss sapo through the trainer, at its paper's aggregation (seq_mean_token_mean, the row's, with
    loss_aggregation null): at ratio 1 its gradient is PPO's (d f / d rho = 1 there); with every ratio e^2
    and positive advantages PPO's clip gives 0 and SAPO the gradient at ratio 1 times rho * 4 s (1 - s),
    s = sigmoid(tau_pos (rho - 1)), tau_pos = 1 (by hand: 0.049483); nothing is counted as clipped."""
    sapo = grpo_config(tiny_model_dir, prompt_file, tmp_path, policy_loss="sapo")
    assert sapo.loss_aggregation is None and sapo.aggregation == "seq_mean_token_mean"
    ppo = grpo_config(tiny_model_dir, prompt_file, tmp_path, loss_aggregation="seq_mean_token_mean")
    rollout, adv = fixed_rollout(sapo)
    adv = adv.abs()
    at_one = raw_gradient(ppo, rollout, adv)
    torch.testing.assert_close(raw_gradient(sapo, rollout, adv), at_one, atol=1e-7, rtol=1e-5)
    shifted = dataclasses.replace(rollout, logprobs=rollout.logprobs - 2.0 * rollout.response_mask)
    assert torch.equal(raw_gradient(ppo, shifted, adv), torch.zeros_like(at_one))
    rho = math.exp(2.0)
    s = 1.0 / (1.0 + math.exp(-(rho - 1.0)))
    factor = rho * 4.0 * s * (1.0 - s)
    assert abs(factor - 0.049483) < 5e-7
    expected = factor * at_one
    # float32's sigmoid gradient s (1 - s) at s = 0.9983 keeps ~4 digits: a tolerance of 0.1% of the largest
    tolerance = dict(atol=1e-3 * float(expected.abs().max()), rtol=1e-3)
    torch.testing.assert_close(raw_gradient(sapo, shifted, adv), expected, **tolerance)
    stats = tiny_ppo_trainer(sapo).train_on_rollout(shifted, adv, None)
    assert stats["policy/clipfrac"] == 0.0 and stats["policy/ratio"] == pytest.approx(rho, rel=1e-5)


def test_aggregations_are_the_same_with_gradient_accumulation(tiny_model_dir, prompt_file, tmp_path):
    """Each loss_aggregation on responses of different lengths: the raw gradient with micro-batches of one
    episode is that of the whole minibatch; token_sum_norm is token_mean rescaled by tokens / (B * L)
    (Dr. GRPO's constant); seq_mean_token_mean weighs the responses, not the tokens, alike (another
    gradient)."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path)
    rollout, adv = fixed_rollout(cfg)
    tokens = int(rollout.response_mask.sum())
    grads = {}
    for aggregation in ("token_mean", "seq_mean_token_mean", "token_sum_norm"):
        for steps in (1, 8):
            c = grpo_config(tiny_model_dir, prompt_file, tmp_path, loss_aggregation=aggregation,
                            gradient_accumulation_steps=steps, mask_truncated=aggregation == "token_mean")  # fmt: skip
            grads[aggregation, steps] = raw_gradient(c, rollout, adv)
        torch.testing.assert_close(grads[aggregation, 8], grads[aggregation, 1],
                                   **sum_tolerance(grads[aggregation, 1], tokens))  # fmt: skip
    truncated = ~rollout.ended(tiny_ppo_trainer(cfg).tokenizer.eos_token_id)
    # token_mean above ran with mask_truncated: compare token_sum_norm with the plain token mean instead
    token_mean = raw_gradient(cfg, rollout, adv)
    torch.testing.assert_close(grads["token_sum_norm", 1] * (8 * cfg.max_new_tokens), token_mean * tokens,
                               **sum_tolerance(token_mean * tokens, tokens))  # fmt: skip
    assert not torch.allclose(grads["seq_mean_token_mean", 1], token_mean, atol=1e-6)
    assert truncated.any() and not torch.allclose(grads["token_mean", 1], token_mean, atol=1e-6)


def test_mask_truncated_gives_no_gradient_from_truncated_responses(tiny_model_dir, prompt_file, tmp_path):
    """Advantages on the truncated responses only (rows 0, 3, 6 of the fixed responses): with mask_truncated
    the update's gradient is exactly 0, without it is not."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path)
    rollout, adv = fixed_rollout(cfg)
    truncated = ~rollout.ended(tiny_ppo_trainer(cfg).tokenizer.eos_token_id)  # (B,)
    assert truncated.tolist() == [i % 3 == 0 for i in range(8)]
    adv = adv * truncated.unsqueeze(-1)
    assert raw_gradient(cfg, rollout, adv).abs().max() > 1e-4
    masked = grpo_config(tiny_model_dir, prompt_file, tmp_path, mask_truncated=True)
    assert torch.equal(raw_gradient(masked, rollout, adv), torch.zeros_like(raw_gradient(cfg, rollout, adv)))


def test_overlong_penalty_in_the_rewards(tiny_model_dir, prompt_file, tmp_path):
    """max_new_tokens 8, overlong_buffer 4: the fixed responses' lengths (2, 3, 5, 6, 8 with EOS; 8 truncated)
    get 0, 0, -0.25, -0.5, -1 and -1 added to their scores at the last token (SPEC's ramp), logged as
    objective/overlong_penalty; with eos_penalty -2 the truncated ones score -2 (it replaces the sum)."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, overlong_buffer=4, overlong_penalty=1.0)
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    lengths = rollout.response_mask.sum(-1).tolist()
    assert lengths == [8, 2, 3, 8, 5, 6, 8, 8]  # rows 0, 3, 6 truncated; row 7 ends with EOS at 8
    penalty = torch.tensor([-1.0, 0.0, 0.0, -1.0, -0.25, -0.5, -1.0, -1.0])
    rewards, _ = trainer.rewards(rollout, kl_coef=0.0)
    torch.testing.assert_close(
        ppo_math.masked_sum(rewards, rollout.response_mask, dim=-1), rollout.scores + penalty
    )
    with_eos = tiny_ppo_trainer(dataclasses.replace(cfg, eos_penalty=-2.0))
    rewards, _ = with_eos.rewards(rollout, kl_coef=0.0)
    expected = torch.where(torch.tensor([i % 3 == 0 for i in range(8)]), -2.0, rollout.scores + penalty)
    torch.testing.assert_close(ppo_math.masked_sum(rewards, rollout.response_mask, dim=-1), expected)
    metrics = trainer.ppo_step()
    assert metrics["objective/overlong_penalty"] == pytest.approx(float(penalty.mean()))


def test_sampler_corrections_with_bfloat16_sampling(tiny_model_dir, prompt_file, tmp_path):
    """sampling_dtype bfloat16 samples from another distribution q: TIS with a cap of 1.0001 (the tiny model's
    |log pi - log q| < 1e-3) truncates some weights (sampler/corrected_frac > 0, sampler/mean_weight <=
    1.0001); MIS's weights are 0 or 1, so its mean weight is 1 - the masked fraction. A sampler that recorded no log-probs is an error naming the key."""
    for correction in ("tis", "mis"):
        cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, sampling_dtype="bfloat16",
                          sampler_correction=correction, sampler_correction_cap=1.0001)  # fmt: skip
        metrics = tiny_ppo_trainer(cfg).ppo_step()
        assert metrics["objective/kl_sampler"] != 0.0
        assert 0 < metrics["sampler/corrected_frac"] < 1, correction
        assert metrics["sampler/weight_std"] > 0, correction  # some weights truncated or masked: a spread
        if correction == "tis":
            assert metrics["sampler/mean_weight"] <= 1.0001
        else:
            assert metrics["sampler/mean_weight"] == pytest.approx(1 - metrics["sampler/corrected_frac"])
            assert metrics["sampler/weight_std"] <= 0.5  # weights of 0 and 1: at most 1/2
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)  # Samples without sampler log-probs
    with pytest.raises(UserError, match="^sampler_correction mis: the sampler recorded no log-probs"):
        trainer.ppo_step()


# --- dynamic sampling --------------------------------------------------------------------------------------


def keep_dynamic_rollouts(trainer) -> list:
    kept, real = [], trainer.dynamic_rollout

    def dynamic_rollout(*args, **kwargs):
        out = real(*args, **kwargs)
        kept.append(out[0])
        return out

    trainer.dynamic_rollout = dynamic_rollout
    return kept


def test_dynamic_sampling_trains_untied_groups(tiny_model_dir, prompt_file, tmp_path):
    """0/1 scores, 2 samples per prompt (about half the groups tie): each step samples further rounds of
    the prompt stream until its 4 groups are untied (or 4 rounds were sampled, then filled with tied
    groups); the trained rollout holds 4 groups; the counts add up; rho == 1 and approx-KL == 0 exactly at
    the update (one minibatch, one epoch: the forwards ran on the kept rows); the prompt stream moves on by
    the extra rounds and the state keeps it. With dynamic_sampling_max_rounds 1 nothing is dropped."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=4,
                      steps=3)  # fmt: skip
    trainer = tiny_ppo_trainer(cfg)
    kept = keep_dynamic_rollouts(trainer)
    sampled, real_score = [], trainer.collector.score  # every round's scores, the dropped groups' too

    def score(samples):
        out = real_score(samples)
        sampled.append((trainer.step, out.scores.clone()))
        return out

    trainer.collector.score = score
    torch.manual_seed(0)
    metrics = [trainer.ppo_step() for _ in range(3)]
    rounds = [m["sampling/rounds"] for m in metrics]
    assert max(rounds) > 1 and all(1 <= r <= 4 for r in rounds)
    for m, rollout in zip(metrics, kept):
        assert rollout.scores.shape == (8,)
        tied = loss_math.tied_groups(scores=rollout.scores, samples_per_prompt=2)  # no shaping: raw scores
        assert int(tied.sum()) == m["sampling/tied_groups_trained"] == m["objective/groups_tied"] * 4
        assert m["sampling/groups_dropped"] == 4 * m["sampling/rounds"] - 4
        assert m["policy/ratio"] == 1.0 and m["policy/approxkl"] == 0.0
    for step, m in enumerate(metrics):  # the mean over all it sampled, not only the kept groups
        this_step = torch.cat([scores for at, scores in sampled if at == step])
        assert this_step.numel() == 8 * m["sampling/rounds"]
        assert m["sampling/scores_sampled"] == pytest.approx(float(this_step.mean()), abs=1e-6)
    assert trainer.collector.extra_prompts == 4 * (sum(rounds) - 3)
    assert metrics[-1]["sampling/sampled_per_trained"] == pytest.approx(sum(rounds) / 3)
    assert trainer.state_dict()["extra_prompts"] == trainer.collector.extra_prompts

    once = tiny_ppo_trainer(dataclasses.replace(cfg, dynamic_sampling_max_rounds=1))
    torch.manual_seed(0)
    m = once.ppo_step()
    assert (m["sampling/rounds"], m["sampling/groups_dropped"]) == (1.0, 0.0) and once.collector.extra_prompts == 0
    assert m["sampling/tied_groups_trained"] == m["objective/groups_tied"] * 4


def test_dynamic_sampling_is_the_same_with_gradient_accumulation(tiny_model_dir, prompt_file, tmp_path):
    """The same seed, micro-batches of 8 or of 1 episode: the same rounds, the same kept groups and the same
    raw gradients."""
    runs = []
    for steps in (1, 8):
        cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, dynamic_sampling=True,
                          gradient_accumulation_steps=steps, loss_aggregation="seq_mean_token_mean")  # fmt: skip
        trainer, grads = tiny_ppo_trainer(cfg), []
        record_raw_grads(trainer, grads)
        torch.manual_seed(0)
        metrics = [trainer.ppo_step() for _ in range(2)]
        runs.append((metrics, grads))
    (m1, g1), (m8, g8) = runs
    assert [m["sampling/rounds"] for m in m1] == [m["sampling/rounds"] for m in m8]
    for a, b in zip(g1, g8):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_lora_with_cispo_and_dynamic_sampling(tiny_model_dir, prompt_file, tmp_path):
    """LoRA (the reference is the adapter switched off) with policy_loss cispo and dynamic sampling: every
    adapter weight changes and the CISPO statistics are logged."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, use_lora=True, lora_target_modules=["c_attn"],
                      policy_loss="cispo", dynamic_sampling=True, learning_rate=1e-2)  # fmt: skip
    trainer = tiny_ppo_trainer(cfg)
    before = {
        k: v.detach().clone() for k, v in trainer.unwrapped_policy.named_parameters() if v.requires_grad
    }
    metrics = trainer.ppo_step()
    after = dict(trainer.unwrapped_policy.named_parameters())
    assert before and all(not torch.equal(after[k], v) for k, v in before.items() if "lora_B" in k)
    assert "policy/clipfrac_high" in metrics and "sampling/rounds" in metrics


# --- processes ----------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_loss_options_two_ranks_and_accumulation_equal_one(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """tests/scripts/ppo_ranks.py MODE loss_options on 1 and on 2 processes (two launches): dapo (clip-higher,
    dual clip, seq_mean_token_mean, TIS, overlong shaping, mask_truncated, dynamic sampling with a tied group
    in the first round), gspo (token_sum_norm, MIS) and cispo (on gae), each with ordinary minibatches and
    with micro-batches of one episode: the raw gradient of every update (2 steps x 2 epochs) and the steps'
    metrics are those of one process without accumulation."""
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"{world}.json"
        args = [str(SCRIPTS / "ppo_ranks.py"), str(tiny_model_dir), str(tiny_rm_dir), str(prompt_file), str(out),
                "loss_options"]  # fmt: skip
        launch(args, world)
        runs[world] = json.loads(out.read_text())["runs"]
    one = runs[1]
    assert set(one) == {f"{n}{a}" for n in ("dapo", "gspo", "cispo") for a in ("", "/accumulate")}
    for key in one:
        name = key.split("/")[0]
        base = one[name]
        for run in (one[key], runs[2][key]):
            assert len(run["grads"]) == len(base["grads"]) == 4, key
            for update, (ga, gb) in enumerate(zip(base["grads"], run["grads"])):
                # after an Adam step (lr 1e-2) the weights differ by float rounding: |diff| < 2e-6 there
                torch.testing.assert_close(torch.tensor(gb), torch.tensor(ga), atol=1e-7 if update == 0 else 2e-6,
                                           rtol=1e-4, msg=f"{key} update {update + 1}")  # fmt: skip
            for m1, m2 in zip(base["metrics"], run["metrics"]):
                for k, v in m1.items():
                    if k.startswith(("loss/", "policy/", "sampler/", "sampling/", "objective/")):
                        assert m2[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (key, m1["step"], k)
    dapo = one["dapo"]["metrics"]
    assert [m["sampling/rounds"] for m in dapo] == [2.0, 2.0] and dapo[0]["sampling/groups_dropped"] == 2.0
    assert dapo[0]["sampler/corrected_frac"] > 0 and dapo[0]["objective/overlong_penalty"] < 0
    assert one["gspo"]["metrics"][0]["sampler/corrected_frac"] > 0
    assert one["cispo"]["metrics"][1]["policy/clipfrac_high"] > 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_with_dynamic_sampling(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """fsdp.yaml (FSDP2) on 2 CPU processes: grpo with dynamic sampling, clip-higher and seq_mean_token_mean;
    the rounds are the same on every process (the sharded forwards are collectives), the run ends."""
    out = tmp_path / "fsdp"
    args = ppo_cli_args(tiny_model_dir, "none", prompt_file, out, 3, advantage_estimator="grpo",
                        samples_per_prompt=2, rollout_batch_size=2, mini_batch_size=4, reward_fn=EVEN,
                        dynamic_sampling="true", cliprange_high=0.28, loss_aggregation="seq_mean_token_mean",
                        gold_judge="none")[2:]  # fmt: skip
    launch([str(SCRIPTS / "fsdp2_on_cpu.py"), *args], 2, config="fsdp.yaml", mixed_precision="no")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all("sampling/rounds" in m and "policy/clipfrac_high" in m for m in metrics)
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_dynamic_sampling_killed_and_resumed_ends_bit_identical(tiny_model_dir, prompt_file, tmp_path):
    """grpo with dynamic sampling on 0/1 scores (further rounds happen), a checkpoint every 2 steps: a run
    killed with SIGKILL as step 4 starts and resumed logs and saves what the uninterrupted run did, bit for
    bit (the prompt stream's extra rounds and the RNG are in the checkpoint)."""
    from safetensors.torch import load_file

    def command(out, *more, kill_at=None):
        args = ppo_cli_args(tiny_model_dir, "none", prompt_file, out, 4, advantage_estimator="grpo",
                            samples_per_prompt=2, rollout_batch_size=2, mini_batch_size=4, save_steps=2,
                            reward_fn=EVEN, dynamic_sampling="true", dynamic_sampling_max_rounds=4,
                            gold_judge="none")  # fmt: skip
        if kill_at is not None:
            args = [str(SCRIPTS / "kill_at_step.py"), str(kill_at), *args[2:]]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(ROOT),
        }
        return subprocess.run([sys.executable, *args, *more], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)  # fmt: skip

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert command(straight).returncode == 0
    crash = command(killed, kill_at=4)
    assert crash.returncode == -signal.SIGKILL, crash.stderr[-2000:]
    resumed = command(killed, "--resume", "true")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    a, b = (
        [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (straight, killed)
    )
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    assert sum(m["sampling/rounds"] for m in a[2:]) > 2, "further rounds after the checkpoint"
    for ma, mb in zip(a, b):
        drop = ("time/", "tokens_per_s")
        assert {k: v for k, v in mb.items() if not k.startswith(drop)} == {
            k: v for k, v in ma.items() if not k.startswith(drop)
        }, ma["step"]
    final_a, final_b = (load_file(d / "model.safetensors") for d in (straight, killed))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


# --- the DAPO recipe ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_dapo_recipe_runs_on_a_tiny_chat_llama(tmp_path, monkeypatch):
    """recipes/smollm2-arithmetic/dapo.yaml (grpo with clip-higher 0.2/0.28, dynamic sampling, token-mean,
    overlong shaping, no KL) on a tiny Llama with a chat template, two steps on the committed arithmetic
    prompts: it parses through PPO's Config with the DAPO keys and runs."""
    from transformers import AutoTokenizer

    from llm_rlhf.interfaces import cli

    monkeypatch.chdir(ROOT)
    recipe = ROOT / "recipes" / "smollm2-arithmetic" / "dapo.yaml"
    cfg = parse_config(Config, ["--config", str(recipe)])
    assert (cfg.advantage_estimator, cfg.cliprange_low, cfg.cliprange_high) == ("grpo", 0.2, 0.28)
    assert cfg.dynamic_sampling and cfg.loss_aggregation == "token_mean" and cfg.overlong_buffer > 0
    model = build_model(tmp_path / "tiny_chat_llama", "llama", n_positions=160)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(model)
    out = tmp_path / "dapo"
    keys = {"model_name_or_path": model, "output_dir": out, "steps": 2, "rollout_batch_size": 2,
            "mini_batch_size": 4, "max_prompt_length": 128, "max_new_tokens": 4, "overlong_buffer": 2,
            "eval_every": 0, "save_steps": 0, "log_samples_every": 0}  # fmt: skip
    argv = ["ppo", "--config", str(recipe)] + [a for k, v in keys.items() for a in (f"--{k}", str(v))]
    assert cli.main(argv) == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(
        "sampling/rounds" in m and "objective/overlong_penalty" in m for m in metrics
    )
