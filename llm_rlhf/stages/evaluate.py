"""`llm-rlhf eval`: compare a policy with a baseline (default: the SFT model) on held-out prompts.

Paired samples: the prompts are cut into the same batches for both models and the generator is seeded
with `seed + batch_index` before each batch's `generate` (inside `torch.random.fork_rng`, so the global
RNG is left alone), so sample j of prompt i of the policy is paired with sample j of prompt i of the
baseline, and two runs with the same seed give the same metrics. When the policy and the baseline are
the same model the samples are identical and both win rates are exactly 0.5.

The command in steps (`_run`): `load_inputs` (judge, reward function, tokenizers, prompts, verifier: every input
checked before any model loads) -> `load_models` (the three models and the scorer, `scoring.build_scorer`) ->
`measure` (both models sampled, scored, judged) -> `eval_figures` -> `write_outputs`.

metrics.json (written last; `_baseline` keys hold the same figures for the baseline's samples):
    gold_score_mean   mean gold-judge score (reviews: the fluency-aware gold of `llm_rlhf.models.gold`, in units
                      of the predicted mean human rating, less the disfluency penalty)
    sentiment_mean    mean sentiment part of that gold (predicted mean human rating of prompt + response)
    fluency_perplexity  exp(mean fluency_nll): the geometric mean over the samples of the per-response
                      perplexity (response + end marker given the prompt) under the gold's independent LM
    rm_score_mean     mean reward-model score (normalised with the RM's stored mean/std, as PPO sees it; with
                      an ensemble, `reward_model_path` a list: the members' scores combined as PPO combines them)
    rm_score_member_<k>_mean, rm_disagreement_mean   with an ensemble only: member k's mean score, and the
                      mean over the samples of the std across the members
    gold_win_rate     fraction of pairs where the policy's sample scores higher than the baseline's
    sentiment_win_rate  (ties count one half), by the gold judge, by its sentiment part alone and by
    rm_win_rate       the reward model
    reward_fn_mean    mean score of the reward function (`--reward_fn module:callable`, unweighted), and
    reward_fn_win_rate  the pairs it prefers, as for the RM
    combined_score_mean  rm_score + reward_fn_weight * reward_fn (rm_score 0 without a reward model): the score
    combined_win_rate   PPO maximises with the same keys; null without a reward_fn
    kl_to_ref         mean over the policy's samples of sum_t log pi(y_t|s_t) - log pi_ref(y_t|s_t) over the
                      response tokens, at temperature 1: the k1 (Monte-Carlo) estimate of the sequence-level
                      KL(pi || pi_ref) when the samples come from pi at temperature 1. Samples drawn at another
                      temperature tau come from pi_tau: `kl_to_ref_at_temperature` is the same sum with both
                      log-probs at tau, the estimate of KL(pi_tau || pi_ref_tau), which is what PPO penalises.
    response_length_mean   response tokens, the EOS included;  eos_rate: fraction of responses that stop
                      (with EOS or a stop string; not truncated at max_new_tokens)
    distinct_1, distinct_2  unique / total token n-grams over all responses (EOS excluded; Li et al. 2016)
    char_run_rate, repeated_ngram_rate, empty_rate   fraction of responses with a run of one repeated
                      character, a repeated word 3-gram, or no text (`llm_rlhf.evaluation.hacking`: signs of reward hacking)
    duplicate_rate, top_bigram_share, shared_bigram_rate, word_distinct_2   the collapse counters of the
                      responses (`hacking.collapse_rates`; a repeat counts only as the response to another prompt)
    alarm_rules, alarm_reasons   the reward-hacking alarm's counter rules, the policy's counters against the
                      baseline's (`hacking.counter_alarms`): the counters past their threshold ([] = quiet) and
                      a line for each (no `_baseline` copy)
    accuracy          with a verifier (`--accuracy_fn module:callable`, e.g. llm_rlhf.tasks.arithmetic:reward: the
                      reward-function interface, every score 1.0 = correct or 0.0 = wrong): its mean over the
                      samples drawn as configured (samples_per_prompt per prompt, temperature, ...)
    accuracy_greedy   its mean over one greedy response per prompt (temperature 0: the argmax at every token, in
                      the same batches, ending at EOS / stop_strings / max_new_tokens, min_new_tokens applied;
                      no random draw, so the same whatever the seed)
    accuracy_stderr, accuracy_greedy_stderr   their standard errors over the PROMPTS: each prompt's samples
                      averaged first, then sd (n - 1) / sqrt(n) over the n prompts (a prompt's samples are not
                      independent draws of the task; `mean_and_stderr_over_prompts`)
    accuracy_fn       the verifier's spec (null: off, and every accuracy key null)
    *_stderr          (the others) standard error of the mean, over the prompts too: each prompt's samples
                      (or win points) averaged first, as for accuracy (the same as over the samples with one
                      sample per prompt)
A null value means "not measured" (gold_judge none, reward_model_path none, reward_fn or accuracy_fn unset, or
a baseline whose tokenizer differs from the reference's for kl_to_ref_baseline).

samples.jsonl: one line per (prompt, sample), prompt-major: prompt, sample, then policy_<key> and
baseline_<key> for response, gold_score, sentiment, fluency_perplexity, rm_score, kl_to_ref, length, eos and
correct (the verifier's 1.0 / 0.0 on that sample; null without accuracy_fn), then policy_greedy_response,
policy_greedy_correct, baseline_greedy_response, baseline_greedy_correct: the prompt's one greedy response
per model and its verdict, the same on each of the prompt's sample lines (null without accuracy_fn); the
first few are printed as a table. Also
config.yaml (the resolved config). Nothing is written before every input (config, judge, prompts,
models) has been loaded and checked.

Your own gold judge: `--gold_judge mypackage.judges:score` (a function) or `mypackage.judges:Judge` (a
class built with no arguments), any callable (prompts: list[str], responses: list[str]) -> list[float]
with higher = better; see `llm_rlhf.models.gold`.

The sampling and the measures are `llm_rlhf.evaluation.measures`'s, which PPO's held-out evaluations (its
`evaluate_policy`, for one already-loaded policy) and `llm-rlhf compare` share. Every score is the one scorer's
(`llm_rlhf.models.scoring.Scorer`), the one PPO adds at the last response token.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import PartialState

from llm_rlhf.core.callables import split_callable_spec
from llm_rlhf.core.config import checked_keywords, format_config, help_field, is_off, require, save_config
from llm_rlhf.core.data import DATA_FORMATS, load_prompt_dataset, prompt_rules
from llm_rlhf.core.errors import UserError
from llm_rlhf.core.utils import atomic_write_json, atomic_write_text, resolve_bf16
from llm_rlhf.evaluation import metric_names
from llm_rlhf.evaluation.hacking import counter_alarms
from llm_rlhf.evaluation.measures import (
    KLReference,
    Measures,
    PairedSampling,
    accuracy_figures,
    greedy_records,
    load_verifier,
    mean_and_stderr_over_prompts,
    sample_and_score,
    summarize_records,
    win_points,
    win_rate,
)
from llm_rlhf.evaluation.sampling_keys import SamplingRunKeys, check_pass_at_k, fill_from_task
from llm_rlhf.models import trunk
from llm_rlhf.models.accelerated import outside_zero_init
from llm_rlhf.models.gold import FluentGoldJudge, GoldJudge, load_judge
from llm_rlhf.models.loading import (
    check_embeddings,
    check_positions,
    freeze,
    load_causal_lm,
    load_tokenizer,
    tokenizer_or_load,
    use_eager_attention,
)
from llm_rlhf.models.reward_fn import RewardFn, load_reward_fn, probe
from llm_rlhf.models.reward_model import RewardEnsemble, check_members_exist
from llm_rlhf.models.scoring import Scorer, build_scorer, check_score_keys
from llm_rlhf.rl.cast_once import frozen_weights_cast_once
from llm_rlhf.rl.episodes import (
    EPISODE_ROW_KEYS,
    EpisodeLimits,
    EpisodePlay,
    check_episode_keys,
    episode_figures,
)
from llm_rlhf.rl.rollout import (
    Sampling,
    check_generation_controls,
    encode_prompt,
)
from llm_rlhf.tasks.environments import check_environment, environment_factory


@checked_keywords
@dataclass
class Config(SamplingRunKeys):
    """`llm-rlhf eval`'s keys: the ones it shares with PPO (`evaluation.sampling_keys`: scoring, prompts,
    sampling, episodes) and evaluation's own below."""

    # --- models
    policy_path: str = help_field("runs/reviews/ppo", "The policy to evaluate (HF folder or hub name).")
    baseline_path: str = help_field(
        "runs/reviews/sft", "The model it is compared with (win rates): by default the SFT model."
    )
    reference_path: str | None = help_field(
        None,
        "The reference pi_ref of kl_to_ref (null = baseline_path); it must share the policy's tokenizer.",
    )
    # --- prompts
    prompt_file: str = help_field(
        "data/reviews/eval_prompts.jsonl",
        "Held-out prompts (JSONL/CSV/Parquet or a hub dataset; a prompt, messages or text column).",
    )
    num_prompts: int | None = help_field(256, "Use the first N prompts of the file (null = all of them).")
    samples_per_prompt: int = help_field(1, "Paired samples per prompt and model.")
    pass_at_k: list[int] = help_field(
        [],
        "With accuracy_fn: the k of each pass@k to report, each model's unbiased estimate from its "
        "samples_per_prompt = n samples of a prompt (Chen et al. 2021: 1 - C(n - c, k) / C(n, k) with c "
        "correct, k <= n) and its standard error over the prompts, as pass_at_<k> and pass_at_<k>_stderr "
        "(_baseline for the baseline). [] = none; e.g. [1, 4] with samples_per_prompt 8.",
    )
    # --- sampling (defaults: the PPO recipe's)
    batch_size: int = help_field(
        32, "Prompts per generate call (the same batches for both models: part of the pairing)."
    )
    seed: int = help_field(0, "Batch b is sampled after torch.manual_seed(seed + b), for both models.")
    bf16: bool | str = help_field(
        False,
        "bf16 autocast for sampling and every forward (the models, the reward model, the gold's LM): true, "
        "false, or auto (on where the hardware computes bf16 natively, as PPO's bf16; logged).",
    )
    # --- output
    output_dir: str = help_field("runs/reviews/eval", "Where metrics.json, samples.jsonl and config.yaml go.")
    print_samples: int = help_field(8, "How many prompt/response pairs to print as a table.")

    def __post_init__(self):
        self.bf16, self.precision = resolve_bf16(self.bf16)
        fill_from_task(self, "eval")
        require(self.data_format in DATA_FORMATS, "data_format", f"must be one of {', '.join(DATA_FORMATS)}")
        check_score_keys(self)  # the reward function's form only: `run` imports it
        check_episode_keys(self)
        if self.accuracy_fn is not None:  # its form only: `run` imports it
            split_callable_spec(self.accuracy_fn, "accuracy_fn")
        if self.environment is not None:  # resolved and checked now, before any stage runs; never built here
            check_environment(self.environment, has_verifier=self.accuracy_fn is not None)
        require(
            self.num_prompts is None or self.num_prompts > 0, "num_prompts", "must be > 0 (or null for all)"
        )
        require(self.samples_per_prompt > 0, "samples_per_prompt", "must be > 0")
        check_pass_at_k(self.pass_at_k, self.samples_per_prompt, self.accuracy_fn, key="pass_at_k")
        require(self.max_new_tokens > 0, "max_new_tokens", "must be > 0")
        require(self.max_prompt_length > 0, "max_prompt_length", "must be > 0")
        require(
            self.temperature > 0,
            "temperature",
            "must be > 0 (sampling; greedy decoding has no pairing to do)",
        )
        require(self.top_k >= 0, "top_k", "must be >= 0 (0 = off)")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.batch_size > 0, "batch_size", "must be > 0")
        require(self.print_samples >= 0, "print_samples", "must be >= 0")
        check_generation_controls(self)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def load_prompt_texts(cfg: Config, tokenizer, prompts=None) -> list[str]:
    """prompt_file's prompts, or `prompts` (`data.InMemory` rows) in its place; the first num_prompts."""
    prompts = list(load_prompt_dataset(prompts or cfg.prompt_file, tokenizer, **prompt_rules(cfg))["prompt"])
    if cfg.num_prompts is not None:
        if cfg.num_prompts > len(prompts):
            raise UserError(
                f"num_prompts={cfg.num_prompts} but '{cfg.prompt_file}' holds {len(prompts)} prompts"
            )
        prompts = prompts[: cfg.num_prompts]
    return prompts


