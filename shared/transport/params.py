"""The params channel: each fragment's global params as chunks plus a head that names them, and
reads that see exactly one version however many are published meanwhile.
"""

from __future__ import annotations

from collections.abc import Mapping

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from shared import records, subjects
from shared.records.outer import ParamsHead
from shared.retry import Backoff, retry
from shared.transport import TransportError
from shared.transport.blobs import (
    ATTEMPT_TIMEOUT_S,
    MAX_CHUNK_BYTES,
    MIN_LINK_BITS_PER_S,
    PUBLISH_TIMEOUT_S,
    publish_blob,
)
from shared.wire.chunks import (
    Reassembler,
    WireError,
    parse_chunk_headers,
    upload_id,
)

#: Timeout of one direct get of a params chunk (at most one chunk's bytes).
PARAMS_READ_TIMEOUT_S = PUBLISH_TIMEOUT_S + MAX_CHUNK_BYTES * 8 / MIN_LINK_BITS_PER_S

TORN_READ_BACKOFF = Backoff(initial_s=0.05, max_s=0.5, jitter_s=0.05)

# Versions of each fragment's params the stream keeps: a read over a slow link that started on
# a version completes unless this many newer ones are published before it ends.
PARAMS_VERSIONS_KEPT = 8


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
        timeout=ATTEMPT_TIMEOUT_S,  # the caller retries the whole publish (the same ids)
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
) -> tuple[ParamsHead, memoryview] | None:
    """Fetch a fragment's newest global params blob: ``(head, blob)``, or None if none yet.

    The chunks are read by the sequences the head names, so the blob is exactly that version
    however many are published meanwhile, unless the stream dropped it (more than
    ``PARAMS_VERSIONS_KEPT`` newer ones): then the read starts again from the newest head.

    Raises:
        TransportError: if no consistent read succeeds within ``attempts``.
        WireError: if the stored data is malformed.
    """

    async def read_once() -> tuple[ParamsHead, memoryview] | None:
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
