"""What ``diloco up`` reads of the job registry: the jobs the gateway created and their units'
desired states (KV ``diloco_jobs`` and ``diloco_desired``), as typed records.

A record that does not fit its model reads as missing (``shared.records.decode``); the gateway
writes only valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NatsClient

from shared import kv, subjects
from shared.records.jobs import DesiredRecord, DesiredState, JobRecord


@dataclass(frozen=True)
class Registry:
    """The registry's jobs and, for those not stopped, their units' desired states.

    Attributes:
        records: every job by name.
        desired: the desired state of each unit that has one, by job and unit index.
    """

    records: dict[str, JobRecord] = field(default_factory=dict)
    desired: dict[str, dict[int, DesiredState]] = field(default_factory=dict)


async def read_registry(nc: NatsClient, jobs_kv: Any, desired_kv: Any, own_job: str) -> Registry:
    """Read the registry's jobs (but ``own_job``) and the desired states of those not stopped.

    Raises:
        kv.KvError, TimeoutError, nats.errors.Error: a bucket cannot be read.
    """
    view = await kv.snapshot(nc, subjects.JOBS_BUCKET)
    registry = Registry()
    for job in view.keys:
        if job == own_job:
            continue
        record = await kv.get(jobs_kv, subjects.job_key(job), JobRecord)
        if record is None:
            continue
        registry.records[job] = record
        if record.state == "stopped":
            continue
        states = registry.desired[job] = {}
        for unit in range(record.units):
            desired = await kv.get(desired_kv, subjects.desired_key(job, unit), DesiredRecord)
            if desired is not None:
                states[unit] = desired.state
    return registry
