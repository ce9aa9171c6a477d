"""`llm-rlhf ppo`: the PPO stage as a command around `llm_rlhf.stages.ppo.PPOTrainer`.

    build the models (policy + value head (gae), frozen reference, frozen RM, optional critic) and the trainer
    -> evaluate on held-out prompts -> loop: ppo_step, log (metrics.jsonl, samples, tensorboard/wandb),
       evaluate every eval_every steps (and read the reward-hacking alarm), checkpoint every save_steps
    -> save the policy (HF folder) and its value head or critic (none for the critic-free estimators), then
       metrics.json (last: the stage is done)

A checkpoint holds everything needed to continue exactly (`--resume true`): trainable weights, optimiser,
scheduler, the step (which fixes the data position), the KL controller and every process's RNG state.

The reward-hacking alarm (issue 40, `hacking.watch_fields`) is read after every held-out evaluation and logged
on its line of eval_log.jsonl (alarm_step, alarm_rules, alarm_reasons, best_step). What the run returns:
the last step's policy; with stop_on_alarm, the policy of the evaluation where the alarm fired (the loop stops
there); with keep_best, the policy of the held-out evaluation with the best gold (or accuracy), checkpointed
in output_dir/best when it was evaluated (`save_checkpoint`; resume ignores the folder), loaded back at the
end and saved as the final model, the last step's policy going to output_dir/last. metrics.json says which:
alarm_step, alarm_rules, alarm_reasons, stopped_on_alarm, best_step, returned_step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from tqdm.auto import tqdm

from llm_rlhf.core.config import format_config, is_off, save_config
from llm_rlhf.core.data import load_prompt_dataset, prompt_rules
from llm_rlhf.core.errors import UserError
from llm_rlhf.core.utils import (
    append_jsonl,
    atomic_write_json,
    publish_files,
    replace_dir,
    seed_everything,
    temp_dir_beside,
)
from llm_rlhf.models.accelerated import loading_whole_models
from llm_rlhf.models.loading import (
    PolicyWithValue,
    Reference,
    Trained,
    ValueHead,
    check_not_adapter_only,
    check_positions,
    freeze,
    load_causal_lm,
    tokenizer_or_load,
    use_fused_gelu,
)
from llm_rlhf.models.reward_fn import RewardFn, decode_texts, load_reward_fn, probe
from llm_rlhf.models.reward_model import (
    check_members_exist,
    load_reward_model,
    member_paths,
    save_reward_model,
)
from llm_rlhf.models.scoring import scoring_reward_model
from llm_rlhf.rl.episodes import EPISODE_ROW_KEYS, EpisodePlay
from llm_rlhf.rl.hacking import heldout_sample_rows, watch_fields
from llm_rlhf.rl.rollout import encode_prompt, left_pad
from llm_rlhf.stages import eval_metrics, ppo_metrics
from llm_rlhf.stages.measures import (
    KLReference,
    Measures,
    PairedSampling,
    evaluate_policy,
    heldout_record,
    load_heldout_inputs,
    load_verifier,
)
from llm_rlhf.stages.ppo import PPOModels, PPOTrainer
from llm_rlhf.stages.ppo_config import Config  # the keys of `llm-rlhf ppo`
from llm_rlhf.stages.ppo_rollouts import EpisodeRoom
from llm_rlhf.tasks.environments import environment_factory

# ---------------------------------------------------------------------------------------------
# Building the models and running the stage
# ---------------------------------------------------------------------------------------------


def load_prompts(cfg: Config, tokenizer, prompts=None) -> list[list[int]]:
    """The training prompts as token ids: prompt_file's, or `prompts` (`data.InMemory` rows) in its place."""
    ds = load_prompt_dataset(prompts or cfg.prompt_file, tokenizer, **prompt_rules(cfg))
    return [encode_prompt(tokenizer, p) for p in ds["prompt"]]  # with BOS where the tokenizer adds one


