"""The REST gateway: health, the job registry, job and unit control, all through NATS KV.

The gateway keeps no state of its own and never talks to a unit directly: it keeps job records
in the ``diloco_jobs`` bucket, writes desired states into ``diloco_desired`` (units poll it) and
reads heartbeats from ``diloco_status``. Every POST/PUT/DELETE needs the API token
(``auth.py``). Domain errors are mapped to HTTP only here, at the edge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from services.gateway import dashboard, observe
from services.gateway.auth import document_auth, token_guard
from services.gateway.control import ErrorView, control_router
from services.gateway.link import NatsLink
from services.gateway.settings import GatewaySettings
from shared import subjects, transport

log = logging.getLogger(__name__)


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
        version="0.2.0",
        description="Job registry, job and unit control, and health of a Decoupled DiLoCo "
        "training system. POST, PUT and DELETE need `Authorization: Bearer <token>`.",
        lifespan=lifespan,
        dependencies=[Depends(token_guard(settings.token))],
    )

    @app.exception_handler(TimeoutError)
    async def nats_timeout(_request: Request, err: TimeoutError) -> JSONResponse:
        return JSONResponse(
            status_code=503, content={"detail": "NATS did not answer in time; try again"}
        )

    @app.get(
        "/healthz",
        summary="The gateway process is up",
        description="Always 200 while the process serves HTTP, even without NATS.",
    )
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        summary="NATS reachable and the outer optimizer alive",
        description="200 when the outer of the gateway's --job heartbeats, else 503 saying why.",
        responses={503: {"model": ErrorView, "description": "NATS unreachable or outer not alive"}},
    )
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

    app.include_router(control_router(settings))

    # Routers of the other gateway modules are included here.
    app.include_router(observe.router)
    app.include_router(dashboard.router)
    document_auth(app)
    return app
