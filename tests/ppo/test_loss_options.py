"""The policy-loss family of 2025-26 through the real PPO path (the math and its worked examples are
tests/rl/test_loss_family.py): every key runs in a tiny-model update and does something measurable, the
defaults keep today's metric set, the aggregations and dynamic sampling are the same with gradient
accumulation and on two data-parallel ranks simulated in one process as on one (raw gradients, before
clipping), the sampler correction's weight carries no gradient, dynamic sampling ties on the raw scores (or
the verifier's verdicts) and its KL sees every sampled group, LoRA with an option on, a kill -9 and resume
with dynamic sampling ends bit-identical, the DAPO recipe runs, and the bad combinations are one-line
ConfigErrors naming the key. The multi-process runs (below: ppo_ranks.py MODE loss_options on 1 and 2
processes, FSDP2) are in tests/multiprocess/test_ppo_options_on_two_processes.py.

    option                   where
    policy_loss ppo_clip     test_clip_higher_logs_each_side, test_dual_clip_bounds_..., multi-process dapo
    cliprange_low/high       test_clip_higher_logs_each_side, test_cispo_..., multi-process dapo and cispo
    dual_clip                test_dual_clip_bounds_..., multi-process dapo
    policy_loss gspo         test_gspo_clips_whole_responses, multi-process gspo
    policy_loss cispo        test_cispo_keeps_the_gradient_of_clipped_tokens, LoRA, multi-process cispo
    policy_loss sapo         test_sapo_fades_the_gradient_where_ppo_clips_it (and tests/rl/test_policy_losses.py)
    loss_aggregation         test_aggregations_..._accumulation (all three), test_global_normaliser_two_simulated_...,
                             multi-process (all three), FSDP2
    sampler_correction(+cap) test_sampler_corrections_with_bfloat16_sampling, test_sampler_correction_weight_...,
                             multi-process dapo (tis), gspo (mis)
    overlong_buffer/penalty  test_overlong_penalty_in_the_rewards, multi-process dapo, the DAPO recipe
    mask_truncated           test_mask_truncated_..., multi-process dapo
    dynamic_sampling(+max)   test_dynamic_sampling_..., test_kl_and_its_controller_see_every_sampled_group, kill and
                             resume, multi-process dapo, FSDP2, the recipe
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    REWARD_FNS,
    ppo_cli_args,
    ppo_config,
    record_raw_grads,
    sum_tolerance,
    tiny_ppo_trainer,
    use_fixed_responses,
)
from processes import ppo_command

from llm_rlhf.core.errors import UserError
from llm_rlhf.models.reward_fn import decode_texts
from llm_rlhf.models.scoring import Scores
from llm_rlhf.ppo.config import batch_sizes
from llm_rlhf.rl import loss_math, ppo_math

EVEN = REWARD_FNS + ":even_length"  # 0 / 1 scores: groups tie often
HALF = REWARD_FNS + ":half"  # 0.5 for every response: every group ties
NEW_STATS = (
    "policy/clipfrac_low",
    "policy/clipfrac_high",
    "policy/dual_clipfrac",
    "sampler/",
    "sampling/",
    "objective/overlong_penalty",
)


def grpo_config(model_dir, prompt_file, out, **kw):
    """grpo with 4 prompts x 2 samples, a 0/1 reward function, no reward model and no KL penalty (so that the
    policy loss is the whole loss), one epoch over one minibatch of the 8 episodes. `kw` wins."""
    base = dict(
        advantage_estimator="grpo",
        samples_per_prompt=2,
        rollout_batch_size=4,
        mini_batch_size=8,
        ppo_epochs=1,
        reward_fn=EVEN,
        kl_controller="fixed",
        init_kl_coef=0.0,
        eval_every=0,
        max_grad_norm=1e9,
    )
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


# --- each option in the real update -------------------------------------------------------------------------


def test_defaults_keep_todays_metrics(tiny_model_dir, prompt_file, tmp_path):
    """With every key of the family at its default, a grpo step logs none of the new statistics and its
    update is `ppo_math.policy_loss`'s (the same update, bit for bit, as without the family's keys)."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path)
    assert cfg.plain_policy_loss
    trainer = tiny_ppo_trainer(cfg)
    metrics = trainer.ppo_step()
    assert not [k for k in metrics if k.startswith(NEW_STATS)]
    assert "extra_prompts" not in trainer.state_dict()


