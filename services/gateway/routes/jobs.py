"""The jobs resource: the registry (create, list, show, delete), job transitions and scaling.

A job created through ``POST /jobs`` is *managed*: it has a registry record and its units'
desired states follow its transitions. A job that only has status records (started by
``diloco up`` or by hand) is *unmanaged*: ``GET /jobs/{job}`` shows it and its reported units
can be controlled one by one (``routes/units.py``), but it has no spec to change.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Body, HTTPException
from pydantic import BaseModel, Field

from services.gateway.deps import JobName, NatsDep, RegistryDep, SettingsDep
from services.gateway.jobs import DELETABLE, UNIT_DESIRED_FOR_JOB, Action, job_transition
from services.gateway.link import NatsHandles
from services.gateway.registry import Registry
from services.gateway.views import (
    CONFLICT,
    NOT_FOUND,
    JobRecordView,
    JobView,
    job_view,
    record_view,
)
from shared import data
from shared.job_status import read_job_status
from shared.records import MAX_UNITS
from shared.records.jobs import FINAL_DESIRED, JobRecord, JobSpec

router = APIRouter(tags=["jobs"])

#: Summary and description of each job action's route.
JOB_ACTIONS: dict[Action, tuple[str, str]] = {
    "start": ("Start a created job", "created → running; every unit's desired → running."),
    "pause": ("Pause a running job", "running → paused; every unit's desired → paused."),
    "resume": ("Resume a paused job", "paused → running; every unit's desired → running."),
    "stop": (
        "Stop a job for good",
        "created/running/paused → stopped; every unit's desired → stopped (units upload "
        "what they have and exit).",
    ),
}


class ScaleRequest(BaseModel):
    """The number of units a job should have."""

    units: int = Field(ge=1, le=MAX_UNITS, description="new number of units", examples=[6])


async def managed(registry: Registry, nats: NatsHandles, job: str) -> tuple[JobRecord, int]:
    """The job's registry record and revision; 404 for an unknown job, 409 for an unmanaged
    one."""
    found = await registry.read_job(job)
    if found is not None:
        return found
    status = await read_job_status(nats.nc, nats.js, job)
    if not status.found:
        raise HTTPException(status_code=404, detail=f"job {job!r} not found")
    raise HTTPException(
        status_code=409,
        detail=f"job {job!r} was not created through POST /jobs (it is run by 'diloco up' or "
        "by hand): control its units one by one",
    )


@router.post(
    "/jobs",
    status_code=201,
    response_model=JobRecordView,
    summary="Create a job",
    description="Store a validated job spec in the registry (state `created`) and set "
    "each of its units' desired state to `idle`. 409 if the job exists; 422 if its corpus "
    "does not resolve to a file or folder inside the gateway's `--data-root` (a gateway "
    "without one takes no corpus paths).",
    responses={**CONFLICT},
)
async def create_job(spec: JobSpec, registry: RegistryDep, settings: SettingsDep) -> JobRecordView:
    """Register ``spec`` as a new job (its corpus, if any, resolved inside ``--data-root``)."""
    if spec.corpus is not None:
        try:
            path = data.corpus_within(spec.corpus, settings.data_root)
        except data.CorpusError as err:
            raise HTTPException(status_code=422, detail=str(err)) from None
        spec = spec.model_copy(update={"corpus": str(path)})
    record = await registry.create_job(spec)
    await registry.write_desired(spec.job, range(spec.units), "idle")
    return record_view(record)


@router.get(
    "/jobs",
    response_model=list[JobRecordView],
    summary="List the jobs of the registry",
    description="Every job created through POST /jobs, by name (unmanaged jobs, e.g. the "
    "one of `diloco up`, are not listed; GET /jobs/{job} shows them).",
)
async def list_jobs(registry: RegistryDep) -> list[JobRecordView]:
    """Every registry record."""
    return [record_view(record) for record in await registry.list_jobs()]


@router.get(
    "/jobs/{job}",
    response_model=JobView,
    summary="Global version, unit states and the registry record",
    description="Live view from the status heartbeats (outer and units) and, for a "
    "managed job, its spec, state and every unit up to its unit count.",
    responses={**NOT_FOUND},
)
async def get_job(
    job: JobName, registry: RegistryDep, nats: NatsDep, settings: SettingsDep
) -> JobView:
    """The job's status records joined with its registry record."""
    found = await registry.read_job(job)
    status = await read_job_status(nats.nc, nats.js, job)
    if found is None and not status.found:
        raise HTTPException(status_code=404, detail=f"job {job!r} not found")
    record = found[0] if found is not None else None
    units = set(status.units) | set(range(record.units if record is not None else 0))
    desired = await registry.desired_states(job, units)
    return job_view(status, record, desired, settings.heartbeat_timeout_s)


