"""The documentation site (docs/, mkdocs.yml): the generated reference pages are what `python docs/generate.py`
writes, `mkdocs build --strict` passes, every command a page shows is run by a test, and "Your own data in five
minutes" does what it says on a newcomer's JSONL files."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import (
    CHAINED,
    ROOT,
    SENTENCES,
    code_blocks,
    doc_section,
    perturb,
    preference_rows,
    tiny_chat_model,
    tiny_overrides,
    write_jsonl,
)

from llm_rlhf.core.config import parse_config
from llm_rlhf.interfaces import cli

DOCS = ROOT / "docs"


def load_generate():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the generated pages and the build ----------------------------------------------------------------------


def test_the_generated_reference_pages_are_the_committed_ones(tmp_path):
    """`python docs/generate.py --out DIR` writes the pages again; each equals the committed one, and the
    commands folder holds no page the script no longer writes."""
    subprocess.run([sys.executable, str(DOCS / "generate.py"), "--out", str(tmp_path)], check=True, cwd=ROOT)
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.md"))
    assert written == sorted(load_generate().pages())
    stale = [p for p in written if (DOCS / p).read_text(encoding="utf-8") != (tmp_path / p).read_text()]
    assert stale == [], "run `python docs/generate.py` and commit the pages"
    commands = sorted(p.relative_to(DOCS).as_posix() for p in (DOCS / "reference" / "commands").glob("*.md"))
    assert commands == [p for p in written if p.startswith("reference/commands/")]


def test_a_command_page_lists_every_key_with_its_help():
    """Each command's page names every key of its config, with its type, default and help text, as --help does."""
    from llm_rlhf.core.config import config_keys

    generate = load_generate()
    for name, (module_name, _) in cli.COMMANDS.items():
        config = getattr(importlib.import_module(module_name), "Config", None)
        page = (DOCS / "reference" / "commands" / f"{name}.md").read_text()
        for key in config_keys(config) if config else []:
            entry = page[page.index(f"### `{key.name}`\n") :].split("\n### ")[0]
            assert f"*{key.type}*" in entry and generate.escape(key.help) in entry, (name, key.name)


def test_markdown_escaping_keeps_code_and_escapes_markup():
    escape = load_generate().escape
    assert escape("a * b < c `x_y * z`") == r"a \* b &lt; c `x_y * z`"
    assert escape("reward_fn [0, 1] {k: 2}") == r"reward\_fn \[0, 1\] \{k: 2\}"


def test_a_recipe_page_is_its_readme_with_links_pointed_from_the_site():
    """docs/recipes/<recipe>.md is the recipe's README; a link to another recipe's README goes to that one's page,
    a link into docs/ stays in the site, and a link to a recipe file leaves docs/ for the repository file."""
    generate = load_generate()
    readmes = generate.recipe_readmes()
    assert {"recipes/reviews/README.md", "recipes/smollm2-reviews/README.md"} <= set(readmes)
    assert generate.recipe_page_path("recipes/reviews/README.md") == "recipes/reviews.md"
    assert generate.recipe_page_path("recipes/a/b/README.md") == "recipes/a/b.md"
    link = lambda target, readme="recipes/reviews-lora/README.md": generate.site_link(  # noqa: E731
        target, readme, generate.recipe_page_path(readme)
    )
    assert link("../reviews/README.md") == "reviews.md"
    assert link("../../docs/results/reviews.md#the-main-job") == "../results/reviews.md#the-main-job"
    assert link("pipeline.yaml") == "../../recipes/reviews-lora/pipeline.yaml"
    assert link("https://example.org/x") == "https://example.org/x" and link("#commands") == "#commands"
    nested = [r for r in readmes if r.count("/") == 3]
    if nested:
        parent = nested[0].rsplit("/", 2)[0] + "/README.md"
        assert link("../README.md", nested[0]) == "../" + parent.split("/")[1] + ".md"
    page = generate.recipe_page("recipes/reviews/README.md")
    text = (ROOT / "recipes/reviews/README.md").read_text()
    assert page.split("\n")[0] == text.split("\n")[0] and "recipes/reviews/README.md" in page.split("\n")[2]


