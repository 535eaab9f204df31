"""The outer's books: what it applied and rejected, unit by unit, so that they balance.

Every upload the outer receives is applied exactly once (its round is in ``applied_rounds``)
or rejected with a reason (counted in ``rejected``, its round in ``rejected_rounds``); the
round sets double as the deduplication set that recognises a redelivered upload. The books go
into every checkpoint and every status record as a ``shared.records.LedgerRecord``
(:meth:`OuterLedger.to_record`, :meth:`OuterLedger.load`); ``shared.ledger.balance`` checks
them against what the units published.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.outer.errors import RejectionReason
from services.outer.policy import Arrival
from shared.ledger import RoundSet
from shared.records import MAX_OUTER_UNITS
from shared.records.outer import LedgerRecord, UnitLedger

Done = Literal["applied", "rejected"]


@dataclass
class OuterLedger:
    """The outer's counters and round sets (see the module docstring).

    Attributes:
        applied: Uploads applied.
        merges: Outer steps taken.
        deduplicated: Redelivered chunk messages of uploads applied before.
        tokens_applied: Tokens behind the applied uploads, each upload's weighted by its
            fragment's share of the parameters (:meth:`merged`).
        clipped: Applied uploads the norm guard scaled down (``norm_guard.py``).
        rejected: Rejected uploads (and stray chunks) by reason (a ``RejectionReason``; a
            checkpoint of a newer outer may hold others).
        units: Per unit, what was applied of it.
        staleness: Applied uploads by staleness.
        codecs: Accepted uploads by the codec named in their description.
        payload_bytes: Compressed bytes of the accepted uploads.
        applied_rounds, rejected_rounds: Per unit, the rounds applied and rejected.
    """

    applied: int = 0
    merges: int = 0
    deduplicated: int = 0
    tokens_applied: int = 0
    clipped: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    units: dict[int, UnitLedger] = field(default_factory=dict)
    staleness: collections.Counter[int] = field(default_factory=collections.Counter)
    codecs: collections.Counter[str] = field(default_factory=collections.Counter)
    payload_bytes: int = 0
    applied_rounds: dict[int, RoundSet] = field(default_factory=dict)
    rejected_rounds: dict[int, RoundSet] = field(default_factory=dict)

    # ---- records -----------------------------------------------------------------------------

    def to_record(self) -> LedgerRecord:
        """The books as the record that checkpoints and status records carry."""
        return LedgerRecord(
            applied=self.applied,
            merges=self.merges,
            deduplicated=self.deduplicated,
            tokens_applied=self.tokens_applied,
            clipped=self.clipped,
            rejected=dict(self.rejected),
            units={u: stats.model_copy() for u, stats in sorted(self.units.items())},
            staleness=dict(sorted(self.staleness.items())),
            codecs=dict(self.codecs),
            payload_bytes=self.payload_bytes,
            applied_rounds={u: r.ranges() for u, r in sorted(self.applied_rounds.items())},
            rejected_rounds={u: r.ranges() for u, r in sorted(self.rejected_rounds.items())},
        )

    def load(self, record: LedgerRecord) -> None:
        """Continue from ``record`` (a checkpoint's books), replacing every count here."""
        self.applied = record.applied
        self.merges = record.merges
        self.deduplicated = record.deduplicated
        self.tokens_applied = record.tokens_applied
        self.clipped = record.clipped
        self.rejected = collections.Counter(record.rejected)
        self.units = {u: stats.model_copy() for u, stats in record.units.items()}
        self.staleness = collections.Counter(record.staleness)
        self.codecs = collections.Counter(record.codecs)
        self.payload_bytes = record.payload_bytes
        self.applied_rounds = {u: RoundSet(r) for u, r in record.applied_rounds.items()}
        self.rejected_rounds = {u: RoundSet(r) for u, r in record.rejected_rounds.items()}

    # ---- entries -----------------------------------------------------------------------------

    def is_done(self, unit: int, round_: int) -> Done | None:
        """``"applied"`` or ``"rejected"`` if this upload was dealt with already, else None."""
        if round_ in self.applied_rounds.get(unit, ()):
            return "applied"
        if round_ in self.rejected_rounds.get(unit, ()):
            return "rejected"
        return None

    def accept(self, codec: str, payload_bytes: int) -> None:
        """Count an upload that passed validation (it is applied by a later merge)."""
        self.codecs[codec] += 1
        self.payload_bytes += payload_bytes

    def merged(
        self,
        arrivals: Sequence[Arrival],
        staleness: Sequence[int],
        share: float = 1.0,
        steps: int = 1,
    ) -> None:
        """Enter a merge's outer steps (one, or under ``each`` one per upload of a backlog
        applied together) and the uploads they applied (with their staleness): ``merges``
        counts outer steps, so it equals the version.

        ``share``: the merged fragment's share of the parameters. With P fragments a unit's
        training reaches the model through P uploads, each of one fragment: each counts its
        tokens × share, so that the tokens applied add up to the tokens trained (not P times
        them), and goodput stays a share of the units' compute.
        """
        self.merges += steps
        for arrival, stale in zip(arrivals, staleness, strict=True):
            tokens = round(arrival.tokens * share)
            self.applied_rounds.setdefault(arrival.unit, RoundSet()).add(arrival.round)
            self.applied += 1
            self.tokens_applied += tokens
            self.clipped += arrival.clipped
            self.staleness[stale] += 1
            stats = self.units.setdefault(arrival.unit, UnitLedger())
            stats.applied += 1
            stats.clipped += arrival.clipped
            stats.last_round = max(stats.last_round, arrival.round)
            stats.last_staleness = stale
            stats.tokens += tokens
            stats.last_train_loss = finite_or_none(arrival.train_loss)

    def skipped(self, unit: int, rounds: int) -> None:
        """Count ``rounds`` round numbers a unit skipped before an upload the outer accepted
        (``order.py``)."""
        stats = self.units.setdefault(unit, UnitLedger())
        stats.skipped_rounds += rounds

    def reject(self, reason: RejectionReason, unit_round: tuple[int, int] | None) -> None:
        """Count a rejection by reason, and under its unit when ``unit_round`` names the upload
        (units no job can have, ``MAX_OUTER_UNITS`` or more, only by reason: junk ids must not
        grow the books)."""
        self.rejected[reason] += 1
        if unit_round is not None and 0 <= unit_round[0] < MAX_OUTER_UNITS:
            unit, round_ = unit_round
            self.rejected_rounds.setdefault(unit, RoundSet()).add(round_)
            stats = self.units.setdefault(unit, UnitLedger())
            stats.rejected[reason] = stats.rejected.get(reason, 0) + 1


def finite_or_none(value: float | None) -> float | None:
    """``value`` if it is a finite number, else None (a diverged unit may report NaN)."""
    return value if value is not None and math.isfinite(value) else None
