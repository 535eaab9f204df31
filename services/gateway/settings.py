"""Settings of the REST gateway (flags ``diloco gateway --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import NatsSettings


class GatewaySettings(NatsSettings):
    """Where the gateway listens and how it judges liveness."""

    host: str = Field("127.0.0.1", description="interface the HTTP server binds to")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port)")
    job: str = Field("demo", description="job whose outer must be alive for /readyz")
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="a unit or outer silent for longer than this is 'lost'"
    )
