"""The names PPO writes: the keys of ppo/metrics.jsonl (one line per step: `llm_rlhf.ppo.trainer.PPOTrainer.ppo_step`) and of
ppo/metrics.json (the last step's line and the run's summary: `stages.ppo.summarize_history`). Declared once here,
beside their writers; `llm_rlhf.interfaces.report` reads the logs by these names. A constant is its key in capitals,
"/" written "_" (OBJECTIVE_KL is "objective/kl"). Stdlib only.

    objective/*   the rollout: scores, KL to the reference, beta, the RLHF reward, entropy (per response)
    policy/*      the policy update: token means over each global minibatch, averaged over the minibatches
    loss/*        the losses of that update
    val/*         the value function's (gae alone: a critic-free estimator has none)
    time/*        seconds per phase of the step
"""

from __future__ import annotations

from llm_rlhf.evaluation import hacking

STEP = "step"  # PPO steps done: 1 on the first line
EPISODES = "episodes"  # responses sampled so far, over every process
LR = "lr"  # the learning rate after the step's schedule

# objective/*: the rollout (`PPOTrainer.metrics`)
OBJECTIVE_SCORES = "objective/scores"  # mean score of the responses (what PPO maximises, before the KL)
OBJECTIVE_SCORES_STD = "objective/scores_std"
OBJECTIVE_KL = "objective/kl"  # KL to the reference per response (nats)
OBJECTIVE_KL_COEF = "objective/kl_coef"  # beta of the step
OBJECTIVE_NON_SCORE_REWARD = "objective/non_score_reward"  # -beta * KL, wherever the KL is optimised
OBJECTIVE_RLHF_REWARD = "objective/rlhf_reward"  # score - beta * KL
OBJECTIVE_ENTROPY = "objective/entropy"  # per response (nats)
OBJECTIVE_GREEDY_SCORES = "objective/greedy_scores"  # ReMax: the greedy responses' mean score
OBJECTIVE_KL_SAMPLER = "objective/kl_sampler"  # KL(sampler || policy) per response token
OBJECTIVE_GROUP_SCORES_STD = "objective/group_scores_std"  # k > 1 samples per prompt: std within a group
OBJECTIVE_GROUPS_TIED = "objective/groups_tied"  # share of the groups whose k scores are all equal
OBJECTIVE_SCORES_MEMBER = "objective/scores_member_"  # + k: member k's mean score (a reward-model ensemble)
OBJECTIVE_SCORES_DISAGREEMENT = "objective/scores_disagreement"  # std across the ensemble's members
OBJECTIVE_OVERLONG_PENALTY = "objective/overlong_penalty"  # overlong_buffer: DAPO's length penalty, mean
OBJECTIVE_DISTILL_KL = "objective/distill_kl"  # teacher_model_path: reverse KL to the teacher per token


def objective(term: str) -> str:
    """The key of a part of the scores (`scoring.Scores.terms`: reward_fn, rm_score, scores_member_<k>,
    scores_disagreement): objective/<term>."""
    return f"objective/{term}"


