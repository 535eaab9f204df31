"""Settings of the REST gateway (flags ``diloco gateway --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from shared.settings import NatsSettings


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
        description="API token: POST/PUT/DELETE need 'Authorization: Bearer <token>' "
        "(required unless --local)",
    )
    local: bool = Field(
        False,
        description="allow starting without a token: then anyone who reaches the port may "
        "change jobs (only for a gateway bound to a trusted machine)",
    )

    @model_validator(mode="after")
    def _check_token(self) -> GatewaySettings:
        if not self.token and not self.local:
            raise ValueError(
                "the gateway needs an API token: pass --token (env DILOCO_TOKEN), "
                "or --local to run without one on a trusted machine"
            )
        return self
