"""The Prometheus collector of ``GET /metrics``: one snapshot of the status records of several
jobs, and the records this process rejected, as metric families.

A fresh collector is made for every scrape, so nothing global or mutable is kept between
scrapes: the metrics are what the status bucket held when the scrape came in. Ages and the
``lost`` state are judged as everywhere else (``shared.records``, on the NATS server's clock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from services.gateway.views import version_lag
from shared.goodput import job_goodput
from shared.job_status import JobStatus
from shared.records.link import LinkStatus
from shared.records.outer import OuterStatus, outer_liveness
from shared.records.unit import UNIT_STATES, LatencySummary, UnitStatus, unit_liveness
from shared.unit_counters import CounterName

#: States the ``diloco_unit_state`` gauge always reports (1 for the current one).
SHOWN_UNIT_STATES = (*UNIT_STATES, "lost")
#: Outer values reported as one sample a job: (family, metric name, help, value of a record).
OUTER_VALUES: tuple[
    tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, Callable[[OuterStatus], int]],
    ...,
] = (
    (GaugeMetricFamily, "diloco_outer_version", "global model version", lambda o: o.version),
    (
        CounterMetricFamily,
        "diloco_outer_applied",
        "uploads applied by the outer",
        lambda o: o.applied,
    ),
    (CounterMetricFamily, "diloco_outer_merges", "outer merges", lambda o: o.merges),
    (
        CounterMetricFamily,
        "diloco_outer_tokens_applied",
        "tokens of applied uploads",
        lambda o: o.tokens_applied,
    ),
    (
        CounterMetricFamily,
        "diloco_outer_payload_bytes",
        "compressed upload bytes accepted",
        lambda o: o.payload_bytes,
    ),
)
#: Unit values reported as gauges: (metric name, help, value of a status record).
UNIT_GAUGES: tuple[tuple[str, str, Callable[[UnitStatus], float | None]], ...] = (
    ("diloco_unit_step", "inner steps done", lambda s: s.step),
    ("diloco_unit_tokens_per_second", "training throughput", lambda s: s.tokens_per_s),
    ("diloco_unit_tokens", "tokens trained, across restarts", lambda s: s.tokens),
    ("diloco_unit_train_loss", "smoothed train loss", lambda s: s.train_loss),
    (
        "diloco_unit_base_version",
        "global version the params are based on",
        lambda s: s.base_version,
    ),
    (
        "diloco_unit_network_wait_seconds",
        "seconds the training loop spent in calls to the NATS link",
        lambda s: s.network_wait_s,
    ),
)
#: A unit's latencies by kind (label ``kind``), as quantiles of its recent durations.
UNIT_LATENCIES: tuple[tuple[str, Callable[[UnitStatus], LatencySummary | None]], ...] = (
    ("upload", lambda s: s.upload_latency),
    ("sync", lambda s: s.sync_latency),
    ("params", lambda s: s.params_latency),
)
#: Unit process counters reported as Prometheus counters: (counter, metric name, help).
UNIT_COUNTERS: tuple[tuple[CounterName, str, str], ...] = (
    ("bytes_sent", "diloco_unit_bytes_sent", "bytes published to NATS"),
    ("payload_bytes_encoded", "diloco_unit_payload_bytes_encoded", "encoded pseudo-gradient bytes"),
    ("published", "diloco_unit_published", "uploads published"),
)


class StatusCollector(Collector):
    """The metric families of one read of the status records.

    Args:
        snapshot: each job's status records, by job name.
        nats_connected: whether the gateway is connected to NATS.
        timeout_s: heartbeat age past which a writer is lost.
        rejected: records rejected by this process so far, ``{(record, reason): count}``.
    """

    def __init__(
        self,
        snapshot: Mapping[str, JobStatus],
        nats_connected: bool,
        timeout_s: float,
        rejected: Mapping[tuple[str, str], int],
    ) -> None:
        self.snapshot = snapshot
        self.nats_connected = nats_connected
        self.timeout_s = timeout_s
        self.rejected = rejected

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family of the snapshot."""
        yield GaugeMetricFamily(
            "diloco_gateway_nats_connected",
            "1 when the gateway is connected to NATS",
            value=1.0 if self.nats_connected else 0.0,
        )
        records = CounterMetricFamily(
            "diloco_gateway_records_rejected",
            "KV records this gateway read as missing because they did not fit their model",
            labels=["record", "reason"],
        )
        for (record, reason), count in sorted(self.rejected.items()):
            records.add_metric([record, reason], float(count))
        yield records
        yield from self._outer_families()
        yield from self._unit_families()
        yield from self._link_families()

    def _outer_families(self) -> Iterator[Metric]:
        job_label = ["job"]
        up = GaugeMetricFamily(
            "diloco_outer_up", "1 when the outer's heartbeat is fresh", labels=job_label
        )
        age = GaugeMetricFamily(
            "diloco_outer_heartbeat_age_seconds", "age of the outer's heartbeat", labels=job_label
        )
        values = [
            (value_of, family(name, text, labels=job_label))
            for family, name, text, value_of in OUTER_VALUES
        ]
        rejected = CounterMetricFamily(
            "diloco_outer_rejected", "uploads rejected, by reason", labels=["job", "reason"]
        )
        eval_loss = GaugeMetricFamily(
            "diloco_outer_eval_nats_per_byte", "last held-out loss (nats/byte)", labels=job_label
        )
        staleness = HistogramMetricFamily(
            "diloco_outer_staleness",
            "staleness (versions) of applied uploads",
            labels=job_label,
        )
        unit_applied = CounterMetricFamily(
            "diloco_outer_unit_applied",
            "uploads of a unit applied by the outer",
            labels=["job", "unit"],
        )
        unit_rejected = CounterMetricFamily(
            "diloco_outer_unit_rejected",
            "uploads of a unit rejected by the outer, by reason",
            labels=["job", "unit", "reason"],
        )
        unit_clipped = CounterMetricFamily(
            "diloco_outer_unit_clipped",
            "applied uploads of a unit the norm guard scaled down",
            labels=["job", "unit"],
        )
        for job, status in sorted(self.snapshot.items()):
            if status.outer is None:
                continue
            outer = status.outer.record
            running = outer_liveness(status.outer, self.timeout_s) == "running"
            up.add_metric([job], 1.0 if running else 0.0)
            age.add_metric([job], status.outer.age_s)
            for value_of, family in values:
                family.add_metric([job], float(value_of(outer)))
            for reason, count in sorted(outer.rejected.items()):
                rejected.add_metric([job, reason], float(count))
            last = outer.evaluation.last or outer.evaluation.init
            if last is not None:
                eval_loss.add_metric([job], last.nats_per_byte)
            counts = sorted(outer.staleness.items())
            buckets, cumulative = [], 0
            for value, count in counts:
                cumulative += count
                buckets.append((str(float(value)), float(cumulative)))
            buckets.append(("+Inf", float(cumulative)))
            staleness.add_metric([job], buckets, float(sum(k * v for k, v in counts)))
            for unit, ledger in sorted(outer.units.items()):
                unit_applied.add_metric([job, str(unit)], float(ledger.applied))
                unit_clipped.add_metric([job, str(unit)], float(ledger.clipped))
                for reason, count in sorted(ledger.rejected.items()):
                    unit_rejected.add_metric([job, str(unit), reason], float(count))
        yield from (up, age)
        for _, family in values:
            yield family
        yield from (rejected, eval_loss, staleness, unit_applied, unit_rejected, unit_clipped)

    def _unit_families(self) -> Iterator[Metric]:
        labels = ["job", "unit"]
        gauges = [
            (value_of, GaugeMetricFamily(name, text, labels=labels))
            for name, text, value_of in UNIT_GAUGES
        ]
        lag = GaugeMetricFamily(
            "diloco_unit_version_lag", "outer version minus base version", labels=labels
        )
        age = GaugeMetricFamily(
            "diloco_unit_heartbeat_age_seconds", "age of the unit's heartbeat", labels=labels
        )
        state = GaugeMetricFamily(
            "diloco_unit_state", "1 for the unit's current state", labels=["job", "unit", "state"]
        )
        counters = [
            (counter, CounterMetricFamily(name, text, labels=labels))
            for counter, name, text in UNIT_COUNTERS
        ]
        goodput = GaugeMetricFamily(
            "diloco_unit_goodput",
            "tokens of the unit the outer applied / what it could have trained at its healthy "
            "speed since it first trained",
            labels=labels,
        )
        job_goodput_family = GaugeMetricFamily(
            "diloco_job_goodput",
            "tokens the outer applied / what the units could have trained at their healthy "
            "speeds since each first trained",
            labels=["job"],
        )
        latency = GaugeMetricFamily(
            "diloco_unit_latency_seconds",
            "recent latencies on the unit's clock: upload (loop → JetStream), sync (sync point "
            "→ params that include it), params (head → loop)",
            labels=["job", "unit", "kind", "quantile"],
        )
        for job, status in sorted(self.snapshot.items()):
            outer = status.outer_record()
            shares = job_goodput(status)
            if shares is not None and shares.job is not None:
                job_goodput_family.add_metric([job], shares.job)
            for unit, share in sorted(shares.units.items() if shares is not None else ()):
                goodput.add_metric([job, str(unit)], share)
            for unit, entry in sorted(status.units.items()):
                record: UnitStatus = entry.record
                key = [job, str(unit)]
                for value_of, family in gauges:
                    value = value_of(record)
                    if value is not None:
                        family.add_metric(key, float(value))
                lag_value = version_lag(outer, record)
                if lag_value is not None:
                    lag.add_metric(key, float(lag_value))
                age.add_metric(key, entry.age_s)
                current = unit_liveness(entry, self.timeout_s)
                for name in dict.fromkeys((*SHOWN_UNIT_STATES, current)):
                    state.add_metric([*key, name], 1.0 if name == current else 0.0)
                for counter, family in counters:
                    family.add_metric(key, float(record.counter(counter)))
                for kind, summary_of in UNIT_LATENCIES:
                    summary = summary_of(record)
                    if summary is not None:
                        for quantile, value in (
                            ("0.5", summary.p50_s),
                            ("0.95", summary.p95_s),
                            ("0.99", summary.p99_s),
                        ):
                            latency.add_metric([*key, kind, quantile], value)
        for _, family in gauges:
            yield family
        yield from (lag, age, state, latency, goodput, job_goodput_family)
        for _, family in counters:
            yield family

    def _link_families(self) -> Iterator[Metric]:
        labels = ["job", "link", "direction"]
        transferred = CounterMetricFamily(
            "diloco_link_bytes",
            "bytes that crossed a shaped link, measured at the link",
            labels=labels,
        )
        busy = CounterMetricFamily(
            "diloco_link_busy_seconds", "seconds a shaped link's direction was busy", labels=labels
        )
        rate = GaugeMetricFamily(
            "diloco_link_rate_bits_per_second", "a shaped link's cap", labels=["job", "link"]
        )
        outage = GaugeMetricFamily(
            "diloco_link_outage", "1 while the link is in an outage", labels=["job", "link"]
        )
        for job, status in sorted(self.snapshot.items()):
            for name, entry in sorted(status.links.items()):
                record: LinkStatus = entry.record
                for direction, sent, busy_s in (
                    ("up", record.bytes_up, record.busy_up_s),
                    ("down", record.bytes_down, record.busy_down_s),
                ):
                    transferred.add_metric([job, name, direction], float(sent))
                    busy.add_metric([job, name, direction], busy_s)
                if record.spec.rate_bps is not None:
                    rate.add_metric([job, name], record.spec.rate_bps)
                outage.add_metric([job, name], 1.0 if record.outage else 0.0)
        yield from (transferred, busy, rate, outage)
