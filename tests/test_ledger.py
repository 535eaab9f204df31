"""shared.ledger.RoundSet against a plain set."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.ledger import RoundSet, balance, with_state_file
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStateFile, UnitStatus

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 200)),
        st.tuples(st.just("range"), st.integers(0, 200), st.integers(0, 40)),
    ),
    max_size=80,
)


@given(ops)
def test_behaves_like_a_set_and_stays_merged(operations) -> None:
    reference: set[int] = set()
    rounds = RoundSet()
    for op in operations:
        if op[0] == "add":
            assert rounds.add(op[1]) == (op[1] not in reference)
            reference.add(op[1])
        else:
            rounds.add_range(op[1], op[1] + op[2])
            reference |= set(range(op[1], op[1] + op[2] + 1))
    assert list(rounds) == sorted(reference) and len(rounds) == len(reference)
    assert all((v in rounds) == (v in reference) for v in range(-1, 250))
    assert rounds.max() == max(reference, default=-1)
    ranges = rounds.ranges()
    assert all(a[1] + 1 < b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert RoundSet(ranges) == rounds
    odd = RoundSet([[v, v] for v in reference if v % 2])
    assert odd.issubset(rounds)
    assert not RoundSet([[300, 300]]).issubset(rounds)


def test_bad_ranges_are_refused() -> None:
    for bad in ([-1, 3], [5, 4]):
        with pytest.raises(ValueError, match="range"):
            RoundSet([bad])
    with pytest.raises(ValueError, match="non-negative"):
        RoundSet().add(-1)


def _outer(**fields) -> OuterStatus:
    return OuterStatus(state="running", model="tiny", holder="h", **fields)


def test_balance_finds_missing_double_and_conflicting_rounds() -> None:
    units = {
        0: UnitStatus(unit=0, published_rounds=[(0, 9)]),
        1: UnitStatus(unit=1, published_rounds=[(0, 4)]),
    }
    ledger = {
        "applied": 14,
        "applied_rounds": {0: [(0, 8)], 1: [(0, 4)]},
        "rejected_rounds": {0: [(9, 9)]},
        "rejected": {"bad_payload": 1},
    }
    books = balance(_outer(**ledger), units)
    assert books.balanced, books.problems
    assert books.published == 15 and books.applied == 14 and books.rejected == 1
    missing = balance(_outer(**{**ledger, "rejected_rounds": {}}), units)
    assert not missing.balanced and "unit 0: 1 published" in missing.problems[0]
    assert missing.per_unit[0].missing == [9]
    double = balance(_outer(**{**ledger, "applied": 15}), units)
    assert any("applied twice" in p for p in double.problems)
    both = balance(_outer(**{**ledger, "rejected_rounds": {0: [(8, 9)]}}), units)
    assert any("both applied and rejected" in p for p in both.problems)
    nothing = balance(None, units)
    assert not nothing.balanced and nothing.applied == 0


def test_balance_tells_a_lost_ack_from_a_round_the_unit_never_handed_out() -> None:
    # Unit 0 handed out rounds 0-11 (next round 12) and recorded 0-9 as published: it was killed
    # after the broker acked round 10, before its record. Round 11 was lost in its memory.
    units = {0: UnitStatus(unit=0, published_rounds=[(0, 9)], next_round=12)}
    ledger = {"applied": 11, "applied_rounds": {0: [(0, 10)]}}
    books = balance(_outer(**ledger), units)
    assert books.balanced, books.problems
    assert books.unrecorded == 1 and books.per_unit[0].unrecorded == 1
    assert books.applied == books.published + books.unrecorded
    # Rounds 12 and 40 were never handed out: someone else uploaded under unit 0's name.
    forged = {"applied": 13, "applied_rounds": {0: [(0, 10), (12, 12), (40, 40)]}}
    books = balance(_outer(**forged), units)
    assert not books.balanced and books.per_unit[0].foreign == [12, 40]
    assert any("2 applied round(s) the unit never handed out" in p for p in books.problems)
    # Refused, such rounds are counted but leave the books balanced: the outer did its job.
    refused = {**ledger, "rejected_rounds": {0: [(12, 12)]}, "rejected": {"replayed": 1}}
    books = balance(_outer(**refused), units)
    assert books.balanced and books.per_unit[0].foreign_rejected == 1
    # A unit with no status at all: everything applied under its name is foreign.
    books = balance(_outer(applied=1, applied_rounds={3: [(0, 0)]}), units)
    assert not books.balanced and books.per_unit[3].foreign == [0]


def test_a_stopped_units_state_file_holds_the_rounds_its_status_record_missed() -> None:
    # Unit 0 was quarantined between the broker's ack of round 1 and its next status write:
    # its status record stops at next round 1, its state file says rounds 0-1 published.
    stale = {0: UnitStatus(unit=0, published_rounds=[(0, 0)], next_round=1, tokens=7)}
    outer = _outer(applied=2, applied_rounds={0: [(0, 1)]})
    assert balance(outer, stale).per_unit[0].foreign == [1]
    state = UnitStateFile(job="j", unit=0, next_round=2, published=[[0, 1]])
    folded = with_state_file(stale[0], 0, state)
    assert folded.published_rounds == [[0, 1]] and folded.next_round == 2 and folded.tokens == 7
    books = balance(outer, {0: folded})
    assert books.balanced and books.published == 2, books.problems
    # Round 2 is still one the unit never handed out, and a unit that never wrote a status
    # record gets one from its state file alone.
    assert balance(_outer(applied=3, applied_rounds={0: [(0, 2)]}), {0: folded}).per_unit[
        0
    ].foreign == [2]
    alone = with_state_file(
        None, 3, UnitStateFile(job="j", unit=3, next_round=5, published=[[0, 3]])
    )
    assert alone.unit == 3 and alone.next_round == 5 and alone.state == "stopped"
    assert balance(_outer(applied=5, applied_rounds={3: [(0, 4)]}), {3: alone}).balanced
