"""Fetching the global params a learner adopts.

The outer publishes each fragment's params as chunks plus a small head message
(``shared.records.ParamsHead``) on ``diloco.J.params.<p>.head``, a new version after every
merge. Two policies (``--params-fetch``):

* ``newest`` (the default): whenever a version newer than the last one fetched is announced
  and no fetch is under way, fetch the newest. Over a fast link that is every version; over a
  slow one, versions published while a copy crosses it are skipped. Adopting every version
  keeps a unit's base fresh, which the quality benchmark shows matters (BENCHMARKS.md,
  "Quality: downlink").
* ``after_upload``: fragment p once at start and then once after each upload of p that
  JetStream accepted (:meth:`ParamsFetcher.want_after_upload`): the first version published
  after that moment. One copy per sync period, not one per merge of any unit, at the cost of
  staler params.

Which versions are wanted is :class:`~services.learner.fetch_rule.FetchRule`'s to say.

How a wanted version comes (``--params-downlink``): ``copy`` reads the global copy;
``delta`` asks the outer for a delta against the copy this unit holds (shared/downlink.py,
``shared.transport.downlink``), checks that it applies to exactly that copy (version and
checksum) and that the result has the checksum the outer recorded, and reads the global copy
(the keyframe) when the outer says so, does not answer, or a check fails (counted in
``params_delta_rejected``).

It subscribes to the heads of its job as notifications and also looks every
``PARAMS_POLL_S`` (a notification may be missed while reconnecting); a fetched version waits
until the training thread takes it at a step boundary (:meth:`ParamsFetcher.take_new`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from services.learner.counters import Counters
from services.learner.fetch_rule import FetchRule
from services.learner.settings import LearnerSettings
from shared import records, subjects
from shared.cancel import raise_if_cancelling
from shared.codec import api as codec
from shared.codec.config import CodecError
from shared.downlink import Held, reconstruct
from shared.latency import Latencies, SyncLatency
from shared.records.outer import DownlinkReply, DownlinkWant, ParamsHead
from shared.retry import NATS_ERRORS, retry
from shared.transport import TransportError
from shared.transport.downlink import read_delta, request_delta
from shared.transport.params import read_latest_params, read_params_head
from shared.wire.chunks import WireError
from shared.wire.envelope import ParamsEnvelope, payload_checksum, unpack_envelope

log = logging.getLogger(__name__)

PARAMS_POLL_S = 2.0  # fallback poll in case a head notification was missed while reconnecting


@dataclass
class GlobalFragment:
    """A decoded global fragment, and when its head was first seen (monotonic seconds).

    Attributes:
        applied_round: the newest round of this unit the outer had applied when it published
            this version (-1: none), from its head.
        rewind: the newest version published is lower than the one fetched before: that one
            was not the job's global (a forged or broken head), so this one replaces it.
    """

    fragment: int
    version: int
    pieces: dict[str, np.ndarray]
    seen_at: float
    applied_round: int = -1
    rewind: bool = False


@dataclass(frozen=True)
class _Fetched:
    version: int
    pieces: dict[str, np.ndarray]
    applied_round: int


class DeltaRejected(ValueError):
    """A params delta that does not apply to the copy this unit holds, or whose result is not
    what the outer recorded."""


class ParamsFetcher:
    """Keeps the newest global version of every fragment not yet taken by the training thread."""

    def __init__(
        self, settings: LearnerSettings, max_params_bytes: int, counters: Counters
    ) -> None:
        """Args:
        settings: the unit's settings (job, fragments).
        max_params_bytes: largest global params envelope accepted.
        counters: where ``params_received``, ``params_rejected`` and ``params_read_failed``
            (NATS unreachable, or a read outrun by newer versions) are counted.
        """
        self.settings = settings
        self.max_params_bytes = max_params_bytes
        self.counters = counters
        self._lock = threading.Lock()
        self._newest: dict[int, GlobalFragment] = {}
        self._known_versions = [-1] * settings.fragments
        # In sync mode a unit waits at each sync point for the round's version: nothing is
        # paced, as a paced fetch could start only after the wait gave up.
        paced = settings.params_fetches_per_period if settings.mode == "decoupled" else 0
        self.rule = FetchRule(settings.params_fetch, settings.fragments, paced, settings.h_steps)
        self._loop: asyncio.AbstractEventLoop | None = None  # run()'s, woken by take_new()
        self._head_versions = [-1] * settings.fragments  # the latest head seen
        self._head_seen_at = [0.0] * settings.fragments  # when that head was first seen
        # The upload id of the last head whose params were rejected (not read again).
        self._rejected: list[str | None] = [None] * settings.fragments
        self.params_latency = Latencies()
        # Each upload's sync point → the first head that includes it (the sender marks the
        # sync points; the heads end them).
        self.sync_latency = SyncLatency()
        self._head_seen: asyncio.Event | None = None
        self._subscription: Any = None
        self._fetching: asyncio.Future[None] | None = None  # the read under way
        self._connected = True  # whether the params connection is up (no read starts if not)
        self._nc: Any = None  # the params connection, for the delta downlink's requests
        # With --params-downlink delta: per fragment, the copy this unit holds exactly as the
        # outer recorded it (what the deltas apply to).
        self.held: list[Held | None] = [None] * settings.fragments

    def take_new(self, step: int = 0, h_steps: int = 1) -> list[GlobalFragment]:
        """Global fragments fetched since the last call (the newest version of each);
        thread-safe, returns at once. Each one's time from its head's notification to now is
        recorded in :attr:`params_latency`. ``step`` and ``h_steps``: where the unit is and
        its sync period now, which pace the fetches (``params_fetches_per_period``)."""
        with self._lock:
            arrived, self._newest = list(self._newest.values()), {}
            opened = self.rule.at_step(step, h_steps)
        if opened and self._loop is not None and self._head_seen is not None:
            self._loop.call_soon_threadsafe(self._head_seen.set)
        now = time.monotonic()
        for fragment in arrived:
            self.params_latency.add(now - fragment.seen_at)
        return arrived

    def head_version(self, fragment: int) -> int:
        """The version of the latest params head of ``fragment`` seen (-1: none yet)."""
        return self._head_versions[fragment]

    def want_after_upload(self, fragment: int) -> None:
        """With ``after_upload``: fetch ``fragment`` once more, its first version published
        after now (the merge that applies the upload JetStream just accepted, or a later one).
        Call on the link's event loop."""
        self.rule.uploaded(fragment, self._head_versions[fragment])
        if self._head_seen is not None:
            self._head_seen.set()

    async def subscribe(self, nc: Any, on_error: Callable[[str], None] | None = None) -> None:
        """Subscribe to the job's params heads (retried until it works; each failure is told
        to ``on_error``)."""
        head_seen = self._head_seen = asyncio.Event()

        async def on_head(msg: Any) -> None:
            fragment = subjects.fragment_of_params_head(self.settings.job, msg.subject)
            head = records.decode(ParamsHead, msg.data, msg.subject)
            if fragment is not None and fragment < self.settings.fragments and head is not None:
                self._note_head(fragment, head.version)
                applied = head.applied.get(self.settings.unit, -1)
                self.sync_latency.applied(applied, time.monotonic())
            head_seen.set()

        self._subscription = await retry(
            lambda: nc.subscribe(subjects.params_head_subject(self.settings.job, "*"), cb=on_head),
            "subscribe to params heads",
            on_error=on_error,
        )

    async def run(self, js: Any, nc: Any = None) -> None:
        """Fetch every fragment whose head is newer, after each notification or poll (forever).
        ``nc``: the connection of ``js``, which the delta downlink sends its requests on."""
        self._nc = nc
        self._loop = asyncio.get_running_loop()
        head_seen = self._head_seen = self._head_seen or asyncio.Event()
        while True:
            # Cleared before the pass: a head (or a step that ends a pause) seen during it
            # makes the wait below return at once.
            head_seen.clear()
            for fragment in range(self.settings.fragments if self._connected else 0):
                self._fetching = asyncio.ensure_future(self._fetch(js, fragment))
                try:
                    await self._fetching
                except (WireError, CodecError) as err:
                    self.counters.add("params_rejected")
                    self.counters.error(f"bad global params: {err}")
                    log.error("bad global params: %s", err)
                except (TransportError, *NATS_ERRORS) as err:
                    self.counters.add("params_read_failed")
                    log.info("params fetch: %r", err)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # this loop itself is being cancelled
                    self.counters.add("params_read_failed")  # given up: the connection dropped
                    log.info("params fetch given up: the connection dropped")
                finally:
                    self._fetching = None
                raise_if_cancelling()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(head_seen.wait(), timeout=PARAMS_POLL_S)
            raise_if_cancelling()

    async def on_disconnected(self) -> None:
        """The params connection dropped: a read under way, or started before it is back,
        waits for replies that never come (nats-py keeps a request waiting out its timeout,
        which allows for a whole chunk over the slowest link). So the read under way is given
        up, and none starts until :meth:`on_reconnected`."""
        self._connected = False
        fetching = self._fetching
        if fetching is not None and not fetching.done():
            fetching.cancel()

    async def on_reconnected(self) -> None:
        """The params connection is back: read at once."""
        self._connected = True
        if self._head_seen is not None:
            self._head_seen.set()

    def _note_head(self, fragment: int, version: int) -> None:
        # The latest head, not the highest: a forged huge version must not outlive the next
        # genuine head.
        if version != self._head_versions[fragment]:
            self._head_versions[fragment] = version
            self._head_seen_at[fragment] = time.monotonic()

    async def close(self) -> None:
        """Unsubscribe from the heads (if subscribed)."""
        if self._subscription is not None:
            await self._subscription.unsubscribe()

    async def _fetch(self, js: Any, fragment: int) -> None:
        with self._lock:
            wanted = self.rule.wanted(fragment) if self.rule.due(fragment) else None
        if wanted is None:
            return
        job = self.settings.job
        head = await read_params_head(js, job, fragment)
        if head is None:
            return
        self._note_head(fragment, head.version)
        # The newest head published is the truth: a version above it that this unit fetched
        # (or waits for) came from a head that is gone, so it is dropped, not waited for.
        bar = wanted if wanted <= head.version else head.version - 1
        rewind = head.version < self._known_versions[fragment]
        if head.version <= max(bar, self._known_versions[fragment]) and not rewind:
            return
        if head.upload == self._rejected[fragment]:
            return  # read and rejected already: wait for the next head
        with self._lock:
            self.rule.started(fragment)
        fetched: _Fetched | Literal["copy", "none"] = "copy"
        if self.settings.params_downlink == "delta" and self._nc is not None:
            fetched = await self._fetch_delta(js, fragment, head)
        if fetched == "copy":
            fetched = await self._fetch_copy(js, fragment)
        if not isinstance(fetched, _Fetched):
            return
        version = fetched.version
        seen_at = self._head_seen_at[fragment] if version == self._head_versions[fragment] else 0
        global_fragment = GlobalFragment(
            fragment,
            version,
            fetched.pieces,
            seen_at or time.monotonic(),
            fetched.applied_round,
            rewind=version < self._known_versions[fragment],
        )
        with self._lock:
            self._newest[fragment] = global_fragment
            self._known_versions[fragment] = version
        self.rule.fetched(fragment, wanted)
        self.counters.add("params_received")

    async def _fetch_copy(self, js: Any, fragment: int) -> _Fetched | Literal["none"]:
        """Read the global copy (the keyframe of the delta downlink)."""
        job = self.settings.job
        fetched = await read_latest_params(js, job, fragment, self.max_params_bytes)
        if fetched is None:
            return "none"
        fetched_head, blob = fetched
        self._rejected[fragment] = fetched_head.upload  # until it proves good below
        self.counters.add("params_bytes_received", len(blob))
        version = fetched_head.version
        envelope = self._unpack(blob, fragment, version)
        pieces = codec.decode_tensors(envelope.payload, envelope.codec)
        self._rejected[fragment] = None
        if self.settings.params_downlink == "delta":
            self.held[fragment] = _held(version, pieces)
        return _Fetched(version, pieces, fetched_head.applied.get(self.settings.unit, -1))

    async def _fetch_delta(
        self, js: Any, fragment: int, head: ParamsHead
    ) -> _Fetched | Literal["copy", "none"]:
        """Ask the outer for a delta from the copy held and apply it; ``copy``: read the
        global copy instead, ``none``: nothing newer to read."""
        job, unit = self.settings.job, self.settings.unit
        held = self.held[fragment]
        want = DownlinkWant(
            fragment=fragment,
            held_version=-1 if held is None else held.version,
            held_checksum=0 if held is None else held.checksum,
        )
        try:
            reply = await request_delta(self._nc, job, unit, want)
        except TransportError as err:
            log.info("no params delta (%s): reading the global copy", err)
            return "copy"
        if reply.kind == "keyframe":
            return "copy"
        if reply.kind == "current":
            return "none"
        try:
            pieces = await self._apply_delta(js, fragment, held, reply)
        except TransportError as err:
            log.info("params delta unreadable (%s): reading the global copy", err)
            return "copy"
        except (DeltaRejected, WireError, CodecError) as err:
            self.held[fragment] = None
            self.counters.add("params_delta_rejected")
            self.counters.error(f"params delta rejected: {err}")
            log.warning("params delta rejected (%s): reading the global copy", err)
            return "copy"
        self.counters.add("params_deltas_received")
        # A version at or above the head's includes at least what the head says was applied.
        applied = head.applied.get(unit, -1) if reply.version >= head.version else -1
        return _Fetched(reply.version, pieces, applied)

    async def _apply_delta(
        self, js: Any, fragment: int, held: Held | None, reply: DownlinkReply
    ) -> dict[str, np.ndarray]:
        if held is None or (reply.base_version, reply.base_checksum) != (
            held.version,
            held.checksum,
        ):
            base = "nothing" if held is None else f"version {held.version} ({held.checksum:x})"
            raise DeltaRejected(
                f"base mismatch: a delta from version {reply.base_version} "
                f"({reply.base_checksum:x}), this unit holds {base}"
            )
        job, unit = self.settings.job, self.settings.unit
        blob = await read_delta(js, job, unit, fragment, reply, self.max_params_bytes)
        self.counters.add("params_bytes_received", len(blob))
        envelope = self._unpack(blob, fragment, reply.version)
        if payload_checksum(envelope.payload) != reply.payload_checksum:
            raise DeltaRejected(f"delta {reply.upload}: payload checksum mismatch")
        result = _held(reply.version, reconstruct(held.pieces, envelope.payload, envelope.codec))
        if result.checksum != reply.checksum:
            raise DeltaRejected(
                f"result mismatch: version {reply.version} reconstructed as "
                f"{result.checksum:x}, the outer recorded {reply.checksum:x}"
            )
        self.held[fragment] = result
        return result.pieces

    def _unpack(self, blob: bytes, fragment: int, version: int) -> ParamsEnvelope:
        job = self.settings.job
        envelope = unpack_envelope(blob, max_size=self.max_params_bytes)
        if (
            not isinstance(envelope, ParamsEnvelope)
            or envelope.fragment != fragment
            or envelope.job != job
        ):
            raise WireError(f"expected params of {job} fragment {fragment}")
        if envelope.model != self.settings.model or envelope.version != version:
            raise WireError(
                f"params of model {envelope.model} version {envelope.version} under a head of "
                f"version {version} (this unit trains model {self.settings.model})"
            )
        return envelope


def _held(version: int, pieces: dict[str, np.ndarray]) -> Held:
    """A copy held for the delta downlink: read-only, so that nothing changes it in place."""
    for piece in pieces.values():
        piece.setflags(write=False)
    return Held.of(version, pieces)
