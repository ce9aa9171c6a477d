"""The reference pages that the code writes: `python docs/generate.py [--out DIR]` (from the repository root).

    docs/reference/commands/<command>.md   every key of a command: type, default and help, from the help text
                                           of its config dataclass (what `llm-rlhf <command> --help` prints)
    docs/reference/estimators.md           the advantage estimators' table, from `llm_rlhf.rl.estimators.ROWS`
    docs/reference/policy-losses.md        the policy losses' table, from `llm_rlhf.rl.policy_losses.ROWS`
    docs/reference/metrics.md              the names the logs use, from `llm_rlhf.ppo.metrics` and
                                           `llm_rlhf.evaluation.metric_names`
    docs/recipes/<recipe>[/<study>].md     each recipe's page: its README (recipes/<recipe>[/<study>]/README.md)
                                           with its links pointing from the site

The pages are committed; tests/recipes_and_docs/test_docs.py writes them again into a temporary folder and
compares, so a help text, a row or a metric name changed without running this script fails the tests.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import io
import posixpath
import re
import sys
import tokenize
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = (
    "<!-- Written by docs/generate.py from the code: edit the code, then run `python docs/generate.py`. -->"
)
COMMANDS_DIR = "reference/commands"


# --- Markdown ------------------------------------------------------------------------------------------------


def escape(text: str) -> str:
    """Text for a Markdown paragraph or table cell: the characters Markdown would read as markup escaped,
    except inside `code` spans, which stay code."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part)
            continue
        part = part.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        out.append(re.sub(r"([\\*_{}\[\]|#])", r"\\\1", part))
    return "".join(out)


def yaml_value(value) -> str:
    """A default as a recipe writes it: null, true, [all-linear], {}."""
    if value is None:
        return "null"
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def code(text: str) -> str:
    """An inline code span that holds any text (a backtick inside gets a longer fence)."""
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def text_block(text: str) -> str:
    return "```text\n" + text.strip("\n") + "\n```"


def dedent_doc(doc: str | None) -> str:
    import inspect

    return inspect.cleandoc(doc or "")


# --- the commands --------------------------------------------------------------------------------------------


def command_page(name: str, module_name: str, summary: str) -> str:
    from llm_rlhf.core.config import config_keys

    module = importlib.import_module(module_name)
    lines = [f"# `llm-rlhf {name}`", "", GENERATED, "", escape(summary), ""]
    config = getattr(module, "Config", None)
    if config is None:  # a command with its own argument form (`report DIR`)
        lines += [
            f"`llm-rlhf {name}` takes no config keys. What its module ({code(module_name)}) says:",
            "",
            text_block(dedent_doc(module.__doc__)),
            "",
        ]
        return "\n".join(lines)
    doc = sys.modules[config.__module__].__doc__
    keys = config_keys(config)
    lines += [
        f"Every key below is a line of a `--config` YAML file and a flag `--key value` (defaults < YAML < flags); "
        f"`llm-rlhf {name} --help` prints the same keys. An unknown key is an error naming the closest one. "
        f"{len(keys)} keys, in the order {code(config.__module__ + '.Config')} declares them.",
        "",
        f"What {code(config.__module__)} says:",
        "",
        text_block(dedent_doc(doc)),
        "",
        "## Keys",
        "",
    ]
    for key in keys:
        default = "required" if key.default == "required" else code(yaml_value(key.default))
        lines += [f"### `{key.name}`", "", f"*{key.type}*, default {default}", "", escape(key.help), ""]
    return "\n".join(lines)