def test_clip_higher_logs_each_side(tiny_model_dir, prompt_file, tmp_path):
    """cliprange_low/high (tiny, so both bind in the second epoch): policy/clipfrac_low and clipfrac_high
    are logged, bind, and add up to policy/clipfrac (a clipped token is on one side)."""
    cfg = grpo_config(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        cliprange_low=1e-3,
        cliprange_high=2e-3,
        ppo_epochs=2,
        learning_rate=1e-2,
    )
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
            c = grpo_config(
                tiny_model_dir,
                prompt_file,
                tmp_path,
                loss_aggregation=aggregation,
                gradient_accumulation_steps=steps,
                mask_truncated=aggregation == "token_mean",
            )
            grads[aggregation, steps] = raw_gradient(c, rollout, adv)
        torch.testing.assert_close(
            grads[aggregation, 8], grads[aggregation, 1], **sum_tolerance(grads[aggregation, 1], tokens)
        )
    truncated = ~rollout.ended(tiny_ppo_trainer(cfg).tokenizer.eos_token_id)
    # token_mean above ran with mask_truncated: compare token_sum_norm with the plain token mean instead
    token_mean = raw_gradient(cfg, rollout, adv)
    torch.testing.assert_close(
        grads["token_sum_norm", 1] * (8 * cfg.max_new_tokens),
        token_mean * tokens,
        **sum_tolerance(token_mean * tokens, tokens),
    )
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
    get 0, 0, -0.25, -0.5, -1 and -1 added to their scores at the last token (the overlong ramp), logged as
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
        cfg = grpo_config(
            tiny_model_dir,
            prompt_file,
            tmp_path,
            sampling_dtype="bfloat16",
            sampler_correction=correction,
            sampler_correction_cap=1.0001,
        )
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


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_sampler_correction_weight_carries_no_gradient(tiny_model_dir, prompt_file, tmp_path, correction):
    """A rollout whose sampler log-probs are the old policy's + 0.1 * N(0, 1) (cap 1.05: some weights
    truncated or masked): the trainer's raw gradient is that of the token-mean loss -w_t * A_t * rho_t written
    out, with the weights w_t = min(pi_old / q, C) (tis) or 1[1/C <= pi_old / q <= C] (mis) detached (rho = 1
    and no clip at the first update). Fails if the weight carries gradient (w * exp(lp - sg(lp)): the same
    values, twice the gradient)."""
    cfg = grpo_config(
        tiny_model_dir, prompt_file, tmp_path, sampler_correction=correction, sampler_correction_cap=1.05
    )
    rollout, advantages = fixed_rollout(cfg)
    mask = rollout.response_mask
    noise = 0.1 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))  # (B, R)
    rollout.sampler_logprobs = torch.where(mask, rollout.logprobs + noise, 0.0)  # log q
    ratio = torch.exp(rollout.logprobs - rollout.sampler_logprobs)  # (B, R) pi_old / q
    corrected = (ratio > 1.05) | ((ratio < 1 / 1.05) if correction == "mis" else False)  # (B, R)
    weights = ratio.clamp(max=1.05) if correction == "tis" else (~corrected).float()  # (B, R), no grad
    assert 0 < int((corrected & mask).sum()) < int(mask.sum()), "some weights truncated or masked"

    trainer = tiny_ppo_trainer(cfg)
    params = list(trainer.trainable_parameters())
    logprobs, _, _ = trainer.forward_policy(rollout, train=True)  # (B, R), with grad
    rho = torch.exp(logprobs - rollout.logprobs)  # (B, R), 1 in value
    loss = (-weights * advantages * rho)[mask].sum() / mask.sum()  # token mean over the minibatch
    by_hand = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    got = raw_gradient(cfg, rollout, advantages)
    assert by_hand.abs().max() > 1e-4
    torch.testing.assert_close(got, by_hand, atol=1e-6 * float(by_hand.abs().max()), rtol=1e-4)


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
    cfg = grpo_config(
        tiny_model_dir, prompt_file, tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=4, steps=3
    )
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
    assert (m["sampling/rounds"], m["sampling/groups_dropped"]) == (
        1.0,
        0.0,
    ) and once.collector.extra_prompts == 0
    assert m["sampling/tied_groups_trained"] == m["objective/groups_tied"] * 4


