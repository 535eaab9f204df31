"""A learner fetches global params by its policy — the newest whenever one is announced, or once
after each of its uploads — and a slow read is never torn (in-memory NATS server)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import nats
import numpy as np
import pytest

from services.learner import params_fetcher
from services.learner.counters import Counters
from services.learner.params_fetcher import GlobalFragment, ParamsFetcher
from services.learner.settings import LearnerSettings
from services.link.proxy import LinkProxy
from services.outer.publishing import params_envelope
from shared.codec import api as codec
from shared.link_spec import parse_link
from shared.transport.params import (
    PARAMS_READ_TIMEOUT_S,
    PARAMS_VERSIONS_KEPT,
    publish_params,
    read_latest_params,
)
from shared.transport.streams import ensure_streams
from shared.wire.envelope import unpack_envelope
from tests.helpers import wait_for_async

JOB = "fetch"
SETTINGS = LearnerSettings(job=JOB, model="tiny", unit=0, num_units=2)
AFTER_UPLOAD = SETTINGS.model_copy(update={"params_fetch": "after_upload"})
#: The fetcher's fallback poll in these tests (PARAMS_POLL_S, 2 s in a learner), so that a
#: window of several polls is short.
POLL_S = 0.1


def values(version: int, size: int) -> np.ndarray:
    """The params of ``version``: incompressible, different for every version."""
    return np.random.default_rng(version).standard_normal(size).astype(np.float32) + version


async def publish(js, version: int, size: int = 1000) -> None:
    params = {"w": values(version, size)}
    blob, checksum = params_envelope(JOB, "tiny", 0, version, 0, params, "fp32")
    await publish_params(js, JOB, 0, version, blob, 4096, params_checksum=checksum)


async def arrival(fetcher: ParamsFetcher) -> list[GlobalFragment]:
    """What the training thread takes once the fetcher has fetched something."""
    return await wait_for_async(fetcher.take_new, 10, "fetched params")


async def nothing_fetched(fetcher: ParamsFetcher, polls: int = 5) -> bool:
    """Whether the training thread finds nothing to take for ``polls`` of the fetcher's poll
    intervals: a window in which the fetcher must not fetch (a pass that decides not to leaves
    nothing to wait for)."""
    deadline = asyncio.get_running_loop().time() + polls * POLL_S
    while asyncio.get_running_loop().time() < deadline:
        if fetcher.take_new():
            return False
        await asyncio.sleep(POLL_S / 4)
    return True


class Calls:
    """Counts the calls of the coroutine function ``module.name``, which still runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> None:
        self.count = 0
        original = getattr(module, name)

        async def counted(*args, **kwargs):
            self.count += 1
            return await original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(params_fetcher, "PARAMS_POLL_S", POLL_S)


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
                arrived = await arrival(fetcher)
                assert [f.version for f in arrived] == [version]
                assert np.array_equal(arrived[0].pieces["w"], values(version, 1000))
            fetcher.want_after_upload(0)  # changes nothing: every newer version is wanted
            await publish(js, 4)
            assert [f.version for f in await arrival(fetcher)] == [4]

    asyncio.run(scenario())


def test_a_version_above_the_newest_head_is_replaced_and_a_bad_head_is_read_once(
    memory_nats, monkeypatch
) -> None:
    async def scenario() -> None:
        async with running_fetcher(memory_nats.url, SETTINGS) as (js, fetcher):
            await publish(js, 10**9)  # a forged (or broken) high version
            assert [(f.version, f.rewind) for f in await arrival(fetcher)] == [(10**9, False)]
            await publish(js, 4)  # the genuine outer's next version: the newest head
            assert [(f.version, f.rewind) for f in await arrival(fetcher)] == [(4, True)]
            # Params of another model under a head: rejected once, not re-read at every poll.
            looks = Calls(monkeypatch, params_fetcher, "read_params_head")
            reads = Calls(monkeypatch, params_fetcher, "read_latest_params")
            blob, _ = params_envelope(JOB, "small", 0, 5, 0, {"w": values(5, 10)}, "fp32")
            await publish_params(js, JOB, 0, 5, blob, 4096)
            await wait_for_async(
                lambda: fetcher.counters["params_rejected"] == 1, 10, "the rejection"
            )
            looked = looks.count
            await wait_for_async(lambda: looks.count >= looked + 3, 10, "three more polls")
            assert reads.count == 1 and fetcher.counters["params_rejected"] == 1
            assert fetcher.take_new() == []
            await publish(js, 6)
            assert [(f.version, f.rewind) for f in await arrival(fetcher)] == [(6, False)]

    asyncio.run(scenario())


