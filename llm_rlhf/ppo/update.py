"""PPO's update: K epochs of clipped minibatch updates on a rollout, apart from the rollout and the step's
bookkeeping.

`PPOUpdate.run(rollout, advantages, returns)` is the inner loop of Ziegler et al. (2019) / Stiennon et al.
(2020): shuffled minibatches, each `gradient_accumulation_steps` micro-batches whose losses are token shares of
the global minibatch, the optimiser and LR-schedule steps, the ratio guard and the approx-KL early stop; the
policy-loss family (`policy_loss`, `loss_aggregation`, `sampler_correction`, `mask_truncated`)
changes the loss here. It owns the optimiser, the schedule and the statistics an update logs (`train_stats`);
`PPOTrainer` (`llm_rlhf.ppo.trainer`) hands it the rollout, the advantages and the returns, and runs the forwards
through `forward_policy`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from llm_rlhf.core.errors import NonFiniteError, UserError
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.ppo.context import PPOContext, UsesContext
from llm_rlhf.rl import loss_math, ppo_math
from llm_rlhf.rl.policy_losses import LossInputs
from llm_rlhf.rl.rollout import Rollout

TRAIN_STATS = (
    ppo_metrics.LOSS_POLICY,
    ppo_metrics.LOSS_VALUE,
    ppo_metrics.POLICY_ENTROPY,
    ppo_metrics.POLICY_APPROXKL,
    ppo_metrics.POLICY_CLIPFRAC,
    ppo_metrics.VAL_CLIPFRAC,
    ppo_metrics.POLICY_RATIO,
)  # token means over each global minibatch, averaged over the minibatches
# not computed without a value function (critic-free estimators)
VALUE_STATS = (ppo_metrics.LOSS_VALUE, ppo_metrics.VAL_CLIPFRAC)
# kl_coef * mean k3 over the minibatch's tokens, when the KL is in the loss
KL_LOSS_STAT = ppo_metrics.LOSS_KL
DISTILL_LOSS_STAT = ppo_metrics.LOSS_DISTILL  # distill_coef * the divergence to the teacher, a loss term
# The policy-loss family's statistics, each logged only when its option is on, token means as above:
CLIP_SIDE_STATS = (
    ppo_metrics.POLICY_CLIPFRAC_LOW,
    ppo_metrics.POLICY_CLIPFRAC_HIGH,
)  # clip-higher, gspo, cispo
DUAL_CLIP_STAT = ppo_metrics.POLICY_DUAL_CLIPFRAC  # dual_clip
SAMPLER_STATS = (
    ppo_metrics.SAMPLER_MEAN_WEIGHT,
    ppo_metrics.SAMPLER_CORRECTED_FRAC,
    ppo_metrics.SAMPLER_WEIGHT_SQ_DEV,
)  # sampler_correction; the last becomes SAMPLER_WEIGHT_STD (`loss_math.spread_about_one`)


def train_stats(cfg) -> tuple[str, ...]:
    """The statistics of an update: no value loss without a value function, the KL loss when it is there, the
    family's statistics when their options are on."""
    stats = tuple(s for s in TRAIN_STATS if cfg.estimator.critic or s not in VALUE_STATS) + (
        (KL_LOSS_STAT,) if cfg.kl_penalty_in_loss else ()
    )
    clip_sides = not cfg.policy_loss_row.plain or (cfg.cliprange_low, cfg.cliprange_high) != (None, None)
    return stats + (
        (CLIP_SIDE_STATS if clip_sides else ())
        + ((DUAL_CLIP_STAT,) if cfg.dual_clip is not None else ())
        + (SAMPLER_STATS if cfg.sampler_correction != "none" else ())
        + ((DISTILL_LOSS_STAT,) if cfg.distill_top_k_in_loss else ())
    )


