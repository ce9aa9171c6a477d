"""PPO stage: policy with a value head, a frozen reference, a frozen reward model, adaptive KL.

One PPO step (`ppo_step`) reads like the algorithm box of Ziegler et al. (2019) / Stiennon et al. (2020):

    rollout (sample responses, old log-probs and values in one pass) -> reference log-probs
    -> reward-model scores -> shaped rewards (-beta*KL per token + score at the last token)
    -> GAE -> K epochs of clipped policy/value updates on shuffled minibatches
    -> KL controller update -> metrics

The math lives in `llm_rlhf.ppo_math` (torch only); this module moves tensors between models.
Run it with `llm-rlhf ppo --config recipes/reviews/ppo.yaml [--key value ...]`, also under
`accelerate launch` with several processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llm_rlhf import ppo_math
from llm_rlhf.config import format_config, help_field, require, save_config
from llm_rlhf.data import DATA_FORMATS
from llm_rlhf.errors import UserError
from llm_rlhf.utils import (
    append_jsonl,
    atomic_write_json,
    publish_files,
    replace_dir,
    seed_everything,
    temp_dir_beside,
)


@dataclass
class Config:
    # --- models and data
    model_name_or_path: str = help_field(
        "runs/reviews/sft", "The SFT model (HF folder or hub name): initial policy and frozen reference."
    )
    reward_model_path: str = help_field(
        "runs/reviews/rm", "The trained reward model folder (`llm-rlhf rm` output)."
    )
    prompt_file: str = help_field(
        "data/reviews/ppo_prompts.jsonl",
        "Prompts to sample responses for (JSONL/CSV/Parquet or a hub dataset).",
    )
    output_dir: str = help_field("runs/reviews/ppo", "Where the policy, value head, logs and checkpoints go.")
    trust_remote_code: bool = help_field(
        False, "Allow model code from the hub (off unless you trust the source)."
    )
    dtype: str = help_field("float32", "Weights dtype: float32 | bfloat16 | float16.")
    bf16: bool = help_field(False, "bf16 autocast for forward passes (CPU and GPU).")
    gradient_checkpointing: bool = help_field(
        False, "Recompute activations in the backward pass to save memory."
    )
    value_model: str = help_field(
        "policy",
        "Critic: 'policy' (value head on the policy trunk) or 'reward' (separate critic initialised from the reward model).",
    )
    seed: int = help_field(0, "Random seed (each process adds its index).")
    # --- budget and batch sizes (per process)
    steps: int = help_field(40, "Number of PPO steps (rollout batches).")
    rollout_batch_size: int = help_field(64, "Prompts per rollout batch, per process.")
    mini_batch_size: int = help_field(16, "Episodes per optimiser step, per process.")
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
    max_prompt_length: int = help_field(
        32, "Prompts longer than this (tokens) are rejected with an error naming the row (see skip_long)."
    )
    data_format: str = help_field(
        "auto",
        "Schema of prompt_file and eval_prompt_file: 'auto' (detected from the columns) or 'hh' "
        "(Anthropic/hh-rlhf dialogues, also detected by 'auto': the prompt is `chosen` up to and including "
        "its last '\\n\\nAssistant:').",
    )
    skip_long: bool = help_field(
        False,
        "Leave out (and count) prompts longer than max_prompt_length; false = stop with an error naming "
        "the row.",
    )
    max_new_tokens: int = help_field(32, "Maximum response length in tokens.")
    temperature: float = help_field(1.0, "Sampling temperature (log-probs use the same temperature).")
    top_k: int = help_field(0, "Top-k sampling (0 = off).")
    top_p: float = help_field(1.0, "Nucleus sampling (1.0 = off).")
    # --- rewards and KL
    kl_estimator: str = help_field("k1", "Per-token KL estimator in the reward: k1 | k3 | abs | mse.")
    kl_controller: str = help_field("adaptive", "'adaptive' (Ziegler et al. 2019) or 'fixed'.")
    init_kl_coef: float = help_field(0.1, "Initial beta.")
    kl_target: float = help_field(6.0, "Adaptive controller: target per-sequence KL (nats).")
    kl_horizon: int = help_field(10000, "Adaptive controller: horizon in episodes.")
    eos_penalty: float | None = help_field(
        None, "EOS trick: score for responses that never emitted EOS (null = off)."
    )
    score_clip: float | None = help_field(None, "Clip RM scores to [-x, x] (null = off).")
    whiten_rewards: bool = help_field(False, "Whiten the per-token rewards over the batch before GAE.")
    # --- PPO
    gamma: float = help_field(1.0, "Discount.")
    lam: float = help_field(0.95, "GAE lambda.")
    cliprange: float = help_field(0.2, "Policy ratio clip epsilon.")
    cliprange_value: float = help_field(0.2, "Value clip epsilon.")
    vf_coef: float = help_field(0.1, "c1: value loss coefficient.")
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
    gold_judge: str = help_field(
        "data/reviews/gold_judge.json",
        "Gold judge for held-out evaluation: a judge JSON, module:callable, or none.",
    )
    # --- logging and checkpoints
    log_samples_every: int = help_field(10, "Log a few sampled responses every N steps.")
    num_log_samples: int = help_field(3, "How many samples to log.")
    save_steps: int = help_field(20, "Checkpoint every N steps (0 = only at the end).")
    resume: bool = help_field(False, "Continue from the last checkpoint in output_dir.")
    report_to: str = help_field("none", "Also log to: none | tensorboard | wandb.")

    def __post_init__(self):
        require(self.data_format in DATA_FORMATS, "data_format", f"must be one of {', '.join(DATA_FORMATS)}")
        require(self.steps > 0, "steps", "must be > 0")
        require(
            self.mini_batch_size > 0 and self.rollout_batch_size % self.mini_batch_size == 0,
            "mini_batch_size",
            f"must divide rollout_batch_size ({self.rollout_batch_size})",
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
            self.report_to in ("none", "tensorboard", "wandb"),
            "report_to",
            "must be none, tensorboard or wandb",
        )
        require(self.temperature > 0, "temperature", "must be > 0")
        require(
            self.kl_target > 0 and self.kl_horizon > 0, "kl_target", "kl_target and kl_horizon must be > 0"
        )
        require(0 < self.cliprange and 0 < self.cliprange_value, "cliprange", "clip ranges must be > 0")
        require(self.max_new_tokens > 0, "max_new_tokens", "must be > 0")


TRAIN_STATS = (
    "loss/policy",
    "loss/value",
    "policy/entropy",
    "policy/approxkl",
    "policy/clipfrac",
    "val/clipfrac",
    "policy/ratio",
)  # token means over each global minibatch, averaged over the minibatches


@dataclass(frozen=True)
class BatchSizes:
    """The batch-size arithmetic of one PPO step, in one place (printed at start, tested)."""

    num_processes: int
    rollout_per_process: int
    mini_batch_per_process: int
    micro_batch_per_process: int
    gradient_accumulation_steps: int
    num_mini_batches: int  # optimiser steps per PPO epoch
    optimizer_steps_per_ppo_step: int
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
) -> BatchSizes:
    num_mini_batches = rollout_batch_size // mini_batch_size
    return BatchSizes(
        num_processes=num_processes,
        rollout_per_process=rollout_batch_size,
        mini_batch_per_process=mini_batch_size,
        micro_batch_per_process=mini_batch_size // gradient_accumulation_steps,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_mini_batches=num_mini_batches,
        optimizer_steps_per_ppo_step=num_mini_batches * ppo_epochs,
        episodes_per_step=rollout_batch_size * num_processes,
        total_episodes=rollout_batch_size * num_processes * steps,
    )


# ---------------------------------------------------------------------------------------------
# Rollout
# ---------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One rollout batch. Layout of a row (query left-padded, response right-padded):

        sequence       pad pad q q q | r r r EOS pad pad
        attention      0   0   1 1 1 | 1 1 1 1   0   0
        response_mask                | T T T T   F   F     (tokens after the first EOS are padding)

    query: (B, P); response: (B, R); response_mask: (B, R) bool; logprobs, ref_logprobs, values,
    entropy: (B, R), aligned with the response tokens; scores: (B,).
    """

    query: torch.Tensor
    query_mask: torch.Tensor
    response: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    @property
    def sequence(self) -> torch.Tensor:
        return torch.cat([self.query, self.response], dim=1)  # (B, P + R)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.query_mask.bool(), self.response_mask], dim=1)  # (B, P + R)

    def ended_with_eos(self, eos_token_id: int) -> torch.Tensor:
        """(B,) True where the response contains EOS (its last unmasked token); False if truncated."""
        return ((self.response == eos_token_id) & self.response_mask).any(-1)

    def select(self, index: torch.Tensor) -> Rollout:
        return Rollout(
            **{
                f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[index])
                for f in dataclasses.fields(self)
            }
        )


