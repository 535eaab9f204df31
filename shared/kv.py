"""Typed records in NATS KV buckets: store a model, read it back parsed, with its age.

Every value is one model of ``shared/records/``: :func:`put` stores ``records.encode`` of it
and every read parses with ``records.decode``, so a malformed value is a counted rejection
that reads as missing, never an exception in the reader.

Ages come from the NATS server's clock only. :func:`snapshot` asks the server for the bucket's
stream info (``$JS.API.STREAM.INFO``), which lists the keys under a prefix and carries the
server's time of the answer (``ts``); :func:`read_stamped` reads an entry by direct get,
whose ``Nats-Time-Stamp`` is the server's time of the write. Their difference is how long ago
the writer was last heard from, whatever the writer's or the reader's clock says.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from shared import records
from shared.records import R, Stamped

KV_OPERATION = "KV-Operation"
DELETED = ("DEL", "PURGE")
JS_API = "$JS.API"
REQUEST_TIMEOUT_S = 5.0


class KvError(RuntimeError):
    """The server refused a request about a bucket (the message says why)."""


def stream_of(bucket: str) -> str:
    """The JetStream stream that holds a KV bucket."""
    return f"KV_{bucket}"


def subject_of(bucket: str, key: str) -> str:
    """The subject a KV key is stored under."""
    return f"$KV.{bucket}.{key}"


async def put(kv: Any, key: str, record: records.Record) -> int:
    """Store ``record`` under ``key``; returns the new revision."""
    return int(await kv.put(key, records.encode(record)))


async def get(kv: Any, key: str, model: type[R]) -> R | None:
    """The record under ``key``, or None when it is missing, deleted or malformed."""
    found = await get_with_revision(kv, key, model)
    return found[0] if found is not None else None


async def get_with_revision(kv: Any, key: str, model: type[R]) -> tuple[R | None, int] | None:
    """``(record, revision)`` for a compare-and-set, or None when the key is missing or
    deleted.

    A malformed (or empty) value gives ``(None, revision)``: a writer may replace it at that
    revision.
    """
    try:
        entry = await kv.get(key)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    if not entry.value:  # an empty value is not a record either: count it
        records.rejections.add(model.__name__, "empty value", key)
        return None, int(entry.revision or 0)
    return records.decode(model, entry.value, key), int(entry.revision or 0)


@dataclass(frozen=True)
class BucketSnapshot:
    """The keys under a prefix of a bucket, and the server's clock when it was read."""

    bucket: str
    keys: list[str]
    server_time: float  # unix seconds, on the server's clock


def _unix(stamp: str) -> float:
    """An RFC 3339 time from the server (nanoseconds allowed) as unix seconds."""
    head, _, fraction = stamp.rstrip("Z").partition(".")
    seconds = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC).timestamp()
    return seconds + (float(f"0.{fraction}") if fraction.isdigit() else 0.0)


async def snapshot(nc: NatsClient, bucket: str, prefix: str = "") -> BucketSnapshot:
    """The keys of ``bucket`` that start with ``prefix`` and hold a value or a delete marker
    (reading a deleted one gives None), and the server's current time.

    One stream-info request: unlike nats-py's ``KeyValue.keys()`` (a watcher, which under load
    sometimes reports no keys while its first message is in flight), it always sees every key.

    Raises:
        KvError: the server refused the request (e.g. no such bucket).
        TimeoutError, nats.errors.Error: NATS unreachable.
    """
    request = {"subjects_filter": subject_of(bucket, prefix + ">")}
    reply = await nc.request(
        f"{JS_API}.STREAM.INFO.{stream_of(bucket)}",
        json.dumps(request).encode(),
        timeout=REQUEST_TIMEOUT_S,
    )
    try:
        info = json.loads(reply.data)
        if "error" in info:
            raise KvError(f"stream info of bucket {bucket}: {info['error']}")
        subjects = (info.get("state") or {}).get("subjects") or {}
        server_time = _unix(str(info["ts"]))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise KvError(f"unreadable stream info of bucket {bucket}: {err}") from err
    strip = len(subject_of(bucket, ""))
    return BucketSnapshot(bucket, sorted(s[strip:] for s in subjects), server_time)


async def read_stamped(
    js: JetStreamContext, bucket: str, key: str, model: type[R], server_time: float
) -> Stamped[R] | None:
    """The record under ``key`` with its age against ``server_time`` (from :func:`snapshot`),
    or None when the key is missing, deleted or malformed.

    Raises:
        TimeoutError, nats.errors.Error: NATS unreachable.
    """
    try:
        msg = await js.get_last_msg(stream_of(bucket), subject_of(bucket, key), direct=True)
    except nats.js.errors.NotFoundError:
        return None
    headers = msg.headers or {}
    if headers.get(KV_OPERATION) in DELETED or msg.time is None:
        return None
    record = records.decode(model, msg.data, f"{bucket}/{key}")
    if record is None:
        return None
    stamp = msg.time.timestamp()
    return Stamped(record, max(0.0, server_time - stamp), stamp, int(msg.seq or 0))


__all__ = [
    "BucketSnapshot",
    "KvError",
    "get",
    "get_with_revision",
    "put",
    "read_stamped",
    "snapshot",
    "stream_of",
    "subject_of",
]
