"""What a job is (``JobSpec``), its registry record, and the state machines of jobs and units.

Pure: no I/O. ``registry.py`` stores the records; ``control.py`` maps these rules to HTTP.

Job states::

    created ──start──▶ running ──pause──▶ paused
       │                 ▲  │               │
       │                 └──┼───resume──────┘
       └──────stop──────────┴──stop─────────┴──▶ stopped   (final; delete: created or stopped)

Unit desired states (bucket ``diloco_desired``, key ``<job>.<unit>``)::

    idle ──start──▶ running ──pause──▶ paused
     │                 ▲  │              │
     │                 └──┼──resume──────┘
     └──────stop───────────┴──stop───────┴──▶ stopped   (final: the unit flushes and exits)

``lost`` is never desired: the gateway reports it when a unit's heartbeats stop.
A job transition writes the matching desired state to every unit that is not ``stopped``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.settings import JOB_NAME_PATTERN

JobState = Literal["created", "running", "paused", "stopped"]
UnitDesired = Literal["idle", "running", "paused", "stopped"]
Action = Literal["start", "pause", "resume", "stop"]
ACTIONS: tuple[Action, ...] = ("start", "pause", "resume", "stop")
MAX_UNITS = 64

# (state, action) -> new state. Anything else is an invalid transition (HTTP 409).
JOB_TRANSITIONS: dict[tuple[str, str], JobState] = {
    ("created", "start"): "running",
    ("created", "stop"): "stopped",
    ("running", "pause"): "paused",
    ("running", "stop"): "stopped",
    ("paused", "resume"): "running",
    ("paused", "stop"): "stopped",
}
UNIT_TRANSITIONS: dict[tuple[str, str], UnitDesired] = {
    ("idle", "start"): "running",
    ("idle", "stop"): "stopped",
    ("running", "pause"): "paused",
    ("running", "stop"): "stopped",
    ("paused", "resume"): "running",
    ("paused", "stop"): "stopped",
}
# The desired state of a unit while its job is in a state (new units, job transitions).
UNIT_DESIRED_FOR_JOB: dict[str, UnitDesired] = {
    "created": "idle",
    "running": "running",
    "paused": "paused",
    "stopped": "stopped",
}
DELETABLE: tuple[JobState, ...] = ("created", "stopped")


class TransitionError(ValueError):
    """An action that the current state does not allow (HTTP 409)."""


def _next(table: dict[tuple[str, str], str], what: str, state: str, action: str) -> str:
    new = table.get((state, action))
    if new is None:
        allowed = sorted(a for (s, a) in table if s == state)
        hint = f"allowed: {', '.join(allowed)}" if allowed else f"{state} is final"
        raise TransitionError(f"cannot {action} {what} in state {state!r} ({hint})")
    return new


def job_transition(job: str, state: str, action: str) -> JobState:
    """The job's state after ``action``; raises TransitionError when not allowed."""
    return _next(JOB_TRANSITIONS, f"job {job!r}", state, action)  # type: ignore[return-value]


def unit_transition(job: str, unit: int, state: str, action: str) -> UnitDesired:
    """A unit's desired state after ``action``; raises TransitionError when not allowed."""
    return _next(UNIT_TRANSITIONS, f"unit {unit} of job {job!r}", state, action)  # type: ignore[return-value]


class JobSpec(BaseModel):
    """Everything that defines a job. Field names are those of the services' options
    (``diloco learner/outer --help``), so a spec maps one to one onto their flags."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "job": "demo",
                    "model": "tiny",
                    "units": 4,
                    "h_steps": 30,
                    "codec": "int8",
                    "outer_optimizer": "delayed_nesterov",
                    "outer_lr": 0.7,
                    "outer_momentum": 0.9,
                    "merge_policy": "each",
                    "staleness_rule": "polynomial",
                    "seed": 0,
                    "max_steps": 300,
                }
            ]
        },
    )

    job: str = Field(
        pattern=JOB_NAME_PATTERN.pattern,
        description="job name: 1-64 letters, digits, '_' or '-', starting alphanumeric",
        examples=["demo"],
    )
    model: Literal["tiny", "small", "medium", "large"] = Field(
        "small", description="model size (shared.model.SIZES)"
    )
    corpus: str | None = Field(
        None,
        max_length=4096,
        description="text file or folder to train on (default: the Python standard library)",
    )
    units: int = Field(4, ge=1, le=MAX_UNITS, description="number of learner units")
    h_steps: int = Field(
        30, ge=1, le=1_000_000, description="inner steps between uploads of a fragment (H)"
    )
    codec: Literal["fp32", "bf16", "int8", "int4", "int2"] = Field(
        "int8", description="pseudo-gradient codec (shared.codec.CODECS)"
    )
    outer_optimizer: Literal["sgd", "nesterov", "delayed_nesterov"] = Field(
        "delayed_nesterov", description="outer optimizer"
    )
    outer_lr: float = Field(0.7, gt=0, le=10, description="outer learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer (Nesterov) momentum")
    merge_policy: Literal["each", "quorum"] = Field(
        "each", description="each (apply every arrival alone) or quorum (quorum + grace window)"
    )
    min_quorum: int = Field(1, ge=1, le=MAX_UNITS, description="arrivals needed for a merge (K)")
    staleness_rule: Literal["constant", "polynomial", "hinge", "exponential"] = Field(
        "polynomial", description="how an update's weight falls with its staleness"
    )
    max_staleness: int | None = Field(
        None, ge=0, le=1_000_000, description="drop updates staler than this (default: keep all)"
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of initial params and data order")
    max_steps: int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description="inner steps each unit trains (default 300 unless token_budget is given)",
    )
    token_budget: int | None = Field(
        None,
        ge=1,
        le=10**15,
        description="tokens the whole job trains on, shared by the units (instead of max_steps)",
    )

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.max_steps is not None and self.token_budget is not None:
            raise ValueError("give max_steps or token_budget, not both")
        if self.max_steps is None and self.token_budget is None:
            self.max_steps = 300
        if self.min_quorum > self.units:
            raise ValueError(f"min_quorum {self.min_quorum} > units {self.units}")
        # The outer's own cross-field checks (e.g. quorum options), without reading env vars.
        from services.outer.settings import OuterAlgorithmSettings

        algorithm = OuterAlgorithmSettings.model_construct(
            outer_optimizer=self.outer_optimizer,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            merge_policy=self.merge_policy,
            min_quorum=self.min_quorum,
            staleness_rule=self.staleness_rule,
            max_staleness=self.max_staleness,
        )
        try:
            algorithm.algorithm(num_units=self.units)
        except (TypeError, ArithmeticError) as err:
            raise ValueError(str(err)) from err
        return self


class JobRecord(BaseModel):
    """A job as the registry (KV ``diloco_jobs``, key ``<job>``) stores it."""

    spec: JobSpec = Field(description="the job's definition")
    state: JobState = Field(description="created, running, paused or stopped")
    units: int = Field(ge=1, le=MAX_UNITS, description="current number of units (after scaling)")
    created: float = Field(description="creation time, seconds since the epoch")
    updated: float = Field(description="time of the last change, seconds since the epoch")