def response_logprobs_and_values(model, rollout: Rollout, temperature: float, *, entropy: str = "grad"):
    """One forward over query + response; outputs aligned with the response tokens.

    The LM head runs only at the R positions whose logits are used (`logits_to_keep`), not at the query.
    entropy: "grad" (differentiable), "stats" (a metric only: no autograd graph over the (B, R, V)
    softmax) or "none" (not computed, None).
    Returns logprobs (B, R), values (B, R), entropy (B, R); values is None for a plain LM (reference).
    """
    P, R = rollout.query.shape[1], rollout.response.shape[1]
    # Positions P-1 .. P+R-2. A tensor, not `R + 1`: indexing gives a contiguous (B, R, H) copy, so the
    # LM head is one matmul (a strided slice sends frozen weights, LoRA's and the reference's, to bmm: 2x).
    keep = torch.arange(P - 1, P + R - 1, device=rollout.query.device)  # (R,)
    out = model(rollout.sequence, rollout.attention_mask.long(), logits_to_keep=keep)
    logits, values = (
        out if isinstance(out, tuple) else (out, None)
    )  # policy: (logits, values); reference: logits
    # logits: (B, R, V): row t predicts response token t
    logprobs = ppo_math.logprobs_from_logits(logits=logits, labels=rollout.response, temperature=temperature)
    if entropy == "grad":
        entropy = ppo_math.entropy_from_logits(logits=logits, temperature=temperature)
    elif entropy == "stats":  # a metric: no graph, and chunks of 4 rows keep its (B, R, V) temporaries small
        with torch.no_grad():
            entropy = torch.cat(
                [ppo_math.entropy_from_logits(logits=z, temperature=temperature) for z in logits.split(4)]
            )  # (B, R)
    else:
        entropy = None
    if values is not None:
        values = values[:, P - 1 : -1]  # (B, R): V(s_t), the state before response token t
    return logprobs, values, entropy