# policy/*, loss/*, val/*: the update (`PPOTrainer.train_on_rollout`)
LOSS_POLICY = "loss/policy"
LOSS_VALUE = "loss/value"
LOSS_KL = "loss/kl"  # kl_coef * mean k3 over the minibatch's tokens, when the KL is in the loss
LOSS_DISTILL = "loss/distill"  # distill_loss forward_kl / jsd: distill_coef * the token mean divergence
POLICY_ENTROPY = "policy/entropy"  # per token
POLICY_APPROXKL = "policy/approxkl"  # old -> new policy, per token
POLICY_CLIPFRAC = "policy/clipfrac"
POLICY_RATIO = "policy/ratio"  # mean pi_theta / pi_theta_old
POLICY_SKIPPED_MINIBATCHES = "policy/skipped_minibatches"  # dropped by ratio_guard
POLICY_EARLY_STOPPED = "policy/early_stopped"  # 1.0 when target_approxkl stopped the epochs
# the policy-loss family: logged only when its option is on
POLICY_CLIPFRAC_LOW = "policy/clipfrac_low"  # tokens clipped at 1 - cliprange_low (A < 0)
POLICY_CLIPFRAC_HIGH = "policy/clipfrac_high"  # tokens clipped at 1 + cliprange_high (A > 0)
POLICY_DUAL_CLIPFRAC = "policy/dual_clipfrac"  # dual_clip: tokens whose loss the bound -c*A replaced
SAMPLER_MEAN_WEIGHT = "sampler/mean_weight"  # sampler_correction: mean importance weight on the tokens
SAMPLER_CORRECTED_FRAC = "sampler/corrected_frac"  # tokens truncated (tis) or masked (mis)
SAMPLER_WEIGHT_STD = "sampler/weight_std"  # the weights' standard deviation over the step's tokens
SAMPLER_WEIGHT_SQ_DEV = "sampler/weight_sq_dev"  # E[(w - 1)^2]: made into SAMPLER_WEIGHT_STD, not logged
SAMPLING_ROUNDS = "sampling/rounds"  # dynamic_sampling: rounds of sampling this step
SAMPLING_GROUPS_DROPPED = "sampling/groups_dropped"  # tied groups left out
SAMPLING_TIED_GROUPS_TRAINED = "sampling/tied_groups_trained"  # tied groups kept to fill the step at the cap
SAMPLING_SAMPLED_PER_TRAINED = "sampling/sampled_per_trained"  # responses sampled per response trained, run
SAMPLING_SCORES_SAMPLED = (
    "sampling/scores_sampled"  # mean score of every response sampled this step, dropped too
)
ENV_TURNS = "env/turns"  # episodes (environment): the policy's turns per episode
ENV_REWARD = "env/reward"  # the environment's reward per episode (the sum over its turns)
ENV_DONE = "env/done_rate"  # episodes the environment ended (not a limit)
ENV_ERRORS = "env/error_rate"  # episodes ended by an environment that raised or timed out
ENV_TOOL_CALLS = "env/tool_calls"  # tool environments: tool calls per episode
ENV_TOOL_CALL_RATE = "env/tool_call_rate"  # episodes with at least one tool call
ENV_TOOL_ANSWER_USED = "env/tool_answer_used"  # episodes whose final answer is a number a tool returned
VAL_CLIPFRAC = "val/clipfrac"
VAL_EXPLAINED_VARIANCE = "val/explained_variance"  # 1 - Var(R - V) / Var(R)
VAL_MEAN = "val/mean"

# lengths and times
RESPONSE_LENGTH = "response_length"  # tokens per response
EOS_RATE = "eos_rate"  # responses that ended with EOS
TIME_GENERATE = "time/generate"
TIME_SCORE = "time/score"
TIME_TRAIN = "time/train"
TIME_TEACHER = "time/teacher"  # teacher_model_path: the teacher's forwards
TIME_TEACHER_SHARE = "time/teacher_share"  # time/teacher / time/step
TIME_STEP = "time/step"  # the whole step
TIME_PHASES = (
    TIME_GENERATE,
    TIME_SCORE,
    TIME_TEACHER,
    TIME_TRAIN,
)  # they add up to the step, but for bookkeeping
TOKENS_PER_S = "tokens_per_s"  # response tokens over every process per second of the step

# ppo/metrics.json: the last step's line and the run's summary (`stages.ppo.summarize_history`)
SCORES_FIRST = "scores_first"  # objective/scores of the first step
SCORES_STD_FIRST = "scores_std_first"
SCORES_LAST = "scores_last"
KL_LAST = "kl_last"
KL_TARGET = "kl_target"  # the config's (the adaptive controller's aim)
TIME_PER_STEP_S = "time_per_step_s"
# the reward-hacking alarm over the held-out evaluations (`hacking.watch_fields`, eval_log.jsonl's lines): the
# step where it fired (None: quiet), its rules there, the step of the best gold (or accuracy); whether
# stop_on_alarm stopped the run there, and the step of the policy the run returned (keep_best: best_step's)
ALARM_STEP, ALARM_RULES, ALARM_REASONS, BEST_STEP = hacking.WATCH_KEYS
STOPPED_ON_ALARM = "stopped_on_alarm"
RETURNED_STEP = "returned_step"

# ppo/samples.jsonl: a few responses logged every log_samples_every steps (`llm_rlhf.stages.ppo.log_samples`), with STEP
SAMPLE_QUERY = "query"
SAMPLE_RESPONSE = "response"
SAMPLE_SCORE = "score"  # the score PPO gave it