SAMPLE_KEYS = (
    metric_names.RESPONSE,
    metric_names.GOLD_SCORE,
    metric_names.SENTIMENT,
    metric_names.FLUENCY_PERPLEXITY,
    metric_names.RM_SCORE,
    metric_names.RM_MEMBER_SCORES,
    metric_names.REWARD_FN,
    metric_names.COMBINED_SCORE,
    metric_names.KL_TO_REF,
    metric_names.LENGTH,
    metric_names.EOS,
    metric_names.CORRECT,
)

GREEDY_SAMPLE_KEYS = (  # (samples.jsonl field, the greedy record's key)
    (metric_names.GREEDY_RESPONSE, metric_names.RESPONSE),
    (metric_names.GREEDY_CORRECT, metric_names.CORRECT),
)


def sample_row(
    prompt: str,
    sample: int,
    policy: dict[str, Any],
    baseline: dict[str, Any],
    greedy: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None),
) -> dict[str, Any]:
    """One line of samples.jsonl, flat (one column per key in a table): prompt, sample, then
    policy_<key> and baseline_<key> side by side for `SAMPLE_KEYS` (response, gold_score, rm_score, kl_to_ref,
    length, eos, correct, ...; with episodes also `episodes.EPISODE_ROW_KEYS`: turns, num_turns, ...), then
    <who>_greedy_response and <who>_greedy_correct from the (policy,
    baseline) greedy records of the prompt (None without them)."""
    row: dict[str, Any] = {metric_names.PROMPT: prompt, metric_names.SAMPLE: sample}
    for key in SAMPLE_KEYS:
        for who, record in (("policy", policy), ("baseline", baseline)):
            row[metric_names.side(who, key)] = record[key]
    for key in EPISODE_ROW_KEYS:  # episodes of several turns: policy_turns, ... where they were played
        if key in policy:
            for who, record in (("policy", policy), ("baseline", baseline)):
                row[metric_names.side(who, key)] = record[key]
    for who, record in zip(("policy", "baseline"), greedy):
        for field, key in GREEDY_SAMPLE_KEYS:
            row[metric_names.side(who, field)] = record[key] if record is not None else None
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    """Prompt, then the policy's and the baseline's response with their gold and RM scores."""

    def num(x):
        return "  n/a" if x is None else f"{x:+.2f}"

    def verdict(x):
        return "" if x is None else "  correct" if x else "  wrong"

    lines = []
    for row in rows:
        lines.append(f"prompt: {row['prompt']!r}")
        for who in ("policy", "baseline"):
            gold, rm, fn, correct, response = (
                row[f"{who}_{k}"] for k in ("gold_score", "rm_score", "reward_fn", "correct", "response")
            )
            fn_text = f"  fn {num(fn)}" if fn is not None else ""
            lines.append(
                f"  {who:<8} gold {num(gold)}  rm {num(rm)}{fn_text}{verdict(correct)}  {response!r}"
            )
            if row.get(f"{who}_greedy_response") is not None:
                greedy, correct = row[f"{who}_greedy_response"], row[f"{who}_greedy_correct"]
                lines.append(f"  {'':<8} greedy{verdict(correct)}  {greedy!r}")
    return "\n".join(lines)


