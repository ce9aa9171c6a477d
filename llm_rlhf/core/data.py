"""The data layer: read rows from local files or the hub, detect the schema, validate every row.

Every stage reads its data through one of three loaders, each returning a `datasets.Dataset` of plain
strings:

| loader                    | columns out                 | schemas accepted (detected from the columns)          |
|---------------------------|-----------------------------|-------------------------------------------------------|
| `load_sft_dataset`        | prompt, completion          | prompt/completion; chat `messages`; `text`; HH rows   |
| `load_preference_dataset` | prompt, chosen, rejected    | prompt/chosen/rejected; HH rows; prompt + `ranked`    |
|                           |                             | (best first)                                          |
| `load_prompt_dataset`     | prompt                      | anything with `prompt`; chat `messages`; `text`;      |
|                           |                             | HH rows                                               |

Conventions:
- `text` rows become `prompt = ""`, `completion = text`: with TRL's completion-only loss that is the
  plain language-modelling loss over the whole text.
- Chat `messages` are rendered with `tokenizer.apply_chat_template`: the prompt is every turn before
  the last assistant turn (with the generation prompt), the completion is the rest of the rendered
  conversation up to and including that assistant turn. A BOS the template writes is dropped from the
  text when the tokenizer adds its own (no double BOS when a stage tokenizes the text).
- HH rows (Anthropic/hh-rlhf): `chosen` and `rejected` full dialogues "\\n\\nHuman: ...\\n\\nAssistant: ...",
  possibly multi-turn, sharing everything up to the last "\\n\\nAssistant:". They are detected by their
  columns (chosen/rejected without a prompt column), or required with `data_format="hh"`. Pairs are split by
  `split_shared_prompt`; SFT and prompt loaders use the `chosen` dialogue only, split the same way: the
  prompt is the text up to and including its last "\\n\\nAssistant:", the completion the rest.
- Completions carry no EOS: the SFT stage appends it (so the model learns to stop).
- Columns other than the ones above are dropped.
- A prompt too long for the length limit is an error naming its row; with `skip_long=True` such rows are
  left out instead, and their number is printed (for hub datasets with long dialogues, like HH).

Bad input raises `DataError` naming the file, the row and the field. Rows are numbered from 1: for
JSONL (and CSV) the row number is the line number in the file, for JSON arrays, Parquet and hub
datasets it is the record's position.

Data held in Python (the Python API: a `datasets.Dataset`, a list of dicts, a list of prompt strings or of
chat `messages` lists) comes in as `InMemory(name, data)` wherever a loader takes a file: the same
schemas and checks, the errors naming the argument (`prompts, row 3, field 'prompt'`) in place of a file.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Dataset

from llm_rlhf.core.errors import DataError

LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
HH_ASSISTANT = "\n\nAssistant:"  # Anthropic/hh-rlhf: the prompt ends at the last assistant tag
DATA_FORMATS = ("auto", "hh")  # auto: the schema is detected from the columns; hh: HH rows required


def prompt_rules(cfg) -> dict:
    """How the prompt files of a PPO or evaluation config are read (length limit, schema, long prompts)."""
    return {
        "max_prompt_length": cfg.max_prompt_length,
        "data_format": cfg.data_format,
        "skip_long": cfg.skip_long,
        "system_prompt": cfg.system_prompt,
    }


# ---------------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------------


class _Rows:
    """Records as read from `file`, with the 1-based row number of each (the JSONL/CSV line)."""

    def __init__(self, file: str, records: list[dict[str, Any]], numbers: list[int]):
        self.file, self.records, self.numbers = file, records, numbers

    def columns(self) -> list[str]:
        seen: dict[str, None] = {}
        for record in self.records:
            seen.update(dict.fromkeys(record))
        return list(seen)


class InMemory:
    """Rows held in Python, read by every loader as a file is: `name` (the API argument) stands for the file
    in error messages, the rows are numbered from 1. `data`: a `datasets.Dataset`, a list of dicts, a list of
    strings (prompts: one `prompt` each) or a list of chat `messages` lists (one `messages` each)."""

    def __init__(self, name: str, data: Any):
        if isinstance(data, Dataset):
            data = data.to_list()
        if not isinstance(data, (list, tuple)):
            raise DataError(
                f"expected a datasets.Dataset or a list of rows, got {type(data).__name__}", file=name
            )
        records = []
        for row, item in enumerate(data, start=1):
            if isinstance(item, str):
                item = {"prompt": item}
            elif isinstance(item, (list, tuple)):
                item = {"messages": list(item)}
            if not isinstance(item, dict):
                raise DataError(
                    f"expected a dict, a string or a list of messages, got {type(item).__name__}",
                    file=name,
                    row=row,
                )
            records.append(item)
        self.name, self.records = name, records


def _is_local(source: str) -> bool:
    """A path that exists, or one that looks like a file (known suffix, or a folder separator)."""
    return (
        os.path.exists(source)
        or source.lower().endswith(LOCAL_SUFFIXES)
        or source.startswith((".", "/", "~"))
    )


def _decode(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); save the file as UTF-8",
            file=str(path),
            row=line,
        ) from None


def _read_jsonl(path: Path, text: str) -> _Rows:
    records, numbers = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"not valid JSON ({e.msg} at column {e.colno})", file=str(path), row=number
            ) from None
        if not isinstance(record, dict):
            raise DataError(
                f"expected a JSON object per line, got {type(record).__name__}", file=str(path), row=number
            )
        records.append(record)
        numbers.append(number)
    return _Rows(str(path), records, numbers)


def _read_json(path: Path, text: str) -> _Rows:
    """A JSON array of objects, or JSON Lines saved with a `.json` suffix."""
    if not text.lstrip().startswith("["):
        return _read_jsonl(path, text)
    try:
        array = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})", file=str(path)
        ) from None
    for i, record in enumerate(array, start=1):
        if not isinstance(record, dict):
            raise DataError(f"expected a JSON object, got {type(record).__name__}", file=str(path), row=i)
    return _Rows(str(path), array, list(range(1, len(array) + 1)))


def _read_csv(path: Path, text: str) -> _Rows:
    """Every cell is a string (an empty cell is ""); the row number is the line (the header is line 1)."""
    reader = csv.DictReader(io.StringIO(text, newline=""))
    records, numbers = [], []
    start = 2
    try:
        for record in reader:
            if None in record:
                raise DataError(
                    f"{len(record[None])} more cell(s) than header columns", file=str(path), row=start
                )
            records.append({k: v for k, v in record.items() if v is not None})
            numbers.append(start)
            start = reader.line_num + 1
    except csv.Error as e:
        raise DataError(f"not valid CSV ({e})", file=str(path), row=reader.line_num) from None
    return _Rows(str(path), records, numbers)


def _read_parquet(path: Path) -> _Rows:
    try:
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"not a readable Parquet file ({str(e).splitlines()[0]})", file=str(path)) from None
    return _Rows(str(path), records, list(range(1, len(records) + 1)))


def _read_hub(source: str, split: str, name: str | None) -> _Rows:
    try:
        dataset = datasets.load_dataset(source, name, split=split)
    except Exception as e:  # network, unknown name, unknown split: all one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"cannot load hub dataset (split '{split}'): {first}. Local files need a "
            f"{'/'.join(LOCAL_SUFFIXES)} suffix",
            file=source,
        ) from None
    records = dataset.to_list()
    return _Rows(f"{source}[{split}]", records, list(range(1, len(records) + 1)))


def _read(source: str | os.PathLike | InMemory, split: str = "train", name: str | None = None) -> _Rows:
    if isinstance(source, InMemory):
        rows = _Rows(source.name, source.records, list(range(1, len(source.records) + 1)))
        if not rows.records:
            raise DataError("empty dataset: no rows", file=rows.file)
        return rows
    source = str(source)
    if not _is_local(source):
        rows = _read_hub(source, split, name)
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise DataError("no such file" if not path.exists() else "is not a file", file=source)
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            rows = _read_parquet(path)
        elif suffix in (".jsonl", ".json", ".csv"):
            text = _decode(path)
            reader = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}[suffix]
            rows = reader(path, text)
        else:
            raise DataError(
                f"unsupported file type '{suffix}' (use one of {', '.join(LOCAL_SUFFIXES)})", file=source
            )
    if not rows.records:
        raise DataError("empty dataset: no rows", file=rows.file)
    return rows


def read_records(
    source: str | os.PathLike, *, split: str = "train", name: str | None = None
) -> tuple[str, list[dict[str, Any]], list[int]]:
    """The records of a local file or hub dataset as read, each value as the file holds it (no Arrow schema
    over the rows: a turn of chat `messages` keeps exactly its own keys, and a row whose value has another
    type is for the caller's check to name), with the file as errors name it and each record's 1-based row
    number (the JSONL/CSV line)."""
    rows = _read(source, split, name)
    return rows.file, rows.records, rows.numbers


def load_rows(source: str | os.PathLike, *, split: str = "train", name: str | None = None):
    """Rows of a local `.jsonl`/`.json`/`.csv`/`.parquet` file or of a hub dataset, as a `datasets.Dataset`.

    `source` is a hub dataset name when it is not an existing path and does not look like a file;
    `split` and `name` (the dataset config) apply to hub datasets only.
    """
    rows = _read(source, split, name)
    columns = rows.columns()
    for column in columns:  # Arrow needs one type per column: report the first row that breaks it
        kinds = {}
        for record, number in zip(rows.records, rows.numbers):
            value = record.get(column)
            if value is not None:
                kinds.setdefault(type(value).__name__, number)
        if len(kinds) > 1:
            (first, _), (other, row) = list(kinds.items())[:2]
            raise DataError(
                f"is {other} here but {first} in earlier rows", file=rows.file, row=row, field=column
            )
    return Dataset.from_dict({c: [r.get(c) for r in rows.records] for c in columns})


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


def check_text(value: Any, *, file: str, row: int, field: str) -> str:
    """The one validator: a field must be present (not null), a string, and not empty or whitespace only."""
    if value is None:
        raise DataError("missing (or null)", file=file, row=row, field=field)
    if not isinstance(value, str):
        raise DataError(
            f"expected a string, got {type(value).__name__} ({value!r:.40})", file=file, row=row, field=field
        )
    if not value.strip():
        raise DataError(
            "is an empty string" if not value else "is only whitespace", file=file, row=row, field=field
        )
    return value


def _field(rows: _Rows, i: int, field: str) -> str:
    return check_text(rows.records[i].get(field), file=rows.file, row=rows.numbers[i], field=field)


def _check_prompt_lengths(
    rows: _Rows,
    prompts: list[str],
    numbers: list[int],
    tokenizer,
    *,
    limit: int,
    why: str,
    skip: bool,
    what: str,
) -> list[int]:
    """Indices of the prompts that tokenize to at most `limit` tokens (the same tokenization TRL uses:
    defaults). A longer prompt is an error naming its row; with `skip` it is left out, and the number left
    out is printed with `what` they are (an error if none is left)."""
    if limit < 1:
        raise DataError(f"no prompt fits: {why}", file=rows.file)
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]] if prompts else []
    keep = []
    for i, (length, number) in enumerate(zip(lengths, numbers)):
        if length <= limit:
            keep.append(i)
        elif not skip:
            raise DataError(
                f"{length} tokens is too long: {why}; shorten the prompt or raise the limit",
                file=rows.file,
                row=number,
                field="prompt",
            )
    if skip and len(keep) < len(prompts):
        if not keep:
            raise DataError(f"every prompt is too long: {why}", file=rows.file)
        print(
            f"{rows.file}: skipped {len(prompts) - len(keep)} of {len(prompts)} {what}: {why}",
            flush=True,
        )
    return keep


def _is_hh(columns: list[str], data_format: str) -> bool:
    """HH rows: asked for (`data_format="hh"`), or detected as chosen/rejected without a prompt column."""
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {DATA_FORMATS}, got {data_format!r}")
    return data_format == "hh" or ("chosen" in columns and "rejected" in columns and "prompt" not in columns)


def _hh_dialogue(rows: _Rows, i: int) -> tuple[str, str]:
    """The `chosen` dialogue of HH row i as (prompt, response), split at its last "\\n\\nAssistant:" by
    `split_shared_prompt` (a dialogue shares everything with itself): the prompt the RM's pairs get."""
    chosen = _field(rows, i, "chosen")
    if HH_ASSISTANT not in chosen:
        raise DataError(
            "no '\\n\\nAssistant:' tag to split the dialogue at (HH rows end with an assistant turn)",
            file=rows.file,
            row=rows.numbers[i],
            field="chosen",
        )
    prompt, response, _ = split_shared_prompt(chosen, chosen)
    return prompt, response


def _select(columns: dict[str, list], keep: list[int]) -> dict[str, list]:
    return {name: [values[i] for i in keep] for name, values in columns.items()}


def _require_chat_template(tokenizer, rows: _Rows) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "rows are chat 'messages' but the tokenizer has no chat template; set `tokenizer.chat_template` "
            "(or use a chat model's tokenizer), or convert the rows to prompt/completion",
            file=rows.file,
        )


