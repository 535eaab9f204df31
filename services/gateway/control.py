"""Routes of jobs and units: the registry (create, list, show, delete), job and unit
transitions, scaling. The state machines are in ``jobs.py``; storage in ``registry.py``.

A job created through ``POST /jobs`` is *managed*: it has a registry record and its units'
desired states follow its transitions. A job that only has status records (started by
``diloco up`` or by hand) is *unmanaged*: ``GET /jobs/{job}`` shows it and its reported units
can be started, paused, resumed or stopped one by one, but it has no spec to change.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, HTTPException, Path
from pydantic import BaseModel, Field

from services.gateway import registry
from services.gateway.jobs import (
    DELETABLE,
    MAX_UNITS,
    UNIT_DESIRED_FOR_JOB,
    Action,
    JobRecord,
    JobSpec,
    JobState,
    TransitionError,
    UnitDesired,
    job_transition,
    unit_transition,
)
from services.gateway.link import Link, NatsLink, read_status
from services.gateway.settings import GatewaySettings
from shared.settings import JOB_NAME_PATTERN

JobName = Annotated[
    str, Path(pattern=JOB_NAME_PATTERN.pattern, description="job name", examples=["demo"])
]
UnitIndex = Annotated[int, Path(ge=0, le=1_000_000, description="unit index", examples=[0])]
DEFAULT_DESIRED = "running"  # what a unit does when no desired state was ever written


class ErrorView(BaseModel):
    """Why a request was refused."""

    detail: str = Field(
        description="what is wrong, naming the job, unit or state",
        examples=["cannot resume job 'demo' in state 'running' (allowed: pause, stop)"],
    )


class UnitView(BaseModel):
    """One unit as the gateway sees it."""

    unit: int = Field(description="unit index", examples=[0])
    state: str = Field(
        description="reported state: starting, idle, running, paused, finishing, finished, "
        "stopped; 'lost' when heartbeats stopped; 'absent' when it never reported",
        examples=["running"],
    )
    desired: str = Field(description="desired state: idle, running, paused or stopped")
    step: int | None = None
    round: int | None = None
    base_version: int | None = None
    train_loss: float | None = None
    tokens_per_s: float | None = None
    last_heartbeat: float | None = None
    heartbeat_age_s: float | None = None
    published: int = 0


class JobView(BaseModel):
    """A job's global state and its units (plus its registry record when it is managed)."""

    job: str = Field(examples=["demo"])
    version: int | None = Field(description="newest global version (None: no outer yet)")
    outer_state: str = Field(description="outer's reported state, 'lost' or 'absent'")
    outer_alive: bool
    eval_nats_per_byte: float | None
    eval_init_nats_per_byte: float | None
    applied: int
    rejected: dict[str, int]
    units: list[UnitView]
    managed: bool = Field(False, description="created through POST /jobs (has a registry record)")
    state: JobState | None = Field(None, description="registry state (None when unmanaged)")
    unit_count: int | None = Field(None, description="current number of units (managed jobs)")
    spec: JobSpec | None = Field(None, description="the job's definition (managed jobs)")
    created: float | None = None
    updated: float | None = None


class JobRecordView(BaseModel):
    """A job's registry record."""

    job: str = Field(examples=["demo"])
    state: JobState = Field(description="created, running, paused or stopped")
    units: int = Field(description="current number of units", examples=[4])
    spec: JobSpec = Field(description="the job's definition (spec.units: the initial count)")
    created: float = Field(description="creation time, seconds since the epoch")
    updated: float = Field(description="time of the last change, seconds since the epoch")

    @classmethod
    def of(cls, record: JobRecord) -> JobRecordView:
        return cls(
            job=record.spec.job,
            state=record.state,
            units=record.units,
            spec=record.spec,
            created=record.created,
            updated=record.updated,
        )


class DesiredStateView(BaseModel):
    """The desired state written for a unit."""

    job: str = Field(examples=["demo"])
    unit: int = Field(examples=[0])
    desired: UnitDesired = Field(examples=["paused"])


class ScaleRequest(BaseModel):
    """The number of units a job should have."""

    units: int = Field(ge=1, le=MAX_UNITS, description="new number of units", examples=[6])


def _error(status: int, description: str) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorView, "description": description}}


NOT_FOUND = _error(404, "no such job or unit")
CONFLICT = _error(409, "not allowed in the current state (the message says why)")


def _conflict(err: Exception) -> HTTPException:
    return HTTPException(status_code=409, detail=str(err))


async def _managed(link: NatsLink, job: str) -> tuple[JobRecord, int]:
    """The job's registry record; 404 if the job is unknown, 409 if it is unmanaged."""
    found = await registry.read_job(link, job)
    if found is not None:
        return found
    outer, units = await read_status(link, job)
    if outer is None and not units:
        raise HTTPException(status_code=404, detail=f"job {job!r} not found")
    raise HTTPException(
        status_code=409,
        detail=f"job {job!r} was not created through POST /jobs (it is run by 'diloco up' or "
        "by hand): control its units one by one",
    )