def test_dynamic_sampling_is_the_same_with_gradient_accumulation(tiny_model_dir, prompt_file, tmp_path):
    """The same seed, micro-batches of 8 or of 1 episode: the same rounds, the same kept groups and the same
    raw gradients."""
    runs = []
    for steps in (1, 8):
        cfg = grpo_config(
            tiny_model_dir,
            prompt_file,
            tmp_path,
            dynamic_sampling=True,
            gradient_accumulation_steps=steps,
            loss_aggregation="seq_mean_token_mean",
        )
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
    cfg = grpo_config(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        use_lora=True,
        lora_target_modules=["c_attn"],
        policy_loss="cispo",
        dynamic_sampling=True,
        learning_rate=1e-2,
    )
    trainer = tiny_ppo_trainer(cfg)
    before = {
        k: v.detach().clone() for k, v in trainer.unwrapped_policy.named_parameters() if v.requires_grad
    }
    metrics = trainer.ppo_step()
    after = dict(trainer.unwrapped_policy.named_parameters())
    assert before and all(not torch.equal(after[k], v) for k, v in before.items() if "lora_B" in k)
    assert "policy/clipfrac_high" in metrics and "sampling/rounds" in metrics


def tie_config(tiny_model_dir, prompt_file, tmp_path, **kw):
    return grpo_config(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        **{"dynamic_sampling": True, "dynamic_sampling_max_rounds": 3, **kw},
    )


@pytest.mark.parametrize(
    "shaping",
    [dict(overlong_buffer=4, overlong_penalty=1.0), dict(eos_penalty=-1.0)],
    ids=["overlong", "eos"],
)
def test_dynamic_sampling_ties_on_raw_scores_not_the_penalties(
    tiny_model_dir, prompt_file, tmp_path, shaping
):
    """Every response scores 0.5 (the groups all tie) and the responses have different lengths, some
    truncated (`use_fixed_responses`): the overlong penalty and the EOS penalty separate some groups' shaped
    scores, but no penalty unties a group. Every round's groups are tied, so the step samples its 3 rounds,
    drops 8 groups and trains 4 tied ones. Fails if the tie test reads the shaped scores."""
    trainer = tiny_ppo_trainer(tie_config(tiny_model_dir, prompt_file, tmp_path, reward_fn=HALF, **shaping))
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    shaped = trainer.rewards(rollout, 0.0)[0].sum(-1)  # (B,) the score the rewards hold (kl_coef 0)
    assert not loss_math.tied_groups(scores=shaped, samples_per_prompt=2).all(), "the penalty unties a group"
    m = trainer.ppo_step()
    assert (m["sampling/rounds"], m["sampling/groups_dropped"]) == (3.0, 8.0)
    assert m["sampling/tied_groups_trained"] == 4.0 and trainer.collector.extra_prompts == 8


def write_verifier(folder) -> str:
    (folder / "verifiers.py").write_text(
        "def always(prompts, responses):\n    return [1.0 for _ in responses]\n"
    )
    return str(folder / "verifiers.py") + ":always"


