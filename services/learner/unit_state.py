"""The unit's small durable record (``state.json``): rounds used, rounds published, desired
state and lifetime counters, so that a restarted unit never reuses a round number and obeys
the desired state it last knew even when NATS is unreachable.

The file lives in ``<checkpoint_dir>/<job>/unit-<u>/state.json`` and holds one
``shared.records.unit.UnitStateFile``::

    {"job": "J", "unit": 0,
     "next_round": 42,                  # first round number never handed out yet
     "desired": "running",              # last known desired state (idle|running|paused|stopped)
     "published": [[0, 37], [39, 41]],  # rounds JetStream accepted (RoundSet ranges, lifetime)
     "lifetime": {"published": 41, "dropped_unsent": 1, "rejected_local": 0},
     "first_trained_at": 1764490000.0,  # when the unit first trained (its clock; goodput)
     "trained_s": 120.5,                # seconds its processes spent training (goodput) ...
     "computing_s": 118.0,              # ... of which computing (not waiting at a sync point)
     "computed_tokens": 245760}         # ... and the tokens computed meanwhile

It is rewritten atomically (``shared/atomic.py``) by the training thread when
uploads are taken, *before* they are handed to the link (so a round is persisted before it can
be published), and by the link thread after each publish and when the desired state changes.
Both threads share one :class:`UnitState`, whose lock orders the writes. Without a checkpoint
folder the same object keeps the record in memory only (for the status record).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from shared import records
from shared.atomic import atomic_write_bytes
from shared.ledger import RoundSet
from shared.records.jobs import DESIRED_STATES, DesiredState
from shared.records.unit import UnitStateFile
from shared.unit_counters import LIFETIME_COUNTERS, LifetimeCounter

log = logging.getLogger(__name__)

STATE_FILE = "state.json"


def unit_dir(checkpoint_dir: str | Path, job: str, unit: int) -> Path:
    """The folder of one unit's state file and checkpoint."""
    return Path(checkpoint_dir) / job / f"unit-{unit}"


def state_file(checkpoint_dir: str | Path, job: str, unit: int) -> Path:
    """The path of one unit's state file."""
    return unit_dir(checkpoint_dir, job, unit) / STATE_FILE


