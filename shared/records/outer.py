"""What the outer writes: its heartbeat and books, its lease, and the heads of the global params.

* :class:`OuterStatus` — KV ``diloco_status`` key ``J.outer.<k>``: the heartbeat and ledger
  (:class:`LedgerRecord`) of outer shard k's leader, read by the gateway, ``diloco up`` and
  learners (rounds applied);
* :class:`StandbyStatus` — same bucket, ``J.outer_standby.<holder>``: a standby outer;
* :class:`LeaseRecord` (with :class:`CheckpointPointer`) — KV ``diloco_outer``, ``J.<k>``: outer
  shard k's leader lease, changed by compare-and-set only;
* :class:`ParamsHead` — stream ``DILOCO_PARAMS``, ``diloco.J.params.<p>.head``: read by learners
  and a restarted outer.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    FiniteFloat,
    NonNegativeFloat,
    model_validator,
)

from shared.records import (
    MAX_OUTER_SHARDS,
    MAX_OUTER_UNITS,
    MAX_VERSION,
    Count,
    Record,
    RoundRanges,
    Stamped,
    liveness,
)

#: What an outer reports about itself (``deposed``: it lost its lease and stops).
OuterState = Literal["starting", "standby", "restoring", "running", "stopped", "deposed"]


class UnitLedger(Record):
    """What the outer has applied from one unit, and what it refused or clipped of it."""

    applied: Count = 0
    rejected: dict[str, Count] = Field({}, description="uploads of this unit rejected, by reason")
    clipped: Count = Field(0, description="applied uploads of this unit the norm guard scaled down")
    skipped_rounds: Count = Field(
        0,
        description="rounds the unit skipped between uploads the outer accepted (dropped, "
        "lost in a killed unit's memory, or skipped on restart)",
    )
    last_round: int = Field(-1, ge=-1)
    last_staleness: Count = 0
    tokens: Count = 0
    last_train_loss: float | None = None


class LedgerRecord(Record):
    """The outer's books, in its status record and every checkpoint: every upload it received
    is applied exactly once (``applied_rounds``) or rejected with a reason (``rejected``,
    ``rejected_rounds``)."""

    applied: Count = 0
    merges: Count = 0
    deduplicated: Count = Field(0, description="redelivered chunks of uploads applied before")
    tokens_applied: Count = 0
    clipped: Count = Field(0, description="applied uploads the norm guard scaled down")
    rejected: dict[str, Count] = Field({}, description="rejected uploads by reason")
    units: dict[Count, UnitLedger] = {}
    staleness: dict[Count, Count] = Field({}, description="applied uploads by staleness")
    codecs: dict[str, Count] = Field({}, description="accepted uploads by codec")
    payload_bytes: Count = Field(0, description="compressed bytes of accepted uploads")
    applied_rounds: dict[Count, RoundRanges] = {}
    rejected_rounds: dict[Count, RoundRanges] = {}


class EvalRecord(Record):
    """One held-out evaluation of the global params (a loss is None when it is not finite:
    the model diverged)."""

    version: Count
    tokens: Count
    nats_per_byte: float | None
    bits_per_byte: float | None
    at: NonNegativeFloat | None = Field(
        None, description="when the evaluated params were taken (unix seconds, outer's clock)"
    )


class EvalPoint(Record):
    """One evaluation of the global model on held-out data."""

    version: Count = Field(description="global version evaluated")
    tokens: Count = Field(description="tokens applied by the outer when it was evaluated")
    nats_per_byte: float | None = Field(
        description="held-out loss in nats per byte (null when not finite: the model diverged)"
    )
    at: NonNegativeFloat | None = Field(
        None, description="when the evaluated params were taken (unix seconds, outer's clock)"
    )


class TrainPoint(Record):
    """The mean train loss of the uploads applied by one merge."""

    tokens: Count = Field(description="tokens applied by the outer after the merge")
    train_loss: float = Field(description="mean train loss reported by the merged uploads")


class MergedUpload(Record):
    """One upload a merge applied: whose, how stale, and the train loss its unit reported."""

    unit: Count
    round: Count
    staleness: Count = Field(description="versions merged since the one it was computed on")
    train_loss: FiniteFloat | None = None


class MergePoint(Record):
    """One merge of the outer: what it applied and what it did to the global params."""

    fragment: Count
    version: Count = Field(description="the fragment's version the merge made")
    tokens: Count = Field(description="tokens applied by the outer after the merge")
    at: NonNegativeFloat = Field(description="when it merged (unix seconds, outer's clock)")
    uploads: list[MergedUpload]
    update_norm: NonNegativeFloat = Field(description="L2 norm of the change to the params")
    momentum_norm: NonNegativeFloat = Field(
        description="L2 norm of the outer momentum after the merge (0 without momentum)"
    )

    def train_point(self) -> TrainPoint | None:
        """The mean of the train losses its uploads reported, if any."""
        losses = [u.train_loss for u in self.uploads if u.train_loss is not None]
        if not losses:
            return None
        return TrainPoint(tokens=self.tokens, train_loss=round(sum(losses) / len(losses), 5))


class EvaluationRecord(Record):
    """The outer's evaluations: the first, the last, and a bounded history."""

    init: EvalRecord | None = None
    last: EvalRecord | None = None
    history: list[EvalPoint] = []


class CheckpointInfo(Record):
    """The outer's last committed checkpoint."""

    id: str
    bytes: Count
    versions: list[Count]
    seconds: NonNegativeFloat


class RestoredFrom(Record):
    """What the leading outer started from."""

    kind: Literal["new", "checkpoint", "params"] = "new"
    id: str | None = None
    versions: list[Count] = []


