"""How a service connects to NATS (URL, user, TLS), and the liveness file its container's health
check reads."""

from __future__ import annotations

import re
import ssl

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared import nats_auth
from shared.records import JOB_NAME_PATTERN
from shared.records.credentials import NatsCredentials
from shared.settings import ENV_PREFIX


class NatsSettings(BaseSettings):
    """Connection settings every service has."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL(s), comma-separated for a cluster",
    )
    nats_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="replicas of every stream and KV bucket, when this service is the one that "
        "creates them (3 on a three-node JetStream cluster: any one node may fail); existing "
        "ones keep theirs",
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


class LivenessSettings(BaseSettings):
    """A service whose container's health check reads a file it touches (``shared.liveness``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    liveness_file: str | None = Field(
        None,
        description="file touched at each heartbeat, for a container's health check "
        "(python -m shared.liveness FILE MAX_AGE_S); default: none",
    )


class JobNameSettings(BaseSettings):
    """Which job a service acts for."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    job: str = Field("demo", description="job name (letters, digits, '_' and '-')")

    @field_validator("job")
    @classmethod
    def _check_job(cls, value: str) -> str:
        if not JOB_NAME_PATTERN.match(value):
            raise ValueError("expected 1-64 letters, digits, '_' or '-' (starting alphanumeric)")
        return value


class ServiceSettings(NatsSettings, JobNameSettings, LivenessSettings):
    """A service of one job: its NATS connection, its job and its liveness file."""
