"""Bytes per token against data-parallel training (pure)."""

from __future__ import annotations

import pytest

from shared.bandwidth import (
    data_parallel_bytes_per_token,
    times_less,
    unit_data_parallel_bytes_per_token,
)
from shared.records.unit import UnitStatus


def test_data_parallel_counts_a_ring_all_reduce_of_fp32_gradients_each_way():
    # 4 workers: each sends 2·3/4 of the gradient and receives as much, 4 bytes a parameter.
    assert data_parallel_bytes_per_token(1000, 4, 100) == pytest.approx(2 * 1.5 * 4 * 1000 / 100)
    assert data_parallel_bytes_per_token(1000, 2, 100) == pytest.approx(2 * 1.0 * 4 * 1000 / 100)
    assert data_parallel_bytes_per_token(1000, 1, 100) is None  # nothing to exchange
    assert data_parallel_bytes_per_token(1000, 4, 0) is None


def test_a_units_figure_comes_from_what_it_reports():
    status = UnitStatus(unit=0, model="small", num_units=4, tokens_per_step=16 * 128)
    expected = 2 * 1.5 * 4 * 676_992 / 2048
    assert unit_data_parallel_bytes_per_token(status) == pytest.approx(expected)
    assert unit_data_parallel_bytes_per_token(UnitStatus(unit=0)) is None
    assert times_less(10.0, expected) == pytest.approx(expected / 10)
    assert times_less(0.0, expected) is None and times_less(10.0, None) is None
