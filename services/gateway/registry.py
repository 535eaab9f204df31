"""The job registry (KV ``diloco_jobs``, key ``<job>``: a ``JobRecord``) and the units' desired
states (KV ``diloco_desired``, key ``<job>.<unit>``: a ``DesiredRecord``), as the gateway reads
and writes them.

Every change of a job record is a compare-and-set on the revision it was read at, so two
concurrent calls can never both pass a transition check: the loser gets :class:`Conflict`.
A malformed record reads as missing (``shared.records.decode`` counts it); creating a job over
a malformed record replaces it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue

from shared import kv, records, subjects
from shared.records.jobs import DesiredRecord, DesiredState, JobRecord, JobSpec

#: JetStream's error code for a write whose expected last sequence is not the stream's.
WRONG_LAST_SEQUENCE = 10071


class Conflict(RuntimeError):
    """The record exists already, or changed since it was read (HTTP 409)."""


class Registry:
    """Job records and desired states in their KV buckets.

    Args:
        nc: the connection (listing a bucket's keys is a JetStream API request).
        jobs_kv: the ``diloco_jobs`` bucket.
        desired_kv: the ``diloco_desired`` bucket.
    """

    def __init__(self, nc: NatsClient, jobs_kv: KeyValue, desired_kv: KeyValue) -> None:
        self.nc = nc
        self.jobs_kv = jobs_kv
        self.desired_kv = desired_kv

    async def read_job(self, job: str) -> tuple[JobRecord, int] | None:
        """The job's record and its revision, or None when there is none (never created,
        deleted, or malformed)."""
        found = await self._read(job)
        if found is None or found[0] is None:
            return None
        return found[0], found[1]

    async def _read(self, job: str) -> tuple[JobRecord | None, int] | None:
        """``(record, revision)``; the record is None when malformed or made for another job."""
        found = await kv.get_with_revision(self.jobs_kv, subjects.job_key(job), JobRecord)
        if found is not None and found[0] is not None and found[0].spec.job != job:
            records.rejections.add("JobRecord", "spec.job differs from its key", job)
            return None, found[1]
        return found

    async def list_jobs(self) -> list[JobRecord]:
        """Every job in the registry, by name."""
        view = await kv.snapshot(self.nc, subjects.JOBS_BUCKET)
        jobs = []
        for key in view.keys:
            found = await self.read_job(key)
            if found is not None:
                jobs.append(found[0])
        return jobs

    async def create_job(self, spec: JobSpec) -> JobRecord:
        """Store a new job in state ``created``.

        Raises:
            Conflict: a job of that name exists.
        """
        now = time.time()
        record = JobRecord(spec=spec, state="created", units=spec.units, created=now, updated=now)
        key = subjects.job_key(spec.job)
        exists = Conflict(f"job {spec.job!r} exists already (DELETE it first)")
        found = await self._read(spec.job)
        if found is not None and found[0] is not None:
            raise exists
        try:
            if found is None:
                await self.jobs_kv.create(key, records.encode(record))
            else:  # a malformed record, replaced at the revision it was read at
                await self.jobs_kv.update(key, records.encode(record), last=found[1])
        except nats.js.errors.KeyWrongLastSequenceError:
            raise exists from None
        return record

    async def replace_job(self, record: JobRecord, revision: int) -> JobRecord:
        """Store ``record`` (with a new ``updated`` time) if the stored one is still at
        ``revision``.

        Raises:
            Conflict: the record changed since it was read.
        """
        record = record.model_copy(update={"updated": time.time()})
        key = subjects.job_key(record.spec.job)
        try:
            await self.jobs_kv.update(key, records.encode(record), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise Conflict(f"job {record.spec.job!r} changed concurrently; try again") from None
        return record

    async def delete_job(self, job: str, revision: int) -> None:
        """Delete the job's record if it is still at ``revision``.

        Raises:
            Conflict: the record changed since it was read.
        """
        try:
            await self.jobs_kv.delete(subjects.job_key(job), last=revision)
        except nats.js.errors.BadRequestError as err:
            # nats-py's delete(last=) raises the server's "wrong last sequence" (10071) as a
            # plain BadRequestError, not as KeyWrongLastSequenceError as update() does.
            if err.err_code != WRONG_LAST_SEQUENCE:
                raise
            raise Conflict(f"job {job!r} changed concurrently; try again") from None

    async def read_desired(self, job: str, unit: int) -> DesiredState | None:
        """A unit's desired state, or None when none was written (or it is malformed)."""
        record = await kv.get(self.desired_kv, subjects.desired_key(job, unit), DesiredRecord)
        return record.state if record is not None else None

    async def desired_states(self, job: str, units: Iterable[int]) -> dict[int, DesiredState]:
        """The desired states written for ``units`` (those with none are left out)."""
        found = {unit: await self.read_desired(job, unit) for unit in units}
        return {unit: state for unit, state in found.items() if state is not None}

    async def write_desired(self, job: str, units: Iterable[int], state: DesiredState) -> None:
        """Write the same desired state for each of ``units``."""
        record = DesiredRecord(state=state)
        for unit in units:
            await kv.put(self.desired_kv, subjects.desired_key(job, unit), record)
