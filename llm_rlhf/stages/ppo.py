"""`llm-rlhf ppo`: the PPO stage as a command around `llm_rlhf.ppo.trainer.PPOTrainer`.

    build the models (policy + value head (gae), frozen reference, frozen RM, optional critic) and the trainer
    -> evaluate on held-out prompts -> loop: ppo_step, log (metrics.jsonl, samples, tensorboard/wandb),
       evaluate every eval_every steps (and read the reward-hacking alarm), checkpoint every save_steps
    -> save the policy (HF folder) and its value head or critic (none for the critic-free estimators), then
       metrics.json (last: the stage is done)

A checkpoint holds everything needed to continue exactly (`--resume true`): trainable weights, optimiser,
scheduler, the step (which fixes the data position), the KL controller and every process's RNG state.

The reward-hacking alarm (`hacking.watch_fields`) is read after every held-out evaluation and logged
on its line of eval_log.jsonl (alarm_step, alarm_rules, alarm_reasons, best_step). What the run returns:
the last step's policy; with stop_on_alarm, the policy of the evaluation where the alarm fired (the loop stops
there); with keep_best, the policy of the held-out evaluation with the best gold (or accuracy), checkpointed
in output_dir/best when it was evaluated (`save_checkpoint`; resume ignores the folder), loaded back at the
end and saved as the final model, the last step's policy going to output_dir/last. metrics.json says which:
alarm_step, alarm_rules, alarm_reasons, stopped_on_alarm, best_step, returned_step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from llm_rlhf.core.config import TRACKIO_PROJECT, format_config, save_config
from llm_rlhf.core.utils import (
    append_jsonl,
)
from llm_rlhf.models.loading import (
    Trained,
    check_positions,
)
from llm_rlhf.models.reward_fn import RewardFn
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.ppo.building import (
    RunInputs,
    build_trainer,
    check_inputs,
)
from llm_rlhf.ppo.checkpoints import (
    load_checkpoint,
    read_jsonl,
    resume_point,
    save_checkpoint,
    save_final,
    truncate_log,
)
from llm_rlhf.ppo.config import Config  # the keys of `llm-rlhf ppo`
from llm_rlhf.ppo.heldout import HeldOut, return_best
from llm_rlhf.ppo.trainer import PPOTrainer
from llm_rlhf.rl.rollout import encode_prompt


def run(cfg: Config) -> dict[str, float]:
    """`llm-rlhf ppo`: `train` from the config's paths; returns the final metrics."""
    return train(cfg).metrics


def train(
    cfg: Config,
    *,
    policy=None,
    tokenizer=None,
    reward_model=None,
    reward_fn: RewardFn | None = None,
    prompts=None,
    teacher=None,
    on_step=None,
) -> Trained:
    """The PPO stage: check every input, build the models and the trainer, run the loop, save.

    policy, tokenizer: a loaded causal LM (trained in place) and its tokenizer, in place of
    model_name_or_path; reward_model: a `RewardModel` or a list of them, in place of reward_model_path;
    reward_fn: a `RewardFn` in place of importing cfg.reward_fn; prompts: `data.InMemory` rows in place of
    prompt_file; teacher: a causal LM with the policy's vocabulary in place of teacher_model_path (on-policy
    distillation); on_step: called on the main process with each step's metrics (the line of metrics.jsonl).
    Returns the policy's LM, its tokenizer, its value head (None for the critic-free estimators or a
    separate critic) and the final metrics (metrics.json's): the last step's policy, or with keep_best the
    best held-out evaluation's (metrics.json's returned_step; the module docstring)."""
    accelerator, out = Accelerator(), Path(cfg.output_dir)
    inputs = check_inputs(
        cfg,
        policy=policy,
        tokenizer=tokenizer,
        reward_model=reward_model,
        reward_fn=reward_fn,
        prompts=prompts,
    )
    resume_from = resume_point(cfg, out, accelerator)
    trainer = build_trainer(
        cfg,
        accelerator,
        inputs.tokenizer,
        inputs.prompts,
        inputs.reward_fn,
        policy=policy,
        reward_model=reward_model,
        verifier=inputs.verifier,
        teacher=teacher,
    )
    start(cfg, trainer, inputs, out, resume_from)
    heldout = HeldOut(cfg, trainer, inputs, out, resumed=resume_from is not None)
    history = loop(cfg, trainer, heldout, out, resumed=resume_from is not None, on_step=on_step)
    final = {
        **summarize_history(history, cfg),
        **heldout.watch["summary"],
        ppo_metrics.RETURNED_STEP: trainer.step,
    }
    if cfg.keep_best and heldout.watch["summary"][ppo_metrics.BEST_STEP] is not None:
        final[ppo_metrics.RETURNED_STEP] = return_best(trainer, cfg, out)
    save_final(trainer, cfg, out, final)
    policy = trainer.unwrapped_policy
    return Trained(model=policy.lm, tokenizer=inputs.tokenizer, metrics=final, value_head=policy.value_head)


