"""Settings of one learner unit (flags ``diloco learner --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.settings.algorithm import InnerAlgorithmSettings, SyncSettings, check_sync_overlap
from shared.settings.codec import DownlinkSettings, UploadCodecSettings
from shared.settings.nats import ServiceSettings
from shared.settings.resources import LearnerDevices, LearnerResources
from shared.settings.workload import UnitsSettings, WorkloadSettings

#: The attacks a unit can be made to send (``services/learner/adversary.py``).
AdversaryName = Literal["none", "sign_flip", "random", "scaled", "alie", "replay", "too_frequent"]
ADVERSARIES: tuple[str, ...] = get_args(AdversaryName)


class CheckpointSettings(BaseModel):
    """How often a unit checkpoints between its sync points."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_every_s: float = Field(
        10.0,
        ge=0,
        description="seconds between checkpoints taken within a sync period (0: only at sync "
        "points); a killed unit trains again at most the steps since its newest checkpoint",
    )


class LearnerSettings(
    ServiceSettings,
    WorkloadSettings,
    UnitsSettings,
    SyncSettings,
    InnerAlgorithmSettings,
    UploadCodecSettings,
    DownlinkSettings,
    LearnerResources,
    LearnerDevices,
    CheckpointSettings,
):
    """One learner unit: which shard it trains on, its inner optimizer and how it syncs."""

    unit: int = Field(0, ge=0, description="this unit's index, 0 <= unit < num-units")
    slowdown: float = Field(
        1.0,
        ge=1.0,
        le=100.0,
        description="run this many times slower than the hardware allows (emulates older "
        "hardware; the math is unchanged)",
    )
    adversary: AdversaryName = Field(
        "none",
        description="fault injection: send this attack instead of honest uploads, with the "
        "unit's own credentials (sign_flip, random, scaled, alie, replay, too_frequent; "
        "services/learner/adversary.py), to test the outer's defences",
    )
    initial_state: str = Field(
        "running",
        description="what the unit does until a desired state is written for it: 'running' "
        "(train at once) or 'idle' (wait for a start through the gateway)",
    )
    max_unsent: int = Field(
        8, ge=1, description="unsent pseudo-gradients kept while NATS is unreachable"
    )
    status_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    flush_timeout_s: float = Field(
        15.0, ge=0, description="at the end, how long to wait for unsent uploads"
    )
    checkpoint_dir: str | None = Field(
        None,
        description="folder for the unit's checkpoint and state file (<dir>/<job>/unit-<u>/); "
        "a restarted unit resumes from it and never reuses a round number (default: none)",
    )

    @field_validator("checkpoint_dir")
    @classmethod
    def _check_checkpoint_dir(cls, value: str | None) -> str | None:
        # An empty value (e.g. DILOCO_CHECKPOINT_DIR=) means "no checkpoints".
        return value if value and value.strip() else None

    @model_validator(mode="after")
    def _check_initial_state(self) -> LearnerSettings:
        if self.initial_state not in ("running", "idle"):
            raise ValueError(f"initial-state must be running or idle, got {self.initial_state!r}")
        return self

    @model_validator(mode="after")
    def _check_unit(self) -> LearnerSettings:
        if self.unit >= self.num_units:
            raise ValueError(f"unit {self.unit} must be < num-units {self.num_units}")
        check_sync_overlap(self.mode, self.overlap_tau)
        if self.num_processes > 1 and self.mode == "sync":
            raise ValueError("--mode sync runs units of one process: leave out --num-processes")
        return self