def test_dynamic_sampling_ties_on_the_verifier_verdicts(tiny_model_dir, prompt_file, tmp_path):
    """With accuracy_fn (the task's verifier, loaded by `build_trainer`), a group ties when its verdicts tie:
    every answer correct (always 1.0) while the reward function grades by parity is dropped in every round;
    with every score 0.5 and the verdicts by parity, the groups tie where the parities do."""
    always = write_verifier(tmp_path)
    trainer = tiny_ppo_trainer(
        tie_config(tiny_model_dir, prompt_file, tmp_path, reward_fn=EVEN, accuracy_fn=always)
    )
    assert trainer.collector.verifier is not None and trainer.collector.verifier.key == "accuracy_fn"
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    assert not loss_math.tied_groups(scores=rollout.scores, samples_per_prompt=2).all(), "the scores differ"
    m = trainer.ppo_step()
    assert (m["sampling/rounds"], m["sampling/groups_dropped"], m["sampling/tied_groups_trained"]) == (
        3,
        8,
        4,
    )

    cfg = tie_config(
        tiny_model_dir, prompt_file, tmp_path, reward_fn=HALF, accuracy_fn=EVEN, dynamic_sampling_max_rounds=1
    )
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)
    rollouts, real = [], trainer.dynamic_rollout

    def dynamic_rollout(*args):
        out = real(*args)
        rollouts.append(out[0])
        return out

    trainer.dynamic_rollout = dynamic_rollout
    m = trainer.ppo_step()
    r = rollouts[0]
    _, responses = decode_texts(trainer.tokenizer, r.query, r.query_mask, r.response, r.response_mask)
    parity = torch.tensor([float(len(text) % 2 == 0) for text in responses])  # (B,)
    tied = loss_math.tied_groups(scores=parity, samples_per_prompt=2)  # (P,)
    assert 0 < int(tied.sum()) < 4, "some groups tie on parity, some do not"
    assert m["sampling/tied_groups_trained"] == float(tied.sum())


def test_kl_and_its_controller_see_every_sampled_group(tiny_model_dir, prompt_file, tmp_path):
    """The policy moved off the reference, all groups tied (every score 0.5), 3 rounds: objective/kl is the
    mean sequence KL over the 24 sampled responses, the 16 dropped ones' too, and the adaptive controller
    moves by that KL (its target set to it once sampled: beta stays where it was, where the 8 kept
    responses' KL would move it). Fails if either reads the kept responses alone."""
    cfg = tie_config(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        reward_fn=HALF,
        kl_controller="adaptive",
        init_kl_coef=0.1,
        kl_target=0.01,
        kl_horizon=10,
    )
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)
    with torch.no_grad():
        for p in trainer.unwrapped_policy.lm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    every = []  # the sequence KL of every sampled round, computed alone
    real_generate = trainer.collector.generate

    def generate(queries, sampling=None):
        samples = real_generate(queries, sampling)
        logprobs, _, _ = trainer.forward_policy(samples)
        kl = ppo_math.kl_penalty(
            logprobs=logprobs, ref_logprobs=trainer.reference_logprobs(samples), estimator=cfg.kl_estimator
        )
        every.append(ppo_math.sequence_kl(kl=kl, response_mask=samples.response_mask))
        if len(every) == 3:  # the last round: the controller's target is the KL of every sampled response
            trainer.kl_ctl.target = float(torch.cat(every).mean())
        return samples

    trainer.collector.generate = generate
    m = trainer.ppo_step()
    every = torch.cat(every)  # (24,)
    assert every.shape == (24,) and m["sampling/rounds"] == 3
    assert m["objective/kl"] == pytest.approx(float(every.mean()), rel=1e-5)
    kept = float(every[:8].mean())  # all tied: the first round's groups fill the step
    assert abs(kept / float(every.mean()) - 1) > 0.01, "the dropped rounds' KL differs"
    assert trainer.kl_ctl.value == pytest.approx(0.1, rel=1e-5)  # the error 0: beta unmoved


