"""Settings classes as CLI flags, environment variables and job configuration files.

Each service has one ``pydantic-settings`` class (see ``services/*/settings.py``). A value comes
from, in order of precedence: a CLI flag (``--inner-lr 3e-3``), an environment variable
(``DILOCO_INNER_LR=3e-3``), then the default. Flags are generated from the fields, so the flag
list, the environment variables and ``--help`` can never drift apart.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Iterable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from shared.settings import ENV_PREFIX, SettingsError, is_secret

SettingsT = TypeVar("SettingsT", bound=BaseModel)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseModel]) -> None:
    """Add one ``--flag`` per settings field, with the field's description and env variable
    (secret fields get none: they come from the environment).

    Flags default to "not given" so that environment variables keep working for fields the
    user did not pass on the command line.
    """
    for name, field in cls.model_fields.items():
        if is_secret(field):
            continue
        env = ENV_PREFIX + name.upper()
        default = field.default if field.default is not None else "unset"
        help_text = f"{field.description or name} [env {env}; default {default}]"
        if field.annotation is bool:
            parser.add_argument(
                _flag(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                _flag(name), dest=name, default=argparse.SUPPRESS, metavar="V", help=help_text
            )


def load_config_file(path: str | None) -> dict[str, Any]:
    """Read a job configuration file (TOML, flat ``name = value`` keys, ``-`` or ``_``).

    Raises:
        SettingsError: when the file cannot be read or parsed.
    """
    if not path:
        return {}
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise SettingsError(f"cannot read config file {path}: {err}") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):  # [sections] are only for readability
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    return flat


def settings_from_args(
    cls: type[SettingsT],
    args: argparse.Namespace | dict[str, Any],
    config: dict[str, Any] | None = None,
    known_keys: set[str] | None = None,
) -> SettingsT:
    """Build a settings object: flags > environment > config file > defaults.

    Args:
        cls: the settings class.
        args: parsed flags (only flags the user gave are present).
        config: values from a job configuration file (``load_config_file``).
        known_keys: every key any service accepts; config keys outside it are an error
            (a typo must not be silently ignored). Defaults to the fields of ``cls``.

    Raises:
        SettingsError: naming every invalid flag, its value and what is expected.
    """
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    config = config or {}
    unknown = sorted(set(config) - (known_keys or set(cls.model_fields)))
    if unknown:
        raise SettingsError(f"unknown keys in the config file: {', '.join(unknown)}")
    kwargs = {
        name: value
        for name, value in config.items()
        if name in cls.model_fields and ENV_PREFIX + name.upper() not in os.environ
    }
    kwargs.update({name: given[name] for name in cls.model_fields if name in given})
    try:
        return cls(**kwargs)
    except ValidationError as err:
        problems = []
        for item in err.errors():
            if not item["loc"]:  # a check across fields: its message names them
                problems.append(str(item["msg"]).removeprefix("Value error, "))
                continue
            name = str(item["loc"][0])
            value = item.get("input")
            where = f"{_flag(name)} (env {ENV_PREFIX}{name.upper()})" if item["loc"] else "settings"
            problems.append(f"{where} = {value!r}: {item['msg']}")
        raise SettingsError("invalid settings:\n  " + "\n  ".join(problems)) from None


def to_flags(settings: BaseModel, fields: Iterable[str]) -> list[str]:
    """Render the given fields of ``settings`` as CLI flags (how ``diloco up`` configures its
    child processes). None values are left out; booleans become ``--x``/``--no-x``."""
    flags: list[str] = []
    for name in fields:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        else:
            flags += [_flag(name), str(value)]
    return flags


def flags_for(
    source: BaseModel, service: type[BaseModel], exclude: Iterable[str] = ()
) -> list[str]:
    """The flags that pass on to a service every option of ``service`` that ``source`` holds
    (``diloco up``'s settings or a REST job's spec hold the same models: workload, algorithm,
    codec, ...), as :func:`to_flags` renders them, except ``exclude`` (what the caller sets per
    process)."""
    skip = set(exclude)
    names = [
        name
        for name in service.model_fields
        if name in type(source).model_fields and name not in skip
    ]
    return to_flags(source, names)
