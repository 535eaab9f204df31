"""Settings of the REST gateway (flags ``diloco gateway --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from shared.settings import SECRET, NatsSettings

#: The shortest API token a gateway outside ``--local`` accepts (``secrets.token_urlsafe(24)``,
#: what ``diloco up`` makes, has 32 characters).
MIN_TOKEN_CHARS = 16


class GatewaySettings(NatsSettings):
    """Where the gateway listens, how it judges liveness and who may change things."""

    host: str = Field("127.0.0.1", description="interface the HTTP server binds to")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port)")
    job: str = Field("demo", description="job whose outer must be alive for /readyz")
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
    max_body_bytes: int = Field(
        1 << 20,
        ge=1024,
        le=1 << 30,
        description="largest request body accepted (413 before it is read)",
    )

    @model_validator(mode="after")
    def _check_token(self) -> GatewaySettings:
        if self.token_file is not None:
            if self.token:
                raise ValueError("give the API token by DILOCO_TOKEN or --token-file, not both")
            try:
                self.token = self.token_file.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"cannot read --token-file {self.token_file}: {err}") from None
        if self.local:
            return self
        if not self.token:
            raise ValueError(
                "the gateway needs an API token: set DILOCO_TOKEN or pass --token-file, "
                "or --local to run without one on a trusted machine"
            )
        if len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"the API token has {len(self.token)} characters; a gateway outside --local "
                f"needs at least {MIN_TOKEN_CHARS} (e.g. openssl rand -base64 24)"
            )
        return self
