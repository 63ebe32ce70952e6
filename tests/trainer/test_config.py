"""The configuration tree: presets, YAML files, --set and flags; errors name the file and the key."""

from __future__ import annotations

import argparse

import pytest

from trainguard.trainer import cli
from trainguard.trainer.config import ConfigError, TrainConfig, load_file, set_value


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--run-dir", "x", *argv])


def test_preset_then_file_then_set_then_flags(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("model: {n_layer: 3}\noptim: {lr: 1.0e-3, batch_size: 4}\nrun: {inject: [nan@3]}\n")
    config = cli.build_config(parse("--config", str(path), "--set", "model.n_embd=96", "--set",
                                    "model.n_head=3", "--lr", "2e-3", "--telemetry", "off",
                                    "--inject", "spike@9", "--device", "cpu"))
    assert (config.model.n_layer, config.model.n_embd, config.model.n_head) == (3, 96, 3)
    assert config.optim.lr == 2e-3 and config.optim.batch_size == 4
    assert config.run.telemetry is False and config.run.inject == ["nan@3", "spike@9"]
    tiny = cli.build_config(parse("--device", "cpu"))
    assert (tiny.model.n_layer, tiny.model.n_embd, tiny.run.steps) == (2, 64, 40)
    assert load_file(TrainConfig(), "small").model.n_layer == 6


@pytest.mark.parametrize("text, message", [
    ("model: {n_lyer: 3}\n", "model.n_lyer: unknown key"),
    ("optim: {lr: fast}\n", "optim.lr: expected float, got 'fast'"),
    ("run: {telemetry: maybe}\n", "run.telemetry: expected bool"),
    ("model: [1, 2]\n", "model: expected a mapping"),
    ("model: {n_layer: 2\n", "not valid YAML"),
])
def test_file_errors_name_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_file(TrainConfig(), str(path))
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)


def test_flag_and_consistency_errors():
    with pytest.raises(ConfigError, match=r"^--set: model.depth: unknown key"):
        set_value(TrainConfig(), "model.depth=3")
    with pytest.raises(ConfigError, match="model.n_embd: must be divisible by model.n_head"):
        cli.build_config(parse("--set", "model.n_head=3", "--device", "cpu"))
    with pytest.raises(ConfigError, match=r"--inject 'nan-5'.*KIND@STEP"):
        cli.build_config(parse("--inject", "nan-5", "--device", "cpu"))
    with pytest.raises(ConfigError, match="no such config file or preset"):
        cli.build_config(parse("--config", "huge", "--device", "cpu"))


def test_bad_input_is_a_clear_exit_not_a_traceback(tmp_path, capsys):
    from trainguard.cli import main

    policy = tmp_path / "policy.yaml"
    policy.write_text("guard: {spike_sigma: loud}\n")
    assert main(["train", "--run-dir", str(tmp_path / "r"), "--policy", str(policy)]) == 2
    assert f"{policy}: guard.spike_sigma: expected float" in capsys.readouterr().err


def test_gpu_count_override_reaches_the_records(tmp_path):
    from tests.trainer.helpers import step_records, train

    assert train(tmp_path / "run", "--steps", "2", "--set", "run.gpu_count=8") == 0
    assert [r["system"]["gpu_count"] for r in step_records(tmp_path / "run")] == [8, 8]
