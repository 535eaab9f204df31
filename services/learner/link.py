"""The learner's connection to the rest of the system, run on a background thread.

The training loop never waits for the network (docs/ARCHITECTURE.md, "Life of one
pseudo-gradient"). It hands finished pseudo-gradients to :meth:`LearnerLink.submit` and polls
:meth:`LearnerLink.take_new_params` and :attr:`LearnerLink.desired_state` at step boundaries;
all of those return at once. The link's thread owns two NATS connections (one for the global
params, which would otherwise hold up every publish acknowledgement behind them on a slow
link; one for everything else) and runs the parts that do the slow work on its event loop:

* :class:`~services.learner.sender.Sender` — the upload queue and its publisher, with the
  :class:`~services.learner.encoder.UploadEncoder` (the codec and its error-feedback state);
* :class:`~services.learner.params_fetcher.ParamsFetcher` — the global params the unit adopts;
* :class:`~services.learner.unit_control.UnitControl` — desired state, the outer's next round,
  peers' speeds;
* :class:`~services.learner.heartbeat.Heartbeat` — the unit's status record.

Resilience: the first connection is retried until NATS is up (the unit trains meanwhile, with a
bounded queue of unsent uploads); after a lost connection nats-py reconnects on its own and the
JetStream/KV handles and the params subscription keep working, the streams and buckets are
created again (a server that came back with an empty store has none), and every part retries
or repeats its calls.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from services.learner.core import Upload
from services.learner.counters import Counters
from services.learner.encoder import UploadEncoder
from services.learner.heartbeat import Heartbeat
from services.learner.params_fetcher import GlobalFragment, ParamsFetcher
from services.learner.sender import Sender
from services.learner.settings import LearnerSettings
from services.learner.unit_control import UnitControl
from services.learner.unit_state import UnitState
from shared import subjects
from shared.cancel import raise_if_cancelling
from shared.latency import TimeSpent
from shared.records.jobs import DesiredState
from shared.retry import NATS_ERRORS, QUICK, retry
from shared.transport.blobs import chunk_size_for
from shared.transport.connection import connect_with_retry
from shared.transport.params import PARAMS_READ_TIMEOUT_S
from shared.transport.streams import prepare_streams
from shared.unit_counters import CounterName

log = logging.getLogger(__name__)

T = TypeVar("T")

CLOSE_TIMEOUT_S = 5.0
# The last heartbeat is retried for this long: it carries the unit's final books (the rounds it
# published), which the ledger balances against; in a broker failover the status bucket answers
# again once nats-server has elected its new leader (4-9 s, plus a campaign of up to 0.8 s).
FINAL_STATUS_S = 10.0
# Beyond the flush timeout: the last heartbeat, then closing both connections.
STOP_JOIN_SLACK_S = FINAL_STATUS_S + CLOSE_TIMEOUT_S + 1.0


class LearnerLink:
    """The NATS side of one learner unit, on a daemon thread with its own event loop.

    Attributes:
        counters: this process's counters and last error.
        training_wait: time the training thread spent in calls to the link.
        control: the unit's desired state, the outer's next round and peers' speeds.
        heartbeat: the unit's status record.
    """

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
        self.unit_state = unit_state or UnitState(job=settings.job, unit=settings.unit)
        self.counters = Counters()
        self.encoder = UploadEncoder(settings, self.counters)
        self.params = ParamsFetcher(settings, max_params_bytes, self.counters)
        self.sender = Sender(
            settings,
            self.unit_state,
            self.counters,
            self.encoder,
            on_published=self.params.want_after_upload,
            sync_latency=self.params.sync_latency,
        )
        self.control = UnitControl(settings, self.unit_state)
        self.heartbeat = Heartbeat(
            settings, self.unit_state, self.counters, self.sender, self.control, self.params
        )
        # Time the training thread spent in this facade's calls: they never wait for the
        # network, so it stays near zero (reported as network_wait_s).
        self.training_wait = TimeSpent()
        self._stopping = threading.Event()
        self._reconnected: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="learner-link", daemon=True)

    # ---- called from the training thread (all non-blocking) ----------------------------------

    def start(self) -> None:
        """Start the background thread, and the codec's compilation on the encoder thread;
        returns at once."""
        self.encoder.start()
        self._thread.start()

    def wait_codec_ready(self) -> float:
        """Block until the codec kernels are compiled (or loaded from Numba's cache) on the
        encoder thread; return the seconds waited. Call after :meth:`start`.

        The training loop waits for this before its first step: with a cold Numba cache (the
        first run after an install: tens of seconds on 2 cores), a fast unit would otherwise
        fill its ``max_unsent`` queue before anything can be encoded, and drop its oldest
        uploads with the steps they carry.

        Raises:
            Exception: whatever compiling the kernels raised.
        """
        return self.encoder.wait_ready()

    def restore_from(self, step: int, residual: dict[str, np.ndarray] | None) -> None:
        """Continue from a checkpoint taken at ``step``: error feedback goes on from its
        ``residual`` and the heartbeat reports the step (call before :meth:`start`)."""
        self.encoder.restore_residual(residual)
        self.heartbeat.restored_from_step = step

    def residual_copy(self) -> dict[str, np.ndarray] | None:
        """The error-feedback residual after the last finished encoding (a private copy that
        is never modified; None without checkpoints or error feedback).

        Uploads still queued are not in it yet: it may be an upload or so behind the core.
        """
        return self.encoder.residual_copy()

    def count(self, name: CounterName) -> None:
        """Increment one of this process's counters (thread-safe)."""
        self.counters.add(name)

    def submit(self, upload: Upload) -> None:
        """Queue a pseudo-gradient for publishing; drops the oldest when the queue is full."""
        with self.training_wait.measure():
            self.sender.submit(upload)

    def take_new_params(self, step: int = 0, h_steps: int = 1) -> list[GlobalFragment]:
        """Global fragments that arrived since the last call (newest version of each); ``step``
        and ``h_steps`` (the unit's step and sync period now) pace the fetches."""
        with self.training_wait.measure():
            return self.params.take_new(step, h_steps)

    def set_status(self, **status: Any) -> None:
        """Replace the training thread's fields (``UnitStatus`` names) in the next heartbeats."""
        with self.training_wait.measure():
            self.heartbeat.set_status(**status, network_wait_s=self.training_wait.seconds)

    def unsent(self) -> int:
        """Number of pseudo-gradients not yet accepted by JetStream."""
        return self.sender.unsent()

    def upload_seconds(self, uploads: int) -> float | None:
        """Seconds the last ``uploads`` accepted uploads held the link, together (None: fewer
        have been accepted)."""
        durations = self.sender.publish_seconds.values()
        return sum(durations[-uploads:]) if len(durations) >= uploads else None

    @property
    def desired_state(self) -> DesiredState:
        """What the unit should do now (``idle``, ``running``, ``paused`` or ``stopped``)."""
        return self.control.desired_state

    @property
    def desired_known(self) -> threading.Event:
        """Set once the desired state and the outer's next round have been read."""
        return self.control.desired_known

    @property
    def outer_next_round(self) -> int:
        """1 + the last round of this unit the outer applied (0 when none or not read yet)."""
        return self.control.outer_next_round

    @property
    def unit_rates(self) -> dict[int, float]:
        """Tokens/s of every running unit that reported a speed (for DyLU)."""
        return self.control.unit_rates

    def stop(self, flush_timeout_s: float) -> bool:
        """Publish what is queued (up to ``flush_timeout_s``; a publish under way then is given
        up), send a last heartbeat, close. Returns whether the NATS thread ended in time."""
        self.sender.finish(flush_timeout_s)
        self._stopping.set()
        self._thread.join(timeout=flush_timeout_s + STOP_JOIN_SLACK_S)
        return not self._thread.is_alive()

    # ---- the background thread ---------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._reconnected = asyncio.Event()
        nc = await connect_with_retry(
            self.settings,
            f"learner-{self.settings.job}-{self.settings.unit}",
            stopping=self._stopping.is_set,
            on_error=self.counters.error,
            reconnected_cb=self._on_reconnect,
        )
        if nc is None:
            return
        # Global params travel on a connection of their own: over a slow link a copy takes
        # seconds, and on one connection every publish acknowledgement would wait behind it.
        params_nc = await connect_with_retry(
            self.settings,
            f"learner-{self.settings.job}-{self.settings.unit}-params",
            stopping=self._stopping.is_set,
            on_error=self.counters.error,
            disconnected_cb=self.params.on_disconnected,
            reconnected_cb=self.params.on_reconnected,
        )
        if params_nc is None:
            await nc.close()
            return
        js = nc.jetstream()
        # The connection may drop again at any point: every set-up call is retried.
        await self._retry(lambda: prepare_streams(js, self.settings), "create streams")
        status_kv = await self._retry(
            lambda: js.key_value(subjects.STATUS_BUCKET), "open status bucket"
        )
        desired_kv = await self._retry(
            lambda: js.key_value(subjects.DESIRED_BUCKET), "open desired bucket"
        )
        # Before the first desired-state read (which sets desired_known), so that the training
        # thread's start-up wait covers both.
        self.control.outer_next_round = await self.control.read_outer_next_round(status_kv)
        await self.params.subscribe(nc, on_error=self.counters.error)
        publisher = asyncio.create_task(self.sender.run(js, chunk_size_for(nc)))
        others = [
            asyncio.create_task(
                self.params.run(params_nc.jetstream(timeout=PARAMS_READ_TIMEOUT_S), params_nc),
                name="params fetcher",
            ),
            asyncio.create_task(self.control.follow_desired(desired_kv, nc), name="desired state"),
            asyncio.create_task(self.heartbeat.run(status_kv), name="heartbeat"),
            asyncio.create_task(self._keep_streams(js), name="stream keeper"),
        ]
        if self.settings.dynamic_h:
            others.append(asyncio.create_task(self.control.poll_rates(status_kv), name="rates"))
        await publisher  # ends once stopping and the queue is flushed (or the deadline passed)
        # The last status first (its counters are final now), before anything that could wait:
        # the process may exit soon after (stop() joins this thread with a timeout).
        final_status = asyncio.create_task(
            retry(
                lambda: asyncio.wait_for(self.heartbeat.put(status_kv), CLOSE_TIMEOUT_S),
                "the last heartbeat",
                within_s=FINAL_STATUS_S,
                backoff=QUICK,
            )
        )
        await _cancel_all(others)
        self.encoder.shutdown()
        try:
            await final_status
        except NATS_ERRORS as err:
            log.warning("the last heartbeat: %s", err)
        closing = asyncio.gather(self.params.close(), params_nc.close(), nc.close())
        try:
            await asyncio.wait_for(closing, timeout=CLOSE_TIMEOUT_S)
        except NATS_ERRORS as err:
            log.warning("closing NATS: %s", err)

    async def _keep_streams(self, js: Any) -> None:
        """After every reconnect, create the streams and buckets again (idempotent).

        The JetStream and KV handles and the subscription survive nats-py's reconnects, but a
        server that came back with an empty store has neither streams nor buckets.
        """
        assert self._reconnected is not None
        while True:
            raise_if_cancelling()
            await self._reconnected.wait()
            self._reconnected.clear()
            await self._retry(lambda: prepare_streams(js, self.settings), "re-create streams")

    async def _on_reconnect(self) -> None:
        if self._reconnected is not None:
            self._reconnected.set()

    async def _retry(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        return await retry(call, what, on_error=self.counters.error)


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait up to ``CLOSE_TIMEOUT_S`` for them to end; log the stack of
    any that goes on (one that swallowed its cancel), which is then left to the thread's end."""
    for task in tasks:
        task.cancel()
    _, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
    for task in pending:
        stack = io.StringIO()
        task.print_stack(file=stack)
        log.warning("%s did not end when cancelled:\n%s", task.get_name(), stack.getvalue())