def build_models(cfg: Config, *, policy=None, reward_model=None) -> PPOModels:
    """policy (+ value head with gae, unless a separate critic), reference, reward model (a `RewardEnsemble` when
    reward_model_path is a list, its members loaded once; None when reward_model_path is none) and optional
    critic (from the first member of an ensemble).

    policy: a loaded causal LM in place of model_name_or_path (trained in place; the reference is a frozen
    copy of it as it is now); reward_model: a `RewardModel` or a list of them (an ensemble combined with the
    config's ensemble keys) in place of reward_model_path (the Python API)."""
    if policy is None:
        policy = load_causal_lm(
            cfg.model_name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code
        )
    lm = use_fused_gelu(policy)
    if cfg.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    if cfg.use_lora:
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
        ref_lm = freeze(copy.deepcopy(lm))  # the policy before any update: the same weights, its own memory
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
    # With a separate critic the policy has no value head: every trainable parameter takes part in the loss.
    # The critic-free estimators (`Estimator.critic` false) have neither: no value function is built, trained,
    # checkpointed or saved.
    with_head = cfg.value_model == "policy" and cfg.estimator.critic
    value_head = ValueHead(hidden).to(next(lm.parameters()).dtype) if with_head else None
    policy = PolicyWithValue(lm, value_head)
    # the one loading of a config's reward model (`scoring.scoring_reward_model`, as eval and compare load it);
    # None with reward_model_path none: the score is the reward_fn's alone
    reward_model = scoring_reward_model(cfg, reward_model, fused_gelu=True)
    critic = None
    if cfg.value_model == "reward":
        critic = use_fused_gelu(
            load_reward_model(
                member_paths(cfg.reward_model_path)[0],
                dtype=cfg.dtype,
                trust_remote_code=cfg.trust_remote_code,
            )
        ).as_critic()
    return PPOModels(policy, ref_model, reward_model=reward_model, critic=critic)


def build_trainer(
    cfg: Config,
    accelerator,
    tokenizer,
    prompts: list[list[int]],
    reward_fn: RewardFn | None = None,
    *,
    policy=None,
    reward_model=None,
    verifier: RewardFn | None = None,
) -> PPOTrainer:
    """The models and the trainer. reward_fn: `cfg.reward_fn` already loaded (`train` loads and probes it
    first), else loaded here; policy, reward_model: objects in place of the config's folders (`build_models`);
    verifier: `cfg.accuracy_fn` loaded, else loaded here where dynamic sampling ties groups on its verdicts."""
    if cfg.reward_fn is not None and reward_fn is None:
        reward_fn = load_reward_fn(cfg.reward_fn)
    if (
        (cfg.dynamic_sampling or cfg.environment is not None)
        and cfg.accuracy_fn is not None
        and verifier is None
    ):
        verifier = load_reward_fn(cfg.accuracy_fn, key="accuracy_fn", binary=True)
    make_environment = None  # episodes of several turns (issue 51): one fresh environment per episode
    if cfg.environment is not None:
        make_environment = environment_factory(cfg.environment, verifier=verifier)
    seed_everything(cfg.seed, accelerator.process_index)
    with loading_whole_models(accelerator):  # not partitioned at load under ZeRO-3 (issue 39)
        models = build_models(cfg, policy=policy, reward_model=reward_model)
    if models.reward_model is not None:
        models.reward_model.to(accelerator.device)
    if not cfg.use_lora:
        models.ref_model.to(accelerator.device)
    return PPOTrainer(
        cfg,
        accelerator=accelerator,
        models=models,
        tokenizer=tokenizer,
        prompts=prompts,
        reward_fn=reward_fn,
        verifier=verifier if cfg.dynamic_sampling else None,
        make_environment=make_environment,
    )


