"""Typed settings shared by every service, and the bridge from settings classes to CLI flags.

Each service has one ``pydantic-settings`` class (see ``services/*/settings.py``). A value comes
from, in order of precedence: a CLI flag (``--inner-lr 3e-3``), an environment variable
(``DILOCO_INNER_LR=3e-3``), then the default. Flags are generated from the fields, so the flag
list, the environment variables and ``--help`` can never drift apart.
"""

from __future__ import annotations

import argparse
import os
import re
import ssl
import tomllib
from collections.abc import Iterable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared import nats_auth
from shared.model_config import ModelSize
from shared.records import JOB_NAME_PATTERN
from shared.records.credentials import NatsCredentials

ENV_PREFIX = "DILOCO_"
#: How the units of a job sync (``--mode``).
SyncMode = Literal["decoupled", "sync"]


class SettingsError(ValueError):
    """A setting has an invalid value; the message names the flag and what is expected."""


class NatsSettings(BaseSettings):
    """Connection settings every service has."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL(s), comma-separated for a cluster",
    )
    connect_timeout_s: float = Field(
        5.0, gt=0, description="timeout of one connection attempt to NATS"
    )
    nats_credentials: str | None = Field(
        None,
        description="file with the NATS user and password to connect as (mode 0600, written by "
        "`diloco up`; docs/SECURITY.md); default: no user",
    )
    nats_ca_file: str | None = Field(
        None,
        description="CA certificate (PEM) the NATS server's certificate must chain to: connect "
        "with TLS and verify the server (`diloco up --tls` writes one); default: no TLS",
    )

    nats_tls_hostname: str | None = Field(
        None,
        max_length=253,
        description="the name the NATS server's certificate must be valid for, when it differs "
        "from the URL's host (a learner behind a shaped link connects to the link, not to the "
        "server); default: the URL's host",
    )

    @field_validator("nats_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        for url in value.split(","):
            if not re.match(r"^(nats|tls|ws|wss)://[^\s/]+$", url.strip()):
                raise ValueError(f"expected nats://host:port (comma-separated), got {url!r}")
        return value

    @field_validator("nats_ca_file")
    @classmethod
    def _check_ca_file(cls, value: str | None) -> str | None:
        if value is not None:
            from shared import tls  # X.509 only where TLS is asked for

            try:  # a clear error at start, not at first connect
                tls.client_context(value)
            except (OSError, ssl.SSLError) as err:
                raise ValueError(f"cannot use the CA file {value}: {err}") from None
        return value

    @field_validator("nats_credentials")
    @classmethod
    def _check_credentials(cls, value: str | None) -> str | None:
        if value is not None:
            nats_auth.read_credentials(value)  # a clear error at start, not at first connect
        return value

    def credentials(self) -> NatsCredentials | None:
        """The user to connect as (None: connect without one)."""
        if self.nats_credentials is None:
            return None
        return nats_auth.read_credentials(self.nats_credentials)

    def nats_servers(self) -> list[str]:
        """The URL list nats-py expects."""
        return [url.strip() for url in self.nats_url.split(",")]


class CommonJobSettings(BaseSettings):
    """What every learner and the outer of one job must agree on."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    job: str = Field("demo", description="job name (letters, digits, '_' and '-')")
    model: ModelSize = Field("small", description="model size: tiny, small, medium or large")
    seed: int = Field(0, ge=0, description="seed of the initial parameters and the data order")
    corpus: str | None = Field(
        None,
        description="text file or folder to train on (default: this Python's standard library)",
    )
    corpus_max_bytes: int | None = Field(
        None, gt=0, description="use only the first N bytes of the corpus (default: all)"
    )
    heldout_fraction: float = Field(
        0.02, gt=0, lt=0.5, description="tail share of the corpus held out for eval loss"
    )
    fragments: int = Field(
        1, ge=1, le=64, description="parameter fragments synced on staggered schedules (P)"
    )
    mode: SyncMode = Field(
        "decoupled",
        description="decoupled: units never wait; sync: synchronous DiLoCo, a unit waits at "
        "its sync point until the global params include its upload, and the outer merges a "
        "round once every active unit is in, or --sync-timeout-s after its first upload",
    )
    sync_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="with --mode sync: seconds the outer waits for a round's missing units "
        "before it merges without them",
    )

    @field_validator("job")
    @classmethod
    def _check_job(cls, value: str) -> str:
        if not JOB_NAME_PATTERN.match(value):
            raise ValueError("expected 1-64 letters, digits, '_' or '-' (starting alphanumeric)")
        return value


class LivenessSettings(BaseSettings):
    """A service whose container's health check reads a file it touches (``shared.liveness``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    liveness_file: str | None = Field(
        None,
        description="file touched at each heartbeat, for a container's health check "
        "(python -m shared.liveness FILE MAX_AGE_S); default: none",
    )


class JobSettings(NatsSettings, CommonJobSettings, LivenessSettings):
    """A service of one job: NATS connection plus the job's definition."""


SettingsT = TypeVar("SettingsT", bound=BaseModel)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


#: Marks a settings field that holds a secret: it gets no ``--flag`` (a command line shows in
#: ``ps``); it is set by its environment variable (or a file the settings read).
SECRET = {"secret": True}


def is_secret(field: Any) -> bool:
    """Whether a settings field holds a secret (:data:`SECRET`)."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("secret") is True


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
