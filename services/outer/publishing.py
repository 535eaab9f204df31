"""What the outer sends: each fragment's global params, and copies of the uploads it rejects.

Params go out as a ``params`` envelope (in ``--params-codec``, int8 by default) through
``shared.transport.publish_params``, whose head (``shared.records.ParamsHead``) carries the
checksum of the encoded params, so that anyone can check that a version number always stands
for the same params however often it is announced. A rejected upload's chunk messages are
copied to the job's dead-letter subject with the reason, and only then terminated (never
redelivered); both happen after the rejection is committed, so a crash in between redelivers
them to the next outer, which rejects them again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import numpy as np

from shared.codec import api as codec
from shared.retry import NATS_ERRORS, QUICK, retry
from shared.transport import TransportError
from shared.transport.dead_letters import dead_letter
from shared.transport.params import publish_params
from shared.wire.envelope import ParamsEnvelope, pack_envelope, payload_checksum

log = logging.getLogger(__name__)


def params_envelope(
    job: str,
    model: str,
    fragment: int,
    version: int,
    tokens: int,
    params: Mapping[str, Any],
    params_codec: str = "int8",
) -> tuple[bytes, int]:
    """One fragment's global params as a packed ``params`` envelope.

    Args:
        job, model: The job and its model size.
        fragment: The fragment.
        version: Its version.
        tokens: Tokens the outer has applied so far.
        params: ``{piece name: float32 array}``.
        params_codec: ``int8`` (blockwise), ``bf16`` or ``fp32`` (exact); each version is
            encoded afresh from the exact params, so errors do not build up across versions.

    Returns:
        The packed envelope and the checksum of its payload (``shared.payload_checksum``).
    """
    payload, description = codec.encode_tensors(
        {name: np.asarray(value) for name, value in params.items()},
        codec=params_codec,
        zstd_level=1,
    )
    envelope = ParamsEnvelope(
        job=job,
        model=model,
        fragment=fragment,
        version=version,
        tokens=tokens,
        codec=description,
        sent_at=time.time(),
        payload=payload,
    )
    return pack_envelope(envelope), payload_checksum(payload)


async def publish_fragment(
    js: Any,
    chunk_size: int,
    job: str,
    fragment: int,
    version: int,
    blob: bytes,
    checksum: int,
    stopping: Callable[[], bool],
    applied: Mapping[int, int] | None = None,
) -> bool:
    """Publish one fragment's params (``blob, checksum`` from :func:`params_envelope`),
    retrying (``shared.retry``) until it is done.

    ``applied`` (per unit, the newest round applied) goes into the head.

    Returns:
        True once published; False if ``stopping()`` became true first.
    """
    try:
        await retry(
            lambda: publish_params(
                js,
                job,
                fragment,
                version,
                blob,
                chunk_size,
                params_checksum=checksum,
                applied=applied,
            ),
            f"publish version {version} of fragment {fragment}",
            on=(TransportError, *NATS_ERRORS),
            stopping=stopping,
            backoff=QUICK,  # a broker failover holds it up: reach the new leader soon
        )
    except (TransportError, *NATS_ERRORS):
        log.warning("stopping before version %d of fragment %d was published", version, fragment)
        return False
    return True


@dataclass
class DeadLetters:
    """Rejected uploads' messages waiting to be copied to the dead-letter subject and
    terminated (in the order they were rejected)."""

    job: str
    waiting: list[tuple[list[Any], str]] = field(default_factory=list)

    def add(self, messages: list[Any], reason: str) -> None:
        """Queue the messages of one rejected upload (or stray chunk) with the reason."""
        self.waiting.append((messages, reason))

    async def flush(self, js: Any) -> None:
        """Copy every queued message to the dead-letter subject, then terminate it.

        Call only once the rejections are committed. A copy that fails leaves it and the rest
        queued for the next call (the copy's message id makes a repeated copy a duplicate
        that JetStream drops).
        """
        while self.waiting:
            messages, reason = self.waiting[0]
            for msg in messages:
                try:
                    await dead_letter(js, self.job, reason, msg)
                except NATS_ERRORS as err:
                    log.warning("dead-letter copy failed (%r); will retry", err)
                    return
            for msg in messages:
                with contextlib.suppress(nats.errors.Error):
                    await msg.term()
            self.waiting.pop(0)
