"""``/healthz`` (the process serves HTTP) and ``/readyz`` (NATS reachable, the outer alive)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from services.gateway.deps import NatsDep, SettingsDep
from services.gateway.views import ErrorView
from shared.job_status import read_job_status
from shared.records import outer_liveness

router = APIRouter(tags=["health"])


class Readiness(BaseModel):
    """The gateway is ready: the outer of its ``--job`` heartbeats and runs."""

    status: str = Field(examples=["ready"])
    job: str = Field(examples=["demo"])
    outer_heartbeat_age_s: float = Field(description="on the NATS server's clock")


@router.get(
    "/healthz",
    summary="The gateway process is up",
    description="Always 200 while the process serves HTTP, even without NATS.",
)
async def healthz() -> dict[str, str]:
    """Always ``{"status": "ok"}``."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="NATS reachable and the outer optimizer alive",
    description="200 when the outer of the gateway's --job heartbeats and runs, else 503 "
    "saying why.",
    responses={503: {"model": ErrorView, "description": "NATS unreachable or outer not alive"}},
)
async def readyz(settings: SettingsDep, nats: NatsDep) -> Readiness:
    """Ready when the outer's shown state (``shared.records.outer_liveness``) is running."""
    status = await read_job_status(nats.nc, nats.js, settings.job)
    state = outer_liveness(status.outer, settings.heartbeat_timeout_s)
    if status.outer is None or state != "running":
        age = f"{status.outer.age_s:.1f} s" if status.outer is not None else "none"
        raise HTTPException(
            status_code=503,
            detail=f"outer of job {settings.job!r} not alive (state {state}, last heartbeat "
            f"age {age})",
        )
    return Readiness(
        status="ready", job=settings.job, outer_heartbeat_age_s=round(status.outer.age_s, 2)
    )