def test_the_site_builds_with_strict_checks(tmp_path):
    """`mkdocs build --strict`, as CI runs it: a broken link or anchor, a page left out of the nav, or a link to
    a repository file that does not exist fails. The `docs` extra installs MkDocs (CI installs it)."""
    for package in ("mkdocs", "material"):
        assert importlib.util.find_spec(package), f'{package} is missing: pip install -e ".[docs]"'
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (site / "index.html").is_file() and (site / "getting-started" / "your-data.html").is_file()


def test_the_repository_link_hook_checks_links_out_of_docs():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.outside_docs("guides/x.md", "../../recipes/reviews/README.md") == "recipes/reviews/README.md"
    assert hooks.outside_docs("guides/x.md", "../reference/math.md#gae") is None
    assert hooks.outside_docs("index.md", "https://example.org/") is None


# --- every command a page shows is run ----------------------------------------------------------------------

# The pages whose code blocks a test reads and runs on tiny models (`doc_section`), and that test.
RUNNERS = {
    "README.md": "tests/recipes_and_docs/test_readme_commands.py",
    "getting-started/your-data.md": "tests/recipes_and_docs/test_docs.py",
    "getting-started/python-api.md": "tests/interfaces/test_api.py",
    "guides/reward-functions.md": "tests/models/test_reward_fn.py",
    "guides/generation.md": "tests/rl/test_generation_controls.py",
    "guides/environments.md": "tests/rl/test_episodes.py",
    "guides/estimators.md": "tests/recipes_and_docs/test_readme_commands.py",
    "guides/distillation.md": "tests/recipes_and_docs/test_readme_commands.py",
    "guides/ensembles.md": "tests/models/test_rm_ensemble.py",
}


def block_commands(block: str) -> list[str]:
    """The `llm-rlhf` command lines of a bash block as a shell would run them: continued lines joined, `cmd &&`
    and `VAR=value` / `/usr/bin/time -v` prefixes dropped, a `# comment` cut, and the variables a line sets
    (`VAR=value`) or a loop binds (`for VAR in first ...; do`, its first value) put in."""
    values, commands = {}, []
    for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
        line = line.split("  #")[0].strip()
        loop = re.match(r"for (\w+) in (\S+)", line)
        if loop:
            values[loop.group(1)] = loop.group(2)
        line = re.sub(r"\$(\w+)", lambda m: values.get(m.group(1), m.group(0)), line)
        assignment = re.fullmatch(r"(\w+)=(\S+)", line)
        if assignment:
            values[assignment.group(1)] = assignment.group(2)
        command = re.sub(r"^((\w+=\S+|/usr/bin/time -v)\s+)+", "", line.split(" && ")[-1])
        if command.startswith("llm-rlhf "):
            commands.append(command)
    return commands


def shown_commands() -> dict[str, list[str]]:
    """The `llm-rlhf` commands in the bash blocks of the README and of every page: page -> command lines."""
    pages = {"README.md": (ROOT / "README.md").read_text()}
    pages |= {p.relative_to(DOCS).as_posix(): p.read_text() for p in sorted(DOCS.rglob("*.md"))}
    found = {}
    for page, text in pages.items():
        commands = [c for block in code_blocks(text, "bash") for c in block_commands(block)]
        if commands:
            found[page] = commands
    return found


def test_block_commands_reads_a_block_as_the_shell_would():
    block = (
        "RUN=runs/x/ppo   # or y\nllm-rlhf eval --config a.yaml --policy_path $RUN\n"
        "for S in 0 1 2; do\n  D=runs/s-$S\n  OMP_NUM_THREADS=1 llm-rlhf ppo --config b.yaml \\\n"
        "    --model_name_or_path $D/sft  # seed\ndone\npython x.py && llm-rlhf report runs/r\n"
    )
    assert block_commands(block) == [
        "llm-rlhf eval --config a.yaml --policy_path runs/x/ppo",
        "llm-rlhf ppo --config b.yaml --model_name_or_path runs/s-0/sft",
        "llm-rlhf report runs/r",
    ]


