"""Section 4: the final evaluation, policy vs baseline (eval/metrics.json, eval/samples.jsonl): the table of
figures with paired standard errors, the gold's validity checks, the before / after samples.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from llm_rlhf.evaluation import hacking, metric_names
from llm_rlhf.evaluation.metric_names import (
    ACCURACY,
    ACCURACY_FN,
    ACCURACY_GREEDY,
    ACCURACY_GREEDY_STDERR,
    ACCURACY_STDERR,
    BASELINE_PATH,
    COMBINED_SCORE,
    COMBINED_SCORE_MEAN,
    COMBINED_SCORE_STDERR,
    COMBINED_WIN_RATE,
    CORRECT,
    DISTINCT_1,
    DISTINCT_2,
    EOS,
    EOS_RATE,
    FLUENCY_PERPLEXITY,
    GOLD_JUDGE,
    GOLD_JUDGE_HELDOUT_ACCURACY,
    GOLD_SCORE,
    GOLD_SCORE_MEAN,
    GOLD_SCORE_STDERR,
    GOLD_WIN_RATE,
    GREEDY_CORRECT,
    KL_TO_REF,
    KL_TO_REF_AT_TEMPERATURE,
    KL_TO_REF_AT_TEMPERATURE_STDERR,
    KL_TO_REF_STDERR,
    LENGTH,
    NUM_PAIRS,
    NUM_PROMPTS,
    POLICY_PATH,
    RESPONSE_LENGTH_MEAN,
    REWARD_FN,
    REWARD_FN_MEAN,
    REWARD_FN_STDERR,
    REWARD_FN_WIN_RATE,
    RM_DISAGREEMENT_MEAN,
    RM_SCORE,
    RM_SCORE_MEAN,
    RM_SCORE_STDERR,
    RM_WIN_RATE,
    SAMPLES_PER_PROMPT,
    SEED,
    SENTIMENT,
    SENTIMENT_MEAN,
    SENTIMENT_STDERR,
    SENTIMENT_WIN_RATE,
    TEMPERATURE,
)
from llm_rlhf.interfaces.report.numbers import num
from llm_rlhf.interfaces.report.page import (
    Page,
    num_cell,
    pct,
    skip_section,
    skipped_note,
    table,
    wall_time_line,
)
from llm_rlhf.interfaces.report.runs import Run, baseline_name, config_value, planned
from llm_rlhf.interfaces.report.samples import SAMPLE_ROWS, pair_samples_table, sample_value


def gold_note(run: Run) -> str | None:
    """Which LM the fluency-aware gold of this run's evaluation reads fluency with, and whether that LM is
    the run's own base model (the SFT stage started from it) or one that no stage trained. None when the
    gold is not a judge JSON with a fluency model, or its file cannot be found from here."""
    try:
        spec = config_value(run, "eval", "gold_judge")
        base = config_value(run, "sft", "model_name_or_path")
        path = Path(str(spec))
        gold = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError, OSError, AttributeError):
        return None
    if not isinstance(gold, dict) or "fluency_model" not in gold:
        return None
    lm = (path.parent / str(gold["fluency_model"])).resolve()
    own = base is not None and (
        Path(str(base)).resolve() == lm or str(base) == gold.get("fluency_model_hub_name")
    )
    if own:
        return (
            f"The gold ({spec}) reads fluency with {lm.name}, the base model this run's SFT stage started "
            f'from: fluency here means "still reads like {lm.name}", not independent English. The gold\'s '
            "sentiment part is independent of every model of the run."
        )
    return f"The gold ({spec}) reads fluency with {lm.name}, an LM that no stage of this run trained."


@dataclass(frozen=True)
class EvalRow:
    """A row of the evaluation table: `key` in eval/metrics.json (the baseline's is key + BASELINE), its
    standard error `stderr` (+ BASELINE), the win rate `win` (its standard error win + STDERR), and
    `sample`, the eval/samples.jsonl field (policy_<sample>, baseline_<sample>) whose paired differences give
    the standard error of the difference."""

    label: str
    key: str
    stderr: str | None = None
    win: str | None = None
    sample: str | None = None


MEMBERS = metric_names.RM_SCORE_MEMBER + "*"  # stands for every ensemble member's row (`eval_groups`)
PASS_AT = metric_names.PASS_AT + "*"  # stands for a row per pass@k the evaluation reported

EVAL_GROUPS: tuple[tuple[str, tuple[EvalRow, ...]], ...] = (
    (
        "Held-out accuracy (a task with a verifier: the fraction of responses it scores correct)",
        (
            EvalRow("accuracy, sampled (the run's sampling)", ACCURACY, ACCURACY_STDERR, sample=CORRECT),
            EvalRow(
                "accuracy, greedy (one response per prompt)",
                ACCURACY_GREEDY,
                ACCURACY_GREEDY_STDERR,
                sample=GREEDY_CORRECT,
            ),
            EvalRow("pass@k", PASS_AT),
        ),
    ),
    (
        "Gold judge (stands in for people)",
        (EvalRow("gold score", GOLD_SCORE_MEAN, GOLD_SCORE_STDERR, GOLD_WIN_RATE, GOLD_SCORE),),
    ),
    (
        "Sentiment (the gold's sentiment part: predicted mean human rating)",
        (EvalRow("sentiment", SENTIMENT_MEAN, SENTIMENT_STDERR, SENTIMENT_WIN_RATE, SENTIMENT),),
    ),
    (
        "Fluency (perplexity under the gold's LM; lower reads more fluent)",
        (EvalRow("fluency perplexity", FLUENCY_PERPLEXITY),),
    ),
    (
        "Reward model, ensemble and reward function (the proxy PPO maximised)",
        (
            EvalRow("RM score (normalised)", RM_SCORE_MEAN, RM_SCORE_STDERR, RM_WIN_RATE, RM_SCORE),
            EvalRow("RM member", MEMBERS),
            EvalRow("RM members' disagreement (std)", RM_DISAGREEMENT_MEAN),
            EvalRow("reward function", REWARD_FN_MEAN, REWARD_FN_STDERR, REWARD_FN_WIN_RATE, REWARD_FN),
            EvalRow(
                "combined score (PPO's score)",
                COMBINED_SCORE_MEAN,
                COMBINED_SCORE_STDERR,
                COMBINED_WIN_RATE,
                COMBINED_SCORE,
            ),
        ),
    ),
    (
        "KL to the reference (nats / response)",
        (
            EvalRow("KL, temperature 1", KL_TO_REF, KL_TO_REF_STDERR, sample=KL_TO_REF),
            EvalRow(
                "KL at the sampling temperature", KL_TO_REF_AT_TEMPERATURE, KL_TO_REF_AT_TEMPERATURE_STDERR
            ),
        ),
    ),
    (
        "Length and EOS",
        (
            EvalRow("response length (tokens, EOS included)", RESPONSE_LENGTH_MEAN, sample=LENGTH),
            EvalRow("EOS rate (responses that stop)", EOS_RATE, sample=EOS),
        ),
    ),
    (
        "Diversity (unique / total token n-grams over all responses)",
        (
            EvalRow("distinct-1", DISTINCT_1),
            EvalRow("distinct-2", DISTINCT_2),
        ),
    ),
    (
        "Degeneracy (fraction of responses; signs of reward hacking)",
        (
            EvalRow("a run of one character (4+)", hacking.CHAR_RUN_RATE),
            EvalRow("a repeated word 3-gram", hacking.REPEATED_NGRAM_RATE),
            EvalRow("empty", hacking.EMPTY_RATE),
        ),
    ),
    (
        "Collapse (onto one phrase: the reward-hacking alarm's counters, `llm_rlhf.evaluation.hacking`)",
        (
            EvalRow("the response to another prompt too (fraction)", metric_names.DUPLICATE_RATE),
            EvalRow("the most frequent word bigram's share", metric_names.TOP_BIGRAM_SHARE),
            EvalRow("holding the most shared word bigram (fraction)", metric_names.SHARED_BIGRAM_RATE),
            EvalRow("word distinct-2", metric_names.WORD_DISTINCT_2),
            EvalRow(
                "one same response to several prompts (largest fraction)", metric_names.TOP_RESPONSE_SHARE
            ),
            EvalRow("copies its prompt (fraction)", metric_names.ECHO_RATE),
        ),
    ),
)


def paired_stderr(samples: list[dict] | None, field_name: str | None) -> float | None:
    """Standard error of the mean paired difference policy_<field> - baseline_<field> over the samples
    (sample std / sqrt(n)); None without at least two samples that hold both. A sample that holds neither is
    no pair (the greedy response is on a prompt's first sample alone); one that holds one side alone gives None."""
    if not samples or field_name is None:
        return None
    diffs = [
        (
            sample_value(s.get(metric_names.side("policy", field_name))),
            sample_value(s.get(metric_names.side("baseline", field_name))),
        )
        for s in samples
    ]
    diffs = [pair for pair in diffs if pair != (None, None)]
    if len(diffs) < 2 or any(a is None or b is None for a, b in diffs):
        return None
    return float(np.std([a - b for a, b in diffs], ddof=1) / math.sqrt(len(diffs)))


def eval_groups(metrics: dict, samples: list[dict] | None = None) -> list[tuple[str, list[dict]]]:
    """The evaluation table's groups and rows, every row a dict: label, key, policy, baseline, difference,
    diff_stderr, paired (whether diff_stderr comes from the paired samples), win, win_stderr. A row whose
    policy and baseline are both absent (null: not measured) is left out, and so is a group with no row; the
    KL at the sampling temperature is left out at temperature 1 (it is the KL above)."""
    groups = []
    for title, specs in EVAL_GROUPS:
        rows = [eval_row(row, metrics, samples) for spec in specs for row in expand(spec, metrics)]
        rows = [row for row in rows if row is not None]
        if rows:
            groups.append((title, rows))
    return groups


def pass_at_logged(records) -> list[tuple[int, tuple[str, str]]]:
    """(k, (pass_at_<k>, pass_at_<k>_stderr)) of each pass@k that some of the records (eval/metrics.json, the
    lines of eval_log.jsonl) holds a number for, in order of k."""
    ks = {
        int(key.removeprefix(metric_names.PASS_AT))
        for record in records or ()
        for key, value in record.items()
        if key.startswith(metric_names.PASS_AT)
        and key.removeprefix(metric_names.PASS_AT).isdigit()
        and num(value) is not None
    }
    return [(k, metric_names.pass_at_keys(k)) for k in sorted(ks)]


def expand(spec: EvalRow, metrics: dict) -> list[EvalRow]:
    """The rows one spec of EVAL_GROUPS stands for: MEMBERS a row per ensemble member (none without an
    ensemble), PASS_AT a row per pass@k reported, the KL at the sampling temperature none at temperature 1, any other spec itself."""
    if spec.key == MEMBERS:
        members = sorted(
            (
                k.removesuffix("_mean")
                for k in metrics
                if k.startswith(metric_names.RM_SCORE_MEMBER) and k.endswith("_mean")
            ),
            key=lambda k: int(k.rsplit("_", 1)[1]),
        )
        return [EvalRow(f"RM member {k.rsplit('_', 1)[1]}", f"{k}_mean") for k in members]
    if spec.key == PASS_AT:
        return [
            EvalRow(
                f"pass@{k} (unbiased, from {metrics.get(metric_names.SAMPLES_PER_PROMPT)} samples)", *keys
            )
            for k, keys in pass_at_logged([metrics])
        ]
    if (
        spec.key == metric_names.KL_TO_REF_AT_TEMPERATURE
        and num(metrics.get(metric_names.TEMPERATURE)) == 1.0
    ):
        return []
    return [spec]


def eval_row(row: EvalRow, metrics: dict, samples: list[dict] | None) -> dict | None:
    """One row of `eval_groups`; None when neither the policy's nor the baseline's figure was measured."""
    baseline_of = metric_names.BASELINE
    policy, baseline = num(metrics.get(row.key)), num(metrics.get(row.key + baseline_of))
    if policy is None and baseline is None:
        return None
    both = policy is not None and baseline is not None
    paired = paired_stderr(samples, row.sample) if both else None
    se = [num(metrics.get(f"{row.stderr}{s}")) if row.stderr else None for s in ("", baseline_of)]
    unpaired = math.hypot(*se) if both and None not in se else None
    return {
        "label": row.label,
        "key": row.key,
        "policy": policy,
        "baseline": baseline,
        "difference": policy - baseline if both else None,
        "diff_stderr": paired if paired is not None else unpaired,
        "paired": paired is not None,
        "win": num(metrics.get(row.win)) if row.win else None,
        "win_stderr": num(metrics.get(row.win + metric_names.STDERR)) if row.win else None,
    }


def eval_table(metrics: dict, samples: list[dict] | None) -> str:
    """metric | policy | baseline | difference | ± stderr | win rate | ± stderr, one header row per group."""
    head = "".join(
        f"<th>{h}</th>"
        for h in ("metric", "policy", "baseline", "difference", "± stderr", "win rate", "± stderr")
    )
    body = []
    for title, rows in eval_groups(metrics, samples):
        body.append(f'<tr class="group"><th colspan="7">{html.escape(title)}</th></tr>')
        for r in rows:
            stderr = num_cell(r["diff_stderr"], ".2g")
            if r["diff_stderr"] is not None and not r["paired"]:
                stderr = stderr.replace("</td>", "†</td>")
            body.append(
                f'<tr><td>{html.escape(r["label"])}<span class="key">{html.escape(r["key"])}</span></td>'
                + num_cell(r["policy"])
                + num_cell(r["baseline"])
                + num_cell(r["difference"], "+.4g")
                + stderr
                + num_cell(r["win"], ".1%")
                + num_cell(r["win_stderr"], ".1%")
                + "</tr>"
            )
    return f'<table class="eval">\n<tr>{head}</tr>\n' + "\n".join(body) + "\n</table>"


VALIDITY_CHECKS = (  # (suffix of the validity keys, what the gold is asked to prefer)
    ("shuffled", "the real sentence to its continuation's words shuffled"),
    ("repeated", "the real sentence to its most positive word written four times"),
    ("salad", "the real sentence to praise salad (its words shuffled, two praise words put in)"),
)


def validity_table(validity: dict) -> str:
    """The fluency-aware gold's checks on held-out data (metrics.json: gold_judge_validity, from the judge
    JSON; `data/make_gold.py`): how often the gold, and its sentiment part alone, prefer real sentences to
    degenerate ones, and agree with people on pairs of real sentences."""
    rows = []
    for name, what in VALIDITY_CHECKS:
        gold, sentiment = (
            validity.get(f"gold_prefers_real_over_{name}"),
            validity.get(f"sentiment_prefers_real_over_{name}"),
        )
        if num(gold) is not None or num(sentiment) is not None:
            nll = validity.get(f"fluency_nll_{name}_median")
            rows.append([f"prefers {what}", pct(gold), pct(sentiment), nll])
    if num(validity.get("gold_agrees_with_people")) is not None:
        rows.append(
            [
                f"agrees with people on {validity.get('pairs', '')} pairs of real sentences",
                pct(validity.get("gold_agrees_with_people")),
                pct(validity.get("sentiment_agrees_with_people")),
                None,
            ]
        )
    if not rows:  # another judge's figures: as they are
        return table(["figure", "value"], [[k, v] for k, v in validity.items()])
    where = f"{validity.get('file', 'held-out data')}, {validity.get('sentences', '?')} sentences"
    real = num(validity.get("fluency_nll_real_median"))
    header = [
        "the gold …",
        "gold",
        "sentiment part alone",
        "median fluency NLL" + (f" (real sentences {real:.3g})" if real is not None else ""),
    ]
    return (
        f'<p class="meta">The gold\'s validity checks on held-out data ({html.escape(where)}):</p>'
        + table(header, rows, css_class="validity")
    )


def eval_meta(metrics: dict) -> str:
    """One line: how many prompts and samples, the models compared, the temperature and seed, the gold."""
    parts = []
    if metrics.get(NUM_PAIRS) is not None:
        parts.append(
            f"{metrics.get(NUM_PROMPTS)} held-out prompts × {metrics.get(SAMPLES_PER_PROMPT)} "
            f"= {metrics.get(NUM_PAIRS)} paired samples"
        )
    if metrics.get(POLICY_PATH):
        parts.append(f"policy {metrics[POLICY_PATH]} vs baseline {metrics.get(BASELINE_PATH)}")
    for key, name in ((TEMPERATURE, "temperature"), (SEED, "seed"), (GOLD_JUDGE, "gold judge")):
        if metrics.get(key) is not None:
            parts.append(f"{name} {metrics[key]}")
    accuracy = num(metrics.get(GOLD_JUDGE_HELDOUT_ACCURACY))
    if accuracy is not None:
        parts.append(f"the gold's sentiment part: held-out accuracy {accuracy:.1%}")
    if metrics.get(ACCURACY_FN):
        parts.append(f"accuracy checked by {metrics[ACCURACY_FN]}")
    return f'<p class="meta">{html.escape("; ".join(parts))}.</p>' if parts else ""


def section_eval(page: Page, run: Run) -> None:
    page.add(f'<h2 id="eval">4. Evaluation: policy vs {baseline_name(run)}</h2>', wall_time_line(run, "eval"))
    if not planned(run, "eval") and not run.metrics.get("eval") and not run.eval_samples:
        skip_section(page, run, "eval", [])
        return
    note = gold_note(run)
    if note:
        page.add(f'<p class="meta">{html.escape(note)}</p>')
    metrics = run.metrics.get("eval")
    if metrics:
        page.add(eval_meta(metrics), eval_table(metrics, run.eval_samples))
        page.add(
            '<p class="meta">difference: policy − baseline. ± stderr: the standard error of the mean paired '
            "difference over the samples (eval/samples.jsonl); † where the samples lack the figure: "
            "sqrt(se_policy² + se_baseline²), as if unpaired. Win rate: the fraction of pairs in which the "
            "policy's sample scores higher (ties count one half). Rows the run did not measure are left out.</p>"
        )
        validity = metrics.get(metric_names.GOLD_JUDGE_VALIDITY)
        if isinstance(validity, dict) and validity:
            page.add(validity_table(validity))
        page.add(
            "<details><summary>eval/metrics.json (raw)</summary>"
            f"<pre>{html.escape(json.dumps(metrics, indent=1, default=str))}</pre></details>"
        )
    else:
        page.missing(skipped_note(run, "eval", ["eval/metrics.json"]))
    page.add("<h3>Before / after samples</h3>")
    if run.eval_samples:
        page.add(
            f'<p class="meta">First {min(SAMPLE_ROWS, len(run.eval_samples))} of {len(run.eval_samples)} '
            f"held-out samples: the {baseline_name(run)}'s and the PPO policy's responses to the same prompt, "
            "with their scores (every field is in eval/samples.jsonl).</p>"
        )
        page.add(pair_samples_table(run.eval_samples, baseline=baseline_name(run)))
    else:
        page.missing(skipped_note(run, "eval", ["eval/samples.jsonl"]))
