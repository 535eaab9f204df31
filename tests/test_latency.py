"""Durations a process measures on its own clock: latency percentiles, time spent in calls and
sync latency (pure)."""

from __future__ import annotations

import pytest

from shared.latency import Latencies, SyncLatency, TimeSpent


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
    now = [100.0]
    spent = TimeSpent(clock=lambda: now[0])
    for block_s in (0.25, 0.5, 1.0):
        with spent.measure():
            now[0] += block_s
        now[0] += 7.0  # time between blocks does not count
    with pytest.raises(RuntimeError), spent.measure():  # a block that raised counts too
        now[0] += 2.0
        raise RuntimeError
    assert spent.seconds == 3.75


def test_sync_latency_ends_when_a_head_includes_the_round():
    sync = SyncLatency()
    sync.due(0, 10.0)
    sync.due(1, 12.0)
    sync.due(2, 14.0)
    sync.forget(1)  # dropped unsent: never applied
    sync.applied(-1, 15.0)  # a head from before any of this unit's uploads
    assert sync.pending() == 2 and sync.latencies.summary() is None
    sync.applied(0, 15.5)
    assert sync.latencies.values() == [5.5] and sync.pending() == 1
    sync.applied(5, 20.0)  # later rounds in one head
    assert sync.latencies.values() == [5.5, 6.0] and sync.pending() == 0


def test_sync_latency_forgets_the_oldest_beyond_its_bound():
    sync = SyncLatency(max_pending=2)
    for round_ in range(3):
        sync.due(round_, float(round_))
    sync.applied(2, 10.0)
    assert sync.latencies.values() == [9.0, 8.0]
