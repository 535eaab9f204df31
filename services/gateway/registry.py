"""The job registry in KV (bucket ``diloco_jobs``) and the units' desired states
(bucket ``diloco_desired``), as the gateway reads and writes them.

Registry record, key ``<job>``::

    {"spec": {...JobSpec...}, "state": "created"|"running"|"paused"|"stopped",
     "units": 4, "created": 1712345678.9, "updated": 1712345690.1}

Every change of a record is a compare-and-set on the revision it was read at, so two
concurrent calls can never both pass a transition check: the loser gets :class:`Conflict`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import nats.js.errors

from services.gateway.jobs import JobRecord, JobSpec
from services.gateway.link import KV_TIMEOUT_S, NatsLink
from shared import subjects, transport


class Conflict(RuntimeError):
    """The record exists already, or changed since it was read (HTTP 409)."""


def _encode(record: JobRecord) -> bytes:
    return record.model_dump_json().encode()


async def read_job(link: NatsLink, job: str) -> tuple[JobRecord, int] | None:
    """The job's registry record and its revision, or None if it was never created (or
    was deleted)."""
    try:
        entry = await asyncio.wait_for(link.jobs_kv.get(subjects.job_key(job)), KV_TIMEOUT_S)
    except nats.js.errors.KeyNotFoundError:
        return None
    if not entry.value:
        return None
    return JobRecord.model_validate_json(entry.value), entry.revision


async def list_jobs(link: NatsLink) -> list[JobRecord]:
    """Every job in the registry, by name."""
    keys = await asyncio.wait_for(transport.kv_keys(link.jobs_kv), KV_TIMEOUT_S)
    records = []
    for key in sorted(keys):
        found = await read_job(link, key)
        if found is not None:
            records.append(found[0])
    return records


async def create_job(link: NatsLink, spec: JobSpec) -> JobRecord:
    """Store a new job in state ``created``.

    Raises:
        Conflict: when a job of that name exists.
    """
    now = time.time()
    record = JobRecord(spec=spec, state="created", units=spec.units, created=now, updated=now)
    try:
        await asyncio.wait_for(
            link.jobs_kv.create(subjects.job_key(spec.job), _encode(record)), KV_TIMEOUT_S
        )
    except nats.js.errors.KeyWrongLastSequenceError:
        raise Conflict(f"job {spec.job!r} exists already (DELETE it first)") from None
    return record


async def replace_job(link: NatsLink, record: JobRecord, revision: int) -> JobRecord:
    """Write ``record`` (with a new ``updated`` time) if the stored one is still at ``revision``.

    Raises:
        Conflict: when the record changed since it was read.
    """
    record = record.model_copy(update={"updated": time.time()})
    try:
        await asyncio.wait_for(
            link.jobs_kv.update(subjects.job_key(record.spec.job), _encode(record), revision),
            KV_TIMEOUT_S,
        )
    except nats.js.errors.KeyWrongLastSequenceError:
        raise Conflict(f"job {record.spec.job!r} changed concurrently; try again") from None
    return record


async def delete_job(link: NatsLink, job: str, revision: int) -> None:
    """Delete the job's record if it is still at ``revision``.

    Raises:
        Conflict: when the record changed since it was read.
    """
    try:
        await asyncio.wait_for(
            link.jobs_kv.delete(subjects.job_key(job), last=revision), KV_TIMEOUT_S
        )
    except nats.js.errors.KeyWrongLastSequenceError:
        raise Conflict(f"job {job!r} changed concurrently; try again") from None


async def read_desired(link: NatsLink, job: str, unit: int) -> str | None:
    """A unit's desired state, or None when none was ever written (units then run)."""
    record = await asyncio.wait_for(
        transport.get_json(link.desired_kv, subjects.desired_key(job, unit)), KV_TIMEOUT_S
    )
    state = (record or {}).get("state")
    return state if state in transport.DESIRED_STATES else None


async def write_desired(link: NatsLink, job: str, units: Iterable[int], state: str) -> None:
    """Write the same desired state for each of ``units``."""
    for unit in units:
        await asyncio.wait_for(
            transport.put_desired(link.desired_kv, job, unit, state), KV_TIMEOUT_S
        )
