"""The keys of `llm-rlhf ppo` (`Config`, also `llm_rlhf.PPOConfig`), their checks, and the batch-size
arithmetic of a PPO step (`batch_sizes`).

PPO trains a policy against a frozen reward model (or a reward function, or both), with a frozen reference
for the KL penalty, in steps of: rollout -> reference log-probs -> scores -> per-token rewards -> advantages
-> K epochs of clipped updates on minibatches -> KL controller update (`llm_rlhf.ppo.trainer`). The
`advantage_estimator` is a row of `llm_rlhf.rl.estimators`: GAE over a value function, or a critic-free
estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax) on the same rollout, KL and update; a key the chosen
estimator does not read, set to another value than its default, is an error naming the key. The keys of the
policy-loss family (policy_loss, the clip ranges, dual_clip, loss_aggregation, sampler_correction,
overlong shaping, mask_truncated, dynamic_sampling) are checked against the same row and the `policy_loss`'s
row of `llm_rlhf.rl.policy_losses` (`check_policy_loss_keys`).
Run it with `llm-rlhf ppo --config recipes/reviews/ppo.yaml [--key value ...]`, also under
`accelerate launch` with several processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llm_rlhf.core.callables import split_callable_spec
from llm_rlhf.core.config import REPORT_TO, checked_keywords, help_field, is_off, require
from llm_rlhf.core.data import DATA_FORMATS
from llm_rlhf.core.utils import resolve_bf16
from llm_rlhf.evaluation import hacking
from llm_rlhf.evaluation.sampling_keys import SamplingRunKeys, check_pass_at_k, fill_from_task
from llm_rlhf.models.scoring import check_score_keys
from llm_rlhf.rl.episodes import check_episode_keys
from llm_rlhf.rl.estimators import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_ESTIMATOR,
    ESTIMATORS,
    ROWS,
    Estimator,
    help_text,
    names,
)
from llm_rlhf.rl.loss_math import LOSS_AGGREGATIONS, SAMPLER_CORRECTIONS
from llm_rlhf.rl.policy_losses import CLIP_KEYS, DEFAULT_LOSS, LOSSES, POLICY_LOSSES, PolicyLoss
from llm_rlhf.rl.policy_losses import ROWS as LOSS_ROWS
from llm_rlhf.rl.policy_losses import help_text as loss_help_text
from llm_rlhf.rl.rollout import check_generation_controls
from llm_rlhf.tasks.environments import check_environment


def clip_default_text(side: int) -> str:
    """What a null cliprange_low (side 0) or cliprange_high (side 1) resolves to for each policy loss, from
    the rows: "cliprange for ppo_clip, 3e-4 for gspo; not read by cispo and sapo"."""
    key = CLIP_KEYS[side]
    readers = [r for r in LOSS_ROWS if key in r.clip_keys]
    values = {}  # the resolved default -> the losses with it, in table order
    for row in readers:
        default = row.clip_defaults[side]
        values.setdefault("cliprange" if default is None else f"{default:g}", []).append(row)
    text = ", ".join(f"{value} for {names(rows)}" for value, rows in values.items())
    others = [r for r in LOSS_ROWS if key not in r.clip_keys]
    return text + (f"; not read by {names(others)}" if others else "")


@checked_keywords
@dataclass
class Config(SamplingRunKeys):
    """`llm-rlhf ppo`'s keys: the ones it shares with evaluation (`evaluation.sampling_keys`: scoring, prompts,
    sampling, episodes) and PPO's own below."""

    # --- models and data
    model_name_or_path: str = help_field(
        "runs/reviews/sft", "The SFT model (HF folder or hub name): initial policy and frozen reference."
    )
    prompt_file: str = help_field(
        "data/reviews/ppo_prompts.jsonl",
        "Prompts to sample responses for (JSONL/CSV/Parquet or a hub dataset).",
    )
    output_dir: str = help_field("runs/reviews/ppo", "Where the policy, value head, logs and checkpoints go.")
    bf16: bool | str = help_field(
        False,
        "bf16 autocast for the forward passes: true, false, or auto (on where the hardware computes bf16 "
        "natively: a CPU with AMX or AVX512-BF16; float32 on a GPU and elsewhere; logged).",
    )
    gradient_checkpointing: bool = help_field(
        False, "Recompute activations in the backward pass to save memory."
    )
    value_model: str = help_field(
        "policy",
        f"Critic of advantage_estimator {names(r for r in ROWS if r.critic)}: 'policy' (value head on the policy "
        "trunk) or 'reward' (separate critic initialised from the reward model). The critic-free estimators "
        "build neither.",
    )
    advantage_estimator: str = help_field(
        DEFAULT_ESTIMATOR,
        f"How the advantages are made (`llm_rlhf.rl.estimators`; docs/guides/estimators.md): {help_text()}. "
        "The critic-free ones train no value head and no critic.",
    )
    samples_per_prompt: int = help_field(
        1,
        "k: responses sampled for each prompt of a rollout, in consecutive rows (a rollout holds "
        "rollout_batch_size * k episodes per process; a prompt's k samples, its group, stay on one process). "
        f"{names(r for r in ROWS if r.min_samples_per_prompt >= 2)} need k >= 2.",
    )
    pass_k: int = help_field(
        1,
        "The k of the pass@k that advantage_estimator pass_at_k trains for, 1 <= pass_k < samples_per_prompt "
        "(each sample's weight in the unbiased pass@k gradient, through GRPO's group normalisation: "
        "`estimators.pass_at_k_shares`); 1 is grpo with its eps n times larger.",
    )
    kl_in_loss: bool | None = help_field(
        None,
        "Where the KL to the reference is penalised: true = in the loss, kl_coef * k3 per token (GRPO's form; "
        "the rewards are the scores alone); false = in the reward, -kl_coef * KL_t per token with kl_estimator "
        "(Ziegler et al.); null = each estimator's published form: in the loss for "
        f"{names(r for r in ROWS if r.kl_in_loss)}, in the reward otherwise. Either way kl_coef is the KL "
        "controller's beta and the controller follows the observed KL (objective/kl, kl_estimator).",
    )
    seed: int = help_field(0, "Random seed (each process adds its index).")
    # --- budget and batch sizes (per process)
    steps: int = help_field(40, "Number of PPO steps (rollout batches).")
    rollout_batch_size: int = help_field(
        64, "Prompts per rollout batch, per process (each sampled samples_per_prompt times)."
    )
    mini_batch_size: int = help_field(
        16,
        "Episodes (responses) per optimiser step, per process: divides rollout_batch_size * samples_per_prompt.",
    )
    gradient_accumulation_steps: int = help_field(
        1, "Micro-batches per minibatch (micro = mini_batch_size / this)."
    )
    ppo_epochs: int = help_field(4, "K: passes over each rollout batch.")
    # --- optimiser
    learning_rate: float = help_field(1e-5, "AdamW learning rate (policy and value head).")
    weight_decay: float = help_field(0.0, "AdamW weight decay.")
    adam_eps: float = help_field(1e-5, "AdamW epsilon.")
    lr_scheduler_type: str = help_field(
        "constant", "'constant' or 'linear' decay to 0 over all optimiser steps."
    )
    max_grad_norm: float = help_field(1.0, "Gradient clipping norm.")
    # --- generation
    # --- rewards and KL
    kl_estimator: str = help_field("k1", "Per-token KL estimator in the reward: k1 | k3 | abs | mse.")
    kl_controller: str = help_field("adaptive", "'adaptive' (Ziegler et al. 2019) or 'fixed'.")
    init_kl_coef: float = help_field(
        0.1,
        "Initial beta (>= 0; 0 = no KL penalty, with kl_controller 'fixed': the adaptive one would stay at 0).",
    )
    kl_target: float = help_field(6.0, "Adaptive controller: target per-sequence KL (nats).")
    kl_horizon: int = help_field(10000, "Adaptive controller: horizon in episodes.")
    eos_penalty: float | None = help_field(
        None,
        "EOS trick: score for responses that never emitted EOS nor a stop string (null = off; off by default:"
        " such a response is scored as its text ending in the RM's EOS, docs/guides/generation.md).",
    )
    score_clip: float | None = help_field(None, "Clip RM scores to [-x, x] (null = off).")
    whiten_rewards: bool = help_field(
        False, "Whiten the per-token rewards over the batch before GAE (advantage_estimator gae only)."
    )
    # --- on-policy distillation (`llm_rlhf.rl.ppo_math.distill_kl`)
    teacher_model_path: str | None = help_field(
        None,
        "On-policy distillation: a causal LM (HF folder or hub name) with the policy's vocabulary that scores "
        "every sampled token. Each response token's reward gains -distill_coef * (log pi_theta(y_t|s_t) - "
        "log pi_teacher(y_t|s_t)), the reverse KL's one-sample estimate, beside the scores (a reward model, a "
        "reward_fn or neither) and the KL to the reference; every estimator and policy loss applies (or a "
        "loss term instead: distill_loss). Logged as objective/distill_kl, time/teacher and "
        "time/teacher_share. null = off.",
    )
    distill_coef: float = help_field(
        1.0,
        "With teacher_model_path: the weight of the distillation signal (> 0): of the per-token reverse KL in the "
        "reward, or of the distill_loss term in the loss.",
    )
    distill_loss: str = help_field(
        "reverse_kl",
        "With teacher_model_path: 'reverse_kl' (the per-token reward above, on the sampled tokens), or a loss "
        "term over the teacher's distill_top_k tokens at each sampled prefix, distill_coef * its token mean: "
        "'forward_kl' (KL(teacher || policy)) or 'jsd' (the generalised JSD of distill_jsd_beta, TRL's "
        "DistillationTrainer's; `ppo_math.topk_divergence`). Logged as loss/distill.",
    )
    distill_top_k: int = help_field(
        32,
        "With distill_loss forward_kl or jsd: the teacher's top-k tokens per position the divergence sums over "
        "(>= 1; the vocabulary's size: the exact divergence).",
    )
    distill_jsd_beta: float = help_field(
        0.5,
        "With distill_loss jsd: its beta, 0 < beta < 1 (the mixture (1 - beta) p_policy + beta p_teacher).",
    )
    teacher_dtype: str | None = help_field(
        None,
        "With teacher_model_path: the teacher's weights dtype (float32 | bfloat16 | float16), its forward then "
        "outside the policy's autocast; null = the run's dtype, under the run's autocast, as the reference.",
    )
    teacher_device: str | None = help_field(
        None,
        "With teacher_model_path: the device the teacher runs on (e.g. 'cpu', 'cuda:1'); null = the process's.",
    )
    # --- PPO
    gamma: float = help_field(
        1.0, "Discount (gae only: the critic-free estimators sum the rewards undiscounted)."
    )
    lam: float = help_field(0.95, "GAE lambda (gae only).")
    cliprange: float = help_field(0.2, "Policy ratio clip epsilon.")
    # --- the policy-loss family of 2025-26 (`llm_rlhf.rl.policy_losses`, `llm_rlhf.rl.loss_math`)
    policy_loss: str = help_field(
        DEFAULT_LOSS,
        "The token loss of the clipped update (`llm_rlhf.rl.policy_losses`): "
        f"{loss_help_text(names(r for r in ROWS if r.response_advantages))}. A loss with one ratio per response "
        "needs one advantage per response, which the estimators of per-token advantages do not give.",
    )
    cliprange_low: float | None = help_field(
        None,
        "eps_low, the clip below 1 (clip-higher, DAPO: a separate cliprange_high). null = "
        f"{clip_default_text(0)}. Every estimator.",
    )
    cliprange_high: float | None = help_field(
        None,
        "eps_high, the clip above 1 (DAPO's clip-higher: 0.28 with cliprange_low 0.2; cispo's truncation of "
        f"its weight). null = {clip_default_text(1)}. Every estimator.",
    )
    dual_clip: float | None = help_field(
        None,
        "c > 1: the loss of a token with a negative advantage is at most -c * A (Ye et al. 2020), a bound at "
        f"large ratios; policy_loss {names(r for r in LOSS_ROWS if 'dual_clip' in r.clip_keys)} only, every "
        "estimator. null = off.",
    )
    loss_aggregation: str | None = help_field(
        None,
        "How a minibatch's token losses make its policy loss: 'token_mean' (over its response tokens; PPO, "
        "DAPO), 'seq_mean_token_mean' (the mean over responses of each one's token mean; GRPO's original, "
        "GSPO's objective) or 'token_sum_norm' (the token sum over the constant minibatch responses x "
        "max_new_tokens, an episode's max_episode_tokens; Dr. GRPO). null = the policy loss's own (its paper's: "
        f"{', '.join(f'{r.aggregation} for {r.name}' for r in LOSS_ROWS)}); another one than its papers' is "
        "used with a note at the start. Over the global minibatch: the same with gradient accumulation and any "
        "number of processes. Every estimator.",
    )
    sampler_correction: str = help_field(
        "none",
        "Per-token importance weight on the policy loss from the sampler's recorded log-probs q to the old "
        "policy's, for a sampler that is not the trainer (sampling_dtype bfloat16): 'tis' (truncated, "
        "min(pi_old / q, cap)), 'mis' (masked: 0 outside [1/cap, cap]) or 'none'. Logged as "
        f"sampler/mean_weight and sampler/corrected_frac. "
        f"{names(r for r in ROWS if r.corrections)}.",
    )
    sampler_correction_cap: float = help_field(2.0, "C of sampler_correction (>= 1).")
    overlong_buffer: int = help_field(
        0,
        "DAPO's overlong shaping: a penalty added to the score of a response longer than max_new_tokens - "
        "this many tokens, growing linearly to -overlong_penalty at max_new_tokens, -overlong_penalty for a "
        "truncated one (in [0, max_new_tokens]; 0 = off). An episode counts all its tokens against "
        "max_episode_tokens instead. Applied after score_clip; eos_penalty, when set, "
        "still replaces the whole score of a truncated response. Logged as objective/overlong_penalty. "
        "Every estimator.",
    )
    overlong_penalty: float = help_field(
        1.0, "The largest overlong shaping penalty (>= 0; see overlong_buffer)."
    )
    mask_truncated: bool = help_field(
        False,
        "Leave the responses truncated at max_new_tokens (no EOS nor stop string) out of the update's losses "
        "(policy, value, KL, entropy) and their normalisers: DAPO's overlong filtering. Every estimator.",
    )
    dynamic_sampling: bool = help_field(
        False,
        "DAPO's dynamic sampling: drop the groups that tie (their advantages are 0 under a group baseline) and "
        "sample further prompts until each process holds rollout_batch_size untied groups, at most "
        "dynamic_sampling_max_rounds rounds (then filled with tied groups); logged as sampling/*. A group ties "
        "when its samples_per_prompt verdicts tie where accuracy_fn is set (the task's verifier), else its scores "
        "as the scorer gave them (before score_clip, overlong_buffer's penalty and eos_penalty: a length penalty "
        "alone does not untie correct answers). objective/kl and the adaptive KL controller read every sampled "
        "group's KL (the dropped rows get forwards for it). "
        f"{names(r for r in ROWS if r.dynamic_sampling)} only, with samples_per_prompt >= 2.",
    )
    dynamic_sampling_max_rounds: int = help_field(
        3, "With dynamic_sampling: the most sampling rounds of one PPO step (>= 1)."
    )
    cliprange_value: float = help_field(0.2, "Value clip epsilon (gae only).")
    vf_coef: float = help_field(0.1, "c1: value loss coefficient (gae only).")
    ent_coef: float = help_field(0.0, "c2: entropy bonus coefficient.")
    target_approxkl: float | None = help_field(
        None, "Stop the epochs early when approx-KL of a minibatch exceeds this (null = off)."
    )
    ratio_guard: float = help_field(
        10.0, "Skip a minibatch whose mean ratio exceeds this (a diverged update)."
    )
    # --- LoRA
    use_lora: bool = help_field(
        False, "Train a LoRA adapter; the reference is the same network with the adapter disabled."
    )
    lora_r: int = help_field(16, "LoRA rank.")
    lora_alpha: int = help_field(32, "LoRA alpha.")
    lora_dropout: float = help_field(0.0, "LoRA dropout (0 keeps ratio == 1 at the first step).")
    lora_target_modules: list[str] | None = help_field(
        None, "Modules to adapt (null = peft's default for the architecture)."
    )
    lora_layers: int | None = help_field(
        None,
        "Adapters only in the last N transformer blocks (peft's layers_to_transform): the update's backward "
        "pass stops below them; null = every block.",
    )
    reuse_frozen_blocks: bool = help_field(
        True,
        "With lora_layers: run the blocks below the adapters once per rollout and reuse their output in the "
        "old policy's, the reference's and every epoch's forward, which then run the adapted blocks only (the "
        "same outputs; not under FSDP2 or DeepSpeed, whose hooks gather the parameters block by block).",
    )
    merge_lora: bool = help_field(
        True, "With LoRA: save the merged policy as a plain HF folder (the adapter is kept in adapter/)."
    )
    # --- held-out evaluation during training (the over-optimisation curve)
    eval_prompt_file: str | None = help_field(
        "data/reviews/eval_prompts.jsonl", "Held-out prompts evaluated every eval_every steps (null = off)."
    )
    eval_every: int = help_field(
        10, "Evaluate on held-out prompts every N steps, and before the first (0 = off)."
    )
    eval_num_prompts: int = help_field(64, "How many held-out prompts each evaluation samples.")
    eval_samples_per_prompt: int = help_field(
        1,
        "Responses sampled for each held-out prompt at each evaluation (consecutive; the standard errors count "
        "each prompt once); the greedy response stays one per prompt.",
    )
    eval_pass_at_k: list[int] = help_field(
        [],
        "With accuracy_fn: the k of each pass@k each held-out evaluation reports from its "
        "eval_samples_per_prompt = n samples of a prompt (Chen et al. 2021's unbiased 1 - C(n - c, k) / C(n, "
        "k), k <= n), with its standard error over the prompts: eval_log.jsonl's pass_at_<k>, "
        "pass_at_<k>_stderr. [] = none.",
    )
    eval_batch_size: int | None = help_field(
        None,
        "Held-out prompts sampled together (null = rollout_batch_size). Batch b is drawn after seeding with "
        "seed + b, so the batch size fixes the evaluation's random draws, and its logits its peak memory: set it "
        "to evaluate runs of different rollout shapes with the same draws.",
    )
    # --- logging and checkpoints
    log_samples_every: int = help_field(10, "Log a few sampled responses every N steps.")
    num_log_samples: int = help_field(3, "How many samples to log.")
    save_steps: int = help_field(20, "Checkpoint every N steps (0 = only at the end).")
    resume: bool = help_field(False, "Continue from the last checkpoint in output_dir.")
    report_to: str = help_field(
        "none",
        "Also log to: none | tensorboard | wandb | trackio (local-first: project llm_rlhf, the run named by "
        "output_dir, under $TRACKIO_DIR or ~/.cache/huggingface/trackio; `trackio show` opens it).",
    )
    # --- the reward-hacking alarm (`llm_rlhf.evaluation.hacking`), read at every held-out evaluation
    stop_on_alarm: bool = help_field(
        False,
        "Stop the run at the held-out evaluation where the reward-hacking alarm fires (eval_every > 0; logged "
        "either way in eval_log.jsonl: alarm_step, alarm_rules, alarm_reasons). It fires at the first "
        f"evaluation where (a) the gold (the verifier's accuracy with accuracy_fn) has fallen by >= {hacking.Z:g} "
        "standard errors of the difference against the evaluation of the best gold so far and the proxy (the "
        f"score PPO maximises) risen by >= {hacking.Z_PROXY:g}, at {hacking.K_EVALS} evaluations in a row; or (b) "
        "a counter of the responses (duplicate_rate, top_bigram_share, shared_bigram_rate, word_distinct_2, "
        "top_response_share, echo_rate, char_run_rate, repeated_ngram_rate, empty_rate) differs from the step-0 "
        "evaluation's (the model PPO started from) by Fisher's exact test of two proportions at p <= "
        f"{hacking.COUNTER_ALPHA:.2g}: a threshold that scales with the number of held-out responses and the "
        f"rate, with at most {hacking.ALPHA:g} false alarms per run of up to {hacking.MAX_EVALS} evaluations "
        "(`llm_rlhf.evaluation.hacking`; recipes/reviews/README.md has the simulated rates). The run then saves and "
        "returns its policy of that step (with keep_best: the best evaluation's).",
    )
    keep_best: bool = help_field(
        False,
        "Return the policy of the held-out evaluation with the best gold (gold_judge's mean; the verifier's "
        "accuracy with accuracy_fn) instead of the last step's: each new best is checkpointed in "
        "output_dir/best, and at the end its weights are the run's output (output_dir, and the model train_ppo "
        "returns; metrics.json's best_step and returned_step say which), the last step's policy going to "
        "output_dir/last. Needs eval_every > 0 and a gold_judge or an accuracy_fn.",
    )

    def __post_init__(self):
        self.bf16, self.precision = resolve_bf16(self.bf16)
        require(self.lora_layers is None or self.lora_layers >= 1, "lora_layers", "must be >= 1 (or null)")
        fill_from_task(self, "ppo")
        require(self.data_format in DATA_FORMATS, "data_format", f"must be one of {', '.join(DATA_FORMATS)}")
        check_reward_keys(self)
        if self.accuracy_fn is not None:  # its form only: imported when the stage starts
            split_callable_spec(self.accuracy_fn, "accuracy_fn")
        require(self.steps > 0, "steps", "must be > 0")
        require(self.eval_samples_per_prompt >= 1, "eval_samples_per_prompt", "must be >= 1")
        check_pass_at_k(
            self.eval_pass_at_k,
            self.eval_samples_per_prompt,
            self.accuracy_fn,
            key="eval_pass_at_k",
            n_key="eval_samples_per_prompt",
        )
        require(
            self.eval_batch_size is None or self.eval_batch_size > 0, "eval_batch_size", "must be > 0 or null"
        )
        episodes = self.rollout_batch_size * self.samples_per_prompt
        require(
            self.mini_batch_size > 0 and episodes % self.mini_batch_size == 0,
            "mini_batch_size",
            f"must divide rollout_batch_size ({self.rollout_batch_size})"
            if self.samples_per_prompt == 1
            else f"must divide the episodes of a rollout, rollout_batch_size * samples_per_prompt ({episodes})",
        )
        require(
            self.gradient_accumulation_steps > 0
            and self.mini_batch_size % self.gradient_accumulation_steps == 0,
            "gradient_accumulation_steps",
            f"must divide mini_batch_size ({self.mini_batch_size})",
        )
        require(self.kl_estimator in ("k1", "k3", "abs", "mse"), "kl_estimator", "must be k1, k3, abs or mse")
        require(self.kl_controller in ("adaptive", "fixed"), "kl_controller", "must be 'adaptive' or 'fixed'")
        require(self.value_model in ("policy", "reward"), "value_model", "must be 'policy' or 'reward'")
        require(
            self.lr_scheduler_type in ("constant", "linear"),
            "lr_scheduler_type",
            "must be 'constant' or 'linear'",
        )
        require(
            self.report_to in REPORT_TO,
            "report_to",
            f"must be one of {', '.join(REPORT_TO)}",
        )
        require(self.temperature > 0, "temperature", "must be > 0")
        sampled_as_scored = (
            "PPO samples from the distribution its log-probs describe: the full softmax at temperature"
        )
        require(self.top_k == 0, "top_k", f"must be 0 (off); {sampled_as_scored}")
        require(self.top_p == 1.0, "top_p", f"must be 1.0 (off); {sampled_as_scored}")
        require(
            self.kl_target > 0 and self.kl_horizon > 0, "kl_target", "kl_target and kl_horizon must be > 0"
        )
        require(self.init_kl_coef >= 0, "init_kl_coef", "must be >= 0 (a negative beta rewards moving away)")
        require(
            self.init_kl_coef > 0 or self.kl_controller != "adaptive",
            "init_kl_coef",
            "is 0 with kl_controller 'adaptive', which multiplies beta at each step and so keeps it at 0: "
            "for no KL penalty use kl_controller 'fixed'",
        )
        require(0 < self.cliprange and 0 < self.cliprange_value, "cliprange", "clip ranges must be > 0")
        require(self.max_new_tokens > 0, "max_new_tokens", "must be > 0")
        check_generation_controls(self)
        check_estimator_keys(self)
        check_policy_loss_keys(self)
        check_watch_keys(self)
        check_episode_keys(self)
        check_distill_keys(self)
        if self.environment is not None:  # resolved and checked now, before any stage runs; never built here
            check_environment(self.environment, has_verifier=self.accuracy_fn is not None)
        require(
            not (self.environment is not None and self.dynamic_sampling),
            "dynamic_sampling",
            "is not yet built for episodes (environment): its ties would need the environment's rewards",
        )

    @property
    def response_width(self) -> int:
        """R, the tokens a response may hold: max_new_tokens, or with an environment max_episode_tokens (an
        episode's policy and environment tokens together): the L_max of the overlong penalty and the L of
        token_sum_norm's constant B * L, so both count an episode against its own budget."""
        return self.max_episode_tokens if self.environment is not None else self.max_new_tokens

    @property
    def heldout_batch_size(self) -> int:
        """Prompts per batch of the held-out evaluation: eval_batch_size, null = rollout_batch_size."""
        return self.eval_batch_size or self.rollout_batch_size

    @property
    def estimator(self) -> Estimator:
        """The row of `advantage_estimator` (`llm_rlhf.rl.estimators`): what the trainer reads of it."""
        return ESTIMATORS[self.advantage_estimator]

    @property
    def policy_loss_row(self) -> PolicyLoss:
        """The row of `policy_loss` (`llm_rlhf.rl.policy_losses`): what the trainer reads of it."""
        return LOSSES[self.policy_loss]

    @property
    def clip_low(self) -> float:
        """eps_low of the policy loss, cliprange_low resolved: null = the row's `clip_defaults` (cliprange for
        ppo_clip, so a config without the key clips as before; GSPO's 3e-4 for gspo); a loss whose
        `clip_keys` lack it does not read it."""
        if self.cliprange_low is not None:
            return self.cliprange_low
        default = self.policy_loss_row.clip_defaults[0]
        return self.cliprange if default is None else default

    @property
    def clip_high(self) -> float:
        """eps_high of the policy loss, cliprange_high resolved: null = the row's `clip_defaults` (cliprange
        for ppo_clip and cispo, GSPO's 4e-4 for gspo)."""
        if self.cliprange_high is not None:
            return self.cliprange_high
        default = self.policy_loss_row.clip_defaults[1]
        return self.cliprange if default is None else default

    @property
    def aggregation(self) -> str:
        """loss_aggregation resolved: null = the policy loss's own, its paper's (`PolicyLoss.aggregation`:
        token_mean for ppo_clip, seq_mean_token_mean for gspo). Not written back into the config."""
        return self.policy_loss_row.aggregation if self.loss_aggregation is None else self.loss_aggregation

    @property
    def notes(self) -> tuple[str, ...]:
        """What the run prints as `note:` lines at its start: a choice that is allowed but departs from the
        papers (an explicit loss_aggregation that is not one of the policy loss's `aggregations`)."""
        row = self.policy_loss_row
        if self.aggregation in row.aggregations:
            return ()
        return (
            f"loss_aggregation {self.aggregation} is not the form of policy_loss {row.name}'s paper "
            f"({' or '.join(row.aggregations)}, its default when loss_aggregation is null)",
        )

    @property
    def plain_policy_loss(self) -> bool:
        """Every key of the policy-loss family at a value that changes nothing: the update is today's
        `ppo_math.policy_loss` with its arithmetic (the defaults stay bit-identical to runs before the keys;
        `llm_rlhf.rl.policy_losses` says why the trainer keeps this path beside the family's)."""
        return (
            self.policy_loss_row.plain
            and self.cliprange_low in (None, self.cliprange)
            and self.cliprange_high in (None, self.cliprange)
            and self.dual_clip is None
            and self.aggregation == "token_mean"
            and self.sampler_correction == "none"
            and not self.mask_truncated
        )

    @property
    def distill_top_k_in_loss(self) -> int:
        """k of on-policy distillation's loss term (distill_loss forward_kl or jsd: the teacher's top k tokens
        at each position, kept in the rollout), 0 where there is none (no teacher, or the reverse KL in the
        reward)."""
        if self.teacher_model_path is None or self.distill_loss == "reverse_kl":
            return 0
        return self.distill_top_k

    @property
    def kl_penalty_in_loss(self) -> bool:
        """Where the KL goes, kl_in_loss resolved: null = the estimator's published form (`Estimator.kl_in_loss`:
        in the loss for GRPO, Shao et al. 2024, eq. 3, and Dr. GRPO; in the reward for the others, as Ziegler
        et al. 2019, RLOO, REINFORCE++ and ReMax put it). Not written back into the config: the saved config
        says what was given."""
        if self.kl_in_loss is None:
            return self.estimator.kl_in_loss
        return self.kl_in_loss


