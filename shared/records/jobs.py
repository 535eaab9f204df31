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

from shared.codec_config import CodecName
from shared.model_config import ModelSize
from shared.outer_choices import MergePolicyName, OuterOptimizerName, StalenessRuleName
from shared.records import (
    MAX_UNITS,
    JobName,
    Record,
)

#: What the gateway may ask of a unit. ``idle``: created, not training yet; ``paused``: stopped
#: training until resumed; ``stopped``: upload what is left and exit (final).
DesiredState = Literal["idle", "running", "paused", "stopped"]

DESIRED_STATES: tuple[str, ...] = get_args(DesiredState)

JobState = Literal["created", "running", "paused", "stopped"]

JOB_STATES: tuple[str, ...] = get_args(JobState)


class DesiredRecord(Record):
    """A unit's desired state, written by the gateway (or ``diloco up``), polled by the unit."""

    state: DesiredState


class JobSpec(Record):
    """Everything that defines a job. Field names are those of the services' options
    (``diloco learner/outer --help``), so a spec maps one to one onto their flags."""

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

    job: JobName = Field(
        description="job name: 1-64 letters, digits, '_' or '-', starting alphanumeric",
        examples=["demo"],
    )
    model: ModelSize = Field("small", description="model size")
    corpus: str | None = Field(
        None,
        max_length=4096,
        description="text file or folder to train on (default: the Python standard library)",
    )
    units: int = Field(4, ge=1, le=MAX_UNITS, description="number of learner units")
    h_steps: int = Field(
        30, ge=1, le=1_000_000, description="inner steps between uploads of a fragment (H)"
    )
    codec: CodecName = Field("int8", description="pseudo-gradient codec")
    outer_optimizer: OuterOptimizerName = Field("delayed_nesterov", description="outer optimizer")
    outer_lr: float = Field(0.7, gt=0, le=10, description="outer learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer (Nesterov) momentum")
    merge_policy: MergePolicyName = Field(
        "each", description="each (apply every arrival alone) or quorum (quorum + grace window)"
    )
    min_quorum: int = Field(1, ge=1, le=MAX_UNITS, description="arrivals needed for a merge (K)")
    staleness_rule: StalenessRuleName = Field(
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
        return self


class JobRecord(Record):
    """A job as the registry (KV ``diloco_jobs``, key ``<job>``) stores it."""

    spec: JobSpec = Field(description="the job's definition")
    state: JobState = Field(description="created, running, paused or stopped")
    units: int = Field(ge=1, le=MAX_UNITS, description="current number of units (after scaling)")
    created: float = Field(description="creation time, seconds since the epoch")
    updated: float = Field(description="time of the last change, seconds since the epoch")
