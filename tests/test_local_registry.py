"""What ``diloco up`` reads of the registry (``services.orchestration.registry``) from the
in-memory NATS server: the jobs but its own, and the desired states of those not stopped; malformed
records read as missing."""

from __future__ import annotations

import asyncio

from services.orchestration.registry import Registry, read_registry
from shared import kv, subjects
from shared.records.jobs import DesiredRecord, JobRecord, JobSpec
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams


def record(job: str, state: str = "running", units: int = 2) -> JobRecord:
    return JobRecord(
        spec=JobSpec(job=job, model="tiny", units=units),
        state=state,  # type: ignore[arg-type]
        units=units,
        created=0.0,
        updated=0.0,
    )


async def write_and_read(url: str) -> Registry:
    nc = await connect(NatsSettings(nats_url=url), "test-registry")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        jobs_kv = await js.key_value(subjects.JOBS_BUCKET)
        desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
        for job in (record("own"), record("a"), record("done", state="stopped")):
            await kv.put(jobs_kv, subjects.job_key(job.spec.job), job)
        await jobs_kv.put(subjects.job_key("broken"), b'{"state": "running"}')
        await kv.put(desired_kv, subjects.desired_key("a", 0), DesiredRecord(state="paused"))
        await desired_kv.put(subjects.desired_key("a", 1), b'{"state": "sleeping"}')
        await kv.put(desired_kv, subjects.desired_key("done", 0), DesiredRecord(state="stopped"))
        return await read_registry(nc, jobs_kv, desired_kv, own_job="own")
    finally:
        await nc.close()


def test_registry_holds_the_other_jobs_and_their_valid_desired_states(memory_nats):
    registry = asyncio.run(write_and_read(memory_nats.url))
    assert sorted(registry.records) == ["a", "done"]
    assert registry.records["a"] == record("a")
    assert registry.desired == {"a": {0: "paused"}}  # unit 1's record is malformed
