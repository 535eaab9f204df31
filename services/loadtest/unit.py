"""A synthetic learner unit: the uploads and params reads of a learner, without training.

Every ``upload_every_s`` (from a random phase) a unit reaches a sync point and queues an upload
of one of the pre-encoded pseudo-gradients (``payloads.py``) with its round, base version and
token count, as a real learner does; a publisher task sends the queue in order as chunked
envelopes (``shared.transport.publish_blob``), retrying a failed publish with the same bytes,
and a full queue drops its oldest upload. With P fragments, round r uploads fragment r mod P,
and the sync points come P times as often (a staggered learner's uploads: the same bytes per
period). A unit subscribes to the params heads: a head of fragment p whose ``applied`` round
for this unit reaches an upload of p's round ends that upload's *sync latency* (sync point →
first global params that include it). With ``params_fetch="newest"`` it fetches a fragment's
newest params whenever a newer version is announced and no fetch is under way, as a learner
does, and uploads against the version it fetched.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from services.loadtest.payloads import PayloadPool
from shared import records, subjects
from shared.latency import SyncLatency
from shared.ledger import RoundSet
from shared.records.outer import ParamsHead
from shared.retry import NATS_ERRORS, retry
from shared.settings.nats import NatsSettings
from shared.transport import TransportError
from shared.transport.blobs import chunk_size_for, publish_blob
from shared.transport.connection import connect
from shared.transport.params import PARAMS_READ_TIMEOUT_S, read_latest_params
from shared.wire.chunks import WireError, upload_id
from shared.wire.envelope import PseudoGradEnvelope, pack_envelope

log = logging.getLogger(__name__)

KEPT_LATENCIES = 1 << 20  # every sync latency of a stage is kept
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class UnitPlan:
    """What one synthetic unit sends.

    Attributes:
        job, model: the job and model size its uploads name.
        unit: its index.
        upload_every_s: seconds between its sync points of one fragment.
        fragments: the fragments it uploads in turn (P).
        inner_steps, tokens: the work each upload claims (H, and H × batch × sequence length).
        fetch_params: whether it fetches the params it would adopt.
        max_unsent: uploads queued before the oldest is dropped.
        max_params_bytes: largest params envelope it reads.
    """

    job: str
    model: str
    unit: int
    upload_every_s: float
    fragments: int
    inner_steps: int
    tokens: int
    fetch_params: bool
    max_unsent: int
    max_params_bytes: int


@dataclass
class UnitTally:
    """What one unit did and measured (read by the stage after the unit stopped)."""

    published: RoundSet = field(default_factory=RoundSet)
    dropped_unsent: int = 0
    params_bytes: int = 0
    heads_rejected: int = 0  # malformed params heads (also in shared.records.rejections)
    syncs: dict[int, SyncLatency] = field(default_factory=dict)  # per fragment

    def sync(self, fragment: int) -> SyncLatency:
        """The sync latencies of one fragment's uploads."""
        if fragment not in self.syncs:
            self.syncs[fragment] = SyncLatency(KEPT_LATENCIES, max_pending=KEPT_LATENCIES)
        return self.syncs[fragment]

    def sync_pending(self) -> int:
        """Uploads whose sync has not ended yet."""
        return sum(sync.pending() for sync in self.syncs.values())


