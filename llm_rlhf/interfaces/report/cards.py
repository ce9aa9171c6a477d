"""The headline cards at the top of a run's page."""

from __future__ import annotations

import html

from llm_rlhf.evaluation import metric_names
from llm_rlhf.interfaces.report.accuracy import ACCURACY_KINDS, accuracy_points
from llm_rlhf.interfaces.report.numbers import first_of, num
from llm_rlhf.interfaces.report.page import formatted, plus_minus
from llm_rlhf.interfaces.report.runs import (
    Run,
    baseline_name,
    config_value,
    final_alarm,
    final_value,
    heldout_alarm,
    kl_target,
    planned,
    without_reward_model,
)
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.rl.estimators import DEFAULT_ESTIMATOR, ESTIMATORS


def _card(label: str, value: str, sub: str = "") -> str:
    sub_html = f'<div class="sub">{html.escape(sub)}</div>' if sub else ""
    return (
        f'<div class="card"><div class="label">{html.escape(label)}</div>'
        f'<div class="value">{html.escape(value)}</div>{sub_html}</div>'
    )


def headline_cards(run: Run) -> str:
    """The cards: SFT and RM (when part of the run), PPO's score and KL, the estimator, held-out accuracy,
    the gold's win rate and its parts, the reward-hacking alarm, the wall time."""
    accuracy = accuracy_cards(run)  # with no gold, held-out accuracy takes the gold win rate's place
    gold = final_value(run, "eval", metric_names.GOLD_WIN_RATE)
    cards = [
        *sft_rm_cards(run),
        *ppo_cards(run),
        *estimator_card(run),
        *accuracy,
        *([] if accuracy and gold is None else [gold_card(run)]),
        *gold_part_cards(run),
        *watch_cards(run),
    ]
    wall = sum(
        num((e or {}).get("wall_time_s")) or 0.0 for e in (run.pipeline or {}).values() if isinstance(e, dict)
    )
    if wall:
        cards.append(_card("Wall time", f"{wall / 60:.1f} min", "all stages"))
    return '<div class="cards">' + "".join(cards) + "</div>"


def sft_rm_cards(run: Run) -> list[str]:
    """The SFT model's EOS rate and the reward model's accuracy, each when its stage is part of the run."""
    sft_eos = final_value(run, "sft", "eos_rate")
    # held-out test pairs when the RM stage had a test_file (the figure recipes report), else the eval pairs
    rm_split = "test" if final_value(run, "rm", "test_accuracy") is not None else "eval"
    rm_acc = final_value(run, "rm", f"{rm_split}_accuracy")
    rm_base = final_value(run, "rm", "baseline_test_accuracy" if rm_split == "test" else "baseline_accuracy")
    return [
        *(
            [_card("SFT EOS rate", formatted(sft_eos, ".1%"), "responses that stop")]
            if planned(run, "sft")
            else []
        ),
        *(
            [
                _card(
                    f"RM {rm_split} accuracy",
                    formatted(rm_acc, ".1%"),
                    f"bag-of-words baseline {formatted(rm_base, '.1%')}, chance 50%"
                    if rm_base is not None
                    else "chance 50%",
                )
            ]
            if planned(run, "rm")
            else []
        ),
    ]


def ppo_cards(run: Run) -> list[str]:
    """PPO's score, first step -> last, and its KL with beta and the target."""
    first = final_value(run, "ppo", ppo_metrics.SCORES_FIRST)
    if first is None and run.ppo_history:
        first = num(run.ppo_history[0].get(ppo_metrics.OBJECTIVE_SCORES))
    last = first_of(
        final_value(run, "ppo", ppo_metrics.SCORES_LAST),
        final_value(run, "ppo", ppo_metrics.OBJECTIVE_SCORES),
    )
    kl = first_of(
        final_value(run, "ppo", ppo_metrics.KL_LAST), final_value(run, "ppo", ppo_metrics.OBJECTIVE_KL)
    )
    target = kl_target(run)
    beta = final_value(run, "ppo", ppo_metrics.OBJECTIVE_KL_COEF)
    no_rm = without_reward_model(run)
    return [
        _card(
            "PPO score" if no_rm else "PPO RM score",
            f"{formatted(first)} → {formatted(last)}",
            "first → last step" + ("; the reward function's (no reward model)" if no_rm else ""),
        ),
        _card(
            "PPO KL",
            formatted(kl),
            f"target {formatted(target)}, β = {formatted(beta)}"
            if target is not None
            else f"fixed β = {formatted(beta)}",
        ),
    ]