def test_every_command_a_page_shows_is_run_by_a_test(monkeypatch):
    """A page with `llm-rlhf` commands in its code blocks is read and run by its test (`RUNNERS`, whose file
    names the page); on the other pages (the recipes' and the results') each command names a recipe file that
    tests/recipes_and_docs/test_recipes.py parses and whose own stages it runs on a tiny model, with flags that
    parse into the command's config; a pipeline command builds every run and stage config its flags make (each
    sweep variant's, as `llm-rlhf pipeline` does before its first stage), and `report` takes one run folder."""
    from llm_rlhf.interfaces import pipeline

    found = shown_commands()
    monkeypatch.chdir(ROOT)  # the pages' commands run from the repository root
    assert {"README.md", "guides/estimators.md", "getting-started/your-data.md"} <= set(found)
    assert any(page.startswith("recipes/") for page in found)
    for page, test in RUNNERS.items():
        assert page.removeprefix("docs/") in (ROOT / test).read_text() or page == "README.md", (page, test)
    for page, commands in found.items():
        if page in RUNNERS:
            continue
        for command in commands:
            _, name, *argv = shlex.split(command)
            if name == "report":  # `llm-rlhf report DIR`: tests/interfaces/test_report.py runs it
                assert len(argv) == 1 and not argv[0].startswith("-"), (page, command)
                continue
            config = argv[argv.index("--config") + 1] if "--config" in argv else None
            assert config and config.startswith("recipes/") and (ROOT / config).is_file(), (page, command)
            module = importlib.import_module(cli.COMMANDS[name][0])
            cfg = parse_config(module.Config, argv)
            if name == "pipeline":
                for run in pipeline.sweep_runs(cfg) if cfg.sweep else [cfg]:
                    for stage in run.stages:
                        pipeline.stage_config(run, stage)


# --- the checkable tasks' studies run as their pages show them ----------------------------------------------

GYM_STUDY = re.compile(  # a study of a checkable-task recipe: in a sub-folder, or the arithmetic one's sweeps
    r"recipes/gym-[^/]+/[^/]+/|recipes/smollm2-arithmetic/pipeline\.yaml .*--ppo"
)
TINY_STAGES = {  # the budget of every stage a study runs: a step or two; every other key the recipe's but the
    # prompt lengths, which the tiny tokenizer (about twice SmolLM2's tokens for the same text) needs longer
    "sft": {
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "eval_steps": 0,
        "save_steps": 2,
        "num_samples": 0,
    }
    | {"max_length": 800},
    "ppo": {"steps": 1, "eval_every": 1, "eval_num_prompts": 2, "save_steps": 0, "log_samples_every": 0}
    | {"max_prompt_length": 600},
    "eval": {"num_prompts": 2, "max_prompt_length": 600},
}


def gym_study_commands() -> list[str]:
    """The pages' commands that run a checkable-task study: a sub-folder's pipeline (a sweep of estimators,
    losses, pass@k, distillation, a curriculum, episodes), the arithmetic recipe's runs of another estimator or
    loss, or an evaluation of a trained policy (generalisation, a probe)."""
    commands = [c for page, found in shown_commands().items() for c in found]
    studies = [c for c in commands if c.split()[1] in ("pipeline", "eval") and GYM_STUDY.search(c)]
    return sorted(set(studies))


def with_tiny_budget(name: str, argv: list[str]) -> list[str]:
    """The command's flags with the study budget put in: for a pipeline, each stage's dict is the recipe file's,
    then the budget, then the page's own keys (a page's `--ppo "{seed: 0}"` keeps them all); for an evaluation,
    the budget's flags first (the page's own win)."""
    if name == "eval":
        return [a for k, v in TINY_STAGES["eval"].items() for a in (f"--{k}", str(v))] + argv
    from llm_rlhf.interfaces import pipeline

    cfg = parse_config(pipeline.Config, argv)
    argv = list(argv)
    for stage, budget in TINY_STAGES.items():
        flag = f"--{stage}"
        page = yaml.safe_load(argv.pop(argv.index(flag) + 1)) if flag in argv else {}
        if flag in argv:
            argv.remove(flag)
        argv += [flag, json.dumps({**(getattr(cfg, stage) or {}), **budget, **page})]
    return argv