def test_after_upload_fetches_one_copy_at_start_and_one_after_each_upload(memory_nats) -> None:
    async def scenario() -> None:
        began = time.monotonic()

        async def head_seen(version: int) -> None:
            await wait_for_async(lambda: fetcher.head_version(0) == version, 10, f"head {version}")

        async with running_fetcher(memory_nats.url, AFTER_UPLOAD) as (js, fetcher):
            await publish(js, 1)
            assert [f.version for f in await arrival(fetcher)] == [1]
            # Versions published while nothing is wanted are not fetched.
            await publish(js, 2)
            await publish(js, 3)
            await head_seen(3)
            assert await nothing_fetched(fetcher)
            # An upload: the next version after the newest head seen (3) is wanted, not 3.
            fetcher.want_after_upload(0)
            assert await nothing_fetched(fetcher)
            await publish(js, 4)
            arrived = await arrival(fetcher)
            assert [f.version for f in arrived] == [4]
            assert np.array_equal(arrived[0].pieces["w"], values(4, 1000))
            # And once only: later versions wait for the next upload.
            await publish(js, 5)
            await head_seen(5)
            assert await nothing_fetched(fetcher)
            assert fetcher.counters["params_received"] == 2
            latency = fetcher.params_latency.summary()
            # Both takes measured, each from its head's notification within this test.
            assert latency is not None and latency.count == 2
            assert 0 <= latency.max_s <= time.monotonic() - began

    asyncio.run(scenario())


def test_a_slow_read_gets_exactly_the_version_it_started_on(memory_nats) -> None:
    """A read of one copy that is under way over a slow link, which is held while five newer
    versions are published, is not torn by them. Past PARAMS_VERSIONS_KEPT newer ones it
    starts again on the newest, and still completes."""

    async def read_while_publishing(newer: int) -> tuple[int, bytes]:
        direct = await nats.connect(memory_nats.url)
        js = direct.jetstream()
        await ensure_streams(js)
        host, port = memory_nats.url.removeprefix("nats://").split(":")
        proxy = LinkProxy(parse_link("10mbit"), host, int(port))
        slow = await nats.connect(f"nats://127.0.0.1:{await proxy.start()}")
        try:
            await publish(js, 1, size=60_000)  # 240 kB, in 4 kB chunks: ten 20 ms slices
            read = asyncio.create_task(read_latest_params(slow.jetstream(), JOB, 0, 1 << 22))
            # Once the read has its head and some chunks, the link holds it while the newer
            # versions are published.
            await wait_for_async(
                lambda: proxy.counters().bytes_down > 16_000, 30, "the read", interval_s=0.001
            )
            stall = asyncio.create_task(proxy.stall(3600))
            await asyncio.sleep(0)  # the stall begins
            assert not read.done()
            for version in range(2, 2 + newer):
                await publish(js, version, size=60_000)
            stall.cancel()  # the stall ends
            with contextlib.suppress(asyncio.CancelledError):
                await stall
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


