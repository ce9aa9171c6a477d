"""PPO stage: policy with a value head, a frozen reference, a frozen reward model, adaptive KL.

One PPO step (`ppo_step`) reads like the algorithm box of Ziegler et al. (2019) / Stiennon et al. (2020):

    rollout (sample responses, old log-probs and values in one pass) -> reference log-probs
    -> scores (the reward model's, or a reward-model ensemble's combined; + reward_fn_weight * reward_fn
    when set)
    -> shaped rewards (-beta*KL per token + score at the last token)
    -> GAE -> K epochs of clipped policy/value updates on shuffled minibatches
    -> KL controller update -> metrics

The policy-loss family (`policy_loss`: PPO's clip with clip-higher and the dual clip, GSPO, CISPO;
`loss_aggregation`; `sampler_correction`; `mask_truncated`) changes the update (`train_on_rollout`), overlong
shaping the scores (`shaped_scores`) and `dynamic_sampling` the rollout (`dynamic_rollout`); with every key at
its default the step is the one above, bit for bit.

With `environment` set each row is an episode of several turns (`llm_rlhf.rl.episodes`, collected by
`EpisodeCollector`): the policy's turns and the environment's replies in one response, response_mask the policy's
tokens (every loss, KL and value term reads only them), the environment's per-turn rewards added to the rewards.

`advantage_estimator` swaps GAE for a critic-free estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax;
their papers in `llm_rlhf.rl.estimators`) on the same rollout, KL, clipped update, processes and checkpoints: each prompt is
sampled `samples_per_prompt` times (its group, consecutive rows on one process), no value head or critic
is built, and the KL goes in the reward or, as k3 per token, in the loss (`kl_in_loss`). What the trainer
knows of an estimator is its row in `llm_rlhf.rl.estimators` (`Config.estimator`), never its name.

The math lives in `llm_rlhf.rl.ppo_math` and `llm_rlhf.rl.loss_math` (torch only), the keys and the
batch-size arithmetic in `llm_rlhf.ppo.config`, sampling and the forwards over a rollout in
`llm_rlhf.rl.rollout`, the scores in `llm_rlhf.models.scoring`, and what each accelerate config (DeepSpeed,
FSDP2, FSDP, mixed precision) needs of the models in `llm_rlhf.models.accelerated`. Two collaborators: the prompts, sampling, scoring and dynamic
sampling are `llm_rlhf.ppo.rollouts.RolloutCollector` (`self.collector`: prompts in, token ids, masks, the
sampler's log-probs and scores out), the K epochs of minibatch updates `llm_rlhf.ppo.update.PPOUpdate`
(`self.update`); this module holds the trainer, which moves tensors between them and the models.
The command around it is `llm_rlhf.stages.ppo` (the run loop and the logs), with `llm_rlhf.ppo.building`
(the models and the trainer), `llm_rlhf.ppo.checkpoints` (checkpoints and the final save) and
`llm_rlhf.ppo.heldout` (the held-out evaluations). Run it with `llm-rlhf ppo --config recipes/reviews/ppo.yaml [--key value ...]`, also
under `accelerate launch` with several processes.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from llm_rlhf.core.errors import NonFiniteError, UserError
from llm_rlhf.models import trunk
from llm_rlhf.models.accelerated import Accelerated
from llm_rlhf.models.scoring import Scorer, Scores
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.ppo.config import Config, batch_sizes
from llm_rlhf.ppo.context import PPOContext, UsesContext
from llm_rlhf.ppo.rollouts import EpisodeCollector, RolloutCollector
from llm_rlhf.ppo.update import PPOUpdate, trainable_parameters
from llm_rlhf.rl import loss_math, ppo_math
from llm_rlhf.rl.cast_once import frozen_weights_cast_once
from llm_rlhf.rl.estimators import AdvantageInputs
from llm_rlhf.rl.rollout import (
    Rollout,
    Samples,
    Sampling,
    pad_columns,
    response_logprobs_and_values,
    teacher_logprobs_and_top_k,
)

# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


@dataclass
class PPOModels:
    """What `llm_rlhf.ppo.building.build_models` loads for the trainer: the policy
    (`llm_rlhf.models.loading.PolicyWithValue`, with its value head unless a separate critic), the frozen
    reference (`llm_rlhf.models.loading.Reference`; with LoRA the policy's own
    network), the frozen reward model (a `RewardModel`, a `RewardEnsemble` or None), the optional critic
    (`RewardCritic`, value_model 'reward') and on-policy distillation's frozen teacher (a `Reference`, or None)."""

    policy: Any
    ref_model: Any
    reward_model: Any = None
    critic: Any = None
    teacher: Any = None


def optimizer_and_schedule(cfg: Config, models: PPOModels, sizes, device: torch.device):
    """AdamW over the trainable parameters of the policy (and the critic) and its LR schedule (constant, or
    linear to 0 over the run's optimiser steps)."""
    params = [
        p for m in (models.policy, models.critic) if m is not None for p in m.parameters() if p.requires_grad
    ]
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.learning_rate,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        # One kernel per step instead of ~8 elementwise passes per tensor: on CPU the default
        # for-loop AdamW took ~10% of a GPT-2 124M update (benchmarks/README.md).
        fused=device.type in ("cpu", "cuda"),
    )
    total = cfg.steps * sizes.optimizer_steps_per_ppo_step
    decay = (lambda i: max(0.0, 1.0 - i / total)) if cfg.lr_scheduler_type == "linear" else (lambda i: 1.0)
    # Not handed to `accelerator.prepare`: its scheduler wrapper steps the schedule num_processes times per
    # optimiser step (made for dataloaders that give each process 1/N of the batches), so with N processes
    # the linear decay reached 0 after 1/N of the run, and under DeepSpeed the engine steps only
    # DeepSpeed's own schedules, so this one never moved. `PPOUpdate.optimizer_step` steps it once.
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, decay)


