"""The REST gateway's application: its routers, the NATS link's lifetime, and the one place
where domain errors become HTTP answers.

The gateway keeps no state of its own and never talks to a unit directly: it keeps job records
in the ``diloco_jobs`` bucket, writes desired states into ``diloco_desired`` (units poll it) and
reads heartbeats from ``diloco_status``. Every request passes the front door first
(``front_door.py``: the API token of a POST/PUT/DELETE, the body size, security headers).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats.errors
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.gateway.auth import document_auth
from services.gateway.front_door import FrontDoor
from services.gateway.jobs import TransitionError
from services.gateway.link import NatsLink
from services.gateway.registry import Conflict
from services.gateway.routes import dashboard, health, jobs, metrics, units
from services.gateway.settings import GatewaySettings
from shared.kv import KvError


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Connect to NATS in the background while the app serves; close the link at the end."""
    link: NatsLink = app.state.link
    link.start()
    yield
    await link.close()


async def conflict(_request: Request, err: Exception) -> JSONResponse:
    """A transition the state does not allow, or a record changed or taken meanwhile: 409."""
    return JSONResponse(status_code=409, content={"detail": str(err)})


async def nats_timeout(_request: Request, _err: Exception) -> JSONResponse:
    """NATS did not answer in time: 503."""
    detail = "NATS did not answer in time; try again"
    return JSONResponse(status_code=503, content={"detail": detail})


async def nats_failure(_request: Request, err: Exception) -> JSONResponse:
    """NATS refused or failed a request: 503 with its reason."""
    return JSONResponse(status_code=503, content={"detail": f"NATS request failed: {err}"})


def create_app(settings: GatewaySettings) -> FastAPI:
    """The FastAPI application of a gateway with ``settings`` (it connects to NATS once it
    starts serving)."""
    app = FastAPI(
        title="decoupled-diloco gateway",
        version="0.2.0",
        description="Job registry, job and unit control, and health of a Decoupled DiLoCo "
        "training system. POST, PUT and DELETE need `Authorization: Bearer <token>`.",
        lifespan=lifespan,
    )
    app.add_middleware(FrontDoor, settings=settings)
    app.state.settings = settings
    app.state.link = NatsLink(settings)
    app.add_exception_handler(TransitionError, conflict)
    app.add_exception_handler(Conflict, conflict)
    app.add_exception_handler(TimeoutError, nats_timeout)
    app.add_exception_handler(nats.errors.TimeoutError, nats_timeout)
    app.add_exception_handler(nats.errors.Error, nats_failure)
    app.add_exception_handler(KvError, nats_failure)
    for module in (health, jobs, units, metrics, dashboard):
        app.include_router(module.router)
    document_auth(app)
    return app