def test_a_read_under_way_when_the_connection_drops_is_given_up(memory_nats) -> None:
    """A params read crossing a slow link when the connection drops is given up at once
    (nats-py would keep its requests waiting out their timeout, which allows for a whole chunk
    over a 1 Mbit/s link): once reconnected, the fetcher reads the newest version."""

    async def scenario() -> None:
        direct = await nats.connect(memory_nats.url)
        js = direct.jetstream()
        await ensure_streams(js)
        host, port = memory_nats.url.removeprefix("nats://").split(":")
        proxy = LinkProxy(parse_link("200kbit"), host, int(port))
        fetcher = ParamsFetcher(SETTINGS, 1 << 22, Counters())
        slow = await nats.connect(
            f"nats://127.0.0.1:{await proxy.start()}",
            reconnect_time_wait=0.1,
            disconnected_cb=fetcher.on_disconnected,
            reconnected_cb=fetcher.on_reconnected,
        )
        runner = asyncio.create_task(fetcher.run(slow.jetstream(timeout=PARAMS_READ_TIMEOUT_S)))
        try:
            await publish(js, 1, size=60_000)  # 240 kB: about 10 s over the link
            await wait_for_async(
                lambda: proxy.counters().bytes_down > 16_000, 30, "the read", interval_s=0.01
            )
            await proxy.cut(0.2)
            await publish(js, 2)
            arrived = await wait_for_async(fetcher.take_new, 8, "the newest version")
            assert [f.version for f in arrived] == [2]
            assert fetcher.counters["params_read_failed"] >= 1
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            await slow.close()
            await proxy.close()
            await direct.close()

    asyncio.run(scenario())


def test_paced_fetches_start_no_sooner_than_h_over_f_steps_apart(memory_nats, monkeypatch) -> None:
    # H = 10, F = 2: a fetch at most every 5 of the unit's steps. The fallback poll is long, so
    # a fetch after a pause can only come from the training thread's step waking the fetcher.
    monkeypatch.setattr(params_fetcher, "PARAMS_POLL_S", 60.0)
    paced = SETTINGS.model_copy(update={"params_fetches_per_period": 2, "h_steps": 10})

    async def at_step(fetcher: ParamsFetcher, step: int) -> list[GlobalFragment]:
        return await wait_for_async(lambda: fetcher.take_new(step, 10), 10, f"params at {step}")

    async def nothing_at(fetcher: ParamsFetcher, step: int) -> bool:
        for _ in range(10):
            if fetcher.take_new(step, 10):
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def scenario() -> None:
        async with running_fetcher(memory_nats.url, paced) as (js, fetcher):
            await publish(js, 1)
            assert [f.version for f in await at_step(fetcher, 0)] == [1]  # began at step 0
            await publish(js, 2)
            await publish(js, 3)
            await wait_for_async(lambda: fetcher.head_version(0) == 3, 10, "head 3")
            assert await nothing_at(fetcher, 4)  # 4 steps after the last fetch began
            # Step 5: the pause is over; the newest version comes, the one between is skipped.
            arrived = await at_step(fetcher, 5)
            assert [f.version for f in arrived] == [3]
            assert np.array_equal(arrived[0].pieces["w"], values(3, 1000))
            await publish(js, 4)
            await wait_for_async(lambda: fetcher.head_version(0) == 4, 10, "head 4")
            assert await nothing_at(fetcher, 9)
            assert [f.version for f in await at_step(fetcher, 10)] == [4]
            assert fetcher.counters["params_received"] == 3

    asyncio.run(scenario())


def test_sync_mode_paces_nothing() -> None:
    # A sync unit waits at its sync point for the round's version: a pause there would hold
    # the fetch until the wait gave up.
    paced = SETTINGS.model_copy(update={"params_fetches_per_period": 2})
    assert ParamsFetcher(paced, 1 << 20, Counters()).rule.fetches_per_period == 2
    in_sync = paced.model_copy(update={"mode": "sync"})
    assert ParamsFetcher(in_sync, 1 << 20, Counters()).rule.fetches_per_period == 0


def test_the_fetch_loop_ends_when_cancelled_though_the_read_under_way_swallows_it() -> None:
    # A read whose reply lands as the cancel comes (or asyncio.wait_for's race) completes
    # instead of raising: the loop must still end, or the link's shutdown waits on it forever.
    async def scenario() -> None:
        fetcher = ParamsFetcher(SETTINGS, 1 << 20, Counters())
        reading = asyncio.Event()

        async def read_that_swallows_its_cancel(js, fragment) -> None:
            reading.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

        fetcher._fetch = read_that_swallows_its_cancel
        loop = asyncio.create_task(fetcher.run(None))
        await reading.wait()
        loop.cancel()
        done, _ = await asyncio.wait({loop}, timeout=10)
        assert done == {loop} and loop.cancelled()

    asyncio.run(scenario())
