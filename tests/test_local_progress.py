"""What ``diloco up`` shows the user (``services.orchestration.local.progress``): the live progress
line, the training throughput and the summary, from typed status records. No NATS, no processes."""

from __future__ import annotations

from services.orchestration.local.progress import (
    Throughput,
    progress_line,
    staleness_summary,
    summary_lines,
)
from services.orchestration.local.records import RunSummary
from shared.goodput import Goodput
from shared.ledger import balance
from shared.link_spec import parse_link
from shared.records.link import LinkStatus
from shared.records.outer import EvalRecord, EvaluationRecord, MergePoint, OuterStatus
from shared.records.unit import LatencySummary, UnitStatus

OUTER = OuterStatus(
    state="running",
    model="tiny",
    holder="h",
    version=26,
    applied=25,
    merges=24,
    rejected={"stale": 2},
    staleness={0: 5, 1: 7, 2: 1, 3: 1, 4: 1, 5: 1, 7: 1, 9: 2},
    tokens_applied=123456,
    applied_rounds={0: [(0, 11)], 1: [(0, 12)]},
    rejected_rounds={1: [(13, 14)]},
    evaluation=EvaluationRecord(
        init=EvalRecord(version=0, tokens=0, nats_per_byte=5.54521, bits_per_byte=8.0),
        last=EvalRecord(version=26, tokens=1000, nats_per_byte=4.60781, bits_per_byte=6.64771),
    ),
    merge_history=[
        MergePoint(
            fragment=0,
            version=v,
            tokens=1000 * v,
            at=float(v),
            uploads=[],
            update_norm=u,
            momentum_norm=m,
        )
        for v, u, m in ((25, 0.5, 2.25), (26, 0.25, 1.5))
    ],
)
UNITS = {
    0: UnitStatus(
        unit=0,
        state="finished",
        step=120,
        train_loss=4.5,
        tokens_per_s=1234.4,
        tokens=5000,
        counters={"published": 12},
        published_rounds=[(0, 11)],
    ),
    1: UnitStatus(unit=1, state="running", step=99, published_rounds=[(0, 14)], staggered=True),
}


def test_progress_line_shows_version_eval_and_each_unit():
    assert progress_line(12.34, OUTER, UNITS) == (
        "[  12.3s] v26 | eval 4.608 nats/B"
        " | u0 fini 120 loss 4.50 1234 tok/s | u1 runn 99 loss - 0 tok/s"
    )
    assert progress_line(0.0, None, {}) == "[   0.0s] v- | eval - nats/B"


def test_summary_lines_of_a_finished_run():
    summary = RunSummary(
        reason="finished",
        elapsed_s=100.2,
        outer=OUTER,
        units=UNITS,
        tokens_per_s=1234.5,
        restarts={"outer": 0, "gateway": 1},
        ledger=balance(OUTER, UNITS),
    )
    assert summary_lines(summary) == [
        "run finished after 100s",
        "global version      26  (25 pseudo-gradients applied, rejected {'stale': 2})",
        "outer merges        24  (staleness of applied updates: median 1, p90 9, max 9)",
        "tokens applied      123,456",
        "outer step norms    update max 0.5 (last 0.25), momentum max 2.25 (last 1.5) over the "
        "last 2 merges",
        "training throughput 1,234 tokens/s (all units)",
        "held-out eval loss  5.5452 -> 4.6078 nats/byte (6.6477 bits/byte) at version 26",
        "ledger              balanced: 27 rounds published, 25 applied once, 2 rejected",
        "restarts            outer 0, gateway 1",
        "unit 0: finished at step 120, 12 uploads, train loss 4.5",
        "unit 1: running at step 99, 0 uploads, fragments staggered, train loss None",
    ]


