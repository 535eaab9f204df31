"""What the gateway answers, and how each answer is built from the records it read.

One :class:`UnitView`, made by :func:`unit_view` only, is the unit in every answer (the units of
``GET /jobs/{job}`` and ``GET /jobs/{job}/metrics``, and ``GET /jobs/{job}/units/{unit}``).
Shown states come from ``shared.records.unit_liveness`` / ``outer_liveness``: ages are on the
NATS server's clock, so a writer's clock never makes it look lost or alive.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field

from shared.bandwidth import link_usage
from shared.goodput import job_goodput
from shared.job_status import JobStatus
from shared.records import Stamped
from shared.records.jobs import DesiredState, JobRecord, JobSpec, JobState
from shared.records.link import LinkStatus
from shared.records.outer import (
    LedgerRecord,
    OuterState,
    OuterStatus,
    outer_liveness,
)
from shared.records.unit import (
    AdoptionPoint,
    LatencySummary,
    UnitState,
    UnitStatus,
    unit_liveness,
)

#: What a unit does when no desired state was ever written for it, and it never reported one.
DEFAULT_DESIRED: DesiredState = "running"
#: Shown states besides the reported ones: silent for too long, or never reported.
ShownUnitState = UnitState | Literal["lost", "absent"]
ShownOuterState = OuterState | Literal["lost", "absent"]
AGE_DIGITS = 3


class ErrorView(BaseModel):
    """Why a request was refused."""

    detail: str = Field(
        description="what is wrong, naming the job, unit or state",
        examples=["cannot resume job 'demo' in state 'running' (allowed: pause, stop)"],
    )


def refusal(status: int, description: str) -> dict[int | str, dict[str, Any]]:
    """An OpenAPI ``responses`` entry: ``status`` answers an :class:`ErrorView`."""
    return {status: {"model": ErrorView, "description": description}}


NOT_FOUND = refusal(404, "no such job or unit")
CONFLICT = refusal(409, "not allowed in the current state (the message says why)")


# ---- units -----------------------------------------------------------------------------------


class LinkView(BaseModel):
    """A unit's shaped link, as measured at the link (``diloco link``) since it started."""

    link: str = Field(description="RATE/DELAY[/JITTER]", examples=["20mbit/50ms"])
    rate_bps: float | None = Field(None, description="cap of each direction (None: no cap)")
    delay_s: float = Field(0.0, description="one-way delay")
    bytes_up: int = Field(description="bytes from the unit towards NATS")
    bytes_down: int = Field(description="bytes from NATS towards the unit")
    bytes_per_token: float | None = Field(
        None, description="(bytes up + down) / tokens the unit trained"
    )
    data_parallel_bytes_per_token: float | None = Field(
        None,
        description="bytes per token each worker would send plus receive under data-parallel "
        "training of the same model and units (fp32 ring all-reduce every step)",
    )
    times_less_than_data_parallel: float | None = Field(
        None, description="data_parallel_bytes_per_token / bytes_per_token"
    )
    utilisation_up: float | None = Field(
        None, description="share of time the up direction was busy (None: no cap)"
    )
    utilisation_down: float | None = Field(
        None, description="share of time the down direction was busy (None: no cap)"
    )
    outage: str | None = Field(None, description="the outage in progress (stall or cut)")
    outages: int = Field(0, description="outages begun so far")
    connects: int = Field(0, description="connections accepted")
    report_age_s: float = Field(description="seconds since the link last reported")


def link_view(entry: Stamped[LinkStatus], unit: UnitStatus | None) -> LinkView:
    """A link's status record as the gateway shows it, per token of its unit (``unit``: the
    unit's status record; None when it never reported)."""
    record = entry.record
    usage = link_usage(record, unit)
    busy = record.utilisation()

    def rounded(value: float | None, digits: int) -> float | None:
        return round(value, digits) if value is not None else None

    return LinkView(
        link=record.spec.text(),
        rate_bps=record.spec.rate_bps,
        delay_s=record.spec.delay_s,
        bytes_up=record.bytes_up,
        bytes_down=record.bytes_down,
        bytes_per_token=rounded(usage.bytes_per_token, 3),
        data_parallel_bytes_per_token=rounded(usage.data_parallel_bytes_per_token, 1),
        times_less_than_data_parallel=rounded(usage.times_less, 1),
        utilisation_up=rounded(busy[0], 4) if busy is not None else None,
        utilisation_down=rounded(busy[1], 4) if busy is not None else None,
        outage=record.outage,
        outages=record.outages,
        connects=record.connects,
        report_age_s=round(entry.age_s, AGE_DIGITS),
    )