def start(cfg: Config, trainer: PPOTrainer, inputs: RunInputs, out: Path, resume_from: Path | None) -> None:
    """Step 3: the policy checked to hold the longest prompt + max_new_tokens; the config, batch sizes and
    notes printed and config.yaml saved (main process); a resumed run's checkpoint loaded and its logs cut
    back to its step."""
    accelerator, tokenizer = trainer.accelerator, inputs.tokenizer
    longest = max(
        [len(q) for q in inputs.prompts] + [len(encode_prompt(tokenizer, p)) for p in inputs.eval_prompts]
    )
    check_positions(trainer.unwrapped_policy.lm, longest, cfg.max_new_tokens, "the policy")
    if accelerator.is_main_process:
        print(format_config(cfg))
        print("batch sizes:", dataclasses.asdict(trainer.sizes))
        print(f"precision: {cfg.precision}", flush=True)
        for note in cfg.notes:  # allowed choices that depart from the papers (`Config.notes`)
            print(f"note: {note}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out)
    if resume_from is not None:
        load_checkpoint(trainer, resume_from)
        if accelerator.is_main_process:
            print(f"resumed from {resume_from} at step {trainer.step}")
            for log in ("metrics.jsonl", "eval_log.jsonl", "eval_samples.jsonl"):
                truncate_log(out / log, trainer.step)


def loop(
    cfg: Config, trainer: PPOTrainer, heldout: HeldOut, out: Path, *, resumed: bool, on_step
) -> list[dict]:
    """Step 4, the loop: (held-out evaluation first, unless resumed) -> until `steps` or the alarm stops it:
    ppo_step, its line of metrics.jsonl (and tensorboard/wandb, on_step), samples every log_samples_every,
    held-out evaluation every eval_every, a checkpoint every save_steps. Returns every step's metrics (a
    resumed run's earlier ones first)."""
    accelerator = trainer.accelerator
    log_metrics, close_writer = make_writer(cfg, out) if accelerator.is_main_process else (None, None)
    history = read_jsonl(out / "metrics.jsonl") if resumed else []
    try:
        if not resumed:
            heldout.maybe_evaluate()
        bar = tqdm(total=cfg.steps, initial=trainer.step, desc="ppo", disable=not accelerator.is_main_process)
        while trainer.step < cfg.steps and not heldout.watch["stop"]:
            metrics = trainer.ppo_step()
            history.append(metrics)
            if accelerator.is_main_process:
                append_jsonl(out / "metrics.jsonl", metrics)
                if log_metrics is not None:
                    log_metrics(metrics)
                if on_step is not None:
                    on_step(dict(metrics))
                bar.set_postfix(
                    score=f"{metrics['objective/scores']:.2f}",
                    kl=f"{metrics['objective/kl']:.2f}",
                    beta=f"{metrics['objective/kl_coef']:.3f}",
                )
                bar.update(1)
            if cfg.log_samples_every and (trainer.step % cfg.log_samples_every == 0 or trainer.step == 1):
                log_samples(trainer, out)  # on every process, like evaluation; the main one writes
            if heldout.maybe_evaluate()["stop"]:
                break  # stop_on_alarm: no checkpoint after the alarm, the policy of this step is saved below
            if cfg.save_steps and trainer.step % cfg.save_steps == 0 and trainer.step < cfg.steps:
                save_checkpoint(trainer, out / "checkpoints" / f"step-{trainer.step}")
        bar.close()
    finally:
        if close_writer is not None:
            close_writer()  # writes the last steps' events, also when a step failed
    return history


def summarize_history(history: list[dict], cfg: Config) -> dict[str, float]:
    last = dict(history[-1])
    first = history[0]
    last.update(
        {
            ppo_metrics.SCORES_FIRST: first[ppo_metrics.OBJECTIVE_SCORES],
            ppo_metrics.SCORES_STD_FIRST: first[ppo_metrics.OBJECTIVE_SCORES_STD],
            ppo_metrics.SCORES_LAST: last[ppo_metrics.OBJECTIVE_SCORES],
            ppo_metrics.KL_LAST: last[ppo_metrics.OBJECTIVE_KL],
            ppo_metrics.KL_TARGET: cfg.kl_target,
            ppo_metrics.TIME_PER_STEP_S: float(np.mean([h[ppo_metrics.TIME_STEP] for h in history])),
        }
    )
    return last


def log_samples(trainer: PPOTrainer, out: Path) -> None:
    """Decode and score fresh samples of the first few prompts (the training rollout is not kept). Every
    process samples (a collective with sharded parameters); the main process writes."""
    tok, cfg = trainer.tokenizer, trainer.cfg
    queries = trainer.collector.prompts[: cfg.num_log_samples]
    state = torch.get_rng_state()
    samples = trainer.collector.generate(queries)
    scores = trainer.collector.score(samples).scores  # (B,)
    torch.set_rng_state(state)  # logging must not change the training run's random stream
    if not trainer.accelerator.is_main_process:
        return
    for i in range(len(queries)):
        q = tok.decode(samples.query[i][samples.query_mask[i].bool()])
        r = tok.decode(samples.response[i][samples.response_mask[i]], skip_special_tokens=True)
        append_jsonl(
            out / "samples.jsonl",
            {
                ppo_metrics.STEP: trainer.step,
                ppo_metrics.SAMPLE_QUERY: q,
                ppo_metrics.SAMPLE_RESPONSE: r,
                ppo_metrics.SAMPLE_SCORE: float(scores[i]),
            },
        )
        tqdm.write(f"[step {trainer.step}] {q!r} -> {r!r} (score {float(scores[i]):+.2f})")


def make_writer(cfg: Config, out: Path):
    """`report_to`'s logger as (log(metrics), close()); (None, None) for none. close() writes what is still
    buffered: nothing else does in a data-parallel run, whose processes end without the interpreter's exit
    handlers (`utils.exit_process`)."""
    if cfg.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter  # optional dependency (the tensorboard extra)

        tb = SummaryWriter(str(out / "tensorboard"))

        def log(m: dict) -> None:
            for k, v in m.items():
                if isinstance(v, (int, float)) and k != ppo_metrics.STEP:
                    tb.add_scalar(k, v, m[ppo_metrics.STEP])

        return log, tb.close
    if cfg.report_to == "wandb":
        import wandb  # optional dependency (the wandb extra)

        run = wandb.init(project="llm_rlhf", config=dataclasses.asdict(cfg), dir=str(out))
        return (lambda m: run.log(m, step=m[ppo_metrics.STEP])), run.finish
    if cfg.report_to == "trackio":
        import trackio  # optional dependency (the trackio extra): local-first, $TRACKIO_DIR

        run = trackio.init(project=TRACKIO_PROJECT, name=str(cfg.output_dir), config=dataclasses.asdict(cfg))

        def log(m: dict) -> None:
            numbers = {k: v for k, v in m.items() if isinstance(v, (int, float)) and k != ppo_metrics.STEP}
            run.log(numbers, step=m[ppo_metrics.STEP])

        return log, run.finish
    return None, None
