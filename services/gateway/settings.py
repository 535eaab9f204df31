"""Settings of the REST gateway (flags ``diloco gateway --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from shared.settings import SECRET
from shared.settings.nats import NatsSettings

#: The shortest API token a gateway outside ``--local`` accepts (``secrets.token_urlsafe(24)``,
#: what ``diloco up`` makes, has 32 characters).
MIN_TOKEN_CHARS = 16


class GatewaySettings(NatsSettings):
    """Where the gateway listens, how it judges liveness and who may change things."""

    host: str = Field("127.0.0.1", description="interface the HTTP server binds to")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port)")
    job: str = Field(
        "demo",
        description="job whose outer must be alive for /readyz; empty: none (a cluster whose "
        "jobs all come through the API: ready when NATS answers)",
    )
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="a unit or outer silent for longer than this is 'lost'"
    )
    token: str = Field(
        "",
        description="API token: POST/PUT/DELETE need 'Authorization: Bearer <token>'; from the "
        "environment only (DILOCO_TOKEN), never a flag",
        json_schema_extra=SECRET,
    )
    token_file: Path | None = Field(
        None,
        description="file holding the API token (instead of DILOCO_TOKEN); the token is "
        f"required unless --local, at least {MIN_TOKEN_CHARS} characters",
    )
    local: bool = Field(
        False,
        description="allow starting without a token, or with a short one: then anyone who "
        "reaches the port may change jobs (only for a gateway bound to a trusted machine)",
    )
    viewer_token: str = Field(
        "",
        description="read-only API token: when set, every read but /healthz, /readyz, the API "
        "schema and the dashboard's page needs it (or the API token); from the environment "
        "only (DILOCO_VIEWER_TOKEN); default: reads are open",
        json_schema_extra=SECRET,
    )
    viewer_token_file: Path | None = Field(
        None, description="file holding the read-only token (instead of DILOCO_VIEWER_TOKEN)"
    )
    data_root: Path | None = Field(
        None,
        description="folder a job created through the API may take its corpus from (the path "
        "must resolve inside it, symlinks followed); default: such a job may not name a corpus "
        "and trains on the built-in one",
    )
    max_body_bytes: int = Field(
        1 << 20,
        ge=1024,
        le=1 << 30,
        description="largest request body accepted (413 before it is read)",
    )

    @model_validator(mode="after")
    def _check_token(self) -> GatewaySettings:
        self.token = _secret(self.token, self.token_file, "DILOCO_TOKEN", "--token-file")
        self.viewer_token = _secret(
            self.viewer_token, self.viewer_token_file, "DILOCO_VIEWER_TOKEN", "--viewer-token-file"
        )
        if self.viewer_token and self.viewer_token == self.token:
            raise ValueError("the read-only token must differ from the API token")
        if self.local:
            return self
        if not self.token:
            raise ValueError(
                "the gateway needs an API token: set DILOCO_TOKEN or pass --token-file, "
                "or --local to run without one on a trusted machine"
            )
        for name, value in (("API token", self.token), ("read-only token", self.viewer_token)):
            if value and len(value) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"the {name} has {len(value)} characters; a gateway outside --local "
                    f"needs at least {MIN_TOKEN_CHARS} (e.g. openssl rand -base64 24)"
                )
        return self


def _secret(value: str, path: Path | None, env: str, flag: str) -> str:
    """A token given by its environment variable (``value``) or read from ``path``."""
    if path is None:
        return value
    if value:
        raise ValueError(f"give the token by {env} or {flag}, not both")
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {flag} {path}: {err}") from None
