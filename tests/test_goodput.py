"""Goodput: applied tokens over what each unit could have trained at its healthy speed."""

from __future__ import annotations

import pytest

from shared.goodput import goodput, job_goodput, window_s
from shared.job_status import JobStatus
from shared.records import Stamped
from shared.records.outer import OuterStatus, UnitLedger
from shared.records.unit import UnitStatus


def test_goodput_per_unit_and_for_the_job():
    # Unit 0 trained 100 s at 1000 tokens/s and everything was applied; unit 1 (500 tokens/s)
    # was down half of its 100 s; unit 2 has not reported a speed yet.
    result = goodput(
        applied_tokens={0: 100_000, 1: 25_000, 2: 7},
        speeds={0: 1000.0, 1: 500.0},
        wall_s={0: 100.0, 1: 100.0, 2: 100.0},
        up_s={0: 100.0, 1: 50.0, 2: 100.0},
    )
    assert result.units == {0: pytest.approx(1.0), 1: pytest.approx(0.5)}
    assert result.job == pytest.approx(125_000 / 150_000)  # weighted by what each could do
    assert result.up == {0: pytest.approx(1.0), 1: pytest.approx(0.5)}
    assert result.job_up == pytest.approx(125_000 / 150_000)


def test_goodput_without_a_window_is_unknown():
    assert goodput({0: 10}, {0: 100.0}, {}).job is None
    assert goodput({}, {0: 100.0}, {0: 10.0}).units == {0: 0.0}  # nothing applied yet


def stamped(age_s: float, **fields) -> Stamped[UnitStatus]:
    return Stamped(record=UnitStatus(**fields), age_s=age_s, stamp=0.0, revision=1)


def test_a_dead_units_window_grows_with_its_records_age_and_an_ended_ones_does_not():
    assert window_s(stamped(5.0, unit=0, state="running")) is None  # never trained
    assert window_s(stamped(5.0, unit=0, state="running", lifetime_s=60.0)) == 65.0
    assert window_s(stamped(5.0, unit=0, state="finished", lifetime_s=60.0)) == 60.0


def test_job_goodput_from_one_read_of_the_status_records():
    outer = OuterStatus(
        state="running",
        model="tiny",
        holder="h",
        units={0: UnitLedger(tokens=90_000), 1: UnitLedger(tokens=10_000)},
    )
    fast = {"state": "running", "compute_tokens_per_s": 1000.0}
    units = {
        # Unit 0 ran 100 s at 1000 tokens/s; unit 1 was killed 90 s ago after 10 s.
        0: stamped(0.0, unit=0, lifetime_s=100.0, lifetime_training_s=95.0, **fast),
        1: stamped(90.0, unit=1, lifetime_s=10.0, lifetime_training_s=10.0, **fast),
    }
    status = JobStatus(job="j", outer=Stamped(outer, 0.0, 0.0, 1), units=units)
    result = job_goodput(status)
    assert result is not None
    assert result.units == {0: pytest.approx(0.9), 1: pytest.approx(0.1)}
    assert result.job == pytest.approx(0.5)
    assert result.up == {0: pytest.approx(0.95), 1: pytest.approx(0.1)}
    assert job_goodput(JobStatus(job="j", units=units)) is None  # no outer yet