def _messages(rows: _Rows, i: int) -> tuple[list[dict[str, str]], int | None]:
    """Validated chat turns of row i and the index of the last assistant turn (None if there is none)."""
    return _record_messages(rows.records[i], file=rows.file, row=rows.numbers[i])


def _record_messages(
    record: dict[str, Any], *, file: str, row: int
) -> tuple[list[dict[str, str]], int | None]:
    messages = record.get("messages")
    if "messages" not in record or messages is None:
        raise DataError("missing (or null)", file=file, row=row, field="messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(
            "expected a non-empty list of {role, content} turns", file=file, row=row, field="messages"
        )
    last_assistant = None
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(
                f"expected a {{role, content}} object, got {type(message).__name__}",
                file=file,
                row=row,
                field=f"messages[{j}]",
            )
        for key in ("role", "content"):
            check_text(message.get(key), file=file, row=row, field=f"messages[{j}].{key}")
        if message["role"] == "assistant":
            last_assistant = j
    return messages, last_assistant


def _render(
    tokenizer, messages: list[dict[str, str]], *, add_generation_prompt: bool, file: str, row: int
) -> str:
    """The conversation as text. A template that writes the BOS itself (`{{ bos_token }}...`, Llama 3's)
    loses it here when the tokenizer adds one anyway: every stage tokenizes the text with the tokenizer's
    special tokens (`rollout.encode_prompt`, TRL's SFT, the RM), which would give two BOS."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja errors raised by the template itself (e.g. "roles must alternate")
        raise DataError(
            f"the chat template failed: {str(e).splitlines()[0]}", file=file, row=row, field="messages"
        ) from None
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and adds_bos(tokenizer):
        text = text[len(bos) :]
    return text


def adds_bos(tokenizer) -> bool:
    """Whether `tokenizer(text)` puts the BOS token in front of the text's own tokens (Llama-style)."""
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return bos is not None and len(with_special) > len(plain) and with_special[0] == bos


