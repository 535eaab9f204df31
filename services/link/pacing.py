"""When bytes cross a shaped link: the rate as a serial line, the delay with jitter (pure).

A direction of a link is modelled as a serial line of fixed rate: the bytes offered to it
cross one after another, so a chunk of ``n`` bytes offered at ``t`` has crossed at
``max(t, line free) + n / rate``. An idle line saves up no credit, as a real one does not, so
the throughput over any busy period is the rate itself. The chunk then arrives one delay
later; jitter varies that delay per chunk, never reordering the bytes of a connection.
"""

from __future__ import annotations

import math
import random

#: How long one slice of bytes holds the line: the shaper reads at most rate × this at a time,
#: so that a slow link moves in small, even steps. 20 ms keeps the proxy's own CPU small (about
#: 3% of a core per busy direction at 1 Mbit/s, against 7% at 5 ms).
SLICE_S = 0.02
MIN_SLICE_BYTES = 1024
MAX_SLICE_BYTES = 64 << 10


class SerialLine:
    """One direction of a link, shared by every connection over it.

    Attributes:
        rate: bytes per second (None: no cap, bytes cross at once).
        busy_s: seconds the line has spent carrying bytes (for its utilisation).
    """

    def __init__(self, rate: float | None) -> None:
        if rate is not None and not rate > 0:
            raise ValueError(f"a line's rate must be above zero, got {rate}")
        self.rate = rate
        self.busy_s = 0.0
        self._free_at = -math.inf

    def slice_bytes(self) -> int:
        """The most bytes to offer at a time."""
        if self.rate is None:
            return MAX_SLICE_BYTES
        return int(min(MAX_SLICE_BYTES, max(MIN_SLICE_BYTES, self.rate * SLICE_S)))

    def send(self, size: int, now: float) -> tuple[float, float]:
        """Offer ``size`` bytes at time ``now``; the times their first byte starts crossing
        and their last byte has crossed."""
        if self.rate is None:
            return now, now
        duration = size / self.rate
        start = max(now, self._free_at)
        self._free_at = start + duration
        self.busy_s += duration
        return start, self._free_at


class Delay:
    """The arrival times of one connection's chunks in one direction.

    Each chunk arrives ``delay ± uniform(jitter)`` after it crossed the line, but never before
    the chunk ahead of it (a TCP stream stays in order).
    """

    def __init__(self, delay_s: float, jitter_s: float, rng: random.Random) -> None:
        if delay_s < 0 or jitter_s < 0:
            raise ValueError(f"delay and jitter must be >= 0, got {delay_s} and {jitter_s}")
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self._rng = rng
        self._last = -math.inf

    def arrival(self, crossed_at: float) -> float:
        """When a chunk that crossed the line at ``crossed_at`` arrives."""
        delay = self.delay_s
        if self.jitter_s:
            delay = max(0.0, delay + self._rng.uniform(-self.jitter_s, self.jitter_s))
        self._last = max(self._last, crossed_at + delay)
        return self._last
