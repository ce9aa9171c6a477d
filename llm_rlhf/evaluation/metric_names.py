"""The names evaluation writes, declared once beside `llm_rlhf.stages.evaluate`, their writer; `llm_rlhf.interfaces.report`
reads the files by these names. Stdlib only.

    eval/metrics.json      `llm-rlhf eval`: the policy's figure under each key below, the baseline's under
                           key + BASELINE, a win rate's standard error under win rate + STDERR
    eval/samples.jsonl     one line per pair of samples: PROMPT, SAMPLE, then `side(who, field)` for each
                           per-sample field of the policy and the baseline
    ppo/eval_log.jsonl     one line per held-out evaluation during PPO (`measures.heldout_record`)

The degeneracy rates (char_run_rate, ...) are `hacking.DEGENERACY_KEYS`, the collapse counters (duplicate_rate,
...) `hacking.COLLAPSE_KEYS`, both in every evaluation's figures (the baseline's with BASELINE) and in every line
of eval_log.jsonl; the alarm's fields are `hacking.WATCH_KEYS` (named below).
"""

from __future__ import annotations

from llm_rlhf.evaluation import hacking

BASELINE = "_baseline"  # suffix: the baseline's figure of a metrics.json key
STDERR = "_stderr"  # suffix: a win rate's standard error

# per-sample fields: `measures.sample_and_score`'s records, and eval/samples.jsonl's columns (`side`)
PROMPT = "prompt"
SAMPLE = "sample"  # samples.jsonl: which of its prompt's samples_per_prompt samples
RESPONSE = "response"
GOLD_SCORE = "gold_score"
SENTIMENT = "sentiment"  # the gold's sentiment part
FLUENCY_PERPLEXITY = "fluency_perplexity"  # the gold's fluency part (also metrics.json's geometric mean)
RM_SCORE = "rm_score"  # normalised
RM_MEMBER_SCORES = "rm_member_scores"  # a reward-model ensemble: each member's score
REWARD_FN = "reward_fn"  # unweighted
COMBINED_SCORE = "combined_score"  # PPO's score: rm_score + reward_fn_weight * reward_fn
KL_TO_REF = "kl_to_ref"  # sequence KL at temperature 1 (also metrics.json's mean)
KL_TO_REF_AT_TEMPERATURE = "kl_to_ref_at_temperature"  # ... at the sampling temperature (also the mean)
LENGTH = "length"  # tokens, EOS included
EOS = "eos"  # the response ended with EOS
CORRECT = "correct"  # the verifier's 1.0 or 0.0 (accuracy_fn); None without one
GREEDY_RESPONSE = "greedy_response"  # samples.jsonl, on a prompt's first sample: one greedy response
GREEDY_CORRECT = "greedy_correct"


def side(who: str, field: str) -> str:
    """The samples.jsonl column of one side's field: who is "policy" or "baseline" (`policy_gold_score`)."""
    return f"{who}_{field}"


# eval/metrics.json: means over the samples with their standard errors, and win rates
GOLD_SCORE_MEAN = "gold_score_mean"
GOLD_SCORE_STDERR = "gold_score_stderr"
GOLD_WIN_RATE = "gold_win_rate"
SENTIMENT_MEAN = "sentiment_mean"
SENTIMENT_STDERR = "sentiment_stderr"
SENTIMENT_WIN_RATE = "sentiment_win_rate"
RM_SCORE_MEAN = "rm_score_mean"
RM_SCORE_STDERR = "rm_score_stderr"
RM_WIN_RATE = "rm_win_rate"
RM_SCORE_MEMBER = "rm_score_member_"  # + k + "_mean" in metrics.json, + k in eval_log.jsonl: member k's
RM_DISAGREEMENT_MEAN = "rm_disagreement_mean"  # the std across an ensemble's members
REWARD_FN_MEAN = "reward_fn_mean"
REWARD_FN_STDERR = "reward_fn_stderr"
REWARD_FN_WIN_RATE = "reward_fn_win_rate"
COMBINED_SCORE_MEAN = "combined_score_mean"
COMBINED_SCORE_STDERR = "combined_score_stderr"
COMBINED_WIN_RATE = "combined_win_rate"
KL_TO_REF_STDERR = "kl_to_ref_stderr"
KL_TO_REF_AT_TEMPERATURE_STDERR = "kl_to_ref_at_temperature_stderr"
RESPONSE_LENGTH_MEAN = "response_length_mean"
EOS_RATE = "eos_rate"
DISTINCT_1 = "distinct_1"
DISTINCT_2 = "distinct_2"
ACCURACY = "accuracy"  # the verifier's mean over the samples (a task with a verifier)
ACCURACY_STDERR = "accuracy_stderr"  # over the prompts
ACCURACY_GREEDY = "accuracy_greedy"  # over one greedy response per prompt
ACCURACY_GREEDY_STDERR = "accuracy_greedy_stderr"
ACCURACY_KEYS = (ACCURACY, ACCURACY_STDERR, ACCURACY_GREEDY, ACCURACY_GREEDY_STDERR)
PASS_AT = (
    "pass_at_"  # + k: the unbiased pass@k of the samples (n per prompt, k <= n), + "_stderr" over the prompts
)


