"""A JetStream stream held in memory: its messages, limits, deduplication and reads.

What a publish goes through, in nats-server's order (``server/stream.go``,
``processJetStreamMsg``): the expected stream, the per-message TTL being allowed, the expected
last sequence of the subject (what KV's compare-and-set sends) and of the stream, the
``Nats-Msg-Id`` duplicate window, the message size, then the limits as the memory store applies
them (``server/memstore.go``, ``storeRawMsg``): with ``discard: new`` a full subject
(``discard_new_per_subject``), stream (``max_msgs``) or store (``max_bytes``) refuses the
message; otherwise the oldest messages make room. A message's size is counted as the memory store
counts it: subject, headers, data and 16 bytes.

Simplified: limits and ages are applied when the stream is next used, not by a timer; an update
may change any setting (the server refuses some changes, e.g. of retention or storage); subject
delete markers (``subject_delete_marker_ttl``), mirrors, sources, republish, message counters and
schedules, sealing and ``deny_delete``/``deny_purge`` are not modelled (their settings are
stored and reported back, nothing else).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tests.memory_nats import headers
from tests.memory_nats.subjects import matches

NANOS = 1_000_000_000
MESSAGE_OVERHEAD_BYTES = 16  # what the memory store adds to each message's size

#: What nats-server fills in for settings a stream's creator left out.
DEFAULTS: dict[str, Any] = {
    "retention": "limits",
    "max_consumers": -1,
    "max_msgs": -1,
    "max_bytes": -1,
    "max_age": 0,
    "max_msgs_per_subject": -1,
    "max_msg_size": -1,
    "discard": "old",
    "storage": "file",
    "num_replicas": 1,
    "duplicate_window": 120 * NANOS,
    "allow_direct": False,
    "allow_rollup_hdrs": False,
    "allow_msg_ttl": False,
    "discard_new_per_subject": False,
}


class ApiError(Exception):
    """A JetStream API error as the server reports it: HTTP-like ``code``, JetStream
    ``err_code`` and a description."""

    def __init__(self, code: int, err_code: int, description: str) -> None:
        super().__init__(description)
        self.code, self.err_code, self.description = code, err_code, description

    def as_json(self) -> dict[str, Any]:
        return {"code": self.code, "err_code": self.err_code, "description": self.description}


def store_failed(reason: str) -> ApiError:
    """A message the stream's limits refuse (nats-server's ``JSStreamStoreFailedF``)."""
    return ApiError(503, 10077, reason)


def iso(time_ns: int) -> str:
    """A time as the server writes it: RFC 3339 in UTC with nanoseconds."""
    seconds, nanos = divmod(time_ns, NANOS)
    stamp = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return f"{stamp:%Y-%m-%dT%H:%M:%S}.{nanos:09d}Z"


@dataclass
class StoredMessage:
    """One message of a stream."""

    subject: str
    seq: int
    header_block: bytes  # as published (b"" without headers)
    data: bytes
    time_ns: int
    expires_ns: int | None = None  # a per-message TTL (``Nats-TTL``)

    @property
    def size(self) -> int:
        return len(self.subject) + len(self.header_block) + len(self.data) + MESSAGE_OVERHEAD_BYTES


class StreamListener(Protocol):
    """A consumer of the stream: told about each new message and each removed one."""

    def stored(self, message: StoredMessage) -> None: ...

    def removed(self, seq: int) -> None: ...


@dataclass
class Stream:
    """A stream's configuration (as the server reports it) and its messages."""

    config: dict[str, Any]
    messages: dict[int, StoredMessage] = field(default_factory=dict)  # by sequence, in order
    last_seq: int = 0
    last_time_ns: int = 0
    created_ns: int = 0
    listeners: dict[str, StreamListener] = field(default_factory=dict)  # consumers by name
    _by_subject: dict[str, list[int]] = field(default_factory=dict)
    _msg_ids: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (seq, time)
    _bytes: int = 0
    _with_ttl: int = 0  # messages stored with their own TTL

    def __post_init__(self) -> None:
        self.config = with_defaults(self.config)
        self.created_ns = time.time_ns()

    @property
    def name(self) -> str:
        return str(self.config["name"])

    def limit(self, key: str) -> int:
        """A numeric limit; 0 or less means none."""
        return int(self.config.get(key) or 0)

    # ---- writing --------------------------------------------------------------------------

    def store(self, subject: str, header_block: bytes, data: bytes) -> tuple[int, bool]:
        """Store a published message; returns ``(sequence, duplicate)``.

        Raises:
            ApiError: the message is refused, with the server's code and description.
        """
        self.expire()
        pairs = headers.parse(header_block) if header_block else []
        expected_stream = headers.value(pairs, "Nats-Expected-Stream")
        if expected_stream is not None and expected_stream != self.name:
            raise ApiError(400, 10060, "expected stream does not match")
        ttl = headers.value(pairs, "Nats-TTL")
        ttl_s = _ttl_seconds(ttl)
        if ttl is not None and not self.config["allow_msg_ttl"]:
            raise ApiError(400, 10166, "per-message TTL is disabled")
        expected = headers.value(pairs, "Nats-Expected-Last-Subject-Sequence")
        if expected is not None:
            last = self._by_subject.get(subject)
            current = last[-1] if last else 0
            if int(expected) != current:
                raise ApiError(400, 10071, f"wrong last sequence: {current}")
        expected = headers.value(pairs, "Nats-Expected-Last-Sequence")
        if expected is not None and int(expected) != self.last_seq:
            raise ApiError(400, 10071, f"wrong last sequence: {self.last_seq}")
        msg_id = headers.value(pairs, "Nats-Msg-Id")
        if msg_id:
            seen = self._msg_ids.get(msg_id)
            if seen is not None:
                return seen[0], True
        max_size = self.limit("max_msg_size")
        if max_size > 0 and len(header_block) + len(data) > max_size:
            raise ApiError(400, 10054, "message size exceeds maximum allowed")
        rollup = headers.value(pairs, "Nats-Rollup")
        if rollup is not None:
            if not self.config["allow_rollup_hdrs"]:
                raise ApiError(500, 10111, "rollup not permitted")
            if rollup not in ("sub", "all"):
                raise ApiError(500, 10111, f"rollup value invalid: {rollup!r}")
        now = max(time.time_ns(), self.last_time_ns)
        message = StoredMessage(subject, self.last_seq + 1, header_block, data, now)
        if ttl_s:
            message.expires_ns = now + ttl_s * NANOS
            self._with_ttl += 1
        self._check_room(message, rollup is not None)
        self._append(message)
        if msg_id:
            self._msg_ids[msg_id] = (message.seq, now)
        if rollup == "sub":
            self.purge(subject, keep=1)
        elif rollup == "all":
            self.purge(None, keep=1)
        self._enforce_limits(subject)
        for listener in list(self.listeners.values()):
            listener.stored(message)
        return message.seq, False

    def _check_room(self, message: StoredMessage, rollup: bool) -> None:
        """With ``discard: new``, refuse what the limits have no room for."""
        if self.config["discard"] != "new":
            return
        per_subject = self.limit("max_msgs_per_subject")
        at_subject_limit = per_subject > 0 and len(self._by_subject.get(message.subject, ())) >= (
            per_subject
        )
        if at_subject_limit and self.config["discard_new_per_subject"] and not rollup:
            raise store_failed("maximum messages per subject exceeded")
        max_msgs = self.limit("max_msgs")
        if max_msgs > 0 and len(self.messages) >= max_msgs and not at_subject_limit:
            raise store_failed("maximum messages exceeded")
        max_bytes = self.limit("max_bytes")
        if max_bytes > 0 and self._bytes + message.size > max_bytes:
            oldest = self._by_subject.get(message.subject)
            if not at_subject_limit or not oldest or self.messages[oldest[0]].size < message.size:
                raise store_failed("maximum bytes exceeded")

    def _append(self, message: StoredMessage) -> None:
        self.messages[message.seq] = message
        self._by_subject.setdefault(message.subject, []).append(message.seq)
        self._bytes += message.size
        self.last_seq, self.last_time_ns = message.seq, message.time_ns

    def _enforce_limits(self, subject: str) -> None:
        per_subject = self.limit("max_msgs_per_subject")
        kept = self._by_subject.get(subject, [])
        while per_subject > 0 and len(kept) > per_subject:
            self.remove(kept[0])
        max_msgs, max_bytes = self.limit("max_msgs"), self.limit("max_bytes")
        while self.messages and (
            (max_msgs > 0 and len(self.messages) > max_msgs)
            or (max_bytes > 0 and self._bytes > max_bytes)
        ):
            self.remove(next(iter(self.messages)))

    def remove(self, seq: int) -> bool:
        """Delete one message (a work-queue ack, a limit, a purge); False if it was not
        there."""
        message = self.messages.pop(seq, None)
        if message is None:
            return False
        same_subject = self._by_subject[message.subject]
        same_subject.remove(seq)
        if not same_subject:
            del self._by_subject[message.subject]
        self._bytes -= message.size
        if message.expires_ns is not None:
            self._with_ttl -= 1
        for listener in list(self.listeners.values()):
            listener.removed(seq)
        return True

    def purge(self, subject_filter: str | None, keep: int = 0, below_seq: int = 0) -> int:
        """Delete the messages under ``subject_filter`` (all without one) but the newest
        ``keep`` of each subject (of the stream, without a filter), or only those below
        ``below_seq``; returns how many were deleted."""
        self.expire()
        chosen = [m for m in self.messages.values() if self._under(m.subject, subject_filter)]
        if below_seq:
            chosen = [m for m in chosen if m.seq < below_seq]
        elif keep and subject_filter is None:
            chosen = chosen[: max(0, len(chosen) - keep)]
        elif keep:
            newest: dict[str, list[int]] = {}
            for m in chosen:
                newest.setdefault(m.subject, []).append(m.seq)
            spared = {s for seqs in newest.values() for s in seqs[-keep:]}
            chosen = [m for m in chosen if m.seq not in spared]
        for message in chosen:
            self.remove(message.seq)
        return len(chosen)

    def expire(self) -> None:
        """Drop messages past ``max_age`` or their own TTL, and message ids past the
        duplicate window (both are kept oldest first)."""
        now = time.time_ns()
        max_age = self.limit("max_age")
        if max_age > 0:
            for message in list(self.messages.values()):
                if now - message.time_ns <= max_age:
                    break
                self.remove(message.seq)
        if self._with_ttl:
            for message in list(self.messages.values()):
                if message.expires_ns is not None and now >= message.expires_ns:
                    self.remove(message.seq)
        window = self.limit("duplicate_window")
        for msg_id, (_, stamp) in list(self._msg_ids.items()):
            if now - stamp <= window:
                break
            del self._msg_ids[msg_id]

    def update(self, config: dict[str, Any]) -> None:
        """Apply a new configuration (its limits take effect at once)."""
        self.config = with_defaults(config)
        for subject in list(self._by_subject):
            self._enforce_limits(subject)

    # ---- reading --------------------------------------------------------------------------

    @staticmethod
    def _under(subject: str, subject_filter: str | None) -> bool:
        return subject_filter is None or matches(subject_filter, subject)

    def get(self, seq: int) -> StoredMessage | None:
        """The message with sequence ``seq``, or None."""
        self.expire()
        return self.messages.get(seq)

    def last(self, subject_filter: str) -> StoredMessage | None:
        """The newest message under ``subject_filter`` (a subject or a wildcard), or None."""
        self.expire()
        seqs = self._by_subject.get(subject_filter)
        if seqs:
            return self.messages[seqs[-1]]
        found = [s[-1] for subj, s in self._by_subject.items() if matches(subject_filter, subj)]
        return self.messages[max(found)] if found else None

    def next_from(self, seq: int, subject_filter: str | None = None) -> StoredMessage | None:
        """The first message at or after ``seq`` under ``subject_filter``, or None."""
        self.expire()
        return next(self.iterate(seq, subject_filter), None)

    def iterate(self, seq: int, subject_filter: str | None = None) -> Iterator[StoredMessage]:
        """The messages at or after ``seq`` under ``subject_filter``, oldest first."""
        for message in list(self.messages.values()):
            if message.seq >= seq and self._under(message.subject, subject_filter):
                yield message

    def state(self, subjects_filter: str | None = None) -> dict[str, Any]:
        """The stream's state as ``STREAM.INFO`` reports it; with ``subjects_filter``, the
        message count of every subject under it."""
        self.expire()
        first = next(iter(self.messages.values()), None)
        state: dict[str, Any] = {
            "messages": len(self.messages),
            "bytes": self._bytes,
            "first_seq": first.seq if first else (self.last_seq + 1 if self.last_seq else 0),
            "first_ts": iso(first.time_ns if first else 0),
            "last_seq": self.last_seq,
            "last_ts": iso(self.last_time_ns),
            "num_subjects": len(self._by_subject),
            "consumer_count": len(self.listeners),
        }
        if subjects_filter:
            counts = {
                subj: len(seqs)
                for subj, seqs in self._by_subject.items()
                if matches(subjects_filter, subj)
            }
            if counts:  # the server leaves an empty listing out
                state["subjects"] = counts
        return state

    def info(self, subjects_filter: str | None = None) -> dict[str, Any]:
        """The ``STREAM.INFO`` answer."""
        return {
            "config": self.config,
            "created": iso(self.created_ns),
            "state": self.state(subjects_filter),
            "ts": iso(time.time_ns()),
        }


def with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A stream configuration with what the server fills in: defaults for what is left out,
    and a duplicate window of 2 minutes (at most ``max_age``) for none or 0."""
    merged = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if not merged["duplicate_window"]:
        max_age = int(merged["max_age"] or 0)
        merged["duplicate_window"] = min(DEFAULTS["duplicate_window"], max_age or 1 << 62)
    return merged


def _ttl_seconds(ttl: str | None) -> int:
    """A ``Nats-TTL`` header in seconds (the server also takes Go durations; clients here send
    whole seconds)."""
    if ttl is None:
        return 0
    try:
        return max(0, int(ttl))
    except ValueError:
        raise ApiError(400, 10165, "invalid per-message TTL") from None
