"""The thin NATS layer: connect, create the streams and buckets, move chunked blobs.

Everything here has an explicit timeout. Pseudo-gradients and parameters travel as msgpack
envelopes (``shared.wire``) split into chunks no larger than the server's ``max_payload`` minus
header slack; every chunk carries a ``Nats-Msg-Id`` so that a retried publish is deduplicated by
JetStream. Typed KV records are read and written with ``shared.kv``. docs/ARCHITECTURE.md
describes the layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from shared import nats_auth, records, subjects
from shared.records import ParamsHead
from shared.retry import QUICK, Backoff, retry
from shared.settings import NatsSettings
from shared.wire.chunks import (
    ChunkInfo,
    Reassembler,
    WireError,
    chunk_headers,
    parse_chunk_headers,
    split_chunks,
    upload_id,
)

log = logging.getLogger(__name__)

HEADER_SLACK_BYTES = 8 * 1024  # headers count towards max_payload on the server
MAX_CHUNK_BYTES = 1 << 20  # 1 MiB chunks: fast on loopback and far below file-store limits
GRADS_DUPLICATE_WINDOW_S = 3600.0  # longer than any learner retry window
GRADS_MAX_BYTES = 8 << 30  # a full grads stream refuses new uploads instead of losing old ones
# Chunks one unit may have waiting in the grads stream (1 GiB of 1 MiB chunks): a unit whose
# backlog is full is refused (it keeps its uploads and retries), so no one unit fills the stream.
GRADS_MAX_CHUNKS_PER_UNIT = 1024
# Chunks are at most MAX_CHUNK_BYTES plus headers; the server's max_payload bounds them too.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + HEADER_SLACK_BYTES
SMALL_RECORD_BYTES = 64 << 10  # a desired state, a job's record, the outer's lease
SMALL_BUCKET_BYTES = 64 << 20
STATUS_BUCKET_BYTES = 1 << 30
PARAMS_MAX_BYTES = 4 << 30  # every job's kept params versions
CKPT_MAX_BYTES = 4 << 30  # every job's outer checkpoints
DEAD_MAX_BYTES = 1 << 30
DEAD_MAX_PER_JOB = 1000  # dead letters kept per job: one job's junk cannot evict another's
DEAD_MAX_AGE_S = 7 * 24 * 3600.0
#: What the limits above reserve of JetStream's file store in all (nats-server refuses a stream
#: whose limit does not fit its store; ``services.orchestration.nats_server`` sizes the store from
#: this).
STORE_BYTES = (
    GRADS_MAX_BYTES
    + PARAMS_MAX_BYTES
    + CKPT_MAX_BYTES
    + DEAD_MAX_BYTES
    + STATUS_BUCKET_BYTES
    + 3 * SMALL_BUCKET_BYTES
)
STATUS_TTL_S = 24 * 3600.0  # status keys of long-gone units eventually disappear
PUBLISH_TIMEOUT_S = 10.0
# The slowest link a request's timeout allows for: a request that moves n bytes may take
# PUBLISH_TIMEOUT_S + 8n / MIN_LINK_BITS_PER_S before it counts as lost (and is retried), so a
# 1 MiB chunk over a 1 Mbit/s link is not re-sent while it is still crossing.
MIN_LINK_BITS_PER_S = 1e6
#: Timeout of one direct get of a params chunk (at most one chunk's bytes).
PARAMS_READ_TIMEOUT_S = PUBLISH_TIMEOUT_S + MAX_CHUNK_BYTES * 8 / MIN_LINK_BITS_PER_S
PUBLISH_ATTEMPTS = 6
RETRYABLE_API_CODES = {429, 503}
# nats-py waits a fixed time between reconnect attempts; each client draws its own from this
# range, so that after a server restart the clients do not all reconnect at the same moments.
RECONNECT_WAIT_S = (0.5, 1.5)
TORN_READ_BACKOFF = Backoff(initial_s=0.05, max_s=0.5, jitter_s=0.05)
# Versions of each fragment's params the stream keeps: a read over a slow link that started on
# a version completes unless this many newer ones are published before it ends.
PARAMS_VERSIONS_KEPT = 8


AUTHORIZATION_VIOLATION = "authorization violation"
NATS_CONNECT_ERRORS = (TimeoutError, OSError, nats.errors.Error)


class TransportError(RuntimeError):
    """A NATS operation failed after its retries."""


async def connect(settings: NatsSettings, name: str, **callbacks: Callable[..., Any]) -> NatsClient:
    """Connect to NATS with reconnect-forever and logged errors.

    With ``settings.nats_credentials`` it connects as that user, with the user's own inbox
    prefix (``shared.nats_auth``); with ``settings.nats_ca_file`` over TLS, verifying the
    server's certificate against that CA (``shared.tls``).

    Args:
        settings: connection settings.
        name: client name shown in the server's connection list.
        **callbacks: optional nats-py callbacks (``disconnected_cb``, ``reconnected_cb``, ...).

    Raises:
        TransportError: when the first connection cannot be made within the connect timeout
            (a refused user or password included).
        nats_auth.CredentialsError: the credentials file cannot be used.
    """

    async def log_error(err: Exception) -> None:
        # Denied publishes and other server-side errors only surface here.
        log.warning("nats error (%s): %s", name, err)

    report = callbacks.pop("error_cb", log_error)
    refused = asyncio.Event()

    async def error_cb(err: Exception) -> None:
        # nats-py retries a refused user forever, even on its first connection.
        if AUTHORIZATION_VIOLATION in str(err).lower():
            refused.set()
        await report(err)

    credentials = settings.credentials()
    identity: dict[str, Any] = {}
    if credentials is not None:
        identity = {
            "user": credentials.user,
            "password": credentials.password,
            "inbox_prefix": nats_auth.inbox_prefix(credentials.user),
        }
    if settings.nats_ca_file is not None:
        from shared import tls  # X.509 only where TLS is asked for

        identity["tls"] = tls.client_context(settings.nats_ca_file)
        if settings.nats_tls_hostname is not None:
            identity["tls_hostname"] = settings.nats_tls_hostname
    connecting = asyncio.ensure_future(
        nats.connect(
            servers=settings.nats_servers(),
            name=name,
            **identity,
            connect_timeout=settings.connect_timeout_s,
            max_reconnect_attempts=-1,
            reconnect_time_wait=random.uniform(*RECONNECT_WAIT_S),
            allow_reconnect=True,
            error_cb=error_cb,
            **callbacks,
        )
    )
    watching = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({connecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if not connecting.done():
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, *NATS_CONNECT_ERRORS):
            await connecting
        who = f"user {credentials.user}" if credentials is not None else "no user"
        raise TransportError(
            f"NATS at {settings.nats_url} refused the connection ({who}): Authorization Violation"
        )
    try:
        return connecting.result()
    except NATS_CONNECT_ERRORS as err:
        raise TransportError(f"cannot connect to NATS at {settings.nats_url}: {err}") from err


async def connect_with_retry(
    settings: NatsSettings,
    name: str,
    stopping: Callable[[], bool],
    on_error: Callable[[str], None] | None = None,
    **callbacks: Callable[..., Any],
) -> NatsClient | None:
    """``connect``, retried (``shared.retry``) until it works or ``stopping()``.

    Returns:
        The connection, or None if ``stopping()`` became true first.
    """
    try:
        return await retry(
            lambda: connect(settings, name, **dict(callbacks)),
            f"connect to NATS as {name}",
            on=(TransportError,),
            stopping=stopping,
            on_error=on_error,
        )
    except TransportError:
        return None


def chunk_size_for(nc: NatsClient) -> int:
    """Largest chunk that fits the server's max_payload with room for headers."""
    return max(4096, min(MAX_CHUNK_BYTES, nc.max_payload - HEADER_SLACK_BYTES))


