"""The gateway's NATS connection, made in the background so that ``/healthz`` answers without it.

Routes reach NATS through :class:`NatsHandles` (``deps.NatsDep``), which answers 503 while the
connection is not up. Every JetStream request (KV reads and writes included) has the JetStream
context's timeout, :data:`REQUEST_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from services.gateway.settings import GatewaySettings
from shared import subjects
from shared.retry import NATS_ERRORS, retry
from shared.transport import TransportError
from shared.transport.connection import connect
from shared.transport.streams import prepare_streams

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class NatsHandles:
    """An open connection and the JetStream handles the routes use."""

    nc: NatsClient
    js: JetStreamContext
    jobs_kv: KeyValue
    desired_kv: KeyValue


class NatsLink:
    """Connects in the background (``shared.retry``) until NATS answers, then holds the handles.

    Once made, the connection reconnects on its own (nats-py), so :attr:`connected` may turn
    false and true again without a new :class:`NatsHandles`.
    """

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.handles: NatsHandles | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start connecting (in a task of the running event loop)."""
        self._task = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        self.handles = await retry(
            self._open, "gateway connect to NATS", on=(TransportError, *NATS_ERRORS)
        )

    async def _open(self) -> NatsHandles:
        nc = await connect(self.settings, "gateway")
        try:
            js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
            await prepare_streams(js, self.settings)
            jobs_kv = await js.key_value(subjects.JOBS_BUCKET)
            desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
        except BaseException:
            await _close(nc)
            raise
        return NatsHandles(nc, js, jobs_kv, desired_kv)

    @property
    def connected(self) -> bool:
        """Whether the connection is made and up at this moment."""
        return self.handles is not None and self.handles.nc.is_connected

    async def close(self) -> None:
        """Stop connecting, or close the connection."""
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        if self.handles is not None:
            await _close(self.handles.nc)


async def _close(nc: NatsClient) -> None:
    with suppress(TimeoutError, nats.errors.Error):
        await asyncio.wait_for(nc.close(), timeout=CLOSE_TIMEOUT_S)
