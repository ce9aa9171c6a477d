"""Run under `accelerate launch` with 1 or 2 processes: PPO steps on a fixed global rollout.

    python ppo_ranks.py MODEL_DIR RM_DIR PROMPT_FILE OUT_JSON MODE [ENSEMBLE_COMBINE]

RM_DIR may be several folders joined by commas: a reward-model ensemble, combined by ENSEMBLE_COMBINE
(default mean; 'uncertainty' with lambda 0.5).

The global batch (8 episodes) is the same whatever the number of processes; each rank takes its
contiguous slice. MODE "same": ordinary responses; MODE "accumulate": the same, each process's
minibatch as micro-batches of one episode; MODE "degenerate": rank 0's responses are all empty (EOS at
once) and the last rank's all truncated (no EOS), to check that no rank hangs. These write the RAW gradient
of the first update (flattened, after DDP's all-reduce, before clipping; clipping is off), the number of
gradient all-reduces (DDP comm-hook calls; 0 with one process or under FSDP2) and the steps' metrics to
OUT_JSON (main process).

Under FSDP2 (`fsdp2_on_cpu.py ppo_ranks.py ARGS...`, accelerate_configs/fsdp.yaml) each gradient is a
DTensor holding this rank's shard after the reduce-scatter: it is gathered whole (`full_tensor`, a
collective every rank enters, as every rank clips) and flattened in the same parameter order as with one
process. OUT_JSON also holds the distributed type and the main process's local gradient size (`local_numel`,
smaller than the gathered one when the gradients really are sharded).

MODE "estimators": for each critic-free advantage estimator (ESTIMATORS: with its samples per prompt, so
the 8 episodes are 8 / k prompts x k samples, a prompt's k samples in consecutive rows of one rank; ReMax
also gets one fixed "greedy" response per prompt), a trainer is built and runs 2 steps (the second one
after the policy moved: KL != 0, in the reward or in the loss as the estimator's default says); OUT_JSON
holds, per estimator, the raw gradient of every update (one per step) and the steps' metrics.

MODE "gae_grpo" (one process, or DeepSpeed: accelerate_configs/deepspeed_zero2.yaml / deepspeed_zero3.yaml
through `llm-rlhf`'s own `run_deepspeed_on_cpu`): the first update of "same" (gae, value head), then grpo (4
samples per prompt, 2 steps) on a second trainer; OUT_JSON holds both, "grpo" as one run of "estimators".
Under DeepSpeed the raw gradient is read from the engine's partitions (`deepspeed.utils.safe_get_full_grad`,
a gather every rank enters) before the engine's step applies it (the config's gradient_clipping set to
1e9: off, as on one process); under ZeRO-3 the script sets
stage3_param_persistence_threshold, stage3_max_live_parameters and stage3_max_reuse_distance to 0 (every
parameter partitioned, none kept live: the tiny model is under the default thresholds) and, after the
updates, samples with the real sampler while rank 0's responses all end at once (EOS forced) and the other
rank's run to max_new_tokens: "sampled_lengths" holds each rank's longest response (ranks out of step there
would hang).

MODE "lora": "same" with a LoRA adapter (LORA; the reference is the policy with the adapter disabled), on one
process or under DeepSpeed as in MODE gae_grpo (under ZeRO-3 the adapter's and the base model's parameters
partitioned alike, then the sampling with rank 0 ending at once); after the update the policy is saved with
merge_lora false (`ppo_checkpoints.save_policy`: under ZeRO-3 gathered from the partitions) into OUT_JSON's path
without its suffix.

MODE "loss_options": for each configuration of LOSS_OPTIONS (the policy-loss family: clip-higher,
dual clip, the loss aggregations, the sampler corrections, overlong shaping, truncated masking, GSPO, CISPO,
dynamic sampling; and on-policy distillation), a trainer runs 2 steps of 2 epochs, with ordinary minibatches and with micro-batches of one
episode (key NAME and NAME/accumulate); OUT_JSON holds the raw gradient of every update and the metrics. Its
fixed responses carry fixed sampler log-probs (log q = -6 + 0.5 * N(0, 1) per token, so both corrections bind
on some tokens), and the first round of each step makes the global batch's first group k identical
responses, whose scores tie: dynamic sampling drops it and samples a second round (other responses), and
selects the same groups on 1 process as on 2 (1 process: the first two untied groups of [a1 b1 a2 b2] are
b1 and a2; 2 processes: rank 0 takes a2, rank 1 b1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from llm_rlhf.core.utils import use_cpu_ddp_without_gpus
from llm_rlhf.models.loading import load_tokenizer
from llm_rlhf.ppo import building as ppo_building
from llm_rlhf.ppo import checkpoints as ppo_checkpoints
from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.rl import token_math
from llm_rlhf.rl.rollout import Samples, left_pad

GLOBAL_BATCH, R = 8, 6
ESTIMATORS = {"grpo": 4, "dr_grpo": 4, "rloo": 4, "reinforce_pp": 2, "remax": 1, "pass_at_k": 4}  # per prompt
ESTIMATOR_KEYS = {"pass_at_k": {"pass_k": 2}}  # the keys of an estimator beside its samples per prompt
LOSS_OPTIONS = {  # name: (advantage_estimator, samples per prompt, the keys of the policy-loss family)
    "dapo": (
        "grpo",
        4,
        dict(
            cliprange_low=0.2,
            cliprange_high=0.28,
            dual_clip=3.0,
            overlong_buffer=3,
            loss_aggregation="seq_mean_token_mean",
            sampler_correction="tis",
            sampler_correction_cap=1.5,
            mask_truncated=True,
            dynamic_sampling=True,
        ),
    ),
    "gspo": (
        "grpo",
        4,
        dict(
            policy_loss="gspo",
            loss_aggregation="token_sum_norm",
            sampler_correction="mis",
            sampler_correction_cap=1.5,
        ),
    ),
    "cispo": ("gae", 1, dict(policy_loss="cispo", cliprange_high=0.28)),
    # on-policy distillation (`run` makes the policy's starting weights, MODEL_DIR, its teacher): the signal 0
    # at the first step, the student's moved reverse KL at the second
    "distill": ("gae", 1, dict(distill_coef=5.0)),
    "distill_jsd": ("grpo", 4, dict(distill_coef=5.0, distill_loss="jsd", distill_top_k=16)),  # a loss term
}
LORA = dict(use_lora=True, lora_r=4, lora_dropout=0.0)  # MODE lora: "same" with a LoRA adapter


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the command line fixes for every run of this process: its accelerator, the policy's and the reward
    model's folders, the prompts, MODE and the ensemble's combine rule."""

    accelerator: Accelerator
    model_dir: str
    rm_dir: str
    prompt_file: str
    mode: str
    combine: str = "mean"