async def prepare_streams(js: JetStreamContext, settings: NatsSettings) -> None:
    """Make sure the streams and buckets exist: create them (:func:`ensure_streams`) as the
    admin or without a user; as any other role, only check the ones it uses
    (``nats_auth.ROLE_STREAMS``; only the admin may create streams).

    Raises:
        nats.js.errors.NotFoundError: a stream is not created yet (retry later).
        TimeoutError, nats.errors.Error: NATS unreachable.
    """
    credentials = settings.credentials()
    if credentials is None or credentials.role == "admin":
        await ensure_streams(js)
        return
    for stream in nats_auth.ROLE_STREAMS[credentials.role]:
        await js.stream_info(stream)


async def ensure_streams(js: JetStreamContext) -> None:
    """Create (or update) every stream and KV bucket the system uses. Idempotent."""
    configs = [
        StreamConfig(
            name=subjects.GRADS_STREAM,
            subjects=[subjects.GRADS_ALL],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=GRADS_DUPLICATE_WINDOW_S,
            max_bytes=GRADS_MAX_BYTES,
            max_msgs_per_subject=GRADS_MAX_CHUNKS_PER_UNIT,
            discard=DiscardPolicy.NEW,
            discard_new_per_subject=True,
            max_msg_size=MAX_MESSAGE_BYTES,
        ),
        StreamConfig(
            name=subjects.PARAMS_STREAM,
            subjects=[subjects.PARAMS_ALL],
            storage=StorageType.FILE,
            max_msgs_per_subject=PARAMS_VERSIONS_KEPT,
            max_bytes=PARAMS_MAX_BYTES,
            max_msg_size=MAX_MESSAGE_BYTES,
            allow_direct=True,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=subjects.CKPT_STREAM,
            subjects=[subjects.CKPT_ALL],
            storage=StorageType.FILE,
            max_msgs_per_subject=1,
            max_bytes=CKPT_MAX_BYTES,
            max_msg_size=MAX_MESSAGE_BYTES,
            allow_direct=True,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=subjects.DEAD_STREAM,
            subjects=[subjects.DEAD_ALL],
            storage=StorageType.FILE,
            max_age=DEAD_MAX_AGE_S,
            max_bytes=DEAD_MAX_BYTES,
            max_msgs_per_subject=DEAD_MAX_PER_JOB,
            max_msg_size=MAX_MESSAGE_BYTES,
            discard=DiscardPolicy.OLD,
        ),
    ]
    for config in configs:
        # Added only when missing: nats-server counts an add's limits against the store before
        # it sees that the stream exists.
        try:
            await js.stream_info(config.name)
        except nats.js.errors.NotFoundError:
            await js.add_stream(config)
        else:
            await js.update_stream(config)
    small = {"max_value_size": SMALL_RECORD_BYTES, "max_bytes": SMALL_BUCKET_BYTES, "direct": True}
    buckets = [
        KeyValueConfig(bucket=subjects.DESIRED_BUCKET, history=5, **small),
        KeyValueConfig(
            bucket=subjects.STATUS_BUCKET,
            history=1,
            ttl=STATUS_TTL_S,
            max_value_size=records.MAX_RECORD_BYTES,
            max_bytes=STATUS_BUCKET_BYTES,
            direct=True,
        ),
        KeyValueConfig(bucket=subjects.OUTER_BUCKET, history=1, **small),
        KeyValueConfig(bucket=subjects.JOBS_BUCKET, history=5, **small),
    ]
    for bucket in buckets:
        try:
            await js.stream_info(f"KV_{bucket.bucket}")
        except nats.js.errors.NotFoundError:
            await js.create_key_value(bucket)


