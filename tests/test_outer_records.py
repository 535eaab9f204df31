"""Malformed lease, status and params-head records never crash an outer; they are rejections."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import nats.js.errors
import pytest

from services.outer.lease import UNREADABLE, Lease, LeaseLost
from services.outer.service import OuterService
from services.outer.settings import OuterSettings
from shared import records, subjects
from shared.job_status import read_job_status
from shared.records.outer import CheckpointPointer, LeaseRecord, OuterStatus
from shared.transport.connection import connect
from shared.transport.params import read_params_head
from shared.transport.streams import ensure_streams
from tests import virtual_clock
from tests.helpers import wait_for_async

GARBAGE = (b"{not json", b'{"holder": 7}', b"[]", b'{"holder": "x", "epoch": -1, "beat": 0}')


@dataclass
class Entry:
    value: bytes
    revision: int


class MemoryKv:
    """The compare-and-set subset of a JetStream KV bucket that the lease uses."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.revision = 0

    async def get(self, key: str) -> Entry:
        if key not in self.entries:
            raise nats.js.errors.KeyNotFoundError()
        return self.entries[key]

    async def put(self, key: str, value: bytes) -> int:
        self.revision += 1
        self.entries[key] = Entry(value, self.revision)
        return self.revision

    async def create(self, key: str, value: bytes) -> int:
        if key in self.entries:
            raise nats.js.errors.KeyWrongLastSequenceError()
        return await self.put(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        if key not in self.entries or self.entries[key].revision != last:
            raise nats.js.errors.KeyWrongLastSequenceError()
        return await self.put(key, value)


def rejected(model: str) -> int:
    return sum(n for (record, _), n in records.rejections.counts().items() if record == model)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_an_unreadable_lease_is_taken_over_after_lease_s_without_a_change(garbage: bytes) -> None:
    async def scenario() -> None:
        store = MemoryKv()
        for _ in range(5):  # some history: the epoch must exceed every epoch written before
            await store.put("other", b"x")
        revision = await store.put("job", garbage)
        before = rejected("LeaseRecord")
        lease = Lease(store, "job", "b", lease_s=0.5)
        waited: list[str] = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await asyncio.wait_for(lease.acquire(lambda: False, waited.append), timeout=10)
        # Once unchanged for lease_s, at the next look (polls come every poll_s ± 20%).
        assert lease.lease_s <= loop.time() - started <= lease.lease_s + 1.2 * lease.poll_s
        assert waited and set(waited) == {UNREADABLE}
        assert lease.epoch == revision + 1 and lease.pointer is None
        assert rejected("LeaseRecord") > before
        stored = records.decode(LeaseRecord, store.entries["job"].value)
        assert stored is not None and (stored.holder, stored.epoch) == ("b", revision + 1)

    virtual_clock.run(scenario())


def test_a_leader_whose_record_is_overwritten_with_garbage_loses_the_lease() -> None:
    async def scenario() -> None:
        store = MemoryKv()
        lease = Lease(store, "job", "a", lease_s=0.5)
        assert await lease.acquire(lambda: False, lambda holder: None)
        pointer = CheckpointPointer(
            id="p", epoch=1, slot=0, chunks=1, size=0, checksum=0, versions=[0]
        )
        await lease.commit(pointer)
        await store.put("job", b"{garbage")
        with pytest.raises(LeaseLost):
            await lease.renew()
        with pytest.raises(LeaseLost):
            await lease.commit(pointer)

    asyncio.run(scenario())


def test_a_standby_waits_while_the_leader_renews() -> None:
    async def scenario() -> None:
        store = MemoryKv()
        a, b = Lease(store, "job", "a", lease_s=0.5), Lease(store, "job", "b", lease_s=0.5)
        assert await a.acquire(lambda: False, lambda holder: None)
        seen: list[str] = []
        stop = asyncio.Event()
        waiter = asyncio.create_task(b.acquire(stop.is_set, seen.append))
        for _ in range(8):  # the leader renews every lease_s / 5 for 1.6 lease_s
            await asyncio.sleep(0.1)
            await a.renew()
        assert not waiter.done() and seen[-1] == "a"
        stop.set()
        assert await asyncio.wait_for(waiter, timeout=5) is False

    virtual_clock.run(scenario())


def test_the_keep_alive_ends_when_cancelled_though_the_renewal_under_way_swallows_it() -> None:
    # A lease write whose reply lands as the cancel comes completes instead of raising
    # (asyncio.wait_for's race in Python 3.11, python/cpython#86296): the loop must still end,
    # or the outer's shutdown waits on it forever.
    async def scenario() -> None:
        lease = Lease(MemoryKv(), "job", "a", lease_s=0.04)
        assert await lease.acquire(lambda: False, lambda holder: None)
        renewing = asyncio.Event()

        async def renewal_that_swallows_its_cancel() -> None:
            renewing.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

        lease.renew = renewal_that_swallows_its_cancel
        keeping = asyncio.create_task(lease.keep_alive(lambda lost: None))
        await renewing.wait()
        keeping.cancel()
        done, _ = await asyncio.wait({keeping}, timeout=10)
        assert done == {keeping} and keeping.cancelled()

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_an_outer_starts_over_malformed_lease_status_and_params_head(memory_nats, tmp_path):
    """Garbage in the lease record, both status keys and the params head: the outer counts
    them as rejections, takes the lease over once it has not changed for ``lease_s``, starts
    from version 0 and replaces the garbage with records that parse."""
    job = "garbage"
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    settings = OuterSettings(
        nats_url=memory_nats.url, job=job, model="tiny", corpus=str(corpus), lease_s=0.5
    )
    before = {name: rejected(name) for name in ("LeaseRecord", "ParamsHead")}

    async def scenario() -> tuple[OuterService, OuterStatus | None]:
        nc = await connect(settings, "garbage-writer")
        js = nc.jetstream()
        await ensure_streams(js)
        await (await js.key_value(subjects.OUTER_BUCKET)).put(subjects.lease_key(job, 0), b"{x")
        status_kv = await js.key_value(subjects.STATUS_BUCKET)
        await status_kv.put(subjects.outer_status_key(job, 0), b'{"state": 5}')
        await status_kv.put(subjects.outer_standby_key(job, "ghost"), b"\xff")
        await js.publish(subjects.params_head_subject(job, 0), b'{"version": "v"}')
        service = OuterService(settings, asyncio.Event())
        run = asyncio.create_task(service.run())

        def running() -> bool:
            assert not run.done(), run.exception()
            return service.state == "running"

        async def heartbeat_says_running() -> OuterStatus | None:
            status = (await read_job_status(nc, js, job)).outer_record()
            return status if status is not None and status.state == "running" else None

        await wait_for_async(running, 240, "the outer to start")
        status = await wait_for_async(heartbeat_says_running, 60, "its heartbeat to say running")
        head = await read_params_head(js, job, 0)
        service.stop.set()
        await run
        assert head is not None and head.version == 0
        await nc.close()
        return service, status

    service, status = asyncio.run(scenario())
    assert status is not None and status.state == "running" and status.version == 0
    assert service.progress.restored_from.kind == "new"
    assert service.lease is not None and service.lease.epoch > 1
    for name, count in before.items():
        assert rejected(name) > count, name