class Reference(torch.nn.Module):
    """pi_ref: a plain causal-LM forward with positions from the attention mask, the same code path as
    the policy's forward (so KL_t = 0 and rho = 1 exactly while the weights are equal)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int | torch.Tensor = 0
    ) -> torch.Tensor:
        from llm_rlhf.models import position_ids_from_mask

        return self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            logits_to_keep=logits_to_keep,
        ).logits  # (B, L, V), or (B, K, V) at the K positions in logits_to_keep


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


class PPOTrainer:
    """Holds the models, the optimiser and the KL controller; `ppo_step` is one iteration."""

    def __init__(
        self, cfg: Config, *, accelerator, policy, ref_model, reward_model, critic, tokenizer, prompts
    ):
        from llm_rlhf.models import shares_vocab

        self.cfg, self.accelerator, self.tokenizer = cfg, accelerator, tokenizer
        self.ref_model, self.reward_model = ref_model, reward_model
        self.sizes = batch_sizes(
            rollout_batch_size=cfg.rollout_batch_size,
            mini_batch_size=cfg.mini_batch_size,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            ppo_epochs=cfg.ppo_epochs,
            steps=cfg.steps,
            num_processes=accelerator.num_processes,
        )
        params = [p for p in policy.parameters() if p.requires_grad]
        if critic is not None:
            params += [p for p in critic.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params,
            lr=cfg.learning_rate,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            # One kernel per step instead of ~8 elementwise passes per tensor: on CPU the default
            # for-loop AdamW took ~10% of a GPT-2 124M update (benchmarks/README.md).
            fused=accelerator.device.type in ("cpu", "cuda"),
        )
        total = cfg.steps * self.sizes.optimizer_steps_per_ppo_step
        decay = (
            (lambda i: max(0.0, 1.0 - i / total)) if cfg.lr_scheduler_type == "linear" else (lambda i: 1.0)
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
        if critic is not None:
            self.policy, self.critic, self.optimizer, self.scheduler = accelerator.prepare(
                policy, critic, optimizer, scheduler
            )
        else:
            self.policy, self.optimizer, self.scheduler = accelerator.prepare(policy, optimizer, scheduler)
            self.critic = None
        self.kl_ctl = (
            ppo_math.AdaptiveKLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
            if cfg.kl_controller == "adaptive"
            else ppo_math.FixedKLController(cfg.init_kl_coef)
        )
        self.prompts = prompts  # list of token-id lists
        self.rm_shares_vocab = shares_vocab(tokenizer, reward_model.tokenizer)
        self.step = 0
        self.device = accelerator.device

    # --- the algorithm -------------------------------------------------------------------------

    def ppo_step(self) -> dict[str, float]:
        """One PPO iteration (Ziegler et al. 2019, Algorithm 1; Stiennon et al. 2020, Appendix B)."""
        cfg, t0 = self.cfg, time.perf_counter()
        queries = self.next_queries()
        rollout = self.generate(queries)  # y ~ pi_theta(.|x), old logprobs and values
        t1 = time.perf_counter()
        rollout.ref_logprobs = self.reference_logprobs(rollout)  # log pi_ref(y_t|s_t)
        rollout.scores = self.score(rollout)  # r_phi(x, y), normalised
        t2 = time.perf_counter()

        kl = ppo_math.kl_penalty(
            logprobs=rollout.logprobs, ref_logprobs=rollout.ref_logprobs, estimator=cfg.kl_estimator
        )
        scores = (
            rollout.scores
            if cfg.score_clip is None
            else ppo_math.clip_scores(scores=rollout.scores, score_clip=cfg.score_clip)
        )
        rewards, non_score_reward = ppo_math.shaped_rewards(
            scores=scores,
            kl=kl,
            kl_coef=self.kl_ctl.value,
            response_mask=rollout.response_mask,
            eos_penalty=cfg.eos_penalty,
            ended_with_eos=rollout.ended_with_eos(self.tokenizer.eos_token_id)
            if cfg.eos_penalty is not None
            else None,
        )
        if cfg.whiten_rewards:
            rewards = self.whiten(rewards, rollout.response_mask, shift_mean=False)
        advantages, returns = ppo_math.compute_gae(
            rewards=rewards,
            values=rollout.values,
            response_mask=rollout.response_mask,
            gamma=cfg.gamma,
            lam=cfg.lam,
        )
        advantages = self.whiten(advantages, rollout.response_mask)

        train_stats = self.train_on_rollout(rollout, advantages, returns)  # K epochs of minibatch updates
        t3 = time.perf_counter()

        kl_seq = ppo_math.sequence_kl(kl=kl, response_mask=rollout.response_mask)  # (B,)
        mean_kl = self.global_mean(kl_seq)
        kl_coef = self.kl_ctl.value
        self.kl_ctl.update(mean_kl, self.sizes.episodes_per_step)  # n in episodes
        self.step += 1
        return self.metrics(
            rollout,
            kl_seq,
            kl_coef,
            non_score_reward,
            rewards,
            returns,
            train_stats,
            times={"generate": t1 - t0, "score": t2 - t1, "train": t3 - t2},
        )

    # --- phases -------------------------------------------------------------------------------

    def next_queries(self) -> list[list[int]]:
        """This process's prompts for the current step: a seeded permutation per pass over the data.

        Global episode index e = step * episodes_per_step + process_index * rollout + i, so the data
        position follows from the step alone (exact resume) and processes never share a prompt.
        """
        n, per_step = len(self.prompts), self.sizes.episodes_per_step
        start = self.step * per_step + self.accelerator.process_index * self.cfg.rollout_batch_size
        out = []
        for e in range(start, start + self.cfg.rollout_batch_size):
            epoch, i = divmod(e, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch))
            out.append(self.prompts[perm[i]])
        return out

    @torch.no_grad()
    def generate(self, queries: list[list[int]]) -> Rollout:
        """Sample responses with the KV cache; then one forward for old log-probs, values and entropy."""
        cfg, tok = self.cfg, self.tokenizer
        P = max(len(q) for q in queries)
        query = torch.full((len(queries), P), tok.pad_token_id, dtype=torch.long)
        query_mask = torch.zeros((len(queries), P), dtype=torch.long)
        for i, q in enumerate(queries):  # left padding: the response starts at column P in every row
            query[i, P - len(q) :] = torch.tensor(q)
            query_mask[i, P - len(q) :] = 1
        query, query_mask = query.to(self.device), query_mask.to(self.device)
        policy = self.unwrapped_policy
        with self.autocast(), self.gathered_for_generation(policy):
            sequences = policy.lm.generate(
                input_ids=query,
                attention_mask=query_mask,
                do_sample=True,
                temperature=cfg.temperature,
                top_k=cfg.top_k or None,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens,
                min_new_tokens=1,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                use_cache=True,
            )
        response = sequences[:, P:]  # (B, R)
        if response.shape[1] < cfg.max_new_tokens:  # generate stops early when every row has ended
            pad = response.new_full(
                (response.shape[0], cfg.max_new_tokens - response.shape[1]), tok.pad_token_id
            )
            response = torch.cat([response, pad], dim=1)  # (B, max_new_tokens): same R on every rank
        rollout = Rollout(
            query=query,
            query_mask=query_mask,
            response=response,
            response_mask=ppo_math.response_mask_from_tokens(
                response=response, eos_token_id=tok.eos_token_id
            ),
        )
        rollout.response = torch.where(rollout.response_mask, response, tok.pad_token_id)
        rollout.logprobs, values, rollout.entropy = self.in_chunks(self.forward_policy, rollout)
        rollout.values = values
        return rollout

    def in_chunks(self, forward, rollout: Rollout):
        """`forward` over chunks of micro-batch rows, outputs concatenated along the batch: a no-grad pass
        over the whole rollout never holds its (B, R, V) logits and their softmax temporaries at once
        (the peak memory of a LoRA step), and runs on the batch shape that training runs on."""
        n = self.sizes.micro_batch_per_process
        parts = [forward(rollout.select(slice(i, i + n))) for i in range(0, rollout.query.shape[0], n)]
        if isinstance(parts[0], torch.Tensor):
            return torch.cat(parts)  # (B, R)
        return tuple(torch.cat(xs) for xs in zip(*parts))  # each (B, R)

    def forward_policy(self, rollout: Rollout, *, train: bool = False):
        """log pi_theta(y_t|s_t), V(s_t), entropy for the response tokens: (B, R) each.

        train=True goes through the DDP wrapper (gradients synchronised in backward); otherwise the
        unwrapped module runs the same computation with no collectives, so any one process may call it.
        """
        unwrap = self.accelerator.unwrap_model
        policy = self.policy if train else unwrap(self.policy)
        # The entropy needs an autograd graph only when the loss uses it (ent_coef != 0).
        entropy_mode = "grad" if train and self.cfg.ent_coef != 0 else "stats"
        with self.autocast(), self.checkpointing(train):
            logprobs, values, entropy = response_logprobs_and_values(
                policy, rollout, self.cfg.temperature, entropy=entropy_mode
            )
            if self.critic is not None:
                critic = self.critic if train else unwrap(self.critic)
                P = rollout.query.shape[1]
                values = critic(rollout.sequence, rollout.attention_mask.long())[:, P - 1 : -1]  # (B, R)
        return logprobs.float(), values.float(), entropy.float()

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """log pi_ref(y_t|s_t): (B, R). With LoRA: the policy's own network with the adapter disabled."""
        with self.autocast(), self.reference_context():
            logprobs = self.in_chunks(
                lambda part: response_logprobs_and_values(
                    self.ref_model, part, self.cfg.temperature, entropy="none"
                )[0],
                rollout,
            )
        return logprobs.float()

    @torch.no_grad()
    def score(self, rollout: Rollout) -> torch.Tensor:
        """r_phi(x, y), normalised with the RM's stored mean/std: (B,)."""
        with self.autocast():
            if self.rm_shares_vocab:  # the usual case: the RM was trained from the SFT model
                return self.reward_model.score(rollout.sequence, rollout.attention_mask.long()).float()
            # Another tokenizer: decode and re-encode the way the RM was trained.
            return self.reward_model.score_tokens(
                rollout.sequence, rollout.attention_mask.long(), self.tokenizer
            ).float()

    def train_on_rollout(
        self, rollout: Rollout, advantages: torch.Tensor, returns: torch.Tensor
    ) -> dict[str, float]:
        """K epochs over shuffled minibatches; each minibatch is `gradient_accumulation_steps` micro-batches.

        Every loss is a token mean over the global minibatch: a micro-batch's masked mean is weighted by
        its share of the minibatch's tokens (times the number of processes, since DDP averages gradients),
        so accumulation and data parallelism change only the float rounding. The ratio guard and the
        approx-KL early stop decide on global statistics, so every process takes the same branch.
        """
        cfg, sizes = self.cfg, self.sizes
        history, skipped, stopped_early = [], 0, False
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(sizes.rollout_per_process, device=self.device)
            for mb in order.split(sizes.mini_batch_per_process):
                mb_tokens = self.global_sum(rollout.response_mask[mb].sum())  # tokens in the global minibatch
                self.optimizer.zero_grad(set_to_none=True)
                totals = torch.zeros(len(TRAIN_STATS), device=self.device)
                for mc in mb.split(sizes.micro_batch_per_process):
                    part = rollout.select(mc)
                    mask = part.response_mask
                    logprobs, values, entropy = self.forward_policy(part, train=True)
                    pg_loss, pg = ppo_math.policy_loss(
                        logprobs=logprobs,
                        old_logprobs=part.logprobs,
                        advantages=advantages[mc],
                        response_mask=mask,
                        cliprange=cfg.cliprange,
                    )
                    vf_loss, vf = ppo_math.value_loss(
                        values=values,
                        old_values=part.values,
                        returns=returns[mc],
                        response_mask=mask,
                        cliprange_value=cfg.cliprange_value,
                    )
                    entropy = ppo_math.masked_mean(entropy, mask)
                    loss = pg_loss + cfg.vf_coef * vf_loss - cfg.ent_coef * entropy
                    weight = mask.sum() * self.accelerator.num_processes / mb_tokens.clamp(min=1)
                    self.accelerator.backward(loss * weight)
                    parts = (
                        pg_loss,
                        vf_loss,
                        entropy,
                        pg.approxkl,
                        pg.clipfrac,
                        vf.clipfrac,
                        ppo_math.masked_mean(pg.ratio, mask),
                    )
                    totals += torch.stack([v.detach().float() for v in parts]) * weight
                stats = dict(zip(TRAIN_STATS, self.accelerator.reduce(totals, reduction="mean").tolist()))
                history.append(stats)
                if stats["policy/ratio"] > cfg.ratio_guard:  # a diverged minibatch: drop its update
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                self.accelerator.clip_grad_norm_(self.trainable_parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                if cfg.target_approxkl is not None and stats["policy/approxkl"] > cfg.target_approxkl:
                    stopped_early = True
                    break
            if stopped_early:
                break
        out = {k: float(np.mean([h[k] for h in history])) for k in TRAIN_STATS}
        out.update(
            {
                "policy/skipped_minibatches": float(skipped),
                "policy/early_stopped": float(stopped_early),
                "lr": self.scheduler.get_last_lr()[0],
            }
        )
        return out

    # --- held-out evaluation ------------------------------------------------------------------

    def evaluate(self, prompts: list[str], judge) -> dict[str, float]:
        """RM score, gold score and KL to the reference on held-out prompts (fixed seed: every
        evaluation of the run samples with the same random numbers)."""
        from llm_rlhf.evaluate import evaluate_policy

        lm = self.unwrapped_policy.lm
        ref = lm if self.cfg.use_lora else self.ref_model.lm
        with self.autocast():
            result = evaluate_policy(
                policy=lm,
                tokenizer=self.tokenizer,
                prompts=prompts,
                ref_model=ref,
                ref_context=(lambda: lm.disable_adapter()) if self.cfg.use_lora else None,
                reward_model=self.reward_model,
                judge=judge,
                seed=self.cfg.seed,
                batch_size=self.cfg.rollout_batch_size,
                max_new_tokens=self.cfg.max_new_tokens,
                temperature=self.cfg.temperature,
                top_k=self.cfg.top_k,
                top_p=self.cfg.top_p,
            )
        return {
            "step": self.step,
            "kl": result["kl_to_ref"],
            "rm_score": result["rm_score_mean"],
            "gold_score": result["gold_score_mean"],
            "eos_rate": result["eos_rate"],
            "response_length": result["response_length_mean"],
        }

    # --- metrics ------------------------------------------------------------------------------

    def metrics(
        self, rollout, kl_seq, kl_coef, non_score_reward, rewards, returns, train_stats, times
    ) -> dict[str, float]:
        mask = rollout.response_mask
        lengths = mask.sum(-1).float()  # (B,)
        non_score = ppo_math.masked_sum(non_score_reward, mask, dim=-1)  # (B,)
        tokens = self.global_sum(lengths.sum())
        step_time = sum(times.values())
        m = {
            "step": self.step,
            "episodes": self.step * self.sizes.episodes_per_step,
            "objective/scores": self.global_mean(rollout.scores.mean()),
            "objective/scores_std": self.global_std(rollout.scores),
            "objective/kl": self.global_mean(kl_seq.mean()),
            "objective/kl_coef": float(kl_coef),
            "objective/non_score_reward": self.global_mean(non_score.mean()),
            "objective/rlhf_reward": self.global_mean((rollout.scores + non_score).mean()),
            "objective/entropy": self.global_mean(ppo_math.masked_sum(rollout.entropy, mask, dim=-1).mean()),
            "val/explained_variance": float(
                ppo_math.explained_variance(values=rollout.values, returns=returns, mask=mask)
            ),
            "val/mean": self.global_mean(ppo_math.masked_mean(rollout.values, mask)),
            "response_length": self.global_mean(lengths.mean()),
            "eos_rate": self.global_mean(rollout.ended_with_eos(self.tokenizer.eos_token_id).float().mean()),
            "time/generate": times["generate"],
            "time/score": times["score"],
            "time/train": times["train"],
            "time/step": step_time,
            "tokens_per_s": float(tokens) / step_time,
        }
        m.update(train_stats)
        return m

    # --- distributed helpers ------------------------------------------------------------------

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(x.detach().to(self.device).float(), reduction="sum")

    def global_mean(self, x) -> float:
        """Mean over every process (each holds the same number of episodes)."""
        x = torch.as_tensor(x, dtype=torch.float32, device=self.device).mean()
        return float(self.accelerator.reduce(x, reduction="mean"))

    def global_std(self, x: torch.Tensor) -> float:
        return float(self.accelerator.gather_for_metrics(x.float()).std())

    def whiten(self, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        """masked_whiten with statistics over every process's batch (the same as whitening the global batch)."""
        if self.accelerator.num_processes == 1:
            return ppo_math.masked_whiten(x, mask, shift_mean=shift_mean)
        n = self.global_sum(mask.sum())
        mean = self.global_sum(ppo_math.masked_sum(x, mask)) / n
        var = self.global_sum(ppo_math.masked_sum((x - mean) ** 2, mask)) / (n - 1)
        whitened = (x - mean) * torch.rsqrt(var + 1e-8)
        if not shift_mean:
            whitened = whitened + mean
        return torch.where(mask, whitened, 0)

    # --- model plumbing -----------------------------------------------------------------------

    @property
    def unwrapped_policy(self):
        return self.accelerator.unwrap_model(self.policy)

    def trainable_parameters(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.critic is not None:
            params += [p for p in self.critic.parameters() if p.requires_grad]
        return params

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.cfg.bf16 else nullcontext()

    @contextmanager
    def checkpointing(self, train: bool):
        """Gradient checkpointing for a training forward. transformers checkpoints a layer only while that
        layer is in training mode, and the policy stays in eval mode (dropout off), so the option did
        nothing: flag the checkpointed layers alone as training (their submodules, dropout included,
        stay in eval mode), and only for the training forward (generation keeps its KV cache)."""
        if not (train and self.cfg.gradient_checkpointing):
            yield
            return
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in self.unwrapped_policy.modules() if isinstance(m, GradientCheckpointingLayer)]
        for layer in layers:
            layer.training = True
        try:
            yield
        finally:
            for layer in layers:
                layer.training = False

    @contextmanager
    def gathered_for_generation(self, policy):
        """ZeRO-3 / FSDP shard parameters: gather them once for the many small forwards of generation
        (each rank then generates on its own, so ranks that finish early wait for nobody)."""
        from accelerate.utils import DistributedType

        if (
            self.accelerator.distributed_type == DistributedType.DEEPSPEED
            and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        ):
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(policy.lm.parameters())):
                yield
        elif self.accelerator.distributed_type == DistributedType.FSDP:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(self.policy, writeback=False, recurse=True):
                yield
        else:
            yield

    def reference_context(self):
        """With LoRA the reference is the policy's network with the adapter switched off."""
        if self.cfg.use_lora:
            return self.unwrapped_policy.lm.disable_adapter()
        return nullcontext()

    # --- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "step": self.step,
            "kl_ctl": self.kl_ctl.state_dict(),
            "rng": rng_state(),
        }

    def save_checkpoint(self, folder: Path) -> None:
        """Atomically write everything needed to continue exactly: weights, optimiser, scheduler, RNG,
        data position (the step) and the KL controller."""
        self.accelerator.wait_for_everyone()
        rng_all = (
            self.accelerator.gather_for_metrics([rng_state()], use_gather_object=True)
            if self.accelerator.num_processes > 1
            else [rng_state()]
        )
        if self.accelerator.is_main_process:
            from safetensors.torch import save_file

            tmp = temp_dir_beside(folder)
            trainable = {
                n: p.detach().contiguous().cpu()
                for n, p in self.unwrapped_policy.named_parameters()
                if p.requires_grad
            }
            save_file(trainable, tmp / "policy_trainable.safetensors")
            if self.critic is not None:
                critic = {
                    n: p.detach().contiguous().cpu()
                    for n, p in self.accelerator.unwrap_model(self.critic).named_parameters()
                    if p.requires_grad
                }
                save_file(critic, tmp / "critic_trainable.safetensors")
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                tmp / "optimizer.pt",
            )
            torch.save(
                {"step": self.step, "kl_ctl": self.kl_ctl.state_dict(), "rng": rng_all},
                tmp / "trainer_state.pt",
            )
            (tmp / "step.json").write_text(json.dumps({"step": self.step}))
            replace_dir(tmp, folder)
        self.accelerator.wait_for_everyone()

    def load_checkpoint(self, folder: Path) -> None:
        from safetensors.torch import load_file

        trainable = load_file(folder / "policy_trainable.safetensors")
        missing = self.unwrapped_policy.load_state_dict(trainable, strict=False)
        if missing.unexpected_keys:
            raise UserError(
                f"checkpoint {folder} does not match the model: unexpected {missing.unexpected_keys[:3]}"
            )
        if self.critic is not None:
            self.accelerator.unwrap_model(self.critic).load_state_dict(
                load_file(folder / "critic_trainable.safetensors"), strict=False
            )
        opt = torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        state = torch.load(folder / "trainer_state.pt", weights_only=True, map_location="cpu")
        self.step = state["step"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        set_rng_state(state["rng"][self.accelerator.process_index])


def rng_state() -> dict:
    """Python, numpy and torch RNG states as plain tensors/tuples (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Building the models and running the stage
# ---------------------------------------------------------------------------------------------


def prompt_rules(cfg) -> dict:
    """How the prompt files of a PPO or evaluation config are read (length limit, schema, long prompts)."""
    return {
        "max_prompt_length": cfg.max_prompt_length,
        "data_format": cfg.data_format,
        "skip_long": cfg.skip_long,
    }


def load_prompts(cfg: Config, tokenizer) -> list[list[int]]:
    from llm_rlhf.data import load_prompt_dataset

    ds = load_prompt_dataset(cfg.prompt_file, tokenizer, **prompt_rules(cfg))
    return [tokenizer(p)["input_ids"] for p in ds["prompt"]]  # with BOS where the tokenizer adds one


def build_models(cfg: Config):
    """policy (+ value head), reference, reward model and optional separate critic."""
    from llm_rlhf.models import PolicyWithValue, ValueHead, freeze, load_causal_lm, use_fused_gelu
    from llm_rlhf.reward import load_reward_model

    lm = use_fused_gelu(
        load_causal_lm(cfg.model_name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    )
    if cfg.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    if cfg.use_lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=cfg.lora_target_modules,
            task_type="CAUSAL_LM",
        )
        lm = get_peft_model(lm, lora)
        ref_model = Reference(lm)  # the same network; reference_context() disables the adapter
    else:
        ref_lm = freeze(
            use_fused_gelu(
                load_causal_lm(
                    cfg.model_name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code
                )
            )
        )
        assert ref_lm is not lm and all(
            a.data_ptr() != b.data_ptr() for a, b in zip(ref_lm.parameters(), lm.parameters())
        )
        ref_model = Reference(ref_lm)
    lm.eval()  # dropout off for the policy too: ratio == 1 exactly at the first minibatch
    hidden = (
        lm.config.get_text_config().hidden_size
        if hasattr(lm.config, "get_text_config")
        else lm.config.hidden_size
    )
    policy = PolicyWithValue(lm, ValueHead(hidden).to(next(lm.parameters()).dtype))
    reward_model = freeze(
        use_fused_gelu(
            load_reward_model(cfg.reward_model_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
        )
    )
    critic = None
    if cfg.value_model == "reward":
        critic = use_fused_gelu(
            load_reward_model(cfg.reward_model_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
        ).as_critic()
    return policy, ref_model, reward_model, critic


def build_trainer(cfg: Config, accelerator, tokenizer, prompts: list[list[int]]) -> PPOTrainer:
    seed_everything(cfg.seed, accelerator.process_index)
    policy, ref_model, reward_model, critic = build_models(cfg)
    reward_model.to(accelerator.device)
    if not cfg.use_lora:
        ref_model.to(accelerator.device)
    return PPOTrainer(
        cfg,
        accelerator=accelerator,
        policy=policy,
        ref_model=ref_model,
        reward_model=reward_model,
        critic=critic,
        tokenizer=tokenizer,
        prompts=prompts,
    )


def last_checkpoint(output_dir: Path) -> Path | None:
    ckpts = sorted((output_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def run(cfg: Config) -> dict[str, float]:
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from llm_rlhf.models import check_not_adapter_only, load_tokenizer

    accelerator = Accelerator()
    out = Path(cfg.output_dir)
    check_not_adapter_only(cfg.model_name_or_path)
    tokenizer = load_tokenizer(
        cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code, padding_side="left"
    )
    prompts = load_prompts(cfg, tokenizer)  # validates the data before anything is written
    eval_prompts, judge = load_eval_inputs(cfg)
    if not Path(cfg.reward_model_path).exists():
        raise UserError(
            f"reward_model_path '{cfg.reward_model_path}' does not exist (train it with `llm-rlhf rm`)"
        )
    resume_from = last_checkpoint(out) if cfg.resume else None
    if cfg.resume and resume_from is None and accelerator.is_main_process:
        print(f"resume: no checkpoint in {out / 'checkpoints'}; starting from scratch")
    if not cfg.resume and (out / "metrics.jsonl").exists():
        raise UserError(
            f"output_dir '{out}' already holds a PPO run; pass --resume true or choose another output_dir"
        )

    trainer = build_trainer(cfg, accelerator, tokenizer, prompts)
    if accelerator.is_main_process:
        print(format_config(cfg))
        print("batch sizes:", dataclasses.asdict(trainer.sizes))
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
        if accelerator.is_main_process:
            print(f"resumed from {resume_from} at step {trainer.step}")
            truncate_log(out / "metrics.jsonl", trainer.step)
            truncate_log(out / "eval_log.jsonl", trainer.step)

    writer = make_writer(cfg, out) if accelerator.is_main_process else None
    history = (
        [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        if resume_from is not None and (out / "metrics.jsonl").exists()
        else []
    )

    def maybe_evaluate():
        if accelerator.is_main_process and eval_prompts and trainer.step % cfg.eval_every == 0:
            record = trainer.evaluate(eval_prompts, judge)
            append_jsonl(out / "eval_log.jsonl", record)
            tqdm_write(
                f"[eval step {trainer.step}] kl {record['kl']:.2f}  rm {record['rm_score']:+.3f}  "
                f"gold {record['gold_score'] if record['gold_score'] is not None else float('nan'):+.3f}"
            )
        accelerator.wait_for_everyone()

    if resume_from is None:
        maybe_evaluate()
    bar = tqdm(total=cfg.steps, initial=trainer.step, desc="ppo", disable=not accelerator.is_main_process)
    while trainer.step < cfg.steps:
        metrics = trainer.ppo_step()
        history.append(metrics)
        if accelerator.is_main_process:
            append_jsonl(out / "metrics.jsonl", metrics)
            if writer is not None:
                writer(metrics)
            bar.set_postfix(
                score=f"{metrics['objective/scores']:.2f}",
                kl=f"{metrics['objective/kl']:.2f}",
                beta=f"{metrics['objective/kl_coef']:.3f}",
            )
            bar.update(1)
            if cfg.log_samples_every and (trainer.step % cfg.log_samples_every == 0 or trainer.step == 1):
                log_samples(trainer, out)
        maybe_evaluate()
        if cfg.save_steps and trainer.step % cfg.save_steps == 0 and trainer.step < cfg.steps:
            trainer.save_checkpoint(out / "checkpoints" / f"step-{trainer.step}")
    bar.close()

    final = summarize(history, cfg)
    save_final(trainer, cfg, out, final)
    return final


def load_eval_inputs(cfg: Config):
    """Held-out prompts (first eval_num_prompts) and the gold judge, or nothing when evaluation is off."""
    if not cfg.eval_every or not cfg.eval_prompt_file:
        return [], None
    from llm_rlhf.data import load_prompt_dataset
    from llm_rlhf.gold import load_judge
    from llm_rlhf.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    prompts = load_prompt_dataset(cfg.eval_prompt_file, tokenizer, **prompt_rules(cfg))["prompt"]
    return list(prompts[: cfg.eval_num_prompts]), load_judge(cfg.gold_judge)


def truncate_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint we resume from (they will be written again)."""
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in lines))