async def publish_blob(
    js: JetStreamContext,
    subject: str | Callable[[int], str],
    blob: bytes,
    upload: str,
    chunk_size: int,
    *,
    inflight: int = 8,
    extra_headers: dict[str, str] | None = None,
) -> list[int]:
    """Publish ``blob`` as chunk messages with a bounded window of in-flight publishes.

    Each chunk is retried (``shared.retry``) with the same ``Nats-Msg-Id`` on timeouts and on
    the server's "busy" answers, which JetStream deduplicates: a timed-out publish may still have
    been stored. A chunk's timeout allows for the bytes in flight with it to cross a link of
    ``MIN_LINK_BITS_PER_S``.

    Args:
        js: JetStream context.
        subject: one subject for every chunk, or a function of the chunk index.
        blob: the bytes to send.
        upload: upload id (``shared.wire.upload_id``), the prefix of every chunk's message id.
        chunk_size: bytes per chunk (``chunk_size_for``).
        inflight: chunks in flight at once.
        extra_headers: headers added to every chunk.

    Returns:
        The stream sequence of each chunk, in order (a chunk JetStream already held as a
        duplicate has the sequence it was stored under).

    Raises:
        TransportError: when a chunk fails after all retries or the server rejects it.
    """
    chunks = split_chunks(blob, chunk_size)
    window = asyncio.Semaphore(inflight)
    sequences = [0] * len(chunks)
    in_flight_bytes = 0

    def retryable(err: BaseException) -> bool:
        if isinstance(err, nats.js.errors.APIError):
            return err.code in RETRYABLE_API_CODES  # busy: try again; anything else is final
        return isinstance(err, TimeoutError | nats.errors.Error)

    async def send(index: int, data: bytes) -> None:
        headers = chunk_headers(ChunkInfo(upload, index, len(chunks), len(blob)))
        if extra_headers:
            headers.update(extra_headers)
        target = subject(index) if callable(subject) else subject
        nonlocal in_flight_bytes
        async with window:
            # The chunks ahead of this one cross the link first.
            in_flight_bytes += len(data)
            timeout = PUBLISH_TIMEOUT_S + in_flight_bytes * 8 / MIN_LINK_BITS_PER_S
            try:
                ack = await retry(
                    lambda: js.publish(target, data, headers=headers, timeout=timeout),
                    f"publish {upload} chunk {index}",
                    on=retryable,
                    attempts=PUBLISH_ATTEMPTS,
                    backoff=QUICK,
                )
            except nats.js.errors.APIError as err:
                raise TransportError(f"server rejected {target}: {err}") from err
            except (TimeoutError, nats.errors.Error) as err:
                raise TransportError(
                    f"chunk {index} of {upload} failed after {PUBLISH_ATTEMPTS} tries: {err!r}"
                ) from err
            finally:
                in_flight_bytes -= len(data)
        sequences[index] = ack.seq

    await asyncio.gather(*(send(i, c) for i, c in enumerate(chunks)))
    return sequences


