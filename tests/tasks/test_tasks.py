"""Tasks from reasoning-gym (llm_rlhf/tasks/gym.py, data/make_tasks.py, data/tasks/, recipes/gym-*): the split,
the committed folders, the answer extraction against adversarial responses, the verifier against the
generator's own score_answer, the verifier named in a config and through the real PPO path."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import random
import time
from pathlib import Path

import pytest
import reasoning_gym
import torch
import yaml
from helpers import (
    ROOT,
    TAGGED_CHAT_TEMPLATE,
    load_script,
    ppo_config,
    recording_rollouts,
    smollm2_chat,
    tiny_chat_model,
    tiny_ppo_trainer,
)

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.interfaces import pipeline
from llm_rlhf.models.reward_fn import decode_texts, load_reward_fn, probe
from llm_rlhf.rl.rollout import Samples, left_pad
from llm_rlhf.stages import evaluate
from llm_rlhf.tasks.gym import (
    INSTRUCTION,
    MAX_ANSWER_CHARS,
    TASK_KEYS,
    Task,
    Verifier,
    answer_line,
    extract_answer,
    load_tasks,
    make_splits,
    question_key,
    task_keys,
    write_task,
)

TASKS_DIR = ROOT / "data" / "tasks"
TASKS_YAML = TASKS_DIR / "tasks.yaml"
RECIPES = ROOT / "recipes"
GYM_RECIPES = sorted(p.name for p in RECIPES.iterdir() if p.is_dir() and p.name.startswith("gym-"))
CHAIN = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)


def read(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def chain_folder(tmp_path_factory) -> Path:
    """A small chain_sum task folder (2 one-digit terms), written by write_task."""
    task = Task(name="chain", dataset="chain_sum", config=CHAIN, seed=5, n_train=40, n_eval=12)
    return write_task(task, tmp_path_factory.mktemp("tasks"), command="test")


@pytest.fixture(scope="module")
def letters_folder(tmp_path_factory) -> Path:
    task = Task(
        name="letters",
        dataset="spell_backward",
        config={"min_word_len": 3, "max_word_len": 5},
        seed=1,
        n_train=20,
        n_eval=8,
        extract="line",
    )
    return write_task(task, tmp_path_factory.mktemp("tasks"), command="test")


# ---------------------------------------------------------------------------------------------------
# the task and its split


def test_split_is_deterministic_and_disjoint():
    task = Task(name="t", dataset="chain_sum", config=CHAIN, seed=3, n_train=300, n_eval=40)
    train, held_out = make_splits(task)
    assert (train, held_out) == make_splits(task)
    other = make_splits(Task(name="t", dataset="chain_sum", config=CHAIN, seed=4, n_train=300, n_eval=40))
    assert [e["question"] for e in held_out] != [e["question"] for e in other[1]]
    held = {question_key(e["question"]) for e in held_out}
    assert len(held) == 40, "held-out questions are distinct"
    assert len(train) == 300 and not {question_key(e["question"]) for e in train} & held
    # the 200 problems of 2 one-digit terms: the held-out ones would be drawn again, and are dropped
    assert len({question_key(e["question"]) for e in train}) < 200 - 40 + 1
    state = random.getstate()
    make_splits(task)
    assert random.getstate() == state  # no global random state used or changed


def test_a_task_too_small_for_its_sizes_is_a_config_error():
    task = Task(name="tiny", dataset="chain_sum", config={**CHAIN, "max_terms": 1, "min_terms": 1}, n_eval=20)
    with pytest.raises(ConfigError, match=r"task 'tiny': .* too few problems"):
        make_splits(task)  # one one-digit term: 10 questions


@pytest.mark.parametrize(
    "values, message",
    [
        ({"dataset": "chain_sum", "colour": 1}, r"task 'x' has unknown keys \['colour'\]"),
        ({"config": {}}, r"task 'x' needs a 'dataset'"),
        (
            {"dataset": "chain_sum", "extract": "regex"},
            r"task 'x': extract 'regex' is not one of line, number",
        ),
        ({"dataset": "chain_sum", "config": {"seed": 1}}, r"without 'seed' and 'size'"),
        ({"dataset": "chain_sum", "instruction": "Reply."}, r"instruction must ask for 'Answer:'"),
        ({"dataset": "chain_sum", "n_eval": 0}, r"n_eval >= 1"),
    ],
)
def test_bad_task_entries_are_one_line_naming_the_task(tmp_path, values, message):
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump({"x": values}))
    with pytest.raises(ConfigError, match=message):
        load_tasks(path)


def test_avoid_task_skips_the_problems_another_task_trains_on(tmp_path):
    rung = Task(name="rung", dataset="chain_sum", config=CHAIN, n_train=150, n_eval=20)
    write_task(rung, tmp_path, command="test")
    trained = {r["metadata"]["expression"] for r in read(tmp_path / "rung" / "train_prompts.jsonl")}
    words = dict(operators=["+", "-"], allow_parentheses=False, allow_negation=False, format_style="natural")
    for avoid, n_clash in (
        (None, "some"),
        ("rung", 0),
    ):  # seed 40: items 40.. of the sequence the rung trains on
        task = Task(
            name=f"w-{avoid}",
            dataset="basic_arithmetic",
            config={**CHAIN, **words},
            seed=40,
            n_train=0,
            n_eval=20,
            avoid_task=avoid,
        )
        asked = {
            r["metadata"]["expression"]
            for r in read(write_task(task, tmp_path, command="t") / "eval_prompts.jsonl")
        }
        assert (len(asked & trained) > 0) if n_clash == "some" else not asked & trained
    with pytest.raises(ConfigError, match=r"task 'w': avoid_task 'nothing' has no "):
        write_task(
            Task(name="w", dataset="chain_sum", config=CHAIN, avoid_task="nothing"), tmp_path, command="t"
        )


def test_a_bad_dataset_or_generator_config_is_a_config_error():
    with pytest.raises(ConfigError, match=r"task 'x': dataset 'no_such_task'"):
        make_splits(Task(name="x", dataset="no_such_task"))
    with pytest.raises(ConfigError, match=r"task 'x': dataset 'chain_sum' with config \{'min_terms': 0\}"):
        make_splits(Task(name="x", dataset="chain_sum", config={"min_terms": 0}))


def test_the_folder_holds_chat_prompts_and_provenance(chain_folder):
    info = json.loads((chain_folder / "task.json").read_text())
    # the installed distribution's version (reasoning_gym.__version__ says 0.1.19 in the 0.1.25 wheel)
    assert info["reasoning_gym_version"] == importlib.metadata.version("reasoning-gym") == "0.1.25"
    assert (info["dataset"], info["config"], info["seed"], info["n_train"], info["n_eval"]) == (
        "chain_sum",
        CHAIN,
        5,
        40,
        12,
    )
    assert (info["train_rows"], info["eval_rows"]) == (40, 12)
    for name, n in (("train_prompts.jsonl", 40), ("eval_prompts.jsonl", 12)):
        rows = read(chain_folder / name)
        assert len(rows) == n
        for row in rows:
            (turn,) = row["messages"]
            assert turn == {"role": "user", "content": f"{row['question'].strip()}\n\n{INSTRUCTION}"}
            assert row["metadata"]["source_dataset"] == "chain_sum"
    again = write_task(
        Task(name="chain", dataset="chain_sum", config=CHAIN, seed=5, n_train=40, n_eval=12),
        chain_folder.parent / "again",
        command="test",
    )
    for name in ("train_prompts.jsonl", "eval_prompts.jsonl", "task.json", "verifier.py"):
        assert (again / name).read_bytes() == (chain_folder / name).read_bytes(), name


# ---------------------------------------------------------------------------------------------------
# the answer extraction


@pytest.mark.parametrize(
    "response, number, line",
    [
        ("Answer: 7", "7", "7"),
        ("answer:7.", "7", "7"),  # any case; a trailing full stop is punctuation
        ("Answer: 12 legs.", "12", "12 legs"),
        ("Answer: 1\nAnswer: 2\nAnswer: 3", "3", "3"),  # several answer lines: the last counts
        ("Answer: 3\nNo wait, I think the answer is 5.", "3", "3"),  # text after it does not count
        ("I think Answer: 7 is right, Answer: 9 is not", "9", "9 is not"),  # the last, in mid-text
        ("So the total is 4 + 3 = 7", "7", None),  # no answer line: the last number (number mode only)
        ("The answer is -4.", "-4", None),
        ("Answer: \u22124", "-4", "\u22124"),  # the minus sign U+2212
        ("Answer: 1,234", "1234", "1,234"),
        ("Answer: **cat**.", None, "cat"),  # markdown emphasis and punctuation around a word
        ("Answer: `tac`!", None, "tac"),
        ('Answer: "olleh"', None, "olleh"),
        ("Answer:", None, None),  # an empty answer line
        ("Answer: none\n42", None, "none"),  # an answer line without a number is no answer, not the 42
        ("", None, None),
        ("x12 and 3rd", None, None),  # digits glued to letters are no number
    ],
)
def test_extraction_on_adversarial_responses(response, number, line):
    assert extract_answer(response, "number") == number
    assert extract_answer(response, "line") == line


def test_extraction_of_a_huge_response_reads_only_its_end_and_is_fast():
    huge = "1 " * 2_000_000 + "Answer: 7"
    start = time.perf_counter()
    assert extract_answer(huge, "number") == "7" and extract_answer(huge, "line") == "7"
    early = "Answer: 7\n" + "x" * (2 * MAX_ANSWER_CHARS)  # its answer line is beyond the part searched
    assert answer_line(early) is None and extract_answer(early, "number") is None
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------------------------------
# the verifier


def test_the_verifier_agrees_with_score_answer(chain_folder, letters_folder):
    """On every held-out question and responses right, wrong, partly right (the generator's partial credit),
    unformatted and empty: reward == score_answer(extracted answer), accuracy == (that score == 1.0)."""
    for folder in (chain_folder, letters_folder):
        reward, accuracy = Verifier(folder, binary=False), Verifier(folder, binary=True)
        info = json.loads((folder / "task.json").read_text())
        data = reasoning_gym.create_dataset(info["dataset"], seed=info["seed"], size=1, **info["config"])
        seen = set()
        for row in read(folder / "eval_prompts.jsonl"):
            prompt = smollm2_chat(row["messages"][0]["content"])
            answer = row["answer"]
            responses = [
                f"Answer: {answer}",
                f"Answer: {answer}9",
                f"The answer is {answer}.",
                f"Answer: {answer} {answer}",
                "",
                "Answer: zzz",
            ]
            entry = {k: row[k] for k in ("question", "answer", "metadata")}
            expected = [data.score_answer(extract_answer(r, info["extract"]), entry) for r in responses]
            got = reward([prompt] * len(responses), responses)
            assert got == expected
            assert accuracy([prompt] * len(responses), responses) == [float(x == 1.0) for x in expected]
            assert got[0] == 1.0 and got[4] == 0.0
            seen |= {x for x in got if 0 < x < 1}
        assert seen, "some wrong answers get partial credit from the generator"


def test_the_question_is_read_back_from_the_rendered_prompt(chain_folder):
    reward = Verifier(chain_folder, binary=False)
    rows = read(chain_folder / "eval_prompts.jsonl")
    user = rows[0]["messages"][0]["content"]
    for prompt in (smollm2_chat(user), f"<|user|>{user}\n<|assistant|>", user):
        assert reward.entry(prompt)["answer"] == rows[0]["answer"]
    # a multi-turn prompt: the question asked last is the one answered
    two = smollm2_chat(rows[1]["messages"][0]["content"]) + "7<|im_end|>\n" + smollm2_chat(user)
    assert reward.entry(two)["answer"] == rows[0]["answer"]
    # a question with a longer one ending the same way: "...: 12 + 3 =" is not "...: 2 + 3 ="
    entry = dict(question="Q: 12 + 3 =", answer="15", metadata={})
    reward.entries[question_key(entry["question"])] = entry
    reward.short.append(entry["question"])
    assert reward.entry(f"Q: 12 + 3 =\n\n{INSTRUCTION}")["answer"] == "15"


def test_named_in_a_config_like_any_reward_function(chain_folder, monkeypatch):
    monkeypatch.chdir(chain_folder.parent)
    loaded = load_reward_fn("chain/verifier.py:reward")
    verdicts = load_reward_fn("chain/verifier.py:accuracy", key="accuracy_fn", binary=True)
    rows = read(chain_folder / "eval_prompts.jsonl")[:2]
    prompts = [smollm2_chat(r["messages"][0]["content"]) for r in rows]
    assert probe(loaded, prompts) == [0.0] * 4  # the dummy responses hold no number
    assert verdicts(prompts, [f"Answer: {r['answer']}" for r in rows]) == [1.0, 1.0]
    with pytest.raises(
        UserError, match=r"^reward_fn 'chain/verifier.py:reward' raised ValueError: prompt 1: "
    ):
        loaded([prompts[0], smollm2_chat("What is 3 + 4?")], ["7", "7"])


# ---------------------------------------------------------------------------------------------------
# through the PPO path


def test_the_task_reward_through_the_ppo_path(chain_folder, tmp_path):
    """A real PPO step on a tiny chat Llama whose responses are the right answer for even rows and a wrong one
    for odd rows: the rollout's scores are the verifier's 1 and 0 on the prompts and responses PPO decoded,
    and the step's objective/scores is their mean."""
    model = tiny_chat_model(tmp_path / "chat_llama", TAGGED_CHAT_TEMPLATE, n_positions=256)
    verifier_fn = f"{chain_folder}/verifier.py:reward"
    cfg = ppo_config(
        model,
        None,
        chain_folder / "train_prompts.jsonl",
        tmp_path / "ppo",
        reward_fn=verifier_fn,
        accuracy_fn=f"{chain_folder}/verifier.py:accuracy",
        max_prompt_length=200,
        max_new_tokens=16,
        gold_judge="none",
        steps=1,
    )
    trainer = tiny_ppo_trainer(cfg)
    kept = recording_rollouts(trainer)
    verifier = Verifier(chain_folder, binary=False)
    tok, eos, pad = trainer.tokenizer, trainer.tokenizer.eos_token_id, trainer.tokenizer.pad_token_id
    written = []

    def answers(queries, sampling=None):
        query, query_mask = left_pad(queries, pad)
        empty = torch.zeros((len(queries), 1), dtype=torch.long)
        prompts, _ = decode_texts(tok, query, query_mask, empty, empty.bool())
        texts = []
        for i, prompt in enumerate(prompts):
            answer = int(verifier.entry(prompt)["answer"])
            texts.append(f"Answer: {answer if i % 2 == 0 else answer + 1}")
        ids = [tok(t)["input_ids"] + [eos] for t in texts]
        response = torch.full((len(ids), cfg.max_new_tokens), pad)  # (B, R)
        mask = torch.zeros_like(response, dtype=torch.bool)
        for i, r in enumerate(ids):
            response[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = True
        written.append(texts)
        return Samples(query=query, query_mask=query_mask, response=response, response_mask=mask)

    trainer.collector.generate = answers
    metrics = trainer.ppo_step()
    (rollout,) = kept
    n = len(written[0])
    assert rollout.scores.tolist() == [1.0 if i % 2 == 0 else 0.0 for i in range(n)]
    prompts, responses = decode_texts(
        tok, rollout.query, rollout.query_mask, rollout.response, rollout.response_mask
    )
    assert responses == written[0] and verifier(prompts, responses) == rollout.scores.tolist()
    assert metrics["objective/scores"] == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------
# the committed task folders and recipes


def load_make_tasks(monkeypatch):
    return load_script(ROOT / "data" / "make_tasks.py", monkeypatch=monkeypatch)


def test_committed_folders_match_the_script(tmp_path, monkeypatch):
    tasks = load_tasks(TASKS_YAML)
    load_make_tasks(monkeypatch).build(TASKS_YAML, tmp_path)
    assert sorted(p.name for p in TASKS_DIR.iterdir() if p.is_dir()) == sorted(t.name for t in tasks)
    for task in tasks:
        for name in ("train_prompts.jsonl", "eval_prompts.jsonl", "task.json", "verifier.py"):
            assert (tmp_path / task.name / name).read_bytes() == (TASKS_DIR / task.name / name).read_bytes()


def test_committed_folders_are_disjoint_and_score_their_answers():
    for task in load_tasks(TASKS_YAML):
        folder = TASKS_DIR / task.name
        train, held_out = read(folder / "train_prompts.jsonl"), read(folder / "eval_prompts.jsonl")
        assert len(held_out) == task.n_eval and len(train) == task.n_train
        assert not {question_key(r["question"]) for r in train} & {
            question_key(r["question"]) for r in held_out
        }
        accuracy = Verifier(folder, binary=True)
        rows = held_out + train[:16]
        prompts = [smollm2_chat(r["messages"][0]["content"]) for r in rows]
        assert accuracy(prompts, [f"Answer: {r['answer']}" for r in rows]) == [1.0] * len(rows), task.name


def gym_configs(name: str) -> dict:
    """A gym recipe's pipeline and the ppo and eval configs it resolves (the task's keys from its `task:`)."""
    recipe = parse_config(pipeline.Config, ["--config", str(RECIPES / name / "pipeline.yaml")])
    return {"pipeline": recipe, **{stage: pipeline.stage_config(recipe, stage) for stage in ("ppo", "eval")}}


@pytest.mark.parametrize("name", GYM_RECIPES)
def test_a_gym_recipe_is_task_files_and_the_tasks_verifier(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = gym_configs(name)
    ppo_cfg, eval_cfg = cfg["ppo"], cfg["eval"]
    folder = Path(ppo_cfg.prompt_file).parent
    assert folder.parent == Path("data/tasks") and (ROOT / folder / "task.json").is_file()
    assert folder.name == cfg["pipeline"].task in {t.name for t in load_tasks(TASKS_YAML)}  # named once
    for stage in ("ppo", "eval"):  # the stage files name none of the task's keys (the pipeline refuses them)
        # the same file for every gym recipe: recipes/gym/ (a new recipe names it and its task)
        assert getattr(cfg["pipeline"], f"{stage}_config") == f"recipes/gym/{stage}.yaml"
        written = yaml.safe_load((RECIPES / "gym" / f"{stage}.yaml").read_text())
        assert not set(written) & set(TASK_KEYS[stage]), stage
        assert written["task"] != cfg["pipeline"].task or name == "gym-chain_sum-t2d1"  # the pipeline's wins
        assert cfg[stage].task == cfg["pipeline"].task
    assert ppo_cfg.prompt_file == str(folder / "train_prompts.jsonl")
    assert ppo_cfg.eval_prompt_file == eval_cfg.prompt_file == str(folder / "eval_prompts.jsonl")
    assert ppo_cfg.reward_fn == eval_cfg.reward_fn == f"{folder}/verifier.py:reward"
    assert ppo_cfg.accuracy_fn == eval_cfg.accuracy_fn == f"{folder}/verifier.py:accuracy"
    assert (
        ppo_cfg.reward_model_path in (None, "none") and eval_cfg.baseline_path == ppo_cfg.model_name_or_path
    )
    for stage in cfg["pipeline"].stages:
        pipeline.stage_config(cfg["pipeline"], stage)
    load_reward_fn(ppo_cfg.reward_fn)  # the named verifier loads
    generalise = sorted((RECIPES / name / "generalise").glob("*.yaml"))
    for path in generalise:  # held-out evaluations of the trained policy on other task folders
        other = parse_config(evaluate.Config, ["--config", str(path)])
        task = Path(other.prompt_file).parent
        assert task != folder and (ROOT / task / "task.json").is_file(), path
        assert (
            other.policy_path == eval_cfg.policy_path and other.accuracy_fn == f"{task}/verifier.py:accuracy"
        )
        load_reward_fn(other.accuracy_fn, key="accuracy_fn", binary=True)


def test_the_wording_folders_ask_no_training_problem_of_their_rung():
    """The 'other wordings' held-out sets (basic_arithmetic, + and -) share no expression with the training
    problems of the rung whose policy they evaluate."""
    for name in GYM_RECIPES:
        path = RECIPES / name / "generalise" / "wording.yaml"
        if path.is_file():
            wording = Path(yaml.safe_load(path.read_text())["prompt_file"]).parent
            rung = TASKS_DIR / yaml.safe_load((RECIPES / name / "pipeline.yaml").read_text())["task"]
            trained = {r["metadata"]["expression"] for r in read(ROOT / rung / "train_prompts.jsonl")}
            asked = [r["metadata"]["expression"] for r in read(ROOT / wording / "eval_prompts.jsonl")]
            assert asked and not trained & set(asked), name


# The task of each gym recipe, and the keys its stage files spelled out themselves before a pipeline named the task
NAMED_BEFORE = {
    "gym-chain_sum-t2d1": "chain_sum-t2d1",
    "gym-chain_sum-t2d2": "chain_sum-t2d2",
    "gym-chain_sum-t3d1": "chain_sum-t3d1",
    "gym-leg_counting-a1": "leg_counting-a1",
    "gym-letter_counting-w2": "letter_counting-w2",
}


@pytest.mark.parametrize("name", sorted(NAMED_BEFORE))
def test_a_recipes_task_resolves_to_the_files_and_verifier_its_stage_files_named(name, monkeypatch):
    """`task: <name>` in a pipeline gives PPO and eval exactly the keys the recipe's ppo.yaml and eval.yaml
    wrote out before (the lines removed from them, as they stood), and the sweeps of a rung train on its task."""
    monkeypatch.chdir(ROOT)
    task = NAMED_BEFORE[name]
    cfg = gym_configs(name)
    assert cfg["pipeline"].task == task
    before = {
        "ppo": {
            "reward_fn": f"data/tasks/{task}/verifier.py:reward",
            "prompt_file": f"data/tasks/{task}/train_prompts.jsonl",
            "eval_prompt_file": f"data/tasks/{task}/eval_prompts.jsonl",
            "accuracy_fn": f"data/tasks/{task}/verifier.py:accuracy",
            "output_dir": f"runs/{name}/ppo",
        },
        "eval": {
            "policy_path": f"runs/{name}/ppo",
            "reward_fn": f"data/tasks/{task}/verifier.py:reward",
            "accuracy_fn": f"data/tasks/{task}/verifier.py:accuracy",
            "prompt_file": f"data/tasks/{task}/eval_prompts.jsonl",
            "output_dir": f"runs/{name}/eval",
        },
    }
    for stage, keys in before.items():
        assert {key: getattr(cfg[stage], key) for key in keys} == keys, stage
        assert task_keys(task, stage) == {key: keys[key] for key in TASK_KEYS[stage]}
    for sweep in sorted((RECIPES / name).glob("sweep/pipeline.yaml")):
        run = pipeline.sweep_runs(parse_config(pipeline.Config, ["--config", str(sweep)]))[0]
        ppo_cfg = pipeline.stage_config(run, "ppo")
        assert {k: getattr(ppo_cfg, k) for k in TASK_KEYS["ppo"]} == task_keys(task, "ppo"), sweep


def test_a_pipelines_task_is_named_once_and_overrides_win(tmp_path, monkeypatch):
    """An unknown task and a stage file that names a task key too are one ConfigError line each; the
    pipeline's own `ppo:` block still wins over the task (a user's explicit key)."""
    monkeypatch.chdir(ROOT)
    recipe = RECIPES / "gym-chain_sum-t2d1" / "pipeline.yaml"

    def resolved(*argv: str):
        return pipeline.stage_config(parse_config(pipeline.Config, ["--config", str(recipe), *argv]), "ppo")

    with pytest.raises(ConfigError, match=r"^task 'no_such': no data/tasks/no_such/task.json .*tasks.yaml"):
        resolved("--task", "no_such")
    assert resolved("--ppo", '{"prompt_file": "mine.jsonl"}').prompt_file == "mine.jsonl"
    stage_file = tmp_path / "ppo.yaml"
    stage_file.write_text(
        (RECIPES / "gym" / "ppo.yaml").read_text()
        + "prompt_file: data/tasks/chain_sum-t2d1/train_prompts.jsonl\n"
    )
    with pytest.raises(
        ConfigError, match=r"ppo.yaml: prompt_file come from the pipeline's task 'chain_sum-t2d1'"
    ):
        resolved("--ppo_config", str(stage_file))


def test_the_estimator_sweep_is_six_estimators_by_three_seeds_at_equal_responses(monkeypatch):
    monkeypatch.chdir(ROOT)
    path = RECIPES / "gym-chain_sum-t2d1" / "sweep" / "pipeline.yaml"
    cfg = parse_config(pipeline.Config, ["--config", str(path)])
    runs = pipeline.sweep_runs(cfg)
    seen = set()
    for run in runs:
        ppo_cfg = pipeline.stage_config(run, "ppo")
        eval_cfg = pipeline.stage_config(run, "eval")
        assert ppo_cfg.rollout_batch_size * ppo_cfg.samples_per_prompt * ppo_cfg.steps == 32 * 12
        assert ppo_cfg.prompt_file == "data/tasks/chain_sum-t2d1/train_prompts.jsonl"
        assert eval_cfg.policy_path == ppo_cfg.output_dir == f"{run.output_dir}/ppo"
        # PPO only: the final accuracy is the last held-out evaluation, on every held-out problem
        assert run.stages == ["ppo"] and ppo_cfg.steps % ppo_cfg.eval_every == 0
        held_out = (ROOT / ppo_cfg.eval_prompt_file).read_text(encoding="utf-8").splitlines()
        assert ppo_cfg.eval_num_prompts == len(held_out) == 64
        seen.add((ppo_cfg.advantage_estimator, ppo_cfg.seed))
    estimators = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "remax")
    assert seen == {(e, s) for e in estimators for s in (0, 1, 2)} and len(runs) == 18


def test_the_second_rung_sweep_is_three_estimators_and_the_loss_family_by_three_seeds(monkeypatch):
    """recipes/gym-chain_sum-t3d1/sweep: rung 1's best three estimators, the DAPO shape, GSPO and CISPO, each on
    seeds 0, 1, 2, every run the rung-2 recipe with 32 trained responses a step; the loss-family runs are GRPO
    groups of 4 with only their published keys changed."""
    monkeypatch.chdir(ROOT)
    cfg = parse_config(
        pipeline.Config, ["--config", str(RECIPES / "gym-chain_sum-t3d1" / "sweep" / "pipeline.yaml")]
    )
    runs = pipeline.sweep_runs(cfg)
    by_name = {}
    for run in runs:
        ppo_cfg = pipeline.stage_config(run, "ppo")
        assert run.stages == ["ppo"] and ppo_cfg.rollout_batch_size * ppo_cfg.samples_per_prompt == 32
        assert ppo_cfg.prompt_file == "data/tasks/chain_sum-t3d1/train_prompts.jsonl" and ppo_cfg.steps == 12
        assert ppo_cfg.eval_prompt_file == "data/tasks/chain_sum-t3d1/eval_prompts.jsonl"
        name, seed = Path(run.output_dir).name.rsplit("-seed", 1)
        assert ppo_cfg.seed == int(seed)
        by_name.setdefault(name, []).append(ppo_cfg)
    assert len(runs) == 18 and all(len(cfgs) == 3 for cfgs in by_name.values())
    losses = {"dapo": "ppo_clip", "gspo": "gspo", "cispo": "cispo"}
    estimators = [n for n in by_name if n not in losses]
    assert sorted(estimators) == ["gae", "reinforce_pp", "remax"]  # rung 1's best three at step 12
    assert all(
        c.advantage_estimator == n and c.policy_loss == "ppo_clip" for n in estimators for c in by_name[n]
    )
    for name, loss in losses.items():  # every seed of a variant, not only the first
        for c in by_name[name]:
            assert c.policy_loss == loss and c.advantage_estimator == "grpo" and c.samples_per_prompt == 4
            assert c.dynamic_sampling == (name == "dapo") and (c.init_kl_coef == 0.0) == (name == "dapo")
    for dapo in by_name["dapo"]:
        assert dapo.cliprange_high > dapo.cliprange_low and dapo.overlong_buffer > 0
    assert all(c.loss_aggregation == "seq_mean_token_mean" for c in by_name["gspo"])


def test_the_first_rung_loss_sweep_is_the_loss_family_by_three_seeds_at_the_estimators_responses(monkeypatch):
    """recipes/gym-chain_sum-t2d1/losses: the DAPO shape, GSPO, CISPO and SAPO on seeds 0, 1, 2, each the
    rung-1 recipe with GRPO groups of 4 and 32 trained responses a step (the estimator table's budget), only the
    loss's published keys changed; GSPO and SAPO take their row's aggregation (loss_aggregation null)."""
    monkeypatch.chdir(ROOT)
    cfg = parse_config(
        pipeline.Config, ["--config", str(RECIPES / "gym-chain_sum-t2d1" / "losses" / "pipeline.yaml")]
    )
    by_name = {}
    for run in pipeline.sweep_runs(cfg):
        c = pipeline.stage_config(run, "ppo")
        assert run.stages == ["ppo"] and (c.rollout_batch_size, c.samples_per_prompt, c.steps) == (8, 4, 12)
        assert (
            c.prompt_file == "data/tasks/chain_sum-t2d1/train_prompts.jsonl"
            and c.advantage_estimator == "grpo"
        )
        assert (c.learning_rate, c.ppo_epochs, c.max_new_tokens, c.use_lora) == (2e-4, 2, 32, True)
        name, seed = Path(run.output_dir).name.rsplit("-seed", 1)
        assert c.seed == int(seed)
        by_name.setdefault(name, []).append(c)
    losses = {"dapo": "ppo_clip", "gspo": "gspo", "cispo": "cispo", "sapo": "sapo"}
    assert {n: sorted(c.seed for c in cs) for n, cs in by_name.items()} == {n: [0, 1, 2] for n in losses}
    for name, loss in losses.items():
        for c in by_name[name]:
            assert c.policy_loss == loss and c.dynamic_sampling == (name == "dapo")
            assert c.init_kl_coef == (0.0 if name == "dapo" else 0.04)
            assert c.aggregation == {"dapo": "token_mean", "cispo": "token_mean"}.get(
                name, "seq_mean_token_mean"
            )


def test_the_second_rung_curriculum_is_rung_twos_recipe_from_rung_ones_policy(monkeypatch):
    """recipes/gym-chain_sum-t3d1/curriculum: seeds 0, 1, 2 of rung 2's own PPO recipe, with one key
    changed: the start (and the KL's reference) is the rung-1 recipe's PPO output, not the instruct model."""
    monkeypatch.chdir(ROOT)
    rung_two = gym_configs("gym-chain_sum-t3d1")["ppo"]
    rung_one = gym_configs("gym-chain_sum-t2d1")["ppo"]
    cfg = parse_config(
        pipeline.Config, ["--config", str(RECIPES / "gym-chain_sum-t3d1" / "curriculum" / "pipeline.yaml")]
    )
    runs = pipeline.sweep_runs(cfg)
    assert cfg.task == "chain_sum-t3d1" and [run.stages for run in runs] == [["ppo"]] * 3
    assert rung_one.merge_lora  # the start is a whole model folder, not an adapter
    for seed, run in enumerate(runs):
        c = pipeline.stage_config(run, "ppo")
        assert c.model_name_or_path == rung_one.output_dir == "runs/gym-chain_sum-t2d1/ppo"
        differs = {
            k for k in vars(c) if getattr(c, k) != getattr(rung_two, k) and k not in ("output_dir", "seed")
        }
        assert differs == {"model_name_or_path"} and c.seed == seed
        assert c.output_dir == f"runs/gym-chain_sum-t3d1-curriculum/seed{seed}/ppo"


@pytest.mark.slow
def test_a_gym_recipe_runs_through_the_pipeline_on_a_tiny_chat_llama(tmp_path, monkeypatch):
    """`llm-rlhf pipeline --config recipes/gym-chain_sum-t2d1/pipeline.yaml` with a tiny Llama (a chat template of
    its own) in place of SmolLM2, two steps and a few held-out problems: the committed task files are rendered
    and scored by the task's verifier, and the held-out evaluations and the eval stage report its accuracy."""
    monkeypatch.chdir(ROOT)
    model = tiny_chat_model(tmp_path / "tiny_chat_llama", TAGGED_CHAT_TEMPLATE, n_positions=256)
    out = tmp_path / "run"
    ppo_keys = {
        "model_name_or_path": str(model),
        "steps": 2,
        "rollout_batch_size": 2,
        "mini_batch_size": 4,
        "max_prompt_length": 200,
        "max_new_tokens": 4,
        "eval_every": 1,
        "eval_num_prompts": 3,
    }
    eval_keys = {"num_prompts": 3, "max_prompt_length": 200, "max_new_tokens": 4}
    argv = [
        "--config",
        str(RECIPES / "gym-chain_sum-t2d1" / "pipeline.yaml"),
        "--output_dir",
        str(out),
        "--ppo",
        json.dumps(ppo_keys),
        "--eval",
        json.dumps(eval_keys),
    ]
    pipeline.run(parse_config(pipeline.Config, argv))
    heldout = read(out / "ppo" / "eval_log.jsonl")
    assert [r["step"] for r in heldout] == [0, 1, 2]
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    assert metrics["accuracy_fn"] == "data/tasks/chain_sum-t2d1/verifier.py:accuracy"
    verdicts = Verifier(TASKS_DIR / "chain_sum-t2d1", binary=True)
    rows = read(out / "eval" / "samples.jsonl")
    assert len(rows) == 6  # 3 problems x 2 samples
    prompts = [r["prompt"] for r in rows]
    assert [r["policy_correct"] for r in rows] == verdicts(prompts, [r["policy_response"] for r in rows])
    assert metrics["accuracy"] == pytest.approx(sum(r["policy_correct"] for r in rows) / len(rows))
    assert (out / "report.html").is_file()