def check_estimator_keys(cfg) -> None:
    """advantage_estimator, samples_per_prompt and the keys the estimator does not read: each a ConfigError
    naming its key. A key of `Estimator.ignored_keys` (gamma, lam, vf_coef, ... with a critic-free
    estimator) is an error when it differs from its default: a recipe or a flag set it, and the run would
    silently not use it. The default itself is accepted, so a recipe that spells out every key (and a run's
    saved config.yaml) still loads with any estimator."""
    require(
        cfg.advantage_estimator in ESTIMATORS,
        "advantage_estimator",
        f"must be one of {', '.join(ADVANTAGE_ESTIMATORS)}",
    )
    row = cfg.estimator
    require(cfg.samples_per_prompt >= 1, "samples_per_prompt", "must be >= 1")
    require(
        cfg.samples_per_prompt >= row.min_samples_per_prompt,
        "samples_per_prompt",
        f"must be >= {row.min_samples_per_prompt} for advantage_estimator {row.name} (a group of one response "
        "has no baseline)",
    )
    if "pass_k" not in row.ignored_keys:
        require(
            1 <= cfg.pass_k < cfg.samples_per_prompt,
            "pass_k",
            f"{cfg.pass_k} must be >= 1 and < samples_per_prompt ({cfg.samples_per_prompt}): pass@k's "
            "gradient from a group of n samples needs k < n (at k = n every sample of the group gets the same "
            "weight, the group's best score, and the group's mean cancels it)",
        )
    defaults = {f.name: f for f in dataclasses.fields(cfg)}
    for key in row.ignored_keys:
        default = defaults[key].default  # every key an estimator may ignore is a scalar
        value = getattr(cfg, key)
        users = names(r for r in ROWS if key not in r.ignored_keys)
        require(
            value == default,
            key,
            f"{value!r} is not used by advantage_estimator {row.name} (only by {users}): remove it or leave it "
            f"at its default {default!r}",
        )