def commands_index() -> str:
    from llm_rlhf.interfaces.cli import COMMANDS

    lines = [
        "# Commands",
        "",
        GENERATED,
        "",
        "`llm-rlhf <command> [--config recipe.yaml] [--key value ...]`, also `python -m llm_rlhf <command>` and, on "
        "several processes, `accelerate launch ... -m llm_rlhf <command>`. Each page lists the command's keys "
        "with their types, defaults and help, as `llm-rlhf <command> --help` prints them.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`{name}`]({name}.md) | {escape(summary)} |" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


# --- the tables of rows ------------------------------------------------------------------------------------


def cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        return ", ".join(code(v) for v in value) if value else "-"
    return escape(str(value))


def estimators_page() -> str:
    from llm_rlhf.rl import estimators

    lines = [
        "# Advantage estimators",
        "",
        GENERATED,
        "",
        "The values of `advantage_estimator`, one row each of `llm_rlhf.rl.estimators.ROWS`: the facts the "
        "config, the trainer and the report read. Their equations and worked examples: [the math](math.md); "
        "when to pick which: [comparing methods](../guides/comparing-methods.md).",
        "",
        "| estimator | what it does | critic | smallest k | KL by default | greedy baseline | divided by "
        "| one advantage per response | sampler corrections | dynamic sampling |",
        "|---|---|---|---:|---|---|---|---|---|---|",
    ]
    for row in estimators.ROWS:
        lines.append(
            f"| `{row.name}` | {cell(row.description)} | {cell(row.critic)} | {row.min_samples_per_prompt} | "
            f"{'loss (k3)' if row.kl_in_loss else 'reward'} | {cell(row.greedy_baseline)} | {row.std_scaling} | "
            f"{cell(row.response_advantages)} | {cell(row.corrections)} | {cell(row.dynamic_sampling)} |"
        )
    lines += [
        "",
        "## Keys each estimator does not read",
        "",
        "Set to another value than its default with that estimator, such a key is a config error naming it.",
        "",
        "| estimator | keys it does not read |",
        "|---|---|",
    ]
    lines += [f"| `{row.name}` | {cell(row.ignored_keys)} |" for row in estimators.ROWS]
    lines += [
        "",
        "## The columns",
        "",
        "What `llm_rlhf.rl.estimators.Estimator` says of its fields:",
        "",
        text_block(dedent_doc(estimators.Estimator.__doc__)),
        "",
    ]
    return "\n".join(lines)


def policy_losses_page() -> str:
    from llm_rlhf.rl import policy_losses

    lines = [
        "# Policy losses",
        "",
        GENERATED,
        "",
        "The values of `policy_loss`, one row each of `llm_rlhf.rl.policy_losses.ROWS`. Their equations and "
        "worked examples: [the math](math.md); the keys around them: "
        "[the policy-loss family](../guides/policy-losses.md).",
        "",
        "| loss | what it does | loss aggregations (the first is its default) | clip keys it reads "
        "| clip when null | one advantage per response | sampler correction | plain PPO path |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in policy_losses.ROWS:
        low, high = row.clip_defaults
        clip = "cliprange" if low is None and high is None else f"{low:g} / {high:g}"
        if not row.clip_keys:
            clip = "-"
        lines.append(
            f"| `{row.name}` | {cell(row.description)} | {cell(row.aggregations)} | {cell(row.clip_keys)} | "
            f"{clip} | {cell(row.response_advantages)} | {cell(row.sampler_correction)} | {cell(row.plain)} |"
        )
    lines += [
        "",
        "## The columns",
        "",
        "What `llm_rlhf.rl.policy_losses.PolicyLoss` says of its fields:",
        "",
        text_block(dedent_doc(policy_losses.PolicyLoss.__doc__)),
        "",
    ]
    return "\n".join(lines)


# --- the metric names --------------------------------------------------------------------------------------


def comments_by_line(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def name_sections(module_name: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The string constants of a names module, in order, grouped under the comment lines above them:
    [(section comment, [(constant, value, its comment), ...]), ...]. A tuple of names gives one row."""
    module = importlib.import_module(module_name)
    source = Path(module.__file__).read_text(encoding="utf-8")
    tree = ast.parse(source)
    comments = comments_by_line(source)
    lines = source.splitlines()
    sections: list[tuple[str, list]] = [("", [])]
    previous_end = 0
    for node in tree.body:
        above = [
            comments[n]
            for n in range(previous_end + 1, node.lineno)
            if n in comments and lines[n - 1].lstrip().startswith("#")
        ]
        previous_end = node.end_lineno
        if not isinstance(node, ast.Assign):
            continue
        targets = node.targets[0]
        names = (
            [targets.id] if isinstance(targets, ast.Name) else [t.id for t in getattr(targets, "elts", [])]
        )
        comment = " ".join(comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments)
        rows = []
        for name in names:
            value = getattr(module, name)
            if isinstance(value, str):
                rows.append((name, value, comment if len(names) == 1 else ""))
            elif isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
                rows.append((name, ", ".join(value), comment))
        if not rows:
            continue
        if above:
            sections.append((" ".join(above), []))
        sections[-1][1].extend(rows)
    return [(title, rows) for title, rows in sections if rows]


def functions_of(module_name: str) -> list[tuple[str, str]]:
    module = importlib.import_module(module_name)
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    return [
        (node.name, dedent_doc(ast.get_docstring(node)).split("\n\n")[0].replace("\n", " "))
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    ]


def metrics_page() -> str:
    lines = [
        "# Metric names",
        "",
        GENERATED,
        "",
        "The keys of the logs: PPO's `ppo/metrics.jsonl` (one line per step) and `ppo/metrics.json`, evaluation's "
        "`eval/metrics.json` and `eval/samples.jsonl`, PPO's held-out evaluations in `ppo/eval_log.jsonl`. Each "
        "name is declared once, beside its writer, and the report reads the logs by these names; the tables "
        "below are those declarations, with the comment each carries.",
        "",
    ]
    for module_name, title in (
        ("llm_rlhf.ppo.metrics", "PPO (`llm_rlhf.ppo.metrics`)"),
        ("llm_rlhf.evaluation.metric_names", "Evaluation (`llm_rlhf.evaluation.metric_names`)"),
    ):
        module = importlib.import_module(module_name)
        lines += [f"## {title}", "", text_block(dedent_doc(module.__doc__)), ""]
        for section, rows in name_sections(module_name):
            if section:
                lines += [escape(section[0].upper() + section[1:]), ""]
            lines += ["| name | constant | meaning |", "|---|---|---|"]
            lines += [f"| {code(value)} | `{name}` | {escape(comment)} |" for name, value, comment in rows]
            lines.append("")
        functions = functions_of(module_name)
        if functions:
            lines += ["Names made by a function:", ""]
            lines += [f"- `{name}`: {escape(doc)}" for name, doc in functions]
            lines.append("")
    return "\n".join(lines)


# --- the recipes --------------------------------------------------------------------------------------------

RECIPES_DIR = "recipes"
LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^()\s]+)\)")  # [text](target), not an image
FENCE = re.compile(r"^\s*(```|~~~)")


def recipe_readmes() -> list[str]:
    """Every recipe README, as a repository path: recipes/<recipe>/README.md and recipes/<recipe>/<study>/README.md."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("README.md"))


def recipe_page_path(readme: str) -> str:
    """recipes/<recipe>/README.md -> recipes/<recipe>.md; recipes/<recipe>/<study>/README.md -> recipes/<recipe>/<study>.md
    (paths under docs/)."""
    return posixpath.dirname(readme) + ".md"


def site_link(target: str, readme: str, page: str) -> str:
    """A README's relative link, pointed from its page under docs/: to the page of another recipe README, to a
    page of docs/, or out of docs/ to the repository file (which docs/hooks.py checks and keeps)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target
    path, hash_, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(readme), path))
    if repo_path in recipe_readmes():
        site_path = "docs/" + recipe_page_path(repo_path)
    elif repo_path.startswith(f"{RECIPES_DIR}/") and repo_path.endswith("/README.md"):
        site_path = repo_path  # a README that is not a recipe's: left for the link check to report
    else:
        site_path = repo_path
    relative = posixpath.relpath(site_path, posixpath.dirname("docs/" + page))
    return relative + hash_ + anchor


def recipe_page(readme: str) -> str:
    """The README's text with its links rewritten, the note that it is generated under its title."""
    page = recipe_page_path(readme)
    lines, out, in_fence = (ROOT / readme).read_text(encoding="utf-8").split("\n"), [], False
    for line in lines:
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            line = LINK.sub(lambda m: f"[{m.group(1)}]({site_link(m.group(2), readme, page)})", line)
        out.append(line)
    note = f"<!-- Written by docs/generate.py from {readme}: edit that file, then run `python docs/generate.py`. -->"
    title = 1 if out and out[0].startswith("# ") else 0
    return "\n".join([*out[:title], "", note, *out[title:]])


# --- all of them -------------------------------------------------------------------------------------------


def pages() -> dict[str, str]:
    """Every generated page: its path under docs/ -> its text."""
    from llm_rlhf.interfaces.cli import COMMANDS

    written = {f"{COMMANDS_DIR}/index.md": commands_index()}
    for name, (module_name, summary) in COMMANDS.items():
        written[f"{COMMANDS_DIR}/{name}.md"] = command_page(name, module_name, summary)
    written["reference/estimators.md"] = estimators_page()
    written["reference/policy-losses.md"] = policy_losses_page()
    written["reference/metrics.md"] = metrics_page()
    for readme in recipe_readmes():
        written[recipe_page_path(readme)] = recipe_page(readme)
    return {path: text.rstrip("\n") + "\n" for path, text in written.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DOCS, help="the docs folder to write into (default: docs/)"
    )
    args = parser.parse_args(argv)
    for path, text in pages().items():
        target = args.out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        print(target)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
