"""The package's import graph, read from the `import` statements (ast): it runs one way,

    ppo_math -> models -> rollout / reward_model / accelerated -> scoring -> stages -> api, pipeline, cli

with first-party imports at module top only. `python tests/test_imports.py` prints the graph.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "llm_rlhf"

# Every module's layer: a module imports only modules of lower layers (so the graph has no cycle). A module
# missing here gets the layer above its highest import (`layers`), so a new module has a place at once.
LAYERS = {
    "errors": 0, "utils": 0, "ppo_math": 0, "hacking": 0, "arithmetic": 0,  # hacking, arithmetic: stdlib only
    "config": 1, "data": 1, "baseline": 1, "models": 1, "callables": 1, "fast_sampling": 1,
    "rollout": 2, "reward_model": 2, "reward_fn": 2, "trainer_stage": 2, "gold": 2, "accelerated": 2,
    "scoring": 3,  # the one scorer: reward model or ensemble (reward_model) + reward function (reward_fn)
    "estimators": 1,  # the table of advantage estimators: one row each, its advantage function over ppo_math
    "ppo_config": 3.5,  # PPO's keys, checked with rollout's and scoring's checks; read by ppo, ppo_run, compare
    "sft": 4, "reward": 4, "dpo": 4, "ppo": 4, "evaluate": 4, "score": 4, "report": 4, "judge": 4,
    "ppo_run": 5,  # the `llm-rlhf ppo` command: the trainer (ppo) and held-out evaluation (evaluate)
    "compare": 5,  # `llm-rlhf compare`: a PPO run's settings (ppo), DPO (dpo), held-out evaluation (evaluate)
    "api": 6,  # the Python API: one function per stage (sft, reward, ppo_run, evaluate)
    "pipeline": 6, "cli": 6,
    "__main__": 7, "__init__": 7,
}  # fmt: skip
STAGES = {"sft", "reward", "dpo", "ppo", "ppo_run", "evaluate", "score", "report", "judge", "compare"}


def first_party(node: ast.AST) -> list[str]:
    """The llm_rlhf modules an import statement names (`from llm_rlhf import a, b` names a and b)."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] for a in node.names if a.name.startswith("llm_rlhf.")]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llm_rlhf":
        if node.module == "llm_rlhf":
            return [a.name for a in node.names]
        return [node.module.split(".")[1]]
    return []


def module_files() -> dict[str, list[Path]]:
    """module -> its files: a module's one file, or every file of a sub-package (`report`), one node of the
    graph (`test_report_package_imports_run_one_way` checks the graph inside it)."""
    files = {path.stem: [path] for path in sorted(PACKAGE.glob("*.py"))}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        files[init.parent.name] = sorted(init.parent.glob("*.py"))
    return files


def import_graph() -> dict[str, dict[str, list]]:
    """module -> {"top": first-party modules imported at module level, "nested": (line, module) imported
    inside a function or class, "external": top-level names of the other imports anywhere}."""
    graph = {}
    for module, paths in module_files().items():
        entry = {"top": [], "nested": [], "external": []}
        for path in paths:
            add_imports(entry, ast.parse(path.read_text(encoding="utf-8")), module)
        graph[module] = entry
    return graph


def add_imports(entry: dict[str, list], tree: ast.Module, module: str) -> None:
    """One file's imports into its module's entry of `import_graph` (a sub-package's imports of its own
    modules left out)."""
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        names = [n for n in first_party(node) if n != module]
        if names:
            if id(node) in top_level:
                entry["top"] += names
            else:
                entry["nested"] += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            entry["external"] += [a.name.split(".")[0] for a in node.names]
        elif node.module and node.level == 0 and node.module.split(".")[0] != "llm_rlhf":
            entry["external"].append(node.module.split(".")[0])


def layers(graph: dict[str, dict[str, list]]) -> dict[str, int]:
    """LAYERS, plus 1 + the highest layer of its imports for a module LAYERS does not name."""
    out = dict(LAYERS)

    def layer(m, path=()):
        if m not in out:
            assert m not in path, f"import cycle through {m}"
            out[m] = 1 + max((layer(d, (*path, m)) for d in graph[m]["top"]), default=-1)
        return out[m]

    for m in graph:
        layer(m)
    return out


def test_first_party_imports_are_at_module_top():
    nested = {m: e["nested"] for m, e in import_graph().items() if e["nested"]}
    assert nested == {}


def test_imports_run_one_way():
    """Each first-party import goes to a lower layer; hence no cycle (checked on its own below too)."""
    graph = import_graph()
    layer = layers(graph)
    upward = [(m, d) for m, e in graph.items() for d in e["top"] if layer[d] >= layer[m]]
    assert upward == []


def test_no_cycle():
    assert_no_cycle({m: set(e["top"]) for m, e in import_graph().items()})


def test_report_package_imports_run_one_way():
    """The report's own modules (runs, figures, page, a module per section, the two pages) import one another
    at module top, one way: no cycle."""
    graph = {}
    for path in sorted((PACKAGE / "report").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[path.stem] = {
            node.module.split(".")[2]
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llm_rlhf.report.")
        }
    assert graph["numbers"] == set() and "__init__" not in set().union(*graph.values())
    assert_no_cycle(graph)


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
    done, on_path = set(), []

    def visit(m):
        assert m not in on_path, f"import cycle: {' -> '.join([*on_path[on_path.index(m) :], m])}"
        if m in done:
            return
        on_path.append(m)
        for d in graph[m]:
            visit(d)
        on_path.pop()
        done.add(m)

    for m in graph:
        visit(m)


def test_layering():
    graph = import_graph()
    ppo_math = graph["ppo_math"]
    assert ppo_math["top"] == [] and ppo_math["nested"] == []
    assert set(ppo_math["external"]) <= {"torch", "__future__"} | set(sys.stdlib_module_names)
    hacking = graph["hacking"]  # pure functions over texts and scores: evaluation and the report share them
    assert hacking["top"] == [] and set(hacking["external"]) <= set(sys.stdlib_module_names)
    assert not set(graph["models"]["top"]) & (STAGES | {"rollout", "reward_model", "pipeline", "cli"})
    for library in ("rollout", "reward_model", "reward_fn", "accelerated", "scoring", "callables"):
        assert not set(graph[library]["top"]) & (STAGES | {"pipeline", "cli"}), library
    assert "ppo_run" not in graph["compare"]["top"]  # compare reads a PPO run's files, not its command
    for stage in STAGES:
        assert not set(graph[stage]["top"]) & {"pipeline", "cli"}, stage


def format_graph() -> str:
    graph = import_graph()
    layer = layers(graph)
    lines = []
    for m in sorted(graph, key=lambda m: (layer[m], m)):
        deps = sorted(set(graph[m]["top"]), key=lambda d: (layer[d], d))
        lines.append(f"[{layer[m]}] {m:<14} -> {', '.join(deps) if deps else '(none)'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_graph())
