"""shared.kv and shared.job_status against the in-memory NATS server: keys, typed reads, server
ages."""

from __future__ import annotations

import asyncio
import time

import nats
import nats.js.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import kv, records, subjects
from shared.job_status import jobs_with_status, read_job_status
from shared.records import Stamped
from shared.records.jobs import DesiredRecord
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStatus
from shared.transport.streams import ensure_streams


async def _connect(url: str):
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js)
    return nc, js


def test_snapshot_lists_every_key_including_deleted_ones_and_none_of_other_buckets(
    memory_nats,
) -> None:
    async def scenario() -> None:
        nc = await nats.connect(memory_nats.url)
        try:
            js = nc.jetstream()
            things = await js.create_key_value(bucket="things")
            other = await js.create_key_value(bucket="things2")
            assert (await kv.snapshot(nc, "things")).keys == []
            await other.put("elsewhere", b"1")
            for key in ("b", "a.1", "a.2", "c"):
                await things.put(key, b"x")
            await things.put("b", b"rewritten")  # one message per key (history 1)
            await things.delete("c")
            before = time.time()
            view = await kv.snapshot(nc, "things")
            after = time.time()
            assert view.keys == ["a.1", "a.2", "b", "c"]
            assert (await kv.snapshot(nc, "things", prefix="a.")).keys == ["a.1", "a.2"]
            # The server's clock at the read (the server runs on this machine's clock).
            assert before - 1e-3 <= view.server_time <= after + 1e-3
            with pytest.raises(nats.js.errors.KeyNotFoundError):  # a listed deleted key
                await things.get("c")
            # Many listings in a row see every key every time (kv.keys() could see none).
            for _ in range(50):
                assert len((await kv.snapshot(nc, "things")).keys) == 4
            with pytest.raises(kv.KvError, match="stream info"):
                await kv.snapshot(nc, "no_such_bucket")
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_typed_put_get_and_stamped_ages_on_the_server_clock(memory_nats) -> None:
    async def scenario() -> None:
        nc, js = await _connect(memory_nats.url)
        try:
            desired = await js.key_value(subjects.DESIRED_BUCKET)
            await kv.put(desired, "j.0", DesiredRecord(state="paused"))
            assert await kv.get(desired, "j.0", DesiredRecord) == DesiredRecord(state="paused")
            assert await kv.get(desired, "j.1", DesiredRecord) is None
            found = await kv.get_with_revision(desired, "j.0", DesiredRecord)
            assert found is not None and found[1] > 0
            await desired.put("j.2", b'{"state": "sideways"}')
            assert await kv.get(desired, "j.2", DesiredRecord) is None
            assert (await kv.get_with_revision(desired, "j.2", DesiredRecord))[0] is None

            status = await js.key_value(subjects.STATUS_BUCKET)
            key = subjects.unit_status_key("j", 0)
            await kv.put(status, key, UnitStatus(unit=0, step=3))
            view = await kv.snapshot(nc, subjects.STATUS_BUCKET, prefix="j.")

            async def read_at(server_time: float) -> Stamped[UnitStatus] | None:
                return await kv.read_stamped(
                    js, subjects.STATUS_BUCKET, key, UnitStatus, server_time
                )

            entry = await read_at(view.server_time)
            assert entry is not None and entry.record.step == 3 and entry.revision > 0
            # Stamped by the server when written, before the read, on the same clock.
            assert entry.stamp <= view.server_time
            assert entry.age_s == view.server_time - entry.stamp
            # The age is the given server time minus the stamp, never negative.
            later = await read_at(entry.stamp + 90.0)
            assert later is not None and later.age_s == pytest.approx(90.0)
            earlier = await read_at(entry.stamp - 5.0)
            assert earlier is not None and earlier.age_s == 0.0
            await status.delete(key)
            assert await read_at(view.server_time) is None
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_job_status_reads_every_unit_and_drops_malformed_or_inconsistent_records(
    memory_nats,
) -> None:
    async def scenario() -> None:
        nc, js = await _connect(memory_nats.url)
        try:
            status = await js.key_value(subjects.STATUS_BUCKET)
            for unit in (0, 3, 12):
                key = subjects.unit_status_key("j", unit)
                await kv.put(status, key, UnitStatus(unit=unit, state="running"))
            await kv.put(status, subjects.unit_status_key("jj", 1), UnitStatus(unit=1))
            await kv.put(
                status,
                subjects.outer_status_key("j", 0),
                OuterStatus(state="running", model="tiny", holder="h"),
            )
            await status.put(subjects.unit_status_key("j", 4), b'{"unit": 4, "step": "many"}')
            await kv.put(status, subjects.unit_status_key("j", 5), UnitStatus(unit=6))
            await status.put("j.unit.x", b"{}")
            before = records.rejections.total()
            job = await read_job_status(nc, js, "j")
            assert sorted(job.units) == [0, 3, 12] and job.found
            assert job.outer is not None and job.outer.record.state == "running"
            for entry in job.units.values():  # aged on the server's clock at the read
                assert entry.stamp <= job.server_time
                assert entry.age_s == job.server_time - entry.stamp
            assert records.rejections.total() == before + 2  # unit 4 malformed, unit 5 lies
            assert not (await read_job_status(nc, js, "nobody")).found
            assert await jobs_with_status(nc) == ["j", "jj"]
        finally:
            await nc.close()

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_malformed_status_records_never_crash_the_job_status_reader(memory_nats) -> None:
    loop = asyncio.new_event_loop()
    nc, js = loop.run_until_complete(_connect(memory_nats.url))
    status_kv = loop.run_until_complete(js.key_value(subjects.STATUS_BUCKET))

    @settings(
        max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(st.binary(max_size=200) | st.text(max_size=80).map(str.encode), st.sampled_from([0, 1]))
    def write_and_read(value: bytes, which: int) -> None:
        key = subjects.outer_status_key("f", 0) if which else subjects.unit_status_key("f", 7)

        async def once() -> None:
            await status_kv.put(key, value or b"x")
            job = await read_job_status(nc, js, "f")
            assert job.outer is None or isinstance(job.outer.record, OuterStatus)
            assert all(isinstance(e.record, UnitStatus) for e in job.units.values())

        loop.run_until_complete(once())

    try:
        write_and_read()
    finally:
        loop.run_until_complete(nc.close())
        loop.close()
