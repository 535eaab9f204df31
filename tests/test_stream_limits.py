"""Every stream and bucket is bounded, per unit or per job where one could crowd out the others
(``shared.transport.streams.ensure_streams``), on a real nats-server."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest

from shared import subjects
from shared.settings.nats import NatsSettings
from shared.transport.blobs import MAX_MESSAGE_BYTES
from shared.transport.connection import connect
from shared.transport.streams import (
    DEAD_MAX_PER_JOB,
    GRADS_MAX_CHUNKS_PER_UNIT,
    SMALL_RECORD_BYTES,
    ensure_streams,
)

pytestmark = pytest.mark.nats


async def _connected(url: str):
    nc = await connect(NatsSettings(nats_url=url), "limits")
    js = nc.jetstream()
    await ensure_streams(js)
    return nc, js


def test_one_units_full_backlog_is_refused_while_the_others_still_upload(nats_server) -> None:
    async def scenario() -> None:
        nc, js = await _connected(nats_server.url)
        try:
            full = subjects.grads_subject("a", 0, 0)
            for start in range(0, GRADS_MAX_CHUNKS_PER_UNIT, 128):
                await asyncio.gather(
                    *(js.publish(full, b"chunk", timeout=10) for _ in range(start, start + 128))
                )
            with pytest.raises(nats.js.errors.APIError, match="maximum messages per subject"):
                await js.publish(full, b"one too many", timeout=10)
            # Another unit of the same job, and another job, are not held back.
            await js.publish(subjects.grads_subject("a", 1, 0), b"chunk", timeout=10)
            await js.publish(subjects.grads_subject("b", 0, 0), b"chunk", timeout=10)
            info = await js.stream_info(subjects.GRADS_STREAM)
            assert info.state.messages == GRADS_MAX_CHUNKS_PER_UNIT + 2
            assert info.config.max_msg_size == MAX_MESSAGE_BYTES
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_dead_letters_are_kept_per_job_and_every_stream_and_bucket_has_limits(
    nats_server,
) -> None:
    async def scenario() -> None:
        nc, js = await _connected(nats_server.url)
        try:
            noisy, quiet = subjects.dead_letter_subject("noisy"), subjects.dead_letter_subject("q")
            await js.publish(quiet, b"rejected", timeout=10)
            for start in range(0, DEAD_MAX_PER_JOB + 100, 100):
                await asyncio.gather(
                    *(js.publish(noisy, b"junk", timeout=10) for _ in range(start, start + 100))
                )
            info = await js.stream_info(subjects.DEAD_STREAM, subjects_filter=">")
            assert info.state.subjects == {noisy: DEAD_MAX_PER_JOB, quiet: 1}
            for stream in (
                subjects.GRADS_STREAM,
                subjects.PARAMS_STREAM,
                subjects.CKPT_STREAM,
                subjects.DEAD_STREAM,
                *(
                    f"KV_{bucket}"
                    for bucket in (
                        subjects.DESIRED_BUCKET,
                        subjects.STATUS_BUCKET,
                        subjects.OUTER_BUCKET,
                        subjects.JOBS_BUCKET,
                    )
                ),
            ):
                config = (await js.stream_info(stream)).config
                assert config.max_bytes and config.max_bytes > 0, stream
                assert config.max_msg_size and config.max_msg_size > 0, stream
            desired = await js.key_value(subjects.DESIRED_BUCKET)
            with pytest.raises(nats.js.errors.APIError, match="message size exceeds maximum"):
                await desired.put("q.0", b"x" * (SMALL_RECORD_BYTES + 1))
        finally:
            await nc.close()

    asyncio.run(scenario())
