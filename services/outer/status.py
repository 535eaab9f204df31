"""What the outer reports: its progress, and the heartbeat records built from it.

The leading outer's heartbeat is a ``shared.records.OuterStatus`` (its books, versions,
evaluations, train losses and checkpoints) under ``J.outer.<shard>``; a standby's is a
``shared.records.StandbyStatus`` under ``J.outer_standby.<holder>``. Both are built here and
only here.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.outer.ledger import OuterLedger
from shared import subjects
from shared.records.outer import (
    CheckpointInfo,
    DownlinkCounts,
    EvalPoint,
    EvalRecord,
    EvaluationRecord,
    MergedUpload,
    MergePoint,
    OuterState,
    OuterStatus,
    RestoredFrom,
    StandbyStatus,
)

if TYPE_CHECKING:
    from services.outer.core import MergeResult

EVAL_HISTORY = 200  # evaluations kept in checkpoints
STATUS_EVAL_HISTORY = 50  # the newest of them shown in the status record
MERGE_HISTORY = 120  # merges the status record shows


@dataclass
class Progress:
    """What the leading outer reports beyond its books.

    Attributes:
        evaluation: The first and the last held-out evaluation and a bounded history (saved in
            checkpoints).
        merge_history: The newest merges: what each applied (units, staleness, train losses)
            and the norms of its update and of the momentum (status only: it starts empty
            after a restart).
        checkpoints: Checkpoints this process committed.
        last_checkpoint: The newest of them.
        restored_from: What this leader started from.
    """

    evaluation: EvaluationRecord = field(default_factory=EvaluationRecord)
    merge_history: collections.deque[MergePoint] = field(
        default_factory=lambda: collections.deque(maxlen=MERGE_HISTORY)
    )
    checkpoints: int = 0
    last_checkpoint: CheckpointInfo | None = None
    restored_from: RestoredFrom = field(default_factory=RestoredFrom)

    def evaluated(self, record: EvalRecord) -> None:
        """Enter an evaluation of the global params (the first one is also ``init``)."""
        point = EvalPoint(
            version=record.version,
            tokens=record.tokens,
            nats_per_byte=record.nats_per_byte,
            at=record.at,
        )
        self.evaluation = EvaluationRecord(
            init=self.evaluation.init or record,
            last=record,
            history=[*self.evaluation.history, point][-EVAL_HISTORY:],
        )

    def merged(self, result: MergeResult, tokens_applied: int) -> None:
        """Enter a merge, ``tokens_applied`` the outer's total after it."""
        uploads = [
            MergedUpload(
                unit=a.unit,
                round=a.round,
                staleness=s,
                train_loss=a.train_loss if finite(a.train_loss) else None,
            )
            for a, s in zip(result.arrivals, result.staleness, strict=True)
        ]
        self.merge_history.append(
            MergePoint(
                fragment=result.fragment,
                version=result.version,
                tokens=tokens_applied,
                at=round(time.time(), 3),
                uploads=uploads,
                update_norm=round(result.update_norm, 6),
                momentum_norm=round(result.momentum_norm, 6),
            )
        )


def finite(value: float | None) -> bool:
    """Whether ``value`` is a finite number (a unit may report none, or a diverged one)."""
    return value is not None and math.isfinite(value)


def status_key(job: str, shard: int, state: OuterState, holder: str) -> str:
    """The KV key (bucket ``diloco_status``) of the heartbeat of an outer of ``shard`` in
    ``state``."""
    if state == "standby":
        return subjects.outer_standby_key(job, holder)
    return subjects.outer_status_key(job, shard)


def leader_status(
    *,
    state: OuterState,
    model: str,
    holder: str,
    epoch: int | None,
    versions: list[int],
    buffered: int,
    ledger: OuterLedger,
    progress: Progress,
    downlink: DownlinkCounts | None = None,
    shard: int = 0,
    shards: int = 1,
) -> OuterStatus:
    """The heartbeat of an outer that leads (or led) its job.

    Args:
        state: What it is doing.
        model: The job's model size.
        holder: Its lease holder id.
        epoch: Its leadership epoch (None before it held the lease).
        versions: Each fragment's version.
        buffered: Uploads accepted and waiting for a merge.
        ledger: Its books.
        progress: Its evaluations, train losses and checkpoints.
        downlink: Its delta downlink's answers (None: it sends copies only).
        shard: The outer shard it leads, of ``shards``.
    """
    evaluation = progress.evaluation
    return OuterStatus(
        **dict(ledger.to_record()),
        state=state,
        model=model,
        holder=holder,
        shard=shard,
        shards=shards,
        epoch=epoch,
        version=sum(versions),
        versions=versions,
        buffered=buffered,
        checkpoints=progress.checkpoints,
        last_checkpoint=progress.last_checkpoint,
        restored_from=progress.restored_from,
        evaluation=EvaluationRecord(
            init=evaluation.init,
            last=evaluation.last,
            history=evaluation.history[-STATUS_EVAL_HISTORY:],
        ),
        merge_history=list(progress.merge_history),
        downlink=downlink,
    )


def standby_status(model: str, holder: str, leader: str, shard: int = 0) -> StandbyStatus:
    """The heartbeat of an outer that waits for the lease of ``shard`` ``leader`` holds."""
    return StandbyStatus(model=model, holder=holder, leader=leader, shard=shard)
