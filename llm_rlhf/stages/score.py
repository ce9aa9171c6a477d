"""Score a JSONL of prompt/response pairs with a saved reward model, to see what it rewards.

    llm-rlhf score --model_path runs/reviews/rm --input_file pairs.jsonl --output_file scored.jsonl

Each input row needs `prompt` (a string, may be empty) and `response`; other fields are kept. Each output
row is the input row plus `score` (normalised with the RM's stored mean/std: roughly N(0, 1) on its
reference set) and `raw_score`. The highest and lowest scored rows are printed at the end.
From Python: `score_texts(load_reward_model(path), prompts, responses)`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from llm_rlhf.core.config import help_field, require
from llm_rlhf.core.data import check_text, load_rows
from llm_rlhf.core.errors import DataError, UserError
from llm_rlhf.core.utils import atomic_write_text
from llm_rlhf.models.reward_model import load_reward_model, score_pairs


@dataclasses.dataclass
class Config:
    input_file: str = dataclasses.field(
        metadata={"help": "JSONL/JSON/CSV/Parquet rows with `prompt` and `response` (other fields are kept)."}
    )
    output_file: str = dataclasses.field(metadata={"help": "Where the scored rows go (JSONL)."})
    model_path: str = help_field("runs/reviews/rm", "A reward model folder written by `llm-rlhf rm`.")
    batch_size: int = help_field(32, "Sequences per forward pass.")
    max_length: int | None = help_field(
        None, "Keep at most the last N tokens of prompt + response + EOS (null = the model's maximum)."
    )
    dtype: str = help_field("float32", "Weights dtype: float32, bfloat16 or float16.")
    trust_remote_code: bool = help_field(False, "Allow model/tokenizer code from the hub.")
    show: int = help_field(3, "Print this many of the highest and of the lowest scored rows (0 = none).")

    def __post_init__(self):
        require(self.batch_size >= 1, "batch_size", "must be >= 1")
        require(self.max_length is None or self.max_length >= 2, "max_length", "must be >= 2 (or null)")
        require(
            self.dtype in ("float32", "bfloat16", "float16"), "dtype", "must be float32, bfloat16 or float16"
        )
        require(self.show >= 0, "show", "must be >= 0")


def score_texts(
    model,
    prompts: list[str],
    responses: list[str],
    batch_size: int = 32,
    *,
    max_length: int | None = None,
    progress: bool = False,
) -> list[float]:
    """Normalised RM scores of (prompt, response) pairs, batched; one float per pair, in input order.
    `model` is a `RewardModel` (from `load_reward_model`)."""
    scores = score_pairs(
        model,
        list(prompts),
        list(responses),
        batch_size=batch_size,
        normalize=True,
        max_length=max_length,
        progress=progress,
    )
    return scores.tolist()


def read_pairs(path: str) -> list[dict]:
    """Rows with a string `prompt` (may be empty) and a non-empty string `response`, checked row by row."""
    rows = load_rows(path).to_list()
    for number, row in enumerate(rows, start=1):
        if not isinstance(row.get("prompt"), str):
            got = (
                "missing (or null)"
                if row.get("prompt") is None
                else f"expected a string, got {row['prompt']!r:.40}"
            )
            raise DataError(got, file=path, row=number, field="prompt")
        check_text(row.get("response"), file=path, row=number, field="response")
    return rows


def run(cfg: Config) -> dict[str, float]:
    """Check the input, load the RM, score every row, write output_file, print a summary."""
    rows = read_pairs(cfg.input_file)
    output = Path(cfg.output_file)
    if output.exists() and output.is_dir():
        raise UserError(f"output_file '{output}' is a folder")
    model = load_reward_model(cfg.model_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    if model.normalization is None:
        print(f"note: '{cfg.model_path}' stores no normalisation: score == raw_score", flush=True)

    prompts, responses = [r["prompt"] for r in rows], [r["response"] for r in rows]
    raw = score_pairs(
        model,
        prompts,
        responses,
        batch_size=cfg.batch_size,
        normalize=False,
        max_length=cfg.max_length,
        progress="scoring",
    )
    scores = (raw - model.mean) / model.std  # (N,)
    lines = [
        json.dumps({**row, "score": float(s), "raw_score": float(r)}) + "\n"
        for row, s, r in zip(rows, scores, raw)
    ]
    atomic_write_text(output, "".join(lines))

    summary = {
        "rows": len(rows),
        "score_mean": float(scores.mean()),
        "score_std": float(scores.std(unbiased=False)),
        "score_min": float(scores.min()),
        "score_max": float(scores.max()),
    }
    first = {}  # one row per distinct (prompt, response): rows often repeat a response
    for i in torch.argsort(scores, descending=True).tolist():
        first.setdefault((prompts[i], responses[i]), i)
    order = list(first.values())  # highest score first
    shown = order[: cfg.show] + order[max(cfg.show, len(order) - cfg.show) :] if cfg.show else []
    for i in shown:
        print(f"{float(scores[i]):+7.3f}  {prompts[i]!r} -> {responses[i]!r}")
    print(json.dumps(summary), flush=True)
    print(f"wrote {len(rows)} scored rows to {output}", flush=True)
    return summary
