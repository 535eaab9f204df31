"""The units resource: one unit's health, and its transitions (start, pause, resume, stop,
quarantine).

A unit action writes the unit's desired state (KV ``diloco_desired``, key ``<job>.<unit>``),
which the unit polls. A unit of a managed job must be below the job's unit count; a unit of an
unmanaged job must have reported.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, HTTPException

from services.gateway.deps import JobName, NatsDep, RegistryDep, SettingsDep, UnitIndex
from services.gateway.jobs import UnitAction, unit_transition
from services.gateway.link import NatsHandles
from services.gateway.registry import Registry
from services.gateway.views import (
    CONFLICT,
    DEFAULT_DESIRED,
    NOT_FOUND,
    DesiredStateView,
    UnitView,
    unit_view,
)
from shared.job_status import read_job_status

router = APIRouter(tags=["units"])

#: Summary and description of each unit action's route.
UNIT_ACTIONS: dict[UnitAction, tuple[str, str]] = {
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
    "quarantine": (
        "Quarantine a misbehaving unit: the outer refuses its uploads, its NATS user is removed",
        "idle/running/paused/stopped → quarantined (final). The outer counts the unit's uploads "
        "as rejected (quarantined) from when it reads the state (within 2 s); diloco up removes "
        "the unit's NATS user and reloads nats-server, which closes its connections, and "
        "stops its learner.",
    ),
}


def never_reported(job: str, unit: int) -> HTTPException:
    """The 404 of a unit with no status record."""
    return HTTPException(status_code=404, detail=f"unit {unit} of job {job!r} has never reported")


@router.get(
    "/jobs/{job}/units/{unit}",
    response_model=UnitView,
    summary="Health of one unit: state (incl. lost), step, tokens/s, version lag, counters",
    responses={**NOT_FOUND},
)
async def get_unit_health(
    job: JobName, unit: UnitIndex, registry: RegistryDep, nats: NatsDep, settings: SettingsDep
) -> UnitView:
    """One unit's heartbeat, judged against ``--heartbeat-timeout-s`` and the outer's version."""
    status = await read_job_status(nats.nc, nats.js, job)
    entry = status.units.get(unit)
    if entry is None:
        raise never_reported(job, unit)
    desired = await registry.read_desired(job, unit)
    return unit_view(
        job,
        unit,
        entry,
        desired,
        status.outer_record(),
        settings.heartbeat_timeout_s,
        status.links.get(str(unit)),
    )


async def run_unit_action(
    registry: Registry, nats: NatsHandles, job: str, unit: int, action: UnitAction
) -> DesiredStateView:
    """Move the unit's desired state through ``action``."""
    found = await registry.read_job(job)
    reported = None
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
    else:
        entry = (await read_job_status(nats.nc, nats.js, job)).units.get(unit)
        if entry is None:
            raise never_reported(job, unit)
        # Nothing written for it yet: the unit obeys its own --initial-state, and says so.
        reported = entry.record.desired
    current = await registry.read_desired(job, unit) or reported or DEFAULT_DESIRED
    desired = unit_transition(job, unit, current, action)
    await registry.write_desired(job, [unit], desired)
    return DesiredStateView(job=job, unit=unit, desired=desired)


def unit_action_route(action: UnitAction) -> Callable[..., Awaitable[DesiredStateView]]:
    """The route function of one unit action."""

    async def unit_action(
        job: JobName, unit: UnitIndex, registry: RegistryDep, nats: NatsDep
    ) -> DesiredStateView:
        return await run_unit_action(registry, nats, job, unit, action)

    return unit_action


for _action, (_summary, _description) in UNIT_ACTIONS.items():
    router.add_api_route(
        f"/jobs/{{job}}/units/{{unit}}/{_action}",
        unit_action_route(_action),
        methods=["POST"],
        response_model=DesiredStateView,
        summary=_summary,
        description=_description + " Writes the unit's desired state (KV diloco_desired, "
        "key <job>.<unit>), which the unit polls. 404 for an unknown job or unit (a unit "
        "of an unmanaged job must have reported); 409 on an invalid transition or when "
        "the job is stopped.",
        responses={**NOT_FOUND, **CONFLICT},
        name=f"{_action}_unit",
    )
