"""A job's status records, read in one go: the outer's and every unit's, each with its age.

The gateway, ``diloco up`` and the tests all read a job's liveness and progress through
:func:`read_job_status`, so they see the same thing and judge it by the same rule
(``shared.records.unit_liveness`` / ``outer_liveness``, on the NATS server's clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from shared import kv, records, subjects
from shared.outer_shards import combine_stamped
from shared.records import JOB_NAME_PATTERN, R, Stamped
from shared.records.link import LinkStatus
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStatus


@dataclass(frozen=True)
class JobStatus:
    """What the status bucket held about one job when it was read.

    Attributes:
        job: the job's name.
        outer: the outer's status, its shards' combined (``shared.outer_shards``; None: shard
            0 never reported).
        units: each reporting unit's status, by unit index.
        links: each shaped link's counters, by link name (a unit index or ``outer``).
        server_time: the NATS server's clock at the read (unix seconds).
    """

    job: str
    outer: Stamped[OuterStatus] | None = None
    units: dict[int, Stamped[UnitStatus]] = field(default_factory=dict)
    links: dict[str, Stamped[LinkStatus]] = field(default_factory=dict)
    server_time: float = 0.0

    @property
    def found(self) -> bool:
        """Whether anything of this job has ever reported."""
        return self.outer is not None or bool(self.units)

    def unit_records(self) -> dict[int, UnitStatus]:
        """Every unit's status record, without the stamps."""
        return {unit: entry.record for unit, entry in self.units.items()}

    def outer_record(self) -> OuterStatus | None:
        """The outer's status record, without the stamp."""
        return self.outer.record if self.outer is not None else None


async def read_job_status(nc: NatsClient, js: JetStreamContext, job: str) -> JobStatus:
    """Read the outer's, every unit's and every shaped link's status record of ``job``.

    A malformed record reads as missing (and is counted, see ``shared.records``).

    Raises:
        kv.KvError, TimeoutError, nats.errors.Error: the bucket cannot be read.
    """
    bucket = subjects.STATUS_BUCKET
    view = await kv.snapshot(nc, bucket, prefix=f"{job}.")

    async def read(key: str, model: type[R], field: str, named: object) -> Stamped[R] | None:
        """The record under ``key``, if its ``field`` agrees with the key (``named``)."""
        entry = await kv.read_stamped(js, bucket, key, model, view.server_time)
        if entry is not None and getattr(entry.record, field) != named:
            records.rejections.add(model.__name__, f"{field} differs from its key", key)
            return None
        return entry

    shards: list[Stamped[OuterStatus]] = []
    units: dict[int, Stamped[UnitStatus]] = {}
    links: dict[str, Stamped[LinkStatus]] = {}
    for key in view.keys:
        if (shard := subjects.shard_of_outer_status_key(job, key)) is not None:
            if (outer := await read(key, OuterStatus, "shard", shard)) is not None:
                shards.append(outer)
        elif (name := subjects.link_of_status_key(job, key)) is not None:
            if (link := await read(key, LinkStatus, "name", name)) is not None:
                links[name] = link
        elif (unit := subjects.unit_of_status_key(job, key)) is not None and (
            entry := await read(key, UnitStatus, "unit", unit)
        ) is not None:
            units[unit] = entry
    return JobStatus(job, combine_stamped(shards), units, links, view.server_time)


async def jobs_with_status(nc: NatsClient) -> list[str]:
    """Every job that has a record in the status bucket, by name."""
    view = await kv.snapshot(nc, subjects.STATUS_BUCKET)
    jobs = {key.split(".", 1)[0] for key in view.keys}
    return sorted(job for job in jobs if JOB_NAME_PATTERN.match(job))
