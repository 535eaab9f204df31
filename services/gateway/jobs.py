"""The state machines of jobs and units (their records are ``shared.records.JobRecord`` and
``DesiredRecord``).

Pure: no I/O. ``registry.py`` stores the records; ``routes/jobs.py`` and ``routes/units.py``
apply these rules, and ``app.py`` answers a :class:`TransitionError` with 409.

Job states::

    created ──start──▶ running ──pause──▶ paused
       │                 ▲  │               │
       │                 └──┼───resume──────┘
       └──────stop──────────┴──stop─────────┴──▶ stopped   (final; delete: created or stopped)

Unit desired states (bucket ``diloco_desired``, key ``<job>.<unit>``)::

    idle ──start──▶ running ──pause──▶ paused
     │                 ▲  │              │
     │                 └──┼──resume──────┘
     └──────stop───────────┴──stop───────┴──▶ stopped   (final: the unit flushes and exits)

``lost`` is never desired: the gateway reports it when a unit's heartbeats stop.
A job transition writes the matching desired state to every unit that is not ``stopped``.
"""

from __future__ import annotations

from typing import Literal

from shared.records.jobs import DesiredState, JobState

Action = Literal["start", "pause", "resume", "stop"]
#: A unit's actions: a job's, and quarantine.
UnitAction = Literal["start", "pause", "resume", "stop", "quarantine"]

# (state, action) -> new state. Anything else is an invalid transition (HTTP 409).
JOB_TRANSITIONS: dict[tuple[str, str], JobState] = {
    ("created", "start"): "running",
    ("created", "stop"): "stopped",
    ("running", "pause"): "paused",
    ("running", "stop"): "stopped",
    ("paused", "resume"): "running",
    ("paused", "stop"): "stopped",
}
UNIT_TRANSITIONS: dict[tuple[str, str], DesiredState] = {
    ("idle", "start"): "running",
    ("idle", "stop"): "stopped",
    ("running", "pause"): "paused",
    ("running", "stop"): "stopped",
    ("paused", "resume"): "running",
    ("paused", "stop"): "stopped",
    # A unit that misbehaves (a bug, stolen credentials) is shut out whatever it is doing.
    **{(state, "quarantine"): "quarantined" for state in ("idle", "running", "paused", "stopped")},
}
# The desired state of a unit while its job is in a state (new units, job transitions).
UNIT_DESIRED_FOR_JOB: dict[str, DesiredState] = {
    "created": "idle",
    "running": "running",
    "paused": "paused",
    "stopped": "stopped",
}
DELETABLE: tuple[JobState, ...] = ("created", "stopped")


class TransitionError(ValueError):
    """An action that the current state does not allow (HTTP 409)."""


def _next(table: dict[tuple[str, str], str], what: str, state: str, action: str) -> str:
    new = table.get((state, action))
    if new is None:
        allowed = sorted(a for (s, a) in table if s == state)
        hint = f"allowed: {', '.join(allowed)}" if allowed else f"{state} is final"
        raise TransitionError(f"cannot {action} {what} in state {state!r} ({hint})")
    return new


def job_transition(job: str, state: str, action: str) -> JobState:
    """The job's state after ``action``; raises TransitionError when not allowed."""
    return _next(JOB_TRANSITIONS, f"job {job!r}", state, action)  # type: ignore[return-value]


def unit_transition(job: str, unit: int, state: str, action: str) -> DesiredState:
    """A unit's desired state after ``action``; raises TransitionError when not allowed."""
    return _next(UNIT_TRANSITIONS, f"unit {unit} of job {job!r}", state, action)  # type: ignore[return-value]
