"""PPO's held-out evaluations during a run: the policy sampled on held-out prompts every eval_every steps and
measured (`evaluation.measures.evaluate_policy`), the reward-hacking alarm read after each one
(`evaluation.hacking.watch_fields`), and keep_best's choice of the policy to return."""

from __future__ import annotations

import json
from pathlib import Path

from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from llm_rlhf.core.errors import UserError
from llm_rlhf.core.utils import (
    append_jsonl,
)
from llm_rlhf.evaluation import metric_names
from llm_rlhf.evaluation.hacking import heldout_sample_rows, watch_fields
from llm_rlhf.evaluation.measures import (
    KLReference,
    Measures,
    PairedSampling,
    evaluate_policy,
    heldout_record,
)
from llm_rlhf.models.reward_fn import RewardFn
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.ppo.building import (
    RunInputs,
)
from llm_rlhf.ppo.checkpoints import (
    read_jsonl,
    save_checkpoint,
    save_policy,
)
from llm_rlhf.ppo.config import Config  # the keys of `llm-rlhf ppo`
from llm_rlhf.ppo.rollouts import EpisodeCollector
from llm_rlhf.ppo.trainer import PPOTrainer
from llm_rlhf.rl.episodes import EPISODE_ROW_KEYS, EpisodePlay


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
        enter. The main process reads the alarm and decides; every process saves the best
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
            + "".join(
                f"  pass@{k} {record[metric_names.pass_at_keys(k)[0]]:.3f}" for k in self.cfg.eval_pass_at_k
            )
        )
        if record[metric_names.LOG_ALARM_STEP] == step:
            tqdm.write(
                f"[eval step {step}] reward-hacking alarm: "
                + "; ".join(record[metric_names.LOG_ALARM_REASONS])
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
        stop = cfg.stop_on_alarm and fields[metric_names.LOG_ALARM_STEP] is not None
        decision = [
            {
                "stop": stop,
                "save_best": cfg.keep_best
                and step is not None
                and fields[metric_names.LOG_BEST_STEP] == step,
                "summary": {
                    ppo_metrics.ALARM_STEP: fields[metric_names.LOG_ALARM_STEP],
                    ppo_metrics.ALARM_RULES: fields[metric_names.LOG_ALARM_RULES],
                    ppo_metrics.ALARM_REASONS: fields[metric_names.LOG_ALARM_REASONS],
                    ppo_metrics.BEST_STEP: fields[metric_names.LOG_BEST_STEP],
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


def signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


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
    reference = (
        KLReference(lm, lm.disable_adapter, shared_blocks=trainer.trunk_blocks)
        if cfg.use_lora
        else KLReference(trainer.ref_model.lm)
    )
    collector = trainer.collector  # with an environment its episodes are played as in training
    play = (
        EpisodePlay(collector.make_environment, collector.limits)
        if isinstance(collector, EpisodeCollector)
        else None
    )
    draws = PairedSampling(trainer.sampling, seed=cfg.seed, batch_size=cfg.heldout_batch_size, play=play)
    with trainer.accelerated.autocast(), trainer.accelerated.gathered_for_generation(policy):
        measures = Measures(scorer=trainer.collector.scorer, judge=judge, verifier=verifier)
        result = evaluate_policy(
            lm,
            trainer.tokenizer,
            prompts,
            draws,
            measures=measures,
            reference=reference,
            samples_out=samples,
            samples_per_prompt=cfg.eval_samples_per_prompt,
            pass_at=cfg.eval_pass_at_k,
        )
    rows = heldout_sample_rows(samples, step=trainer.step, reward_fn_weight=cfg.reward_fn_weight)
    for row, record in zip(rows, samples):  # episodes of several turns: their turns, for the report
        row.update({key: record[key] for key in EPISODE_ROW_KEYS if key in record})
    return heldout_record(trainer.step, result), rows
