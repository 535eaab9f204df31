"""``/healthz`` (the process serves HTTP) and ``/readyz`` (NATS reachable, the outer alive)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from nats import errors as nats_errors
from pydantic import BaseModel, Field

from services.gateway.deps import NatsDep, SettingsDep
from services.gateway.views import ErrorView
from shared.job_status import read_job_status
from shared.records.outer import outer_liveness

router = APIRouter(tags=["health"])
READY_FLUSH_TIMEOUT_S = 2.0


class Readiness(BaseModel):
    """The gateway is ready: NATS answers and the outer of its ``--job`` (if it has one)
    heartbeats and runs."""

    status: str = Field(examples=["ready"])
    job: str = Field(examples=["demo"], description="empty: a gateway of no job")
    outer_heartbeat_age_s: float | None = Field(
        description="on the NATS server's clock (None: a gateway of no job)"
    )


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
    description="200 when the outer of the gateway's --job heartbeats and runs (a gateway "
    "with an empty --job: when NATS answers), else 503 saying why.",
    responses={503: {"model": ErrorView, "description": "NATS unreachable or outer not alive"}},
)
async def readyz(settings: SettingsDep, nats: NatsDep) -> Readiness:
    """Ready when the outer's shown state (``shared.records.outer_liveness``) is running; a
    gateway of no job (compose's) when NATS answers a round trip."""
    if not settings.job:
        try:
            await nats.nc.flush(timeout=READY_FLUSH_TIMEOUT_S)
        except (TimeoutError, nats_errors.Error) as err:
            raise HTTPException(status_code=503, detail=f"NATS does not answer: {err}") from None
        return Readiness(status="ready", job="", outer_heartbeat_age_s=None)
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
