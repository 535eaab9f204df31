"""What each process of a job may use of the machine: threads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from shared.codec.config import CodecConfig


class LearnerResources(BaseModel):
    """A learner's threads besides training."""

    model_config = ConfigDict(extra="forbid")

    codec_threads: int = Field(
        CodecConfig.threads,
        ge=-1,
        le=256,
        description="threads encoding uploads of 8 MiB or more (-1: one per CPU)",
    )


class OuterResources(BaseModel):
    """The outer's threads besides merging."""

    model_config = ConfigDict(extra="forbid")

    decode_threads: int = Field(
        -1, ge=-1, le=256, description="threads decoding uploads of 8 MiB or more (-1: one per CPU)"
    )


class LearnerThreads(BaseModel):
    """The compute threads a launcher (``diloco up``, the compose controller) gives each
    learner's XLA, through its environment: several learners share few cores."""

    model_config = ConfigDict(extra="forbid")

    learner_threads: int = Field(
        1, ge=1, le=64, description="CPU threads each learner's XLA may use"
    )


class ResourceSettings(LearnerResources, OuterResources, LearnerThreads):
    """Every process's threads, as ``diloco up`` sets them."""
