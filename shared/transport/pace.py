"""How fast one connection's publishes are acknowledged, so that a publish's timeout allows for
its bytes to cross the link the connection has, not the slowest one it might have.

A chunk's publish waits for JetStream's ack for ``ATTEMPT_TIMEOUT_S`` plus its bytes' time on
the link (``shared/transport/blobs.py``) before it is sent again. With the slowest link assumed
(1 Mbit/s), a 1 MiB chunk waits 10 s, so a request lost in a broker failover on a fast link
held the outer's checkpoint that long. :class:`AckPace` measures the link from the acks of
large publishes instead, and assumes the slowest link until it has measured enough.
"""

from __future__ import annotations

from collections import deque
from typing import Any
from weakref import WeakKeyDictionary

#: Publishes smaller than this measure the round trip, not the link, and are not counted.
MIN_SAMPLE_BYTES = 64 * 1024
#: The acks the estimate is taken over; it is trusted only once there are this many.
SAMPLES = 8


class AckPace:
    """The slowest throughput among a connection's last ``SAMPLES`` acknowledged large
    publishes (bits per second), never below ``floor_bits_per_s``, which it is until then.

    The slowest, not the mean: one slow ack (a loaded machine, a stalled link) brings the
    estimate down at once, and it rises again only once ``SAMPLES`` faster ones have passed.
    """

    def __init__(self, floor_bits_per_s: float) -> None:
        self.floor_bits_per_s = floor_bits_per_s
        self._samples: deque[float] = deque(maxlen=SAMPLES)

    def observe(self, nbytes: int, elapsed_s: float) -> None:
        """A publish whose ``nbytes`` (with those sent ahead of it) were acked ``elapsed_s``
        after it was sent."""
        if nbytes >= MIN_SAMPLE_BYTES and elapsed_s > 0:
            self._samples.append(nbytes * 8 / elapsed_s)

    def bits_per_s(self) -> float:
        """The link speed a publish's timeout allows for."""
        if len(self._samples) < SAMPLES:
            return self.floor_bits_per_s
        return max(self.floor_bits_per_s, min(self._samples))


_PACES: WeakKeyDictionary[Any, AckPace] = WeakKeyDictionary()


def pace_of(js: Any, floor_bits_per_s: float) -> AckPace:
    """The :class:`AckPace` of the connection behind JetStream context ``js`` (nats-py keeps it
    in ``_nc``), kept while the connection lives."""
    connection = getattr(js, "_nc", js)
    pace = _PACES.get(connection)
    if pace is None:
        pace = _PACES[connection] = AckPace(floor_bits_per_s)
    return pace