@dataclass(frozen=True)
class EvalObjects:
    """The Python API's objects (`api.run_eval`), each in place of a config key (None: the key's): policy and
    tokenizer (policy_path), baseline and baseline_tokenizer (baseline_path; without its own tokenizer a
    baseline object reads the policy's ids), reference (reference_path; the policy's tokenizer), reward_model
    (a `RewardModel` or a list of them: reward_model_path), reward_fn (a `RewardFn`: reward_fn), prompts
    (`data.InMemory` rows: prompt_file)."""

    policy: Any = None
    tokenizer: Any = None
    baseline: Any = None
    baseline_tokenizer: Any = None
    reference: Any = None
    reward_model: Any = None
    reward_fn: RewardFn | None = None
    prompts: Any = None

    def models(self, cfg: Config) -> dict[str, Any]:
        """The model objects given, by the path they stand in for (`model_paths`)."""
        given = ((cfg.policy_path, self.policy), (cfg.baseline_path, self.baseline))
        return {p: model for p, model in (*given, (reference_path(cfg), self.reference)) if model is not None}


def run(cfg: Config, **objects: Any) -> dict[str, Any] | None:
    """Load and check every input, sample both models with paired seeds, score, write the outputs.

    objects (the Python API): `EvalObjects`' fields by name, each in place of a config key. Under `accelerate
    launch` with several processes the main process evaluates and the others wait (the evaluation is small
    next to training, and one writer keeps the outputs whole)."""
    given = EvalObjects(**objects)  # a TypeError naming an unknown argument, as a signature would
    state = PartialState()
    if not state.is_main_process:
        state.wait_for_everyone()
        return None
    try:
        with outside_zero_init():  # the main process alone: no model of it is built under zero.Init
            return _run(cfg, given)
    finally:
        if state.num_processes > 1:
            state.wait_for_everyone()