# --- two data-parallel ranks simulated in one process -------------------------------------------------------
# One trainer per rank (the same initial weights), two threads, and a stand-in accelerator whose `reduce` is the
# all-reduce of the two threads' tensors; everything else is the trainer's real code.


class TwoRanks:
    """The accelerator as the trainer's collectives see it on one of two data-parallel ranks played by two
    threads: `reduce(x, "sum" | "mean")` waits for the other rank's call and returns the all-reduce of both
    tensors; process_index is this rank's; the rest is the rank's real (one-process) accelerator. One
    `TwoRanks` per rank, sharing `pair` (a barrier, the parts)."""

    num_processes = 2

    def __init__(self, rank: int, pair: SimpleNamespace, real):
        self.process_index, self.pair, self.real = rank, pair, real

    def __getattr__(self, name: str):
        return getattr(self.real, name)  # unwrap_model, device, ...

    @staticmethod
    def pair() -> SimpleNamespace:
        return SimpleNamespace(barrier=threading.Barrier(2, timeout=30), parts={})

    def reduce(self, x: torch.Tensor, reduction: str) -> torch.Tensor:
        pair = self.pair
        pair.parts[self.process_index] = x
        pair.barrier.wait()
        total = pair.parts[0] + pair.parts[1]
        pair.barrier.wait()  # both have read the parts before the next call writes them
        return total if reduction == "sum" else total / 2


def on_two_ranks(trainers, work) -> list:
    """`work(rank, trainer)` on two threads, each trainer's accelerator the rank's `TwoRanks`; the results."""
    pair, out, errors = TwoRanks.pair(), [None, None], []
    real = [t.accelerator for t in trainers]
    for rank, t in enumerate(trainers):
        t.context.accelerator = TwoRanks(
            rank, pair, t.accelerator
        )  # the trainer's, the collector's, the update's

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank, trainers[rank])
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)
            pair.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t, accelerator in zip(trainers, real):
        t.context.accelerator = accelerator
    if errors:
        raise errors[0]
    return out


def rank_trainer(cfg, **sizes):
    """A trainer of `cfg` whose batch sizes are those of one of 2 processes (`sizes` the per-process keys)."""
    trainer = tiny_ppo_trainer(cfg)
    keys = dict(
        rollout_batch_size=cfg.rollout_batch_size,
        mini_batch_size=cfg.mini_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        ppo_epochs=cfg.ppo_epochs,
        steps=cfg.steps,
        samples_per_prompt=cfg.samples_per_prompt,
    )
    trainer.context.sizes = batch_sizes(**{**keys, **sizes, "num_processes": 2})  # every part's
    return trainer


