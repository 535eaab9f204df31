"""Goodput: the share of the units' compute that became training of the global model (pure).

For a unit u over a window of ``wall_s`` seconds:

    goodput_u = tokens of u the outer applied / (u's healthy speed × wall_s)

where the healthy speed is the unit's own measured training speed while it computes
(``UnitStatus.compute_tokens_per_s``: waits at sync points excluded). Time a unit is dead, paused,
cut off, waiting for a merge, or computing work that is never applied (dropped, rejected, lost
with a killed process) is what lowers it. The job's goodput weighs the units by what they could
have done: Σ applied / Σ (speed × wall).

A unit's window starts when it first trained and spans its restarts: every status record
carries ``lifetime_s`` (seconds since then, on the unit's own clock, so no clock is compared with
another's). A reader adds the record's age on the NATS server's clock unless the unit ended on
purpose, so the time since a killed unit's last report counts as lost.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field, NonNegativeFloat

from shared.job_status import JobStatus
from shared.records import Count, Record, Stamped
from shared.records.unit import ENDED_STATES, UnitStatus


def goodput(
    applied_tokens: Mapping[int, int],
    speeds: Mapping[int, float],
    wall_s: Mapping[int, float],
    up_s: Mapping[int, float] | None = None,
) -> Goodput:
    """Each unit's and the job's goodput, and the share of the windows the units were up.

    Args:
        applied_tokens: per unit, tokens of its uploads the outer applied.
        speeds: per unit, its healthy speed in tokens per second.
        wall_s: per unit, the seconds of its window (from the start of training to its end).
        up_s: per unit, the seconds of its window it spent training (alive, not paused).

    Units without a speed or a window yet are left out. The job's up share weighs the units by
    their speeds, as its goodput does, so that the two compare.
    """
    possible = {
        unit: speeds[unit] * wall_s[unit]
        for unit in speeds
        if unit in wall_s and speeds[unit] > 0 and wall_s[unit] > 0
    }
    units = {unit: applied_tokens.get(unit, 0) / possible[unit] for unit in sorted(possible)}
    total = sum(possible.values())
    job = sum(applied_tokens.get(unit, 0) for unit in possible) / total if total else None
    up = {u: min(1.0, up_s[u] / wall_s[u]) for u in sorted(possible) if up_s and u in up_s}
    job_up = None
    if up and len(up) == len(possible):
        job_up = sum(up[u] * possible[u] for u in possible) / total
    windows = {u: wall_s[u] for u in sorted(possible)}
    return Goodput(job=job, units=units, job_up=job_up, up=up, windows_s=windows)


def window_s(entry: Stamped[UnitStatus]) -> float | None:
    """A unit's goodput window up to the read of ``entry`` (None: it has not trained yet)."""
    status = entry.record
    if status.lifetime_s is None:
        return None
    return status.lifetime_s + (0.0 if status.state in ENDED_STATES else entry.age_s)


def job_goodput(status: JobStatus) -> Goodput | None:
    """Each unit's and the job's goodput from one read of its status records: the outer's
    ledger gives the applied tokens, each unit's record its healthy speed over its life
    (``compute_tokens_per_s``), its window and its time up.

    Returns:
        None before the outer reported.
    """
    outer = status.outer_record()
    if outer is None:
        return None
    applied = {unit: books.tokens for unit, books in outer.units.items()}
    windows = {u: w for u, entry in status.units.items() if (w := window_s(entry)) is not None}
    reported = {u: entry.record.compute_tokens_per_s for u, entry in status.units.items()}
    up = {u: entry.record.lifetime_training_s for u, entry in status.units.items()}
    return goodput(applied, reported, windows, up)


class Goodput(Record):
    """Share of the units' possible work that was applied to the global model
    (``shared.goodput``)."""

    job: NonNegativeFloat | None = Field(None, description="all units together")
    units: dict[Count, NonNegativeFloat] = Field({}, description="per unit")
    job_up: NonNegativeFloat | None = Field(
        None, description="share of the units' windows they spent training (up), all units"
    )
    up: dict[Count, NonNegativeFloat] = Field({}, description="the same per unit")
    windows_s: dict[Count, NonNegativeFloat] = Field({}, description="each unit's window")
