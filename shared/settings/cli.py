"""Settings classes as CLI flags, environment variables and job configuration files.

Each service has one ``pydantic-settings`` class (see ``services/*/settings.py``). A value comes
from, in order of precedence: a CLI flag (``--inner-lr 3e-3``), an environment variable
(``DILOCO_INNER_LR=3e-3``), a job configuration file (``--config job.toml``), then the default.

pydantic-settings does the work: its ``CliSettingsSource`` adds one kebab-case flag per field to
each ``diloco`` subcommand's argparse parser (booleans as ``--x/--no-x``; ``--help`` shows the
description, the default and the environment variable) and reads the parsed flags back; its
``EnvSettingsSource`` reads ``DILOCO_*``; ``JobConfigSource``, a subclass of its
``TomlConfigSettingsSource``, reads the config file. Written here, because the library does not
do it (``_read_file`` and ``_build_sources`` are its private API: pyproject.toml caps the version,
tests/test_dependencies.py checks they are there):

* a secret field (:data:`shared.settings.SECRET`) gets no flag: ``CliSuppress`` only hides a flag
  from ``--help`` and still accepts it, so the flags are added through an ``add_argument_method``
  that leaves secret fields out;
* the job configuration file is flat and one file serves every service of a job, but the
  library's TOML source hands a ``[section]`` to the model as one nested value, matches keys to
  field names only with ``_``, passes every key on (``extra="forbid"`` then rejects the other
  services' keys; ``"ignore"`` would let a typo pass) and skips a missing file silently: so
  ``JobConfigSource`` (its subclass) flattens the file, keeps its own service's keys and rejects
  keys no service knows and a file it cannot read;
* the sources are put in order per call (``_build_sources``, as ``CliApp.run`` does), since the
  file is named at run time and ``settings_customise_sources`` takes no per-call arguments;
* a ``ValidationError`` becomes a :class:`~shared.settings.SettingsError` that names the flag, the
  environment variable and the value;
* ``to_flags``/``flags_for`` render settings for ``diloco up``'s children: ``CliApp.serialize``
  leaves out values equal to a field's default (a child inherits its parent's environment, so
  a ``DILOCO_*`` variable would then win over what the parent resolved), renders one whole model
  (not the fields another service shares with it) and would put secrets on the command line.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

from shared.settings import ENV_PREFIX, SettingsError, is_secret

SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _cli_source(
    cls: type[BaseSettings], parser: argparse.ArgumentParser | None = None
) -> CliSettingsSource[argparse.ArgumentParser]:
    """The library's CLI source for ``cls``, its flags added to ``parser`` (or to a parser of its
    own), secret fields left out."""
    secret = {name for name, field in cls.model_fields.items() if is_secret(field)}

    def add_argument(target: argparse.ArgumentParser, *names: str, **kwargs: Any) -> None:
        if kwargs.get("dest") not in secret:
            target.add_argument(*names, **kwargs)

    return CliSettingsSource(
        cls,
        root_parser=parser,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_show_env_vars=True,
        cli_hide_none_type=True,
        add_argument_method=add_argument,
    )


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one ``--flag`` per field of ``cls`` to ``parser``, with the field's description,
    default and environment variable (secret fields get none: they come from the environment).

    Flags default to "not given", so that the environment and the config file keep working for
    fields the user did not pass on the command line.
    """
    _cli_source(cls, parser)


class JobConfigSource(TomlConfigSettingsSource):
    """A job configuration file: flat TOML, keys are option names (``-`` or ``_``), ``[sections]``
    only group them for the reader. One file serves every service of a job, so a key of another
    service is skipped, and a key no service knows is an error (a typo must not pass silently).
    """

    def __init__(
        self, settings_cls: type[BaseSettings], path: str, known_keys: Iterable[str] | None = None
    ) -> None:
        """Read ``path`` for ``settings_cls``.

        Args:
            settings_cls: the service's settings class; its own keys are kept.
            path: the TOML file.
            known_keys: every key any service accepts (default: the fields of ``settings_cls``).

        Raises:
            SettingsError: the file is missing or not TOML, or has a key outside ``known_keys``.
        """
        self._own_keys = set(settings_cls.model_fields)
        self._known_keys = set(known_keys) if known_keys is not None else self._own_keys
        if not Path(path).is_file():  # the library would silently skip a missing file
            raise SettingsError(f"cannot read config file {path}: no such file")
        try:
            super().__init__(settings_cls, toml_file=path)
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise SettingsError(f"cannot read config file {path}: {err}") from None

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for key, value in super()._read_file(file_path).items():
            pairs = value.items() if isinstance(value, dict) else [(key, value)]
            flat.update((name.replace("-", "_"), item) for name, item in pairs)
        unknown = sorted(set(flat) - self._known_keys)
        if unknown:
            raise SettingsError(f"unknown keys in the config file: {', '.join(unknown)}")
        return {name: value for name, value in flat.items() if name in self._own_keys}


def settings_from_args(
    cls: type[SettingsT],
    args: Sequence[str] | argparse.Namespace | Mapping[str, Any] = (),
    config_file: str | None = None,
    known_keys: Iterable[str] | None = None,
) -> SettingsT:
    """Build a settings object: flags > environment > config file > defaults.

    Args:
        cls: the settings class.
        args: a command line (parsed here), or the flags a parser given
            :func:`add_settings_arguments` parsed (only flags the user gave are present).
        config_file: a job configuration file (:class:`JobConfigSource`), if any.
        known_keys: every key any service accepts; config keys outside it are an error.
            Defaults to the fields of ``cls``.

    Raises:
        SettingsError: naming every invalid flag, its value and what is expected, or a config
            file that cannot be read or has unknown keys.
    """
    cli = _cli_source(cls)
    if isinstance(args, (argparse.Namespace, Mapping)):
        cli(parsed_args=args)
    else:
        cli(args=list(args))
    sources: list[PydanticBaseSettingsSource] = [cli, EnvSettingsSource(cls)]
    if config_file:
        sources.append(JobConfigSource(cls, config_file, known_keys))
    try:
        return cls(_build_sources=(tuple(sources), {}))
    except ValidationError as err:
        raise _settings_error(err) from None


def _settings_error(err: ValidationError) -> SettingsError:
    """The problems of ``err``, each named by its flag and environment variable."""
    problems = []
    for item in err.errors():
        if not item["loc"]:  # a check across fields: its message names them
            problems.append(str(item["msg"]).removeprefix("Value error, "))
            continue
        name = str(item["loc"][0])
        where = f"{_flag(name)} (env {ENV_PREFIX}{name.upper()})"
        problems.append(f"{where} = {item.get('input')!r}: {item['msg']}")
    return SettingsError("invalid settings:\n  " + "\n  ".join(problems))


def to_flags(settings: BaseModel, fields: Iterable[str]) -> list[str]:
    """Render the given fields of ``settings`` as CLI flags (how ``diloco up`` configures its
    child processes). None values are left out; booleans become ``--x``/``--no-x``. Defaults
    are rendered too, so that a ``DILOCO_*`` variable the child inherits cannot override them."""
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