async def publish_params(
    js: JetStreamContext,
    job: str,
    fragment: int,
    version: int,
    blob: bytes,
    chunk_size: int,
    params_checksum: int | None = None,
    applied: Mapping[int, int] | None = None,
) -> None:
    """Publish a fragment's global params: chunks first, then the head that points at them.

    The head names the stream sequence of every chunk, and the params stream keeps the last
    ``PARAMS_VERSIONS_KEPT`` messages of each subject, so a reader that started on a version
    reads exactly it even while newer ones are published (up to that many), and a unit that
    starts late reads the newest head. ``params_checksum``
    (:func:`shared.wire.payload_checksum` of the encoded params) goes into the head, so that
    anyone can check that a version number always stands for the same params, however often
    it is announced. ``applied`` (per unit, the newest round applied) goes into the head too,
    so that a unit can tell when its upload reached the global params.
    """
    upload = upload_id(job, -1, version, fragment)
    sequences = await publish_blob(
        js, lambda i: subjects.params_chunk_subject(job, fragment, i), blob, upload, chunk_size
    )
    head = ParamsHead(
        version=version,
        upload=upload,
        chunks=len(sequences),
        sequences=sequences,
        size=len(blob),
        params_checksum=params_checksum,
        applied=dict(applied or {}),
    )
    await js.publish(
        subjects.params_head_subject(job, fragment),
        records.encode(head),
        headers={"Nats-Msg-Id": f"{upload}:head"},
        timeout=PUBLISH_TIMEOUT_S,
    )


