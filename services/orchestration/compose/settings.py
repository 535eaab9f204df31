"""The options of ``diloco broker`` and ``diloco controller`` (each also ``DILOCO_<NAME>``)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.records import MAX_OUTER_UNITS, JobName
from shared.settings import ENV_PREFIX
from shared.settings.link import ShapedLinkSettings
from shared.settings.nats import LivenessSettings, NatsSettings
from shared.settings.resources import LearnerThreads

#: Inside the ``secrets`` volume: one credentials file per NATS user, the TLS files, the token.
CREDENTIALS_DIR = "credentials"
TLS_DIR = "tls"
TOKEN_FILE = "api-token"
ROUTE_SECRET_FILE = "route-secret"  # the password of the cluster's routes


class BrokerSettings(BaseSettings):
    """Options of ``diloco broker``: nats-server for a compose cluster, with the cluster's
    secrets (made once, kept in ``--secrets-dir``) and a reload whenever users are added."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    secrets_dir: Path = Field(
        Path("/secrets"),
        description="folder of the cluster's secrets: credentials/<user>.json, tls/, api-token, "
        "route-secret",
    )
    store_dir: Path = Field(Path("/data"), description="JetStream's store and the server log")
    listen_host: str = Field("0.0.0.0", description="interface nats-server listens on")
    port: int = Field(4222, ge=1, le=65535, description="client port")
    http_port: int = Field(
        8222, ge=1, le=65535, description="monitoring port on 127.0.0.1 (the health check)"
    )
    tls: bool = Field(True, description="clients must connect with TLS (a CA made once)")
    server_names: str = Field(
        "nats,localhost,127.0.0.1",
        description="comma-separated names and addresses the server's certificate is valid for",
    )
    poll_s: float = Field(
        1.0, gt=0, le=60, description="how often the credentials folder is checked for new users"
    )
    routes: str = Field(
        "",
        description="a node of a JetStream cluster: the route URLs of every node, comma-"
        "separated (nats-route://nats:6222,nats-route://nats-1:6222,...; its own may be among "
        "them); empty: a server on its own",
    )
    route_port: int = Field(6222, ge=1, le=65535, description="port the cluster's routes use")
    server_name: str = Field(
        "",
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]*$",
        description="the node's name in the cluster (default: the host's name)",
    )

    def names(self) -> list[str]:
        """The certificate's names, in order."""
        return [name.strip() for name in self.server_names.split(",") if name.strip()]

    def route_urls(self) -> list[str]:
        """``--routes`` as a list (empty: no cluster)."""
        return [route.strip() for route in self.routes.split(",") if route.strip()]

    @field_validator("routes")
    @classmethod
    def _check_routes(cls, value: str) -> str:
        for route in value.split(","):
            if route.strip() and not re.match(r"^nats-route://[^\s/:,]+:\d{1,5}$", route.strip()):
                raise ValueError(
                    f"expected nats-route://host:port (comma-separated), got {route!r}"
                )
        return value


class CredentialsSettings(BaseSettings):
    """Options of ``diloco credentials``: the NATS user of a learner unit that runs outside
    the compose cluster (on another machine), made in the secrets volume, where the brokers
    load it within their ``--poll-s``; its credentials file is printed (run it in the
    controller's container: ``docker compose exec -T controller diloco credentials ...``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    secrets_dir: Path = Field(
        Path("/secrets"), description="the broker's secrets folder (the user's file goes here)"
    )
    job: JobName = Field(description="the job the unit joins")
    unit: int = Field(ge=0, lt=MAX_OUTER_UNITS, description="the unit's index")


class ControllerSettings(NatsSettings, LivenessSettings, ShapedLinkSettings, LearnerThreads):
    """Options of ``diloco controller``: start a container for each outer, learner (and shaped
    link) of the jobs created through the REST API, restart crashed ones, retire finished jobs;
    connects to NATS as the admin (``DILOCO_NATS_CREDENTIALS``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    secrets_dir: Path = Field(
        Path("/secrets"), description="the broker's secrets folder (new users' files go here)"
    )
    checkpoint_dir: str = Field(
        "/units", description="the learners' --checkpoint-dir (a volume every learner mounts)"
    )
    docker_socket: str = Field(
        "/var/run/docker.sock", description="the Docker Engine API's Unix socket"
    )
    container: str = Field(
        "",
        description="this controller's container (name or id), whose image, networks and "
        "volumes the job containers get; default: $HOSTNAME (a container's own id)",
    )