def last_checkpoint(output_dir: Path) -> Path | None:
    ckpts = sorted((output_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def run(cfg: Config) -> dict[str, float]:
    """`llm-rlhf ppo`: `train` from the config's paths; returns the final metrics."""
    return train(cfg).metrics


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """Everything a run reads besides the models, checked before anything is written: the tokenizer, the
    training prompts (ids), the reward function (probed), the held-out prompts and gold judge, the verifier."""

    tokenizer: object
    prompts: list[list[int]]
    reward_fn: RewardFn | None
    eval_prompts: list[str]
    judge: object
    verifier: RewardFn | None


def train(
    cfg: Config,
    *,
    policy=None,
    tokenizer=None,
    reward_model=None,
    reward_fn: RewardFn | None = None,
    prompts=None,
    on_step=None,
) -> Trained:
    """The PPO stage: check every input, build the models and the trainer, run the loop, save.

    policy, tokenizer: a loaded causal LM (trained in place) and its tokenizer, in place of
    model_name_or_path; reward_model: a `RewardModel` or a list of them, in place of reward_model_path;
    reward_fn: a `RewardFn` in place of importing cfg.reward_fn; prompts: `data.InMemory` rows in place of
    prompt_file; on_step: called on the main process with each step's metrics (the line of metrics.jsonl).
    Returns the policy's LM, its tokenizer, its value head (None for the critic-free estimators or a
    separate critic) and the final metrics (metrics.json's): the last step's policy, or with keep_best the
    best held-out evaluation's (metrics.json's returned_step; the module docstring)."""
    accelerator, out = Accelerator(), Path(cfg.output_dir)
    inputs = check_inputs(cfg, policy=policy, tokenizer=tokenizer, reward_model=reward_model,
                          reward_fn=reward_fn, prompts=prompts)  # fmt: skip
    resume_from = resume_point(cfg, out, accelerator)
    trainer = build_trainer(cfg, accelerator, inputs.tokenizer, inputs.prompts, inputs.reward_fn,
                            policy=policy, reward_model=reward_model, verifier=inputs.verifier)  # fmt: skip
    start(cfg, trainer, inputs, out, resume_from)
    heldout = HeldOut(cfg, trainer, inputs, out, resumed=resume_from is not None)
    history = loop(cfg, trainer, heldout, out, resumed=resume_from is not None, on_step=on_step)
    final = {**summarize(history, cfg), **heldout.watch["summary"], ppo_metrics.RETURNED_STEP: trainer.step}
    if cfg.keep_best and heldout.watch["summary"][ppo_metrics.BEST_STEP] is not None:
        final[ppo_metrics.RETURNED_STEP] = return_best(trainer, cfg, out)
    save_final(trainer, cfg, out, final)
    policy = trainer.unwrapped_policy
    return Trained(model=policy.lm, tokenizer=inputs.tokenizer, metrics=final, value_head=policy.value_head)


def check_inputs(cfg: Config, *, policy, tokenizer, reward_model, reward_fn, prompts) -> RunInputs:
    """Step 1: the tokenizer, the prompts (validated row by row), the reward function and the verifier (each
    called once on real prompts: a broken one stops the run here), the held-out inputs, the RM folders."""
    if policy is None:
        check_not_adapter_only(cfg.model_name_or_path)
    tokenizer = tokenizer_or_load(cfg, tokenizer, policy, padding_side="left")
    prompts = load_prompts(cfg, tokenizer, prompts)
    reward_fn = load_and_probe_reward_fn(cfg, tokenizer, prompts, reward_fn)
    eval_prompts, judge = load_heldout_inputs(cfg, tokenizer)
    verifier = load_and_probe_verifier(cfg, tokenizer, prompts, eval_prompts)
    if reward_model is None and not is_off(cfg.reward_model_path):
        check_members_exist(cfg.reward_model_path)
    return RunInputs(tokenizer, prompts, reward_fn, eval_prompts, judge, verifier)


def resume_point(cfg: Config, out: Path, accelerator) -> Path | None:
    """The checkpoint to resume from (resume: the last in output_dir/checkpoints, None when there is none);
    without resume, an output_dir that already holds a run is refused."""
    resume_from = last_checkpoint(out) if cfg.resume else None
    if cfg.resume and resume_from is None and accelerator.is_main_process:
        print(f"resume: no checkpoint in {out / 'checkpoints'}; starting from scratch")
    if not cfg.resume and (out / "metrics.jsonl").exists():
        raise UserError(
            f"output_dir '{out}' already holds a PPO run; pass --resume true or choose another output_dir"
        )
    return resume_from


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
                bar.set_postfix(score=f"{metrics['objective/scores']:.2f}", kl=f"{metrics['objective/kl']:.2f}",
                                beta=f"{metrics['objective/kl_coef']:.3f}")  # fmt: skip
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


class HeldOut:
    """The run's held-out evaluations: `log`, the records so far, oldest first (the main process's: it
    decides for every process), and `watch`, what the last decision says (`decide`: stop, save_best, the
    summary for metrics.json); a resumed run starts from its eval_log.jsonl."""

    def __init__(self, cfg: Config, trainer: PPOTrainer, inputs: RunInputs, out: Path, *, resumed: bool):
        self.cfg, self.trainer, self.inputs, self.out = cfg, trainer, inputs, out
        main = trainer.accelerator.is_main_process
        self.log = read_jsonl(out / "eval_log.jsonl") if resumed and main else []
        self.watch = decide(cfg, self.log, trainer.accelerator, step=None)  # what a resumed log already says

    def maybe_evaluate(self) -> dict:
        """At every eval_every-th step: every process evaluates (the same prompts and seed) and the main one
        writes: with sharded parameters (ZeRO-3, FSDP) each forward is a collective that every process must
        enter (issue 13). The main process reads the alarm and decides; every process saves the best
        checkpoint and stops alike (saving is a collective under FSDP2 and ZeRO-3). Returns `watch`."""
        cfg, trainer, inputs, accelerator = self.cfg, self.trainer, self.inputs, self.trainer.accelerator
        if inputs.eval_prompts and trainer.step % cfg.eval_every == 0:
            record, rows = evaluate_heldout(trainer, inputs.eval_prompts, inputs.judge, inputs.verifier)
            if accelerator.is_main_process:
                self.log.append(record)
                record.update(watch_fields(self.log, reward_fn_weight=cfg.reward_fn_weight))
            self.watch = decide(cfg, self.log, accelerator, step=trainer.step)
            if self.watch[
                "save_best"
            ]:  # before the line that names it: a logged best_step has its checkpoint
                save_checkpoint(trainer, self.out / "best")
            if accelerator.is_main_process:
                self.write(record, rows)
        accelerator.wait_for_everyone()
        return self.watch

    def write(self, record: dict, rows: list[dict]) -> None:
        """The evaluation's line of eval_log.jsonl, its samples' lines of eval_samples.jsonl (the report's
        reward-hacking watch ranks their proxy-gold gaps) and its line on the console."""
        step, verifier = self.trainer.step, self.inputs.verifier
        append_jsonl(self.out / "eval_log.jsonl", record)
        for row in rows:
            append_jsonl(self.out / "eval_samples.jsonl", row)
        tqdm.write(
            f"[eval step {step}] kl {record['kl']:.2f}  rm {signed(record['rm_score'])}  "
            f"gold {signed(record['gold_score'])}"
            + (f"  reward_fn {signed(record['reward_fn'])}" if self.cfg.reward_fn is not None else "")
            + (
                f"  accuracy {record['accuracy']:.3f} (greedy {record['accuracy_greedy']:.3f})"
                if verifier is not None
                else ""
            )
        )
        if record[eval_metrics.LOG_ALARM_STEP] == step:
            tqdm.write(
                f"[eval step {step}] reward-hacking alarm: "
                + "; ".join(record[eval_metrics.LOG_ALARM_REASONS])
            )


def decide(cfg: Config, heldout_log: list[dict], accelerator, *, step: int | None) -> dict:
    """What the run does after a held-out evaluation at `step` (None: before any, on resume), decided on the
    main process from its held-out log (`hacking.watch_fields` of its lines) and broadcast, so that every
    process enters the same collectives: {"stop": stop_on_alarm and the alarm has fired, "save_best": keep_best
    and this evaluation is the best so far, "summary": metrics.json's alarm_step, alarm_rules, alarm_reasons,
    best_step and stopped_on_alarm}."""
    decision = [None]
    if accelerator.is_main_process:
        fields = watch_fields(heldout_log, reward_fn_weight=cfg.reward_fn_weight)
        stop = cfg.stop_on_alarm and fields[eval_metrics.LOG_ALARM_STEP] is not None
        decision = [
            {
                "stop": stop,
                "save_best": cfg.keep_best
                and step is not None
                and fields[eval_metrics.LOG_BEST_STEP] == step,
                "summary": {
                    ppo_metrics.ALARM_STEP: fields[eval_metrics.LOG_ALARM_STEP],
                    ppo_metrics.ALARM_RULES: fields[eval_metrics.LOG_ALARM_RULES],
                    ppo_metrics.ALARM_REASONS: fields[eval_metrics.LOG_ALARM_REASONS],
                    ppo_metrics.BEST_STEP: fields[eval_metrics.LOG_BEST_STEP],
                    ppo_metrics.STOPPED_ON_ALARM: stop,
                },
            }
        ]
    if accelerator.num_processes > 1:
        broadcast_object_list(decision)
    return decision[0]


def return_best(trainer: PPOTrainer, cfg: Config, out: Path) -> int:
    """keep_best at the end of the run: the last step's policy saved to output_dir/last (`save_policy`), then
    the best held-out evaluation's weights loaded back from output_dir/best (every process); returns their
    step (the checkpoint's own record of it)."""
    best = out / "best"
    if not (best / "step.json").is_file():
        raise UserError(
            f"keep_best: no best checkpoint in {best} (it is written at each new best evaluation)"
        )
    save_policy(trainer, cfg, out / "last", merge_copies=True)
    trainer.load_model_state(best)
    return json.loads((best / "step.json").read_text())["step"]


def read_jsonl(path: Path) -> list[dict]:
    """A JSONL log's lines (none when the file is absent)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def load_and_probe_reward_fn(
    cfg: Config, tokenizer, prompts: list[list[int]], reward_fn: RewardFn | None = None
) -> RewardFn | None:
    """`cfg.reward_fn` imported and called once (`reward_fn.probe`) on the first two training prompts, as
    text as training decodes them (`reward_fn.decode_texts`), with dummy responses: before any model is
    loaded or any output written. Every process probes on the same inputs, so a deterministic function
    fails on all of them alike. None without a reward_fn."""
    if reward_fn is None and cfg.reward_fn is None:
        return None
    reward_fn = reward_fn or load_reward_fn(cfg.reward_fn)
    probe(reward_fn, prompt_texts(tokenizer, prompts[:2]))
    return reward_fn


def load_and_probe_verifier(
    cfg: Config, tokenizer, prompts: list[list[int]], eval_prompts: list[str]
) -> RewardFn | None:
    """`cfg.accuracy_fn` loaded and probed before any model, as the reward_fn (`measures.load_verifier`),
    where something reads it: held-out evaluation's accuracy (probed on the held-out prompts) or dynamic
    sampling, which ties groups on its verdicts (probed on the first two training prompts). Else None."""
    if cfg.accuracy_fn is None or not (eval_prompts or cfg.dynamic_sampling):
        return None
    return load_verifier(cfg.accuracy_fn, eval_prompts or prompt_texts(tokenizer, prompts[:2]))


def prompt_texts(tokenizer, prompts: list[list[int]]) -> list[str]:
    """Prompts (token ids) as text, as training decodes them for a reward function (`reward_fn.decode_texts`)."""
    query, query_mask = left_pad(prompts, tokenizer.pad_token_id)  # (n, P) each
    no_response = torch.zeros((query.shape[0], 0), dtype=torch.bool)  # (n, 0)
    return decode_texts(tokenizer, query, query_mask, no_response.long(), no_response)[0]


def signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def truncate_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint we resume from (they will be written again)."""
    if path.exists():
        lines = [
            ln for ln in path.read_text().splitlines() if ln and json.loads(ln)[ppo_metrics.STEP] <= step
        ]
        path.write_text("".join(ln + "\n" for ln in lines))


def summarize(history: list[dict], cfg: Config) -> dict[str, float]:
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
    queries = trainer.room.prompts[: cfg.num_log_samples]
    state = torch.get_rng_state()
    samples = trainer.room.generate(queries)
    scores = trainer.room.score(samples).scores  # (B,)
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
    return None, None


def save_final(trainer: PPOTrainer, cfg: Config, out: Path, final: dict) -> None:
    """The policy (`save_policy`), then metrics.json (last)."""
    save_policy(trainer, cfg, out)
    if trainer.accelerator.is_main_process:
        write_final_metrics(out, final)
    trainer.accelerator.wait_for_everyone()


def save_policy(trainer: PPOTrainer, cfg: Config, out: Path, *, merge_copies: bool = False) -> None:
    """The policy as a plain HF causal-LM folder in `out`, the value head beside it (or the separate critic as
    an RM folder in critic/). Every process calls it. merge_copies: with LoRA, merge the adapters into copies
    of the models (merging unloads them in place): the trainer's models keep theirs, for keep_best to load the
    best checkpoint into after saving the last policy."""
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    if accelerator.is_fsdp2 or (trainer.acc.zero3 and not cfg.use_lora):
        save_policy_gathered(trainer, out)
        return
    policy = trainer.unwrapped_policy
    if trainer.acc.zero3:  # LoRA: the partitions gathered into a whole copy (every process enters the gather)
        policy, merge_copies = whole_lora_policy(trainer), False  # the copy is this function's to merge
    if not accelerator.is_main_process:
        return
    tmp = temp_dir_beside(out / "final")
    lm = policy.lm
    if cfg.use_lora:
        lm.save_pretrained(tmp / "adapter")
        trainer.tokenizer.save_pretrained(tmp / "adapter")
        if cfg.merge_lora:
            lm = (copy.deepcopy(lm) if merge_copies else lm).merge_and_unload()
    if not cfg.use_lora or cfg.merge_lora:
        lm.save_pretrained(tmp, safe_serialization=True)
    trainer.tokenizer.save_pretrained(tmp)
    if policy.value_head is not None:
        save_file(
            {k: v.contiguous() for k, v in policy.value_head.state_dict().items()},
            tmp / "value_head.safetensors",
        )
    if trainer.critic is not None:  # the trained critic, an RM folder (`load_reward_model` reads it)
        critic = trainer.accelerator.unwrap_model(trainer.critic).reward_model
        critic = copy.deepcopy(critic) if merge_copies and cfg.use_lora else critic
        save_reward_model(critic, tmp / "critic", merge_lora=True)
    publish_files(tmp, out)


def write_final_metrics(out: Path, final: dict) -> None:
    atomic_write_json(
        out / "metrics.json", {k: v for k, v in final.items() if not (isinstance(v, float) and math.isnan(v))}
    )
    print(
        json.dumps(
            {
                k: final[k]
                for k in (
                    ppo_metrics.SCORES_FIRST,
                    ppo_metrics.SCORES_LAST,
                    ppo_metrics.SCORES_STD_FIRST,
                    ppo_metrics.KL_LAST,
                    ppo_metrics.KL_TARGET,
                    ppo_metrics.TIME_PER_STEP_S,
                )
            },
            indent=2,
        )
    )


def save_policy_gathered(trainer: PPOTrainer, out: Path) -> None:
    """FSDP2 and ZeRO-3 (parameters sharded): the full policy state gathered from the shards (a collective:
    every process), then the main process writes the same folder as `save_policy`: one full HF causal-LM
    folder and the value head. (LoRA under ZeRO-3 takes `whole_lora_policy` instead; FSDP2 refuses LoRA, and
    both refuse the separate critic: `Accelerated.prepare`.)"""
    policy = trainer.unwrapped_policy
    if trainer.acc.zero3:
        # DeepSpeed's consolidated 16-bit weights (the config's zero3_save_16bit_model), on rank 0 only
        state = trainer.accelerator.get_state_dict(trainer.policy)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0 only
        state = get_model_state_dict(policy, options=options)
    if trainer.accelerator.is_main_process:
        tmp = temp_dir_beside(out / "final")
        lm_state = {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
        for name in tied_duplicates(policy.lm):  # e.g. GPT-2's lm_head.weight is wte.weight: saved once
            lm_state.pop(name, None)
        policy.lm.save_pretrained(tmp, state_dict=lm_state, safe_serialization=True)
        trainer.tokenizer.save_pretrained(tmp)
        if policy.value_head is not None:
            head = {
                k.removeprefix("value_head."): v.contiguous()
                for k, v in state.items()
                if k.startswith("value_head.")
            }
            save_file(head, tmp / "value_head.safetensors")
        publish_files(tmp, out)
    trainer.accelerator.wait_for_everyone()


def whole_lora_policy(trainer: PPOTrainer) -> PolicyWithValue | None:
    """ZeRO-3 with LoRA: the policy (peft model and value head) with whole weights, for `save_policy` to write
    the folder the unsharded LoRA path writes (adapter/, the merged model with merge_lora). Every process
    calls it: DeepSpeed's consolidated 16-bit state dict is a gather (keep the config's
    zero3_save_16bit_model true); the main process loads it into a copy built outside ZeRO
    (`loading_whole_models`: the base model from its config, the run's LoRA config, a new value head) in the
    engine's dtype; None on the others."""
    state = trainer.accelerator.get_state_dict(trainer.policy)  # whole on the main process, else None
    if not trainer.accelerator.is_main_process:
        return None
    policy = trainer.unwrapped_policy
    base, lora = policy.lm.get_base_model(), copy.deepcopy(policy.lm.peft_config[policy.lm.active_adapter])
    with loading_whole_models(trainer.accelerator):
        lm = get_peft_model(type(base)(base.config), lora)
        head = None if policy.value_head is None else ValueHead(policy.value_head.summary.in_features)
    whole = PolicyWithValue(lm, head).to(next(iter(state.values())).dtype)
    whole.load_state_dict(state)
    lm.generation_config = copy.deepcopy(base.generation_config)
    return whole.eval()


def tied_duplicates(model: torch.nn.Module) -> list[str]:
    """Names of parameters that are another parameter registered again (tied weights), all but the first
    name of each: what `save_pretrained` leaves out of a folder."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [name for group in names.values() for name in group[1:]]


def evaluate_heldout(
    trainer: PPOTrainer, prompts: list[str], judge, verifier: RewardFn | None = None
) -> tuple[dict[str, float], list[dict]]:
    """RM score, gold score, reward_fn score (unweighted; None without a reward_fn) and KL to the reference
    on held-out prompts (`measures.evaluate_policy`, with the run's sampling settings and scorer; fixed seed:
    every evaluation of the run samples with the same random numbers, in a fork of the RNG), as a line of
    eval_log.jsonl (`measures.heldout_record`; with a reward-model ensemble also each member's score and their
    disagreement, and the degeneracy rates; with a verifier, the loaded accuracy_fn, the accuracy of these
    samples and of one greedy response per prompt, which draws no random number), and the samples' rows for
    eval_samples.jsonl (`hacking.heldout_sample_rows`: the report's reward-hacking watch)."""
    samples: list[dict] = []
    policy = trainer.unwrapped_policy
    lm, cfg = policy.lm, trainer.cfg
    reference = KLReference(lm, lm.disable_adapter) if cfg.use_lora else KLReference(trainer.ref_model.lm)
    room = trainer.room  # with an environment its episodes are played as in training (issue 51)
    play = EpisodePlay(room.make_environment, room.limits) if isinstance(room, EpisodeRoom) else None
    draws = PairedSampling(trainer.sampling, seed=cfg.seed, batch_size=cfg.heldout_batch_size, play=play)
    with trainer.acc.autocast(), trainer.acc.gathered_for_generation(policy):
        measures = Measures(scorer=trainer.room.scorer, judge=judge, verifier=verifier)
        result = evaluate_policy(
            lm, trainer.tokenizer, prompts, draws, measures=measures, reference=reference, samples_out=samples
        )
    rows = heldout_sample_rows(samples, step=trainer.step, reward_fn_weight=cfg.reward_fn_weight)
    for row, record in zip(rows, samples):  # episodes: their turns, for the report (issue 51)
        row.update({key: record[key] for key in EPISODE_ROW_KEYS if key in record})
    return heldout_record(trainer.step, result), rows


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def save_checkpoint(trainer: PPOTrainer, folder: Path) -> None:
    """Atomically write everything needed to continue exactly: the weights and optimiser state
    (`PPOTrainer.save_model_state`: trainable weights on one process or DDP, every process's shards under
    FSDP2 and DeepSpeed), the trainer's state (`PPOTrainer.state_dict`: the step, which fixes the data
    position, the KL controller and the LR schedule) and every process's RNG state. Every process calls it;
    the folder appears whole (renamed at the end)."""
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    rng_all = (
        accelerator.gather_for_metrics([rng_state()], use_gather_object=True)
        if accelerator.num_processes > 1
        else [rng_state()]
    )
    tmp = folder.with_name(f".{folder.name}.tmp")  # the same path on every process
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    trainer.save_model_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save({**trainer.state_dict(), "rng": rng_all}, tmp / "trainer_state.pt")
        (tmp / "step.json").write_text(json.dumps({"step": trainer.step}))
        replace_dir(tmp, folder)
    accelerator.wait_for_everyone()


def load_checkpoint(trainer: PPOTrainer, folder: Path) -> None:
    """What `save_checkpoint` wrote: the weights and optimiser state, the trainer's state and this process's
    RNG state. A checkpoint written before issue 23 kept the LR schedule beside the optimiser state
    (`optimizer.pt`, or `scheduler.pt` when sharded): it is read from there."""
    trainer.load_model_state(folder)
    state = torch.load(folder / "trainer_state.pt", weights_only=True, map_location="cpu")
    if "scheduler" not in state:
        old = folder / ("scheduler.pt" if (folder / "scheduler.pt").is_file() else "optimizer.pt")
        state["scheduler"] = torch.load(old, weights_only=True, map_location="cpu")["scheduler"]
    trainer.load_state_dict(state)
    set_rng_state(state["rng"][trainer.accelerator.process_index])


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