class UnitView(BaseModel):
    """One unit: its liveness, progress, lag behind the global version and counters."""

    job: str = Field(examples=["demo"])
    unit: int = Field(description="unit index", examples=[0])
    state: ShownUnitState = Field(
        description="reported state (starting, idle, running, paused, finishing, finished, "
        "stopped); 'lost' when its heartbeat is older than --heartbeat-timeout-s; 'absent' "
        "when it never reported",
        examples=["running"],
    )
    reported_state: UnitState | None = Field(
        None, description="the state in the unit's last heartbeat (None: never reported)"
    )
    desired: DesiredState = Field(
        description="desired state written through the gateway (else the one the unit reports, "
        "else running)"
    )
    lost: bool = Field(False, description="state is 'lost'")
    heartbeat_age_s: float | None = Field(
        None, description="seconds since its last heartbeat, on the NATS server's clock"
    )
    last_heartbeat: float | None = Field(
        None, description="the NATS server's time of its last heartbeat (unix seconds)"
    )
    step: int | None = None
    max_steps: int | None = None
    round: int | None = Field(None, description="the next round number the unit hands out")
    tokens: int | None = Field(None, description="tokens trained, across restarts")
    tokens_per_s: float | None = None
    train_loss: float | None = None
    base_version: int | None = Field(None, description="global version its params are based on")
    outer_version: int | None = Field(None, description="the outer's global version")
    version_lag: int | None = Field(None, description="outer_version minus base_version")
    adoptions: list[AdoptionPoint] = Field(
        [], description="the unit's newest adoptions of global versions (step, version, skipped)"
    )
    applied: int = Field(0, description="uploads of this unit the outer has applied")
    last_staleness: int | None = Field(None, description="staleness of its last applied upload")
    rejected: dict[str, int] = Field(
        {}, description="uploads of this unit the outer rejected, by reason"
    )
    clipped: int = Field(0, description="applied uploads of this unit the norm guard scaled down")
    published: int = Field(0, description="uploads published by the unit's process")
    bytes_sent: int = Field(0, description="bytes published to NATS (all chunks)")
    payload_bytes_encoded: int = Field(0, description="encoded pseudo-gradient bytes")
    fp32_bytes_encoded: int = Field(0, description="the same tensors' size in fp32")
    unsent: int | None = Field(None, description="uploads queued but not yet published")
    last_error: str | None = None
    counters: dict[str, int] = Field({}, description="this process's counters")
    lifetime: dict[str, int] | None = Field(None, description="upload counters across restarts")
    upload_latency: LatencySummary | None = Field(
        None, description="recent uploads: training loop → accepted by JetStream (its clock)"
    )
    params_latency: LatencySummary | None = Field(
        None, description="recent globals: head notification → taken by the training loop"
    )
    sync_latency: LatencySummary | None = Field(
        None, description="recent uploads: sync point → first params head that includes them"
    )
    network_wait_s: float | None = Field(
        None, description="seconds the training loop spent in calls to the NATS link"
    )
    sync_wait_s: float | None = Field(
        None, description="seconds the training loop waited at sync points (--mode sync)"
    )
    goodput: float | None = Field(
        None,
        description="tokens of this unit the outer applied ÷ what it could have trained at its "
        "healthy speed since it first trained (shared/goodput.py)",
    )
    link: LinkView | None = Field(None, description="its shaped link (None: it has none)")

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "job": "demo",
                    "unit": 1,
                    "state": "running",
                    "reported_state": "running",
                    "desired": "running",
                    "lost": False,
                    "heartbeat_age_s": 0.7,
                    "last_heartbeat": 1764490000.0,
                    "step": 120,
                    "max_steps": 1000,
                    "round": 24,
                    "tokens": 49152,
                    "tokens_per_s": 1498.2,
                    "train_loss": 3.1,
                    "base_version": 40,
                    "outer_version": 42,
                    "version_lag": 2,
                    "applied": 23,
                    "last_staleness": 1,
                    "rejected": {"too_stale": 1},
                    "clipped": 0,
                    "published": 24,
                    "bytes_sent": 300000,
                    "payload_bytes_encoded": 290000,
                    "fp32_bytes_encoded": 1160000,
                    "unsent": 0,
                    "last_error": None,
                    "counters": {"published": 24, "bytes_sent": 300000},
                    "lifetime": {"published": 24},
                }
            ]
        }
    }


