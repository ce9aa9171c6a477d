"""Score prompt/response rows with the gold evaluation, to see what it rewards (the `judge` command).

    llm-rlhf judge --input_file samples.jsonl --output_file judged.jsonl [--gold_judge data/reviews/gold.json]

Each input row (JSONL/JSON/CSV/Parquet) needs a string `prompt` and a string `response` (either may be
empty: a policy can stop at once); other fields are kept. Instead of `prompt`, a row may hold chat
`messages`: the prompt is then every turn before the last assistant turn rendered with the chat template
of `--tokenizer` (the policy's), the text `llm-rlhf ppo` and `eval` sample from, and the output row gets it
as `prompt`; the response stays in `response`. Each output row adds `gold_score` and, when the
judge reports them (the fluency-aware gold does), `sentiment`, `fluency_nll` and `fluency_perplexity`.
The scores come from `judge_details`, the call `llm-rlhf eval` makes, so both give the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from llm_rlhf.core.config import help_field, require
from llm_rlhf.core.data import chat_prompt, read_records
from llm_rlhf.core.errors import DataError, UserError
from llm_rlhf.core.utils import atomic_write_text
from llm_rlhf.models.gold import judge_details, load_judge
from llm_rlhf.models.loading import load_tokenizer


@dataclasses.dataclass
class Config:
    input_file: str = dataclasses.field(
        metadata={
            "help": "JSONL/JSON/CSV/Parquet rows with `prompt` (or chat `messages`) and `response` (other "
            "fields are kept)."
        }
    )
    output_file: str = dataclasses.field(metadata={"help": "Where the judged rows go (JSONL)."})
    gold_judge: str = help_field(
        "data/reviews/gold.json",
        "The gold judge: a judge JSON (fluency-aware or sentiment-only), 'module:function' or 'module:Class'.",
    )
    show: int = help_field(3, "Print this many of the highest and of the lowest judged rows (0 = none).")
    tokenizer: str | None = help_field(
        None,
        "For rows given as chat `messages`: the model (HF folder or hub name) whose tokenizer's chat template "
        "renders them, the policy's (null = every row has a `prompt`).",
    )

    def __post_init__(self):
        require(self.show >= 0, "show", "must be >= 0")
        require(
            self.gold_judge.strip().lower() not in ("", "none", "null"), "gold_judge", "must name a judge"
        )


def read_rows(path: str, tokenizer: str | None = None) -> list[dict]:
    """Rows with string `prompt` and `response` (empty allowed), checked row by row before any scoring. A row
    with chat `messages` and no `prompt` gets the prompt rendered with `tokenizer`'s chat template."""
    file, rows, numbers = read_records(path)  # as read: a bad `messages` row is ours to name, not Arrow's
    chat = None
    for number, row in zip(numbers, rows):
        if row.get("prompt") is None and row.get("messages") is not None:
            if chat is None:
                chat = chat_tokenizer(tokenizer, path)
            row["prompt"] = chat_prompt(chat, row, file=file, row=number)
        for field in ("prompt", "response"):
            value = row.get(field)
            if not isinstance(value, str):
                got = "missing (or null)" if value is None else f"expected a string, got {value!r:.40}"
                raise DataError(got, file=file, row=number, field=field)
    return rows


def chat_tokenizer(tokenizer: str | None, path: str):
    """The tokenizer whose chat template renders `messages` rows: `--tokenizer`, which must have one."""
    if tokenizer is None:
        raise UserError(
            f"'{path}' has rows with chat `messages` and no `prompt`: set --tokenizer to the policy's model, "
            "whose chat template renders them"
        )
    loaded = load_tokenizer(tokenizer)
    if not getattr(loaded, "chat_template", None):
        raise UserError(
            f"tokenizer '{tokenizer}' has no chat template to render the `messages` rows of '{path}'"
        )
    return loaded


def run(cfg: Config) -> dict[str, float]:
    """Check the input, load the judge, judge every row, write output_file, print a summary."""
    rows = read_rows(cfg.input_file, cfg.tokenizer)
    output = Path(cfg.output_file)
    if output.is_dir():
        raise UserError(f"output_file '{output}' is a folder")
    judge = load_judge(cfg.gold_judge)
    prompts, responses = [r["prompt"] for r in rows], [r["response"] for r in rows]
    parts = judge_details(judge, prompts, responses)
    judged = [{**row, **{k: v[i] for k, v in parts.items()}} for i, row in enumerate(rows)]
    atomic_write_text(output, "".join(json.dumps(r) + "\n" for r in judged))

    summary = {"rows": len(rows)}
    for key, values in parts.items():
        summary[f"{key}_mean"] = statistics.fmean(values)
    if "fluency_nll" in parts:
        summary["fluency_perplexity_median"] = statistics.median(parts["fluency_perplexity"])
    order = sorted(range(len(rows)), key=lambda i: parts["gold_score"][i], reverse=True)
    shown = order[: cfg.show] + order[max(cfg.show, len(order) - cfg.show) :] if cfg.show else []
    for i in shown:
        extra = "".join(f"  {k} {parts[k][i]:.3g}" for k in ("sentiment", "fluency_perplexity") if k in parts)
        print(f"{parts['gold_score'][i]:+7.3f}{extra}  {prompts[i]!r} -> {responses[i]!r}")
    print(json.dumps(summary), flush=True)
    print(f"wrote {len(rows)} judged rows to {output}", flush=True)
    return summary
