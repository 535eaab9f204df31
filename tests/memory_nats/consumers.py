"""A durable pull consumer of an in-memory stream: pull requests, explicit acks, redelivery.

As nats-server does it (``server/consumer.go``): a pull request (``CONSUMER.MSG.NEXT``) asks
for a batch; messages go to its inbox with an ack subject
``$JS.ACK.<stream>.<consumer>.<deliveries>.<stream seq>.<consumer seq>.<time>.<pending>``
(what nats-py's ``Msg.metadata`` reads); a request that ends unfilled is answered
``408 Request Timeout`` when it expires, or ``404 No Messages`` when it asked not to wait. A
delivered message stays pending until acked: ``+ACK`` (or an empty body) and ``+TERM`` end it
(and delete it from a work-queue stream), ``-NAK`` redelivers it (after its ``delay``),
``+WPI`` restarts its ack wait, and an ack wait that runs out redelivers it, up to
``max_deliver`` deliveries. Redeliveries go before new messages.

Simplified: only pull consumers (a ``deliver_subject`` is refused by the API), deliver
policies ``all``, ``new``, ``last`` and ``by_start_sequence``, no ``backoff``, no idle
heartbeats, no ``max_bytes`` per request, no advisories; the ack floor is the stream sequence
below the oldest pending message (the server's stays below a message that ran out of
deliveries).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.memory_nats import headers
from tests.memory_nats.streams import NANOS, ApiError, StoredMessage, Stream, iso

#: What nats-server fills in for settings a pull consumer's creator left out.
DEFAULTS: dict[str, Any] = {
    "deliver_policy": "all",
    "ack_policy": "explicit",
    "ack_wait": 30 * NANOS,
    "max_deliver": -1,
    "replay_policy": "instant",
    "max_waiting": 512,
    "max_ack_pending": 1000,
    "num_replicas": 0,
}

DELIVER_POLICIES = ("all", "new", "last", "by_start_sequence")

#: Sends a message: ``(subject, reply, header block, data, to)``; ``to``, when not None, is
#: the subject whose subscribers get it (a request's inbox) instead of ``subject``.
Send = Callable[[str, str, bytes, bytes, str | None], object]


@dataclass
class PullRequest:
    """A waiting ``CONSUMER.MSG.NEXT`` request."""

    inbox: str
    remaining: int
    no_wait: bool
    expires: asyncio.TimerHandle | None = None
    delivered: int = 0


@dataclass
class Pending:
    """A delivered message not acked yet."""

    deliveries: int
    timer: asyncio.TimerHandle | None = None


@dataclass
class PullConsumer:
    """A durable pull consumer: its configuration, delivery state and waiting requests.

    ``send`` delivers a message to a subject; ``has_interest`` says whether anyone still
    listens on a request's inbox (a request from a closed connection is dropped, as the server
    drops it).
    """

    stream: Stream
    name: str
    config: dict[str, Any]
    send: Send
    has_interest: Callable[[str], bool]
    created_ns: int = field(default_factory=time.time_ns)
    next_seq: int = 1  # the first stream sequence not delivered yet
    consumer_seq: int = 0
    delivered_stream_seq: int = 0
    pending: dict[int, Pending] = field(default_factory=dict)  # by stream sequence
    redeliver: list[int] = field(default_factory=list)  # due again, oldest first
    redelivered: set[int] = field(default_factory=set)  # pending ones delivered again
    waiting: deque[PullRequest] = field(default_factory=deque)
    _delivery_due: bool = False

    def __post_init__(self) -> None:
        self.configure(self.config, start=True)

    def configure(self, config: dict[str, Any], start: bool = False) -> None:
        """Set the configuration (creating, or updating an existing consumer).

        Raises:
            ApiError: a push consumer or an unsupported deliver policy.
        """
        if config.get("deliver_subject"):
            raise ApiError(400, 10140, "push consumers are not supported in memory")
        merged = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if merged["deliver_policy"] not in DELIVER_POLICIES:
            raise ApiError(400, 10140, f"deliver policy {merged['deliver_policy']} unsupported")
        self.config = merged
        if not start:
            return
        policy, last = merged["deliver_policy"], self.stream.last_seq
        if policy == "new":
            self.next_seq = last + 1
        elif policy == "last":
            newest = self.stream.last(self.filter) if self.filter else None
            self.next_seq = newest.seq if newest else max(1, last)
        elif policy == "by_start_sequence":
            self.next_seq = int(merged.get("opt_start_seq") or 1)

    @property
    def filter(self) -> str | None:
        return self.config.get("filter_subject") or None

    # ---- requests -------------------------------------------------------------------------

    def request(self, inbox: str, batch: int, expires_ns: int, no_wait: bool) -> None:
        """A pull request for ``batch`` messages to ``inbox``."""
        if no_wait and not expires_ns and not self._available():
            self.send(inbox, "", headers.status(404, "No Messages"), b"", None)
            return
        request = PullRequest(inbox, max(1, batch), no_wait)
        if expires_ns:
            request.expires = asyncio.get_running_loop().call_later(
                expires_ns / NANOS, self._expire, request
            )
        self.waiting.append(request)
        self._deliver()

    def _expire(self, request: PullRequest) -> None:
        """A request's time is up: it ends with how many messages it still wanted."""
        if request in self.waiting:
            self.waiting.remove(request)
            pairs = [("Nats-Pending-Messages", str(request.remaining)), ("Nats-Pending-Bytes", "0")]
            self.send(request.inbox, "", headers.encode(pairs, "408 Request Timeout"), b"", None)

    def _close(self, request: PullRequest) -> None:
        if request.expires is not None:
            request.expires.cancel()
        if request in self.waiting:
            self.waiting.remove(request)

    def _available(self) -> bool:
        return bool(self.redeliver) or self._next_new() is not None

    def _next_new(self) -> StoredMessage | None:
        if len(self.pending) >= int(self.config["max_ack_pending"]) > 0:
            return None
        return self.stream.next_from(self.next_seq, self.filter)

    def _deliver(self) -> None:
        """Hand out what is due to the waiting requests, oldest request first."""
        while self.waiting:
            request = self.waiting[0]
            if not self.has_interest(request.inbox):
                self._close(request)
                continue
            message = self._take()
            if message is None:
                break
            self._send(request, message)
            request.remaining -= 1
            request.delivered += 1
            if request.remaining == 0:
                self._close(request)
        # A request that asked not to wait ends once nothing more is available.
        for request in [r for r in self.waiting if r.no_wait]:
            if request.expires is None or request.delivered:
                self._close(request)
                self.send(request.inbox, "", headers.status(404, "No Messages"), b"", None)

    def _take(self) -> StoredMessage | None:
        while self.redeliver:
            seq = self.redeliver.pop(0)
            message = self.stream.messages.get(seq)
            if message is not None and seq in self.pending:
                return message
        message = self._next_new()
        if message is not None:
            self.next_seq = message.seq + 1
        return message

    def _send(self, request: PullRequest, message: StoredMessage) -> None:
        entry = self.pending.get(message.seq)
        if entry is None:
            entry = self.pending[message.seq] = Pending(deliveries=0)
        else:
            self.redelivered.add(message.seq)
        entry.deliveries += 1
        self.consumer_seq += 1
        self.delivered_stream_seq = max(self.delivered_stream_seq, message.seq)
        self._arm(message.seq, entry, self.config["ack_wait"] / NANOS)
        ack = ".".join(
            [
                "$JS.ACK",
                self.stream.name,
                self.name,
                str(entry.deliveries),
                str(message.seq),
                str(self.consumer_seq),
                str(message.time_ns),
                str(self.num_pending()),
            ]
        )
        self.send(message.subject, ack, message.header_block, message.data, request.inbox)

    def _arm(self, seq: int, entry: Pending, after_s: float) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        entry.timer = asyncio.get_running_loop().call_later(after_s, self._due_again, seq)

    def _due_again(self, seq: int) -> None:
        """An ack wait ran out (or a nak's delay passed): deliver again, unless the message
        reached ``max_deliver``."""
        entry = self.pending.get(seq)
        if entry is None:
            return
        entry.timer = None
        max_deliver = int(self.config["max_deliver"])
        if 0 < max_deliver <= entry.deliveries:
            del self.pending[seq]  # never delivered again, and never acked
            self.redelivered.discard(seq)
            return
        if seq not in self.redeliver:
            self.redeliver.append(seq)
            self.redeliver.sort()
        # Every ack wait that ran out by now is redelivered together, as the server's pending
        # check does: deliver on the loop's next turn, after the other timers due now.
        if not self._delivery_due:
            self._delivery_due = True
            asyncio.get_running_loop().call_soon(self._deliver_due)

    def _deliver_due(self) -> None:
        self._delivery_due = False
        self._deliver()

    # ---- acks -----------------------------------------------------------------------------

    def acknowledge(self, seq: int, body: bytes) -> None:
        """An ack for the message at stream sequence ``seq``: ``+ACK`` (or empty), ``-NAK``
        (optionally ``{"delay": ns}``), ``+WPI``, ``+TERM``."""
        entry = self.pending.get(seq)
        if entry is None:
            return
        verb, _, argument = body.partition(b" ")
        if verb in (b"", b"+ACK", b"+TERM", b"+NXT"):
            self._done(seq, entry)
        elif verb == b"-NAK":
            delay_ns = _delay_ns(argument)
            if delay_ns:
                self._arm(seq, entry, delay_ns / NANOS)
            else:
                if entry.timer is not None:
                    entry.timer.cancel()
                self._due_again(seq)
        elif verb == b"+WPI":
            self._arm(seq, entry, self.config["ack_wait"] / NANOS)

    def _done(self, seq: int, entry: Pending) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        del self.pending[seq]
        self.redelivered.discard(seq)
        if seq in self.redeliver:
            self.redeliver.remove(seq)
        if self.stream.config["retention"] == "workqueue":
            self.stream.remove(seq)
        self._deliver()  # room under max_ack_pending

    # ---- the stream's news ----------------------------------------------------------------

    def stored(self, message: StoredMessage) -> None:
        """A new message: deliver it if someone waits."""
        self._deliver()

    def removed(self, seq: int) -> None:
        """A message left the stream (a limit, a purge, an ack): nothing to redeliver."""
        entry = self.pending.pop(seq, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()
        self.redelivered.discard(seq)
        if seq in self.redeliver:
            self.redeliver.remove(seq)

    def stop(self) -> None:
        """The consumer is deleted: cancel its timers and forget its requests."""
        for entry in self.pending.values():
            if entry.timer is not None:
                entry.timer.cancel()
        for request in list(self.waiting):
            self._close(request)

    def drop_requests(self) -> None:
        """Every connection is gone (the broker was killed): so are their requests."""
        for request in list(self.waiting):
            self._close(request)

    # ---- info -----------------------------------------------------------------------------

    def num_pending(self) -> int:
        """Messages under the filter not delivered yet."""
        return sum(1 for _ in self.stream.iterate(self.next_seq, self.filter))

    def info(self) -> dict[str, Any]:
        """The ``CONSUMER.INFO`` answer."""
        floor = min(self.pending) - 1 if self.pending else self.delivered_stream_seq
        return {
            "stream_name": self.stream.name,
            "name": self.name,
            "created": iso(self.created_ns),
            "config": {**self.config, "name": self.name},
            "delivered": {
                "consumer_seq": self.consumer_seq,
                "stream_seq": self.delivered_stream_seq,
            },
            "ack_floor": {"consumer_seq": 0, "stream_seq": floor},
            "num_ack_pending": len(self.pending),
            "num_redelivered": len(self.redelivered),
            "num_waiting": len(self.waiting),
            "num_pending": self.num_pending(),
            "ts": iso(time.time_ns()),
        }


def _delay_ns(argument: bytes) -> int:
    """The ``delay`` of a ``-NAK {"delay": ns}``, 0 without one."""
    if not argument.strip():
        return 0
    try:
        return max(0, int(json.loads(argument).get("delay") or 0))
    except (ValueError, AttributeError):
        return 0