def chat_prompt(
    tokenizer, record: dict[str, Any], *, file: str, row: int, system_prompt: str | None = None
) -> str:
    """The prompt of a chat `messages` record: every turn before its last assistant turn (all of them when
    it has none), rendered with the generation prompt, the text `load_prompt_dataset` gives. `system_prompt`
    (when not None) is the system turn of a record that has none of its own, in place of whatever the
    template writes then (SmolLM2's writes a default system message of 16 tokens); "" is an empty one."""
    messages, last = _record_messages(record, file=file, row=row)
    turns = messages[:last] if last is not None else messages
    if system_prompt is not None and turns and turns[0]["role"] != "system":
        turns = [{"role": "system", "content": system_prompt}, *turns]
    if not turns:
        raise DataError(
            "no turn before the assistant turn to use as the prompt", file=file, row=row, field="messages"
        )
    return _render(tokenizer, turns, add_generation_prompt=True, file=file, row=row)


def _to_dataset(columns: dict[str, list[str]]):
    return Dataset.from_dict(columns)


def _fit_in_max_length(rows: _Rows, prompts, numbers, tokenizer, *, max_length: int, skip: bool, what: str):
    """`_check_prompt_lengths` for a training sequence of max_length tokens: each prompt must leave room for
    one response token and the EOS (SFT's examples, the pairs of the RM and DPO)."""
    return _check_prompt_lengths(
        rows,
        prompts,
        numbers,
        tokenizer,
        limit=max_length - 2,
        why=f"max_length={max_length} leaves room for at most {max_length - 2} prompt tokens "
        "(plus one response token and the EOS)",
        skip=skip,
        what=what,
    )


