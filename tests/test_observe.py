"""Observability without processes: metrics built from status records, Prometheus text, pages."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.app import create_app
from services.gateway.observe import StatusCollector, job_metrics, unit_state, version_lag
from services.gateway.settings import GatewaySettings
from shared.broker import free_port

NOW = 1_800_000_000.0


def outer_record() -> dict:
    return {
        "state": "running",
        "time": NOW - 1,
        "version": 12,
        "applied": 10,
        "merges": 9,
        "tokens_applied": 40960,
        "rejected": {"too_stale": 2, "bad_crc": 1},
        "staleness": {"0": 4, "1": 5, "3": 1},
        "payload_bytes": 123456,
        "units": {
            "0": {"applied": 6, "last_round": 5, "last_staleness": 1, "tokens": 24576},
            "1": {"applied": 4, "last_round": 3, "last_staleness": 0, "tokens": 16384},
        },
        "eval_init": {"nats_per_byte": 5.5},
        "eval": {"nats_per_byte": 3.25},
        "eval_history": [[0, 0, 5.5], [10, 36864, 3.25]],
        "train_history": [[4096, 5.4], [8192, 5.1]],
    }


def unit_record(unit: int, **overrides) -> dict:
    record = {
        "unit": unit,
        "state": "running",
        "time": NOW - 0.5,
        "step": 100 + unit,
        "base_version": 10,
        "tokens": 4096 * (unit + 1),
        "tokens_per_s": 1500.5,
        "train_loss": 3.5,
        "counters": {"published": 7, "bytes_sent": 9000, "payload_bytes_encoded": 8000},
    }
    return {**record, **overrides}


def test_unit_state_is_lost_after_the_heartbeat_timeout_unless_it_ended():
    assert unit_state(unit_record(0), NOW, 10) == "running"
    assert unit_state(unit_record(0, time=NOW - 11), NOW, 10) == "lost"
    assert unit_state(unit_record(0, time=NOW - 99, state="finished"), NOW, 10) == "finished"
    assert version_lag(outer_record(), unit_record(0)) == 2
    assert version_lag(None, unit_record(0)) is None


def test_job_metrics_combine_outer_histories_and_unit_heartbeats():
    units = {0: unit_record(0), 1: unit_record(1, state="paused", time=NOW - 30)}
    metrics = job_metrics("j", outer_record(), units, {1: "paused"}, NOW, 10.0)
    assert (metrics.version, metrics.merges, metrics.applied) == (12, 9, 10)
    assert metrics.staleness == {0: 4, 1: 5, 3: 1}
    assert [p.nats_per_byte for p in metrics.eval_history] == [5.5, 3.25]
    assert [(p.tokens, p.train_loss) for p in metrics.train_history] == [(4096, 5.4), (8192, 5.1)]
    assert metrics.bytes_sent == 18000 and metrics.payload_bytes == 123456
    first, second = metrics.units
    assert (first.state, first.desired, first.version_lag, first.applied) == (
        "running",
        "running",
        2,
        6,
    )
    assert (second.state, second.desired, second.last_staleness) == ("lost", "paused", 0)
    # An outer record of an older version (no train_history) still works.
    older = {k: v for k, v in outer_record().items() if k != "train_history"}
    assert job_metrics("j", older, {}, {}, NOW, 10.0).train_history == []


def scrape(snapshot: dict, connected: bool = True) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot, connected, NOW, 10.0))
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_collector_reports_every_job_and_unit():
    samples = scrape(
        {
            "j": (outer_record(), {0: unit_record(0), 1: unit_record(1, state="paused")}),
            "other": (None, {3: unit_record(3, time=NOW - 60)}),
        }
    )
    job = (("job", "j"),)
    assert samples[("diloco_gateway_nats_connected", ())] == 1
    assert samples[("diloco_outer_version", job)] == 12
    assert samples[("diloco_outer_up", job)] == 1
    assert samples[("diloco_outer_applied_total", job)] == 10
    assert samples[("diloco_outer_merges_total", job)] == 9
    assert samples[("diloco_outer_tokens_applied_total", job)] == 40960
    assert samples[("diloco_outer_rejected_total", (("job", "j"), ("reason", "too_stale")))] == 2
    assert samples[("diloco_outer_eval_nats_per_byte", job)] == 3.25
    # The staleness histogram is cumulative over the exact staleness values.
    assert samples[("diloco_outer_staleness_bucket", (("job", "j"), ("le", "1.0")))] == 9
    assert samples[("diloco_outer_staleness_bucket", (("job", "j"), ("le", "+Inf")))] == 10
    assert samples[("diloco_outer_staleness_sum", job)] == 8
    unit1 = (("job", "j"), ("unit", "1"))
    assert samples[("diloco_unit_step", unit1)] == 101
    assert samples[("diloco_unit_tokens_per_second", unit1)] == 1500.5
    assert samples[("diloco_unit_version_lag", unit1)] == 2
    assert samples[("diloco_unit_heartbeat_age_seconds", unit1)] == 0.5
    assert samples[("diloco_unit_bytes_sent_total", unit1)] == 9000
    paused, running = (
        (("job", "j"), ("state", "paused"), ("unit", "1")),
        (
            ("job", "j"),
            ("state", "running"),
            ("unit", "1"),
        ),
    )
    assert samples[("diloco_unit_state", paused)] == 1
    assert samples[("diloco_unit_state", running)] == 0
    lost = (("job", "other"), ("state", "lost"), ("unit", "3"))
    assert samples[("diloco_unit_state", lost)] == 1
    assert ("diloco_outer_version", (("job", "other"),)) not in samples


def test_prometheus_collector_without_nats_only_says_so():
    assert scrape({}, connected=False) == {("diloco_gateway_nats_connected", ()): 0}


@pytest.fixture
def client_without_nats():
    settings = GatewaySettings(nats_url=f"nats://127.0.0.1:{free_port()}", job="dash", token="t")
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.timeout(60)
def test_dashboard_page_and_static_files_are_served(client_without_nats):
    page = client_without_nats.get("/")
    assert page.status_code == 200 and 'content="dash"' in page.text
    assert 'id="loss-chart"' in page.text and 'id="token"' in page.text
    assert 'content="other"' in client_without_nats.get("/?job=other").text
    assert client_without_nats.get("/?job=bad!").status_code == 422
    script = client_without_nats.get("/static/dashboard.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert client_without_nats.get("/static/dashboard.css").status_code == 200
    assert client_without_nats.get("/static/index.html").status_code == 404
    assert client_without_nats.get("/static/..%2Fapp.py").status_code == 404
    # Without NATS: JSON endpoints answer 503, Prometheus still answers.
    assert client_without_nats.get("/jobs/dash/metrics").status_code == 503
    assert client_without_nats.get("/jobs/dash/units/0").status_code == 503
    metrics = client_without_nats.get("/metrics")
    assert metrics.status_code == 200 and "diloco_gateway_nats_connected 0.0" in metrics.text