def _run(cfg: Config, given: EvalObjects) -> dict[str, Any]:
    """The evaluation's steps: every input checked before any model loads, the models loaded, both measured,
    the figures, the outputs written (metrics.json last)."""
    import torch

    started = time.time()
    print(format_config(cfg))
    print(f"precision: {cfg.precision}", flush=True)
    inputs = load_inputs(cfg, given)
    models = load_models(cfg, given, inputs)
    with (
        torch.autocast(PartialState().device.type, dtype=torch.bfloat16, enabled=cfg.bf16),
        frozen_weights_cast_once(*evaluated_modules(models, inputs.judge)),  # once, not at every forward
    ):
        measured = measure(cfg, inputs, models)
    metrics = {**eval_figures(cfg, inputs, models, measured), "time_s": time.time() - started}
    write_outputs(cfg, metrics, sample_rows(inputs.prompts, measured, cfg.samples_per_prompt))
    return metrics


def evaluated_modules(models: EvalModels, judge) -> list:
    """The torch modules an evaluation runs: the policy, the baseline, the KL reference, the reward model and
    the gold's LM (each frozen: `rl.cast_once` casts their weights to bf16 once under autocast)."""
    fluency = getattr(judge, "fluency", None)
    return [
        models.policy,
        models.baseline,
        models.reference.lm,
        models.scorer.reward_model,
        getattr(fluency, "model", None),
    ]


