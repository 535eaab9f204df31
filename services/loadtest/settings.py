"""Settings of ``diloco loadtest`` (flags ``diloco loadtest --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.fragments import check_shards
from shared.link_spec import LinkSpec, parse_link
from shared.model_config import ModelSize
from shared.records import MAX_OUTER_SHARDS, MAX_OUTER_UNITS
from shared.settings import ENV_PREFIX
from shared.settings.algorithm import MAX_FRAGMENTS
from shared.settings.codec import CodecSettings

ParamsFetch = Literal["newest", "none"]


class LoadtestSettings(BaseSettings, CodecSettings):
    """Load-test the outer and the broker with synthetic learner units (no JAX): for each unit
    count of ``--units``, a fresh nats-server and ``diloco outer`` take uploads of realistic
    pseudo-gradients of ``--model`` from that many units, each uploading every
    ``--upload-every-s`` through its own shaped link (``--link``) and fetching the params it
    would adopt. Each stage reports the outer's ingest, sync latency and backlog; the first
    stage whose ingest falls behind the offered load is the saturation point. Uploads are
    encoded with ``--codec`` and the outer publishes in ``--params-codec`` (the shipped codecs
    by default); each stands for the work of H inner steps of a default learner."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    model: ModelSize = Field("medium", description="model size the uploads are for")
    units: str = Field(
        "4,8,16,32", description="unit counts, one stage each, increasing (e.g. 4,8,16,32)"
    )
    upload_every_s: float = Field(
        10.0, gt=0, le=3600, description="seconds between two uploads of one unit (its pace)"
    )
    stage_s: float = Field(
        60.0, gt=0, le=86400, description="seconds each stage is measured for, after warm-up"
    )
    warmup_s: float | None = Field(
        None,
        ge=0,
        description="seconds between the units' start and the measurement (default: two "
        "upload intervals), and then until the outer has applied an upload (up to --drain-s)",
    )
    drain_s: float = Field(
        300.0, gt=0, description="longest wait, after a stage, for the outer to apply the rest"
    )
    params_fetch: ParamsFetch = Field(
        "newest",
        description="newest: each unit fetches the newest params whenever a newer version is "
        "announced and no fetch is under way (as a learner does); none: heads only",
    )
    link: str = Field(
        "unlimited", description="each unit's link, RATE[/DELAY[/JITTER]] (e.g. 100mbit/25ms)"
    )
    max_unsent: int = Field(
        4, ge=1, le=1024, description="uploads a unit queues before dropping its oldest"
    )
    saturation_share: float = Field(
        0.9,
        gt=0,
        le=1,
        description="a stage is saturated when the outer applies less than this share of the "
        "offered uploads, or its backlog grows",
    )
    seed: int = Field(0, ge=0, description="seed of the synthetic pseudo-gradients and phases")
    fragments: int = Field(
        1,
        ge=1,
        le=MAX_FRAGMENTS,
        description="fragments of the model (P): a unit uploads one of them in turn, P times "
        "every --upload-every-s (a staggered learner's uploads: the same bytes per period)",
    )
    outer_shards: int = Field(
        1,
        ge=1,
        le=MAX_OUTER_SHARDS,
        description="outer processes, each owning the fragments p with p mod outer-shards = "
        "its shard (at most --fragments)",
    )
    commit_every_s: float | None = Field(
        None,
        ge=0,
        le=60,
        description="the outer's --commit-every-s (default: the outer's own; 0: a commit "
        "after every fetch)",
    )
    data_dir: str = Field(
        "./diloco-loadtest", description="folder for each stage's store, logs and the report"
    )

    @field_validator("link")
    @classmethod
    def _check_link(cls, value: str) -> str:
        parse_link(value)
        return value

    @model_validator(mode="after")
    def _check_units(self) -> LoadtestSettings:
        self.unit_counts()
        check_shards(self.outer_shards, self.fragments)
        return self

    def unit_counts(self) -> list[int]:
        """The stages' unit counts.

        Raises:
            ValueError: not increasing whole numbers from 1 to ``MAX_OUTER_UNITS``.
        """
        try:
            counts = [int(part) for part in self.units.split(",")]
        except ValueError:
            raise ValueError(f"units: expected counts like 4,8,16,32, got {self.units!r}") from None
        if not all(1 <= c <= MAX_OUTER_UNITS for c in counts):
            raise ValueError(f"units: each count must be 1..{MAX_OUTER_UNITS}, got {self.units!r}")
        if counts != sorted(set(counts)):
            raise ValueError(f"units: counts must increase, got {self.units!r}")
        return counts

    def link_spec(self) -> LinkSpec:
        """Each unit's link."""
        return parse_link(self.link)

    def warmup(self) -> float:
        """Seconds of warm-up before each stage's measurement."""
        return self.warmup_s if self.warmup_s is not None else 2 * self.upload_every_s