def version_lag(outer: OuterStatus | None, status: UnitStatus) -> int | None:
    """The outer's version minus the version the unit's params are based on (None: no outer).

    The outer publishes a params version before the status record that names it, so a unit can
    be based on a version newer than the status shows; its lag is then 0, never negative.
    """
    return max(0, outer.version - status.base_version) if outer is not None else None


def unit_view(
    job: str,
    unit: int,
    entry: Stamped[UnitStatus] | None,
    desired: DesiredState | None,
    outer: OuterStatus | None,
    timeout_s: float,
    link: Stamped[LinkStatus] | None = None,
    goodput: float | None = None,
) -> UnitView:
    """One unit as the gateway shows it.

    Args:
        job: the job's name.
        unit: the unit's index.
        entry: its status record with its age (None: it never reported).
        desired: the desired state written for it (None: none written).
        outer: the outer's status record, for its ledger of the unit and its version.
        timeout_s: heartbeat age past which a unit that has not ended is lost.
        link: its shaped link's status record with its age (None: it has none).
        goodput: its goodput (None: not known yet).
    """
    state = unit_liveness(entry, timeout_s)
    ledger = outer.unit_ledger(unit) if outer is not None else None
    shown: dict[str, Any] = {
        "job": job,
        "unit": unit,
        "state": state,
        "lost": state == "lost",
        "outer_version": outer.version if outer is not None else None,
        "applied": ledger.applied if ledger is not None else 0,
        "last_staleness": ledger.last_staleness if ledger is not None else None,
        "rejected": dict(ledger.rejected) if ledger is not None else {},
        "clipped": ledger.clipped if ledger is not None else 0,
    }
    if entry is None:
        if link is not None:
            shown["link"] = link_view(link, None)
        return UnitView(desired=desired or DEFAULT_DESIRED, **shown)
    status = entry.record
    if link is not None:
        shown["link"] = link_view(link, status)
    return UnitView(
        reported_state=status.state,
        desired=desired or status.desired,
        heartbeat_age_s=round(entry.age_s, AGE_DIGITS),
        last_heartbeat=entry.stamp,
        step=status.step,
        max_steps=status.max_steps,
        round=status.round,
        tokens=status.tokens,
        tokens_per_s=status.tokens_per_s,
        train_loss=status.train_loss,
        base_version=status.base_version,
        version_lag=version_lag(outer, status),
        adoptions=status.adoptions,
        published=status.counter("published"),
        bytes_sent=status.counter("bytes_sent"),
        payload_bytes_encoded=status.counter("payload_bytes_encoded"),
        fp32_bytes_encoded=status.counter("fp32_bytes_encoded"),
        unsent=status.unsent,
        last_error=status.last_error or None,
        counters=status.counters,
        lifetime=status.lifetime,
        upload_latency=status.upload_latency,
        params_latency=status.params_latency,
        sync_latency=status.sync_latency,
        network_wait_s=round(status.network_wait_s, 6),
        sync_wait_s=round(status.sync_wait_s, 3),
        goodput=None if goodput is None else round(goodput, 4),
        **shown,
    )


def unit_views(
    status: JobStatus,
    indexes: set[int],
    desired: Mapping[int, DesiredState],
    timeout_s: float,
) -> list[UnitView]:
    """:func:`unit_view` of each of ``indexes``, in order."""
    outer = status.outer_record()
    goodput = job_goodput(status)
    return [
        unit_view(
            status.job,
            unit,
            status.units.get(unit),
            desired.get(unit),
            outer,
            timeout_s,
            status.links.get(str(unit)),
            goodput.units.get(unit) if goodput is not None else None,
        )
        for unit in sorted(indexes)
    ]


# ---- the outer -------------------------------------------------------------------------------


