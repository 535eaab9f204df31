"""What the gateway writes: the job registry and the units' desired states.

* :class:`JobRecord` (with :class:`JobSpec`) — KV ``diloco_jobs``, ``J``: read by the gateway and
  ``diloco up`` (and the compose controller);
* :class:`DesiredRecord` — KV ``diloco_desired``, ``J.<u>``: also written by ``diloco up``, polled
  by learner u.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import (
    ConfigDict,
    Field,
    model_validator,
)

from shared.records import (
    MAX_UNITS,
    JobName,
    Record,
)
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.codec import CodecSettings
from shared.settings.workload import DEFAULT_UNITS, MAX_STEPS, BudgetSettings, WorkloadSettings

#: What the gateway may ask of a unit. ``idle``: created, not training yet; ``paused``: stopped
#: training until resumed; ``stopped``: upload what is left and exit (final); ``quarantined``:
#: the outer refuses its uploads and its NATS user is removed (final; docs/SECURITY.md).
DesiredState = Literal["idle", "running", "paused", "stopped", "quarantined"]

DESIRED_STATES: tuple[str, ...] = get_args(DesiredState)
#: The final desired states: no learner is started for such a unit, no job action changes them.
FINAL_DESIRED: tuple[DesiredState, ...] = ("stopped", "quarantined")

JobState = Literal["created", "running", "paused", "stopped"]

JOB_STATES: tuple[str, ...] = get_args(JobState)


class DesiredRecord(Record):
    """A unit's desired state, written by the gateway (or ``diloco up``), polled by the unit."""

    state: DesiredState


class JobSpec(Record, WorkloadSettings, AlgorithmSettings, CodecSettings):
    """Everything that defines a job: its name and units, and every workload, algorithm and
    codec setting (the same models, defaults and limits ``diloco up`` and the services read).
    Field names are those of the services' options (``diloco learner/outer --help``), so a
    spec maps one to one onto their flags."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "examples": [
                {
                    "job": "demo",
                    "model": "tiny",
                    "units": 4,
                    "h_steps": 30,
                    "codec": "int8",
                    "outer_optimizer": "delayed_nesterov",
                    "merge_policy": "each",
                    "max_steps": 300,
                }
            ]
        },
    )

    job: JobName = Field(
        description="job name: 1-64 letters, digits, '_' or '-', starting alphanumeric",
        examples=["demo"],
    )
    units: int = Field(DEFAULT_UNITS, ge=1, le=MAX_UNITS, description="number of learner units")
    max_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="inner steps each unit trains (default: as `diloco up`, unless "
        "token_budget is given)",
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
            self.max_steps = BudgetSettings.model_fields["max_steps"].default
        if self.min_quorum > self.units:
            raise ValueError(f"min_quorum {self.min_quorum} > units {self.units}")
        return self


class JobRecord(Record):
    """A job as the registry (KV ``diloco_jobs``, key ``<job>``) stores it."""

    spec: JobSpec = Field(description="the job's definition")
    state: JobState = Field(description="created, running, paused or stopped")
    units: int = Field(ge=1, le=MAX_UNITS, description="current number of units (after scaling)")
    created: float = Field(description="creation time, seconds since the epoch")
    updated: float = Field(description="time of the last change, seconds since the epoch")
