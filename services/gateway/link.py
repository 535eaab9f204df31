"""The gateway's NATS side: one background connection, its KV handles, status reads.

The connection is made in the background so that ``/healthz`` answers without NATS; routes
that need NATS depend on :data:`Link`, which answers 503 while it is down.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from typing import Annotated, Any

import nats.errors
import nats.js.errors
from fastapi import Depends, HTTPException, Request

from services.gateway.settings import GatewaySettings
from shared import subjects, transport
from shared.transport import TransportError

log = logging.getLogger(__name__)

KV_TIMEOUT_S = 5.0


class NatsLink:
    """The gateway's NATS connection, made in the background so /healthz works without it."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.nc: Any = None
        self.desired_kv: Any = None
        self.status_kv: Any = None
        self.jobs_kv: Any = None
        # Unit status keys seen per job. Listing a bucket's keys (nats-py's kv.keys(), an
        # ordered replay) can miss a key that is being rewritten at that moment, and units
        # heartbeat every second; keys seen once are therefore always read directly.
        self.seen_unit_keys: dict[str, set[str]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._connect_forever())

    async def _connect_forever(self) -> None:
        backoff = 0.5
        while True:
            try:
                nc = await transport.connect(self.settings, "gateway")
                js = nc.jetstream()
                await transport.ensure_streams(js)
                self.desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
                self.status_kv = await js.key_value(subjects.STATUS_BUCKET)
                self.jobs_kv = await js.key_value(subjects.JOBS_BUCKET)
                self.nc = nc
                return
            except (TimeoutError, TransportError, nats.errors.Error) as err:
                log.warning("gateway cannot reach NATS (%s); retrying in %.1fs", err, backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.nc is not None:
            with suppress(TimeoutError, nats.errors.Error):
                await asyncio.wait_for(self.nc.close(), timeout=5)


def _link(request: Request) -> NatsLink:
    link: NatsLink = request.app.state.link
    if not link.connected:
        raise HTTPException(status_code=503, detail="NATS is not reachable from the gateway")
    return link


Link = Annotated[NatsLink, Depends(_link)]


async def read_status(link: NatsLink, job: str) -> tuple[dict[str, Any] | None, dict[int, dict]]:
    """Return (outer status, {unit: status}) of a job."""
    outer = await asyncio.wait_for(
        transport.get_json(link.status_kv, subjects.outer_status_key(job)), KV_TIMEOUT_S
    )
    units: dict[int, dict] = {}
    keys = await asyncio.wait_for(transport.kv_keys(link.status_kv), KV_TIMEOUT_S)
    prefix = subjects.unit_status_key(job, 0)[:-1]
    seen = link.seen_unit_keys.setdefault(job, set())
    seen.update(k for k in keys if k.startswith(prefix) and k[len(prefix) :].isdigit())
    for key in sorted(seen):
        status = await transport.get_json(link.status_kv, key)
        if status is not None:
            units[int(key[len(prefix) :])] = status
    return outer, units
