"""The learner process's counters and its last error, reported in every heartbeat.

The link's parts (sender, encoder, params fetcher) and the training thread (checkpoint writer)
count what happened to uploads, params and checkpoints here; the heartbeat reports a copy.
"""

from __future__ import annotations

import collections
import threading

from shared.records import MAX_ERROR_CHARS


class Counters:
    """Named counts and the last error of this process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._last_error = ""

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name``."""
        with self._lock:
            self._counts[name] += amount

    def __getitem__(self, name: str) -> int:
        """The counter ``name`` (0 when it was never counted)."""
        with self._lock:
            return self._counts[name]

    def as_dict(self) -> dict[str, int]:
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