class DownlinkCounts(Record):
    """The delta downlink's answers since this leader started, and the bytes of its deltas."""

    delta: Count = 0
    keyframe: Count = 0
    current: Count = 0
    delta_bytes: Count = 0


class OuterStatus(LedgerRecord):
    """The leading outer's heartbeat: its ledger, versions, evaluations and checkpoints.

    Each outer shard writes one for the fragments it owns (``shard`` of ``shards``);
    :func:`shared.job_status.combine_shards` makes the job's from them.
    """

    state: OuterState
    model: str
    holder: str
    shard: Count = Field(0, lt=MAX_OUTER_SHARDS)
    shards: int = Field(1, ge=1, le=MAX_OUTER_SHARDS)
    epoch: Count | None = None
    version: Count = Field(0, description="sum of the fragments' versions")
    versions: list[Count] = []
    buffered: Count = Field(0, description="uploads accepted, waiting for a merge")
    checkpoints: Count = 0
    last_checkpoint: CheckpointInfo | None = None
    restored_from: RestoredFrom = RestoredFrom()
    evaluation: EvaluationRecord = EvaluationRecord()
    downlink: DownlinkCounts | None = Field(
        None, description="with --params-downlink delta: the wants this leader answered"
    )
    merge_history: list[MergePoint] = Field(
        [], description="the newest merges (status only: it starts empty after a restart)"
    )

    def unit_ledger(self, unit: int) -> UnitLedger | None:
        """The outer's ledger of one unit (None before it applied anything of it)."""
        return self.units.get(unit)

    def next_round(self, unit: int) -> int:
        """1 + the last round of ``unit`` the outer applied (0 when none)."""
        ledger = self.units.get(unit)
        return ledger.last_round + 1 if ledger is not None else 0


class StandbyStatus(Record):
    """A standby outer's heartbeat: who it is and who leads."""

    state: Literal["standby"] = "standby"
    model: str
    holder: str
    shard: Count = Field(0, lt=MAX_OUTER_SHARDS)
    leader: str = ""


def outer_liveness(entry: Stamped[OuterStatus] | None, timeout_s: float) -> str:
    """The outer's shown state: ``absent``, ``lost`` or what it reports."""
    if entry is None:
        return "absent"
    return liveness(entry.record.state, entry.age_s, timeout_s)


class CheckpointPointer(Record):
    """Where the committed checkpoint of the outer lies (inside the lease record)."""

    id: str = Field(max_length=200)
    epoch: Count
    slot: Literal[0, 1]
    chunks: int = Field(ge=1, le=1 << 24)
    size: Count
    checksum: int = Field(ge=0, lt=1 << 64, description="XXH3-64 of the checkpoint blob")
    versions: list[Count]


class LeaseRecord(Record):
    """The leader lease of one job's outer (changed by compare-and-set only)."""

    holder: str = Field(max_length=300)
    epoch: Count
    beat: Count
    released: bool = False
    pointer: CheckpointPointer | None = None


class ParamsHead(Record):
    """The newest global params of one fragment: which upload holds them, in which chunks."""

    version: int = Field(ge=0, le=MAX_VERSION)
    upload: str = Field(max_length=200)
    chunks: int = Field(ge=1, le=1 << 24)
    sequences: list[Annotated[int, Field(ge=1)]] = Field(
        description="the stream sequence of each chunk, in order: a read by sequence sees "
        "exactly this version however many newer ones are published meanwhile"
    )
    size: Count
    params_checksum: int | None = Field(
        None, ge=0, lt=1 << 64, description="XXH3-64 of the encoded params (shared.wire)"
    )
    applied: dict[Count, Annotated[int, Field(ge=-1)]] = Field(
        {},
        max_length=MAX_OUTER_UNITS,
        description="per unit, the newest round the outer had applied when it published this "
        "version: a unit's upload of round r is in this version if r <= applied[unit]",
    )

    @model_validator(mode="after")
    def _one_sequence_per_chunk(self) -> ParamsHead:
        if len(self.sequences) != self.chunks:
            raise ValueError(f"{len(self.sequences)} sequences for {self.chunks} chunks")
        return self


class DownlinkWant(Record):
    """A unit's request for the newest params of a fragment as a delta against what it holds
    (``--params-downlink delta``; shared/downlink.py). The unit is the request's subject's."""

    fragment: int = Field(ge=0, le=1 << 10)
    held_version: int = Field(ge=-1, le=MAX_VERSION, description="-1: holds nothing")
    held_checksum: int = Field(ge=0, lt=1 << 64, description="shared.downlink.params_checksum")


class DownlinkReply(Record):
    """The outer's answer to a :class:`DownlinkWant`.

    ``kind``: ``delta`` (read it from the unit's downlink subjects: ``upload`` in ``chunks``
    chunks of ``size`` bytes, whose payload has ``payload_checksum``; it applies to
    ``(base_version, base_checksum)`` and gives ``(version, checksum)``), ``keyframe`` (read
    the global copy instead: there is no record of what the unit holds, or a delta would be
    larger) or ``current`` (the unit holds the newest version).
    """

    kind: Literal["delta", "keyframe", "current"]
    version: int = Field(ge=0, le=MAX_VERSION)
    base_version: int = Field(-1, ge=-1, le=MAX_VERSION)
    base_checksum: int = Field(0, ge=0, lt=1 << 64)
    checksum: int = Field(0, ge=0, lt=1 << 64)
    upload: str = Field("", max_length=200)
    chunks: int = Field(0, ge=0, le=1 << 24)
    size: Count = 0
    payload_checksum: int = Field(0, ge=0, lt=1 << 64)
