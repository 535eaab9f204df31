"""The learner's connection to the rest of the system, run on a background thread.

The training loop never waits for the network (DESIGN invariant 1). It hands finished
pseudo-gradients to :meth:`LearnerLink.submit` and polls :meth:`LearnerLink.take_new_params`
and :attr:`LearnerLink.desired_state` at step boundaries; all of those return at once. This
thread owns the NATS connection and does the slow parts: encoding, chunked publishing with
retries, fetching new global params, heartbeats and reading the desired state from KV.

Resilience: the first connection is retried until NATS is up (the unit trains meanwhile, with a
bounded queue of unsent uploads); after a lost connection nats-py reconnects on its own and the
JetStream/KV handles and the params subscription keep working, while every task here retries
its calls with backoff. The desired state starts from the one persisted in the unit's state file
(``services/learner/unit_state.py``), so a paused unit restarted while NATS is down stays paused.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import numpy as np

from services.learner.core import Upload
from services.learner.settings import LearnerSettings
from services.learner.unit_state import UnitState
from shared import codec, subjects, transport, wire
from shared.transport import TransportError

log = logging.getLogger(__name__)

PARAMS_POLL_S = 2.0  # fallback poll in case a head notification was missed while reconnecting
DESIRED_POLL_S = 0.5
RATES_POLL_S = 2.0
OUTER_STATUS_TIMEOUT_S = 2.0


@dataclass
class GlobalFragment:
    """A decoded global fragment."""

    fragment: int
    version: int
    pieces: dict[str, np.ndarray]


class LearnerLink:
    """Owns the NATS side of one learner unit on a daemon thread with its own event loop."""

    def __init__(
        self,
        settings: LearnerSettings,
        max_params_bytes: int,
        unit_state: UnitState | None = None,
    ) -> None:
        """Args:
        settings: the unit's settings.
        max_params_bytes: largest global params envelope accepted.
        unit_state: the unit's durable record (rounds, desired state, lifetime counters),
            shared with the training thread; an in-memory one if None.
        """
        self.settings = settings
        self.max_params_bytes = max_params_bytes
        self.unit_state = unit_state or UnitState(job=settings.job, unit=settings.unit)
        # The last desired state this unit knew (its state file), else --initial-state.
        self.desired_state = self.unit_state.desired if self.unit_state.loaded else None
        self.desired_state = self.desired_state or settings.initial_state
        # Set after the first read of the desired state; by then outer_next_round is known too.
        self.desired_known = threading.Event()
        # 1 + the last round of this unit the outer applied (from its status record; 0 if none).
        self.outer_next_round = 0
        self.restored_from_step: int | None = None
        self.connected = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_error = ""
        self._lock = threading.Lock()
        self._queue: collections.deque[Upload] = collections.deque()
        self._in_flight: Upload | None = None  # the head of the queue while it is being sent
        self._reconnected: asyncio.Event | None = None
        self._codec = settings.codec_config()
        self._codec_state = codec.CodecState()
        # With checkpoints and error feedback, a copy of the residual after each encoding, for
        # the training thread's snapshots (the live one is updated in place while encoding).
        self._keep_residual = settings.checkpoint_dir is not None and self._codec.error_feedback
        self._residual_copy: dict[str, np.ndarray] | None = None
        # Uploads are encoded once, in queue order, on one worker thread (the error-feedback
        # state is sequential); keyed by (round, fragment).
        self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._codec_ready: concurrent.futures.Future[None] | None = None
        self._encodings: dict[tuple[int, int], asyncio.Future[bytes]] = {}
        self._queue_changed: asyncio.Event | None = None
        self._newest: dict[int, GlobalFragment] = {}
        self._known_versions = [-1] * settings.fragments
        self.unit_rates: dict[int, float] = {}
        self._status: dict[str, Any] = {"state": "starting"}
        self._stopping = threading.Event()
        self._flush_deadline = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="learner-link", daemon=True)

    # ---- called from the training thread (all non-blocking) ----------------------------------

    def start(self) -> None:
        """Start the background thread, and the codec's compilation on the encoder thread;
        returns at once."""
        self._codec_ready = self._encoder.submit(codec.warm_up)
        self._thread.start()

    def wait_codec_ready(self) -> float:
        """Block until the codec kernels are compiled (or loaded from Numba's cache) on the
        encoder thread; return the seconds waited. Call after :meth:`start`.

        The training loop waits for this before its first step. Otherwise, with a cold Numba
        cache (the first run after an install: tens of seconds on 2 cores), a fast unit filled
        its ``max_unsent`` queue before anything could be encoded, and the oldest uploads,
        with the steps they carried, were dropped.

        Raises:
            Exception: whatever compiling the kernels raised.
        """
        assert self._codec_ready is not None, "start() first"
        started = time.monotonic()
        self._codec_ready.result()
        return time.monotonic() - started

    def restore_residual(self, residual: dict[str, np.ndarray] | None) -> None:
        """Continue error feedback from a checkpoint's residual (call before :meth:`start`)."""
        if not residual or not self._codec.error_feedback:
            return
        restored = {name: np.array(value, np.float32) for name, value in residual.items()}
        self._codec_state = codec.CodecState(residual=restored)
        if self._keep_residual:
            self._residual_copy = {name: value.copy() for name, value in restored.items()}

    def residual_copy(self) -> dict[str, np.ndarray] | None:
        """The error-feedback residual after the last finished encoding (a private copy that
        is never modified; None without checkpoints or error feedback).

        Uploads still queued are not in it yet: it may be an upload or so behind the core.
        """
        with self._lock:
            return self._residual_copy

    def count(self, name: str) -> None:
        """Increment one of this process's counters (thread-safe)."""
        with self._lock:
            self.counters[name] += 1

    def submit(self, upload: Upload) -> None:
        """Queue a pseudo-gradient for publishing; drops the oldest when the queue is full.

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
                    self.counters["dropped_unsent"] += 1
            self._queue.append(upload)
            self.counters["queued"] += 1
        if dropped is not None:
            log.warning("unsent queue full: dropped round %d", dropped.round)
            self.unit_state.record("dropped_unsent")
        self._wake_publisher()

    def take_new_params(self) -> list[GlobalFragment]:
        """Global fragments that arrived since the last call (newest version of each)."""
        with self._lock:
            arrived, self._newest = list(self._newest.values()), {}
        return arrived

    def set_status(self, **status: Any) -> None:
        """Replace the fields sent with the next heartbeat."""
        with self._lock:
            self._status.update(status)

    def unsent(self) -> int:
        """Number of pseudo-gradients not yet accepted by JetStream."""
        with self._lock:
            return len(self._queue)

    def stop(self, flush_timeout_s: float) -> None:
        """Publish what is queued (up to ``flush_timeout_s``), send a last heartbeat, close."""
        self._flush_deadline = time.monotonic() + flush_timeout_s
        self._stopping.set()
        self._wake_publisher()
        self._thread.join(timeout=flush_timeout_s + 8)

    def _wake_publisher(self) -> None:
        loop, event = self._loop, self._queue_changed
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    # ---- the background thread ---------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue_changed = asyncio.Event()
        self._reconnected = asyncio.Event()
        nc = await transport.connect_with_retry(
            self.settings,
            f"learner-{self.settings.job}-{self.settings.unit}",
            stopping=self._stopping.is_set,
            on_error=self._record_error,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
        )
        if nc is None:
            return
        self.connected = True
        js = nc.jetstream()
        # The connection may drop again at any point: every set-up call is retried.
        await self._retry_forever(lambda: transport.ensure_streams(js), "create streams")
        status_kv = await self._retry_forever(
            lambda: js.key_value(subjects.STATUS_BUCKET), "open status bucket"
        )
        desired_kv = await self._retry_forever(
            lambda: js.key_value(subjects.DESIRED_BUCKET), "open desired bucket"
        )
        # Before the first desired-state read (which sets desired_known), so that the training
        # thread's start-up wait covers both.
        self.outer_next_round = await self._read_outer_next_round(status_kv)
        head_seen = asyncio.Event()

        async def on_head(_msg: Any) -> None:
            head_seen.set()

        sub = await self._retry_forever(
            lambda: nc.subscribe(subjects.params_head_subject(self.settings.job, "*"), cb=on_head),
            "subscribe to params heads",
        )
        tasks = [
            asyncio.create_task(self._publisher(js)),
            asyncio.create_task(self._params_watcher(js, head_seen)),
            asyncio.create_task(self._desired_poller(desired_kv)),
            asyncio.create_task(self._heartbeat(status_kv)),
            asyncio.create_task(self._stream_keeper(js)),
        ]
        if self.settings.dynamic_h:
            tasks.append(asyncio.create_task(self._rates_poller(status_kv)))
        publisher = tasks[0]
        await publisher  # ends once stopping and the queue is flushed (or the deadline passed)
        # The last status first (its counters are final now), before anything that could wait:
        # the process may exit soon after (stop() joins this thread with a timeout).
        final_status = asyncio.create_task(
            transport.put_status(
                status_kv,
                subjects.unit_status_key(self.settings.job, self.settings.unit),
                self._status_record(),
            )
        )
        for task in tasks[1:]:
            task.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)
        self._encoder.shutdown(wait=False, cancel_futures=True)
        try:
            await asyncio.wait_for(final_status, timeout=5)
            await sub.unsubscribe()
            await asyncio.wait_for(nc.close(), timeout=5)
        except (TimeoutError, nats.errors.Error) as err:
            log.warning("closing NATS: %s", err)

    async def _stream_keeper(self, js: Any) -> None:
        """After every reconnect, create the streams and buckets again (idempotent).

        The JetStream and KV handles and the subscription survive nats-py's reconnects, but a
        server that came back with an empty store has neither streams nor buckets.
        """
        assert self._reconnected is not None
        while True:
            await self._reconnected.wait()
            self._reconnected.clear()
            await self._retry_forever(lambda: transport.ensure_streams(js), "re-create streams")

    async def _read_outer_next_round(self, status_kv: Any) -> int:
        """1 + the last round of this unit the outer has applied, from the outer's status
        record (0 when there is none or it cannot be read quickly)."""
        key = subjects.outer_status_key(self.settings.job)
        try:
            outer = await asyncio.wait_for(
                transport.get_json(status_kv, key), timeout=OUTER_STATUS_TIMEOUT_S
            )
        except (TimeoutError, nats.errors.Error, ValueError) as err:
            log.info("outer status not read: %r", err)
            return 0
        unit = ((outer or {}).get("units") or {}).get(str(self.settings.unit)) or {}
        last_round = unit.get("last_round") if isinstance(unit, dict) else None
        return last_round + 1 if isinstance(last_round, int) and last_round >= 0 else 0

    def _record_error(self, error: str) -> None:
        self.last_error = error

    async def _on_disconnect(self) -> None:
        self.connected = False

    async def _on_reconnect(self) -> None:
        self.connected = True
        if self._reconnected is not None:
            self._reconnected.set()

    async def _retry_forever(self, make_call: Callable[[], Any], what: str) -> Any:
        return await transport.retry_with_backoff(make_call, what, on_error=self._record_error)

    def _status_record(self) -> dict[str, Any]:
        durable = self.unit_state.record_dict()
        with self._lock:
            return {
                **self._status,
                "unit": self.settings.unit,
                "desired": self.desired_state,
                "unsent": len(self._queue),
                "counters": dict(self.counters),  # this process
                "lifetime": durable["lifetime"],  # across restarts (with a state file)
                "published_rounds": durable["published"],
                "next_round": durable["next_round"],
                "restored_from_step": self.restored_from_step,
                "last_error": self.last_error,
            }

    async def _publisher(self, js: Any) -> None:
        assert self._queue_changed is not None
        chunk_size = transport.chunk_size_for(js._nc)
        backoff = 0.5
        while True:
            with self._lock:
                upload = self._queue[0] if self._queue else None
                self._in_flight = upload
            if upload is None:
                if self._stopping.is_set():
                    return
                self._queue_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._queue_changed.wait(), timeout=1.0)
                continue
            if self._stopping.is_set() and time.monotonic() > self._flush_deadline:
                log.warning("flush deadline passed with %d uploads unsent", self.unsent())
                return
            try:
                blob = await self._encoding(upload)
                with self._lock:
                    following = self._queue[1] if len(self._queue) > 1 else None
                if following is not None:
                    self._encoding(following)  # encoded while this one is being sent
                upload_id = wire.upload_id(
                    self.settings.job, self.settings.unit, upload.round, upload.fragment
                )
                await transport.publish_blob(
                    js,
                    subjects.grads_subject(self.settings.job, self.settings.unit),
                    blob,
                    upload_id,
                    chunk_size,
                )
            except codec.CodecError as err:
                # A pseudo-gradient with NaN/Inf must never be sent: record and skip it.
                log.error("round %d not sent: %s", upload.round, err)
                self.last_error = f"round {upload.round} not sent: {err}"
                self._finish(upload, "rejected_local")
                continue
            except (TimeoutError, TransportError, nats.errors.Error) as err:
                self.last_error = f"publish round {upload.round}: {err}"
                log.warning("%s; retrying in %.1fs", self.last_error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(transport.RECONNECT_BACKOFF_MAX_S, backoff * 2)
                continue
            backoff = 0.5
            with self._lock:
                self.counters["bytes_sent"] += len(blob)
            self._finish(upload, "published")

    def _finish(self, upload: Upload, counter: str) -> None:
        with self._lock:
            if self._queue and self._queue[0] is upload:
                self._queue.popleft()
            self._in_flight = None
            self.counters[counter] += 1
            if counter == "published":
                self._status["last_published_round"] = upload.round
            live = {(u.round, u.fragment) for u in self._queue}
        self.unit_state.record(counter, upload.round)
        # Forget this upload's envelope and those of uploads dropped from a full queue.
        for key in [k for k in self._encodings if k not in live]:
            del self._encodings[key]

    def _encoding(self, upload: Upload) -> asyncio.Future[bytes]:
        """The (future) envelope of ``upload``, encoded once however often it is resent.

        Encoding advances the error-feedback state, so a retry must resend the same bytes
        (which also keeps the Nats-Msg-Id deduplication exact).
        """
        key = (upload.round, upload.fragment)
        future = self._encodings.get(key)
        if future is None:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(self._encoder, self._encode, upload)
            # A failed encoding of an upload that is dropped before it is awaited is not an
            # unhandled error: mark its exception as retrieved.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._encodings[key] = future
        return future

    def _encode(self, upload: Upload) -> bytes:
        # A fragment's residuals start at zero the first time it is sent.
        shapes = {name: np.shape(t) for name, t in upload.tensors.items()}
        state = codec.extend_state(self._codec, self._codec_state, shapes)
        try:
            if upload.values is not None and upload.layout is not None:
                payload, description, self._codec_state = codec.encode_flat(
                    upload.values, upload.layout, self._codec, state
                )
            else:
                payload, description, self._codec_state = codec.encode(
                    upload.tensors, self._codec, state
                )
        except codec.CodecError:
            # The state was consumed; residuals restart from zero.
            self._codec_state = codec.CodecState()
            raise
        residual_copy = (
            {name: value.copy() for name, value in self._codec_state.residual.items()}
            if self._keep_residual
            else None
        )
        with self._lock:
            if residual_copy is not None:
                self._residual_copy = residual_copy
            self.counters["fp32_bytes_encoded"] += 4 * sum(
                np.size(t) for t in upload.tensors.values()
            )
            self.counters["payload_bytes_encoded"] += len(payload)
        envelope = wire.Envelope(
            kind="pseudo_grad",
            job=self.settings.job,
            unit=self.settings.unit,
            round=upload.round,
            fragment=upload.fragment,
            base_version=upload.base_version,
            inner_steps=upload.inner_steps,
            tokens=upload.tokens,
            train_loss=upload.train_loss,
            codec=description,
            sent_at=time.time(),
            payload=payload,
            model=self.settings.model,
        )
        return wire.pack_envelope(envelope)

    async def _params_watcher(self, js: Any, head_seen: asyncio.Event) -> None:
        while True:
            for fragment in range(self.settings.fragments):
                try:
                    await self._fetch_fragment(js, fragment)
                except (wire.WireError, codec.CodecError) as err:
                    self.counters["params_rejected"] += 1
                    self.last_error = f"bad global params: {err}"
                    log.error(self.last_error)
                except (TransportError, TimeoutError, nats.errors.Error) as err:
                    log.info("params fetch: %r", err)
            head_seen.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(head_seen.wait(), timeout=PARAMS_POLL_S)

    async def _fetch_fragment(self, js: Any, fragment: int) -> None:
        job = self.settings.job
        head = await transport.read_params_head(js, job, fragment)
        if head is None or head["version"] <= self._known_versions[fragment]:
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
            self.counters["params_received"] += 1

    async def _rates_poller(self, status_kv: Any) -> None:
        """Read every unit's measured speed (for Dynamic Local Updates)."""
        while True:
            rates = {}
            for unit in range(self.settings.num_units):
                with contextlib.suppress(TimeoutError, nats.errors.Error, ValueError):
                    status = await transport.get_json(
                        status_kv, subjects.unit_status_key(self.settings.job, unit)
                    )
                    if status and status.get("state") == "running" and status.get("tokens_per_s"):
                        rates[unit] = float(status["tokens_per_s"])
            self.unit_rates = rates
            await asyncio.sleep(RATES_POLL_S)

    async def _desired_poller(self, desired_kv: Any) -> None:
        key = subjects.desired_key(self.settings.job, self.settings.unit)
        while True:
            try:
                desired = await transport.get_json(desired_kv, key)
                state = (desired or {}).get("state", self.settings.initial_state)
                if state in transport.DESIRED_STATES and state != self.desired_state:
                    log.info("desired state of unit %d: %s", self.settings.unit, state)
                    self.desired_state = state
                    self.unit_state.set_desired(state)  # remembered across restarts
                self.desired_known.set()
            except (TimeoutError, nats.errors.Error, ValueError) as err:
                log.info("desired-state poll: %r", err)
            await asyncio.sleep(DESIRED_POLL_S)

    async def _heartbeat(self, status_kv: Any) -> None:
        key = subjects.unit_status_key(self.settings.job, self.settings.unit)
        while True:
            try:
                await transport.put_status(status_kv, key, self._status_record())
            except (TimeoutError, nats.errors.Error) as err:
                log.info("heartbeat: %r", err)
            await asyncio.sleep(self.settings.status_interval_s)