@pytest.fixture(scope="module")
def study_root(tmp_path_factory) -> Path:
    """A repository root as the studies expect it, with tiny chat Llamas where they name SmolLM2: data/ holds the
    repository's data but data/smollm2-135m-instruct and data/smollm2-20-blocks (another draw of the same tiny
    architecture and tokenizer), and runs/ the rung-1 policy that the curriculum starts from and distillation
    learns from, and the trained policies the evaluations read (each the tiny model moved by seeded noise)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("study_root")
    (root / "recipes").symlink_to(ROOT / "recipes")
    (root / "data").mkdir()
    for entry in (ROOT / "data").iterdir():
        if entry.name not in ("smollm2-135m-instruct", "smollm2-20-blocks"):
            (root / "data" / entry.name).symlink_to(entry)
    chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    start = tiny_chat_model(root / "data" / "smollm2-135m-instruct", chat_template)
    policies = {"data/smollm2-20-blocks", "runs/gym-chain_sum-t2d1/ppo"}
    for command in gym_study_commands():
        _, name, *argv = shlex.split(command)
        if name == "eval":
            config = ["--config", str(ROOT / argv[argv.index("--config") + 1])]
            policies.add(
                parse_config(importlib.import_module(cli.COMMANDS["eval"][0]).Config, config).policy_path
            )
            if "--policy_path" in argv:
                policies.add(argv[argv.index("--policy_path") + 1])
    for seed, policy in enumerate(sorted(policies - {"data/smollm2-135m-instruct"})):
        shutil.copytree(start, root / policy)
        lm = AutoModelForCausalLM.from_pretrained(root / policy)
        perturb(lm, seed=seed, scale=0.5)
        lm.save_pretrained(root / policy, safe_serialization=True)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("command", gym_study_commands())
def test_every_study_a_checkable_task_page_shows_runs_on_tiny_models(command, study_root, monkeypatch):
    """Each study command of the checkable tasks' pages, as the page writes it (every variant of its sweep, the
    page's own flags), on tiny chat Llamas with a step's budget: it exits 0 and each run logs its step and its
    held-out evaluations; an evaluation writes its metrics."""
    from llm_rlhf.interfaces import pipeline

    monkeypatch.chdir(study_root)
    _, name, *argv = shlex.split(command)
    argv = with_tiny_budget(name, argv)
    assert cli.main([name, *argv]) == 0, command
    if name == "eval":
        cfg = parse_config(importlib.import_module(cli.COMMANDS["eval"][0]).Config, argv)
        assert (study_root / cfg.output_dir / "metrics.json").is_file()
        return
    cfg = parse_config(pipeline.Config, argv)
    for run in pipeline.sweep_runs(cfg) if cfg.sweep else [cfg]:
        if "ppo" in run.stages:
            ppo_dir = study_root / run.output_dir / "ppo"
            logged = [json.loads(x) for x in (ppo_dir / "metrics.jsonl").read_text().splitlines()]
            heldout = [json.loads(x) for x in (ppo_dir / "eval_log.jsonl").read_text().splitlines()]
            steps = pipeline.stage_config(run, "ppo").steps  # 1, or the page's own
            assert [m["step"] for m in logged] == list(range(1, steps + 1)), run.output_dir
            assert heldout[0]["step"] == 0 and heldout[-1]["step"] <= steps, run.output_dir  # eval_every's


# --- your own data in five minutes --------------------------------------------------------------------------

BUDGET = {"sft": {"lora_layers": 1}, "rm": {"lora_layers": 1}, "ppo": {"lora_layers": 1, "eval_every": 2}}
DATA_KEYS = {  # the keys the page sets in the pipeline's blocks: the page's own, never the test's
    "sft": ("model_name_or_path", "train_file", "eval_file"),
    "rm": ("train_file", "eval_file", "test_file"),
    "ppo": ("prompt_file", "eval_prompt_file", "gold_judge"),
    "eval": ("prompt_file", "gold_judge"),
}


def newcomers_files(folder: Path) -> None:
    """A newcomer's JSONL: prompt/completion rows and preference pairs, each with a held-out file."""
    rows = [
        {"prompt": " ".join(s.split(" ")[:3]), "completion": " " + " ".join(s.split(" ")[3:])}
        for s in SENTENCES
    ]
    write_jsonl(folder / "sft.jsonl", rows * 4)
    write_jsonl(folder / "sft_val.jsonl", rows[:4])
    write_jsonl(folder / "prefs.jsonl", preference_rows() * 8)
    write_jsonl(folder / "prefs_val.jsonl", preference_rows())


