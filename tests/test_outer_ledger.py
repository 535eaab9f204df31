"""The outer's books and status records: typed, and the same after a round trip."""

from __future__ import annotations

import math

from services.outer.core import MergeResult
from services.outer.ledger import OuterLedger
from services.outer.policy import Arrival
from services.outer.status import (
    EVAL_HISTORY,
    STATUS_EVAL_HISTORY,
    Progress,
    leader_status,
    standby_status,
    status_key,
)
from shared import records, subjects
from shared.ledger import balance
from shared.records.outer import (
    CheckpointInfo,
    EvalRecord,
    LedgerRecord,
    OuterStatus,
    RestoredFrom,
    StandbyStatus,
    TrainPoint,
)
from shared.records.unit import UnitStatus


def arrival(unit: int, round_: int, tokens: int = 100, train_loss: float | None = 3.0) -> Arrival:
    return Arrival(unit, round_, 0, 10, tokens, {}, 0.0, f"j.u{unit}.r{round_}.f0", train_loss)


def busy_ledger() -> OuterLedger:
    ledger = OuterLedger()
    ledger.accept("int8", 1000)
    ledger.accept("int4", 500)
    ledger.merged([arrival(0, 0), arrival(1, 0, train_loss=math.nan)], [0, 2])
    ledger.merged([arrival(0, 1, tokens=50)], [1])
    ledger.reject("wrong_model", (1, 1))
    ledger.reject("bad_chunk_header", None)
    ledger.deduplicated = 4
    return ledger


def test_the_books_survive_a_record_round_trip() -> None:
    ledger = busy_ledger()
    record = ledger.to_record()
    assert record.applied == 3 and record.merges == 2 and record.tokens_applied == 250
    assert record.applied_rounds == {0: [(0, 1)], 1: [(0, 0)]}
    assert record.rejected_rounds == {1: [(1, 1)]}
    assert record.staleness == {0: 1, 1: 1, 2: 1}
    assert record.units[0].last_round == 1 and record.units[0].tokens == 150
    assert record.units[1].last_train_loss is None  # NaN is not a number the books hold
    stored = records.decode(LedgerRecord, records.encode(record))
    assert stored == record
    again = OuterLedger()
    again.load(stored)
    assert again.to_record() == record
    assert again.is_done(0, 1) == "applied" and again.is_done(1, 1) == "rejected"
    assert again.is_done(1, 2) is None and again.is_done(7, 0) is None
    # The loaded books are a copy: changing them leaves the record alone.
    again.merged([arrival(0, 2)], [0])
    assert record.units[0].applied == 2 and again.units[0].applied == 3


def merge_result(train_losses: list[float | None]) -> MergeResult:
    """A merge of one upload per train loss, unit u's with staleness u."""
    arrivals = [
        Arrival(u, 0, 0, 10, 100, None, 0.0, train_loss=loss) for u, loss in enumerate(train_losses)
    ]
    return MergeResult(0, 7, arrivals, list(range(len(arrivals))), 0.5, 1.25)


def test_the_leader_status_carries_the_books_and_balances() -> None:
    ledger = busy_ledger()
    progress = Progress(
        checkpoints=2,
        last_checkpoint=CheckpointInfo(id="j.ckpt.e1.s2", bytes=10, versions=[2], seconds=0.1),
        restored_from=RestoredFrom(kind="checkpoint", id="j.ckpt.e0.s9", versions=[1]),
    )
    for version in range(EVAL_HISTORY + 5):
        record = EvalRecord(version=version, tokens=version, nats_per_byte=5.0, bits_per_byte=7.2)
        progress.evaluated(record)
    progress.merged(merge_result([3.0, None, math.nan, 2.0]), 250)
    progress.merged(merge_result([math.inf]), 260)  # nothing finite: no train point
    status = leader_status(
        state="running",
        model="tiny",
        holder="h:1:x",
        epoch=3,
        versions=[1, 1],
        buffered=2,
        ledger=ledger,
        progress=progress,
    )
    stored = records.decode(OuterStatus, records.encode(status))
    assert stored == status
    assert stored.version == 2 and stored.epoch == 3 and stored.buffered == 2
    assert stored.applied_rounds == ledger.to_record().applied_rounds
    assert stored.evaluation.init.version == 0
    assert stored.evaluation.last.version == EVAL_HISTORY + 4
    assert len(stored.evaluation.history) == STATUS_EVAL_HISTORY
    assert len(progress.evaluation.history) == EVAL_HISTORY  # the checkpoint keeps more
    assert [p.train_point() for p in stored.merge_history] == [
        TrainPoint(tokens=250, train_loss=2.5),
        None,
    ]
    first = stored.merge_history[0]
    assert [(u.unit, u.staleness, u.train_loss) for u in first.uploads] == [
        (0, 0, 3.0),
        (1, 1, None),
        (2, 2, None),
        (3, 3, 2.0),
    ]
    assert (first.version, first.update_norm, first.momentum_norm) == (7, 0.5, 1.25)
    assert stored.next_round(0) == 2 and stored.next_round(5) == 0
    units = {
        0: UnitStatus(unit=0, published_rounds=[(0, 1)]),
        1: UnitStatus(unit=1, published_rounds=[(0, 1)]),
    }
    assert balance(stored, units).balanced


def test_standby_status_and_keys() -> None:
    standby = standby_status("tiny", "h:2:y", "h:1:x")
    assert records.decode(StandbyStatus, records.encode(standby)) == standby
    assert status_key("j", 0, "standby", "h:2:y") == subjects.outer_standby_key("j", "h:2:y")
    for state in ("restoring", "running", "stopped", "deposed"):
        assert status_key("j", 0, state, "h:2:y") == subjects.outer_status_key("j", 0)
