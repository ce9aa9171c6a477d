"""The synthetic run folders of the report tests (tests/interfaces/test_report*.py), and what they read back
from a report: `make_run` writes every file a finished pipeline run (SFT -> RM -> PPO -> eval) writes, with
small fake logs; `between` cuts a piece of report.html, `visible_titles` reads a figure's panels.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import write_jsonl

IMG = "data:image/png;base64,"  # an image embedded in report.html
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"  # the first bytes of a PNG file


def write_file(path: Path, text: str) -> None:
    """`text` in `path` (UTF-8), its folders made as needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


# eval/metrics.json of a run without a reward function or an ensemble (their keys null or absent), as
# `llm-rlhf eval` writes it
EVAL_METRICS = {
    "gold_win_rate": 0.62,
    "gold_win_rate_stderr": 0.031,
    "sentiment_win_rate": 0.7,
    "sentiment_win_rate_stderr": 0.03,
    "rm_win_rate": 0.8,
    "rm_win_rate_stderr": 0.025,
    "reward_fn_win_rate": None,
    "reward_fn_win_rate_stderr": None,
    "combined_win_rate": None,
    "combined_win_rate_stderr": None,
    "gold_score_mean": 0.3,
    "gold_score_stderr": 0.05,
    "sentiment_mean": 0.9,
    "sentiment_stderr": 0.06,
    "rm_score_mean": 1.1,
    "rm_score_stderr": 0.1,
    "reward_fn_mean": None,
    "reward_fn_stderr": None,
    "combined_score_mean": None,
    "combined_score_stderr": None,
    "kl_to_ref": 4.2,
    "kl_to_ref_stderr": 0.3,
    "kl_to_ref_at_temperature": 4.2,
    "kl_to_ref_at_temperature_stderr": 0.3,
    "fluency_perplexity": 61.0,
    "response_length_mean": 12.5,
    "eos_rate": 0.97,
    "distinct_1": 0.4,
    "distinct_2": 0.8,
    "char_run_rate": 0.125,
    "repeated_ngram_rate": 0.0625,
    "empty_rate": 0.0,
    "gold_score_mean_baseline": 0.1,
    "gold_score_stderr_baseline": 0.04,
    "sentiment_mean_baseline": 0.5,
    "sentiment_stderr_baseline": 0.05,
    "rm_score_mean_baseline": -0.1,
    "rm_score_stderr_baseline": 0.1,
    "reward_fn_mean_baseline": None,
    "reward_fn_stderr_baseline": None,
    "combined_score_mean_baseline": None,
    "combined_score_stderr_baseline": None,
    "kl_to_ref_baseline": 0.0,
    "kl_to_ref_stderr_baseline": 0.0,
    "kl_to_ref_at_temperature_baseline": 0.0,
    "kl_to_ref_at_temperature_stderr_baseline": 0.0,
    "fluency_perplexity_baseline": 55.0,
    "response_length_mean_baseline": 11.0,
    "eos_rate_baseline": 0.98,
    "distinct_1_baseline": 0.45,
    "distinct_2_baseline": 0.85,
    "char_run_rate_baseline": 0.0,
    "repeated_ngram_rate_baseline": 0.0,
    "empty_rate_baseline": 0.0,
    "num_prompts": 25,
    "samples_per_prompt": 1,
    "num_pairs": 25,
    "policy_path": "runs/x/ppo",
    "baseline_path": "runs/x/sft",
    "reward_model_path": "runs/x/rm",
    "reward_fn": None,
    "reward_fn_weight": 1.0,
    "gold_judge": "data/reviews/gold.json",
    "gold_judge_heldout_accuracy": 0.83,
    "gold_judge_validity": {
        "file": "data/reviews/gold_test.jsonl",
        "sentences": 1053,
        "gold_prefers_real_over_shuffled": 0.998,
        "gold_prefers_real_over_repeated": 0.935,
        "gold_prefers_real_over_salad": 0.928,
        "sentiment_prefers_real_over_shuffled": 0.504,
        "sentiment_prefers_real_over_repeated": 0.49,
        "sentiment_prefers_real_over_salad": 0.016,
        "fluency_nll_real_median": 4.52,
        "fluency_nll_shuffled_median": 7.88,
        "fluency_nll_repeated_median": 5.02,
        "fluency_nll_salad_median": 8.13,
        "pairs": 884,
        "gold_agrees_with_people": 0.838,
        "sentiment_agrees_with_people": 0.862,
    },
    "temperature": 1.0,
    "seed": 0,
    "time_s": 20.0,
}


VALUE_KEYS = ("loss/value", "val/clipfrac", "val/explained_variance", "val/mean")  # gae alone logs these


