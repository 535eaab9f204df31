"""Goodput: applied tokens over what each unit could have trained at its healthy speed."""

from __future__ import annotations

import pytest

from shared.goodput import goodput


def test_goodput_per_unit_and_for_the_job():
    # Unit 0 trained 100 s at 1000 tokens/s and everything was applied; unit 1 (500 tokens/s)
    # was down half of its 100 s; unit 2 has not reported a speed yet.
    result = goodput(
        applied_tokens={0: 100_000, 1: 25_000, 2: 7},
        speeds={0: 1000.0, 1: 500.0},
        wall_s={0: 100.0, 1: 100.0, 2: 100.0},
    )
    assert result.units == {0: pytest.approx(1.0), 1: pytest.approx(0.5)}
    assert result.job == pytest.approx(125_000 / 150_000)  # weighted by what each could do


def test_goodput_without_a_window_is_unknown():
    assert goodput({0: 10}, {0: 100.0}, {}).job is None
    assert goodput({}, {0: 100.0}, {0: 10.0}).units == {0: 0.0}  # nothing applied yet