def gold_card(run: Run) -> str:
    """The gold's win rate against the SFT model, with the reward model's."""
    gold = final_value(run, "eval", metric_names.GOLD_WIN_RATE)
    rm_win = final_value(run, "eval", metric_names.RM_WIN_RATE)
    return _card(
        "Gold win rate",
        formatted(gold, ".1%"),
        f"vs SFT; RM win rate {formatted(rm_win, '.1%')}" if rm_win is not None else "vs SFT",
    )


def gold_part_cards(run: Run) -> list[str]:
    """The fluency-aware gold's parts: the sentiment win rate and the fluency perplexity (none without them)."""
    sentiment = final_value(run, "eval", metric_names.SENTIMENT_WIN_RATE)
    fluency = final_value(run, "eval", metric_names.FLUENCY_PERPLEXITY)
    if sentiment is None or fluency is None:
        return []
    fluency_sft = final_value(run, "eval", metric_names.FLUENCY_PERPLEXITY + metric_names.BASELINE)
    return [
        _card("Sentiment win rate", formatted(sentiment, ".1%"), "vs SFT, the gold's sentiment part alone"),
        _card(
            "Fluency perplexity", formatted(fluency), f"SFT {formatted(fluency_sft)}; lower reads more fluent"
        ),
    ]


def accuracy_cards(run: Run) -> list[str]:
    """Held-out accuracy, sampled and greedy: the final evaluation's policy vs baseline (eval/metrics.json), ±
    standard errors; without it, PPO's first → last held-out evaluation (ppo/eval_log.jsonl). None measured
    (a task without a verifier): no card."""
    cards = []
    for key, kind in ACCURACY_KINDS:
        policy = final_value(run, "eval", key)
        if policy is not None:
            baseline = plus_minus(
                final_value(run, "eval", key + metric_names.BASELINE),
                final_value(run, "eval", key + metric_names.STDERR + metric_names.BASELINE),
            )
            cards.append(
                _card(
                    f"Held-out accuracy, {kind}",
                    plus_minus(policy, final_value(run, "eval", key + metric_names.STDERR)),
                    f"policy; {baseline_name(run)} {baseline}",
                )
            )
            continue
        step, _, y, se = accuracy_points(run.eval_log, key)
        if len(step):
            cards.append(
                _card(
                    f"Held-out accuracy, {kind}",
                    f"{y[0]:.1%} → {y[-1]:.1%}",
                    f"PPO's evaluations, step {step[0]:g} → {step[-1]:g}; ± {formatted(num(se[-1]), '.1%')} last",
                )
            )
    return cards


def estimator_card(run: Run) -> list[str]:
    """The card that says how the PPO stage made its advantages (none without a PPO config)."""
    if "ppo/config.yaml" not in run.configs:
        return []
    estimator = str(config_value(run, "ppo", "advantage_estimator") or DEFAULT_ESTIMATOR)
    row = ESTIMATORS.get(estimator)  # None: a name this version does not know
    critic = "GAE over a value function" if row is not None and row.critic else "no value function"
    k = config_value(run, "ppo", "samples_per_prompt")
    sub = f"{critic}; {k} samples / prompt" if k not in (None, 1) else critic
    return [_card("Advantage estimator", str(estimator), sub)]


def watch_cards(run: Run) -> list[str]:
    """The reward-hacking alarm (`llm_rlhf.evaluation.hacking`): fired at PPO step N (its rules) or quiet over PPO's held-out
    evaluations, with the best evaluation's step and the step the run returned; else the final evaluation's
    counter rules alone. No card when neither was logged."""
    alarm, final = heldout_alarm(run), final_alarm(run)
    if alarm is None and final is None:
        return []
    parts = []
    if alarm is not None and alarm["best_step"] is not None:
        parts.append(f"best gold at step {alarm['best_step']:g}")
    if alarm is not None and alarm["returned_step"] is not None:
        parts.append(f"returned step {alarm['returned_step']:g}")
    if final is not None:
        parts.append(f"final evaluation: {', '.join(final['rules']) or 'quiet'}")
    if alarm is not None and alarm["step"] is not None:
        stopped = " (stopped)" if alarm["stopped"] else ""
        value = f"fired at step {alarm['step']:g}{stopped}"
        parts.insert(0, ", ".join(alarm["rules"]))
    elif final is not None and final["rules"]:
        value = "fired on the final evaluation"
    else:
        value = "quiet"
    return [_card("Reward-hacking alarm", value, "; ".join(parts))]