@router.delete(
    "/jobs/{job}",
    response_model=JobRecordView,
    summary="Delete a created or stopped job",
    description="Remove the job from the registry and set its units' desired state to "
    "`stopped`. 409 unless the job is `created` or `stopped`.",
    responses={**NOT_FOUND, **CONFLICT},
)
async def delete_job(job: JobName, registry: RegistryDep, nats: NatsDep) -> JobRecordView:
    """Delete the job's record and stop its units."""
    record, revision = await managed(registry, nats, job)
    if record.state not in DELETABLE:
        raise HTTPException(
            status_code=409, detail=f"job {job!r} is {record.state}: stop it before deleting it"
        )
    await registry.delete_job(job, revision)
    await registry.write_desired(job, range(record.units), "stopped")
    return record_view(record)


async def run_job_action(
    registry: Registry, nats: NatsHandles, job: str, action: Action
) -> JobRecordView:
    """Move the job through ``action`` and write the matching desired state to its units.

    A unit stopped or quarantined on its own stays so (both are final).
    """
    record, revision = await managed(registry, nats, job)
    state = job_transition(job, record.state, action)
    record = await registry.replace_job(record.model_copy(update={"state": state}), revision)
    for unit in range(record.units):
        if await registry.read_desired(job, unit) not in FINAL_DESIRED:
            await registry.write_desired(job, [unit], UNIT_DESIRED_FOR_JOB[state])
    return record_view(record)


def job_action_route(action: Action) -> Callable[..., Awaitable[JobRecordView]]:
    """The route function of one job action."""

    async def job_action(job: JobName, registry: RegistryDep, nats: NatsDep) -> JobRecordView:
        return await run_job_action(registry, nats, job, action)

    return job_action


for _action, (_summary, _description) in JOB_ACTIONS.items():
    router.add_api_route(
        f"/jobs/{{job}}/{_action}",
        job_action_route(_action),
        methods=["POST"],
        response_model=JobRecordView,
        summary=_summary,
        description=_description + " Units stopped on their own stay stopped. 409 on an "
        "invalid transition or for a job not created through POST /jobs.",
        responses={**NOT_FOUND, **CONFLICT},
        name=f"{_action}_job",
    )


@router.put(
    "/jobs/{job}/units",
    response_model=JobRecordView,
    summary="Scale a job to N units",
    description="New units get the desired state of the job's state (created → idle, "
    "running → running, paused → paused); removed units (the highest indexes) get "
    "`stopped` (a quarantined one stays quarantined). 409 for a stopped or unmanaged job.",
    responses={**NOT_FOUND, **CONFLICT},
)
async def scale_units(
    job: JobName,
    registry: RegistryDep,
    nats: NatsDep,
    request: Annotated[ScaleRequest, Body(examples=[{"units": 6}])],
) -> JobRecordView:
    """Change the job's unit count and the desired states of the units added or removed."""
    record, revision = await managed(registry, nats, job)
    if record.state == "stopped":
        raise HTTPException(status_code=409, detail=f"job {job!r} is stopped")
    old, new = record.units, request.units
    record = await registry.replace_job(record.model_copy(update={"units": new}), revision)
    if new > old:
        await registry.write_desired(job, range(old, new), UNIT_DESIRED_FOR_JOB[record.state])
    else:
        for unit in range(new, old):  # a quarantined unit stays so
            if await registry.read_desired(job, unit) != "quarantined":
                await registry.write_desired(job, [unit], "stopped")
    return record_view(record)
