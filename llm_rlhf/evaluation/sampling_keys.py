"""The configuration keys of sampling a policy on prompts and scoring what it wrote, declared once and shared by
PPO (`llm_rlhf.ppo.config.Config`) and evaluation (`llm_rlhf.stages.evaluate.Config`):

    ScoringKeys    the reward model(s), the reward function, the verifier and the gold judge
    PromptKeys     a checkable task, the prompt file and how its rows become prompts
    SamplingKeys   responses per prompt, their length, the sampler and where a response ends
    EpisodeKeys    episodes of several turns with an environment

`SamplingRunKeys` composes them with the models' loading keys, the seed and the output folder. A stage's Config
derives from it and re-declares a key only to change its default or its help (a user still sees one flat
config per stage: YAML keys, `--key value` flags, `--help`, the saved config.yaml).

A task (`task: chain_sum-t2d1`, a task of data/tasks/tasks.yaml) fills the stage's prompt files, reward function
and verifier with the files of data/tasks/<task>/ (`llm_rlhf.tasks.gym.task_keys`) where they are left at their
defaults, so a stage file that names its task runs alone with its command.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llm_rlhf.core.config import help_field, require
from llm_rlhf.rl.episodes import EPISODE_KEYS
from llm_rlhf.tasks.gym import task_keys


@dataclass
class ScoringKeys:
    reward_model_path: str | list[str] | None = help_field(
        "runs/reviews/rm",
        "The trained reward model folder (`llm-rlhf rm` output), or a list of them: an ensemble whose members "
        "each score every response with their own normalisation, combined per response by ensemble_combine "
        "(PPO's value_model 'reward' starts the critic from the first member); null or 'none': no reward model "
        "(PPO's score is then reward_fn_weight * reward_fn alone; evaluation reports no rm_* metrics).",
    )
    ensemble_combine: str = help_field(
        "mean",
        "With a list of reward models, one score per response from the members' scores: 'mean', 'min' (worst "
        "case) or 'uncertainty' (mean - ensemble_uncertainty_coef * std across the members, the population "
        "std). Ignored with one reward model; evaluation takes the PPO run's (the pipeline does).",
    )
    ensemble_uncertainty_coef: float = help_field(
        1.0, "lambda of ensemble_combine 'uncertainty' (>= 0; 0 = the mean)."
    )
    reward_fn: str | None = help_field(
        None,
        "A reward function 'module:callable' (importable from the current directory or the python path) or "
        "'path/to/file.py:callable': any callable (prompts: list[str], responses: list[str]) -> list[float] "
        "(a class is built with no arguments). scores = rm_score + reward_fn_weight * reward_fn, the one "
        "score per sequence at the last response token (rm_score = 0 without a reward model); evaluation "
        "reports it as reward_fn_* and combined_score. Probed once before the stage starts; every call is "
        "checked (one finite number per response). null = off.",
    )
    reward_fn_weight: float = help_field(1.0, "The weight of reward_fn in the score (see reward_fn).")
    accuracy_fn: str | None = help_field(
        None,
        "A verifier: 'module:callable' or 'path/to/file.py:callable' with the reward-function interface "
        "(prompts, responses) -> list of 1.0 (correct) / 0.0 (wrong), e.g. llm_rlhf.tasks.arithmetic:reward. "
        "When set, evaluation (and PPO's held-out evaluation, eval_every > 0) reports accuracy: sampled (the "
        "mean over the samples drawn as configured) and greedy (one greedy response per prompt, temperature 0 "
        "/ argmax), with standard errors over the prompts. With PPO's dynamic_sampling a group ties when its "
        "verdicts tie (DAPO filters on accuracy). null = off.",
    )
    gold_judge: str = help_field(
        "data/reviews/gold.json",
        "Gold judge of held-out responses: a judge JSON (data/reviews/gold.json: sentiment and fluency; "
        "gold_judge.json: sentiment only), 'module:function' or 'module:Class' (a callable (prompts, "
        "responses) -> list[float], higher = better), or 'none'.",
    )


@dataclass
class PromptKeys:
    task: str | None = help_field(
        None,
        "A checkable task of data/tasks/tasks.yaml (e.g. chain_sum-t2d1): its files fill the prompt files, "
        "reward_fn and accuracy_fn left at their defaults (data/tasks/<task>/: the prompts and the verifier); "
        "a pipeline's `task:` sets it for its stages. null = none.",
    )
    prompt_file: str = help_field(
        "data/reviews/ppo_prompts.jsonl",
        "Prompts to sample responses for (JSONL/CSV/Parquet or a hub dataset; a prompt, messages or text column).",
    )
    max_prompt_length: int = help_field(
        32, "Prompts longer than this (tokens) are rejected with an error naming the row (see skip_long)."
    )
    data_format: str = help_field(
        "auto",
        "Schema of the prompt files: 'auto' (detected from the columns) or 'hh' (Anthropic/hh-rlhf dialogues, "
        "also detected by 'auto': the prompt is `chosen` up to and including its last '\\n\\nAssistant:').",
    )
    skip_long: bool = help_field(
        False,
        "Leave out (and count) prompts longer than max_prompt_length; false = stop with an error naming "
        "the row.",
    )
    system_prompt: str | None = help_field(
        None,
        "Chat `messages` prompts (the prompt files): the system turn of every prompt that has none of its own "
        "('' = an empty one); null = whatever the chat template writes (SmolLM2's: a default system message "
        "of 16 tokens, carried through every forward).",
    )


@dataclass
class SamplingKeys:
    samples_per_prompt: int = help_field(1, "Responses sampled per prompt.")
    max_new_tokens: int = help_field(32, "Maximum response length in tokens.")
    temperature: float = help_field(1.0, "Sampling temperature (PPO's log-probs use the same temperature).")
    top_k: int = help_field(
        0,
        "Top-k sampling (0 = off). PPO needs 0: its ratio and KL are log-probs of the full softmax at "
        "`temperature`, the distribution the tokens must be drawn from (tokens outside the reference's top k "
        "would even have infinite KL). Evaluation may use it.",
    )
    top_p: float = help_field(
        1.0, "Nucleus sampling (1.0 = off); PPO needs 1.0, as top_k and for the same reason."
    )
    stop_strings: list[str] = help_field(
        [],
        "A response ends at the token completing the first of these strings in its text (the token is kept, "
        "as an EOS is): its end for the response mask, the score, the KL and the EOS trick; evaluation takes "
        "the PPO run's (the pipeline does). On the command line a YAML list keeps spaces and escapes: "
        "--stop_strings '[\"\\n\"]'. [] = off.",
    )
    min_new_tokens: int = help_field(
        0,
        "EOS cannot be sampled before this many response tokens, and a stop string completed before then is "
        "ignored (0 = off). PPO's log-probs and every KL are those of the same EOS-masked distribution; "
        "evaluation takes the PPO run's.",
    )
    sampling_dtype: str = help_field(
        "float32",
        "The dtype of the linear layers while sampling: float32 | bfloat16. "
        "float32 samples the policy's own distribution (up to float rounding); bfloat16, an opt-in, samples "
        "from copies of the linear layers in bfloat16 (0.8x the float32 step at batch 32 on an AVX-512 CPU, "
        "slower on an H100 at ~100M weights): another distribution than the one PPO's log-probs describe, "
        "the gap logged per token as objective/kl_sampler.",
    )
    sampling_compile: bool = help_field(
        False,
        "Decode steps with a static KV cache through torch.compile (CUDA graphs on a GPU): the same "
        "distribution, 5.7x faster decode steps on an H100 for a 135M model after a compilation of ~45 s per "
        "batch size and prompt width bucket of 64; slower on CPUs. For long GPU runs; float32 sampling only.",
    )


@dataclass
class EpisodeKeys:
    environment: str | None = help_field(*EPISODE_KEYS["environment"])
    max_turns: int = help_field(*EPISODE_KEYS["max_turns"])
    max_episode_tokens: int = help_field(*EPISODE_KEYS["max_episode_tokens"])
    max_reply_tokens: int = help_field(*EPISODE_KEYS["max_reply_tokens"])
    environment_timeout: float = help_field(*EPISODE_KEYS["environment_timeout"])
    environment_process: bool = help_field(*EPISODE_KEYS["environment_process"])
    environment_memory_mb: int = help_field(*EPISODE_KEYS["environment_memory_mb"])


@dataclass
class SamplingRunKeys(EpisodeKeys, SamplingKeys, PromptKeys, ScoringKeys):
    """Every key PPO and evaluation share, in the order `--help` and config.yaml show them: scoring, prompts,
    sampling, episodes, then these."""

    trust_remote_code: bool = help_field(
        False, "Allow model code from the hub (off unless you trust the source)."
    )
    dtype: str = help_field("float32", "Weights dtype: float32 | bfloat16 | float16.")
    seed: int = help_field(0, "Random seed.")
    output_dir: str = help_field("runs/reviews/out", "Where the stage's outputs go.")


def check_pass_at_k(ks, samples_per_prompt: int, accuracy_fn, *, key: str, n_key: str = "samples_per_prompt"):
    """A list of pass@k's k (evaluation's pass_at_k, PPO's eval_pass_at_k): integers 1 <= k <= n, the
    samples of each prompt (n_key's value), distinct, and an accuracy_fn to give the verdicts; each a
    ConfigError naming the key."""
    require(isinstance(ks, list), key, f"must be a list of integers (got {ks!r})")
    for k in ks:
        require(type(k) is int and k >= 1, key, f"{k!r} is not an integer >= 1")
        require(
            k <= samples_per_prompt,
            key,
            f"pass@{k} needs k <= {n_key} ({samples_per_prompt}): an unbiased pass@k takes k of the n samples of "
            "a prompt",
        )
    require(len(set(ks)) == len(ks), key, f"lists a k twice ({ks})")
    require(not ks or accuracy_fn is not None, key, "needs accuracy_fn (the verdicts pass@k counts)")


def fill_from_task(cfg: SamplingRunKeys, stage: str) -> None:
    """With cfg.task set, the task's files (`task_keys(cfg.task, stage)`: prompt files, reward_fn, accuracy_fn)
    in every one of those keys still at its default; a key set to something else keeps its value. A task
    without a written folder is a ConfigError naming it."""
    if cfg.task is None:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for key, value in task_keys(cfg.task, stage).items():
        if getattr(cfg, key) == defaults[key]:
            setattr(cfg, key, value)
