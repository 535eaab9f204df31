"""What ``diloco loadtest`` measured: ``<data-dir>/loadtest.json`` (:class:`LoadtestReport`)."""

from __future__ import annotations

from pydantic import (
    Field,
    NonNegativeFloat,
    PositiveFloat,
)

from shared.codec.config import CodecName
from shared.ledger import Books
from shared.link_spec import LinkSpec
from shared.model_config import ModelSize
from shared.records import (
    Count,
    Record,
)
from shared.records.unit import LatencySummary


class LoadtestStage(Record):
    """One stage of ``diloco loadtest``: a number of synthetic units against a fresh outer,
    measured over a window after warm-up (rates are per second of that window)."""

    units: Count
    window_s: NonNegativeFloat
    offered_uploads_per_s: NonNegativeFloat = Field(
        description="uploads the units are due to make: units / upload interval"
    )
    published_per_s: NonNegativeFloat = Field(description="uploads JetStream accepted")
    ingest_uploads_per_s: NonNegativeFloat = Field(description="uploads the outer applied")
    ingest_mb_per_s: NonNegativeFloat = Field(description="payload MB (10^6) the outer applied")
    merges_per_s: NonNegativeFloat
    uploads_per_merge: NonNegativeFloat
    uploads_per_commit: NonNegativeFloat = Field(
        description="uploads applied per checkpoint commit (each followed by a params publish)"
    )
    sync_latency: LatencySummary | None = Field(
        description="an upload's time from its sync point to the first params head that "
        "includes it, every upload of the stage"
    )
    backlog_start: int = Field(description="uploads published, not yet applied, window start")
    backlog_end: int = Field(description="the same at the window's end")
    dropped_unsent: Count = Field(description="uploads dropped from full unit queues")
    params_mb_per_s: NonNegativeFloat = Field(description="params MB all units fetched")
    heads_rejected: Count = Field(0, description="malformed params heads the units received")
    outer_cpu: NonNegativeFloat = Field(description="CPU cores the outer process used")
    broker_cpu: NonNegativeFloat = Field(description="CPU cores nats-server used")
    generator_cpu: NonNegativeFloat = Field(
        description="CPU cores the load generator (units and links) used"
    )
    drain_s: NonNegativeFloat = Field(
        description="seconds after the last upload until the outer had applied everything"
    )
    books: Books
    saturated: bool
    reason: str = Field("", description="why the stage counts as saturated")


class LoadtestReport(Record):
    """``<data-dir>/loadtest.json``: what ``diloco loadtest`` ran and measured."""

    model: ModelSize
    param_count: Count
    codec: CodecName
    params_codec: str
    params_fetch: str
    link: LinkSpec
    upload_every_s: PositiveFloat
    upload_payload_bytes: Count = Field(
        description="encoded bytes of one synthetic upload (the mean over the fragments)"
    )
    commit_every_s: float | None = Field(
        None, description="the outer's --commit-every-s (None: the outer's default)"
    )
    fragments: int = Field(1, ge=1, description="fragments a unit uploads in turn")
    outer_shards: int = Field(1, ge=1, description="outer processes the fragments are split over")
    stages: list[LoadtestStage] = []
    saturation_units: Count | None = Field(
        None, description="units of the first saturated stage (None: none saturated)"
    )