def books(outer: OuterStatus | None) -> LedgerRecord:
    """The outer's books (empty ones before any outer reported)."""
    return outer if outer is not None else LedgerRecord()


def eval_losses(outer: OuterStatus | None) -> tuple[float | None, float | None]:
    """``(initial, last)`` held-out loss in nats per byte (None: not evaluated)."""
    if outer is None:
        return None, None
    evaluation = outer.evaluation
    initial = evaluation.init.nats_per_byte if evaluation.init is not None else None
    last = evaluation.last.nats_per_byte if evaluation.last is not None else None
    return initial, last


def job_goodput_value(status: JobStatus) -> float | None:
    """The job's goodput, rounded for showing (None: not known yet)."""
    goodput = job_goodput(status)
    return None if goodput is None or goodput.job is None else round(goodput.job, 4)


# ---- jobs ------------------------------------------------------------------------------------


class JobRecordView(BaseModel):
    """A job's registry record."""

    job: str = Field(examples=["demo"])
    state: JobState = Field(description="created, running, paused or stopped")
    units: int = Field(description="current number of units", examples=[4])
    spec: JobSpec = Field(description="the job's definition (spec.units: the initial count)")
    created: float = Field(description="creation time, seconds since the epoch")
    updated: float = Field(description="time of the last change, seconds since the epoch")


def record_view(record: JobRecord) -> JobRecordView:
    """A registry record as the API shows it."""
    return JobRecordView(
        job=record.spec.job,
        state=record.state,
        units=record.units,
        spec=record.spec,
        created=record.created,
        updated=record.updated,
    )


class JobView(BaseModel):
    """A job's global state and its units (plus its registry record when it is managed)."""

    job: str = Field(examples=["demo"])
    version: int | None = Field(description="newest global version (None: no outer yet)")
    outer_state: ShownOuterState = Field(description="outer's reported state, 'lost' or 'absent'")
    outer_alive: bool = Field(description="the outer's heartbeat is fresh")
    eval_nats_per_byte: float | None = Field(description="last held-out loss")
    eval_init_nats_per_byte: float | None = Field(description="held-out loss at version 0")
    applied: int
    rejected: dict[str, int]
    goodput: float | None = Field(
        None,
        description="tokens the outer applied ÷ what the units could have trained at their "
        "healthy speeds since each first trained (shared/goodput.py)",
    )
    units: list[UnitView]
    managed: bool = Field(False, description="created through POST /jobs (has a registry record)")
    state: JobState | None = Field(None, description="registry state (None when unmanaged)")
    unit_count: int | None = Field(None, description="current number of units (managed jobs)")
    spec: JobSpec | None = Field(None, description="the job's definition (managed jobs)")
    created: float | None = None
    updated: float | None = None


def job_view(
    status: JobStatus,
    record: JobRecord | None,
    desired: Mapping[int, DesiredState],
    timeout_s: float,
) -> JobView:
    """A job: every reporting unit, and every unit up to a managed job's unit count.

    Args:
        status: the job's status records.
        record: its registry record (None: unmanaged).
        desired: the desired states written for its units.
        timeout_s: heartbeat age past which a writer is lost.
    """
    outer = status.outer_record()
    indexes = set(status.units) | set(range(record.units if record is not None else 0))
    shown = outer_liveness(status.outer, timeout_s)
    initial, last = eval_losses(outer)
    return JobView(
        job=status.job,
        version=outer.version if outer is not None else None,
        outer_state=shown,
        outer_alive=shown not in ("lost", "absent"),
        eval_nats_per_byte=last,
        eval_init_nats_per_byte=initial,
        applied=books(outer).applied,
        rejected=books(outer).rejected,
        goodput=job_goodput_value(status),
        units=unit_views(status, indexes, desired, timeout_s),
        managed=record is not None,
        state=record.state if record is not None else None,
        unit_count=record.units if record is not None else None,
        spec=record.spec if record is not None else None,
        created=record.created if record is not None else None,
        updated=record.updated if record is not None else None,
    )


class DesiredStateView(BaseModel):
    """The desired state written for a unit."""

    job: str = Field(examples=["demo"])
    unit: int = Field(examples=[0])
    desired: DesiredState = Field(examples=["paused"])
