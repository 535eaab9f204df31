"""Durations a process measures on its own clocks: recent durations of one kind with their
percentiles for the heartbeat (``shared.records.LatencySummary``), and time spent in calls.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator

from shared.records import LatencySummary

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

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Add the time the ``with`` block takes."""
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._seconds += elapsed

    @property
    def seconds(self) -> float:
        """The time summed so far."""
        with self._lock:
            return self._seconds