def reference_path(cfg: Config) -> str:
    """pi_ref of kl_to_ref: reference_path, else the baseline."""
    return cfg.reference_path or cfg.baseline_path


def model_paths(cfg: Config) -> list[str]:
    """The policy's, the baseline's and the reference's paths, each once: one copy of each model."""
    return list(dict.fromkeys([cfg.policy_path, cfg.baseline_path, reference_path(cfg)]))


@dataclass(frozen=True)
class EvalInputs:
    """What `load_inputs` loads and checks before any model: the gold judge, the reward function (loaded and
    probed), the verifier (None without accuracy_fn), the prompts, the policy's tokenizer (also the
    reference's), the baseline's, and whether the baseline reads the reference's ids (its kl_to_ref)."""

    judge: Any
    reward_fn: RewardFn | None
    verifier: RewardFn | None
    prompts: list[str]
    tokenizer: Any
    baseline_tokenizer: Any
    baseline_has_kl: bool


def load_inputs(cfg: Config, given: EvalObjects) -> EvalInputs:
    """Step 1: the judge, the reward function, the reward-model folders, the tokenizers (the reference's must
    be the policy's), the prompts and the verifier, each checked with one line before any model loads."""
    judge = load_judge(cfg.gold_judge)
    reward_fn = given.reward_fn
    if reward_fn is None and cfg.reward_fn is not None:
        reward_fn = load_reward_fn(cfg.reward_fn)
    if given.reward_model is None and not is_off(cfg.reward_model_path):  # every folder, before any loads
        check_members_exist(cfg.reward_model_path)
    tokenizers = load_tokenizers(cfg, given)
    tokenizer, baseline_tokenizer = tokenizers[cfg.policy_path], tokenizers[cfg.baseline_path]
    ref_vocab = tokenizers[reference_path(cfg)].get_vocab()
    if tokenizer.get_vocab() != ref_vocab:
        raise UserError(
            f"reference_path '{reference_path(cfg)}': its tokenizer differs from the policy's; kl_to_ref needs "
            "the same token ids (set reference_path to the model the policy was trained from)"
        )
    prompts = load_prompt_texts(cfg, tokenizer, given.prompts)
    if reward_fn is not None:  # checked on two real prompts before any model loads, as PPO does
        probe(reward_fn, prompts)
    verifier = load_verifier(cfg.accuracy_fn, prompts) if cfg.accuracy_fn is not None else None
    return EvalInputs(
        judge=judge,
        reward_fn=reward_fn,
        verifier=verifier,
        prompts=prompts,
        tokenizer=tokenizer,
        baseline_tokenizer=baseline_tokenizer,
        baseline_has_kl=baseline_tokenizer.get_vocab() == ref_vocab,
    )


