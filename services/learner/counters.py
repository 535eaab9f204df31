"""The learner process's counters and its last error, reported in every heartbeat.

The link's parts (sender, encoder, params fetcher) and the training thread (checkpoint writer)
count what happened to uploads, params and checkpoints here; the heartbeat reports a copy.
Every name is a :data:`~shared.unit_counters.CounterName`.
"""

from __future__ import annotations

import collections
import threading

from shared.records import MAX_ERROR_CHARS
from shared.unit_counters import COUNTER_NAMES, CounterName


class Counters:
    """Named counts and the last error of this process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[CounterName] = collections.Counter()
        self._last_error = ""

    def add(self, name: CounterName, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name``.

        Raises:
            ValueError: ``name`` is not a ``CounterName``.
        """
        if name not in COUNTER_NAMES:
            raise ValueError(f"unknown counter {name!r}; counters are {COUNTER_NAMES}")
        with self._lock:
            self._counts[name] += amount

    def __getitem__(self, name: CounterName) -> int:
        """The counter ``name`` (0 when it was never counted)."""
        with self._lock:
            return self._counts[name]

    def as_dict(self) -> dict[CounterName, int]:
        """A copy of every counter counted so far."""
        with self._lock:
            return dict(self._counts)

    def error(self, message: str) -> None:
        """Remember ``message`` as the last error (cut to what a status record holds)."""
        with self._lock:
            self._last_error = message[:MAX_ERROR_CHARS]

    @property
    def last_error(self) -> str:
        """The last error remembered ('' when none)."""
        with self._lock:
            return self._last_error
