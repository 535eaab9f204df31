"""A learner's own measurements: latency percentiles and time spent in calls (pure)."""

from __future__ import annotations

import time

from shared.latency import Latencies, TimeSpent


def test_latencies_summarise_the_most_recent_durations():
    latencies = Latencies(kept=100)
    assert latencies.summary() is None
    for value in range(1, 201):  # only 101..200 are kept
        latencies.add(value / 100)
    latencies.add(-1.0)  # a clock that stepped back counts as zero
    summary = latencies.summary()
    assert summary is not None and summary.count == 201
    assert (summary.p50_s, summary.max_s) == (1.51, 2.0)  # 0, 1.02 ... 2.00 kept
    assert summary.p95_s == 1.96 and summary.p99_s == 2.0


def test_time_spent_adds_up_the_measured_blocks():
    spent = TimeSpent()
    for _ in range(3):
        with spent.measure():
            time.sleep(0.01)
    assert 0.03 <= spent.seconds < 0.5