def check_policy_loss_keys(cfg) -> None:
    """The keys of the policy-loss family, each a ConfigError naming its key; what they may be is
    read in two rows: the estimator's (`response_advantages`, `corrections`, `dynamic_sampling`; the rows with
    dynamic sampling have a group baseline and need samples_per_prompt >= 2: `check_estimator_keys` says so
    first) and the policy loss's (`clip_keys`, `response_advantages`, `sampler_correction`)."""
    row = cfg.estimator
    require(cfg.policy_loss in LOSSES, "policy_loss", f"must be one of {', '.join(POLICY_LOSSES)}")
    loss = cfg.policy_loss_row
    require(
        row.response_advantages or not loss.response_advantages,
        "policy_loss",
        f"'{loss.name}' is not for advantage_estimator {row.name} ({loss.name} clips one ratio per response and "
        f"needs one advantage per response: {names(r for r in ROWS if r.response_advantages)} give one)",
    )
    for key in ("cliprange_low", "cliprange_high"):
        value = getattr(cfg, key)
        require(value is None or value > 0, key, "must be > 0 or null")
    require(cfg.dual_clip is None or cfg.dual_clip > 1, "dual_clip", "must be > 1 or null (c bounds -c * A)")
    for key in CLIP_KEYS:
        require(
            getattr(cfg, key) is None or key in loss.clip_keys,
            key,
            f"is not read by policy_loss {loss.name} (only by {names(r for r in LOSS_ROWS if key in r.clip_keys)}):"
            " leave it null",
        )
    require(
        cfg.loss_aggregation is None or cfg.loss_aggregation in LOSS_AGGREGATIONS,
        "loss_aggregation",
        f"must be one of {', '.join(LOSS_AGGREGATIONS)} or null (the policy loss's own)",
    )
    require(
        cfg.sampler_correction == "none" or cfg.sampler_correction in SAMPLER_CORRECTIONS,
        "sampler_correction",
        f"must be none, {' or '.join(SAMPLER_CORRECTIONS)}",
    )
    require(
        cfg.sampler_correction == "none" or cfg.sampler_correction in row.corrections,
        "sampler_correction",
        f"'{cfg.sampler_correction}' is not for advantage_estimator {row.name}",
    )
    require(
        cfg.sampler_correction == "none" or loss.sampler_correction,
        "sampler_correction",
        f"'{cfg.sampler_correction}' is not for policy_loss {loss.name}",
    )
    require(
        cfg.sampler_correction_cap >= 1,
        "sampler_correction_cap",
        f"must be >= 1 (got {cfg.sampler_correction_cap}): weights are truncated at C and kept in [1/C, C]",
    )
    width = "max_episode_tokens" if cfg.environment is not None else "max_new_tokens"
    require(
        0 <= cfg.overlong_buffer <= cfg.response_width,
        "overlong_buffer",
        f"must be in [0, {width} = {cfg.response_width}] (got {cfg.overlong_buffer})",
    )
    require(cfg.overlong_penalty >= 0, "overlong_penalty", "must be >= 0")
    require(cfg.dynamic_sampling_max_rounds >= 1, "dynamic_sampling_max_rounds", "must be >= 1")
    if cfg.dynamic_sampling:
        require(
            row.dynamic_sampling,
            "dynamic_sampling",
            f"drops the groups whose scores tie, which carry no signal only under a group baseline: not for "
            f"advantage_estimator {row.name} (only {names(r for r in ROWS if r.dynamic_sampling)})",
        )


