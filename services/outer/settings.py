"""Settings of the outer optimizer service (flags ``diloco outer --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import JobSettings


class OuterSettings(JobSettings):
    """The outer optimizer of one job: how it merges pseudo-gradients and reports progress."""

    outer_lr: float = Field(0.7, gt=0, le=10, description="outer SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer Nesterov momentum")
    num_units: int = Field(
        1,
        ge=1,
        le=1024,
        description="units contributing; each arrival is scaled by 1/num-units (see docs)",
    )
    staleness_exponent: float = Field(
        0.5, ge=0, le=4, description="update weight (1 + staleness)^-a; 0 disables it"
    )
    eval_every_s: float = Field(
        5.0, gt=0, description="seconds between held-out evaluations of the global params"
    )
    eval_batches: int = Field(8, ge=1, le=1000, description="held-out batches per evaluation")
    eval_batch_size: int = Field(16, ge=1, le=4096, description="sequences per eval batch")
    fetch_batch: int = Field(32, ge=1, le=1024, description="messages fetched per pull")
    max_upload_bytes: int = Field(
        1 << 30, gt=0, description="largest pseudo-gradient message accepted"
    )
    max_pending_uploads: int = Field(
        64, ge=1, description="incomplete uploads kept in memory before the oldest is dropped"
    )
    status_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
