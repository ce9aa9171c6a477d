"""Tasks from reasoning-gym: a checkable task as a config value, written as the toolkit's prompt
files, and its verifier as a reward function and an `accuracy_fn`.

    pip install -e ".[tasks]"                      # reasoning-gym==0.1.25; the default pipeline never imports it
    python data/make_tasks.py                      # every task of data/tasks/tasks.yaml -> data/tasks/<name>/

A task (`Task`, one entry of a tasks YAML) is: a reasoning-gym dataset name and its generator config, a seed,
the number of training and held-out prompts, the answer format asked for (`instruction`) and how the answer
is read back (`extract`). `write_task` writes its folder:

    task.json            the task itself and its provenance (reasoning-gym version, rows, the command)
    train_prompts.jsonl  PPO's prompts     {"messages": [{"role": "user", "content": ...}], "question": ...,
    eval_prompts.jsonl   held-out prompts   "answer": ..., "metadata": {...}}   (the generator's entry)
    verifier.py          three lines that bind this folder's verifier, so a config names it like any
                         reward function:
                             reward_fn: data/tasks/<name>/verifier.py:reward       (graded, 0..1)
                             accuracy_fn: data/tasks/<name>/verifier.py:accuracy   (1.0 or 0.0)

A recipe names its task once: `task: <name>` in its pipeline.yaml, and the pipeline gives the
PPO and evaluation stages the keys of `TASK_KEYS` (`task_keys`), each a file of `data/tasks/<name>/`; the
stage files set none of them. Adding a task is one entry of data/tasks/tasks.yaml (then `python
data/make_tasks.py --only <name>`) and, to train on it, a recipe folder whose pipeline.yaml names it.

Train and held-out are disjoint by construction (`make_splits`): the generator's items are taken in index
order from one seeded dataset, the first `n_eval` distinct questions are held out, and every later item
whose question text is a held-out one is dropped from training (asserted).

The user message is the generator's question, a blank line, and the instruction (default `INSTRUCTION`,
"Give the final answer as: Answer: <answer>"). A reward function sees only the rendered prompt and the
response (`llm_rlhf.models.reward_fn`), so the verifier reads the question back from the prompt: the text just
before the last copy of the instruction must end with a question of the folder's prompt files, whose
generator entry (answer and metadata) `score_answer` needs. A prompt that holds none is a ValueError (a wrong
prompt file is a setup mistake; scoring it 0 would train on a constant).

How the answer is read from a response (`extract_answer`), per task by its `extract` key:
- the answer line: the text after the LAST "Answer:" (any case; so a response cannot score by listing several
  answer lines, only the last counts), up to the end of that line; none -> no answer (score 0);
- `extract: line` (non-numeric answers): that text with surrounding spaces, markdown emphasis (`*`, `_`,
  backticks), quotes and `$` removed, then trailing `.`, `,`, `;`, `:`, `!` removed;
- `extract: number` (numeric answers: chain_sum, basic_arithmetic, products, leg_counting, letter_counting):
  the first number of that text ("Answer: 12 legs." -> "12"; `llm_rlhf.tasks.arithmetic.NUMBER`: a sign, digits
  or thousands groups, a decimal part, never inside a word), the minus sign U+2212 written "-" and thousands
  commas dropped; no number there -> no answer. A response with no answer line at all is read as
  `llm_rlhf.tasks.arithmetic` reads one: its LAST number ("The answer is 7." -> "7"). SmolLM2-135M-Instruct
  writes "Answer:" in 3% to 14% of its sampled responses to these tasks and in none of its greedy ones
  (measured: data/tasks/README.md), so a format-only rule would start every rung at zero reward;
- only the last `MAX_ANSWER_CHARS` characters of a response are searched (a response is bounded by
  max_new_tokens anyway; this keeps a pathological one linear and cheap).
The extracted text goes to the generator's own `score_answer(answer, entry)`: the `reward` is that score as
it is (reasoning-gym gives some wrong but well-formed answers partial credit: a reward a policy can game,
which the hacking watch should see); the `accuracy` is 1.0 where that score is exactly 1.0, else 0.0.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from llm_rlhf.core.errors import ConfigError
from llm_rlhf.tasks.arithmetic import NUMBER

INSTRUCTION = "Give the final answer as: Answer: <answer>"
# where a pipeline's `task:` is found, relative to the repo root (as recipes name their files)
TASKS_DIR = "data/tasks"
TRAIN_FILE, EVAL_FILE, VERIFIER_FILE = "train_prompts.jsonl", "eval_prompts.jsonl", "verifier.py"
# The stage keys that a pipeline's `task: <name>` decides, by stage: each a file of its folder.
TASK_KEYS = {
    "ppo": {
        "prompt_file": TRAIN_FILE,
        "eval_prompt_file": EVAL_FILE,
        "reward_fn": f"{VERIFIER_FILE}:reward",
        "accuracy_fn": f"{VERIFIER_FILE}:accuracy",
    },
    "eval": {
        "prompt_file": EVAL_FILE,
        "reward_fn": f"{VERIFIER_FILE}:reward",
        "accuracy_fn": f"{VERIFIER_FILE}:accuracy",
    },
}
EXTRACT_MODES = ("line", "number")
MAX_ANSWER_CHARS = 4000
DRAWS_PER_ROW = 20  # how many generator items a row may cost before the task is too small for its sizes
REASONING_GYM = "reasoning-gym"
VERIFIER_PY = '''"""The verifier of this task folder (written by llm_rlhf.tasks.gym.write_task; see its docstring).