def make_run(
    run: Path,
    *,
    kl_coef: float = 0.1,
    steps: int = 12,
    estimator: str = "gae",
    k: int = 1,
    distill: bool = False,
) -> Path:
    """Every file a finished pipeline run writes, with small fake logs. A critic-free `estimator` logs no
    value statistics and its ppo/config.yaml names it (a gae run's config, as before the key existed, does not);
    `distill`: on-policy distillation's keys too (the reverse KL to the teacher, the teacher's seconds)."""
    sft_metrics = {"eval_loss": 2.1, "eval_perplexity": 8.17, "eos_rate": 0.97}
    rm_metrics = {"eval_accuracy": 0.71, "eval_margin": 0.9, "baseline_accuracy": 0.66, "score_mean": 0.1}
    history = []
    for step in range(1, steps + 1):
        kl = 0.5 * step / (1 + 10 * kl_coef)
        history.append(
            {
                "step": step,
                "episodes": 16 * step,
                "objective/scores": 0.1 * step,
                "objective/scores_std": 0.5,
                "objective/kl": kl,
                "objective/kl_coef": kl_coef,
                "objective/non_score_reward": -kl_coef * kl,
                "objective/rlhf_reward": 0.1 * step - kl_coef * kl,
                "objective/entropy": 20.0 - step,
                "val/explained_variance": 0.05 * step,
                "val/mean": 0.2,
                "response_length": 12.0 + step % 3,
                "eos_rate": 0.9,
                "time/generate": 1.0,
                "time/score": 0.2,
                "time/train": 2.0,
                "time/step": 3.4,
                "tokens_per_s": 60.0,
                "policy/approxkl": 0.01,
                "policy/clipfrac": 0.05,
                "loss/policy": -0.01,
                "loss/value": 0.3 / step,
                "val/clipfrac": 0.1,
                "policy/entropy": 2.5,
                "policy/ratio": 1.0,
                "lr": 1e-5,
            }
        )
    if estimator != "gae":
        history = [{k: v for k, v in row.items() if k not in VALUE_KEYS} for row in history]
    if distill:
        for row in history:
            row.update(
                {
                    "objective/distill_kl": 0.5 / row["step"],
                    "time/teacher": 0.4,
                    "time/teacher_share": 0.4 / 3.4,
                }
            )
            row["time/step"] = 3.8
    ppo_metrics = {
        **history[-1],
        "scores_first": 0.1,
        "scores_last": 0.1 * steps,
        "kl_last": history[-1]["objective/kl"],
        "kl_target": 6.0,
    }
    eval_metrics = EVAL_METRICS
    write_file(
        run / "pipeline.json",
        json.dumps(
            {
                "sft": {"wall_time_s": 60.0, "metrics": sft_metrics},
                "rm": {"wall_time_s": 30.0, "metrics": rm_metrics},
                "ppo": {"wall_time_s": 300.0, "metrics": ppo_metrics},
                "eval": {"wall_time_s": 20.0, "metrics": eval_metrics},
            }
        ),
    )
    write_file(
        run / "pipeline_config.yaml",
        f"output_dir: {run}\nstages: [sft, rm, ppo, eval]\nppo:\n  init_kl_coef: {kl_coef}\n",
    )
    for stage, metrics in (
        ("sft", sft_metrics),
        ("rm", rm_metrics),
        ("ppo", ppo_metrics),
        ("eval", eval_metrics),
    ):
        write_file(run / stage / "metrics.json", json.dumps(metrics))
        write_file(
            run / stage / "config.yaml", f"output_dir: {run / stage}\nseed: 0\nmarker_{stage}: yes-{stage}\n"
        )
    ppo_config = f"output_dir: {run / 'ppo'}\ninit_kl_coef: {kl_coef}\nkl_target: 6.0\n"
    if estimator != "gae":
        ppo_config += f"advantage_estimator: {estimator}\nsamples_per_prompt: {k}\n"
    write_file(run / "ppo" / "config.yaml", ppo_config)
    sft_log = [{"loss": 3.0 - 0.1 * s, "step": s, "learning_rate": 1e-4} for s in range(1, 11)]
    sft_log += [
        {"eval_loss": 2.5, "step": 5},
        {"eval_loss": 2.1, "step": 10},
        {"train_loss": 2.5, "step": 10},
    ]
    write_file(run / "sft" / "train_log.json", json.dumps(sft_log))
    rm_log = [
        {"loss": 0.7 - 0.02 * s, "accuracy": 0.5 + 0.02 * s, "margin": 0.1 * s, "step": s}
        for s in range(1, 11)
    ]
    rm_log += [{"eval_loss": 0.6, "eval_accuracy": 0.71, "eval_margin": 0.9, "step": 10}]
    write_file(run / "rm" / "train_log.json", json.dumps(rm_log))
    write_jsonl(run / "ppo" / "metrics.jsonl", history)
    write_jsonl(
        run / "ppo" / "samples.jsonl",
        [
            {"step": s, "query": f"The film q{s}{i}", "response": f" resp{s}{i}", "score": 0.1 * s}
            for s in (1, steps)
            for i in range(2)
        ],
    )
    write_jsonl(
        run / "ppo" / "eval_log.jsonl",
        [
            {"step": s, "kl": 0.5 * s, "rm_score": 0.2 * s, "gold_score": 0.1 * s - 0.01 * s * s}
            for s in range(0, steps + 1, 3)
        ],
    )
    write_jsonl(
        run / "eval" / "samples.jsonl",
        [
            {
                "prompt": f"Prompt number {i}",
                "sample": 0,
                "policy_response": f" great movie {i}",
                "baseline_response": f" bad {i}",
                "policy_gold_score": 0.9 - 0.01 * i,
                "baseline_gold_score": 0.2,
                "policy_rm_score": 1.5 + 0.02 * i,
                "baseline_rm_score": -0.3 + 0.01 * i,
                "policy_reward_fn": None,
                "baseline_reward_fn": None,
                "policy_combined_score": None,
                "baseline_combined_score": None,
                "policy_length": 4,
                "baseline_length": 3,
                "policy_eos": True,
                "baseline_eos": i % 2 == 0,
            }
            for i in range(25)
        ],
    )
    return run


def visible_titles(fig) -> list[str]:
    """The titles of a figure's visible panels."""
    return [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title()]


def between(text: str, start: str, end: str = "</table>") -> str:
    """The part of text from the first `start` to the `end` after it."""
    i = text.index(start)
    return text[i : text.index(end, i)]
