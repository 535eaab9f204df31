"""A blob published as chunk messages: a bounded window of publishes, each retried under the same
``Nats-Msg-Id`` so that JetStream deduplicates a retry that was stored after all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from shared.retry import QUICK, retry
from shared.transport import TransportError
from shared.transport.pace import pace_of
from shared.wire.chunks import (
    ChunkInfo,
    chunk_headers,
    split_chunks,
)

HEADER_SLACK_BYTES = 8 * 1024  # headers count towards max_payload on the server

MAX_CHUNK_BYTES = 1 << 20  # 1 MiB chunks: fast on loopback and far below file-store limits

# Chunks are at most MAX_CHUNK_BYTES plus headers; the server's max_payload bounds them too.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + HEADER_SLACK_BYTES

PUBLISH_TIMEOUT_S = 10.0

# The slowest link a chunk's publish allows for: one that moves n bytes is retried for
# PUBLISH_ATTEMPTS x (PUBLISH_TIMEOUT_S + 8n / MIN_LINK_BITS_PER_S) before it fails, and an
# attempt waits for its ack at most this link's time for them until the connection's acks
# show a faster one (``shared/transport/pace.py``), so that a 1 MiB chunk over a 1 Mbit/s
# link is not re-sent while it is still crossing.
MIN_LINK_BITS_PER_S = 1e6

#: A chunk is retried for as long as this many attempts of ``PUBLISH_TIMEOUT_S`` would take: a
#: failover's quick "no responders" answers (``shared.retry.QUICK``) do not use it up sooner.
PUBLISH_ATTEMPTS = 6

#: How long one attempt waits for the broker's ack, beyond its bytes' time on the link, before
#: the chunk is sent again (with the same message id: JetStream stores it once). Shorter than
#: ``PUBLISH_TIMEOUT_S``, the chunk's patience per attempt, because a request lost in a broker
#: failover (sent to a leader as it died, or to a new one not serving yet) is never answered:
#: in a three-node cluster test one checkpoint chunk waited out a 10-s timeout so, and the
#: outer's version advanced 18 s after the kill instead of 8. A slow ack under load costs a
#: copy of the chunk that JetStream drops as a duplicate.
ATTEMPT_TIMEOUT_S = 2.0

RETRYABLE_API_CODES = {429, 503}


def chunk_size_for(nc: NatsClient) -> int:
    """Largest chunk that fits the server's max_payload with room for headers."""
    return max(4096, min(MAX_CHUNK_BYTES, nc.max_payload - HEADER_SLACK_BYTES))


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
    been stored. An attempt's timeout (``ATTEMPT_TIMEOUT_S``) allows for the bytes in flight
    with it to cross the link at the pace the connection's acks have shown
    (``shared/transport/pace.py``), the chunk's retry window (``PUBLISH_ATTEMPTS`` ×
    ``PUBLISH_TIMEOUT_S``) for them to cross a link of ``MIN_LINK_BITS_PER_S``.

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
    pace = pace_of(js, MIN_LINK_BITS_PER_S)
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
            ahead = in_flight_bytes
            timeout = ATTEMPT_TIMEOUT_S + ahead * 8 / pace.bits_per_s()
            within = PUBLISH_ATTEMPTS * (PUBLISH_TIMEOUT_S + ahead * 8 / MIN_LINK_BITS_PER_S)

            async def attempt() -> Any:
                sent = time.monotonic()
                ack = await js.publish(target, data, headers=headers, timeout=timeout)
                pace.observe(ahead, time.monotonic() - sent)
                return ack

            try:
                ack = await retry(
                    attempt,
                    f"publish {upload} chunk {index}",
                    on=retryable,
                    within_s=within,
                    backoff=QUICK,
                )
            except nats.js.errors.APIError as err:
                raise TransportError(f"server rejected {target}: {err}") from err
            except (TimeoutError, nats.errors.Error) as err:
                raise TransportError(
                    f"chunk {index} of {upload} failed for {within:.0f} s: {err!r}"
                ) from err
            finally:
                in_flight_bytes -= len(data)
        sequences[index] = ack.seq

    await asyncio.gather(*(send(i, c) for i, c in enumerate(chunks)))
    return sequences
