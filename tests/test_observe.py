"""Observability without processes: views and metrics built from status records, Prometheus
text, the dashboard's files."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.app import create_app
from services.gateway.collector import StatusCollector
from services.gateway.job_metrics import job_metrics
from services.gateway.settings import GatewaySettings
from services.gateway.views import job_view, unit_view, version_lag
from services.orchestration.nats_server import free_port
from shared.job_status import JobStatus
from shared.link_spec import parse_link
from shared.records import Stamped
from shared.records.link import LinkStatus
from shared.records.outer import (
    EvalPoint,
    EvalRecord,
    EvaluationRecord,
    MergedUpload,
    MergePoint,
    OuterStatus,
    UnitLedger,
)
from shared.records.unit import LatencySummary, UnitStatus
from tests.helpers import GATEWAY_TOKEN

SERVER_TIME = 1_800_000_000.0
TIMEOUT_S = 10.0


def stamped(record, age_s: float) -> Stamped:
    return Stamped(record, age_s, SERVER_TIME - age_s, 1)


def outer_record(**overrides) -> OuterStatus:
    record = OuterStatus(
        state="running",
        model="tiny",
        holder="outer-1",
        version=12,
        applied=10,
        merges=9,
        tokens_applied=40960,
        rejected={"too_stale": 2, "bad_payload": 1},
        staleness={0: 4, 1: 5, 3: 1},
        payload_bytes=123456,
        units={
            0: UnitLedger(applied=6, last_round=5, last_staleness=1, tokens=24576),
            1: UnitLedger(
                applied=4,
                last_round=3,
                last_staleness=0,
                tokens=16384,
                rejected={"too_stale": 2},
                clipped=1,
            ),
        },
        evaluation=EvaluationRecord(
            init=EvalRecord(version=0, tokens=0, nats_per_byte=5.5, bits_per_byte=7.9),
            last=EvalRecord(version=10, tokens=36864, nats_per_byte=3.25, bits_per_byte=4.7),
            history=[
                EvalPoint(version=0, tokens=0, nats_per_byte=5.5),
                EvalPoint(version=10, tokens=36864, nats_per_byte=3.25),
            ],
        ),
        merge_history=[
            merge_point(1, 4096, [5.4]),
            merge_point(2, 8192, [5.0, 5.2]),
            merge_point(3, 9000, [None]),  # no loss reported: no train point
        ],
    )
    return record.model_copy(update=overrides)


def merge_point(version: int, tokens: int, losses: list[float | None]) -> MergePoint:
    uploads = [
        MergedUpload(unit=u, round=version, staleness=1, train_loss=loss)
        for u, loss in enumerate(losses)
    ]
    return MergePoint(
        fragment=0,
        version=version,
        tokens=tokens,
        at=1.0,
        uploads=uploads,
        update_norm=0.1,
        momentum_norm=0.2,
    )


def unit_record(unit: int, **overrides) -> UnitStatus:
    record = UnitStatus(
        unit=unit,
        state="running",
        desired="running",
        step=100 + unit,
        round=20,
        base_version=10,
        tokens=4096 * (unit + 1),
        tokens_per_s=1500.5,
        train_loss=3.5,
        unsent=1,
        counters={"published": 7, "bytes_sent": 9000, "payload_bytes_encoded": 8000},
        lifetime={"published": 9},
    )
    return record.model_copy(update=overrides)


SYNC = LatencySummary(count=4, p50_s=1.5, p95_s=2.5, p99_s=3.0, max_s=3.5)


def link_record(name: str, **overrides) -> LinkStatus:
    record = LinkStatus(
        name=name,
        spec=parse_link("20mbit/50ms"),
        bytes_up=30_000,
        bytes_down=50_000,
        busy_up_s=1.5,
        busy_down_s=3.0,
        uptime_s=60.0,
        connects=2,
        outages=1,
    )
    return record.model_copy(update=overrides)


def job_status(
    outer: Stamped | None,
    units: dict[int, Stamped] | None = None,
    links: dict[str, Stamped] | None = None,
) -> JobStatus:
    return JobStatus("j", outer, units or {}, links or {}, server_time=SERVER_TIME)


def test_a_unit_is_lost_after_the_timeout_on_the_server_clock_unless_it_ended():
    outer = outer_record()

    def shown(entry):
        return unit_view("j", 0, entry, None, outer, TIMEOUT_S)

    assert shown(stamped(unit_record(0), 0.5)).state == "running"
    lost = shown(stamped(unit_record(0), TIMEOUT_S + 1))
    assert (lost.state, lost.lost, lost.reported_state) == ("lost", True, "running")
    assert shown(stamped(unit_record(0, state="finished"), 99)).state == "finished"
    absent = shown(None)
    assert (absent.state, absent.reported_state, absent.desired) == ("absent", None, "running")
    assert (absent.applied, absent.last_staleness, absent.outer_version) == (6, 1, 12)
    assert version_lag(outer, unit_record(0)) == 2
    assert version_lag(None, unit_record(0)) is None
    # Params are published before the status that names them: a unit ahead has no lag.
    assert version_lag(outer, unit_record(0, base_version=outer.version + 1)) == 0


def test_the_unit_view_carries_the_heartbeat_stamp_ledger_and_counters():
    entry = stamped(unit_record(1, last_error="boom"), 0.25)
    view = unit_view("j", 1, entry, "paused", outer_record(), TIMEOUT_S)
    assert (view.job, view.unit, view.state, view.desired) == ("j", 1, "running", "paused")
    assert view.last_heartbeat == SERVER_TIME - 0.25 and view.heartbeat_age_s == 0.25
    assert (view.step, view.round, view.tokens, view.unsent) == (101, 20, 8192, 1)
    assert (view.applied, view.last_staleness, view.version_lag) == (4, 0, 2)
    assert (view.rejected, view.clipped) == ({"too_stale": 2}, 1)
    assert (view.published, view.bytes_sent, view.payload_bytes_encoded) == (7, 9000, 8000)
    assert view.fp32_bytes_encoded == 0 and view.last_error == "boom"
    assert view.counters["published"] == 7 and view.lifetime == {"published": 9}
    # Without a desired state written, the unit's own is shown.
    reported = unit_view("j", 1, stamped(unit_record(1, desired="idle"), 0), None, None, 1)
    assert reported.desired == "idle" and reported.version_lag is None
    assert view.link is None


def test_a_units_link_is_shown_per_token_and_by_how_busy_it_was():
    link = stamped(link_record("1"), 0.75)
    view = unit_view("j", 1, stamped(unit_record(1), 0.25), None, outer_record(), TIMEOUT_S, link)
    assert view.link is not None
    assert (view.link.link, view.link.rate_bps, view.link.delay_s) == (
        "20mbit/50ms",
        20e6,
        0.05,
    )
    assert (view.link.bytes_up, view.link.bytes_down) == (30_000, 50_000)
    assert view.link.bytes_per_token == round(80_000 / 8192, 3)
    assert view.link.data_parallel_bytes_per_token is None  # the unit did not say its model
    reporting = unit_record(1, model="tiny", num_units=2, tokens_per_step=1024)
    full = unit_view("j", 1, stamped(reporting, 0), None, None, TIMEOUT_S, link).link
    assert full is not None and full.data_parallel_bytes_per_token == round(8 * 84288 / 1024, 1)
    assert full.times_less_than_data_parallel == round(8 * 84288 / 1024 / (80_000 / 8192), 1)
    assert (view.link.utilisation_up, view.link.utilisation_down) == (0.025, 0.05)
    assert (view.link.outages, view.link.connects, view.link.report_age_s) == (1, 2, 0.75)
    # An unshaped link has no utilisation; a unit that never reported has no tokens.
    free = stamped(link_record("1", spec=parse_link("unlimited")), 0)
    absent = unit_view("j", 1, None, None, None, TIMEOUT_S, free)
    assert absent.link is not None and absent.link.utilisation_up is None
    assert absent.link.bytes_per_token is None


def test_job_metrics_combine_outer_histories_and_unit_heartbeats():
    status = job_status(
        stamped(outer_record(), 1.0),
        {0: stamped(unit_record(0), 0.5), 1: stamped(unit_record(1, state="paused"), 30.0)},
    )
    metrics = job_metrics(status, {1: "paused"}, TIMEOUT_S, now=123.0)
    assert (metrics.version, metrics.merges, metrics.applied, metrics.time) == (12, 9, 10, 123.0)
    assert metrics.outer_state == "running"
    assert metrics.staleness == {0: 4, 1: 5, 3: 1}
    assert (metrics.eval_init_nats_per_byte, metrics.eval_nats_per_byte) == (5.5, 3.25)
    assert [p.nats_per_byte for p in metrics.eval_history] == [5.5, 3.25]
    assert [(p.tokens, p.train_loss) for p in metrics.train_history] == [(4096, 5.4), (8192, 5.1)]
    assert [m.version for m in metrics.merge_history] == [1, 2, 3]
    assert metrics.bytes_sent == 18000 and metrics.payload_bytes == 123456
    first, second = metrics.units
    assert (first.state, first.desired, first.version_lag, first.applied) == (
        "running",
        "running",
        2,
        6,
    )
    assert (second.state, second.desired, second.last_staleness) == ("lost", "paused", 0)
    # Before any outer reported: empty books, no series.
    bare = job_metrics(job_status(None, {0: stamped(unit_record(0), 0)}), {}, TIMEOUT_S, 0.0)
    assert (bare.outer_state, bare.version, bare.applied, bare.eval_history) == (
        "absent",
        None,
        0,
        [],
    )


def test_job_view_lists_every_unit_of_a_managed_job_and_judges_the_outer():
    status = job_status(stamped(outer_record(), TIMEOUT_S + 5), {2: stamped(unit_record(2), 0)})
    view = job_view(status, None, {}, TIMEOUT_S)
    assert (view.outer_state, view.outer_alive, view.version) == ("lost", False, 12)
    assert [u.unit for u in view.units] == [2] and not view.managed
    assert view.rejected == {"too_stale": 2, "bad_payload": 1}
    assert job_view(job_status(None), None, {}, TIMEOUT_S).outer_state == "absent"


def scrape(snapshot: dict, connected: bool = True, rejected: dict | None = None) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot, connected, TIMEOUT_S, rejected or {}))
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_collector_reports_every_job_and_unit():
    samples = scrape(
        {
            "j": job_status(
                stamped(outer_record(), 1.0),
                {
                    0: stamped(unit_record(0), 0.5),
                    1: stamped(
                        unit_record(1, state="paused", sync_latency=SYNC, network_wait_s=0.02),
                        0.5,
                    ),
                },
                {"1": stamped(link_record("1", outage="stall"), 0.5)},
            ),
            "other": JobStatus(
                "other", None, {3: stamped(unit_record(3), 60.0)}, server_time=SERVER_TIME
            ),
        },
        rejected={("UnitStatus", "state: bad"): 3},
    )
    job = (("job", "j"),)
    assert samples[("diloco_gateway_nats_connected", ())] == 1
    rejected = (("reason", "state: bad"), ("record", "UnitStatus"))
    assert samples[("diloco_gateway_records_rejected_total", rejected)] == 3
    assert samples[("diloco_outer_version", job)] == 12
    assert samples[("diloco_outer_up", job)] == 1
    assert samples[("diloco_outer_heartbeat_age_seconds", job)] == 1.0
    assert samples[("diloco_outer_applied_total", job)] == 10
    assert samples[("diloco_outer_merges_total", job)] == 9
    assert samples[("diloco_outer_tokens_applied_total", job)] == 40960
    assert samples[("diloco_outer_rejected_total", (("job", "j"), ("reason", "too_stale")))] == 2
    assert samples[("diloco_outer_eval_nats_per_byte", job)] == 3.25
    assert samples[("diloco_outer_unit_applied_total", (("job", "j"), ("unit", "0")))] == 6
    # Which unit the outer refused or clipped uploads of, and why.
    stale = (("job", "j"), ("reason", "too_stale"), ("unit", "1"))
    assert samples[("diloco_outer_unit_rejected_total", stale)] == 2
    assert samples[("diloco_outer_unit_clipped_total", (("job", "j"), ("unit", "1")))] == 1
    assert samples[("diloco_outer_unit_clipped_total", (("job", "j"), ("unit", "0")))] == 0
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
    assert samples[("diloco_unit_network_wait_seconds", unit1)] == 0.02
    for quantile, value in (("0.5", 1.5), ("0.95", 2.5), ("0.99", 3.0)):
        labels = (("job", "j"), ("kind", "sync"), ("quantile", quantile), ("unit", "1"))
        assert samples[("diloco_unit_latency_seconds", labels)] == value
    upload = (("job", "j"), ("kind", "upload"), ("quantile", "0.5"), ("unit", "1"))
    assert upload not in samples  # no upload latency measured yet
    paused = (("job", "j"), ("state", "paused"), ("unit", "1"))
    running = (("job", "j"), ("state", "running"), ("unit", "1"))
    assert samples[("diloco_unit_state", paused)] == 1
    assert samples[("diloco_unit_state", running)] == 0
    lost = (("job", "other"), ("state", "lost"), ("unit", "3"))
    assert samples[("diloco_unit_state", lost)] == 1
    assert ("diloco_outer_version", (("job", "other"),)) not in samples
    assert ("diloco_unit_version_lag", (("job", "other"), ("unit", "3"))) not in samples
    link_up = (("direction", "up"), ("job", "j"), ("link", "1"))
    link_down = (("direction", "down"), ("job", "j"), ("link", "1"))
    assert samples[("diloco_link_bytes_total", link_up)] == 30_000
    assert samples[("diloco_link_bytes_total", link_down)] == 50_000
    assert samples[("diloco_link_busy_seconds_total", link_down)] == 3.0
    assert samples[("diloco_link_rate_bits_per_second", (("job", "j"), ("link", "1")))] == 20e6
    assert samples[("diloco_link_outage", (("job", "j"), ("link", "1")))] == 1


def test_a_stale_outer_is_not_up():
    samples = scrape({"j": job_status(stamped(outer_record(), TIMEOUT_S + 1))})
    assert samples[("diloco_outer_up", (("job", "j"),))] == 0


def test_prometheus_collector_without_nats_only_says_so():
    assert scrape({}, connected=False) == {("diloco_gateway_nats_connected", ()): 0}


@pytest.fixture
def client_without_nats():
    url = f"nats://127.0.0.1:{free_port()}"
    settings = GatewaySettings(nats_url=url, job="dash", token=GATEWAY_TOKEN)
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
