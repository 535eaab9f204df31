"""A learner's upload queue and its publisher.

The training thread queues uploads with :meth:`Sender.submit`, which returns at once; the
queue is bounded (``--max-unsent``) and drops its oldest upload when full, so a unit that cannot
reach NATS keeps training. On the link's event loop :meth:`Sender.run` publishes the queue's
head, in order, as chunked envelopes (encoded by :class:`UploadEncoder`, the next one while the
head is being sent) and retries a failed publish (``shared.retry``) with the same bytes until it
is accepted or, once the link is stopping, its flush deadline has passed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import nats.errors

from services.learner.core import Upload
from services.learner.counters import Counters
from services.learner.encoder import UploadEncoder, UploadKey, upload_key
from services.learner.settings import LearnerSettings
from services.learner.unit_state import UnitState
from shared import subjects
from shared.codec.config import CodecError
from shared.latency import Latencies, SyncLatency
from shared.retry import retry
from shared.transport import TransportError
from shared.transport.blobs import publish_blob
from shared.unit_counters import LifetimeCounter
from shared.wire.chunks import upload_id

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # how long the publisher sleeps on an empty queue before looking again
PUBLISH_ERRORS = (TimeoutError, OSError, TransportError, nats.errors.Error)


class Sender:
    """The bounded upload queue and the task that publishes it."""

    def __init__(
        self,
        settings: LearnerSettings,
        unit_state: UnitState,
        counters: Counters,
        encoder: UploadEncoder,
        on_published: Callable[[int], None] = lambda _fragment: None,
        sync_latency: SyncLatency | None = None,
    ) -> None:
        """Args:
        settings: the unit's settings (job, unit, ``max_unsent``).
        unit_state: where lifetime counts and published rounds are recorded.
        counters: this process's counters (``queued``, ``dropped_unsent``, ``published``,
            ``rejected_local``, ``bytes_sent``) and last error.
        encoder: encodes the uploads.
        on_published: told the fragment of every upload JetStream accepted (on the link's
            event loop).
        sync_latency: told each upload's sync point (its submission), and the uploads that
            will never be applied.
        """
        self.settings = settings
        self.unit_state = unit_state
        self.counters = counters
        self.encoder = encoder
        self.on_published = on_published
        self.upload_latency = Latencies()
        # Seconds each accepted upload's publish took: its time on the unit's link.
        self.publish_seconds = Latencies()
        self.sync_latency = sync_latency or SyncLatency()
        self._queued_at: dict[UploadKey, float] = {}
        self.last_published_round: int | None = None
        self._lock = threading.Lock()
        self._queue: collections.deque[Upload] = collections.deque()
        self._in_flight: Upload | None = None  # the head of the queue while it is being sent
        self._stopping = threading.Event()
        self._flush_deadline = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue_changed: asyncio.Event | None = None
        self._deadline_passed: asyncio.Event | None = None

    # ---- any thread ----------------------------------------------------------------------------

    def submit(self, upload: Upload) -> None:
        """Queue ``upload`` for publishing; drops the oldest when the queue is full.

        The upload being sent is never dropped (it may be published anyway, and would then be
        counted twice); with ``max_unsent`` 1 the queue briefly holds it and the new one.
        """
        dropped = None
        with self._lock:
            if len(self._queue) >= self.settings.max_unsent:
                index = 1 if self._queue and self._queue[0] is self._in_flight else 0
                if index < len(self._queue):
                    dropped = self._queue[index]
                    del self._queue[index]
            self._queue.append(upload)
            self._queued_at[upload_key(upload)] = now = time.monotonic()
            self.sync_latency.due(upload.round, now)
            if dropped is not None:
                self._queued_at.pop(upload_key(dropped), None)
                self.sync_latency.forget(dropped.round)
        self.counters.add("queued")
        if dropped is not None:
            self.counters.add("dropped_unsent")
            log.warning("unsent queue full: dropped round %d", dropped.round)
            self.unit_state.record("dropped_unsent")
        self._wake()

    def unsent(self) -> int:
        """Number of uploads not yet accepted by JetStream."""
        with self._lock:
            return len(self._queue)

    def finish(self, flush_timeout_s: float) -> None:
        """Publish what is queued for at most ``flush_timeout_s`` more, then end :meth:`run`
        (a publish still under way then is given up: the upload stays unsent)."""
        self._flush_deadline = time.monotonic() + flush_timeout_s
        self._stopping.set()
        loop, passed = self._loop, self._deadline_passed
        if loop is not None and passed is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended: nothing to end
                loop.call_soon_threadsafe(loop.call_later, flush_timeout_s, passed.set)
        self._wake()

    def _wake(self) -> None:
        loop, event = self._loop, self._queue_changed
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended: nothing to wake
                loop.call_soon_threadsafe(event.set)

    def _past_deadline(self) -> bool:
        return self._stopping.is_set() and time.monotonic() > self._flush_deadline

    # ---- the link's event loop -------------------------------------------------------------

    async def run(self, js: Any, chunk_size: int) -> None:
        """Publish the queue in order, in chunks of ``chunk_size`` bytes, until :meth:`finish`
        was called and the queue is empty or the flush deadline has passed."""
        self._loop = asyncio.get_running_loop()
        self._queue_changed = asyncio.Event()
        self._deadline_passed = asyncio.Event()
        while True:
            with self._lock:
                upload = self._queue[0] if self._queue else None
                self._in_flight = upload
            if upload is None:
                if self._stopping.is_set():
                    return
                self._queue_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._queue_changed.wait(), timeout=IDLE_WAIT_S)
                continue
            if self._past_deadline():
                log.warning("flush deadline passed with %d uploads unsent", self.unsent())
                return
            try:
                blob = await self.encoder.encoding(upload)
            except CodecError as err:
                # A pseudo-gradient with NaN/Inf must never be sent: record and skip it.
                self.counters.error(f"round {upload.round} not sent: {err}")
                log.error("round %d not sent: %s", upload.round, err)
                self.sync_latency.forget(upload.round)
                self._finish(upload, "rejected_local")
                continue
            with self._lock:
                following = self._queue[1] if len(self._queue) > 1 else None
            if following is not None:
                self.encoder.encoding(following)  # encoded while this one is being sent
            started = time.monotonic()
            try:
                published = await self._publish_before_deadline(js, upload, blob, chunk_size)
            except PUBLISH_ERRORS:
                published = False
            if not published:
                log.warning("flush deadline passed with %d uploads unsent", self.unsent())
                return
            self.publish_seconds.add(time.monotonic() - started)
            self.counters.add("bytes_sent", len(blob))
            self._finish(upload, "published")
            self.on_published(upload.fragment)

    async def _publish_before_deadline(
        self, js: Any, upload: Upload, blob: bytes, chunk_size: int
    ) -> bool:
        """Publish ``blob``; False when the flush deadline passed first (the publish is given
        up: a publish waiting on an unreachable server could otherwise hold the unit's exit
        for one more publish timeout)."""
        assert self._deadline_passed is not None
        publish = asyncio.ensure_future(self._publish(js, upload, blob, chunk_size))
        deadline = asyncio.ensure_future(self._deadline_passed.wait())
        try:
            await asyncio.wait({publish, deadline}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            deadline.cancel()
            if not publish.done():
                publish.cancel()
        await asyncio.gather(publish, return_exceptions=True)
        if publish.cancelled():
            return False
        publish.result()
        return True

    async def _publish(self, js: Any, upload: Upload, blob: bytes, chunk_size: int) -> None:
        """Publish ``blob`` until JetStream accepts it; raises once past the flush deadline."""
        name = upload_id(self.settings.job, self.settings.unit, upload.round, upload.fragment)
        await retry(
            lambda: publish_blob(
                js,
                subjects.grads_subject(self.settings.job, self.settings.unit, upload.fragment),
                blob,
                name,
                chunk_size,
            ),
            f"publish round {upload.round}",
            on=PUBLISH_ERRORS,
            stopping=self._past_deadline,
            on_error=self.counters.error,
        )

    def _finish(self, upload: Upload, counter: LifetimeCounter) -> None:
        with self._lock:
            if self._queue and self._queue[0] is upload:
                self._queue.popleft()
            self._in_flight = None
            if counter == "published":
                self.last_published_round = upload.round
            queued_at = self._queued_at.pop(upload_key(upload), None)
            live = {upload_key(u) for u in self._queue}
        if counter == "published" and queued_at is not None:
            self.upload_latency.add(time.monotonic() - queued_at)
        self.counters.add(counter)
        self.unit_state.record(counter, upload.round)
        # Forget this upload's envelope and those of uploads dropped from a full queue.
        self.encoder.keep_only(live)