reward_fn: <this folder>/verifier.py:reward       score_answer of the extracted answer, 0..1
accuracy_fn: <this folder>/verifier.py:accuracy   1.0 where that score is 1.0, else 0.0
"""

from pathlib import Path

from llm_rlhf.tasks.gym import load_verifiers

reward, accuracy = load_verifiers(Path(__file__).resolve().parent)
'''


@dataclasses.dataclass(frozen=True)
class Task:
    """One checkable task: which generator, configured how, seeded how, how many prompts, how answered."""

    name: str  # the folder name under the output directory, e.g. "chain_sum-t3d1"
    dataset: str  # a reasoning-gym dataset name (reasoning_gym.create_dataset), e.g. "chain_sum"
    # the generator's config keys, e.g. {"min_terms": 3} (its seed and size are the task's own)
    config: dict = dataclasses.field(default_factory=dict)
    seed: int = 0  # the generator's seed: one seed makes both files
    n_train: int = 1000  # training prompts (questions may repeat; none is a held-out one); 0: held-out only
    n_eval: int = 64  # held-out prompts, distinct questions
    extract: str = "number"  # how the answer is read from a response: "number" or "line" (module docstring)
    instruction: str = INSTRUCTION  # the answer format asked for, after the question
    # A held-out set of other problems than another task trains on, where the two word them differently (e.g.
    # the same sums in other words): every item whose metadata[avoid_metadata] is that of a training row of
    # the task folder `avoid_task` (written before this one, beside it) is skipped.
    avoid_task: str | None = None
    avoid_metadata: str = "expression"

    def __post_init__(self):
        where = f"task '{self.name}'"
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"{where}: name must be a plain folder name")
        if self.extract not in EXTRACT_MODES:
            raise ConfigError(f"{where}: extract '{self.extract}' is not one of {', '.join(EXTRACT_MODES)}")
        if self.n_train < 0 or self.n_eval < 1:  # n_train 0: a held-out set only (a generalisation test)
            raise ConfigError(
                f"{where}: n_train must be >= 0 and n_eval >= 1 (got {self.n_train}, {self.n_eval})"
            )
        if "answer:" not in self.instruction.lower():
            raise ConfigError(f"{where}: instruction must ask for 'Answer:', which the verifier reads")
        if not isinstance(self.config, dict) or {"seed", "size"} & set(self.config):
            raise ConfigError(f"{where}: config must be a mapping without 'seed' and 'size' (the task's own)")


def load_tasks(path: Path) -> list[Task]:
    """The tasks of a YAML file `{name: {dataset: ..., config: {...}, seed: ..., ...}}`, in file order; an
    unknown key or a bad value is one ConfigError line naming the file and the task."""
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of task names to tasks")
    known = {f.name for f in dataclasses.fields(Task)} - {"name"}
    tasks = []
    for name, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: task '{name}' must be a mapping")
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{path}: task '{name}' has unknown keys {unknown}; known: {sorted(known)}")
        if "dataset" not in values:
            raise ConfigError(f"{path}: task '{name}' needs a 'dataset' (a reasoning-gym dataset name)")
        tasks.append(Task(name=str(name), **values))
    return tasks


def task_keys(name: str, stage: str, tasks_dir: str = TASKS_DIR) -> dict[str, str]:
    """The keys of `stage`'s config that the task `name` decides (`TASK_KEYS`), as paths under `tasks_dir`:
    for "ppo" {"prompt_file": "data/tasks/<name>/train_prompts.jsonl", "eval_prompt_file": ...eval_prompts.jsonl,
    "reward_fn": ".../verifier.py:reward", "accuracy_fn": ".../verifier.py:accuracy"}; {} for a stage no task
    feeds. A name without a written folder is a ConfigError."""
    folder = f"{tasks_dir}/{name}"
    if not Path(folder, "task.json").is_file():
        raise ConfigError(
            f"task '{name}': no {folder}/task.json (a task of {tasks_dir}/tasks.yaml, written by `python "
            f"data/make_tasks.py --only {name}`; recipes run from the repo root)"
        )
    return {key: f"{folder}/{file}" for key, file in TASK_KEYS.get(stage, {}).items()}


def reasoning_gym():
    """The optional library, imported where used (the toolkit's other stages never need it)."""
    try:
        import reasoning_gym as gym
    except ImportError:
        raise ConfigError(
            "tasks need reasoning-gym: pip install -e '.[tasks]' (reasoning-gym==0.1.25)"
        ) from None
    return gym


def create_dataset(task: Task, size: int):
    """The task's reasoning-gym generator, seeded, with `size` items; a bad name or config is a ConfigError."""
    gym = reasoning_gym()
    try:
        return gym.create_dataset(task.dataset, seed=task.seed, size=size, **task.config)
    except (KeyError, ValueError, TypeError, AssertionError) as e:
        raise ConfigError(
            f"task '{task.name}': dataset '{task.dataset}' with config {task.config}: {e}"
        ) from None


def question_key(question: str) -> str:
    """The question as it stands in the user message (and so in the rendered prompt): without the
    surrounding whitespace the generator may leave (leg_counting ends its question with a newline)."""
    return question.strip()


def user_message(task: Task, question: str) -> str:
    return f"{question_key(question)}\n\n{task.instruction}"


def make_splits(task: Task, avoid: frozenset = frozenset()) -> tuple[list[dict], list[dict]]:
    """(train entries, held-out entries), deterministic in the task: items of one seeded generator in index
    order; the first `n_eval` distinct questions are held out, then the next `n_train` items whose question is
    not held out are the training rows (a question may repeat in train: a small task has few). Raises a
    ConfigError when that takes more than `DRAWS_PER_ROW` items a row (the task is too small for its sizes).
    avoid: values of metadata[task.avoid_metadata] whose items are skipped (`Task.avoid_task`)."""
    budget = DRAWS_PER_ROW * (task.n_train + task.n_eval)
    data = create_dataset(task, budget)
    held_out, seen, train = [], set(), []
    index = 0

    def allowed(entry: dict) -> bool:
        return question_key(entry["question"]) not in seen and (
            not avoid or entry["metadata"].get(task.avoid_metadata) not in avoid
        )

    while len(held_out) < task.n_eval and index < budget:
        entry = data[index]
        index += 1
        if allowed(entry):
            seen.add(question_key(entry["question"]))
            held_out.append(entry)
    while len(train) < task.n_train and index < budget:
        entry = data[index]
        index += 1
        if allowed(entry):
            train.append(entry)
    if len(held_out) < task.n_eval or len(train) < task.n_train:
        raise ConfigError(
            f"task '{task.name}': {budget} generated items give {len(held_out)} distinct held-out and "
            f"{len(train)} training questions (wanted {task.n_eval} and {task.n_train}): the generator's "
            "config has too few problems for these sizes"
        )
    assert not {question_key(e["question"]) for e in train} & seen, "train and held-out share a question"
    return train, held_out


def prompt_row(task: Task, entry: dict) -> dict:
    """A prompt file row: the chat prompt PPO reads (`messages`) and, for people and the verifier, the
    generator's entry (question, answer, metadata)."""
    return {
        "messages": [{"role": "user", "content": user_message(task, entry["question"])}],
        "question": entry["question"],
        "answer": entry["answer"],
        "metadata": entry["metadata"],
    }


def gym_version() -> str:
    return importlib.metadata.version(REASONING_GYM)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")


def write_task(task: Task, out: Path, *, command: str) -> Path:
    """Write the task's folder `out / task.name` (module docstring); the same task writes the same bytes."""
    avoid = frozenset()
    if task.avoid_task is not None:
        other = Path(out) / task.avoid_task / TRAIN_FILE
        if not other.is_file():
            raise ConfigError(
                f"task '{task.name}': avoid_task '{task.avoid_task}' has no {other} (write it first)"
            )
        with other.open(encoding="utf-8") as f:
            avoid = frozenset(json.loads(line)["metadata"].get(task.avoid_metadata) for line in f)
    train, held_out = make_splits(task, avoid)
    folder = Path(out) / task.name
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / TRAIN_FILE, [prompt_row(task, e) for e in train])
    write_jsonl(folder / EVAL_FILE, [prompt_row(task, e) for e in held_out])
    provenance = {
        **dataclasses.asdict(task),
        "reasoning_gym_version": gym_version(),
        "train_rows": len(train),
        "eval_rows": len(held_out),
        "distinct_train_questions": len({question_key(e["question"]) for e in train}),
        "command": command,
    }
    (folder / "task.json").write_text(
        json.dumps(provenance, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    (folder / VERIFIER_FILE).write_text(VERIFIER_PY, encoding="utf-8")
    return folder


# ---------------------------------------------------------------------------------------------------
# the verifier

TAIL = 16
ANSWER_LINE = re.compile(r"answer\s*:", re.IGNORECASE)
LINE_STRIP = " \t*_`'\"$"
TRAILING = ".,;:!"


def answer_line(response: str) -> str | None:
    """The text after the last "Answer:" of the response (any case) to the end of its line, or None."""
    tail = response[-MAX_ANSWER_CHARS:]
    ends = [m.end() for m in ANSWER_LINE.finditer(tail)]
    return tail[ends[-1] :].split("\n", 1)[0] if ends else None


def extract_answer(response: str, mode: str) -> str | None:
    """The response's answer as text for `score_answer`, by `mode` ("line" or "number"; module docstring),
    or None when it gives none."""
    line = answer_line(response)
    if mode == "number":
        if (
            line is None
        ):  # no answer line: the last number of the response, as llm_rlhf.tasks.arithmetic reads it
            found = list(NUMBER.finditer(response[-MAX_ANSWER_CHARS:]))
            m = found[-1] if found else None
        else:
            m = NUMBER.search(line)
        return None if m is None else m.group().replace(",", "").replace("\u2212", "-")
    if line is None:
        return None
    text = line.strip(LINE_STRIP).rstrip(TRAILING).strip(LINE_STRIP)
    return text or None


class Verifier:
    """A task folder's verifier: `self(prompts, responses)` -> one score per pair (`reward_fn` interface).

    folder: the task folder (task.json and both prompt files; its entries are what `score_answer` reads);
    binary: False for the reward (the generator's score as it is), True for the accuracy (1.0 where that
    score is 1.0, else 0.0)."""

    def __init__(self, folder: Path, *, binary: bool):
        self.folder, self.binary = Path(folder), binary
        info = json.loads((self.folder / "task.json").read_text(encoding="utf-8"))
        fields = {f.name for f in dataclasses.fields(Task)}
        self.task = Task(**{k: v for k, v in info.items() if k in fields})
        self.entries = {}  # the question as the user message writes it -> the generator's entry
        for name in (TRAIN_FILE, EVAL_FILE):
            with (self.folder / name).open(encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    entry = {key: row[key] for key in ("question", "answer", "metadata")}
                    self.entries[question_key(row["question"])] = entry
        self.by_tail = {}  # a question's last TAIL characters -> the questions ending so (to find one fast)
        self.short = [key for key in self.entries if len(key) < TAIL]  # checked one by one
        for key in self.entries:
            if len(key) >= TAIL:
                self.by_tail.setdefault(key[-TAIL:], []).append(key)
        self.scorer = create_dataset(self.task, 1)  # score_answer is the generator's method

    def __repr__(self) -> str:
        return f"Verifier('{self.folder}', binary={self.binary})"

    def entry(self, prompt: str) -> dict | None:
        """The generator's entry of the question asked last in `prompt` (module docstring), or None."""
        return _find_entry(self, prompt)

    def score(self, prompt: str, response: str) -> float:
        entry = self.entry(prompt)
        if entry is None:
            raise ValueError(
                f"the prompt asks no question of task '{self.task.name}' ({self.folder}); it ends {prompt[-80:]!r}"
            )
        value = float(self.scorer.score_answer(extract_answer(response, self.task.extract), entry))
        return float(value == 1.0) if self.binary else value

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        scores = []
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            try:
                scores.append(self.score(prompt, response))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return scores


@functools.lru_cache(maxsize=8192)  # PPO scores several responses per prompt, and the same prompts again
def _find_entry(verifier: Verifier, prompt: str) -> dict | None:
    at = prompt.rfind("\n\n" + verifier.task.instruction)
    if at < 0:
        return None
    head = prompt[:at]  # the text the chat template wrote before the user message, then the question
    found = [key for key in (*verifier.by_tail.get(head[-TAIL:], ()), *verifier.short) if head.endswith(key)]
    return verifier.entries[max(found, key=len)] if found else None  # the longest: "12 + 3 =", not "2 + 3 ="


def load_verifiers(folder: Path) -> tuple[Verifier, Verifier]:
    """(reward, accuracy) of a task folder: the two callables its verifier.py names."""
    return Verifier(folder, binary=False), Verifier(folder, binary=True)
