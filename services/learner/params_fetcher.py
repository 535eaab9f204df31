"""Fetching the newest global params of each fragment for a learner.

The outer publishes each fragment's params as chunks plus a small head message
(``shared.records.ParamsHead``) on ``diloco.J.params.<p>.head``. The fetcher subscribes to the
heads of its job as notifications and also looks every ``PARAMS_POLL_S`` (a notification may
be missed while reconnecting); for each fragment whose head is newer than what it has, it reads
and decodes the params and keeps them until the training thread takes them at a step boundary
(:meth:`ParamsFetcher.take_new`: only the newest version of each fragment).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.learner.counters import Counters
from services.learner.settings import LearnerSettings
from shared import codec, subjects, transport, wire
from shared.retry import NATS_ERRORS, retry
from shared.transport import TransportError

log = logging.getLogger(__name__)

PARAMS_POLL_S = 2.0  # fallback poll in case a head notification was missed while reconnecting


@dataclass
class GlobalFragment:
    """A decoded global fragment."""

    fragment: int
    version: int
    pieces: dict[str, np.ndarray]


class ParamsFetcher:
    """Keeps the newest global version of every fragment not yet taken by the training thread."""

    def __init__(
        self, settings: LearnerSettings, max_params_bytes: int, counters: Counters
    ) -> None:
        """Args:
        settings: the unit's settings (job, fragments).
        max_params_bytes: largest global params envelope accepted.
        counters: where ``params_received`` and ``params_rejected`` are counted.
        """
        self.settings = settings
        self.max_params_bytes = max_params_bytes
        self.counters = counters
        self._lock = threading.Lock()
        self._newest: dict[int, GlobalFragment] = {}
        self._known_versions = [-1] * settings.fragments
        self._head_seen: asyncio.Event | None = None
        self._subscription: Any = None

    def take_new(self) -> list[GlobalFragment]:
        """Global fragments fetched since the last call (the newest version of each);
        thread-safe, returns at once."""
        with self._lock:
            arrived, self._newest = list(self._newest.values()), {}
        return arrived

    async def subscribe(self, nc: Any, on_error: Callable[[str], None] | None = None) -> None:
        """Subscribe to the job's params heads (retried until it works; each failure is told
        to ``on_error``)."""
        head_seen = self._head_seen = asyncio.Event()

        async def on_head(_msg: Any) -> None:
            head_seen.set()

        self._subscription = await retry(
            lambda: nc.subscribe(subjects.params_head_subject(self.settings.job, "*"), cb=on_head),
            "subscribe to params heads",
            on_error=on_error,
        )

    async def run(self, js: Any) -> None:
        """Fetch every fragment whose head is newer, after each notification or poll (forever)."""
        head_seen = self._head_seen or asyncio.Event()
        while True:
            for fragment in range(self.settings.fragments):
                try:
                    await self._fetch(js, fragment)
                except (wire.WireError, codec.CodecError) as err:
                    self.counters.add("params_rejected")
                    self.counters.error(f"bad global params: {err}")
                    log.error("bad global params: %s", err)
                except (TransportError, *NATS_ERRORS) as err:
                    log.info("params fetch: %r", err)
            head_seen.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(head_seen.wait(), timeout=PARAMS_POLL_S)

    async def close(self) -> None:
        """Unsubscribe from the heads (if subscribed)."""
        if self._subscription is not None:
            await self._subscription.unsubscribe()

    async def _fetch(self, js: Any, fragment: int) -> None:
        job = self.settings.job
        head = await transport.read_params_head(js, job, fragment)
        if head is None or head.version <= self._known_versions[fragment]:
            return
        fetched = await transport.read_latest_params(js, job, fragment, self.max_params_bytes)
        if fetched is None:
            return
        version, blob = fetched
        envelope = wire.unpack_envelope(blob, max_size=self.max_params_bytes)
        if envelope.kind != "params" or envelope.fragment != fragment or envelope.job != job:
            raise wire.WireError(f"expected params of {job} fragment {fragment}")
        pieces = codec.decode_tensors(envelope.payload, envelope.codec)
        with self._lock:
            self._newest[fragment] = GlobalFragment(fragment, version, pieces)
            self._known_versions[fragment] = version
        self.counters.add("params_received")