def test_summary_lines_without_an_outer_and_with_unbalanced_books():
    units = {0: UnitStatus(unit=0, published_rounds=[(0, 2)])}
    summary = RunSummary(
        reason="time limit 60s reached", elapsed_s=61, units=units, ledger=balance(None, units)
    )
    lines = summary_lines(summary)
    assert lines[:6] == [
        "run time limit 60s reached after 61s",
        "global version      -  (0 pseudo-gradients applied, rejected {})",
        "outer merges        0  (staleness of applied updates: {})",
        "tokens applied      0",
        "training throughput - tokens/s (all units)",
        "held-out eval loss  - -> - nats/byte (- bits/byte) at version None",
    ]
    assert lines[6].startswith(
        "ledger              NOT balanced: 3 rounds published, 0 applied once, 0 rejected; "
        "unit 0: 3 published round(s) neither applied nor rejected"
    )
    assert lines[7:] == ["unit 0: starting at step 0, 0 uploads, train loss None"]


def test_staleness_summary_shows_a_small_histogram_whole():
    assert staleness_summary({1: 3, 0: 2}) == "{'0': 2, '1': 3}"
    assert staleness_summary({v: 1 for v in range(10)}) == "median 4, p90 8, max 9"


def test_throughput_counts_from_the_first_step_seen_to_the_last_token():
    meter = Throughput()
    meter.observe({0: UnitStatus(unit=0)}, now=5.0)  # still compiling: no tokens yet
    assert meter.tokens_per_s() is None
    meter.observe({0: UnitStatus(unit=0, tokens=100)}, now=10.0)
    assert meter.tokens_per_s() is None  # one observation is no rate
    units = {0: UnitStatus(unit=0, tokens=300), 1: UnitStatus(unit=1, tokens=200)}
    meter.observe(units, now=14.0)
    meter.observe(units, now=99.0)  # nothing new (stopping): the rate is not diluted
    assert meter.tokens_per_s() == 100.0


def test_summary_lines_show_what_crossed_each_link():
    spec = parse_link("1mbit/100ms")
    units = {
        0: UNITS[0].model_copy(
            update={
                "model": "tiny",
                "num_units": 2,
                "tokens_per_step": 1024,
                "upload_latency": LatencySummary(
                    count=12, p50_s=0.25, p95_s=1.5, p99_s=2.0, max_s=2.5
                ),
                "sync_latency": LatencySummary(
                    count=12, p50_s=1.25, p95_s=3.0, p99_s=4.0, max_s=4.5
                ),
                "network_wait_s": 0.0012,
            }
        ),
        1: UNITS[1].model_copy(update={"sync_wait_s": 12.34}),
    }
    links = {
        "0": LinkStatus(
            name="0",
            spec=spec,
            bytes_up=40_000,
            bytes_down=60_000,
            busy_up_s=3,
            busy_down_s=6,
            uptime_s=60,
            outages=1,
        ),
        "1": LinkStatus(name="1", spec=parse_link("unlimited"), bytes_up=5, bytes_down=7),
        "outer": LinkStatus(name="outer", spec=spec, bytes_up=2_500_000, uptime_s=10),
    }
    summary = RunSummary(
        reason="finished",
        elapsed_s=1,
        units=units,
        links=links,
        ledger=balance(None, units),
        goodput=Goodput(job=0.875, units={0: 0.95, 1: 0.8}, job_up=0.9, up={0: 1.0, 1: 0.8}),
    )
    lines = summary_lines(summary)
    assert "goodput             0.88  (up 0.90; unit 0 0.95, unit 1 0.80)" in lines
    per_token, data_parallel = 100_000 / 5000, 8 * 84288 / 1024
    assert lines[-6:] == [
        "  upload p50 0.25 s, p95 1.50 s; sync p50 1.25 s, p95 3.00 s; params -;"
        " training loop in network calls 0.001 s",
        "  link 1mbit/100ms: 0.04 MB up, 0.06 MB down,"
        f" {per_token:.1f} B/token ({data_parallel / per_token:.0f}x less than data-parallel),"
        " busy 5.0% up, 10.0% down, 1 outage(s)",
        "unit 1: running at step 99, 0 uploads, fragments staggered, train loss None",
        "  upload -; sync -; params -; training loop in network calls 0.000 s,"
        " waiting at sync points 12.3 s",
        "  link unlimited/0ms: 0.00 MB up, 0.00 MB down",
        "outer link 1mbit/100ms: 2.50 MB up, 0.00 MB down, busy 0.0% up, 0.0% down",
    ]