def control_router(settings: GatewaySettings) -> APIRouter:
    """The job and unit routes of a gateway with these settings."""
    router = APIRouter(tags=["jobs"])

    @router.post(
        "/jobs",
        status_code=201,
        response_model=JobRecordView,
        summary="Create a job",
        description="Store a validated job spec in the registry (state `created`) and set "
        "each of its units' desired state to `idle`. 409 if the job exists.",
        responses={**CONFLICT},
    )
    async def create_job(spec: JobSpec, link: Link) -> JobRecordView:
        try:
            record = await registry.create_job(link, spec)
        except registry.Conflict as err:
            raise _conflict(err) from None
        await registry.write_desired(link, spec.job, range(spec.units), "idle")
        return JobRecordView.of(record)

    @router.get(
        "/jobs",
        response_model=list[JobRecordView],
        summary="List the jobs of the registry",
        description="Every job created through POST /jobs, by name (unmanaged jobs, e.g. the "
        "one of `diloco up`, are not listed; GET /jobs/{job} shows them).",
    )
    async def list_jobs(link: Link) -> list[JobRecordView]:
        return [JobRecordView.of(record) for record in await registry.list_jobs(link)]

    @router.get(
        "/jobs/{job}",
        response_model=JobView,
        summary="Global version, unit states and the registry record",
        description="Live view from the status heartbeats (outer and units) and, for a "
        "managed job, its spec, state and every unit up to its unit count.",
        responses={**NOT_FOUND},
    )
    async def get_job(job: JobName, link: Link) -> JobView:
        found = await registry.read_job(link, job)
        outer, units = await read_status(link, job)
        if found is None and outer is None and not units:
            raise HTTPException(status_code=404, detail=f"job {job!r} not found")
        record = found[0] if found else None
        indexes = set(units) | set(range(record.units if record else 0))
        now = time.time()
        views = []
        for unit in sorted(indexes):
            status = units.get(unit)
            desired = (
                await registry.read_desired(link, job, unit)
                or (status or {}).get("desired")
                or DEFAULT_DESIRED
            )
            if status is None:
                views.append(UnitView(unit=unit, state="absent", desired=desired))
                continue
            age = now - status.get("time", 0)
            lost = age > settings.heartbeat_timeout_s and status.get("state") not in (
                "finished",
                "stopped",
            )
            views.append(
                UnitView(
                    unit=unit,
                    state="lost" if lost else status.get("state", "unknown"),
                    desired=desired,
                    step=status.get("step"),
                    round=status.get("round"),
                    base_version=status.get("base_version"),
                    train_loss=status.get("train_loss"),
                    tokens_per_s=status.get("tokens_per_s"),
                    last_heartbeat=status.get("time"),
                    heartbeat_age_s=round(age, 2),
                    published=status.get("counters", {}).get("published", 0),
                )
            )
        outer = outer or {}
        outer_alive = bool(outer) and now - outer.get("time", 0) <= settings.heartbeat_timeout_s
        return JobView(
            job=job,
            version=outer.get("version"),
            outer_state=outer.get("state", "absent") if outer_alive or not outer else "lost",
            outer_alive=outer_alive,
            eval_nats_per_byte=(outer.get("eval") or {}).get("nats_per_byte"),
            eval_init_nats_per_byte=(outer.get("eval_init") or {}).get("nats_per_byte"),
            applied=outer.get("applied", 0),
            rejected=outer.get("rejected", {}),
            units=views,
            managed=record is not None,
            state=record.state if record else None,
            unit_count=record.units if record else None,
            spec=record.spec if record else None,
            created=record.created if record else None,
            updated=record.updated if record else None,
        )

    @router.delete(
        "/jobs/{job}",
        response_model=JobRecordView,
        summary="Delete a created or stopped job",
        description="Remove the job from the registry and set its units' desired state to "
        "`stopped`. 409 unless the job is `created` or `stopped`.",
        responses={**NOT_FOUND, **CONFLICT},
    )
    async def delete_job(job: JobName, link: Link) -> JobRecordView:
        record, revision = await _managed(link, job)
        if record.state not in DELETABLE:
            raise HTTPException(
                status_code=409,
                detail=f"job {job!r} is {record.state}: stop it before deleting it",
            )
        try:
            await registry.delete_job(link, job, revision)
        except registry.Conflict as err:
            raise _conflict(err) from None
        await registry.write_desired(link, job, range(record.units), "stopped")
        return JobRecordView.of(record)

    async def job_action(link: NatsLink, job: str, action: Action) -> JobRecordView:
        record, revision = await _managed(link, job)
        try:
            state = job_transition(job, record.state, action)
            record = await registry.replace_job(
                link, record.model_copy(update={"state": state}), revision
            )
        except (TransitionError, registry.Conflict) as err:
            raise _conflict(err) from None
        for unit in range(record.units):
            # A unit stopped on its own stays stopped (stopped is final).
            if await registry.read_desired(link, job, unit) != "stopped":
                await registry.write_desired(link, job, [unit], UNIT_DESIRED_FOR_JOB[state])
        return JobRecordView.of(record)

    job_actions = {
        "start": ("Start a created job", "created → running; every unit's desired → running."),
        "pause": ("Pause a running job", "running → paused; every unit's desired → paused."),
        "resume": ("Resume a paused job", "paused → running; every unit's desired → running."),
        "stop": (
            "Stop a job for good",
            "created/running/paused → stopped; every unit's desired → stopped (units upload "
            "what they have and exit).",
        ),
    }

    def job_route(action: Action) -> Any:
        async def run_job_action(job: JobName, link: Link) -> JobRecordView:
            return await job_action(link, job, action)

        return run_job_action

    for action, (summary, description) in job_actions.items():
        router.add_api_route(
            f"/jobs/{{job}}/{action}",
            job_route(action),
            methods=["POST"],
            response_model=JobRecordView,
            summary=summary,
            description=description + " Units stopped on their own stay stopped. 409 on an "
            "invalid transition or for a job not created through POST /jobs.",
            responses={**NOT_FOUND, **CONFLICT},
            name=f"{action}_job",
        )

    @router.put(
        "/jobs/{job}/units",
        response_model=JobRecordView,
        summary="Scale a job to N units",
        description="New units get the desired state of the job's state (created → idle, "
        "running → running, paused → paused); removed units (the highest indexes) get "
        "`stopped`. 409 for a stopped or unmanaged job.",
        responses={**NOT_FOUND, **CONFLICT},
    )
    async def scale_units(
        job: JobName,
        link: Link,
        request: Annotated[ScaleRequest, Body(examples=[{"units": 6}])],
    ) -> JobRecordView:
        record, revision = await _managed(link, job)
        if record.state == "stopped":
            raise HTTPException(status_code=409, detail=f"job {job!r} is stopped")
        old, new = record.units, request.units
        try:
            record = await registry.replace_job(
                link, record.model_copy(update={"units": new}), revision
            )
        except registry.Conflict as err:
            raise _conflict(err) from None
        if new > old:
            await registry.write_desired(
                link, job, range(old, new), UNIT_DESIRED_FOR_JOB[record.state]
            )
        else:
            await registry.write_desired(link, job, range(new, old), "stopped")
        return JobRecordView.of(record)

    async def unit_action(link: NatsLink, job: str, unit: int, action: Action) -> DesiredStateView:
        found = await registry.read_job(link, job)
        if found is not None:
            record = found[0]
            if unit >= record.units:
                raise HTTPException(
                    status_code=404,
                    detail=f"job {job!r} has {record.units} units (0..{record.units - 1}), "
                    f"not unit {unit}",
                )
            if record.state == "stopped":
                raise HTTPException(status_code=409, detail=f"job {job!r} is stopped")
        reported = None
        if found is None:
            _, units = await read_status(link, job)
            if unit not in units:
                raise HTTPException(
                    status_code=404, detail=f"unit {unit} of job {job!r} has never reported"
                )
            # Nothing written for it yet: the unit obeys its own --initial-state, and says so.
            reported = units[unit].get("desired")
        current = await registry.read_desired(link, job, unit) or reported or DEFAULT_DESIRED
        try:
            desired = unit_transition(job, unit, current, action)
        except TransitionError as err:
            raise _conflict(err) from None
        await registry.write_desired(link, job, [unit], desired)
        return DesiredStateView(job=job, unit=unit, desired=desired)

    unit_actions = {
        "start": ("Start an idle unit", "idle → running."),
        "pause": (
            "Pause a unit: it stops training and publishing until resumed",
            "running → paused.",
        ),
        "resume": ("Resume a paused unit from where it stopped", "paused → running."),
        "stop": (
            "Stop a unit for good: it uploads what it has and exits",
            "idle/running/paused → stopped.",
        ),
    }

    def unit_route(action: Action) -> Any:
        async def run_unit_action(job: JobName, unit: UnitIndex, link: Link) -> DesiredStateView:
            return await unit_action(link, job, unit, action)

        return run_unit_action

    for action, (summary, description) in unit_actions.items():
        router.add_api_route(
            f"/jobs/{{job}}/units/{{unit}}/{action}",
            unit_route(action),
            methods=["POST"],
            response_model=DesiredStateView,
            summary=summary,
            description=description + " Writes the unit's desired state (KV diloco_desired, "
            "key <job>.<unit>), which the unit polls. 404 for an unknown job or unit (a unit "
            "of an unmanaged job must have reported); 409 on an invalid transition or when "
            "the job is stopped.",
            responses={**NOT_FOUND, **CONFLICT},
            name=f"{action}_unit",
        )

    return router
