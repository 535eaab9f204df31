"""The REST gateway: health, job status and unit pause/resume, all through NATS KV.

The gateway keeps no state of its own and never talks to a unit directly: it writes desired
states into the ``diloco_desired`` bucket (units poll it) and reads heartbeats from
``diloco_status``. Domain errors are mapped to HTTP only here, at the edge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Path, Request
from pydantic import BaseModel

from services.gateway.link import KV_TIMEOUT_S, Link, NatsLink, read_status
from services.gateway.settings import GatewaySettings
from shared import subjects, transport
from shared.settings import JOB_NAME_PATTERN

log = logging.getLogger(__name__)

JobName = Annotated[
    str, Path(pattern=JOB_NAME_PATTERN.pattern, description="job name", examples=["demo"])
]
UnitIndex = Annotated[int, Path(ge=0, le=1_000_000, description="unit index", examples=[0])]


class UnitView(BaseModel):
    """One unit as the gateway sees it."""

    unit: int
    state: str
    desired: str
    step: int | None = None
    round: int | None = None
    base_version: int | None = None
    train_loss: float | None = None
    tokens_per_s: float | None = None
    last_heartbeat: float | None = None
    heartbeat_age_s: float | None = None
    published: int = 0


class JobView(BaseModel):
    """A job's global state and its units."""

    job: str
    version: int | None
    outer_state: str
    outer_alive: bool
    eval_nats_per_byte: float | None
    eval_init_nats_per_byte: float | None
    applied: int
    rejected: dict[str, int]
    units: list[UnitView]


class DesiredStateView(BaseModel):
    """The desired state written for a unit."""

    job: str
    unit: int
    desired: Literal["running", "paused"]


async def _desired(link: NatsLink, job: str, unit: int) -> str:
    desired = await transport.get_json(link.desired_kv, subjects.desired_key(job, unit))
    return (desired or {}).get("state", "running")


def create_app(settings: GatewaySettings) -> FastAPI:
    """Build the FastAPI application (the NATS connection is made at start-up)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.link = NatsLink(settings)
        app.state.link.start()
        yield
        await app.state.link.close()

    app = FastAPI(
        title="decoupled-diloco gateway",
        version="0.1.0",
        description="Job control and health of a Decoupled DiLoCo training system.",
        lifespan=lifespan,
    )

    @app.get("/healthz", summary="The gateway process is up")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="NATS reachable and the outer optimizer alive")
    async def readyz(request: Request) -> dict[str, Any]:
        link: NatsLink = request.app.state.link
        if not link.connected:
            raise HTTPException(status_code=503, detail="NATS is not reachable")
        outer = await transport.get_json(link.status_kv, subjects.outer_status_key(settings.job))
        age = time.time() - outer["time"] if outer else None
        if age is None or age > settings.heartbeat_timeout_s or outer.get("state") != "running":
            raise HTTPException(
                status_code=503,
                detail=f"outer of job {settings.job!r} not alive (last heartbeat age {age})",
            )
        return {"status": "ready", "job": settings.job, "outer_heartbeat_age_s": round(age, 2)}

    @app.get("/jobs/{job}", response_model=JobView, summary="Global version and unit states")
    async def get_job(job: JobName, link: Link) -> JobView:
        outer, units = await read_status(link, job)
        if outer is None and not units:
            raise HTTPException(status_code=404, detail=f"job {job!r} not found")
        now = time.time()
        views = []
        for unit, status in sorted(units.items()):
            age = now - status.get("time", 0)
            lost = age > settings.heartbeat_timeout_s and status.get("state") not in (
                "finished",
                "stopped",
            )
            views.append(
                UnitView(
                    unit=unit,
                    state="lost" if lost else status.get("state", "unknown"),
                    desired=await _desired(link, job, unit),
                    step=status.get("step"),
                    round=status.get("round"),
                    base_version=status.get("base_version"),
                    train_loss=status.get("train_loss"),
                    tokens_per_s=status.get("tokens_per_s"),
                    last_heartbeat=status.get("time"),
                    heartbeat_age_s=round(age, 2),
                    published=status.get("counters", {}).get("published", 0),
                )
            )
        outer = outer or {}
        outer_alive = bool(outer) and now - outer.get("time", 0) <= settings.heartbeat_timeout_s
        return JobView(
            job=job,
            version=outer.get("version"),
            outer_state=outer.get("state", "absent") if outer_alive or not outer else "lost",
            outer_alive=outer_alive,
            eval_nats_per_byte=(outer.get("eval") or {}).get("nats_per_byte"),
            eval_init_nats_per_byte=(outer.get("eval_init") or {}).get("nats_per_byte"),
            applied=outer.get("applied", 0),
            rejected=outer.get("rejected", {}),
            units=views,
        )

    async def set_desired(link: NatsLink, job: str, unit: int, state: str) -> DesiredStateView:
        _, units = await read_status(link, job)
        if unit not in units:
            raise HTTPException(
                status_code=404, detail=f"unit {unit} of job {job!r} has never reported"
            )
        await asyncio.wait_for(
            transport.put_desired(link.desired_kv, job, unit, state), KV_TIMEOUT_S
        )
        return DesiredStateView(job=job, unit=unit, desired=state)

    @app.post(
        "/jobs/{job}/units/{unit}/pause",
        response_model=DesiredStateView,
        summary="Pause a unit: it stops training and publishing until resumed",
    )
    async def pause_unit(job: JobName, unit: UnitIndex, link: Link) -> DesiredStateView:
        return await set_desired(link, job, unit, "paused")

    @app.post(
        "/jobs/{job}/units/{unit}/resume",
        response_model=DesiredStateView,
        summary="Resume a paused unit from where it stopped",
    )
    async def resume_unit(job: JobName, unit: UnitIndex, link: Link) -> DesiredStateView:
        return await set_desired(link, job, unit, "running")

    # Routers of the other gateway modules are included here.
    return app