def summarize(history: list[dict], cfg: Config) -> dict[str, float]:
    last = dict(history[-1])
    first = history[0]
    last.update(
        {
            "scores_first": first["objective/scores"],
            "scores_std_first": first["objective/scores_std"],
            "scores_last": last["objective/scores"],
            "kl_last": last["objective/kl"],
            "kl_target": cfg.kl_target,
            "time_per_step_s": float(np.mean([h["time/step"] for h in history])),
        }
    )
    return last


def log_samples(trainer: PPOTrainer, out: Path) -> None:
    """Decode a few responses of a fresh rollout-free sample (greedy-free: the last rollout is not kept)."""
    tok, cfg = trainer.tokenizer, trainer.cfg
    queries = trainer.prompts[: cfg.num_log_samples]
    state = torch.get_rng_state()
    rollout = trainer.generate(queries)
    scores = trainer.score(rollout)
    torch.set_rng_state(state)  # logging must not change the training run's random stream
    for i in range(len(queries)):
        q = tok.decode(rollout.query[i][rollout.query_mask[i].bool()])
        r = tok.decode(rollout.response[i][rollout.response_mask[i]], skip_special_tokens=True)
        append_jsonl(
            out / "samples.jsonl",
            {"step": trainer.step, "query": q, "response": r, "score": float(scores[i])},
        )
        tqdm_write(f"[step {trainer.step}] {q!r} -> {r!r} (score {float(scores[i]):+.2f})")


