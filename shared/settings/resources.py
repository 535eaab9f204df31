"""What each process of a job may use of the machine: threads and devices."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class DeviceLayout(BaseModel):
    """How a learner unit lays its state out over its devices (``services/learner/devices.py``)."""

    model_config = ConfigDict(extra="forbid")

    shard_params: bool = Field(
        False,
        description="split the params and optimizer state over the unit's devices (FSDP), "
        "for a model that does not fit one device; otherwise every device holds a copy",
    )


class LearnerDevices(DeviceLayout):
    """The accelerators (or CPU devices) one learner unit trains on as one island."""

    devices: int = Field(
        0,
        ge=0,
        le=1024,
        description="devices of this process the unit trains on, the batch split over them "
        "(0: all of them); each inner step trains --batch-size sequences per device",
    )
    num_processes: int = Field(
        1,
        ge=1,
        le=1024,
        description="processes (hosts) the unit spans, each started with the same flags and "
        "its own --process-id; process 0 speaks for the unit on NATS, the others follow it",
    )
    process_id: int = Field(0, ge=0, description="this process's index in the unit")
    coordinator: str | None = Field(
        None,
        description="host:port where process 0 of the unit coordinates its processes "
        "(jax.distributed); needed with --num-processes > 1",
    )

    @model_validator(mode="after")
    def _check_processes(self) -> LearnerDevices:
        if self.process_id >= self.num_processes:
            raise ValueError(
                f"process-id {self.process_id} must be < num-processes {self.num_processes}"
            )
        if self.num_processes > 1 and not self.coordinator:
            raise ValueError("a unit of several processes needs --coordinator host:port")
        if self.num_processes > 1 and self.shard_params:
            raise ValueError(
                "--shard-params splits the state over one process's devices only: "
                "leave it out with --num-processes > 1"
            )
        return self


class DevicesPerUnit(DeviceLayout):
    """The devices a launcher (``diloco up``) gives each learner unit."""

    devices_per_unit: int = Field(
        1,
        ge=1,
        le=64,
        description="devices each learner unit trains on, --batch-size sequences per device "
        "per step: unit u gets the GPUs u*N .. u*N+N-1 (of $CUDA_VISIBLE_DEVICES, if set), "
        "or, without GPUs, N CPU devices of its own",
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


class ResourceSettings(LearnerResources, OuterResources, LearnerThreads, DevicesPerUnit):
    """Every process's threads and each unit's devices, as ``diloco up`` sets them."""
