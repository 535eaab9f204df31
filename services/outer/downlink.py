"""The outer's side of the delta downlink (``--params-downlink delta``; shared/downlink.py).

The leader answers the units' wants (``shared.transport.downlink``): per fragment a
:class:`~shared.downlink.DownlinkSender` holds the newest committed version and, per unit, the
copies the unit may hold. A delta is published on the unit's own downlink subjects before the
reply names it; asking again from the same copy gets the same reply, without publishing again.
The records live in memory only: after a restart or a failover every unit gets a keyframe
(the global copy) first, then deltas against it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shared import records, subjects
from shared.codec.config import CodecError
from shared.downlink import Answer, Current, Delta, DownlinkSender, Keyframe
from shared.records.outer import DownlinkCounts, DownlinkReply, DownlinkWant
from shared.retry import NATS_ERRORS
from shared.transport import TransportError
from shared.transport.downlink import publish_delta
from shared.wire.chunks import upload_id
from shared.wire.envelope import ParamsEnvelope, pack_envelope, payload_checksum, unpack_envelope

log = logging.getLogger(__name__)


def delta_envelope(job: str, model: str, fragment: int, delta: Delta) -> bytes:
    """A delta as the packed ``params`` envelope a unit reads (``version``: the result's)."""
    envelope = ParamsEnvelope(
        job=job,
        model=model,
        fragment=fragment,
        version=delta.version,
        tokens=0,
        codec=delta.description,
        sent_at=time.time(),
        payload=delta.payload,
    )
    return pack_envelope(envelope)


class DownlinkServer:
    """Answers the wants of one job's units, fragment by fragment."""

    def __init__(
        self,
        job: str,
        model: str,
        fragments: int,
        delta_codec: str,
        chunk_size: int,
        max_params_bytes: int,
    ) -> None:
        self.job, self.model = job, model
        self.chunk_size = chunk_size
        self.max_params_bytes = max_params_bytes
        self.senders = [DownlinkSender(delta_codec) for _ in range(fragments)]
        # Per (unit, fragment): the last delta published and the reply that names it.
        self._replies: dict[tuple[int, int], tuple[Delta, DownlinkReply]] = {}
        # Upload ids of deltas: unique across restarts, as JetStream deduplicates by them.
        self._serial = time.time_ns()
        # Per fragment, one want (or new version) at a time in its sender (computed in a thread).
        self._locks = [asyncio.Lock() for _ in range(fragments)]
        self.answered: dict[str, int] = {"delta": 0, "keyframe": 0, "current": 0}
        self.delta_bytes = 0

    def counts(self) -> DownlinkCounts:
        """The answers given so far, for the outer's status record."""
        return DownlinkCounts(**self.answered, delta_bytes=self.delta_bytes)

    async def published(
        self, fragment: int, version: int, params: Mapping[str, Any], blob: bytes
    ) -> None:
        """``version`` of ``fragment`` is committed and published as the global copy ``blob``
        (a packed params envelope, the keyframe)."""
        envelope = unpack_envelope(blob, max_size=self.max_params_bytes)
        assert isinstance(envelope, ParamsEnvelope)
        exact = {name: np.asarray(value) for name, value in params.items()}
        async with self._locks[fragment]:
            await asyncio.to_thread(
                self.senders[fragment].published,
                version,
                exact,
                envelope.payload,
                envelope.codec,
            )

    async def subscribe(self, nc: Any, js: Any, fragments: Sequence[int]) -> list[Any]:
        """Serve the wants of ``fragments`` (an outer shard's) on ``nc``, publishing deltas
        through ``js``; returns the subscriptions."""

        async def on_want(msg: Any) -> None:
            try:
                await self.answer(js, msg, lambda: nc.stats["reconnects"])
            except (TransportError, *NATS_ERRORS) as err:
                log.info("params want on %s not answered: %r", msg.subject, err)

        every = sorted(fragments) == list(range(len(self.senders)))
        filters = ["*"] if every else sorted(fragments)
        return [
            await nc.subscribe(subjects.want_subject(self.job, "*", p), cb=on_want) for p in filters
        ]

    async def answer(self, js: Any, msg: Any, reconnects: Callable[[], int] = lambda: 0) -> None:
        """Answer one want message (a malformed one, or one for an unknown fragment, is
        ignored: its sender times out and reads the global copy).

        ``reconnects`` counts the connection's reconnects: a want that came before one is not
        answered. nats-server lets the outer publish one reply to a request it delivered
        (``allow_responses``), and a restarted server does not know the requests the old one
        delivered: the reply would be a publish violation. The unit asks again. (A want still
        queued for this callback when the connection dropped is read after the reconnect and
        answered; the new server refuses that reply, and the unit asks again too.)"""
        received = reconnects()
        named = subjects.unit_of_want(self.job, msg.subject)
        want = records.decode(DownlinkWant, msg.data, msg.subject)
        if named is None or want is None or want.fragment != named[1] or not msg.reply:
            return
        unit = named[0]
        if want.fragment >= len(self.senders):
            return
        sender = self.senders[want.fragment]
        async with self._locks[want.fragment]:
            if sender.version < 0:
                return
            try:
                answer = await asyncio.to_thread(
                    sender.answer, unit, want.held_version, want.held_checksum
                )
            except CodecError as err:
                log.warning("no delta for unit %d: %s", unit, err)
                answer = Keyframe(sender.version, "no_record")
        # The delta is published outside the lock: the merge loop takes it to publish the next
        # version (:meth:`published`), and a publish that a broker failover holds up until its
        # timeout held that version up as long (5 s past the new leaders' election).
        reply = await self._reply(js, unit, want.fragment, answer)
        if reconnects() != received:
            log.info("params want of unit %d came before a reconnect: not answered", unit)
            return
        self.answered[reply.kind] += 1
        await msg.respond(records.encode(reply))

    async def _reply(self, js: Any, unit: int, fragment: int, answer: Answer) -> DownlinkReply:
        if isinstance(answer, Keyframe):
            return DownlinkReply(kind="keyframe", version=answer.version)
        if isinstance(answer, Current):
            return DownlinkReply(kind="current", version=answer.version)
        last = self._replies.get((unit, fragment))
        if last is not None and last[0] is answer:
            return last[1]
        blob = delta_envelope(self.job, self.model, fragment, answer)
        self._serial += 1
        upload = upload_id(self.job, unit, self._serial, fragment)
        chunks = await publish_delta(js, self.job, unit, fragment, blob, upload, self.chunk_size)
        self.delta_bytes += len(blob)
        reply = DownlinkReply(
            kind="delta",
            version=answer.version,
            base_version=answer.base_version,
            base_checksum=answer.base_checksum,
            checksum=answer.checksum,
            upload=upload,
            chunks=chunks,
            size=len(blob),
            payload_checksum=payload_checksum(answer.payload),
        )
        self._replies[unit, fragment] = (answer, reply)
        return reply
