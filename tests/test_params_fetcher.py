"""A learner fetches global params by its policy — the newest whenever one is announced, or once
after each of its uploads — and a slow read is never torn (in-memory NATS server)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats
import numpy as np

from services.learner.counters import Counters
from services.learner.params_fetcher import PARAMS_POLL_S, GlobalFragment, ParamsFetcher
from services.learner.settings import LearnerSettings
from services.link.proxy import LinkProxy
from services.outer.publishing import params_envelope
from shared.codec import api as codec
from shared.link_spec import parse_link
from shared.transport.params import PARAMS_VERSIONS_KEPT, publish_params, read_latest_params
from shared.transport.streams import ensure_streams
from shared.wire.envelope import unpack_envelope

JOB = "fetch"
SETTINGS = LearnerSettings(job=JOB, model="tiny", unit=0, num_units=2)
AFTER_UPLOAD = SETTINGS.model_copy(update={"params_fetch": "after_upload"})


def values(version: int, size: int) -> np.ndarray:
    """The params of ``version``: incompressible, different for every version."""
    return np.random.default_rng(version).standard_normal(size).astype(np.float32) + version


async def publish(js, version: int, size: int = 1000) -> None:
    params = {"w": values(version, size)}
    blob, checksum = params_envelope(JOB, "tiny", 0, version, 0, params, "fp32")
    await publish_params(js, JOB, 0, version, blob, 4096, params_checksum=checksum)


async def taken(fetcher: ParamsFetcher, timeout_s: float) -> list[GlobalFragment]:
    """What the training thread would take within ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        arrived = fetcher.take_new()
        if arrived:
            return arrived
        await asyncio.sleep(0.05)
    return []


@contextlib.asynccontextmanager
async def running_fetcher(url: str, settings: LearnerSettings) -> AsyncIterator[tuple]:
    """A fetcher following ``url``'s params, and the JetStream context to publish with."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js)
    fetcher = ParamsFetcher(settings, 1 << 20, Counters())
    await fetcher.subscribe(nc)
    runner = asyncio.create_task(fetcher.run(js))
    try:
        yield js, fetcher
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await fetcher.close()
        await nc.close()


def test_newest_fetches_each_announced_version(memory_nats) -> None:
    async def scenario() -> None:
        async with running_fetcher(memory_nats.url, SETTINGS) as (js, fetcher):
            for version in (1, 2, 3):
                await publish(js, version)
                arrived = await taken(fetcher, 10)
                assert [f.version for f in arrived] == [version]
                assert np.array_equal(arrived[0].pieces["w"], values(version, 1000))
            fetcher.want_after_upload(0)  # changes nothing: every newer version is wanted
            await publish(js, 4)
            assert [f.version for f in await taken(fetcher, 10)] == [4]

    asyncio.run(scenario())


def test_a_version_above_the_newest_head_is_replaced_and_a_bad_head_is_read_once(
    memory_nats,
) -> None:
    async def scenario() -> None:
        async with running_fetcher(memory_nats.url, SETTINGS) as (js, fetcher):
            await publish(js, 10**9)  # a forged (or broken) high version
            assert [(f.version, f.rewind) for f in await taken(fetcher, 10)] == [(10**9, False)]
            await publish(js, 4)  # the genuine outer's next version: the newest head
            assert [(f.version, f.rewind) for f in await taken(fetcher, 10)] == [(4, True)]
            # Params of another model under a head: rejected once, not re-read at every poll.
            blob, _ = params_envelope(JOB, "small", 0, 5, 0, {"w": values(5, 10)}, "fp32")
            await publish_params(js, JOB, 0, 5, blob, 4096)
            assert await taken(fetcher, PARAMS_POLL_S * 2.5) == []
            assert fetcher.counters["params_rejected"] == 1
            await publish(js, 6)
            assert [(f.version, f.rewind) for f in await taken(fetcher, 10)] == [(6, False)]

    asyncio.run(scenario())


def test_after_upload_fetches_one_copy_at_start_and_one_after_each_upload(memory_nats) -> None:
    async def scenario() -> None:
        async with running_fetcher(memory_nats.url, AFTER_UPLOAD) as (js, fetcher):
            await publish(js, 1)
            assert [f.version for f in await taken(fetcher, 10)] == [1]
            # Versions published while nothing is wanted are not fetched.
            await publish(js, 2)
            await publish(js, 3)
            assert await taken(fetcher, 1.0) == []
            # An upload: the next version after the newest head seen (3) is wanted, not 3.
            await asyncio.sleep(0.3)  # the heads' notifications have arrived
            fetcher.want_after_upload(0)
            assert await taken(fetcher, 1.0) == []
            await publish(js, 4)
            arrived = await taken(fetcher, 10)
            assert [f.version for f in arrived] == [4]
            assert np.array_equal(arrived[0].pieces["w"], values(4, 1000))
            # And once only: later versions wait for the next upload.
            await publish(js, 5)
            assert await taken(fetcher, 1.0) == []
            assert fetcher.counters["params_received"] == 2
            latency = fetcher.params_latency.summary()
            assert latency is not None and latency.count == 2 and latency.max_s < 10

    asyncio.run(scenario())


def test_a_slow_read_gets_exactly_the_version_it_started_on(memory_nats) -> None:
    """Over a 1 Mbit/s link one copy takes about two seconds; five newer versions published
    meanwhile do not tear it. Past PARAMS_VERSIONS_KEPT newer ones it starts again on the
    newest, and still completes."""

    async def read_while_publishing(newer: int) -> tuple[int, bytes]:
        direct = await nats.connect(memory_nats.url)
        js = direct.jetstream()
        await ensure_streams(js)
        host, port = memory_nats.url.removeprefix("nats://").split(":")
        proxy = LinkProxy(parse_link("1mbit"), host, int(port))
        slow = await nats.connect(f"nats://127.0.0.1:{await proxy.start()}")
        try:
            await publish(js, 1, size=60_000)
            read = asyncio.create_task(read_latest_params(slow.jetstream(), JOB, 0, 1 << 22))
            for version in range(2, 2 + newer):
                await asyncio.sleep(0.02)
                await publish(js, version, size=60_000)
            result = await asyncio.wait_for(read, 60)
            assert result is not None
            head, blob = result
            return head.version, blob
        finally:
            await slow.close()
            await proxy.close()
            await direct.close()

    def read_values(blob: bytes) -> np.ndarray:
        envelope = unpack_envelope(blob)
        return codec.decode_tensors(envelope.payload, envelope.codec)["w"]

    version, blob = asyncio.run(read_while_publishing(5))
    assert version == 1 and np.array_equal(read_values(blob), values(1, 60_000))
    version, blob = asyncio.run(read_while_publishing(PARAMS_VERSIONS_KEPT + 4))
    assert version > 1 and np.array_equal(read_values(blob), values(version, 60_000))
