"""Settings: flags and environment variables map onto one typed object, bad values are named."""

from __future__ import annotations

import argparse

import pytest

from services.cli import build_parser
from services.learner.settings import LearnerSettings
from shared.settings import SettingsError, add_settings_arguments, settings_from_args


def parse(cls, argv):
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, cls)
    return settings_from_args(cls, parser.parse_args(argv))


def test_flags_override_environment_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("DILOCO_H_STEPS", "7")
    monkeypatch.setenv("DILOCO_INNER_LR", "0.01")
    settings = parse(LearnerSettings, ["--inner-lr", "0.002", "--unit", "1", "--num-units", "2"])
    assert settings.h_steps == 7  # from the environment
    assert settings.inner_lr == 0.002  # the flag wins
    assert settings.batch_size == 16  # default


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--unit", "4", "--num-units", "4"], "unit 4 must be < num-units 4"),
        (["--job", "bad job!"], "--job"),
        (["--model", "huge"], "unknown model size 'huge'"),
        (["--inner-lr", "-1"], "--inner-lr"),
        (["--nats-url", "http://x"], "expected nats://host:port"),
        (["--codec", "int3"], "codec must be int8 or fp32"),
        (["--h-steps", "zero"], "--h-steps"),
    ],
)
def test_invalid_values_name_the_flag(argv, fragment):
    with pytest.raises(SettingsError, match=None) as err:
        parse(LearnerSettings, argv)
    assert fragment in str(err.value)


def test_cli_reports_invalid_settings_with_exit_code_2(capsys):
    from services.cli import main

    assert main(["learner", "--unit", "-1"]) == 2
    assert "--unit" in capsys.readouterr().err


def test_up_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--learners",
        "--model",
        "--max-steps",
        "--h-steps",
        "--data-dir",
        "--gateway-port",
        "--max-duration-s",
        "--codec",
    ):
        assert flag in text
    assert "DILOCO_LEARNERS" in text