class PPOTrainer(UsesContext):
    """Holds the models, the optimiser and the KL controller; `ppo_step` is one iteration.

    models: `PPOModels`; reward_fn: a loaded `llm_rlhf.models.reward_fn.RewardFn`, or None. The reward model and
    the reward function (at least one of them) make the scores (`scoring.Scorer`); verifier: the task's loaded
    accuracy_fn (a binary `RewardFn`) or None, read only by dynamic sampling (`RolloutCollector.tie_scores`). The precision and
    sharding plumbing of each accelerate config is `self.accelerated` (`accelerated.Accelerated`). `state_dict()` is
    what a checkpoint keeps of the trainer besides the models' weights and optimiser state."""

    def __init__(
        self,
        cfg: Config,
        *,
        accelerator,
        models: PPOModels,
        tokenizer,
        prompts,
        reward_fn=None,
        verifier=None,
        make_environment=None,
    ):
        if (
            models.reward_model is None
            and reward_fn is None
            and make_environment is None
            and models.teacher is None
        ):
            raise UserError(
                "reward_model_path: PPO needs a reward model, a reward_fn, an environment, a teacher or several"
            )
        sizes = batch_sizes(
            rollout_batch_size=cfg.rollout_batch_size,
            mini_batch_size=cfg.mini_batch_size,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            ppo_epochs=cfg.ppo_epochs,
            steps=cfg.steps,
            num_processes=accelerator.num_processes,
            samples_per_prompt=cfg.samples_per_prompt,
        )
        if sizes.episodes_per_step < 2:
            raise UserError(
                "rollout_batch_size: advantages are whitened over the global rollout batch, which needs at "
                f"least 2 episodes (rollout_batch_size {cfg.rollout_batch_size} x {accelerator.num_processes} "
                "processes)"
            )
        accelerated = Accelerated(
            accelerator, bf16=cfg.bf16, gradient_checkpointing=cfg.gradient_checkpointing
        )
        # what the rollout collector and the update share with the trainer (`context.PPOContext`)
        self.context = PPOContext(cfg, accelerator, accelerated, sizes, tokenizer)
        optimizer, self.scheduler = optimizer_and_schedule(cfg, models, sizes, accelerator.device)
        # the teacher in the policy's compute dtype where it runs as the reference does (teacher_dtype null)
        teacher_as_reference = (
            models.teacher is not None and cfg.teacher_dtype is None and cfg.teacher_device is None
        )
        frozen = [
            m
            for m in (models.ref_model, models.reward_model, models.teacher if teacher_as_reference else None)
            if m is not None
        ]
        self.policy, self.critic, self.optimizer = self.accelerated.prepare(
            models.policy,
            models.critic,
            optimizer,
            frozen=frozen,
            micro_batch_size=self.sizes.micro_batch_per_process,
            lora=cfg.use_lora,
            sampling_compile=cfg.sampling_compile,
        )
        self.accelerated.set_up_root(self.policy, tokenizer.eos_token_id)
        self.ref_model = models.ref_model
        self.teacher = (
            models.teacher
        )  # on-policy distillation: log pi_teacher of every sampled token, or None
        self.frozen_models = frozen
        # blocks whose output the rollout computes once (`llm_rlhf.models.trunk`): 0 = none
        reuse = (
            cfg.use_lora
            and cfg.reuse_frozen_blocks
            and not (accelerator.is_fsdp2 or self.accelerated.deepspeed)
        )
        self.trunk_blocks = trunk.frozen_block_count(self.unwrapped_policy.lm) if reuse else 0
        self.sampling = Sampling.of(cfg)
        # ReMax's baseline response: the same settings, greedy (temperature 0: argmax, no random draw).
        self.greedy = dataclasses.replace(self.sampling, temperature=0.0)
        self.kl_ctl = (
            ppo_math.AdaptiveKLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
            if cfg.kl_controller == "adaptive"
            else ppo_math.FixedKLController(cfg.init_kl_coef)
        )
        self.step = 0
        # prompts, sampling, scoring and dynamic sampling (`RolloutCollector`): what the forwards and the update
        # below receive as token ids, masks and scores
        scorer = Scorer(
            models.reward_model,
            reward_fn,
            reward_fn_weight=cfg.reward_fn_weight,
            rm_context=self.accelerated.autocast,
        )
        parts = dict(
            policy=self.policy, prompts=prompts, sampling=self.sampling, scorer=scorer, verifier=verifier
        )
        # episodes of several turns with an environment, else one response per row
        self.collector = (
            EpisodeCollector(self.context, make_environment=make_environment, **parts)
            if make_environment is not None
            else RolloutCollector(self.context, **parts)
        )
        # K epochs of clipped minibatch updates (`update`): the optimiser, the schedule, the losses
        self.update = PPOUpdate(
            self.context,
            policy=self.policy,
            critic=self.critic,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
        )

    # --- the trainer's state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What continues the run exactly besides the models' weights and optimiser state (written by
        `accelerated.Accelerated.save_model_state`) and the RNG: the step (which fixes the data position,
        `RolloutCollector.queries`), the KL controller and the LR schedule; with dynamic sampling the prompts its
        further rounds drew (the rest of the data position, the collector's state)."""
        return {
            "step": self.step,
            "kl_ctl": self.kl_ctl.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            **self.collector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.collector.load_state_dict(state)
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save_model_state(self, folder) -> None:
        """The weights and optimiser state into a checkpoint folder, sharded or not (every process calls it)."""
        self.accelerated.save_model_state(
            folder, policy=self.policy, critic=self.critic, optimizer=self.optimizer
        )

    def load_model_state(self, folder) -> None:
        self.accelerated.load_model_state(
            folder, policy=self.policy, critic=self.critic, optimizer=self.optimizer
        )

    # --- the algorithm -------------------------------------------------------------------------

    def ppo_step(self) -> dict[str, float]:
        """One PPO iteration (Ziegler et al. 2019, Algorithm 1; Stiennon et al. 2020, Appendix B); the
        critic-free estimators (`advantage_estimator`) change only how the advantages are made."""
        # the weights that do not train, cast to autocast's dtype once for the step (`rl.cast_once`)
        with frozen_weights_cast_once(*self.models_of_step()):
            cfg, times = self.cfg, {}
            queries = self.collector.queries(self.step)  # this process's prompts, each sampled k times below
            # y ~ pi_theta(.|x), logprobs (and values with gae), ref_logprobs, scores; with one update per step
            # the old log-probs and entropy come from the update's own forward instead (`old_logprobs_from_update`)
            from_update = self.old_logprobs_from_update
            sampling_stats, dropped_kl = {}, None
            if cfg.dynamic_sampling:  # DAPO: untied groups, from further prompts where some tie
                rollout, scores, sampling_stats, dropped_kl = self.dynamic_rollout(queries, times)
            else:
                rollout, scores = self.rollout(
                    self.collector.in_groups(queries), times, old_logprobs=not from_update
                )
            episode_stats = (
                self.collector.episode_stats() if isinstance(self.collector, EpisodeCollector) else {}
            )
            greedy = None  # ReMax: one greedy response per prompt, its logprobs, ref_logprobs and scores
            if cfg.estimator.greedy_baseline:
                greedy, _ = self.rollout(queries, times, sampling=self.greedy)
            self.check_finite(
                "rollout",
                scores=rollout.scores,
                # from_update: the log-probs are checked as part of the update's loss (`train_on_rollout`)
                **({"logprobs": rollout.logprobs} if not from_update else {}),
                ref_logprobs=rollout.ref_logprobs,
                **({"values": rollout.values} if rollout.values is not None else {}),
                **(
                    {"greedy_scores": greedy.scores, "greedy_logprobs": greedy.logprobs}
                    if greedy is not None
                    else {}
                ),
            )

            kl_coef = self.kl_ctl.value
            rewards, kl = self.rewards(rollout, kl_coef)  # -beta*KL per token (unless in the loss) + score
            if cfg.whiten_rewards:
                rewards = self.whiten(rewards, rollout.response_mask, shift_mean=False)
            baseline = None
            if greedy is not None:  # ReMax: the greedy response's reward, measured as the samples' are
                greedy_rewards, _ = self.rewards(greedy, kl_coef)
                baseline = ppo_math.masked_sum(greedy_rewards, greedy.response_mask, dim=-1)  # (P,)
            advantages, returns = self.advantages(rollout, rewards, baseline)

            t = time.perf_counter()
            train_stats = self.train_on_rollout(rollout, advantages, returns)  # K epochs of minibatch updates
            times["train"] = time.perf_counter() - t
            if (
                from_update
            ):  # the KL of the metrics and the controller, from the log-probs the update filled in
                _, kl = self.rewards(rollout, kl_coef)

            kl_seq = ppo_math.sequence_kl(kl=kl, response_mask=rollout.response_mask)  # (B,)
            if dropped_kl is not None:  # every sampled group's KL, the dropped ones' too (`dynamic_rollout`)
                kl_seq = torch.cat([kl_seq, dropped_kl])  # (rounds * P * k,), as many on every process
            sampled_kl = self.global_mean(kl_seq)
            self.kl_ctl.update(sampled_kl, self.sizes.episodes_per_step)  # n in episodes
            self.step += 1
            metrics = self.metrics(rollout, kl=kl, kl_coef=kl_coef, returns=returns, times=times)
            metrics[ppo_metrics.OBJECTIVE_KL] = sampled_kl
            if greedy is not None:
                metrics[ppo_metrics.OBJECTIVE_GREEDY_SCORES] = self.global_mean(greedy.scores.mean())
            if cfg.overlong_buffer > 0:
                metrics[ppo_metrics.OBJECTIVE_OVERLONG_PENALTY] = self.global_mean(
                    self.overlong(rollout).mean()
                )
            return {
                **metrics,
                **train_stats,
                **sampling_stats,
                **episode_stats,
                **self.score_term_means(scores),
            }

    def rewards(self, rollout: Rollout, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token rewards of a rollout and its per-token KL (kl_estimator), both (B, R):

            rewards_t = -kl_coef * KL_t + [t == last response token] * score      (`ppo_math.shaped_rewards`)

        the score clipped (score_clip), with the overlong penalty (`shaped_scores`) and replaced for responses
        that did not end (eos_penalty); with the KL in the loss (`Config.kl_penalty_in_loss`) the rewards hold
        the score alone. A rollout without old log-probs yet (`old_logprobs_from_update`, the KL in the loss)
        gets KL_t = 0 until the update fills them. Episodes of several turns: each turn's reward from the environment
        (`Samples.env_rewards`, on the turn's last token) is added to these rewards, so GAE sees it where it was given
        and the group estimators in the sequence reward. On-policy distillation (teacher_model_path) adds
        -distill_coef * d_t to every response token's reward (`distill_kl`), the KL penalty's place in the reward
        whatever kl_in_loss says: GAE and REINFORCE++ credit a token with the reverse KL of its own and the later
        tokens (the sequence KL's gradient), the group estimators with its sum over the response."""
        cfg = self.cfg
        kl = (
            torch.zeros_like(rollout.ref_logprobs)
            if rollout.logprobs is None
            else ppo_math.kl_penalty(
                logprobs=rollout.logprobs, ref_logprobs=rollout.ref_logprobs, estimator=cfg.kl_estimator
            )
        )
        rewards, _ = ppo_math.shaped_rewards(
            scores=self.shaped_scores(rollout, rollout.scores),
            kl=kl,
            kl_coef=0.0 if cfg.kl_penalty_in_loss else kl_coef,
            response_mask=rollout.response_mask,
            eos_penalty=cfg.eos_penalty,
            ended_with_eos=rollout.ended(self.tokenizer.eos_token_id)  # EOS or a stop string
            if cfg.eos_penalty is not None
            else None,
        )
        if rollout.env_rewards is not None:
            rewards = rewards + torch.where(rollout.response_mask, rollout.env_rewards, 0.0)  # (B, R)
        if (
            rollout.teacher_logprobs is not None and not cfg.distill_top_k_in_loss
        ):  # -distill_coef * d_t per token
            rewards = rewards - cfg.distill_coef * self.distill_kl(rollout)  # (B, R)
        return rewards, kl

    def distill_kl(self, rollout: Rollout) -> torch.Tensor:
        """d_t = log pi_theta(y_t|s_t) - log pi_teacher(y_t|s_t) of every response token, (B, R), 0 elsewhere
        (`ppo_math.distill_kl`): from the rollout's old log-probs, which a teacher always has computed."""
        return ppo_math.distill_kl(
            logprobs=rollout.logprobs,
            teacher_logprobs=rollout.teacher_logprobs,
            response_mask=rollout.response_mask,
        )

    def shaped_scores(self, samples: Samples, scores: torch.Tensor) -> torch.Tensor:
        """The scorer's `scores` (B,) as the rewards take them, before the EOS trick, (B,):

            clip(scores, -score_clip, score_clip)          score_clip (null = off)
            + overlong penalty                             overlong_buffer > 0 (`overlong`; DAPO)

        The overlong penalty comes after the clip (it is bounded already) and before the EOS trick
        (`ppo_math.shaped_rewards`, eos_penalty), which replaces the whole score of a truncated response: its
        score is eos_penalty when that is set, not eos_penalty minus overlong_penalty (one penalty for one
        fault); responses that ended inside the buffer keep their ramp either way."""
        cfg = self.cfg
        if cfg.score_clip is not None:
            scores = ppo_math.clip_scores(scores=scores, score_clip=cfg.score_clip)
        if cfg.overlong_buffer > 0:
            scores = scores + self.overlong(samples)
        return scores

    def overlong(self, samples: Samples) -> torch.Tensor:
        """DAPO's overlong penalty of each response, (B,) (`loss_math.overlong_penalty`): its length counts its
        tokens (EOS included; an episode's, the policy's and the environment's, which fill its budget together)
        against `cfg.response_width`; truncated = it ended with neither EOS nor a stop string."""
        cfg = self.cfg
        return loss_math.overlong_penalty(
            lengths=samples.tokens_mask.sum(-1),
            truncated=~samples.ended(self.tokenizer.eos_token_id),
            max_new_tokens=cfg.response_width,
            overlong_buffer=cfg.overlong_buffer,
            penalty=cfg.overlong_penalty,
        )

    def advantages(
        self, rollout: Rollout, rewards: torch.Tensor, baseline: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A_t for every response token, (B, R), from the per-token rewards (B, R), and the returns the value
        loss fits (None without a value function), by the estimator's advantage function
        (`Estimator.advantages`, `llm_rlhf.rl.estimators`):

            gae           GAE over the values, then whitened over the global batch
            reinforce_pp  gamma = 1 returns, whitened over the global batch (`ppo_math.reinforce_pp_advantages`)
            grpo, dr_grpo, rloo, remax, pass_at_k   one advantage per response from its sequence reward
                          r = sum_t rewards_t (the score, minus beta * KL when the KL is in the reward)
                          against its group (`ppo_math`), the same on each of its tokens

        The groups are this process's consecutive rows of k samples (`in_groups`): whole on this process, and
        taken over the whole rollout before any minibatch, so neither the number of processes nor the
        micro-batches change a group's statistics. baseline: ReMax's greedy sequence rewards, (P,)."""
        cfg = self.cfg
        inputs = AdvantageInputs(
            rewards=rewards,
            response_mask=rollout.response_mask,
            values=rollout.values,
            baseline=baseline,
            samples_per_prompt=cfg.samples_per_prompt,
            gamma=cfg.gamma,
            lam=cfg.lam,
            reduce_sum=self.reduce_sum,
            pass_k=cfg.pass_k,
        )
        return cfg.estimator.advantages(inputs)

    # --- phases -------------------------------------------------------------------------------

    @torch.no_grad()
    def rollout(
        self,
        queries: list[list[int]],
        times: dict[str, float] | None = None,
        *,
        sampling: Sampling | None = None,
        old_logprobs: bool = True,
    ) -> tuple[Rollout, Scores]:
        """The complete rollout of `queries`: samples, then the policy's old log-probs, values and entropy
        (one forward), the reference's log-probs and the scores (`score`), and the scores' parts. `times`, if
        given, adds the seconds of "generate" (sampling and the policy forward) and "score" (reference
        and scores). sampling: `self.sampling` unless given (ReMax's greedy baseline: `self.greedy`).
        old_logprobs False: no policy forward; logprobs, values and entropy stay None for `train_on_rollout`
        to fill in from the update's own forward (`old_logprobs_from_update`)."""
        t0 = time.perf_counter()
        samples = self.with_trunk(self.collector.generate(queries, sampling=sampling))  # y ~ pi_theta(.|x)
        logprobs = values = entropy = None
        if old_logprobs:
            logprobs, values, entropy = self.in_chunks(self.forward_policy, samples)
        t1 = time.perf_counter()
        ref_logprobs = self.reference_logprobs(samples)  # log pi_ref(y_t|s_t)
        scores = self.collector.score(samples)  # r_phi(x, y), normalised (+ reward_fn_weight * reward_fn)
        t2 = time.perf_counter()
        teacher = self.teacher_scores(samples)  # log pi_teacher(y_t|s_t) (and its top k), or nothing
        rollout = Rollout.of(
            samples,
            logprobs=logprobs,
            values=values,
            entropy=entropy,
            ref_logprobs=ref_logprobs,
            scores=scores.scores,
            **teacher,
        )
        if times is not None:
            times["generate"] = times.get("generate", 0.0) + t1 - t0
            times["score"] = times.get("score", 0.0) + t2 - t1
            if teacher:
                times["teacher"] = times.get("teacher", 0.0) + time.perf_counter() - t2
        return rollout, scores

    @torch.no_grad()
    def dynamic_rollout(
        self, queries: list[list[int]], times: dict[str, float]
    ) -> tuple[Rollout, Scores, dict[str, float], torch.Tensor]:
        """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): the rollout of rollout_batch_size groups per
        process whose verdicts (or unshaped scores) do not all tie, when the rounds allow it
        (`RolloutCollector.collect_untied`: the rounds, the selection and the sampling/* statistics); then the
        policy's (and value's) and the reference's forwards on the kept rows, in the micro-batches the first
        epoch visits, so rho == 1 exactly before the first update, and on the dropped rows for their KL alone
        (`dropped_kl`).

        Returns the rollout, its scores' parts, the statistics, and the dropped rows' sequence KL, (D,):
        `ppo_step` gives objective/kl and the KL controller the KL of every sampled group, since
        which groups are kept depends on the prompts (the ones the policy always or never solves are dropped)
        and the controller steers the policy's KL over the prompt stream. The KL penalty itself (in the reward
        or the loss) can only act on the rows that are trained."""
        episodes = self.collector.collect_untied(queries, self.step, times)
        kept = episodes.samples
        t0 = time.perf_counter()
        logprobs, values, entropy = self.in_chunks(self.forward_policy, kept)
        t1 = time.perf_counter()
        ref_logprobs = self.reference_logprobs(kept)
        t2 = time.perf_counter()
        rollout = Rollout.of(
            kept,
            logprobs=logprobs,
            values=values,
            entropy=entropy,
            ref_logprobs=ref_logprobs,
            scores=episodes.scores.scores,
            **self.teacher_scores(kept),
        )
        times["generate"] += t1 - t0
        times["score"] += t2 - t1
        if self.teacher is not None:
            times["teacher"] = times.get("teacher", 0.0) + time.perf_counter() - t2
        return rollout, episodes.scores, episodes.stats, self.dropped_kl(episodes.dropped, times)

    def dropped_kl(self, dropped: Samples | None, times: dict[str, float]) -> torch.Tensor:
        """The sequence KL (`ppo_math.sequence_kl`, kl_estimator) of the sampled rows dynamic sampling does not
        train, (D,) with D = (rounds - 1) * P * k, from the policy's and the reference's forwards on those rows
        (no generation: forwards only, about what the kept rows cost each round; 0 rows with one round)."""
        if dropped is None:
            return torch.zeros(0, device=self.device)
        t0 = time.perf_counter()
        logprobs, _, _ = self.in_chunks(self.forward_policy, dropped)
        t1 = time.perf_counter()
        ref_logprobs = self.reference_logprobs(dropped)
        times["generate"] += t1 - t0
        times["score"] += time.perf_counter() - t1
        kl = ppo_math.kl_penalty(
            logprobs=logprobs, ref_logprobs=ref_logprobs, estimator=self.cfg.kl_estimator
        )  # (D, R)
        return ppo_math.sequence_kl(kl=kl, response_mask=dropped.response_mask)  # (D,)

    @torch.no_grad()
    def with_trunk(self, samples: Samples) -> Samples:
        """`samples` with `trunk` = h_K (B, P + R, H), the output of the policy's K frozen blocks
        (`llm_rlhf.models.trunk`), which the old policy's, the reference's and every epoch's forward then
        start from; computed over the chunks `in_chunks` visits, each trimmed to its own widths (the rollout's
        forwards and the first epoch run on those rows and widths, so rho == 1 and KL == 0 stay exact),
        zeros at the columns a chunk trims. `samples` unchanged when no block is frozen (K = 0)."""
        k = self.trunk_blocks
        if k == 0:
            return samples
        policy, n = self.unwrapped_policy, self.sizes.micro_batch_per_process
        B, P = samples.query.shape
        hidden = None
        for i in range(0, B, n):
            part = samples.select(slice(i, i + n)).trimmed()
            with self.accelerated.autocast():
                h = trunk.trunk_states(
                    policy.lm, k, policy, part.sequence, part.attention_mask
                )  # (b, P'+R', H)
            if hidden is None:
                hidden = h.new_zeros(B, P + samples.response.shape[1], h.shape[-1])
            start = P - part.query.shape[1]
            hidden[i : i + n, start : start + h.shape[1]] = h
        return dataclasses.replace(samples, trunk=hidden)

    def trunk_context(self, samples: Samples):
        """Inside: a forward of the policy's network on `samples` starts from `samples.trunk` (if set)."""
        if samples.trunk is None:
            return nullcontext()
        return trunk.from_trunk(self.unwrapped_policy.lm, samples.trunk, self.trunk_blocks)

    def in_chunks(self, forward, samples: Samples):
        """`forward` over chunks of micro-batch rows, outputs concatenated along the batch: a no-grad pass
        over the whole rollout never holds its (B, R, V) logits and their softmax temporaries at once
        (the peak memory of a LoRA step), and runs on as many rows as a training micro-batch. `forward` trims
        each chunk to its own real tokens and returns (b, R) outputs."""
        n = self.sizes.micro_batch_per_process
        parts = [forward(samples.select(slice(i, i + n))) for i in range(0, samples.query.shape[0], n)]
        if isinstance(parts[0], torch.Tensor):
            return torch.cat(parts)  # (B, R)
        return tuple(None if xs[0] is None else torch.cat(xs) for xs in zip(*parts))  # each (B, R) or None

    def forward_policy(self, samples: Samples, *, train: bool = False, teacher_top: bool = False):
        """log pi_theta(y_t|s_t), V(s_t), entropy for the response tokens: (B, R) each, 0 at padding; V None
        without a value function (the critic-free estimators).

        The forward runs on `samples.trimmed()`: the rows' longest real query and response, not the padding
        up to max_new_tokens (each rollout chunk and each shuffled micro-batch of every PPO epoch is trimmed
        to its own rows; the shape may differ between processes, DDP's collectives are on gradients).
        train=True goes through the DDP wrapper (gradients synchronised in backward); otherwise the
        unwrapped module runs the same computation without DDP's gradient hooks. It is not free of
        collectives under sharding: under FSDP2 (`fully_shard` units) and DeepSpeed ZeRO-3 every forward
        all-gathers the parameters, so every process must call it the same number of times (PPO does: the
        rollout's chunks, `in_chunks`, and the micro-batches are the same count on every process).
        The log-probs are those of the distribution the tokens were drawn from (`self.sampling`: the
        temperature, EOS masked before min_new_tokens). teacher_top (a `Rollout` with the teacher's top-k ids,
        distill_loss forward_kl or jsd): also log pi_theta of those k tokens at each position, (B, R, k), 0 at
        padding, a fourth output.
        """
        R = samples.response.shape[1]
        samples = samples.trimmed()  # (B, P') query, (B, R') response
        unwrap = self.accelerator.unwrap_model
        policy = self.policy if train else unwrap(self.policy)
        # The entropy needs an autograd graph only when the loss uses it (ent_coef != 0).
        entropy_mode = "grad" if train and self.cfg.ent_coef != 0 else "stats"
        with (
            self.accelerated.autocast(),
            self.accelerated.checkpointing(self.unwrapped_policy, train),
            self.trunk_context(samples),
        ):
            logprobs, values, entropy, *at_top = response_logprobs_and_values(
                policy,
                samples,
                self.sampling,
                eos_token_id=self.tokenizer.eos_token_id,
                entropy=entropy_mode,
                at_ids=samples.teacher_top_ids if teacher_top else None,
            )
            if self.critic is not None:
                critic = self.critic if train else unwrap(self.critic)
                P = samples.query.shape[1]
                values = critic(samples.sequence, samples.attention_mask)[:, P - 1 : -1]  # (B, R')
        outputs = tuple(None if x is None else pad_columns(x.float(), R) for x in (logprobs, values, entropy))
        if not teacher_top:
            return outputs
        top = torch.nn.functional.pad(at_top[0].float(), (0, 0, 0, R - at_top[0].shape[1]))  # (B, R, k)
        return (*outputs, top)

    @torch.no_grad()
    def reference_logprobs(self, samples: Samples) -> torch.Tensor:
        """log pi_ref(y_t|s_t): (B, R), 0 at padding; each chunk's forward on its real tokens (`Samples.trimmed`).
        With LoRA: the policy's own network with the adapter disabled."""
        R, eos = samples.response.shape[1], self.tokenizer.eos_token_id

        def forward(part: Samples) -> torch.Tensor:
            part = part.trimmed()
            with self.trunk_context(part):
                logprobs = response_logprobs_and_values(
                    self.ref_model, part, self.sampling, eos_token_id=eos, entropy="none"
                )[0]
            return pad_columns(logprobs, R)  # (b, R)

        with self.accelerated.autocast(), self.reference_context():
            logprobs = self.in_chunks(forward, samples)
        return logprobs.float()

    @torch.no_grad()
    def teacher_scores(self, samples: Samples) -> dict[str, torch.Tensor]:
        """On-policy distillation's teacher on `samples`, as `Rollout` fields: teacher_logprobs, log
        pi_teacher(y_t|s_t) (B, R), 0 at padding, and with a loss term (distill_loss forward_kl or jsd) its top
        distill_top_k tokens' log-probs and ids, (B, R, k) each (`rollout.teacher_logprobs_and_top_k`: the
        sampling's temperature, EOS masked before min_new_tokens, each chunk trimmed to its real tokens); {}
        without a teacher. On the teacher's device, under the run's autocast unless teacher_dtype sets its
        own; the teacher has no frozen trunk of the policy's to start from."""
        if self.teacher is None:
            return {}
        R, eos, k = samples.response.shape[1], self.tokenizer.eos_token_id, self.cfg.distill_top_k_in_loss
        device = next(self.teacher.parameters()).device

        def forward(part: Samples):
            part = dataclasses.replace(part.trimmed(), trunk=None).to(device)
            logprobs, top, ids = teacher_logprobs_and_top_k(
                self.teacher, part, self.sampling, eos_token_id=eos, top_k=k
            )
            widen = lambda x: torch.nn.functional.pad(x, (0, 0, 0, R - x.shape[1])).to(self.device)  # noqa: E731
            logprobs = pad_columns(logprobs.float(), R).to(self.device)  # (b, R)
            return (logprobs, None, None) if k == 0 else (logprobs, widen(top.float()), widen(ids))

        with self.accelerated.autocast() if self.cfg.teacher_dtype is None else nullcontext():
            logprobs, top, ids = self.in_chunks(forward, samples)
        fields = {"teacher_logprobs": logprobs}
        if k:
            fields.update(teacher_top_logprobs=top, teacher_top_ids=ids)
        return fields

    def train_on_rollout(
        self, rollout: Rollout, advantages: torch.Tensor, returns: torch.Tensor | None
    ) -> dict[str, float]:
        """K epochs of clipped minibatch updates on `rollout` (`llm_rlhf.ppo.update.PPOUpdate.run`), with the KL
        coefficient of this step's rollout (the controller moves after the update)."""
        return self.update.run(
            rollout,
            advantages,
            returns,
            kl_coef=self.kl_ctl.value,
            step=self.step,
            forward_policy=self.forward_policy,
        )

    @property
    def old_logprobs_from_update(self) -> bool:
        """Whether `ppo_step` skips the rollout's old-policy forward and takes the old log-probs (and the
        entropy) from the update's own forward, detached: ratio = exp(logp - sg(logp)) = 1 exactly, as TRL's
        GRPOTrainer does with one iteration per batch. It skips work only where nothing changes, bit for bit:

        - one optimiser step per PPO step (ppo_epochs 1, one minibatch): the policy the update's forward runs
          is the old policy, on the rows the rollout's chunks hold, trimmed to the same widths (the first
          epoch keeps rollout order, `train_on_rollout`), with dropout off (`building.build_models` keeps the policy in eval
          mode), so the separate forward gave the same log-probs and the same gradient;
        - no value function (critic-free): GAE needs the old values before the update;
        - the KL in the loss (`Config.kl_penalty_in_loss`): in the reward, the advantages need the old
          log-probs before the update (the KL metric and controller read them after it, either way);
        - ent_coef 0: the update's entropy is then the rollout's (the same "stats" computation), which
          objective/entropy reports.
        """
        cfg = self.cfg
        return (
            self.sizes.optimizer_steps_per_ppo_step == 1
            and not cfg.dynamic_sampling  # `dynamic_rollout` runs its own forwards on the rows it keeps
            and cfg.sampler_correction == "none"  # its weights read the old log-probs before the update
            and not cfg.estimator.critic
            and cfg.kl_penalty_in_loss
            and cfg.ent_coef == 0
            and self.teacher is None  # distillation's rewards read the old log-probs before the update
        )

    # --- the step's log line ------------------------------------------------------------------

    def metrics(self, rollout: Rollout, *, kl, kl_coef, returns, times) -> dict[str, float]:
        """The step's log line: objective/*, val/* (with a value function), lengths, EOS rate and times, global
        over processes (`ppo_step` adds the update's statistics and the scores' parts, `score_term_means`).
        kl: the per-token KL_t (B, R) of `rewards`; objective/non_score_reward is the KL penalty as the
        objective counts it, -beta * KL_t, wherever it is optimised (in the reward, or as k3 in the loss), so
        objective/rlhf_reward means the same for every estimator. With dynamic_sampling these are over the kept
        groups, except objective/kl, which `ppo_step` sets to the KL of every sampled group (the controller's)."""
        mask = rollout.response_mask
        lengths = mask.sum(-1).float()  # (B,)
        kl_seq = ppo_math.sequence_kl(kl=kl, response_mask=mask)  # (B,)
        non_score_reward = torch.where(mask, -kl_coef * kl, 0)  # (B, R)
        non_score = ppo_math.masked_sum(non_score_reward, mask, dim=-1)  # (B,)
        tokens = self.global_sum(lengths.sum())
        step_time = sum(times.values())
        return {
            ppo_metrics.STEP: self.step,
            ppo_metrics.EPISODES: self.step * self.sizes.episodes_per_step,
            ppo_metrics.OBJECTIVE_SCORES: self.global_mean(rollout.scores.mean()),
            ppo_metrics.OBJECTIVE_SCORES_STD: self.global_std(rollout.scores),
            ppo_metrics.OBJECTIVE_KL: self.global_mean(kl_seq.mean()),
            ppo_metrics.OBJECTIVE_KL_COEF: float(kl_coef),
            ppo_metrics.OBJECTIVE_NON_SCORE_REWARD: self.global_mean(non_score.mean()),
            ppo_metrics.OBJECTIVE_RLHF_REWARD: self.global_mean((rollout.scores + non_score).mean()),
            ppo_metrics.OBJECTIVE_ENTROPY: self.global_mean(
                ppo_math.masked_sum(rollout.entropy, mask, dim=-1).mean()
            ),
            **(self.value_metrics(rollout, returns) if rollout.values is not None else {}),
            **(self.group_metrics(rollout) if self.cfg.samples_per_prompt > 1 else {}),
            **(self.sampler_metrics(rollout, tokens) if rollout.sampler_logprobs is not None else {}),
            ppo_metrics.RESPONSE_LENGTH: self.global_mean(lengths.mean()),
            ppo_metrics.EOS_RATE: self.global_mean(rollout.ended(self.tokenizer.eos_token_id).float().mean()),
            ppo_metrics.TIME_GENERATE: times["generate"],
            ppo_metrics.TIME_SCORE: times["score"],
            ppo_metrics.TIME_TRAIN: times["train"],
            **(
                self.distill_metrics(rollout, tokens, times["teacher"], step_time)
                if rollout.teacher_logprobs is not None
                else {}
            ),
            ppo_metrics.TIME_STEP: step_time,
            ppo_metrics.TOKENS_PER_S: float(tokens) / step_time,
        }

    def distill_metrics(
        self, rollout: Rollout, tokens: torch.Tensor, teacher_time, step_time
    ) -> dict[str, float]:
        """On-policy distillation: objective/distill_kl, the reverse KL to the teacher per response token (the
        global mean of d_t, `distill_kl`), time/teacher, the seconds of the teacher's forwards, and
        time/teacher_share, their share of the step."""
        total = self.global_sum(self.distill_kl(rollout).sum())  # ()
        return {
            ppo_metrics.OBJECTIVE_DISTILL_KL: float(total) / max(float(tokens), 1.0),
            ppo_metrics.TIME_TEACHER: teacher_time,
            ppo_metrics.TIME_TEACHER_SHARE: teacher_time / step_time,
        }

    def value_metrics(self, rollout: Rollout, returns: torch.Tensor) -> dict[str, float]:
        """val/explained_variance and val/mean of the value function (gae), global over processes."""
        mask = rollout.response_mask
        return {
            ppo_metrics.VAL_EXPLAINED_VARIANCE: float(
                ppo_math.explained_variance(
                    values=rollout.values, returns=returns, mask=mask, reduce_sum=self.reduce_sum
                )
            ),
            ppo_metrics.VAL_MEAN: self.global_mean(ppo_math.masked_mean(rollout.values, mask)),
        }

    def sampler_metrics(self, rollout: Rollout, tokens: torch.Tensor) -> dict[str, float]:
        """objective/kl_sampler: KL(q || pi_theta) per response token between the sampler's distribution q
        and the policy's, estimated on the sampled tokens (y_t ~ q) as the global mean of
        log q(y_t|s_t) - log pi_theta(y_t|s_t) (the old log-probs). ~1e-7 in float32 (q differs from
        pi_theta by float rounding only); with sampling_dtype bfloat16 the price of the faster sampler: the
        tokens come from q, while the ratio and the KL to the reference are computed under pi_theta."""
        gap = ppo_math.masked_sum(rollout.sampler_logprobs - rollout.logprobs, rollout.response_mask)  # ()
        return {ppo_metrics.OBJECTIVE_KL_SAMPLER: float(self.global_sum(gap)) / max(float(tokens), 1.0)}

    def group_metrics(self, rollout: Rollout) -> dict[str, float]:
        """With k > 1 samples per prompt: objective/group_scores_std, the std of the scores within a prompt's
        group (n - 1), averaged over the groups of every process, and objective/groups_tied, the share of
        groups whose k scores are all equal (with the KL in the loss, grpo, dr_grpo and rloo give their
        responses a zero advantage: the group teaches nothing). With dynamic_sampling these are the trained
        groups (the tied groups it filled in at its cap); the dropped ones are sampling/groups_dropped. With
        on-policy distillation's reward (distill_loss reverse_kl) a response's score here includes its
        -distill_coef * sum_t d_t, which its reward holds too, so its group is not tied."""
        scores = rollout.scores  # (B,) and with episodes the environment's rewards
        if rollout.env_rewards is not None:
            scores = scores + ppo_math.masked_sum(rollout.env_rewards, rollout.response_mask, dim=-1)
        if (
            rollout.teacher_logprobs is not None and not self.cfg.distill_top_k_in_loss
        ):  # the teacher's reward
            scores = scores - self.cfg.distill_coef * self.distill_kl(rollout).sum(-1)
        grouped = ppo_math.scores_by_prompt(
            scores=scores, samples_per_prompt=self.cfg.samples_per_prompt
        )  # (P, k)
        tied = (grouped == grouped[:, :1]).all(dim=1).float()  # (P,)
        return {
            ppo_metrics.OBJECTIVE_GROUP_SCORES_STD: self.global_mean(grouped.std(dim=1, correction=1).mean()),
            ppo_metrics.OBJECTIVE_GROUPS_TIED: self.global_mean(tied.mean()),
        }

    def score_term_means(self, scores: Scores) -> dict[str, float]:
        """objective/<term> for each part of the scores (`Scores.terms`: objective/reward_fn,
        objective/rm_score, objective/scores_member_<k>, objective/scores_disagreement): their means over
        every process, all in one all-reduce; nothing when the scores have no parts."""
        terms = scores.terms()
        if not terms:
            return {}
        means = torch.stack([v.float().mean() for v in terms.values()])  # (n,) this process's
        means = self.accelerator.reduce(means.to(self.device), reduction="mean")  # (n,) every process's
        return {ppo_metrics.objective(name): float(v) for name, v in zip(terms, means)}

    # --- distributed helpers ------------------------------------------------------------------

    def global_std(self, x: torch.Tensor) -> float:
        return float(self.accelerator.gather_for_metrics(x.float()).std())

    @property
    def reduce_sum(self):
        """Sum over every process for the batch statistics of `ppo_math` (None with one process)."""
        return self.global_sum if self.accelerator.num_processes > 1 else None

    def whiten(self, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        """masked_whiten with statistics over every process's batch (the same as whitening the global batch)."""
        return ppo_math.masked_whiten(x, mask, shift_mean=shift_mean, reduce_sum=self.reduce_sum)

    def check_finite(self, phase: str, **tensors: torch.Tensor) -> None:
        """Stop with a one-line error naming the step, the phase and the tensors when any entry is NaN or
        inf on any process (the counts are summed over processes, so every process raises together)."""
        counts = torch.stack([(~torch.isfinite(t.float())).sum() for t in tensors.values()])  # (n,)
        counts = self.global_sum(counts)
        if counts.sum() > 0:
            bad = [f"{name} ({int(c)} entries)" for name, c in zip(tensors, counts) if c > 0]
            raise NonFiniteError(
                f"PPO step {self.step + 1}, {phase} phase: non-finite {', '.join(bad)}; nothing was updated"
            )

    # --- the models ---------------------------------------------------------------------------

    @property
    def unwrapped_policy(self):
        return self.accelerator.unwrap_model(self.policy)

    def trainable_parameters(self):
        return trainable_parameters(self.policy, self.critic)

    def models_of_step(self) -> list:
        """Every model a PPO step runs under its autocast: the policy, the critic, the reference, the reward
        model and a teacher that runs as the reference does."""
        return [self.policy, self.critic, *self.frozen_models]

    def reference_context(self):
        """With LoRA the reference is the policy's network with the adapter switched off."""
        if self.cfg.use_lora:
            return self.unwrapped_policy.lm.disable_adapter()
        return nullcontext()
