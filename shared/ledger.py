"""Sets of round numbers kept as sorted, merged ranges, for ledgers that must balance.

A unit numbers its uploads 0, 1, 2, ... (per unit, never reused), so the rounds it has
published, and those the outer has applied or rejected, are almost always a few contiguous
runs. :class:`RoundSet` stores them as ``[[first, last], ...]`` (inclusive), which is small
enough to go into every status record and checkpoint, and lets a test balance the books
exactly: every round a unit published is applied once or rejected with a reason.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping

from pydantic import Field

from shared.records import Count, Record
from shared.records.outer import LedgerRecord, OuterStatus
from shared.records.unit import UnitStateFile, UnitStatus

__all__ = ["RoundSet", "balance", "with_state_file"]


class RoundSet:
    """A set of non-negative ints stored as disjoint, sorted, inclusive ranges."""

    def __init__(self, ranges: Iterable[Iterable[int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for pair in ranges:
            first, last = (int(v) for v in pair)
            self.add_range(first, last)

    def add_range(self, first: int, last: int) -> None:
        """Add every int in ``[first, last]``."""
        if not 0 <= first <= last:
            raise ValueError(
                f"a range must be [first, last] with 0 <= first <= last, got {[first, last]}"
            )
        # Drop every range the new one overlaps or touches, and put their union in its place.
        lo = bisect.bisect_left(self._ends, first - 1)
        hi = bisect.bisect_right(self._starts, last + 1)
        if lo < hi:
            first = min(first, self._starts[lo])
            last = max(last, self._ends[hi - 1])
        self._starts[lo:hi] = [first]
        self._ends[lo:hi] = [last]

    def add(self, value: int) -> bool:
        """Add ``value``; returns False if it was already there."""
        if value < 0:
            raise ValueError(f"rounds are non-negative, got {value}")
        i = bisect.bisect_right(self._starts, value) - 1
        if i >= 0 and self._ends[i] >= value:
            return False
        joins_left = i >= 0 and self._ends[i] == value - 1
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == value + 1
        if joins_left and joins_right:
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]
        elif joins_left:
            self._ends[i] = value
        elif joins_right:
            self._starts[i + 1] = value
        else:
            self._starts.insert(i + 1, value)
            self._ends.insert(i + 1, value)
        return True

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        i = bisect.bisect_right(self._starts, value) - 1
        return i >= 0 and self._ends[i] >= value

    def __len__(self) -> int:
        return sum(e - s + 1 for s, e in zip(self._starts, self._ends, strict=True))

    def __iter__(self) -> Iterator[int]:
        for s, e in zip(self._starts, self._ends, strict=True):
            yield from range(s, e + 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoundSet) and self.ranges() == other.ranges()

    def __repr__(self) -> str:
        return f"RoundSet({self.ranges()})"

    def max(self) -> int:
        """The largest member, or -1 when empty."""
        return self._ends[-1] if self._ends else -1

    def ranges(self) -> list[list[int]]:
        """``[[first, last], ...]``, sorted and merged (JSON-ready)."""
        return [[s, e] for s, e in zip(self._starts, self._ends, strict=True)]

    def issubset(self, other: RoundSet) -> bool:
        """Whether every member is also in ``other``."""
        for s, e in zip(self._starts, self._ends, strict=True):
            i = bisect.bisect_right(other._starts, s) - 1
            if i < 0 or other._ends[i] < e:
                return False
        return True


def balance(outer: OuterStatus | None, units: Mapping[int, UnitStatus]) -> Books:
    """Balance the books of a job from its status records (the outer's and each unit's).

    Every round a unit published (JetStream accepted it) must have been applied exactly once
    or rejected with a reason; no round may be both; the outer's ``applied`` counter must equal
    the number of distinct applied rounds (nothing applied twice); and every applied round
    must be one its unit handed out (below its ``next_round``).

    A unit records a round as published after the broker's ack, so one killed between the ack
    and that record leaves a round the outer applied (or rejected) but the unit never recorded:
    below its ``next_round`` (reserved before the publish), it is counted as ``unrecorded``,
    not a problem. An applied round at or above it is one the unit never handed out (a forged
    or replayed upload under its name) and unbalances the books; a rejected one is counted
    (``foreign_rejected``): the outer refused it, which is what it should do.

    Args:
        outer: The outer's status record (None: no outer has reported).
        units: Unit index -> that unit's status record.
    """
    ledger = outer if outer is not None else LedgerRecord()
    applied = {u: RoundSet(r) for u, r in ledger.applied_rounds.items()}
    rejected = {u: RoundSet(r) for u, r in ledger.rejected_rounds.items()}
    problems: list[str] = []
    per_unit: dict[int, UnitBooks] = {}
    published_total = unrecorded_total = 0
    for unit in sorted(set(units) | set(applied) | set(rejected)):
        status = units.get(unit)
        published = RoundSet(status.published_rounds if status is not None else ())
        handed_out = max(status.next_round if status is not None else 0, published.max() + 1)
        done, refused = applied.get(unit, RoundSet()), rejected.get(unit, RoundSet())
        missing = [r for r in published if r not in done and r not in refused]
        both = [r for r in done if r in refused]
        unrecorded = [r for r in (*done, *refused) if r not in published and r < handed_out]
        foreign = [r for r in done if r >= handed_out]
        foreign_rejected = sum(1 for r in refused if r >= handed_out)
        published_total += len(published)
        unrecorded_total += len(unrecorded)
        per_unit[unit] = UnitBooks(
            published=len(published),
            applied=len(done),
            rejected=len(refused),
            missing=missing[:20],
            unrecorded=len(unrecorded),
            foreign=foreign[:20],
            foreign_rejected=foreign_rejected,
        )
        if missing:
            problems.append(
                f"unit {unit}: {len(missing)} published round(s) neither applied nor "
                f"rejected, e.g. {missing[:5]}"
            )
        if both:
            problems.append(f"unit {unit}: rounds both applied and rejected: {both[:5]}")
        if foreign:
            problems.append(
                f"unit {unit}: {len(foreign)} applied round(s) the unit never handed out "
                f"(its next round is {handed_out}), e.g. {foreign[:5]}"
            )
    distinct = sum(len(r) for r in applied.values())
    if outer is not None and outer.applied != distinct:
        problems.append(
            f"outer applied {outer.applied} updates but {distinct} distinct rounds (applied twice?)"
        )
    return Books(
        balanced=not problems,
        problems=problems,
        per_unit=per_unit,
        applied=distinct,
        published=published_total,
        rejected=sum(ledger.rejected.values()),
        unrecorded=unrecorded_total,
    )


def with_state_file(status: UnitStatus | None, unit: int, state: UnitStateFile) -> UnitStatus:
    """A unit's status record (None: it never wrote one) with the rounds of its state file
    added: the rounds it handed out (``next_round``) and those it recorded as published.

    The unit writes its state file before each publish and after each ack, and its status
    record only every ``--status-interval-s``. A unit that is stopped for good (quarantined:
    its learner killed, its NATS user removed) never writes the status record again, so the
    rounds it published since its last write would read as foreign to :func:`balance`; its
    state file holds them.
    """
    published = RoundSet(status.published_rounds if status is not None else ())
    for first, last in state.published:
        published.add_range(first, last)
    next_round = max(status.next_round if status is not None else 0, state.next_round)
    base = status if status is not None else UnitStatus(unit=unit, state="stopped")
    return base.model_copy(
        update={
            "published_rounds": published.ranges(),
            "next_round": max(next_round, published.max() + 1),
        }
    )


class UnitBooks(Record):
    """One unit's line of the ledger balance."""

    published: Count = 0
    applied: Count = 0
    rejected: Count = 0
    missing: list[Count] = Field([], description="published rounds neither applied nor rejected")
    unrecorded: Count = Field(
        0,
        description="rounds applied or rejected that the unit handed out but never recorded as "
        "published (killed between the broker's ack and its record)",
    )
    foreign: list[Count] = Field(
        [], description="applied rounds the unit never handed out (at or above its next round)"
    )
    foreign_rejected: Count = Field(
        0, description="rejected rounds the unit never handed out (the outer refused them)"
    )


class Books(Record):
    """Whether a job's books balance (``shared.ledger.balance``)."""

    balanced: bool
    problems: list[str] = []
    per_unit: dict[Count, UnitBooks] = {}
    applied: Count = 0
    published: Count = 0
    rejected: Count = 0
    unrecorded: Count = Field(
        0,
        description="rounds the outer saw that their units handed out but never recorded as "
        "published (killed between the broker's ack and the record): JetStream accepted them too",
    )
