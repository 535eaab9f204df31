"""Bytes on the wire against data-parallel training of the same tokens.

Data-parallel training exchanges every step's fp32 gradients; with a ring all-reduce over K
workers each one sends, and receives, 2(K−1)/K × 4 bytes per parameter per step. Per token a
worker trains that is 2 × 2(K−1)/K × 4 × parameters / tokens per step, both directions
together: the figure a unit's bytes per token measured at its link are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.model_config import SIZES
from shared.records.link import LinkStatus
from shared.records.unit import UnitStatus

FP32_BYTES = 4


def data_parallel_bytes_per_token(params: int, units: int, tokens_per_step: int) -> float | None:
    """Bytes one worker sends plus receives per token it trains under data-parallel training
    with a ring all-reduce of fp32 gradients every step (None for a single worker, which
    exchanges nothing, or an unknown step size)."""
    if units < 2 or tokens_per_step <= 0:
        return None
    per_direction = 2 * (units - 1) / units * FP32_BYTES * params
    return 2 * per_direction / tokens_per_step


def times_less(measured_bytes_per_token: float | None, data_parallel: float | None) -> float | None:
    """How many times fewer bytes per token than data-parallel (None when either is unknown
    or nothing was measured)."""
    if not measured_bytes_per_token or data_parallel is None:
        return None
    return data_parallel / measured_bytes_per_token


def unit_data_parallel_bytes_per_token(status: UnitStatus) -> float | None:
    """:func:`data_parallel_bytes_per_token` for the model, units and step size a unit
    reports (None when it has not reported them)."""
    if status.model is None:
        return None
    return data_parallel_bytes_per_token(
        SIZES[status.model].param_count, status.num_units, status.tokens_per_step
    )


@dataclass(frozen=True)
class LinkUsage:
    """What a unit's link carried per token, against data-parallel training (None: unknown)."""

    bytes_per_token: float | None
    data_parallel_bytes_per_token: float | None
    times_less: float | None


def link_usage(link: LinkStatus, unit: UnitStatus | None) -> LinkUsage:
    """Bytes up and down per token the unit trained, and how many times fewer than
    data-parallel (``unit``: the unit's status record; None when it never reported)."""
    tokens = unit.tokens if unit is not None else 0
    per_token = (link.bytes_up + link.bytes_down) / tokens if tokens else None
    data_parallel = unit_data_parallel_bytes_per_token(unit) if unit is not None else None
    return LinkUsage(per_token, data_parallel, times_less(per_token, data_parallel))
