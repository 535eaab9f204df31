"""Settings of the outer optimizer service (flags ``diloco outer --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.fragments import check_shards
from shared.records import MAX_BATCH_SIZE, MAX_OUTER_SHARDS, MAX_OUTER_UNITS, MAX_STEPS_PER_UPLOAD
from shared.settings.algorithm import InnerAlgorithmSettings, OuterAlgorithmSettings, SyncSettings
from shared.settings.codec import ParamsCodecSettings
from shared.settings.nats import ServiceSettings
from shared.settings.resources import OuterResources
from shared.settings.workload import MAX_STEPS, DataSettings, UnitsSettings, WorkloadSettings

if TYPE_CHECKING:
    from services.outer.core import OuterAlgorithm


class EvaluationSettings(BaseModel):
    """How often and on how much held-out data the outer evaluates the global params."""

    model_config = ConfigDict(extra="forbid")

    eval_every_s: float = Field(
        10.0, gt=0, description="seconds between held-out evaluations of the global params"
    )
    eval_when_idle: bool = Field(
        True,
        description="also evaluate a new version whenever no upload came for a second (the "
        "last version of a run is evaluated at once)",
    )
    eval_batches: int = Field(8, ge=1, le=1000, description="held-out batches per evaluation")
    eval_batch_size: int = Field(16, ge=1, le=4096, description="sequences per eval batch")


class WorkBoundsSettings(BaseModel):
    """The job's own bounds on the work one upload can stand for: its H and batch size, with
    the learners' defaults (``diloco up`` and the REST orchestrator pass the job's values; an
    outer started by hand must be given the learners' ``--h-steps`` and ``--batch-size``)."""

    h_steps: int = Field(
        InnerAlgorithmSettings.model_fields["h_steps"].default,
        ge=1,
        le=MAX_STEPS_PER_UPLOAD,
        description="the job's H: an upload of more inner steps is implausible_work",
    )
    inner_lr: float = Field(
        InnerAlgorithmSettings.model_fields["inner_lr"].default,
        gt=0,
        le=1.0,
        description="the learners' peak AdamW learning rate: the norm guard's prior bound",
    )
    weight_decay: float = Field(
        InnerAlgorithmSettings.model_fields["weight_decay"].default,
        ge=0,
        le=1.0,
        description="the learners' AdamW weight decay: the norm guard's prior bound",
    )
    warmup_steps: int = Field(
        InnerAlgorithmSettings.model_fields["warmup_steps"].default,
        ge=0,
        description="the learners' linear warm-up of the inner learning rate: peer review "
        "expects an upload's size from the learning rate over the steps it claims",
    )
    learner_steps: str = Field(
        "",
        max_length=MAX_OUTER_UNITS * 10,
        description="the inner steps the learners train in all, the horizon of their learning "
        "rate's cosine decay: one number for every unit, or one per unit, comma-separated "
        "(diloco up passes its units'); peer review expects an upload's size from the learning "
        "rate over the steps it claims, and without it leaves the decay out",
    )
    batch_size: int = Field(
        WorkloadSettings.model_fields["batch_size"].default,
        ge=1,
        le=MAX_BATCH_SIZE,
        description="the job's sequences per inner step: an upload claiming more tokens than "
        "its steps x this x the context length is implausible_work",
    )


class OuterSettings(
    ServiceSettings,
    DataSettings,
    UnitsSettings,
    SyncSettings,
    OuterAlgorithmSettings,
    ParamsCodecSettings,
    OuterResources,
    EvaluationSettings,
    WorkBoundsSettings,
):
    """The outer optimizer of one job: how it merges pseudo-gradients and reports progress."""

    shards: int = Field(
        1,
        ge=1,
        le=MAX_OUTER_SHARDS,
        description="outer shards the job's fragments are split over, each its own process "
        "(`--shard`) with its own consumer, lease, checkpoint and status: shard k owns the "
        "fragments p with p mod shards = k",
    )
    shard: int = Field(0, ge=0, lt=MAX_OUTER_SHARDS, description="the shard this outer serves")

    fetch_batch: int = Field(32, ge=1, le=1024, description="messages fetched per pull")
    commit_every_s: float = Field(
        2.0,
        ge=0,
        le=60,  # well inside the consumer's ack wait (services/outer/service.py ACK_WAIT_S)
        description="while uploads keep coming, seconds of merging between two checkpoint "
        "commits (each followed by a params publish and the uploads' acknowledgements); the "
        "outer commits at once whenever the uploads pause (no message for 0.1 s), and waits "
        "up to twice as long where a commit took more than a tenth of the interval. 0: after "
        "every fetch",
    )
    max_upload_bytes: int = Field(
        1 << 30, gt=0, description="largest pseudo-gradient message accepted"
    )
    max_pending_uploads: int = Field(
        1024,
        ge=1,
        description="incomplete uploads held in memory at once; beyond, one is dropped: the "
        "least recently active one of the unit holding the most of them",
    )
    max_pending_bytes: int = Field(
        4 << 30,
        gt=0,
        description="bytes the incomplete uploads hold in memory at once (each is allocated "
        "whole at its first chunk); beyond, one is dropped as for --max-pending-uploads. At "
        "least --max-upload-bytes",
    )
    status_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    lease_s: float = Field(
        10.0,
        ge=0.5,
        le=600,
        description="seconds without a lease renewal after which a standby outer takes over",
    )

    def outer_algorithm(self) -> OuterAlgorithm:
        """The algorithm the outer core runs for this job (its mode and units included)."""
        from services.outer.norm_guard import InnerBound

        inner = InnerBound(
            self.inner_lr, self.weight_decay, self.warmup_steps, self.learner_horizons()
        )
        return self.algorithm(self.num_units, self, inner)

    def learner_horizons(self) -> tuple[int, ...]:
        """``--learner-steps`` as numbers (() when not given)."""
        return tuple(int(x) for x in self.learner_steps.split(",")) if self.learner_steps else ()

    @model_validator(mode="after")
    def _check_shards(self) -> OuterSettings:
        if self.shard >= self.shards:
            raise ValueError(
                f"shard {self.shard} of {self.shards}: shards are 0..{self.shards - 1}"
            )
        check_shards(self.shards, self.fragments)
        return self

    @model_validator(mode="after")
    def _check_pending_bytes(self) -> OuterSettings:
        if self.max_pending_bytes < self.max_upload_bytes:
            raise ValueError(
                f"max-pending-bytes {self.max_pending_bytes} < max-upload-bytes "
                f"{self.max_upload_bytes}: the largest upload would not fit"
            )
        return self

    @model_validator(mode="after")
    def _check_quorum(self) -> OuterSettings:
        if self.min_quorum > self.num_units:
            raise ValueError(f"min-quorum {self.min_quorum} > num-units {self.num_units}")
        return self

    @model_validator(mode="after")
    def _check_learner_steps(self) -> OuterSettings:
        try:
            horizons = self.learner_horizons()
        except ValueError:
            raise ValueError(
                f"learner-steps must be numbers like 300 or 300,150, got {self.learner_steps!r}"
            ) from None
        if len(horizons) not in (0, 1, self.num_units) or any(
            not 1 <= h <= MAX_STEPS for h in horizons
        ):
            raise ValueError(
                f"learner-steps needs one number in [1, {MAX_STEPS}], or one per unit "
                f"({self.num_units}), got {self.learner_steps!r}"
            )
        return self
