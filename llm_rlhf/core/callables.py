"""The one resolver of a user's callable named in a config: `reward_fn` (`llm_rlhf.models.reward_fn`) and a
`gold_judge` that is not a judge JSON (`llm_rlhf.models.gold`) follow the same rules.

    module:callable            imported from the current directory or the python path (`my_rewards:length`,
                               `mypackage.judges:Judge`; an attribute path `module:Class.method` works too)
    path/to/file.py:callable   the file is loaded as a module (relative to the current directory)

A class is built once with no arguments and its instance is the callable. Every failure is one UserError
line that names the config key and its value.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llm_rlhf.core.errors import ConfigError, UserError

CALLABLE_FORMS = (
    "'module:callable' or 'path/to/file.py:callable' (a callable (prompts, responses) -> list[float])"
)


def split_callable_spec(spec: str, key: str, forms: str = CALLABLE_FORMS) -> tuple[str, str]:
    """'module:attr' or 'path/file.py:attr' -> (module or path, attr); otherwise a ConfigError naming `key`
    and the `forms` it accepts. The last ':' splits, so a Windows drive letter stays in the path."""
    where, colon, attr = spec.strip().rpartition(":")
    if not colon or not where or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise ConfigError(f"{key} '{spec}': expected {forms}")
    return where, attr


@contextmanager
def current_directory_on_path():
    """The current directory first on sys.path while importing (`python -m` puts it there, the `llm-rlhf`
    entry point does not), so `my_rewards:fn` finds ./my_rewards.py either way."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def import_file(path: Path, what: str):
    """Load `path` (a .py file) as a module, once: registered under a private name, so a file called
    e.g. `random.py` does not replace the standard module. `what` starts every error line."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"_llm_rlhf_callable_{digest}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise UserError(f"{what}: no such file '{path}'")
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserError(f"{what}: loading '{path}' raised {type(e).__name__}: {e}") from e
    return module


def resolve_callable(spec: str, key: str, forms: str = CALLABLE_FORMS, *, build: bool = True) -> Any:
    """The callable `spec` names (see the module docstring), for the config key `key`; a class is built with
    no arguments unless build is False (an environment: one instance per episode). Every failure is one
    UserError line starting "<key> '<spec>'"."""
    where, attr = split_callable_spec(spec, key, forms)
    what = f"{key} '{spec}'"
    if where.endswith(".py") or "/" in where or os.sep in where:
        if not where.endswith(".py"):
            raise UserError(f"{what}: '{where}' is a path but not a .py file ({forms})")
        obj: Any = import_file(Path(where), what)
    else:
        try:
            with current_directory_on_path():
                obj = importlib.import_module(where)
        except ImportError as e:
            raise UserError(f"{what}: cannot import module '{where}' ({e})") from None
        except Exception as e:  # the module itself failed while importing
            raise UserError(f"{what}: importing '{where}' raised {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{what}: '{where}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if isinstance(obj, type) and build:
        try:
            obj = obj()
        except Exception as e:
            raise UserError(
                f"{what}: building the class with no arguments raised {type(e).__name__}: {e}"
            ) from e
    if not callable(obj):
        raise UserError(f"{what}: {type(obj).__name__} is not callable")
    return obj
