"""Flat per-stage configs: defaults < YAML recipe (`--config`) < command-line flags.

Each stage owns one dataclass whose fields carry their help text in `metadata["help"]`. Unknown keys
raise a `ConfigError` naming the key and the closest valid one; cross-field rules raise in the stage's
`__post_init__`. The resolved config is printed at start and saved next to the outputs as `config.yaml`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from llm_rlhf.core.errors import ConfigError
from llm_rlhf.core.utils import atomic_write_text

C = TypeVar("C")


def help_field(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its help text written once, where it is declared."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs
        )
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _base_types(annotation: Any) -> tuple[type, ...]:
    """`float | None` -> (float, NoneType); `list[str]` -> (list,)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(annotation) for t in _base_types(arg))
    if origin is not None:
        return (origin,)
    return (annotation,)


def _coerce(key: str, value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML- or flag-parsed value to the field's type, or raise naming the key."""
    allowed = _base_types(annotation)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{where}: '{key}' may not be empty (expected {_type_names(allowed)})")
    for kind in allowed:
        if kind is type(None):
            continue
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            continue
        if kind is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except ValueError:
                continue
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is int and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                continue
        if kind is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if kind is list and isinstance(value, list):
            return value
        if kind is list and isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if kind is dict and isinstance(value, dict):
            return value
    raise ConfigError(f"{where}: '{key}' = {value!r} is not a valid {_type_names(allowed)}")


def _type_names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def parse_config(cls: type[C], argv: list[str]) -> C:
    """Build `cls` from defaults, then `--config FILE` (YAML), then `--key value` / `--key=value` flags.

    A bare `--flag` sets a boolean field to true. Values are parsed as YAML scalars, then checked
    against the field's type.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    valid = sorted(fields)

    config_path, flags = None, {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}' (options look like --key value)")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            kinds = _base_types(hints[key]) if key in fields else ()
            is_bool = bool in kinds
            # a bool-only key takes a following true/false; a bool-or-string key (bf16: auto) any value
            bare = is_bool and str not in kinds and nxt is not None and nxt.lower() not in ("true", "false")
            if nxt is None or nxt.startswith("--") or bare:
                if not is_bool and key != "config":
                    raise ConfigError(f"command line: '--{key}' needs a value")
                value = "true"
            else:
                value = nxt
                i += 1
        i += 1
        if key == "config":
            config_path = value
            continue
        if key not in fields:
            raise ConfigError(f"command line: unknown key '{key}'{_closest(key, valid)}")
        flags[key] = value

    values: dict[str, Any] = {}
    if config_path is not None:
        values.update(load_yaml_config(config_path, valid))
    for key, raw in flags.items():
        values[key] = yaml.safe_load(raw) if raw != "" else ""
    where = {k: (config_path if k not in flags else "command line") for k in values}
    values = {k: _coerce(k, v, hints[k], where[k]) for k, v in values.items()}
    for key, value in values.items():
        check_not_placeholder(key, value, where[key])
    try:
        return cls(**values)
    except TypeError as e:  # a required field is missing
        raise ConfigError(str(e)) from None


# What a config saved by the Python API holds where an object stood in for a path (a key `*_path`, `*_file`):
# `<policy>`, `<train_data>`, `<reward_model 1>` (`placeholder`). No path is written so.
PLACEHOLDER = re.compile(r"<[a-z_]+(?: \d+)?>")


def placeholder(name: str) -> str:
    """The config value that names an object given to the Python API in place of a path: `<name>`."""
    return f"<{name}>"


def check_not_placeholder(key: str, value: Any, where: str) -> None:
    """A path key's value (or list member) that is a `placeholder` is a ConfigError naming the key: the
    config.yaml of a Python API run cannot hold the object, so a path must replace it before the config runs
    again. Other keys may hold such text (a stop string `<end_of_turn>`)."""
    if not key.endswith(("_path", "_file")):  # model_name_or_path, policy_path, train_file, prompt_file, ...
        return
    for member in value if isinstance(value, list) else [value]:
        if isinstance(member, str) and PLACEHOLDER.fullmatch(member):
            raise ConfigError(
                f"{where}: '{key}' is '{member}', which held a live object in the Python API (a "
                "config.yaml cannot store it); replace it with a path"
            )


def checked_keywords(cls: type[C]) -> type[C]:
    """Class decorator (above `@dataclasses.dataclass`): a config built in Python (`PPOConfig(steps=10)`, the
    Python API) has its keys checked as a YAML recipe's are: an unknown key is a ConfigError naming the closest
    valid one, and a value of another type is converted (`"1e-3"` -> 1e-3) or a ConfigError naming the key.
    Values already of the field's type (a path object for a string) pass as they are."""
    init = cls.__init__
    valid = sorted(f.name for f in dataclasses.fields(cls))

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        hints = typing.get_type_hints(cls)
        for key, value in kwargs.items():
            if key not in hints or key not in valid:
                raise ConfigError(f"config: unknown key '{key}'{_closest(key, valid)}")
            kwargs[key] = _as_field_type(key, value, hints[key])
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def _as_field_type(key: str, value: Any, annotation: Any) -> Any:
    allowed = _base_types(annotation)
    if isinstance(value, os.PathLike) and str in allowed:
        return os.fspath(value)
    if isinstance(value, tuple) and list in allowed:
        return list(value)
    kinds = tuple(k for k in allowed if k is not type(None))
    exact = isinstance(value, kinds) and not (
        isinstance(value, bool) and bool not in allowed
    )  # True is an int
    return value if exact else _coerce(key, value, annotation, "config")


def config_from(cls: type[C], config: Any) -> C:
    """The Python API's `config` argument as a `cls`: an instance as it is, a mapping of keys (checked as
    `checked_keywords` checks them), or the path of a YAML recipe (read as `--config` reads it)."""
    if isinstance(config, cls):
        return config
    if isinstance(config, dict):
        return cls(**config)
    if isinstance(config, (str, os.PathLike)):
        return parse_config(cls, ["--config", os.fspath(config)])
    raise ConfigError(
        f"config: expected a {cls.__name__}, a dict of keys or a YAML file, got {type(config).__name__}"
    )


def load_yaml_config(path: str | Path, valid: list[str]) -> dict[str, Any]:
    """Read a flat YAML mapping; reject unknown keys naming the closest valid one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file '{path}'")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value")
    for key in data:
        if key not in valid:
            raise ConfigError(f"{path}: unknown key '{key}'{_closest(str(key), valid)}")
    return data


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def format_config(cfg: Any) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)


def save_config(cfg: Any, output_dir: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config next to the outputs (atomically)."""
    path = Path(output_dir) / name
    atomic_write_text(path, format_config(cfg))
    return path


@dataclasses.dataclass(frozen=True)
class KeyHelp:
    """One config key as `--help` and the reference pages (docs/generate.py) show it: its name, its type
    ("float or null"), its default ("required" when it has none) and its help text."""

    name: str
    type: str
    default: Any
    help: str


def config_keys(cls: type) -> list[KeyHelp]:
    """The keys of a stage's config, in declaration order, each with its type, default and help text."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
        )
        keys.append(
            KeyHelp(f.name, _type_names(_base_types(hints[f.name])), default, f.metadata.get("help", ""))
        )
    return keys


def format_help(cls: type) -> str:
    """One line per field: `--name (type, default): help`."""
    lines = []
    for key in config_keys(cls):
        lines.append(f"  --{key.name} ({key.type}, default {key.default!r})")
        lines.append(f"      {key.help}")
    return "\n".join(lines)


# report_to, every stage's: where metrics also go besides the console and the stage's JSONL logs; with trackio
# every stage's runs go into one local project, TRACKIO_PROJECT, each run named by its output_dir
REPORT_TO = ("none", "tensorboard", "wandb", "trackio")
TRACKIO_PROJECT = "llm_rlhf"
REPORT_TO_MODULES = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "trackio": ("trackio",),
}


def check_report_to_installed(report_to: str) -> None:
    """A report_to whose package is not installed is a ConfigError naming the extra, before anything is loaded."""
    import importlib.util

    needs = REPORT_TO_MODULES.get(report_to, ())
    if needs and not any(importlib.util.find_spec(m) for m in needs):
        raise ConfigError(
            f"config key 'report_to': '{report_to}' is not installed (pip install 'llm-rlhf[{report_to}]')"
        )


def is_off(value: str | list[str] | None) -> bool:
    """True for a path or a callable's name that means "none": null, '', 'none', 'null' (any case). A list (a reward-model
    ensemble's folders) is never off."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))


def require(condition: bool, key: str, message: str) -> None:
    """Cross-field check for `__post_init__`: raise a ConfigError naming the key."""
    if not condition:
        raise ConfigError(f"config key '{key}': {message}")
