"""Settings of one learner unit (flags ``diloco learner --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from shared.settings import JobSettings


class LearnerSettings(JobSettings):
    """One learner unit: which shard it trains on, its inner optimizer and how it syncs."""

    unit: int = Field(0, ge=0, description="this unit's index, 0 <= unit < num-units")
    num_units: int = Field(4, ge=1, le=1024, description="number of units the corpus is split into")
    batch_size: int = Field(16, ge=1, le=4096, description="sequences per inner step")
    inner_lr: float = Field(3e-3, gt=0, le=1.0, description="peak AdamW learning rate")
    warmup_steps: int = Field(50, ge=0, description="linear warm-up steps of the inner LR")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    max_steps: int = Field(300, ge=1, description="inner steps this unit trains (cosine horizon)")
    h_steps: int = Field(
        30, ge=1, description="inner steps between two pseudo-gradient uploads (H)"
    )
    codec: str = Field("int8", description="pseudo-gradient codec: int8 or fp32")
    block_size: int = Field(256, ge=8, le=1 << 20, description="quantization block size")
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level of uploads")
    max_unsent: int = Field(
        8, ge=1, description="unsent pseudo-gradients kept while NATS is unreachable"
    )
    status_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    flush_timeout_s: float = Field(
        15.0, ge=0, description="at the end, how long to wait for unsent uploads"
    )

    @model_validator(mode="after")
    def _check_unit(self) -> LearnerSettings:
        if self.unit >= self.num_units:
            raise ValueError(f"unit {self.unit} must be < num-units {self.num_units}")
        if self.codec not in ("int8", "fp32"):
            raise ValueError(f"codec must be int8 or fp32, got {self.codec!r}")
        return self