def check_watch_keys(cfg) -> None:
    """stop_on_alarm and keep_best read the held-out evaluations: each needs them on (eval_every > 0 and an
    eval_prompt_file), and keep_best something to rank them by (a gold_judge or an accuracy_fn)."""
    heldout = cfg.eval_every > 0 and not is_off(cfg.eval_prompt_file)
    for key in ("stop_on_alarm", "keep_best"):
        require(
            not getattr(cfg, key) or heldout,
            key,
            "reads the held-out evaluations: set eval_every > 0 and an eval_prompt_file",
        )
    require(
        not cfg.keep_best or not is_off(cfg.gold_judge) or cfg.accuracy_fn is not None,
        "keep_best",
        "ranks the held-out evaluations by the gold or the verifier's accuracy: set gold_judge or accuracy_fn",
    )


DISTILL_LOSSES = ("reverse_kl", "forward_kl", "jsd")
DISTILL_KEYS = (
    "distill_coef",
    "distill_loss",
    "distill_top_k",
    "distill_jsd_beta",
    "teacher_dtype",
    "teacher_device",
)


def check_distill_keys(cfg) -> None:
    """The distillation keys are read only with a teacher (distill_top_k with a loss term, distill_jsd_beta with
    jsd); the coefficient is positive, the loss one of three, the dtype one of three."""
    teacher = not is_off(cfg.teacher_model_path)
    if not teacher:
        cfg.teacher_model_path = None
    default = {key: Config.__dataclass_fields__[key].default for key in DISTILL_KEYS}
    for key in DISTILL_KEYS:
        require(
            teacher or getattr(cfg, key) == default[key],
            key,
            "is read only with teacher_model_path (on-policy distillation), which is not set",
        )
    require(cfg.distill_coef > 0, "distill_coef", "must be > 0")
    require(cfg.distill_loss in DISTILL_LOSSES, "distill_loss", f"must be one of {', '.join(DISTILL_LOSSES)}")
    require(cfg.distill_top_k >= 1, "distill_top_k", "must be >= 1")
    require(0 < cfg.distill_jsd_beta < 1, "distill_jsd_beta", "must be strictly between 0 and 1")
    for key, losses in (("distill_top_k", ("forward_kl", "jsd")), ("distill_jsd_beta", ("jsd",))):
        require(
            cfg.distill_loss in losses or getattr(cfg, key) == default[key],
            key,
            f"is read only with distill_loss {' or '.join(losses)}",
        )
    require(
        cfg.teacher_dtype in (None, "float32", "bfloat16", "float16"),
        "teacher_dtype",
        "must be float32, bfloat16, float16 or null (the run's dtype)",
    )