def run(launch: Launch, estimator="gae", k=1, options=None, accumulate=False, save_to=None) -> dict:
    """Build a trainer (as `llm-rlhf ppo` does) whose rollouts are fixed, run its steps and record them.
    options: keys of the policy-loss family (MODE loss_options) or LORA; accumulate: micro-batches of one
    episode; save_to: a folder to save the policy into after the steps, with merge_lora false (MODE lora)."""
    accelerator, model_dir, rm_dir, mode = launch.accelerator, launch.model_dir, launch.rm_dir, launch.mode
    prompt_file, combine = launch.prompt_file, launch.combine
    world, rank = accelerator.num_processes, accelerator.process_index
    local = GLOBAL_BATCH // world  # episodes per rank: whole groups (k divides it)
    loss_options = mode == "loss_options"
    cfg = ppo_trainer.Config(
        model_name_or_path=model_dir,
        reward_model_path=rm_dir.split(",") if "," in rm_dir else rm_dir,
        ensemble_combine=combine,
        ensemble_uncertainty_coef=0.5,
        prompt_file=prompt_file,
        output_dir="unused",
        steps=2,
        advantage_estimator=estimator,
        samples_per_prompt=k,
        rollout_batch_size=local // k,
        mini_batch_size=local,
        gradient_accumulation_steps=local if mode == "accumulate" or accumulate else 1,
        max_grad_norm=1e9,
        ppo_epochs=2 if loss_options else 1,
        max_new_tokens=R,
        learning_rate=1e-2,
        eval_every=0,
        log_samples_every=0,
        save_steps=0,
        kl_target=1.0,
        kl_horizon=100,
        **(options or {}),
        **({"teacher_model_path": model_dir} if "distill_coef" in (options or {}) else {}),
    )
    tokenizer = load_tokenizer(model_dir, padding_side="left")
    prompts = ppo_building.load_prompt_ids(cfg, tokenizer)
    trainer = ppo_building.build_trainer(cfg, accelerator, tokenizer, prompts)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rounds = {}  # PPO step -> sampling rounds so far (dynamic sampling samples more than once)

    def fixed_rollout(_queries, sampling=None):
        """The global batch's rows of this rank: prompt p's k samples in rows p*k .. p*k + k - 1; with
        `sampling` greedy (ReMax's baseline), one fixed response per prompt instead. MODE loss_options: the
        first group of a step's first round is k copies of one response, and the rows carry sampler
        log-probs; each further round of a step draws other responses."""
        greedy = sampling is not None and sampling.greedy
        per_prompt = 1 if greedy else k
        queries = [q for q in prompts[: GLOBAL_BATCH // k] for _ in range(per_prompt)]
        r = 1 if greedy else rounds.get(trainer.step, 0) + 1
        rounds[trainer.step] = r
        g = torch.Generator().manual_seed((8 if greedy else 7) + 100 * (r - 1))
        responses = torch.randint(5, 200, (len(queries), R), generator=g)
        for i in range(len(queries)):  # EOS at varied positions; row 0 never stops
            if i % 3:
                responses[i, 1 + i % (R - 1)] = eos
        if loss_options and r == 1:
            responses[:k] = responses[1]  # group 0: k identical responses (EOS in column 2), tied scores
        sampler_logprobs = -6.0 + 0.5 * torch.randn((len(queries), R), generator=g)  # (B, R) log q
        n = len(queries) // world
        rows = list(range(rank * n, (rank + 1) * n))
        if mode == "degenerate":
            if rank == 0:
                responses[rows, 0] = eos  # every response on rank 0 is empty but for its EOS
            if rank == world - 1:
                responses[rows] = torch.randint(5, 200, (n, R), generator=g)  # all truncated
        query, query_mask = left_pad([queries[i] for i in rows], pad)
        response = responses[rows]
        mask = token_math.response_mask_from_tokens(response=response, eos_token_id=eos)
        return Samples(
            query=query,
            query_mask=query_mask,
            response=torch.where(mask, response, pad),
            response_mask=mask,
            sampler_logprobs=torch.where(mask, sampler_logprobs[rows], 0.0) if loss_options else None,
        )

    real_generate, trainer.collector.generate = trainer.collector.generate, fixed_rollout
    grads, clip, local_numel = [], accelerator.clip_grad_norm_, [0]
    if trainer.accelerated.deepspeed:
        record_deepspeed_grads(trainer, grads, local_numel)

    def record_and_clip(parameters, max_norm, *args, **kwargs):  # the raw gradient of each update
        parameters = list(parameters)
        local_numel[0] = sum(
            p.grad.to_local().numel() if sharded(p.grad) else p.grad.numel() for p in parameters
        )
        full = [p.grad.full_tensor() if sharded(p.grad) else p.grad for p in parameters]  # FSDP2: gathered
        grads.append(torch.cat([g.flatten() for g in full]))
        return clip(parameters, max_norm, *args, **kwargs)

    accelerator.clip_grad_norm_ = record_and_clip
    all_reduces = [0]
    if world > 1 and not accelerator.is_fsdp2 and not trainer.accelerated.deepspeed:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_allreduce(state, bucket):
            all_reduces[0] += 1
            return allreduce_hook(state, bucket)

        trainer.policy.register_comm_hook(None, counting_allreduce)
    steps = 2 if mode in ("degenerate", "estimators", "loss_options") or estimator != "gae" else 1
    metrics = [trainer.ppo_step() for _ in range(steps)]
    accelerator.clip_grad_norm_ = clip
    if save_to is not None:
        ppo_checkpoints.save_policy(trainer, dataclasses.replace(cfg, merge_lora=False), save_to)
    lengths = []
    if trainer.accelerated.zero3:
        trainer.collector.generate = real_generate
        lengths = sampled_lengths_with_rank_0_ending_at_once(trainer, prompts[: local // k])
    return {
        "grads": [g.tolist() for g in grads],
        "metrics": metrics,
        "all_reduces": all_reduces[0],
        "local_numel": local_numel[0],
        "sampled_lengths": lengths,
    }


def record_deepspeed_grads(trainer, grads: list, local_numel: list) -> None:
    """Under DeepSpeed: append the raw gradient of each update (whole, fp32, in the order of the
    parameters, after ZeRO's reduction and before the engine's step clips it) to `grads`; the main
    process's local parameter size (its ZeRO-3 partitions: smaller than the whole) to `local_numel`."""
    from deepspeed.utils import safe_get_full_grad

    step = trainer.accelerated.clip_gradients

    def record_then_step(policy, parameters, max_grad_norm):
        parameters = list(parameters)
        local_numel[0] = sum(
            p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in parameters
        )
        grads.append(
            torch.cat([safe_get_full_grad(p).detach().flatten().float().clone() for p in parameters])
        )
        return step(policy, parameters, max_grad_norm)

    trainer.accelerated.clip_gradients = record_then_step


def sampled_lengths_with_rank_0_ending_at_once(trainer, queries) -> list[int]:
    """The trainer's own sampling (`PPOTrainer.generate`: ZeRO-3's gather, then `rollout.sample`) with EOS
    forced as rank 0's first token (a hook on its LM head) and the other ranks' responses running to
    max_new_tokens (EOS forbidden there): the longest real response of each rank."""
    eos = trainer.tokenizer.eos_token_id
    lm = trainer.unwrapped_policy.lm

    def force(_module, _inputs, logits):
        if trainer.accelerator.process_index == 0:
            return logits.index_fill(-1, torch.tensor([eos]), 1e4)
        return logits.index_fill(-1, torch.tensor([eos]), -1e4)

    hook = lm.get_output_embeddings().register_forward_hook(force)
    samples = trainer.collector.generate(queries)
    hook.remove()
    longest = samples.response_mask.sum(-1).max().reshape(1)  # (1,)
    return trainer.accelerator.gather(longest).tolist()


def sharded(grad: torch.Tensor) -> bool:
    """An FSDP2 gradient: a DTensor (this rank's shard of the whole)."""
    from torch.distributed.tensor import DTensor  # here: torch.distributed is missing from some builds

    return isinstance(grad, DTensor)


def main() -> None:
    model_dir, rm_dir, prompt_file, out_json, mode = sys.argv[1:6]
    combine = sys.argv[6] if len(sys.argv) > 6 else "mean"
    use_cpu_ddp_without_gpus()
    accelerator = Accelerator()
    world = accelerator.num_processes
    launch = Launch(accelerator, model_dir, rm_dir, prompt_file, mode, combine)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # clipping off, as max_grad_norm 1e9 makes it off on one process
        plugin.deepspeed_config["gradient_clipping"] = 1e9
    if plugin is not None and plugin.zero_stage == 3:  # see the docstring: really sharded, nothing kept live
        plugin.deepspeed_config["zero_optimization"].update(
            stage3_param_persistence_threshold=0, stage3_max_live_parameters=0, stage3_max_reuse_distance=0
        )
    if mode == "estimators":
        record = {
            "runs": {
                name: run(launch, estimator=name, k=k, options=ESTIMATOR_KEYS.get(name))
                for name, k in ESTIMATORS.items()
            }
        }
    elif mode == "gae_grpo":
        same = dataclasses.replace(launch, mode="same")
        gae, grpo = run(same), run(same, estimator="grpo", k=4)
        record = {
            "grads": gae["grads"][0],
            "metrics": gae["metrics"],
            "local_numel": gae["local_numel"],
            "sampled_lengths": gae["sampled_lengths"],
            "grpo": grpo,
            "distributed_type": accelerator.distributed_type.value,
        }
    elif mode == "loss_options":
        record = {"runs": {}}
        for name, (estimator, k, options) in LOSS_OPTIONS.items():
            for accumulate in (False, True):
                key = f"{name}/accumulate" if accumulate else name
                record["runs"][key] = run(
                    launch, estimator=estimator, k=k, options=options, accumulate=accumulate
                )
    else:
        lora = mode == "lora"
        save_to = Path(out_json).with_suffix("") if lora else None
        result = run(launch, options=LORA if lora else None, save_to=save_to)
        record = {
            "grads": result["grads"][0],
            "metrics": result["metrics"],
            "all_reduces": result["all_reduces"],
            "local_numel": result["local_numel"],
            "sampled_lengths": result["sampled_lengths"],
            "distributed_type": accelerator.distributed_type.value,
        }
    if accelerator.is_main_process:
        with open(out_json, "w") as f:
            json.dump({"world": world, **record}, f)
    accelerator.wait_for_everyone()
    if world > 1:
        # Leave without interpreter teardown: with the comm hook above registered in the C++ reducer, a rank
        # rarely aborted at exit ("terminate called without an active exception", exit -6) while gloo's
        # threads were torn down, after its work was done; destroy_process_group hung.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