def read_state_file(path: Path, job: str, unit: int) -> UnitStateFile | None:
    """The state file of ``job``'s ``unit`` at ``path``, or None (logged) when it is missing or
    unreadable, names another unit, or its published rounds are not valid ranges."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("cannot read unit state %s (%s)", path, err)
        return None
    record = records.decode(UnitStateFile, raw, str(path))
    try:
        if record is None:
            raise ValueError("not a unit state record")
        if (record.job, record.unit) != (job, unit):
            raise ValueError(f"it names {record.job!r} unit {record.unit}")
        RoundSet(record.published)
    except ValueError as err:
        log.warning("ignoring unreadable unit state %s: %s", path, err)
        return None
    return record


class UnitState:
    """Rounds reserved and published, desired state and lifetime counters of one unit.

    Thread-safe; every change is written through to the file (when there is one) at once.
    Write failures are logged and counted (:attr:`write_errors`), never raised: the unit
    keeps training.
    """

    def __init__(self, path: Path | None = None, job: str = "", unit: int = 0) -> None:
        """Load ``path`` if it exists (a missing or unreadable file starts afresh).

        Args:
            path: the state file, or None to keep the record in memory only.
            job: job name (recorded in the file).
            unit: unit index (recorded in the file).
        """
        self.path = path
        self.job = job
        self.unit = unit
        self.next_round = 0
        self.desired: DesiredState = "running"
        self.published = RoundSet()
        self.lifetime: dict[str, int] = dict.fromkeys(LIFETIME_COUNTERS, 0)
        self.first_trained_at: float | None = None
        self.trained_s = 0.0
        self.computing_s = 0.0
        self.computed_tokens = 0
        self.loaded = False
        self.write_errors = 0
        self._lock = threading.Lock()
        if path is not None:
            self._load(path)

    @classmethod
    def for_unit(cls, checkpoint_dir: str | None, job: str, unit: int) -> UnitState:
        """The unit's state (file-backed when ``checkpoint_dir`` is set, else in memory)."""
        path = None if checkpoint_dir is None else state_file(checkpoint_dir, job, unit)
        return cls(path, job, unit)

    # ---- changes (each one is written through) -----------------------------------------------

    def reserve(self, next_round: int) -> None:
        """Record that every round below ``next_round`` has been handed out.

        Called by the training thread right after it took uploads and *before* it submits them,
        so that a restarted unit never numbers an upload with a round already used.
        """
        with self._lock:
            if next_round <= self.next_round:
                return
            self.next_round = next_round
            self._write()

    def record(self, counter: LifetimeCounter, round_number: int | None = None) -> None:
        """Count one ``published``/``dropped_unsent``/``rejected_local`` upload (lifetime).

        Args:
            counter: one of ``LIFETIME_COUNTERS``.
            round_number: the upload's round; added to the published set for ``published``.
        """
        if counter not in LIFETIME_COUNTERS:
            raise ValueError(f"unknown lifetime counter {counter!r}")
        with self._lock:
            self.lifetime[counter] += 1
            if counter == "published" and round_number is not None:
                self.published.add(round_number)
                self.next_round = max(self.next_round, round_number + 1)
            self._write()

    def set_desired(self, state: DesiredState) -> None:
        """Remember the desired state across restarts.

        Raises:
            ValueError: ``state`` is not one of ``shared.records.DESIRED_STATES``.
        """
        if state not in DESIRED_STATES:
            raise ValueError(f"desired state must be one of {DESIRED_STATES}, got {state!r}")
        with self._lock:
            if state == self.desired:
                return
            self.desired = state
            self._write()

    def mark_trained(self, now: float) -> None:
        """Remember when the unit first trained (``now``, unix seconds); later calls keep the
        first time, so goodput's window spans the unit's restarts."""
        with self._lock:
            if self.first_trained_at is not None:
                return
            self.first_trained_at = now
            self._write()

    def set_lifetime(self, trained_s: float, computing_s: float, computed_tokens: int) -> None:
        """Record, across restarts, the seconds the unit's processes have spent training, of
        which computing, and the tokens they computed (the status report writes them through
        about every second)."""
        with self._lock:
            self.trained_s, self.computing_s = trained_s, computing_s
            self.computed_tokens = computed_tokens
            self._write()

    # ---- reading -----------------------------------------------------------------------------

    def as_record(self) -> UnitStateFile:
        """The record as written to the file."""
        with self._lock:
            return self._record()

    def _record(self) -> UnitStateFile:
        return UnitStateFile(
            job=self.job,
            unit=self.unit,
            next_round=self.next_round,
            desired=self.desired,
            published=self.published.ranges(),
            lifetime=dict(self.lifetime),
            first_trained_at=self.first_trained_at,
            trained_s=round(self.trained_s, 3),
            computing_s=round(self.computing_s, 3),
            computed_tokens=self.computed_tokens,
        )

    # ---- the file ----------------------------------------------------------------------------

    def _write(self) -> None:
        """Write the record through (the caller holds the lock)."""
        if self.path is None:
            return
        try:
            atomic_write_bytes(self.path, records.encode(self._record()))
        except OSError as err:
            self.write_errors += 1
            log.error("cannot write unit state %s: %s", self.path, err)

    def _load(self, path: Path) -> None:
        record = read_state_file(path, self.job, self.unit)
        if record is None:
            return
        published = RoundSet(record.published)
        self.published = published
        self.next_round = max(record.next_round, published.max() + 1, 0)
        self.desired = record.desired
        for name in LIFETIME_COUNTERS:
            self.lifetime[name] = record.lifetime.get(name, 0)
        self.first_trained_at = record.first_trained_at
        self.trained_s = record.trained_s
        self.computing_s = record.computing_s
        self.computed_tokens = record.computed_tokens
        self.loaded = True
        log.info(
            "unit state %s: next round %d, desired %s, %d rounds published",
            path,
            self.next_round,
            self.desired,
            len(self.published),
        )