def pass_at_keys(k: int) -> tuple[str, str]:
    """pass@k's keys: ("pass_at_<k>", "pass_at_<k>_stderr")."""
    return f"{PASS_AT}{k}", f"{PASS_AT}{k}{STDERR}"


DEGENERACY_KEYS = hacking.DEGENERACY_KEYS  # char_run_rate, repeated_ngram_rate, empty_rate
COLLAPSE_KEYS = hacking.COLLAPSE_KEYS  # duplicate_rate, ..., word_distinct_2, top_response_share, echo_rate
DUPLICATE_RATE, TOP_BIGRAM_SHARE, SHARED_BIGRAM_RATE, WORD_DISTINCT_2 = COLLAPSE_KEYS[:4]
TOP_RESPONSE_SHARE, ECHO_RATE = COLLAPSE_KEYS[4:]  # a collapse onto one answer; copying the prompt
NUM_RESPONSES = hacking.RESPONSES  # the responses the counters were computed over: the alarm's N
# the counter rules of the reward-hacking alarm on the final evaluation, the policy's counters against the
# baseline's (`hacking.counter_alarms`): the counters past their threshold ([] = quiet) and a line for each
ALARM_RULES = "alarm_rules"
ALARM_REASONS = "alarm_reasons"

# eval/metrics.json: what was evaluated, and how
NUM_PROMPTS = "num_prompts"
SAMPLES_PER_PROMPT = "samples_per_prompt"
NUM_PAIRS = "num_pairs"
POLICY_PATH = "policy_path"
BASELINE_PATH = "baseline_path"
TEMPERATURE = "temperature"
SEED = "seed"
ACCURACY_FN = "accuracy_fn"
GOLD_JUDGE = "gold_judge"
GOLD_JUDGE_HELDOUT_ACCURACY = "gold_judge_heldout_accuracy"  # the gold's sentiment part on held-out data
GOLD_JUDGE_VALIDITY = "gold_judge_validity"  # the fluency-aware gold's checks (its judge JSON's)

# ppo/eval_log.jsonl (`measures.heldout_record`): these, and RM_SCORE, RM_SCORE_MEMBER + k, GOLD_SCORE,
# REWARD_FN, SENTIMENT, FLUENCY_PERPLEXITY, EOS_RATE, GOLD_SCORE_STDERR, the degeneracy and collapse counters
# and ACCURACY_KEYS
LOG_STEP = "step"  # the PPO step evaluated (0: the model PPO started from)
LOG_KL = "kl"  # KL_TO_REF's mean
LOG_RM_DISAGREEMENT = "rm_disagreement"
LOG_RESPONSE_LENGTH = "response_length"
LOG_PROXY = (
    hacking.PROXY
)  # the mean score PPO maximised: COMBINED_SCORE's with a reward function, else RM_SCORE's
LOG_PROXY_STDERR = "proxy_stderr"  # its standard error (GOLD_SCORE_STDERR: the gold's), for the alarm's rule
# what the alarm says after each held-out evaluation (`hacking.watch_fields`): the step where it first fired
# (None: quiet so far), its rules and lines there, and the step of the best gold (or accuracy) so far
LOG_ALARM_STEP, LOG_ALARM_RULES, LOG_ALARM_REASONS, LOG_BEST_STEP = hacking.WATCH_KEYS