@pytest.mark.parametrize(
    "keys",
    [
        dict(),
        dict(cliprange_high=0.28),
        dict(loss_aggregation="seq_mean_token_mean"),
        dict(loss_aggregation="token_sum_norm"),
        dict(cliprange_high=0.28, gradient_accumulation_steps=2),
    ],
    ids=["plain", "token_mean", "seq_mean_token_mean", "token_sum_norm", "accumulated"],
)
def test_global_normaliser_two_simulated_ranks_equal_one(tiny_model_dir, prompt_file, tmp_path, keys):
    """One minibatch of 8 responses of 2 to 8 tokens (`use_fixed_responses`): on one process, and cut into two
    ranks of 2 groups (rank 0 holds 20 tokens, rank 1 25) whose normaliser and token counts are all-reduced by
    two threads: the mean of the ranks' raw gradients (what DDP's all-reduce gives) is the one process's, for
    the plain loss and every aggregation. Fails if the normaliser N is this rank's (not all-reduced), or if
    the policy loss's share is not multiplied by the processes DDP averages over."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path, **keys)
    rollout, advantages = fixed_rollout(cfg)
    one = raw_gradient(cfg, rollout, advantages)
    halves = [torch.arange(0, 4), torch.arange(4, 8)]
    lengths = [int(rollout.response_mask[h].sum()) for h in halves]
    assert lengths[0] != lengths[1], "the ranks hold different numbers of tokens"

    trainers = [rank_trainer(cfg, rollout_batch_size=2, mini_batch_size=4) for _ in (0, 1)]
    grads = [[], []]
    for t, store in zip(trainers, grads):
        record_raw_grads(t, store)  # on the real accelerator, whose clip the trainer's `acc` calls
    on_two_ranks(
        trainers, lambda r, t: t.train_on_rollout(rollout.select(halves[r]), advantages[halves[r]], None)
    )
    assert len(grads[0]) == len(grads[1]) == 1 and one.abs().max() > 1e-4
    mean = (grads[0][0] + grads[1][0]) / 2  # DDP's all-reduce of the ranks' gradients
    torch.testing.assert_close(mean, one, atol=1e-6 * float(one.abs().max()), rtol=1e-4)


def test_dynamic_sampling_rounds_are_the_same_on_two_simulated_ranks(tiny_model_dir, prompt_file, tmp_path):
    """Two ranks of 2 groups each: rank 0's groups are untied from the first round, rank 1's tie in rounds 1
    and 2 (scripted scores): both sample 3 rounds (their collectives match), rank 0 trains its first
    round's groups, rank 1 its third's, and the counts are global: 8 groups dropped, none tied trained. Fails
    if a process stops on its own untied count."""
    cfg = tie_config(tiny_model_dir, prompt_file, tmp_path, reward_fn=HALF, dynamic_sampling_max_rounds=4)
    trainers = [rank_trainer(cfg, rollout_batch_size=2, mini_batch_size=4) for _ in (0, 1)]
    untied, tied = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])  # (B,) 2 groups
    script = {0: [untied] * 4, 1: [tied, tied, untied, untied]}  # each rank's scores, round by round
    for rank, t in enumerate(trainers):
        use_fixed_responses(t)
        rounds = iter(script[rank])
        t.collector.score = lambda samples, rounds=rounds: Scores(scores=next(rounds))

    def step(rank, t):
        times = {}
        return t.dynamic_rollout(t.collector.queries(t.step), times)

    (r0, _, s0, kl0), (r1, _, s1, kl1) = on_two_ranks(trainers, step)
    assert s0["sampling/rounds"] == s1["sampling/rounds"] == 3.0
    assert s0["sampling/groups_dropped"] == s1["sampling/groups_dropped"] == 8.0
    assert s0["sampling/tied_groups_trained"] == s1["sampling/tied_groups_trained"] == 0.0
    assert r0.scores.tolist() == untied.tolist() and r1.scores.tolist() == untied.tolist()
    assert kl0.shape == kl1.shape == (8,)  # the dropped rows: 2 rounds x 2 groups x 2 samples
    assert trainers[0].collector.extra_prompts == trainers[1].collector.extra_prompts == 8


# --- kill -9 and resume -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dynamic_sampling_killed_and_resumed_ends_bit_identical(tiny_model_dir, prompt_file, tmp_path):
    """grpo with dynamic sampling on 0/1 scores (further rounds happen), a checkpoint every 2 steps: a run
    killed with SIGKILL as step 4 starts and resumed logs and saves what the uninterrupted run did, bit for
    bit (the prompt stream's extra rounds and the RNG are in the checkpoint)."""
    from safetensors.torch import load_file

    def command(out, *more, kill_at=None):
        args = ppo_cli_args(
            tiny_model_dir,
            "none",
            prompt_file,
            out,
            4,
            advantage_estimator="grpo",
            samples_per_prompt=2,
            rollout_batch_size=2,
            mini_batch_size=4,
            save_steps=2,
            reward_fn=EVEN,
            dynamic_sampling="true",
            dynamic_sampling_max_rounds=4,
            gold_judge="none",
        )
        return ppo_command(args, *more, kill_at=kill_at)

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