async def read_params_head(js: JetStreamContext, job: str, fragment: int) -> ParamsHead | None:
    """A fragment's newest params head; None when none was published (or it is malformed:
    then it is rejected, see ``shared.records``)."""
    subject = subjects.params_head_subject(job, fragment)
    try:
        msg = await js.get_last_msg(subjects.PARAMS_STREAM, subject, direct=True)
    except nats.js.errors.NotFoundError:
        return None
    return records.decode(ParamsHead, msg.data, subject)


class TornRead(TransportError):
    """The version being read was dropped (``PARAMS_VERSIONS_KEPT`` newer ones were published
    meanwhile) before all its chunks were read."""


async def read_latest_params(
    js: JetStreamContext, job: str, fragment: int, max_bytes: int, attempts: int = 5
) -> tuple[ParamsHead, bytes] | None:
    """Fetch a fragment's newest global params blob: ``(head, blob)``, or None if none yet.

    The chunks are read by the sequences the head names, so the blob is exactly that version
    however many are published meanwhile, unless the stream dropped it (more than
    ``PARAMS_VERSIONS_KEPT`` newer ones): then the read starts again from the newest head.

    Raises:
        TransportError: if no consistent read succeeds within ``attempts``.
        WireError: if the stored data is malformed.
    """

    async def read_once() -> tuple[ParamsHead, bytes] | None:
        head = await read_params_head(js, job, fragment)
        if head is None:
            return None
        reassembler = Reassembler(max_upload_bytes=max_bytes, max_pending_uploads=1)
        blob = None
        for index, sequence in enumerate(head.sequences):
            try:
                msg = await js.get_msg(subjects.PARAMS_STREAM, seq=sequence, direct=True)
            except nats.js.errors.NotFoundError:
                raise TornRead(
                    f"version {head.version} of job {job} fragment {fragment} was dropped "
                    "while read"
                ) from None
            info = parse_chunk_headers(msg.headers)
            expected = subjects.params_chunk_subject(job, fragment, index)
            if msg.subject != expected or info.upload != head.upload:
                raise WireError(
                    f"params head of job {job} fragment {fragment} names sequence {sequence}, "
                    f"which holds {msg.subject} of {info.upload}"
                )
            blob = reassembler.add(info, msg.data)
        if blob is None:
            raise TornRead(f"params of job {job} fragment {fragment} incomplete")
        return head, blob

    return await retry(
        read_once,
        f"read params of job {job} fragment {fragment}",
        on=(TornRead,),
        attempts=attempts,
        backoff=TORN_READ_BACKOFF,
    )


HEADER_REASON = "Diloco-Reason"
HEADER_SUBJECT = "Diloco-Subject"


async def dead_letter(js: JetStreamContext, job: str, reason: str, msg: Any) -> None:
    """Copy a rejected message to the job's dead-letter subject, with the reason in a header.

    The copy keeps the original data and headers and adds ``Diloco-Reason`` and
    ``Diloco-Subject``; its ``Nats-Msg-Id`` is derived from the original's, so a copy made
    again after a crash is deduplicated.

    Raises:
        TimeoutError, nats.errors.Error: when it cannot be stored (the caller retries later,
            since the original is only terminated after its copy is stored).
    """
    headers = {k: v for k, v in (msg.headers or {}).items() if isinstance(v, str)}
    original_id = headers.get("Nats-Msg-Id")
    if original_id is None:
        try:
            original_id = f"seq:{msg.metadata.sequence.stream}"
        except (AttributeError, ValueError):
            original_id = f"seq:{id(msg)}"
    headers.update(
        {
            HEADER_REASON: reason[:1000].replace("\r", " ").replace("\n", " "),
            HEADER_SUBJECT: msg.subject,
            "Nats-Msg-Id": f"dead:{original_id}",
        }
    )
    await js.publish(
        subjects.dead_letter_subject(job), msg.data, headers=headers, timeout=PUBLISH_TIMEOUT_S
    )


__all__ = [
    "TransportError",
    "WireError",
    "chunk_size_for",
    "connect",
    "connect_with_retry",
    "dead_letter",
    "ensure_streams",
    "publish_blob",
    "publish_params",
    "read_latest_params",
    "read_params_head",
]
