"""What the outer reports: its progress, and the heartbeat records built from it.

The leading outer's heartbeat is a ``shared.records.OuterStatus`` (its books, versions,
evaluations, train losses and checkpoints) under ``J.outer``; a standby's is a
``shared.records.StandbyStatus`` under ``J.outer_standby.<holder>``. Both are built here and
only here.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.outer.ledger import OuterLedger
from shared import subjects
from shared.records.outer import (
    CheckpointInfo,
    EvalPoint,
    EvalRecord,
    EvaluationRecord,
    OuterState,
    OuterStatus,
    RestoredFrom,
    StandbyStatus,
    TrainPoint,
)

EVAL_HISTORY = 200  # evaluations kept in checkpoints
STATUS_EVAL_HISTORY = 50  # the newest of them shown in the status record
TRAIN_HISTORY = 200  # merges whose mean train loss the status record shows


@dataclass
class Progress:
    """What the leading outer reports beyond its books.

    Attributes:
        evaluation: The first and the last held-out evaluation and a bounded history (saved in
            checkpoints).
        train_history: Per merge, the tokens applied and the mean train loss the merged uploads
            reported (status only: it starts empty after a restart).
        checkpoints: Checkpoints this process committed.
        last_checkpoint: The newest of them.
        restored_from: What this leader started from.
    """

    evaluation: EvaluationRecord = field(default_factory=EvaluationRecord)
    train_history: collections.deque[TrainPoint] = field(
        default_factory=lambda: collections.deque(maxlen=TRAIN_HISTORY)
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

    def merged(self, tokens_applied: int, train_losses: Sequence[float | None]) -> None:
        """Enter a merge: the mean of the finite train losses its uploads reported, if any."""
        finite = [loss for loss in train_losses if loss is not None and math.isfinite(loss)]
        if finite:
            mean = round(sum(finite) / len(finite), 5)
            self.train_history.append(TrainPoint(tokens=tokens_applied, train_loss=mean))


def status_key(job: str, state: OuterState, holder: str) -> str:
    """The KV key (bucket ``diloco_status``) of an outer's heartbeat in ``state``."""
    if state == "standby":
        return subjects.outer_standby_key(job, holder)
    return subjects.outer_status_key(job)


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
    """
    evaluation = progress.evaluation
    return OuterStatus(
        **dict(ledger.to_record()),
        state=state,
        model=model,
        holder=holder,
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
        train_history=list(progress.train_history),
    )


def standby_status(model: str, holder: str, leader: str) -> StandbyStatus:
    """The heartbeat of an outer that waits for the lease ``leader`` holds."""
    return StandbyStatus(model=model, holder=holder, leader=leader)
