"""The delta downlink's channel (``--params-downlink delta``; shared/downlink.py).

A unit asks the outer with a core NATS request on ``diloco.J.want.<unit>`` (a
:class:`~shared.records.outer.DownlinkWant`: the fragment, and the version and checksum of the
copy it holds). The outer publishes the delta's chunks on the unit's own subjects of the
downlink stream (``diloco.J.downlink.<unit>.<p>.chunk.<i>``, one message kept per subject)
and then replies with a :class:`~shared.records.outer.DownlinkReply` naming them; or replies
``keyframe`` (read the global copy) or ``current``. The unit reads each chunk as the last
message of its subject, which only the unit itself may read (``shared.nats_auth``): one want
at a time per unit and fragment, so nothing overwrites a delta while it is read; a chunk of
another upload (a delta sent to an earlier want) fails the read, and the unit then reads the
global copy.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from shared import records, subjects
from shared.records.outer import DownlinkReply, DownlinkWant
from shared.transport import TransportError
from shared.transport.blobs import PUBLISH_TIMEOUT_S, publish_blob
from shared.wire.chunks import Reassembler, WireError, parse_chunk_headers

#: How long a unit waits for the outer's answer to a want: the outer encodes the delta and
#: publishes its chunks before it replies.
WANT_TIMEOUT_S = PUBLISH_TIMEOUT_S + 20.0


async def publish_delta(
    js: JetStreamContext,
    job: str,
    unit: int,
    fragment: int,
    blob: bytes,
    upload: str,
    chunk_size: int,
) -> int:
    """Publish a delta's packed envelope on ``unit``'s downlink subjects; returns its number
    of chunks."""
    sequences = await publish_blob(
        js,
        lambda i: subjects.downlink_chunk_subject(job, unit, fragment, i),
        blob,
        upload,
        chunk_size,
    )
    return len(sequences)


async def request_delta(
    nc: nats.NATS, job: str, unit: int, want: DownlinkWant, timeout_s: float = WANT_TIMEOUT_S
) -> DownlinkReply:
    """Ask the outer for ``want`` and return its answer.

    Raises:
        TransportError: no answer (no outer serves wants, or it did not answer in time), or
            an answer that is not a :class:`DownlinkReply`.
    """
    subject = subjects.want_subject(job, unit, want.fragment)
    try:
        msg = await nc.request(subject, records.encode(want), timeout=timeout_s)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as err:
        raise TransportError(f"no answer to the params want of unit {unit}: {err!r}") from err
    reply = records.decode(DownlinkReply, msg.data, subject)
    if reply is None:
        raise TransportError(f"malformed answer to the params want of unit {unit}")
    return reply


async def read_delta(
    js: JetStreamContext, job: str, unit: int, fragment: int, reply: DownlinkReply, max_bytes: int
) -> memoryview:
    """Read the delta ``reply`` names (a ``delta`` reply) from ``unit``'s downlink subjects.

    Raises:
        TransportError: a chunk is missing or belongs to another delta (ask again).
        WireError: the stored data is malformed.
    """
    reassembler = Reassembler(max_upload_bytes=max_bytes, max_pending_uploads=1)
    blob = None
    for index in range(reply.chunks):
        subject = subjects.downlink_chunk_subject(job, unit, fragment, index)
        try:
            msg = await js.get_last_msg(subjects.DOWNLINK_STREAM, subject, direct=True)
        except nats.js.errors.NotFoundError:
            raise TransportError(f"delta chunk {subject} is missing") from None
        info = parse_chunk_headers(msg.headers)
        if info.upload != reply.upload:
            raise TransportError(f"{subject} holds {info.upload}, not {reply.upload}")
        blob = reassembler.add(info, msg.data)
    if blob is None:
        raise WireError(f"delta {reply.upload} is incomplete after {reply.chunks} chunks")
    return blob
