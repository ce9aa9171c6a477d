"""Config layer: defaults < YAML < flags, unknown keys, types, cross-field checks, --help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import ROOT

from llm_rlhf.core.config import format_help, parse_config, save_config
from llm_rlhf.core.errors import ConfigError
from llm_rlhf.interfaces import cli
from llm_rlhf.stages.sft import Config

RECIPE = ROOT / "recipes" / "reviews" / "sft.yaml"


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_then_yaml_then_flags(tmp_path):
    recipe = write_yaml(tmp_path, "learning_rate: 0.001\nmax_steps: 5\nuse_lora: true\n")
    cfg = parse_config(Config, ["--config", str(recipe), "--max_steps", "7"])
    assert cfg.learning_rate == 0.001  # YAML over the default
    assert cfg.max_steps == 7  # flag over YAML
    assert cfg.use_lora is True
    assert cfg.seed == Config().seed  # untouched default
    # the order of --config among the flags does not matter: flags always win
    assert parse_config(Config, ["--max_steps=9", "--config", str(recipe)]).max_steps == 9


def test_unknown_key_in_yaml_names_the_closest_valid_key(tmp_path):
    recipe = write_yaml(tmp_path, "learning_rat: 0.1\n")
    with pytest.raises(ConfigError) as e:
        parse_config(Config, ["--config", str(recipe)])
    assert str(e.value) == f"{recipe}: unknown key 'learning_rat'; did you mean 'learning_rate'?"


def test_unknown_key_on_the_command_line_names_the_closest_valid_key():
    with pytest.raises(ConfigError) as e:
        parse_config(Config, ["--num_train_epoch", "2"])
    assert str(e.value) == "command line: unknown key 'num_train_epoch'; did you mean 'num_train_epochs'?"


def test_bool_flags():
    assert parse_config(Config, ["--use_lora"]).use_lora is True  # bare flag
    assert parse_config(Config, ["--use_lora", "--max_steps", "3"]).use_lora is True
    assert parse_config(Config, ["--resume", "true"]).resume is True
    assert parse_config(Config, ["--merge_lora", "false"]).merge_lora is False
    assert parse_config(Config, ["--merge_lora=false"]).merge_lora is False


def test_list_flag_is_comma_separated():
    cfg = parse_config(Config, ["--lora_target_modules", "c_attn,c_proj"])
    assert cfg.lora_target_modules == ["c_attn", "c_proj"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max_steps", "abc"], "command line: 'max_steps' = 'abc' is not a valid int"),
        (["--learning_rate", "fast"], "command line: 'learning_rate' = 'fast' is not a valid float"),
        (["--use_lora", "maybe"], "unexpected argument 'maybe' (options look like --key value)"),
    ],
)
def test_type_errors_name_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_config(Config, argv)
    assert str(e.value) == message


def test_type_error_in_yaml_names_the_key(tmp_path):
    recipe = write_yaml(tmp_path, "max_length: [1, 2]\n")
    with pytest.raises(ConfigError) as e:
        parse_config(Config, ["--config", str(recipe)])
    assert str(e.value) == f"{recipe}: 'max_length' = [1, 2] is not a valid int"


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--top_p", "0"], "top_p"),
        (["--warmup_ratio", "1.0"], "warmup_ratio"),
        (["--lr_scheduler_type", "cosinus"], "lr_scheduler_type"),
        (["--report_to", "mlflow"], "report_to"),
        (["--max_steps", "-1", "--num_train_epochs", "0"], "num_train_epochs"),
    ],
)
def test_cross_field_checks_name_the_key(argv, key):
    with pytest.raises(ConfigError, match=f"^config key '{key}': "):
        parse_config(Config, argv)


def test_saved_config_reloads_to_the_same_config(tmp_path):
    cfg = parse_config(Config, ["--learning_rate", "0.003", "--lora_target_modules", "c_attn"])
    path = save_config(cfg, tmp_path)
    assert parse_config(Config, ["--config", str(path)]) == cfg


def test_recipe_parses_and_sets_every_key():
    cfg = parse_config(Config, ["--config", str(RECIPE)])
    import yaml

    keys = set(yaml.safe_load(RECIPE.read_text()))
    assert keys == {f.name for f in dataclasses.fields(Config)}, "the recipe spells out every setting"
    assert cfg.model_name_or_path == "data/reviews/base_model"


def test_help_lists_every_key(capsys):
    assert cli.main(["sft", "--help"]) == 0
    out = capsys.readouterr().out
    for field in dataclasses.fields(Config):
        assert f"--{field.name} (" in out
    assert "--learning_rate (float, default 0.0005)" in format_help(Config)


def test_cli_unknown_key_exits_2_with_one_line(capsys, tmp_path):
    assert cli.main(["sft", "--lerning_rate", "0.1", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == "error: command line: unknown key 'lerning_rate'; did you mean 'learning_rate'?\n"
    assert not (tmp_path / "out").exists()


def test_bf16_auto_follows_the_hardware_and_is_logged(monkeypatch):
    """`bf16: auto` is bf16 where the CPU has AMX or AVX512-BF16 and float32 where bf16 would be emulated; the
    phrase the stages print says which and why. true/false are taken as they are; anything else names the key."""
    import torch

    from llm_rlhf.core.errors import ConfigError
    from llm_rlhf.core.utils import resolve_bf16
    from llm_rlhf.ppo.config import Config as PPOConfig
    from llm_rlhf.stages import sft

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for amx, avx512_bf16, expected in ((False, False, False), (False, True, True), (True, False, True)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        on, why = resolve_bf16("auto")
        assert on is expected and why.startswith(f"bf16 autocast {'on' if expected else 'off'} (bf16: auto;")
        assert ("emulated" in why) is (not expected)
        cfg = parse_config(sft.Config, ["--bf16", "auto"])
        assert cfg.bf16 is expected and cfg.precision == why
        assert PPOConfig(bf16="auto").bf16 is expected
    assert parse_config(sft.Config, ["--bf16"]).bf16 is True  # a bare flag is still true
    assert parse_config(sft.Config, ["--bf16", "false", "--max_steps", "3"]).bf16 is False
    assert resolve_bf16(True) == (
        True,
        "bf16 autocast on (bf16: true; the CPU has AMX)",
    )  # the last CPU above
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU: auto stays float32
    assert resolve_bf16("auto") == (
        False,
        "bf16 autocast off (bf16: auto; on a GPU auto stays float32 (set bf16: true for a large model))",
    )
    with pytest.raises(ConfigError, match="'bf16': 'fast' must be true, false or auto"):
        parse_config(sft.Config, ["--bf16", "fast"])