def tqdm_write(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(text)


def make_writer(cfg: Config, out: Path):
    if cfg.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(out / "tensorboard"))
        return lambda m: [
            tb.add_scalar(k, v, m["step"])
            for k, v in m.items()
            if isinstance(v, (int, float)) and k != "step"
        ]
    if cfg.report_to == "wandb":
        import wandb

        wandb.init(project="llm_rlhf", config=dataclasses.asdict(cfg), dir=str(out))
        return lambda m: wandb.log(m, step=m["step"])
    return None


def save_final(trainer: PPOTrainer, cfg: Config, out: Path, final: dict) -> None:
    """The policy as a plain HF causal-LM folder, the value head beside it, then metrics.json (last)."""
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    from safetensors.torch import save_file

    policy = trainer.unwrapped_policy
    tmp = temp_dir_beside(out / "final")
    lm = policy.lm
    if cfg.use_lora:
        lm.save_pretrained(tmp / "adapter")
        trainer.tokenizer.save_pretrained(tmp / "adapter")
        if cfg.merge_lora:
            lm = lm.merge_and_unload()
    if not cfg.use_lora or cfg.merge_lora:
        lm.save_pretrained(tmp, safe_serialization=True)
    trainer.tokenizer.save_pretrained(tmp)
    save_file(
        {k: v.contiguous() for k, v in policy.value_head.state_dict().items()}, tmp / "value_head.safetensors"
    )
    publish_files(tmp, out)
    atomic_write_json(
        out / "metrics.json", {k: v for k, v in final.items() if not (isinstance(v, float) and math.isnan(v))}
    )
    print(
        json.dumps(
            {
                k: final[k]
                for k in (
                    "scores_first",
                    "scores_last",
                    "scores_std_first",
                    "kl_last",
                    "kl_target",
                    "time_per_step_s",
                )
            },
            indent=2,
        )
    )