def load_tokenizers(cfg: Config, given: EvalObjects) -> dict[str, Any]:
    """The tokenizer of each model path: a folder's own; a policy object's `tokenizer` (else its folder's); a
    baseline object's `baseline_tokenizer`; a baseline or reference object without one reads the policy's ids
    (as the SFT model of a PPO policy does), checked against its embeddings."""
    live = given.models(cfg)
    tokenizers = {
        p: load_tokenizer(p, trust_remote_code=cfg.trust_remote_code)
        for p in model_paths(cfg)
        if p not in live
    }
    if given.policy is not None:
        tokenizers[cfg.policy_path] = tokenizer_or_load(cfg, given.tokenizer, given.policy)
    if given.baseline is not None and given.baseline_tokenizer is not None:
        tokenizers[cfg.baseline_path] = tokenizer_or_load(cfg, given.baseline_tokenizer, given.baseline)
    for p, name, model, hint in (
        (cfg.baseline_path, "baseline", given.baseline, "give the baseline's own as baseline_tokenizer"),
        (
            reference_path(cfg),
            "reference",
            given.reference,
            "kl_to_ref needs a reference of the policy's tokenizer",
        ),
    ):
        if model is not None and p not in tokenizers:  # the policy's, as for the SFT model of a PPO policy
            tokenizers[p] = tokenizers[cfg.policy_path]
            check_embeddings(model, tokenizers[p], name, hint)
    return tokenizers


@dataclass(frozen=True)
class EvalModels:
    """The loaded models (frozen, eval mode, on the device): the policy, the baseline, the KL reference and
    the scorer (`scoring.build_scorer`: PPO's score)."""

    policy: Any
    baseline: Any
    reference: KLReference
    scorer: Scorer


def load_models(cfg: Config, given: EvalObjects, inputs: EvalInputs) -> EvalModels:
    """Step 2: each model path loaded once (a given object in its place, put in eval mode: sampled without
    gradients), the sampled models checked to hold the longest prompt + max_new_tokens, and the scorer."""
    device = PartialState().device  # this process's accelerator (cuda:<local rank>), else the CPU
    live = given.models(cfg)
    models = {
        p: freeze(load_causal_lm(p, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)).to(device)
        for p in model_paths(cfg)
        if p not in live
    }
    models.update({p: model.eval().to(device) for p, model in live.items()})
    longest = max(len(encode_prompt(inputs.tokenizer, p)) for p in inputs.prompts)
    for p in (cfg.policy_path, cfg.baseline_path):
        check_positions(models[p], longest, cfg.max_new_tokens, f"'{p}'")
    scorer = build_scorer(cfg, reward_model=given.reward_model, reward_fn=inputs.reward_fn, device=device)
    for model in [*models.values(), scorer.reward_model]:
        if model is not None:
            use_eager_attention(model, bf16=cfg.bf16, device=device)
    return EvalModels(
        policy=models[cfg.policy_path],
        baseline=models[cfg.baseline_path],
        reference=KLReference(models[reference_path(cfg)]),
        scorer=scorer,
    )


def kl_reference(model, reference: KLReference) -> KLReference:
    """`reference` for the KL of `model`'s samples, with the leading blocks the two hold with equal weights
    (`trunk.shared_block_count`: a PPO policy whose adapters were in its last N blocks shares the others with
    the model it started from), computed once for both forwards."""
    return dataclasses.replace(reference, shared_blocks=trunk.shared_block_count(model, reference.lm))


@dataclass(frozen=True)
class Measured:
    """Each model's records (`sample_and_score`: samples_per_prompt per prompt, prompt-major, paired) and with
    a verifier its greedy records (one per prompt; None without one)."""

    policy: list[dict[str, Any]]
    baseline: list[dict[str, Any]]
    policy_greedy: list[dict[str, Any]] | None = None
    baseline_greedy: list[dict[str, Any]] | None = None


def measure(cfg: Config, inputs: EvalInputs, models: EvalModels) -> Measured:
    """Step 3: both models sampled on the same prompts with paired seeds (`PairedSampling`), scored as PPO
    scores, judged, their KL to the reference measured (the baseline's only when it reads the reference's
    ids); with a verifier one greedy response per prompt and model."""
    play = None  # episodes with an environment, played as PPO played them
    if cfg.environment is not None:
        play = EpisodePlay(
            environment_factory(cfg.environment, verifier=inputs.verifier, limits=EpisodeLimits.of(cfg)),
            EpisodeLimits.of(cfg),
        )
    draws = PairedSampling(Sampling.of(cfg), seed=cfg.seed, batch_size=cfg.batch_size, play=play)
    measures = Measures(scorer=models.scorer, judge=inputs.judge, verifier=inputs.verifier)
    rows = [p for p in inputs.prompts for _ in range(cfg.samples_per_prompt)]  # prompt-major
    policy = sample_and_score(
        models.policy,
        inputs.tokenizer,
        rows,
        draws,
        measures=measures,
        reference=kl_reference(models.policy, models.reference),
        progress="policy",
    )
    # the KL needs the same ids
    baseline_ref = kl_reference(models.baseline, models.reference) if inputs.baseline_has_kl else None
    baseline = sample_and_score(
        models.baseline,
        inputs.baseline_tokenizer,
        rows,
        draws,
        measures=measures,
        reference=baseline_ref,
        progress="baseline",
    )
    if inputs.verifier is None:
        return Measured(policy, baseline)
    greedy = [
        greedy_records(model, tok, inputs.prompts, draws, inputs.verifier)
        for model, tok in ((models.policy, inputs.tokenizer), (models.baseline, inputs.baseline_tokenizer))
    ]
    return Measured(policy, baseline, *greedy)


