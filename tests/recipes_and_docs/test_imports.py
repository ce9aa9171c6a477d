"""The package's folders are its layers, read from the `import` statements (ast). Imports run one way:

    core -> rl -> models, tasks -> evaluation, training -> ppo -> stages -> interfaces -> llm_rlhf/__init__, __main__

- core        errors, the config system, callables named in configs, data files
- rl          the math and sampling: ppo_math, loss_math, reward_math and token_math (torch only), the estimator and policy-loss
              tables, the sampler, episodes
- models      loading, reward models, reward functions, the scorer, the judges, device plumbing
- tasks       checkable tasks and their verifiers
- evaluation  sampling a policy and measuring what it wrote, the metric names, the reward-hacking alarm (stdlib)
- training    what the stages built on a Hugging Face `Trainer` (SFT, RM, DPO) share
- ppo         PPO's library: the trainer, its config, rollouts, the update, metrics, building, checkpoints,
              held-out evaluations
- stages      the commands, one module each (sft, rm, dpo, ppo, eval, compare, score, judge)
- interfaces  the command line, the Python API, the pipeline and the report

A module imports modules of its own folder or of a folder below, never above, and the graph has no cycle;
first-party imports are at module top only. `python tests/recipes_and_docs/test_imports.py` prints the graph.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llm_rlhf"  # not helpers.ROOT: the file also runs alone
FLOORS = {
    "core": 0,
    "rl": 1,
    "models": 2,
    "tasks": 2,
    "evaluation": 3,
    "training": 3,
    "ppo": 4,
    "stages": 5,
    "interfaces": 6,
    "": 7,
}
STAGE_COMMANDS = {"sft", "reward", "dpo", "ppo", "evaluate", "compare", "score", "judge"}


def module_name(path: Path) -> str:
    """llm_rlhf/rl/ppo_math.py -> "rl.ppo_math"; a package's __init__ is the package ("interfaces.report")."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def floor(module: str) -> int:
    head = module.split(".")[0]
    return FLOORS[head if head in FLOORS else ""]  # a folder's __init__ ("rl") is on its folder's floor


def first_party(node: ast.AST, modules: set[str]) -> list[str]:
    """The llm_rlhf modules an import statement names: `from llm_rlhf.rl import ppo_math, rollout` names
    rl.ppo_math and rl.rollout; `from llm_rlhf.rl.ppo_math import masked_mean` names rl.ppo_math."""
    if isinstance(node, ast.Import):
        dotted = [a.name for a in node.names if a.name.startswith("llm_rlhf.")]
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llm_rlhf":
        base = node.module.removeprefix("llm_rlhf").lstrip(".")
        named = [f"{base}.{a.name}".lstrip(".") for a in node.names]
        dotted = [f"llm_rlhf.{n}" for n in named if n in modules] or [f"llm_rlhf.{base}"]
    else:
        return []
    return [d.removeprefix("llm_rlhf.") for d in dotted]


def import_graph() -> dict[str, dict[str, list]]:
    """module -> {"top": first-party modules imported at module level, "nested": (line, module) imported
    inside a function or class, "external": top-level names of the other imports anywhere}."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {}
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = set(map(id, tree.body))
        entry = {"top": [], "nested": [], "external": []}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = first_party(node, modules)
            if names:
                if id(node) in top_level:
                    entry["top"] += names
                else:
                    entry["nested"] += [(node.lineno, n) for n in names]
            elif isinstance(node, ast.Import):
                entry["external"] += [a.name.split(".")[0] for a in node.names]
            elif node.module and node.level == 0:
                entry["external"].append(node.module.split(".")[0])
            elif node.level > 0:
                entry["nested"].append((node.lineno, f"relative import {node.module}"))
        graph[module_name(path)] = entry
    return graph


def test_every_module_lives_in_a_layer_folder():
    loose = [
        m for m in import_graph() if "." not in m and m not in FLOORS and m not in ("__init__", "__main__")
    ]
    assert loose == [], f"modules outside the layer folders: {loose}"
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FLOORS) - {""}


def test_first_party_imports_are_at_module_top():
    nested = {m: e["nested"] for m, e in import_graph().items() if e["nested"]}
    assert nested == {}


def test_imports_point_down():
    """Each first-party import goes to the module's own folder or a folder below it."""
    graph = import_graph()
    upward = [(m, d) for m, e in graph.items() for d in e["top"] if floor(d) > floor(m)]
    assert upward == []


def test_no_cycle():
    graph = {m: set(e["top"]) - {m} for m, e in import_graph().items()}
    done, on_path = set(), []

    def visit(m):
        assert m not in on_path, f"import cycle: {' -> '.join([*on_path[on_path.index(m) :], m])}"
        if m in done:
            return
        on_path.append(m)
        for d in graph.get(m, ()):
            visit(d)
        on_path.pop()
        done.add(m)

    for m in graph:
        visit(m)


def test_layering():
    graph = import_graph()
    # the equations, reviewable alone: torch only; the loss family reads ppo_math's masked reductions
    math_modules = {
        "rl.ppo_math": [],
        "rl.reward_math": [],
        "rl.token_math": [],
        "rl.loss_math": ["rl.ppo_math"],
    }
    for math_module, allowed in math_modules.items():
        entry = graph[math_module]
        assert entry["top"] == allowed and entry["nested"] == [], math_module
        assert set(entry["external"]) <= {"torch", "__future__"} | set(sys.stdlib_module_names), math_module
    hacking = graph[
        "evaluation.hacking"
    ]  # pure functions over texts and scores: evaluation and the report share them
    assert hacking["top"] == [] and set(hacking["external"]) <= set(sys.stdlib_module_names)
    assert "stages.ppo" not in graph["stages.compare"]["top"]  # compare reads a PPO run's files
    stages = {m.split(".")[-1] for m in graph if m.startswith("stages.")}
    assert stages == STAGE_COMMANDS, "the stages folder holds the commands only"
    for stage in stages:
        assert not {d for d in graph[f"stages.{stage}"]["top"] if d.startswith("interfaces")}, stage
        commands = {d for d in graph[f"stages.{stage}"]["top"] if d.startswith("stages.")}
        assert commands <= ({"stages.dpo"} if stage == "compare" else set()), stage  # compare runs DPO stages


def test_public_api_unchanged():
    import llm_rlhf
    from llm_rlhf.interfaces import api

    for name in llm_rlhf.API:
        assert getattr(llm_rlhf, name) is not None, name
    assert sorted(llm_rlhf.__all__) == sorted(llm_rlhf.API) == sorted(api.__all__)


def test_dir_lists_the_api_without_importing_it():
    """`dir(llm_rlhf)` (a notebook's tab completion) lists the lazy API, and neither it nor `import llm_rlhf`
    imports the stages' libraries (a lazy module's own `dir` would list only `API` and `importlib`)."""
    code = (
        "import sys, llm_rlhf; names = dir(llm_rlhf); "
        "print(repr((names, sorted({'torch', 'transformers', 'trl', 'llm_rlhf.interfaces.api'} & set(sys.modules)))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    names, heavy = ast.literal_eval(out.stdout)
    import llm_rlhf

    public = [n for n in names if not n.startswith("_")]
    assert public == sorted([*llm_rlhf.API, "API"]) and "__version__" in names
    assert heavy == []


def format_graph() -> str:
    graph = import_graph()
    lines = []
    for m in sorted(graph, key=lambda m: (floor(m), m)):
        deps = sorted(set(graph[m]["top"]), key=lambda d: (floor(d), d))
        lines.append(f"[{floor(m)}] {m:<28} -> {', '.join(deps) if deps else '(none)'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_graph())
