"""Durations a process measures on its own clocks: recent durations of one kind with their
percentiles for the heartbeat (``shared.records.LatencySummary``), and time spent in calls.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from shared.records.unit import LatencySummary

KEPT = 200  # the most recent durations summarised


class Latencies:
    """The last ``KEPT`` durations of one kind (thread-safe)."""

    def __init__(self, kept: int = KEPT) -> None:
        self._lock = threading.Lock()
        self._values: collections.deque[float] = collections.deque(maxlen=kept)
        self._count = 0

    def add(self, seconds: float) -> None:
        """Record one duration."""
        with self._lock:
            self._values.append(max(0.0, seconds))
            self._count += 1

    def values(self) -> list[float]:
        """The kept durations, oldest first."""
        with self._lock:
            return list(self._values)

    def summary(self) -> LatencySummary | None:
        """Count (in all) and percentiles of the kept durations (None before the first)."""
        with self._lock:
            values, count = sorted(self._values), self._count
        if not values:
            return None

        def rank(share: float) -> float:
            return round(values[min(len(values) - 1, int(share * len(values)))], 4)

        return LatencySummary(
            count=count, p50_s=rank(0.5), p95_s=rank(0.95), p99_s=rank(0.99), max_s=values[-1]
        )


class TimeSpent:
    """Seconds spent inside measured calls, summed (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """Args:
        clock: what the blocks are timed with (seconds).
        """
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds = 0.0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Add the time the ``with`` block takes."""
        started = self._clock()
        try:
            yield
        finally:
            elapsed = self._clock() - started
            with self._lock:
                self._seconds += elapsed

    @property
    def seconds(self) -> float:
        """The time summed so far."""
        with self._lock:
            return self._seconds


class SyncLatency:
    """Each upload's time from its sync point until the outer has published global params
    that include it: a params head's ``applied`` round for this unit reaches the upload's round
    (``shared.records.ParamsHead``). Thread-safe.

    Attributes:
        latencies: the measured durations.
    """

    def __init__(self, kept: int = KEPT, max_pending: int = 4096) -> None:
        """Args:
        kept: durations kept for the percentiles.
        max_pending: rounds waiting for a head at most (the oldest is forgotten beyond).
        """
        self.latencies = Latencies(kept)
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._due: dict[int, float] = {}  # round -> its sync point, in order

    def due(self, round_: int, at: float) -> None:
        """Round ``round_`` reached its sync point at ``at`` (``time.monotonic()``)."""
        with self._lock:
            self._due[round_] = at
            while len(self._due) > self._max_pending:
                del self._due[next(iter(self._due))]

    def forget(self, round_: int) -> None:
        """Round ``round_`` will never be applied (dropped before it was sent)."""
        with self._lock:
            self._due.pop(round_, None)

    def applied(self, up_to: int, at: float) -> None:
        """A head says every round up to ``up_to`` is in the global params, seen at ``at``."""
        with self._lock:
            done = [r for r in self._due if r <= up_to]
            durations = [at - self._due.pop(r) for r in done]
        for duration in durations:
            self.latencies.add(duration)

    def pending(self) -> int:
        """Rounds still waiting for a head."""
        with self._lock:
            return len(self._due)
