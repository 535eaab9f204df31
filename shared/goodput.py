"""Goodput: the share of the units' compute that became training of the global model (pure).

For a unit u over a window of ``wall_s`` seconds:

    goodput_u = tokens of u the outer applied / (u's healthy speed × wall_s)

where the healthy speed is the unit's own measured training speed while it computes
(``UnitStatus.compute_tokens_per_s``: waits at sync points excluded). Time a unit is dead, paused,
cut off, waiting for a merge, or computing work that is never applied (dropped, rejected, lost
with a killed process) is what lowers it. The job's goodput weighs the units by what they could
have done: Σ applied / Σ (speed × wall).
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.records import Goodput


def goodput(
    applied_tokens: Mapping[int, int], speeds: Mapping[int, float], wall_s: Mapping[int, float]
) -> Goodput:
    """Each unit's and the job's goodput.

    Args:
        applied_tokens: per unit, tokens of its uploads the outer applied.
        speeds: per unit, its healthy speed in tokens per second.
        wall_s: per unit, the seconds of its window (from the start of training to its end).

    Units without a speed or a window yet are left out.
    """
    possible = {
        unit: speeds[unit] * wall_s[unit]
        for unit in speeds
        if unit in wall_s and speeds[unit] > 0 and wall_s[unit] > 0
    }
    units = {unit: applied_tokens.get(unit, 0) / possible[unit] for unit in sorted(possible)}
    total = sum(possible.values())
    job = sum(applied_tokens.get(unit, 0) for unit in possible) / total if total else None
    return Goodput(job=job, units=units)