def check_reward_keys(cfg) -> None:
    """The score needs a reward model, a reward function or an environment that rewards (`scoring.check_score_keys`
    checks their keys); the RM-initialised critic needs the RM."""
    require(
        not is_off(cfg.reward_model_path)
        or cfg.reward_fn is not None
        or cfg.environment is not None
        or not is_off(cfg.teacher_model_path),
        "reward_model_path",
        "is none and neither reward_fn, environment nor teacher_model_path is set: PPO needs a signal (a reward "
        "model, a reward_fn, an environment's rewards, a teacher to distil)",
    )
    check_score_keys(cfg)  # the reward function's form only: it is imported when the stage starts
    require(
        cfg.value_model != "reward" or not is_off(cfg.reward_model_path),
        "value_model",
        "'reward' initialises the critic from the reward model: set reward_model_path",
    )


@dataclass(frozen=True)
class BatchSizes:
    """The batch-size arithmetic of one PPO step, in one place (printed at start, tested)."""

    num_processes: int
    samples_per_prompt: int
    prompts_per_process: int  # rollout_batch_size
    rollout_per_process: int  # episodes: prompts_per_process * samples_per_prompt
    mini_batch_per_process: int
    micro_batch_per_process: int
    gradient_accumulation_steps: int
    num_mini_batches: int  # optimiser steps per PPO epoch
    optimizer_steps_per_ppo_step: int
    prompts_per_step: int  # global: what the prompt schedule advances by (`next_queries`)
    episodes_per_step: int  # global rollout batch: the n of the KL controller update
    total_episodes: int


def batch_sizes(
    *,
    rollout_batch_size: int,
    mini_batch_size: int,
    gradient_accumulation_steps: int,
    ppo_epochs: int,
    steps: int,
    num_processes: int,
    samples_per_prompt: int = 1,
) -> BatchSizes:
    """rollout_batch_size prompts per process, each sampled samples_per_prompt times: the rollout's episodes
    per process; minibatches and micro-batches count episodes."""
    episodes = rollout_batch_size * samples_per_prompt  # per process
    num_mini_batches = episodes // mini_batch_size
    return BatchSizes(
        num_processes=num_processes,
        samples_per_prompt=samples_per_prompt,
        prompts_per_process=rollout_batch_size,
        rollout_per_process=episodes,
        mini_batch_per_process=mini_batch_size,
        micro_batch_per_process=mini_batch_size // gradient_accumulation_steps,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_mini_batches=num_mini_batches,
        optimizer_steps_per_ppo_step=num_mini_batches * ppo_epochs,
        prompts_per_step=rollout_batch_size * num_processes,
        episodes_per_step=episodes * num_processes,
        total_episodes=episodes * num_processes * steps,
    )
