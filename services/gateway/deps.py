"""What the routes depend on: the settings, the NATS connection, the registry, and the path
parameters every router shares.

``create_app`` keeps the settings and the :class:`NatsLink` in ``app.state``; the routers are
module-level and get them here, as FastAPI dependencies.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request

from services.gateway.link import NatsHandles, NatsLink
from services.gateway.registry import Registry
from services.gateway.settings import GatewaySettings
from shared.records import JOB_NAME_PATTERN


def get_settings(request: Request) -> GatewaySettings:
    """The gateway's settings."""
    return request.app.state.settings


def get_link(request: Request) -> NatsLink:
    """The gateway's NATS link, connected or not."""
    return request.app.state.link


def get_nats(link: Annotated[NatsLink, Depends(get_link)]) -> NatsHandles:
    """The open NATS connection; 503 while there is none."""
    if link.handles is None or not link.connected:
        raise HTTPException(status_code=503, detail="NATS is not reachable from the gateway")
    return link.handles


def get_registry(nats: Annotated[NatsHandles, Depends(get_nats)]) -> Registry:
    """The job registry and desired states, over the open connection."""
    return Registry(nats.nc, nats.jobs_kv, nats.desired_kv)


SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
LinkDep = Annotated[NatsLink, Depends(get_link)]
NatsDep = Annotated[NatsHandles, Depends(get_nats)]
RegistryDep = Annotated[Registry, Depends(get_registry)]

JobName = Annotated[
    str, Path(pattern=JOB_NAME_PATTERN.pattern, description="job name", examples=["demo"])
]
UnitIndex = Annotated[int, Path(ge=0, le=1_000_000, description="unit index", examples=[0])]
