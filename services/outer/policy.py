"""When to merge: apply every arrival alone, or wait for a minimum quorum and a grace window.

Decoupled DiLoCo's syncer merges a fragment once at least K learners have reported (minimum
quorum; K = 1 means progress never stops), then may wait a little longer inside an **adaptive
grace window** to bring in more learners when that costs little (arXiv 2604.21428;
docs/ALGORITHMS.md, "Outer"). Our window is derived from observed arrival times:

* each unit's upload interval is tracked (exponential moving average); units that uploaded
  within the last three median intervals are *active*;
* when the quorum is reached at t_q, the policy merges as soon as every active unit is in, and
  at the latest at t_q + clamp(grace_factor × median interval, grace_min_s, grace_max_s);
* so a unit that is slow, paused or gone delays a merge by at most that window, and stops
  being waited for once it has been silent for three intervals. Units never wait for merges.

Time is passed in (``now``), so the same policy runs on the wall clock in the outer service and
on a simulated clock in the quality benchmark.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from shared.outer_choices import POLICIES

ACTIVE_INTERVALS = 3.0
_EMA = 0.5


@dataclass
class Arrival:
    """One validated pseudo-gradient waiting to be merged.

    Attributes:
        unit, round: Who sent it, and its per-unit round number.
        base_version: The fragment's version it was computed against.
        inner_steps, tokens: The work behind it (token weights).
        pseudo_grad: ``{piece name: array}`` of its fragment.
        arrived_at: When it arrived, on the caller's clock (wall or simulated).
        upload: Its upload id (``shared.wire.chunks.upload_id``).
        train_loss: The mean train loss its unit reported (a report, not an input to the math).
        messages: The transport's handles of its messages (to acknowledge once the merge that
            uses it is committed); opaque here.
        norm: Its pseudo-gradient's L2 norm (after clipping), set by the core's norm guard.
        clipped: Whether the norm guard scaled it down.
    """

    unit: int
    round: int
    base_version: int
    inner_steps: int
    tokens: int
    pseudo_grad: Any
    arrived_at: float
    upload: str = ""
    train_loss: float | None = None
    messages: Any = None
    norm: float | None = None
    clipped: bool = False


@dataclass
class UploadIntervals:
    """Each unit's last upload and its upload interval, smoothed (an exponential moving
    average): who is active, and how long a typical interval is. The merge policy's grace
    window and the cluster simulator (``sim/cluster/engine.py``) both read it."""

    last_arrival: dict[int, float] = field(default_factory=dict)
    intervals: dict[int, float] = field(default_factory=dict)

    def seen(self, unit: int, now: float) -> None:
        """Record an upload of ``unit`` at ``now``."""
        if unit in self.last_arrival:
            gap = max(0.0, now - self.last_arrival[unit])
            previous = self.intervals.get(unit)
            self.intervals[unit] = gap if previous is None else _EMA * gap + (1 - _EMA) * previous
        self.last_arrival[unit] = now

    def median(self) -> float | None:
        """The median of the units' intervals (None before any unit uploaded twice)."""
        return statistics.median(self.intervals.values()) if self.intervals else None

    def active(self, now: float, expected_units: int = 0) -> set[int]:
        """Units that uploaded within ``ACTIVE_INTERVALS`` median intervals before ``now``.
        Before any interval is known, every unit that uploaded, and units
        ``0 .. expected_units - 1``."""
        median = self.median()
        if median is None:
            return set(self.last_arrival) | set(range(expected_units))
        silence = ACTIVE_INTERVALS * median
        return {u for u, t in self.last_arrival.items() if t >= now - silence}


@dataclass
class MergePolicy:
    """Buffering rule of one fragment. ``add`` arrivals, ask ``ready``, then ``take``."""

    kind: str
    min_quorum: int
    grace_factor: float
    grace_min_s: float
    grace_max_s: float
    expected_units: int = 0
    sync_rounds: bool = False
    buffer: list[Arrival] = field(default_factory=list)
    fresh_units: set[int] = field(default_factory=set)
    uploads: UploadIntervals = field(default_factory=UploadIntervals)
    quorum_at: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"merge policy must be one of {POLICIES}, got {self.kind!r}")
        if self.min_quorum < 1:
            raise ValueError(f"min quorum must be >= 1, got {self.min_quorum}")
        if self.grace_factor < 0 or not 0 <= self.grace_min_s <= self.grace_max_s:
            raise ValueError("need grace_factor >= 0 and 0 <= grace_min_s <= grace_max_s")

    def add(self, arrival: Arrival, fresh: bool = True) -> None:
        """Buffer an arrival and learn its unit's upload interval.

        With ``sync_rounds`` (synchronous DiLoCo) only a *fresh* arrival (based on the current
        version) takes part in the round: it starts the round's clock and counts as its unit
        being in. A stale one (its unit was dropped from an earlier round) is merged with the
        round but neither starts nor completes it, so a late unit cannot split the units into
        rounds of their own that each wait for the timeout.
        """
        unit, now = arrival.unit, arrival.arrived_at
        self.uploads.seen(unit, now)
        self.buffer.append(arrival)
        if fresh or not self.sync_rounds:
            self.fresh_units.add(unit)
        if self.quorum_at is None and len(self.fresh_units) >= self.min_quorum:
            self.quorum_at = now

    def _window_cap(self) -> float:
        median = self.uploads.median()
        if median is None:
            return self.grace_min_s
        return min(self.grace_max_s, max(self.grace_min_s, self.grace_factor * median))

    def deadline(self) -> float | None:
        """When the buffered arrivals must be merged at the latest (None: nothing pending)."""
        if self.kind == "each":
            return 0.0 if self.buffer else None
        if self.quorum_at is None:
            if not (self.sync_rounds and self.buffer):
                return None
            # Stale uploads alone (sync rounds) wait for a round until no unit is active any
            # more, as at the end of a job: merged alone, they would make the work of every
            # unit still computing stale.
            interval = self.uploads.median() or 0.0
            return self.buffer[0].arrived_at + ACTIVE_INTERVALS * max(self._window_cap(), interval)
        if self.active_units(self.quorum_at) <= self.fresh_units:
            return self.quorum_at
        return self.quorum_at + self._window_cap()

    def active_units(self, now: float) -> set[int]:
        """Units that uploaded recently (:meth:`UploadIntervals.active`); before any interval
        is known, units ``0 .. expected_units - 1`` too (synchronous DiLoCo's first round waits
        for every unit)."""
        return self.uploads.active(now, self.expected_units)

    def ready(self, now: float) -> bool:
        """Whether the buffer should be merged now."""
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def take(self, most: int = 1) -> list[Arrival]:
        """Remove and return what the next merge uses: the ``most`` oldest arrivals under
        ``each`` (each is applied in a step of its own), everything buffered under
        ``quorum``."""
        if self.kind == "each":
            taken, self.buffer = self.buffer[:most], self.buffer[most:]
            return taken
        taken, self.buffer, self.quorum_at = self.buffer, [], None
        self.fresh_units = set()
        return taken