WIN_RATE_KEYS = ("gold_score", "sentiment", "rm_score", "reward_fn", "combined_score")


def win_rates(
    policy: list[dict[str, Any]], baseline: list[dict[str, Any]], *, samples_per_prompt: int
) -> dict[str, float | None]:
    """<name>_win_rate and its stderr for each of `WIN_RATE_KEYS` (name: the key less _score); None where
    either side was not measured. A prompt's k samples are not independent draws: the stderr is over the
    prompts, each prompt's pairs averaged first."""
    out: dict[str, float | None] = {}
    for key in WIN_RATE_KEYS:
        a, b = [r[key] for r in policy], [r[key] for r in baseline]
        measured = None not in a and None not in b
        name = key.removesuffix("_score")
        out[f"{name}_win_rate"] = win_rate(a, b) if measured else None
        out[f"{name}_win_rate_stderr"] = (
            mean_and_stderr_over_prompts(win_points(a, b), samples_per_prompt)[1] if measured else None
        )
    return out


def eval_figures(cfg: Config, inputs: EvalInputs, models: EvalModels, measured: Measured) -> dict[str, Any]:
    """Step 4: metrics.json's figures (but time_s): the win rates, each model's means (`summarize_records`) and
    accuracy (`accuracy_figures`), the alarm's counter rules (`final_alarm`), then what was evaluated
    (`run_info`)."""
    k = cfg.samples_per_prompt
    policy = summarize_records(measured.policy, samples_per_prompt=k)
    baseline = summarize_records(measured.baseline, samples_per_prompt=k)
    return {
        **win_rates(measured.policy, measured.baseline, samples_per_prompt=k),
        **policy,
        **{key + metric_names.BASELINE: value for key, value in baseline.items()},
        **accuracy_figures(
            measured.policy, measured.policy_greedy, samples_per_prompt=k, pass_at=cfg.pass_at_k
        ),
        **accuracy_figures(
            measured.baseline,
            measured.baseline_greedy,
            samples_per_prompt=k,
            suffix="_baseline",
            pass_at=cfg.pass_at_k,
        ),
        **episode_figures(measured.policy),
        **episode_figures(measured.baseline, suffix="_baseline"),
        **final_alarm(policy, baseline),
        **run_info(cfg, inputs, models),
    }


def final_alarm(policy: dict[str, Any], baseline: dict[str, Any]) -> dict[str, list[str]]:
    """The reward-hacking alarm's counter rules on the final evaluation (`hacking.counter_alarms`): the policy's
    collapse and degeneracy counters against the baseline's (`summarize_records`'s figures, the baseline's without
    their suffix), as alarm_rules (the counters past their threshold, [] = quiet) and alarm_reasons (a line
    each). The proxy-up / gold-down rule needs a trajectory: PPO's held-out evaluations have it."""
    alarms = counter_alarms(policy, baseline=baseline)
    return {metric_names.ALARM_RULES: list(alarms), metric_names.ALARM_REASONS: list(alarms.values())}