# ---------------------------------------------------------------------------------------------------
# The three loaders
# ---------------------------------------------------------------------------------------------------


def load_sft_dataset(
    source: str | os.PathLike,
    tokenizer,
    *,
    max_length: int,
    split: str = "train",
    name: str | None = None,
    data_format: str = "auto",
    skip_long: bool = False,
):
    """Demonstrations as `prompt`, `completion` strings (see the module docstring for the schemas).

    Every prompt must leave room for at least one response token and the EOS within `max_length`
    (`skip_long`: rows whose prompt does not are left out and counted). HH rows give the `chosen`
    dialogue: prompt up to and including the last "\\n\\nAssistant:", completion the rest.
    """
    rows = _read(source, split, name)
    columns = rows.columns()
    prompts, completions = [], []
    if _is_hh(columns, data_format):
        for i in range(len(rows.records)):
            prompt, completion = _hh_dialogue(rows, i)
            if not completion.strip():
                raise DataError(
                    "nothing after the last '\\n\\nAssistant:' to learn from",
                    file=rows.file,
                    row=rows.numbers[i],
                    field="chosen",
                )
            prompts.append(prompt)
            completions.append(completion)
    elif "messages" in columns:
        _require_chat_template(tokenizer, rows)
        for i in range(len(rows.records)):
            row = rows.numbers[i]
            messages, last = _messages(rows, i)
            if last is None:
                raise DataError("no assistant turn to learn from", file=rows.file, row=row, field="messages")
            if last == 0:
                raise DataError(
                    "the assistant turn has no prompt before it", file=rows.file, row=row, field="messages"
                )
            prompt = _render(tokenizer, messages[:last], add_generation_prompt=True, file=rows.file, row=row)
            full = _render(
                tokenizer, messages[: last + 1], add_generation_prompt=False, file=rows.file, row=row
            )
            if not full.startswith(prompt) or len(full) == len(prompt):
                raise DataError(
                    "the chat template does not render the prompt turns as a prefix of the "
                    "conversation, so the completion cannot be separated",
                    file=rows.file,
                    row=row,
                    field="messages",
                )
            prompts.append(prompt)
            completions.append(full[len(prompt) :])
    elif "prompt" in columns or "completion" in columns:
        for i in range(len(rows.records)):
            prompts.append(_field(rows, i, "prompt"))
            completions.append(_field(rows, i, "completion"))
    elif "text" in columns:
        for i in range(len(rows.records)):
            completions.append(_field(rows, i, "text"))
        prompts = [""] * len(completions)
    else:
        raise DataError(
            "no SFT schema found: expected columns prompt/completion, messages, text or chosen/rejected; "
            f"found {', '.join(columns)}",
            file=rows.file,
        )
    keep = _fit_in_max_length(
        rows,
        prompts,
        rows.numbers,
        tokenizer,
        max_length=max_length,
        skip=skip_long,
        what="examples whose prompt is too long",
    )
    return _to_dataset(_select({"prompt": prompts, "completion": completions}, keep))