class SyntheticUnit:
    """One synthetic unit on its own NATS connection (see the module docstring)."""

    def __init__(self, plan: UnitPlan, pools: list[PayloadPool], rng: random.Random) -> None:
        """Args:
        plan: what it sends.
        pools: the pre-encoded pseudo-gradients of each fragment.
        rng: its random phase.
        """
        self.plan = plan
        self.pools = pools
        self.rng = rng
        self.tally = UnitTally()
        self._queue: collections.deque[int] = collections.deque()
        self._queue_changed = asyncio.Event()
        self.next_round = 0  # the first round number never handed out
        fragments = range(plan.fragments)
        self._base_version = dict.fromkeys(fragments, 0)  # what uploads are computed against
        self._fetched = dict.fromkeys(fragments, -1)  # the newest version fetched
        self._newest_head = dict.fromkeys(fragments, -1)
        self._head_seen = asyncio.Event()
        self._last_fetch = -1  # the fragment fetched last
        self._producing = True

    def fragment(self, round_: int) -> int:
        """The fragment a round uploads."""
        return round_ % self.plan.fragments

    def unsent(self) -> int:
        """Uploads queued and not yet accepted by JetStream."""
        return len(self._queue)

    def stop_producing(self) -> None:
        """No more sync points: what is queued is still sent."""
        self._producing = False
        self._queue_changed.set()

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        """Upload and fetch until ``stop`` is set (after :meth:`stop_producing` and the queue
        is sent, or at once on a stop of the whole load test)."""
        nc = await connect(
            NatsSettings(nats_url=nats_url), f"loadtest-{self.plan.job}-{self.plan.unit}"
        )
        try:
            js = nc.jetstream(timeout=PARAMS_READ_TIMEOUT_S)
            await nc.subscribe(subjects.params_head_subject(self.plan.job, "*"), cb=self._on_head)
            tasks = [
                asyncio.create_task(self._produce(stop)),
                asyncio.create_task(self._publish(js, chunk_size_for(nc), stop)),
            ]
            if self.plan.fetch_params:
                tasks.append(asyncio.create_task(self._fetch(js, stop)))
            await stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            with contextlib.suppress(*NATS_ERRORS, TimeoutError):
                await asyncio.wait_for(nc.close(), CLOSE_TIMEOUT_S)

    # ---- sync points and uploads -----------------------------------------------------------

    async def _produce(self, stop: asyncio.Event) -> None:
        # Units start at random phases, as independent units would.
        every_s = self.plan.upload_every_s / self.plan.fragments
        await asyncio.sleep(self.rng.uniform(0, every_s))
        while self._producing and not stop.is_set():
            round_ = self.next_round
            self.next_round += 1
            self.tally.sync(self.fragment(round_)).due(round_, time.monotonic())
            if len(self._queue) >= self.plan.max_unsent:
                # Never the head: it may be being sent.
                dropped = self._queue[1] if len(self._queue) > 1 else None
                if dropped is not None:
                    self._queue.remove(dropped)
                    self.tally.sync(self.fragment(dropped)).forget(dropped)
                    self.tally.dropped_unsent += 1
            self._queue.append(round_)
            self._queue_changed.set()
            await asyncio.sleep(every_s)

    async def _publish(self, js: Any, chunk_size: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not self._queue:
                self._queue_changed.clear()
                await self._queue_changed.wait()
                continue
            round_ = self._queue[0]
            fragment = self.fragment(round_)
            blob = self._envelope(round_)
            upload = upload_id(self.plan.job, self.plan.unit, round_, fragment)
            subject = subjects.grads_subject(self.plan.job, self.plan.unit, fragment)
            await retry(
                lambda blob=blob, upload=upload, subject=subject: publish_blob(
                    js, subject, blob, upload, chunk_size
                ),
                f"publish round {round_}",
                on=(TransportError, TimeoutError, *NATS_ERRORS),
                stopping=stop.is_set,
            )
            self._queue.popleft()
            self.tally.published.add(round_)

    def _envelope(self, round_: int) -> bytes:
        fragment = self.fragment(round_)
        payload, description = self.pools[fragment].take()
        envelope = PseudoGradEnvelope(
            job=self.plan.job,
            unit=self.plan.unit,
            round=round_,
            fragment=fragment,
            base_version=self._base_version[fragment],
            inner_steps=self.plan.inner_steps,
            tokens=self.plan.tokens,
            train_loss=0.0,
            codec=description,
            sent_at=time.time(),
            payload=payload,
            model=self.plan.model,
        )
        return pack_envelope(envelope)

    # ---- params ----------------------------------------------------------------------------

    async def _on_head(self, msg: Any) -> None:
        head = records.decode(ParamsHead, msg.data, msg.subject)
        fragment = subjects.fragment_of_params_head(self.plan.job, msg.subject)
        if head is None or fragment is None or fragment >= self.plan.fragments:
            self.tally.heads_rejected += 1
            return
        applied = head.applied.get(self.plan.unit, -1)
        self.tally.sync(fragment).applied(applied, time.monotonic())
        if head.version > self._newest_head[fragment]:
            self._newest_head[fragment] = head.version
            if not self.plan.fetch_params:
                self._base_version[fragment] = head.version  # adopted at once, as if fetched
            self._head_seen.set()

    async def _fetch(self, js: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._head_seen.wait()
            self._head_seen.clear()
            behind = [p for p, newest in self._newest_head.items() if newest > self._fetched[p]]
            if not behind:
                continue
            # In turn, from the one after the last fetched: no fragment waits behind another.
            fragment = min(behind, key=lambda p: (p - self._last_fetch - 1) % self.plan.fragments)
            self._last_fetch = fragment
            if len(behind) > 1:
                self._head_seen.set()  # the others next
            try:
                fetched = await read_latest_params(
                    js, self.plan.job, fragment, self.plan.max_params_bytes
                )
            except (TransportError, WireError, *NATS_ERRORS) as err:
                log.info("unit %d: params fetch: %r", self.plan.unit, err)
                self._head_seen.set()  # try again on the next head, or now if one is newer
                await asyncio.sleep(0.5)
                continue
            if fetched is not None:
                head, blob = fetched
                self.tally.params_bytes += len(blob)
                self._fetched[fragment] = max(self._fetched[fragment], head.version)
                self._base_version[fragment] = self._fetched[fragment]
