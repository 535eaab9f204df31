"""Settings of one learner unit (flags ``diloco learner --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.codec.config import CODECS, CodecConfig, CodecError
from shared.records import MAX_BATCH_SIZE
from shared.settings import ENV_PREFIX, JobSettings

#: Which global params a unit fetches (``services/learner/params_fetcher.py``).
ParamsFetchName = Literal["newest", "after_upload"]


class InnerSettings(BaseSettings):
    """A unit's inner optimizer and sync schedule (``diloco up`` passes these to every unit)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    batch_size: int = Field(16, ge=1, le=MAX_BATCH_SIZE, description="sequences per inner step")
    inner_lr: float = Field(3e-3, gt=0, le=1.0, description="peak AdamW learning rate")
    warmup_steps: int = Field(50, ge=0, description="linear warm-up steps of the inner LR")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    max_steps: int = Field(300, ge=1, description="inner steps each unit trains (cosine horizon)")
    h_steps: int = Field(30, ge=1, description="inner steps between uploads of a fragment (H)")
    overlap_tau: int = Field(
        0, ge=0, description="steps after an upload before a new global fragment is mixed in (τ)"
    )
    mix_alpha: float = Field(
        0.0, ge=0, le=1, description="share of local params kept when mixing in a global (α)"
    )
    dynamic_h: bool = Field(
        True, description="scale H by the unit's speed relative to the fastest (DyLU)"
    )
    params_fetch: ParamsFetchName = Field(
        "newest",
        description="which global params a unit fetches: newest (the newest version whenever "
        "one is announced and the last fetch is done) or after_upload (once after each of its "
        "uploads: fewer bytes, staler params; BENCHMARKS.md, 'Quality: downlink')",
    )
    codec: str = Field("int8", description=f"pseudo-gradient codec, one of {', '.join(CODECS)}")
    block_size: int = Field(
        256, ge=16, le=1 << 20, description="quantization block size (a multiple of 16)"
    )
    zstd_level: int = Field(
        1, ge=-7, le=22, description="zstd level of uploads (negative: faster, larger)"
    )
    # Off by default: with the default (Nesterov) outer step it made int2 worse in
    # bench/quality.py --codecs; it helps with --outer-momentum 0 (docs/CODEC.md).
    error_feedback: bool = Field(
        False, description="carry each upload's quantization error into the next upload"
    )
    codec_threads: int = Field(
        0, ge=-1, le=256, description="threads encoding uploads of 8 MiB or more (-1: one per CPU)"
    )
    checkpoint_every_s: float = Field(
        10.0,
        ge=0,
        description="seconds between checkpoints taken within a sync period (0: only at sync "
        "points); a killed unit trains again at most the steps since its newest checkpoint",
    )

    @model_validator(mode="after")
    def _check_codec(self) -> InnerSettings:
        try:
            self.codec_config()
        except CodecError as err:
            raise ValueError(str(err)) from err
        return self

    def codec_config(self) -> CodecConfig:
        """The upload codec these settings describe."""
        return CodecConfig(
            self.codec, self.block_size, self.zstd_level, self.codec_threads, self.error_feedback
        )


class LearnerSettings(JobSettings, InnerSettings):
    """One learner unit: which shard it trains on, its inner optimizer and how it syncs."""

    unit: int = Field(0, ge=0, description="this unit's index, 0 <= unit < num-units")
    num_units: int = Field(4, ge=1, le=1024, description="number of units the corpus is split into")
    slowdown: float = Field(
        1.0,
        ge=1.0,
        le=100.0,
        description="run this many times slower than the hardware allows (emulates older "
        "hardware; the math is unchanged)",
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
        return self


def check_sync_overlap(mode: str, overlap_tau: int) -> None:
    """Synchronous DiLoCo takes each round's global at its sync point: no overlap.

    Raises:
        ValueError: ``--mode sync`` with ``--overlap-tau`` above 0.
    """
    if mode == "sync" and overlap_tau > 0:
        raise ValueError(
            f"--mode sync waits for each round's global at its sync point: overlap-tau must be "
            f"0, got {overlap_tau}"
        )