def with_a_tiny_budget(recipe: Path, model: Path, out: Path) -> None:
    """The copied stage files with the tests' two-step budget (`tiny_overrides`), less the keys the pipeline
    chains and the data keys the page writes: what the page says is run as it says it."""
    overrides = tiny_overrides(model, {"sft": None, "prefs": None, "prompts": None}, out, max_length=48)
    for stage, values in overrides.items():
        path = recipe / f"{stage}.yaml"
        keys = yaml.safe_load(path.read_text())
        for key, value in {**values, **BUDGET.get(stage, {})}.items():
            if key not in CHAINED[stage] and key not in DATA_KEYS[stage]:
                keys[key] = str(value) if isinstance(value, Path) else value
        path.write_text(yaml.safe_dump(keys, sort_keys=False))


@pytest.mark.slow
def test_your_own_data_trains_as_the_page_says(tiny_llama_dir, tmp_path, monkeypatch):
    """docs/getting-started/your-data.md step by step in a fresh folder: the newcomer's four JSONL files, the
    page's `cp -r` of the main job's recipe run as a shell command, its pipeline.yaml written over the copy, and
    its `llm-rlhf pipeline` command; then its reward-function variant (my_rewards.py and rule.yaml). The tiny
    Llama stands where `python data/make_smollm2.py` puts SmolLM2, and the copied stage files get a two-step
    budget. Every stage writes its folder and the run its report, from the newcomer's rows."""
    page = doc_section("getting-started/your-data.md")
    copy, run = code_blocks(page, "bash")[:2]
    assert copy.strip() == "cp -r recipes/smollm2-reviews recipes/mine"
    assert run.splitlines() == [
        "python data/make_smollm2.py",
        "llm-rlhf pipeline --config recipes/mine/pipeline.yaml",
    ]
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "recipes" / "smollm2-reviews", tmp_path / "recipes" / "smollm2-reviews")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "smollm2-135m-instruct").symlink_to(tiny_llama_dir)  # python data/make_smollm2.py
    newcomers_files(tmp_path / "my_data")
    subprocess.run(copy, shell=True, check=True, cwd=tmp_path)
    for block in code_blocks(page, "yaml"):
        target = re.match(r"# (\S+\.yaml)\n", block).group(1)
        (tmp_path / target).write_text(block)
    (code,) = code_blocks(page, "python")
    (tmp_path / "my_rewards.py").write_text(code)
    with_a_tiny_budget(tmp_path / "recipes" / "mine", tiny_llama_dir, tmp_path / "unused")

    assert cli.main(shlex.split(run.splitlines()[1])[1:]) == 0
    out = tmp_path / "runs" / "mine"
    for stage in ("sft", "rm", "ppo", "eval"):
        assert (out / stage / "metrics.json").is_file(), stage
    assert (out / "report.html").is_file()
    sft_config = yaml.safe_load((out / "sft" / "config.yaml").read_text())
    assert sft_config["train_file"] == "my_data/sft.jsonl"
    assert yaml.safe_load((out / "rm" / "config.yaml").read_text())["train_file"] == "my_data/prefs.jsonl"
    assert json.loads((out / "rm" / "metrics.json").read_text())["global_step"] == 2

    (rule,) = [line for line in code_blocks(page, "bash")[2].splitlines() if line.startswith("llm-rlhf")]
    assert rule == "llm-rlhf pipeline --config recipes/mine/rule.yaml"
    assert cli.main(shlex.split(rule)[1:]) == 0
    out = tmp_path / "runs" / "mine-rule"
    assert not (out / "rm").exists()
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    assert metrics["reward_fn"] == "my_rewards:concise" and metrics["reward_fn_mean"] is not None
    assert metrics.get("rm_score_mean") is None  # no reward model: the rule is the whole score