def run_info(cfg: Config, inputs: EvalInputs, models: EvalModels) -> dict[str, Any]:
    """What was evaluated, and how: the counts, the paths, the scorer's keys (the ensemble's only with an
    ensemble), the verifier and the gold judge (with its stored held-out accuracy and validity)."""
    judge = inputs.judge
    sentiment_judge = judge.sentiment if isinstance(judge, FluentGoldJudge) else judge
    heldout = sentiment_judge.info.get("heldout", {}) if isinstance(sentiment_judge, GoldJudge) else {}
    ensemble = isinstance(models.scorer.reward_model, RewardEnsemble)
    return {
        "num_prompts": len(inputs.prompts),
        "samples_per_prompt": cfg.samples_per_prompt,
        "num_pairs": len(inputs.prompts) * cfg.samples_per_prompt,
        "policy_path": cfg.policy_path,
        "baseline_path": cfg.baseline_path,
        "reference_path": reference_path(cfg),
        "reward_model_path": cfg.reward_model_path,
        **(
            {
                "ensemble_combine": cfg.ensemble_combine,
                "ensemble_uncertainty_coef": cfg.ensemble_uncertainty_coef,
            }
            if ensemble
            else {}
        ),
        "reward_fn": cfg.reward_fn,
        "reward_fn_weight": cfg.reward_fn_weight,
        "accuracy_fn": cfg.accuracy_fn,
        "gold_judge": cfg.gold_judge,
        "gold_judge_heldout_accuracy": heldout.get("accuracy"),
        "gold_judge_validity": judge.info.get("validity") if isinstance(judge, FluentGoldJudge) else None,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
    }


def sample_rows(prompts: list[str], measured: Measured, samples_per_prompt: int) -> list[dict[str, Any]]:
    """samples.jsonl's lines (`sample_row`): pair j of prompt i, with the prompt's greedy records."""
    k = samples_per_prompt  # record r is sample r % k of prompt r // k
    return [
        sample_row(prompts[r // k], r % k, p, b, greedy_pair(measured, r // k))
        for r, (p, b) in enumerate(zip(measured.policy, measured.baseline))
    ]


def greedy_pair(measured: Measured, i: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(policy, baseline) greedy record of prompt i; (None, None) without a verifier."""
    if measured.policy_greedy is None:
        return None, None
    return measured.policy_greedy[i], measured.baseline_greedy[i]


def write_outputs(cfg: Config, metrics: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    """Step 5: the first print_samples as a table and the figures printed; samples.jsonl, config.yaml, then
    metrics.json (last: its presence marks the evaluation done)."""
    if cfg.print_samples:
        print(format_table(samples[: cfg.print_samples]))
    print(format_metrics(metrics))
    out = Path(cfg.output_dir)
    atomic_write_text(
        out / "samples.jsonl", "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
    )
    save_config(cfg, out)
    atomic_write_json(out / "metrics.json", metrics)


def format_metrics(metrics: dict[str, Any]) -> str:
    """policy vs baseline, one line per figure."""

    def num(x):
        return "n/a" if x is None else f"{x:.4f}"

    lines = [f"{'':<24}{'policy':>10}{'baseline':>10}"]
    for key in (
        "gold_score_mean",
        "sentiment_mean",
        "fluency_perplexity",
        "rm_score_mean",
        *sorted(k for k in metrics if k.startswith("rm_score_member_") and k.endswith("_mean")),
        *(["rm_disagreement_mean"] if "rm_disagreement_mean" in metrics else []),
        "reward_fn_mean",
        "combined_score_mean",
        "kl_to_ref",
        "kl_to_ref_at_temperature",
        "response_length_mean",
        "eos_rate",
        "distinct_1",
        "distinct_2",
    ):
        lines.append(f"{key:<24}{num(metrics[key]):>10}{num(metrics[key + '_baseline']):>10}")
    for key in (
        "gold_win_rate",
        "sentiment_win_rate",
        "rm_win_rate",
        "reward_fn_win_rate",
        "combined_win_rate",
    ):
        stderr = metrics[key + "_stderr"]
        lines.append(
            f"{key:<24}{num(metrics[key]):>10}" + (f"  (+/- {stderr:.4f})" if stderr is not None else "")
        )
    for (
        key
    ) in metric_names.COLLAPSE_KEYS:  # the reward-hacking alarm's counters (`llm_rlhf.evaluation.hacking`)
        lines.append(f"{key:<24}{num(metrics[key]):>10}{num(metrics[key + metric_names.BASELINE]):>10}")
    reasons = metrics.get(metric_names.ALARM_REASONS)
    if reasons is not None:
        lines.append("reward-hacking alarm: " + ("; ".join(reasons) if reasons else "quiet"))
    if metrics.get("accuracy") is not None:  # the verifier's (accuracy_fn), stderr over the prompts
        for key in ("accuracy", "accuracy_greedy"):
            stderrs = [metrics[key + "_stderr" + suffix] for suffix in ("", "_baseline")]
            lines.append(
                f"{key:<24}{num(metrics[key]):>10}{num(metrics[key + '_baseline']):>10}"
                f"  (+/- {stderrs[0]:.4f} / {stderrs[1]:.4f})"
            )
    return "\n".join(lines)