def trainable_parameters(policy, critic) -> list[torch.nn.Parameter]:
    """The parameters with requires_grad of the policy and of the critic (None without a separate one)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    if critic is not None:
        params += [p for p in critic.parameters() if p.requires_grad]
    return params


def what_was_updated(updates: int, *, this_step: bool) -> str:
    """What a non-finite loss or gradient norm in the train phase leaves behind, for its error message.
    `updates`: optimiser steps this PPO step took before the failing minibatch; `this_step`: the failing
    minibatch's own step may have been applied (DeepSpeed's engine steps before the norm is read). Earlier
    minibatches of the same PPO step have already moved the weights; the KL controller, the step count and
    the checkpoints are updated only after a whole PPO step."""
    own = (
        "this minibatch's step may have been applied by the DeepSpeed engine"
        if this_step
        else ("this minibatch updated nothing")
    )
    if updates == 0:
        return (
            "nothing was updated" if not this_step else f"{own}; no earlier step of this PPO step was taken"
        )
    return (
        f"{own}, but {updates} earlier optimiser step{'s' if updates > 1 else ''} of this PPO step already "
        "updated the weights (and the LR schedule); the KL controller, the step count and the checkpoints "
        "were not updated (the last checkpoint predates this PPO step)"
    )


class PPOUpdate(UsesContext):
    """The update of `PPOTrainer` (the module docstring). context: the trainer's `PPOContext`; policy and critic
    (as prepared), optimizer, scheduler. `run` receives the rollout and the policy's forward
    (forward_policy(samples, train=True) -> (logprobs, values, entropy)) at each call."""

    def __init__(self, context: PPOContext, *, policy, critic, optimizer, scheduler):
        self.context = context
        self.policy, self.critic, self.optimizer, self.scheduler = policy, critic, optimizer, scheduler
        self.train_stats = train_stats(context.cfg)
        self.kl_coef, self.step, self.forward_policy = None, 0, None  # set by each `run`

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The policy's (and the separate critic's) parameters that the optimiser steps."""
        return trainable_parameters(self.policy, self.critic)

    def run(
        self,
        rollout: Rollout,
        advantages: torch.Tensor,
        returns: torch.Tensor | None,
        *,
        kl_coef: float,
        step: int,
        forward_policy: Callable,
    ) -> dict[str, float]:
        """K epochs over shuffled minibatches; each minibatch is `gradient_accumulation_steps` micro-batches.

        The loss of a micro-batch: the clipped policy loss, + vf_coef * the clipped value loss towards
        `returns` with gae (the critic-free estimators have no value function: returns None), + kl_coef * the
        mean k3 to the reference when the KL is in the loss (`ppo_math.kl_loss`; beta of the rollout, the
        controller moves after the update), - ent_coef * entropy.

        Every loss is a token mean over the global minibatch: a micro-batch's masked mean is weighted by
        its share of the minibatch's tokens (times the number of processes, since DDP averages gradients),
        so accumulation and data parallelism change only the float rounding, and so does trimming: each
        micro-batch's forward runs on its own rows' real tokens (`forward_policy`). Gradients are
        all-reduced once per minibatch, in the backward of its last micro-batch (`Accelerated.accumulating`).
        The ratio guard and the approx-KL early stop decide on global statistics, so every process takes the
        same branch; a skipped minibatch is counted, not averaged into the statistics.

        The first epoch visits the rows in rollout order, the micro-batches on which `rollout` computed
        the old log-probs (the rows are already in random prompt order, `RolloutCollector.queries`): the same rows
        trimmed to the same widths, so rho == 1 exactly before the first update; later epochs shuffle.

        The policy-loss family (with every key at its default the update above, with its arithmetic:
        `Config.plain_policy_loss`; `llm_rlhf.rl.policy_losses` says why two paths): the token losses of
        policy_loss (its row's `token_losses`, with the clip keys it reads), times the sampler
        correction's weights (`sampler_weights`), make the policy loss by `loss_math.aggregate_loss` over the
        normaliser N of loss_aggregation summed over the global minibatch (one all-reduce with its token count):
        each micro-batch's share is a sum over its rows / N, so the shares add up to the minibatch's loss on
        any split (times the number of processes, as DDP averages). With mask_truncated the truncated responses
        leave the loss mask of every term (policy, value, KL, entropy) and the counts.
        """
        # this run's: the KL loss's beta, the PPO step (for errors), the trainer's policy forward
        self.kl_coef, self.step, self.forward_policy = kl_coef, step, forward_policy
        cfg, sizes = self.cfg, self.sizes
        # No old log-probs yet (`PPOTrainer.old_logprobs_from_update`): the policy this forward runs is the old policy, and
        # its detached log-probs and entropy are the rollout's, filled in here for the metrics and the KL.
        fill = rollout.logprobs is None
        if fill:
            rollout.logprobs, rollout.entropy = (torch.zeros_like(rollout.ref_logprobs) for _ in range(2))
        loss_mask = self.loss_mask(rollout)  # (B, R)
        sampler = self.sampler_weights(
            rollout, loss_mask
        )  # (weights, corrected), (B, R) each, or (None, None)
        history, skipped, stopped_early = [], 0, False
        for epoch in range(cfg.ppo_epochs):
            n = sizes.rollout_per_process  # the first epoch in rollout order, later ones shuffled
            order = (
                torch.arange(n, device=self.device) if epoch == 0 else torch.randperm(n, device=self.device)
            )
            for mb in order.split(sizes.mini_batch_per_process):
                stats = self.accumulate_minibatch(
                    rollout,
                    mb,
                    advantages=advantages,
                    returns=returns,
                    loss_mask=loss_mask,
                    sampler=sampler,
                    fill=fill,
                )
                if not all(np.isfinite(list(stats.values()))):  # the same global numbers on every process
                    raise NonFiniteError(
                        f"PPO step {self.step + 1}, train phase (epoch {epoch + 1}): non-finite loss "
                        f"({', '.join(k for k, v in stats.items() if not np.isfinite(v))}); "
                        + what_was_updated(len(history), this_step=False)
                    )
                if stats[ppo_metrics.POLICY_RATIO] > cfg.ratio_guard:  # a diverged minibatch: drop its update
                    self.accelerated.discard_gradients(self.policy, self.optimizer)
                    skipped += 1
                    continue
                self.optimizer_step(epoch, updates=len(history))
                history.append(stats)  # one entry per optimiser step taken
                if (
                    cfg.target_approxkl is not None
                    and stats[ppo_metrics.POLICY_APPROXKL] > cfg.target_approxkl
                ):
                    stopped_early = True
                    break
            if stopped_early:
                break
        return self.statistics(history, skipped=skipped, stopped_early=stopped_early)

    def statistics(self, history: list[dict], *, skipped: int, stopped_early: bool) -> dict[str, float]:
        """The update's log: each of `train_stats` averaged over the optimiser steps taken (`history`, one
        dict each; NaN when none was), the sampler weights' spread from its two token means, the minibatches
        the ratio guard skipped, whether target_approxkl stopped the epochs, and the learning rate."""
        out = {k: float(np.mean([h[k] for h in history])) if history else math.nan for k in self.train_stats}
        if ppo_metrics.SAMPLER_WEIGHT_SQ_DEV in out:  # the weights' spread, from token means that split
            mean_sq_dev = out.pop(ppo_metrics.SAMPLER_WEIGHT_SQ_DEV)
            out[ppo_metrics.SAMPLER_WEIGHT_STD] = loss_math.spread_about_one(
                mean=out[ppo_metrics.SAMPLER_MEAN_WEIGHT], mean_sq_dev=mean_sq_dev
            )
        out.update(
            {
                ppo_metrics.POLICY_SKIPPED_MINIBATCHES: float(skipped),
                ppo_metrics.POLICY_EARLY_STOPPED: float(stopped_early),
                ppo_metrics.LR: self.scheduler.get_last_lr()[0],
            }
        )
        return out

    def loss_mask(self, rollout: Rollout) -> torch.Tensor:
        """The tokens every loss term counts, (B, R): the response mask, less the truncated responses with
        mask_truncated (DAPO's overlong filtering)."""
        if not self.cfg.mask_truncated:
            return rollout.response_mask
        truncated = ~rollout.ended(self.tokenizer.eos_token_id)  # (B,)
        return loss_math.mask_truncated(response_mask=rollout.response_mask, truncated=truncated)  # (B, R)

    def minibatch_counts(
        self, mb: torch.Tensor, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The global minibatch's token count and, with the policy-loss family, the normaliser N of
        `loss_math.aggregate_loss`, both summed over processes in one all-reduce. `mb` (b,) the rows of this
        process's part; without the family the count is of response tokens and N is None."""
        cfg = self.cfg
        if cfg.plain_policy_loss:
            return self.global_sum(loss_mask[mb].sum()), None
        normaliser = loss_math.loss_normaliser(
            loss_mask=loss_mask[mb], aggregation=cfg.aggregation, max_new_tokens=cfg.response_width
        )
        tokens, normaliser = self.global_sum(torch.stack([loss_mask[mb].sum(), normaliser]))
        return tokens, normaliser

    def accumulate_minibatch(
        self,
        rollout: Rollout,
        mb: torch.Tensor,
        *,
        advantages: torch.Tensor,
        returns: torch.Tensor | None,
        loss_mask: torch.Tensor,
        sampler: tuple[torch.Tensor | None, torch.Tensor | None],
        fill: bool,
    ) -> dict[str, float]:
        """One minibatch's gradients, accumulated over its micro-batches and all-reduced in the backward of the
        last, and its global statistics (`train_stats`, the same numbers on every process).

        A micro-batch's loss is weighted by its share of the global minibatch's tokens (times the number of
        processes, as DDP averages); with the policy-loss family the policy loss is already a share of the
        global N (`minibatch_counts`) and only multiplied by the processes. `mb` (b,) this process's rows;
        `loss_mask` (B, R); `sampler` the correction's (weights, corrected) (B, R), or Nones; `fill`: the
        rollout has no old log-probs yet and this forward writes them (the ratio is 1 exactly)."""
        cfg, sizes = self.cfg, self.sizes
        plain, processes = cfg.plain_policy_loss, self.accelerator.num_processes
        weights, corrected = sampler
        # the policy loss's share is already divided by the global N: summed, not token-weighted, in the stats
        summed = torch.tensor(
            [k == ppo_metrics.LOSS_POLICY and not plain for k in self.train_stats], device=self.device
        )
        mb_tokens, normaliser = self.minibatch_counts(mb, loss_mask)
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(len(self.train_stats), device=self.device)
        micro_batches = mb.split(sizes.micro_batch_per_process)
        for i, mc in enumerate(micro_batches):
            part = rollout.select(mc)
            mask = loss_mask[mc]  # (b, R)
            last = i == len(micro_batches) - 1
            with self.accelerated.accumulating((self.policy, self.critic), last=last):
                teacher_top = part.teacher_top_ids is not None  # distillation's loss term (`other_terms`)
                extra = {"teacher_top": True} if teacher_top else {}  # the plain call otherwise, as before it
                logprobs, values, entropy, *student_top = self.forward_policy(part, train=True, **extra)
                old_logprobs = logprobs.detach() if fill else part.logprobs  # fill: ratio 1 exactly
                if fill:
                    rollout.logprobs[mc], rollout.entropy[mc] = old_logprobs, entropy.detach()
                pg_loss, loss, parts = self.policy_terms(
                    logprobs=logprobs,
                    old_logprobs=old_logprobs,
                    advantages=advantages[mc],
                    mask=mask,
                    normaliser=normaliser,
                    sampler=None if weights is None else (weights[mc], corrected[mc]),
                )
                loss = self.other_terms(
                    loss,
                    parts,
                    part=part,
                    logprobs=logprobs,
                    values=values,
                    entropy=entropy,
                    returns=None if returns is None else returns[mc],
                    mask=mask,
                    student_top=student_top[0] if teacher_top else None,
                )
                weight = mask.sum() * processes / mb_tokens.clamp(min=1)
                scaled = loss * weight if plain else pg_loss * processes + loss * weight
                self.accelerated.backward(self.policy, scaled, last=last)
            stat = torch.stack([parts[k].detach().float() for k in self.train_stats])
            totals += stat * weight if plain else stat * torch.where(summed, processes, weight)
        return dict(zip(self.train_stats, self.accelerator.reduce(totals, reduction="mean").tolist()))

    def policy_terms(
        self,
        *,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        normaliser: torch.Tensor | None,
        sampler: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """A micro-batch's policy loss: (pg_loss, the loss its other terms add to, the statistics).

        normaliser None (`Config.plain_policy_loss`): the clipped loss as a token mean over this micro-batch's
        mask, which `accumulate_minibatch` weights by its share of the minibatch's tokens (the arithmetic PPO
        used before the family existed, bit for bit), and the loss starts from it. Else this micro-batch's
        share of `loss_math.aggregate_loss` over the global normaliser (`policy_loss_share`), the sampler
        correction's (weights, corrected) (B, R) applied, and the other terms start from 0 (they keep their
        token-share weights)."""
        if normaliser is None:  # the plain loss, with its arithmetic (bit-identical runs)
            pg_loss, pg = ppo_math.policy_loss(
                logprobs=logprobs,
                old_logprobs=old_logprobs,
                advantages=advantages,
                response_mask=mask,
                cliprange=self.cfg.cliprange,
            )
            parts = {
                ppo_metrics.LOSS_POLICY: pg_loss,
                ppo_metrics.POLICY_APPROXKL: pg.approxkl,
                ppo_metrics.POLICY_CLIPFRAC: pg.clipfrac,
                ppo_metrics.POLICY_RATIO: ppo_math.masked_mean(pg.ratio, mask),
            }
            return pg_loss, pg_loss, parts
        weights, corrected = sampler if sampler is not None else (None, None)
        pg_loss, parts = self.policy_loss_share(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            advantages=advantages,
            loss_mask=mask,
            normaliser=normaliser,
            weights=weights,
        )
        if weights is not None:
            parts[ppo_metrics.SAMPLER_MEAN_WEIGHT] = ppo_math.masked_mean(weights, mask)
            parts[ppo_metrics.SAMPLER_CORRECTED_FRAC] = ppo_math.masked_mean(corrected.float(), mask)
            parts[ppo_metrics.SAMPLER_WEIGHT_SQ_DEV] = ppo_math.masked_mean((weights - 1.0) ** 2, mask)
        return pg_loss, torch.zeros((), device=self.device), parts

    def other_terms(
        self,
        loss: torch.Tensor,
        parts: dict[str, torch.Tensor],
        *,
        part: Rollout,
        logprobs: torch.Tensor,
        values: torch.Tensor | None,
        entropy: torch.Tensor,
        returns: torch.Tensor | None,
        mask: torch.Tensor,
        student_top: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """loss + vf_coef * the clipped value loss (gae) + the k3 KL loss (the KL in the loss) - ent_coef *
        entropy, each a token mean over `mask`, added in this order (the float rounding of every run so far),
        + distill_coef * the divergence to the teacher over its top k tokens (distill_loss forward_kl or jsd,
        `ppo_math.topk_divergence`; student_top: log pi_theta of those tokens, (b, R, k)); their statistics go
        into `parts`."""
        cfg = self.cfg
        entropy = ppo_math.masked_mean(entropy, mask)
        parts[ppo_metrics.POLICY_ENTROPY] = entropy
        if cfg.estimator.critic:  # gae: the value head's or the critic's loss
            vf_loss, vf = ppo_math.value_loss(
                values=values,
                old_values=part.values,
                returns=returns,
                response_mask=mask,
                cliprange_value=cfg.cliprange_value,
            )
            loss = loss + cfg.vf_coef * vf_loss
            parts.update({ppo_metrics.LOSS_VALUE: vf_loss, ppo_metrics.VAL_CLIPFRAC: vf.clipfrac})
        if cfg.kl_penalty_in_loss:
            kl_loss = ppo_math.kl_loss(
                logprobs=logprobs,
                ref_logprobs=part.ref_logprobs,
                response_mask=mask,
                kl_coef=self.kl_coef,
            )
            loss = loss + kl_loss
            parts[KL_LOSS_STAT] = kl_loss
        loss = loss - cfg.ent_coef * entropy
        if student_top is not None:
            divergence = ppo_math.topk_divergence(
                student_logprobs=student_top,
                teacher_logprobs=part.teacher_top_logprobs,
                beta=cfg.distill_jsd_beta if cfg.distill_loss == "jsd" else 0.0,
            )  # (b, R)
            distill = cfg.distill_coef * ppo_math.masked_mean(divergence, mask)
            parts[DISTILL_LOSS_STAT] = distill
            loss = loss + distill
        return loss

    def policy_loss_share(
        self,
        *,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        normaliser: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's share of its minibatch's policy loss under the policy-loss family, and its token
        statistics (masked means over `loss_mask`):

            l_t   = token loss of policy_loss (its row's `token_losses`, `llm_rlhf.rl.policy_losses`)  (b, R)
            l_t  *= w_t                        the sampler correction's weight (`sampler_weights`), if on
            share = aggregate_loss(l, loss_aggregation, N)    N: the global minibatch's normaliser

        logprobs (with grad), old_logprobs, advantages, weights: (b, R); loss_mask: (b, R) bool."""
        cfg = self.cfg
        losses, st = cfg.policy_loss_row.token_losses(
            LossInputs(
                logprobs=logprobs,
                old_logprobs=old_logprobs,
                advantages=advantages,
                response_mask=loss_mask,
                cliprange_low=cfg.clip_low,
                cliprange_high=cfg.clip_high,
                dual_clip=cfg.dual_clip,
            )
        )  # (b, R)
        if weights is not None:
            losses = losses * weights  # (b, R)
        share = loss_math.aggregate_loss(
            token_losses=losses, loss_mask=loss_mask, aggregation=cfg.aggregation, normaliser=normaliser
        )
        with torch.no_grad():
            mean = lambda x: ppo_math.masked_mean(x.float(), loss_mask)  # noqa: E731
            parts = {
                ppo_metrics.LOSS_POLICY: share,
                ppo_metrics.POLICY_APPROXKL: 0.5 * mean((logprobs - old_logprobs) ** 2),
                ppo_metrics.POLICY_CLIPFRAC: mean(st.clipped),
                ppo_metrics.POLICY_RATIO: mean(st.ratio),
                ppo_metrics.POLICY_CLIPFRAC_LOW: mean(st.clipped_low),
                ppo_metrics.POLICY_CLIPFRAC_HIGH: mean(st.clipped_high),
                DUAL_CLIP_STAT: mean(st.dual_clipped),
            }
        return share, parts

    def sampler_weights(
        self, rollout: Rollout, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """sampler_correction's per-token weights and where they were truncated or masked, (B, R) each, from
        the sampler's recorded log q(y_t) to the old policy's (`loss_math.sampler_correction_weights`); the
        same for every epoch. (None, None) when sampler_correction is none."""
        cfg = self.cfg
        if cfg.sampler_correction == "none":
            return None, None
        if rollout.sampler_logprobs is None:
            raise UserError(
                f"sampler_correction {cfg.sampler_correction}: the sampler recorded no log-probs of its tokens "
                "(a model sampled through its own generate); use sampler_correction none"
            )
        weights, stats = loss_math.sampler_correction_weights(
            old_logprobs=rollout.logprobs,
            sampler_logprobs=rollout.sampler_logprobs,
            response_mask=loss_mask,
            correction=cfg.sampler_correction,
            cap=cfg.sampler_correction_cap,
        )
        return weights, stats.corrected

    def optimizer_step(self, epoch: int, *, updates: int) -> None:
        """Clip the gradients, step the optimiser, then the LR schedule: once per optimiser step on every
        process, whatever their number. Under DeepSpeed the engine's step clips and steps the optimiser
        (`Accelerated.clip_gradients`), and the gradient norm is checked after it. `updates`: the optimiser
        steps this PPO step has already taken (for the error message)."""
        deepspeed = self.accelerated.deepspeed
        grad_norm = self.accelerated.clip_gradients(
            self.policy, self.trainable_parameters(), self.cfg.max_grad_norm
        )
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            raise NonFiniteError(
                f"PPO step {self.step + 1}, train phase (epoch {epoch + 1}): non-finite gradient norm; "
                + what_was_updated(updates, this_step=deepspeed)
            )
        if not deepspeed:
            self.optimizer.step()
        if not self.optimizer.step_was_skipped:  # an fp16 overflow: no update, so the schedule waits too
            self.scheduler.step()