def split_shared_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Split two full texts (HH-style rows) into (prompt, chosen response, rejected response).

    The prompt is their longest shared prefix, cut back to the last `"\\n\\nAssistant:"` in it (so for
    Anthropic/hh-rlhf the prompt ends with "Assistant:"), or else to the last whitespace in it (so no word
    is split; the responses start with that whitespace). Returns an empty prompt when nothing is shared.
    With `chosen == rejected` it splits one dialogue at its last assistant tag (SFT and prompts of HH rows).
    """
    shared = os.path.commonprefix([chosen, rejected])
    cut = shared.rfind(HH_ASSISTANT)
    if cut >= 0:
        n = cut + len(HH_ASSISTANT)
    else:
        n = max(shared.rfind(c) for c in (" ", "\n", "\t"))
        n = max(n, 0)
    return chosen[:n], chosen[n:], rejected[n:]


def ranking_to_pairs(ranked: list) -> list[tuple]:
    """Expand a ranking, best first, into its K(K-1)/2 (chosen, rejected) pairs (Ouyang et al. 2022,
    sec. 3.5). ["B", "A", "D", "C"] -> [(B, A), (B, D), (B, C), (A, D), (A, C), (D, C)].
    Works on items or indices alike.
    """
    return [(ranked[i], ranked[j]) for i in range(len(ranked)) for j in range(i + 1, len(ranked))]


def load_preference_dataset(
    source: str | os.PathLike,
    tokenizer,
    *,
    max_length: int,
    split: str = "train",
    name: str | None = None,
    data_format: str = "auto",
    skip_long: bool = False,
):
    """Preference pairs as `prompt`, `chosen`, `rejected` strings.

    Schemas: prompt/chosen/rejected; chosen/rejected full texts (HH-style, split by
    `split_shared_prompt`); prompt + `ranked` (a list of >= 2 responses, best first), expanded into
    all K(K-1)/2 pairs (ranked[i] preferred to ranked[j] for i < j). Every prompt must leave room for
    at least one response token and the EOS within `max_length` (`skip_long`: pairs whose prompt does
    not are left out and counted).
    """
    rows = _read(source, split, name)
    columns = rows.columns()
    out: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    numbers: list[int] = []  # source row of each pair

    def add(prompt: str, chosen: str, rejected: str, row: int, fields=("chosen", "rejected")) -> None:
        if chosen == rejected:
            raise DataError(
                f"identical to '{fields[0]}': a pair needs two different responses",
                file=rows.file,
                row=row,
                field=fields[1],
            )
        out["prompt"].append(prompt)
        out["chosen"].append(chosen)
        out["rejected"].append(rejected)
        numbers.append(row)

    hh = _is_hh(columns, data_format)
    if "ranked" in columns and not hh:
        for i, record in enumerate(rows.records):
            row = rows.numbers[i]
            prompt = _field(rows, i, "prompt")
            ranked = record.get("ranked")
            if not isinstance(ranked, list) or len(ranked) < 2:
                raise DataError(
                    "expected a list of at least 2 responses, best first",
                    file=rows.file,
                    row=row,
                    field="ranked",
                )
            ranked = [
                check_text(r, file=rows.file, row=row, field=f"ranked[{k}]") for k, r in enumerate(ranked)
            ]
            for a, b in ranking_to_pairs(list(range(len(ranked)))):
                add(prompt, ranked[a], ranked[b], row, fields=(f"ranked[{a}]", f"ranked[{b}]"))
    elif "prompt" in columns and not hh:
        for i in range(len(rows.records)):
            prompt, chosen, rejected = (_field(rows, i, f) for f in ("prompt", "chosen", "rejected"))
            add(prompt, chosen, rejected, rows.numbers[i])
    elif hh:
        for i in range(len(rows.records)):
            add(*_hh_pair(rows, i), rows.numbers[i])
    else:
        raise DataError(
            "no preference schema found: expected columns prompt/chosen/rejected, chosen/rejected or "
            f"prompt/ranked; found {', '.join(columns)}",
            file=rows.file,
        )
    keep = _fit_in_max_length(
        rows,
        out["prompt"],
        numbers,
        tokenizer,
        max_length=max_length,
        skip=skip_long,
        what="pairs whose prompt is too long",
    )
    return _to_dataset(_select(out, keep))


def _hh_pair(rows, i: int) -> tuple[str, str, str]:
    """Row i of an HH-style file (full texts `chosen` and `rejected`: a common dialogue, then two responses)
    as (prompt, chosen, rejected): the shared prefix (`split_shared_prompt`) and what follows it in each, each
    checked (different texts, a non-empty prompt, two non-empty responses)."""
    row = rows.numbers[i]
    chosen, rejected = _field(rows, i, "chosen"), _field(rows, i, "rejected")
    if chosen == rejected:
        raise DataError(
            "identical to 'chosen': a pair needs two different responses",
            file=rows.file,
            row=row,
            field="rejected",
        )
    prompt, chosen_response, rejected_response = split_shared_prompt(chosen, rejected)
    if not prompt.strip():
        raise DataError(
            "shares no prefix with 'rejected' to use as the prompt (HH-style rows are "
            "full texts: a common dialogue followed by two responses)",
            file=rows.file,
            row=row,
            field="chosen",
        )
    for field, response in (("chosen", chosen_response), ("rejected", rejected_response)):
        if not response.strip():
            raise DataError(
                "has no response after the shared prompt (one text is a prefix of the other)",
                file=rows.file,
                row=row,
                field=field,
            )
    return prompt, chosen_response, rejected_response


def load_prompt_dataset(
    source: str | os.PathLike,
    tokenizer,
    *,
    max_prompt_length: int,
    split: str = "train",
    name: str | None = None,
    data_format: str = "auto",
    skip_long: bool = False,
    system_prompt: str | None = None,
):
    """Prompts as one `prompt` column: from a `prompt` field, chat `messages` (every turn before the last
    assistant turn, rendered with the generation prompt), `text`, or HH rows (the `chosen` dialogue up to
    and including its last "\\n\\nAssistant:"). Prompts longer than `max_prompt_length` tokens are an
    error (they are never silently cut), or with `skip_long` left out and counted. `system_prompt` (chat
    `messages` only; `chat_prompt`) is the system turn of the records that have none."""
    rows = _read(source, split, name)
    columns = rows.columns()
    prompts, chat = [], False
    if _is_hh(columns, data_format):
        prompts = [_hh_dialogue(rows, i)[0] for i in range(len(rows.records))]
    elif "prompt" in columns:
        prompts = [_field(rows, i, "prompt") for i in range(len(rows.records))]
    elif "messages" in columns:
        chat = True
        _require_chat_template(tokenizer, rows)
        for i in range(len(rows.records)):
            prompts.append(
                chat_prompt(
                    tokenizer,
                    rows.records[i],
                    file=rows.file,
                    row=rows.numbers[i],
                    system_prompt=system_prompt,
                )
            )
    elif "text" in columns:
        prompts = [_field(rows, i, "text") for i in range(len(rows.records))]
    else:
        raise DataError(
            "no prompt schema found: expected a column prompt, messages or text, or columns chosen/rejected; "
            f"found {', '.join(columns)}",
            file=rows.file,
        )
    if system_prompt is not None and not chat:
        raise DataError(
            "system_prompt is set, but these prompts are not chat `messages` (a system turn needs a chat "
            "template)",
            file=rows.file,
        )
    keep = _check_prompt_lengths(
        rows,
        prompts,
        rows.numbers,
        tokenizer,
        limit=max_prompt_length,
        why=f"the limit is max_prompt_length={max_prompt_length}",
        skip=skip_long,
        what="prompts that are too long",
    )
    return _to_dataset(_select({"prompt": prompts}, keep))
