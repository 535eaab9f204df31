"""Gateway edges through FastAPI's TestClient and the in-memory NATS server: health and
readiness, the API token, the body limit and security headers, unknown jobs and units, bad
names, and malformed records in KV."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.cli import main
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.orchestration.nats_server import free_port
from shared import records, subjects
from shared.records import Record
from shared.records.jobs import DesiredRecord, JobRecord, JobSpec
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStatus
from tests.helpers import AUTH, GATEWAY_TOKEN, wait_for
from tests.memory_nats import MemoryNats
from tests.strategies import json_values

JOB = "g"


@contextmanager
def gateway(nats_url: str, **options) -> Iterator[TestClient]:
    """A gateway app in this process (``--job g``, the test token), connected to NATS."""
    config = GatewaySettings(nats_url=nats_url, **{"job": JOB, "token": GATEWAY_TOKEN, **options})
    with TestClient(create_app(config)) as client:
        wait_for(lambda: client.app.state.link.connected, 30, "the gateway to reach NATS")
        yield client


@pytest.fixture
def client(memory_nats: MemoryNats) -> Iterator[TestClient]:
    with gateway(memory_nats.url) as client:
        yield client


def put(client: TestClient, bucket: str, key: str, value: Record | bytes) -> None:
    """Store a record (or raw bytes) in a KV bucket, through the gateway's own connection."""
    data = records.encode(value) if isinstance(value, Record) else value

    async def store() -> None:
        handle = await client.app.state.link.handles.js.key_value(bucket)
        await handle.put(key, data)

    client.portal.call(store)


def outer_status(state: str = "running") -> OuterStatus:
    return OuterStatus(state=state, model="tiny", holder="test")


@pytest.mark.timeout(60)
def test_health_and_readiness_without_nats():
    config = GatewaySettings(nats_url=f"nats://127.0.0.1:{free_port()}", token=GATEWAY_TOKEN)
    with TestClient(create_app(config)) as app:
        assert app.get("/healthz").json() == {"status": "ok"}
        response = app.get("/readyz")
        assert response.status_code == 503 and "NATS" in response.json()["detail"]
        assert app.get("/jobs/g").status_code == 503
        assert app.get("/jobs").status_code == 503


@pytest.mark.timeout(60)
def test_readiness_follows_the_outer_heartbeat(memory_nats, client):
    # No outer has ever run for job g: not ready, and the reason says so.
    response = client.get("/readyz")
    assert response.status_code == 503 and "outer of job 'g' not alive" in response.text
    key = subjects.outer_status_key(JOB, 0)
    put(client, subjects.STATUS_BUCKET, key, outer_status("restoring"))
    response = client.get("/readyz")
    assert response.status_code == 503 and "state restoring" in response.text
    put(client, subjects.STATUS_BUCKET, subjects.outer_status_key(JOB, 0), outer_status())
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    # Ready: the heartbeat is no older than the gateway's timeout.
    timeout_s = GatewaySettings.model_fields["heartbeat_timeout_s"].default
    assert ready.json()["job"] == JOB and 0 <= ready.json()["outer_heartbeat_age_s"] <= timeout_s
    # The same heartbeat, judged by a gateway with a shorter timeout once it is older.
    with gateway(memory_nats.url, heartbeat_timeout_s=0.5) as strict:
        put(strict, subjects.STATUS_BUCKET, subjects.outer_status_key(JOB, 0), outer_status())

        def lost() -> bool:
            response = strict.get("/readyz")
            return response.status_code == 503 and "state lost" in response.text

        wait_for(lost, 10, "the heartbeat to be judged lost", interval_s=0.1)


@pytest.mark.timeout(60)
def test_a_gateway_of_no_job_is_ready_when_nats_answers(memory_nats):
    # compose's gateway: no outer to wait for; NATS answering a round trip is enough.
    with gateway(memory_nats.url, job="") as app:
        ready = app.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json() == {"status": "ready", "job": "", "outer_heartbeat_age_s": None}
        assert app.get("/metrics").status_code == 200
        memory_nats.kill()
        response = app.get("/readyz")
        assert response.status_code == 503, response.text


MUTATING_CALLS = [
    ("POST", "/jobs", {"json": {"job": "t2", "units": 1}}),
    ("POST", "/jobs/t1/start", {}),
    ("POST", "/jobs/t1/stop", {}),
    ("POST", "/jobs/t1/units/0/start", {}),
    ("PUT", "/jobs/t1/units", {"json": {"units": 1}}),
    ("DELETE", "/jobs/t1", {}),
]
BAD_HEADERS = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Basic {GATEWAY_TOKEN}"},
    {"Authorization": "Bearer"},
    {"Authorization": f"Bearer {GATEWAY_TOKEN}x"},
]


@pytest.mark.timeout(60)
def test_the_token_guards_every_change(client):
    assert client.post("/jobs", json={"job": "t1", "units": 2}, headers=AUTH).status_code == 201
    before = client.get("/jobs").json(), client.get("/jobs/t1").json()
    for method, path, kwargs in MUTATING_CALLS:
        for headers in BAD_HEADERS:
            response = client.request(method, path, headers=headers, **kwargs)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert "API token" in response.text
            assert response.headers["www-authenticate"] == "Bearer"
    assert (client.get("/jobs").json(), client.get("/jobs/t1").json()) == before
    # Reads stay open.
    assert client.get("/jobs/t1").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    # With the token the same calls work.
    assert client.post("/jobs/t1/start", headers=AUTH).json()["state"] == "running"


@pytest.mark.timeout(60)
def test_an_oversized_body_gets_413_before_it_is_read_and_changes_nothing(memory_nats):
    with gateway(memory_nats.url, max_body_bytes=1024) as small:
        before = small.get("/jobs").json()
        # Not even JSON: it is refused by its length, never parsed (that would be 422).
        oversized = b"x" * 1025
        response = small.post("/jobs", content=oversized, headers=AUTH)
        assert response.status_code == 413 and "at most 1024" in response.json()["detail"]
        # A body that does not say its length is not read either.
        chunked = small.post("/jobs", content=iter([b"{", b"}"]), headers=AUTH)
        assert chunked.status_code == 411
        # Without the token, the answer is 401, whatever the body.
        assert small.post("/jobs", content=oversized).status_code == 401
        assert small.get("/jobs").json() == before
        # Within the limit the same route works.
        job = {"job": "small", "units": 1}
        assert small.post("/jobs", json=job, headers=AUTH).status_code == 201


@pytest.mark.timeout(60)
def test_security_headers_are_on_every_answer(client):
    for response in (
        client.get("/"),
        client.get("/healthz"),
        client.get("/jobs/none"),
        client.post("/jobs", json={}),  # 401
    ):
        csp = response.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, response.url
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["referrer-policy"] == "no-referrer"
    # The interactive API page loads FastAPI's script from its CDN: only framing is ruled.
    assert client.get("/docs").headers["content-security-policy"] == "frame-ancestors 'none'"


def test_a_viewer_token_guards_every_read_of_job_data_and_changes_nothing(memory_nats):
    viewer = "viewer-token-0123456789"
    with gateway(memory_nats.url, viewer_token=viewer) as client:
        read_only = {"Authorization": f"Bearer {viewer}"}
        assert client.post("/jobs", json={"job": "v1", "units": 2}, headers=AUTH).status_code == 201
        for path in ("/jobs", "/jobs/v1", "/jobs/v1/metrics", "/metrics", "/jobs/v1/units/0"):
            for headers in BAD_HEADERS:
                response = client.get(path, headers=headers)
                assert response.status_code == 401, (path, headers, response.text)
                assert "read-only or API token" in response.text
            # Let in (a job without status records has no metrics yet: 404 past the door).
            assert client.get(path, headers=read_only).status_code in (200, 404), path
            assert client.get(path, headers=AUTH).status_code in (200, 404), path
        # Probes, the schema and the dashboard's page hold no job data.
        for path in ("/healthz", "/", "/static/dashboard.js", "/openapi.json", "/docs"):
            assert client.get(path).status_code == 200, path
        # The viewer token reads only.
        response = client.post("/jobs/v1/start", headers=read_only)
        assert response.status_code == 401 and "API token" in response.text
        assert client.get("/jobs/v1", headers=read_only).json()["state"] == "created"
    with pytest.raises(ValueError, match="must differ"):
        GatewaySettings(token=GATEWAY_TOKEN, viewer_token=GATEWAY_TOKEN)
    with pytest.raises(ValueError, match="read-only token has 5 characters"):
        GatewaySettings(token=GATEWAY_TOKEN, viewer_token="short")


@pytest.mark.parametrize("token", ["t", "fifteen-chars!!"])
def test_a_weak_token_is_refused_at_start_outside_local_mode(token, monkeypatch, capsys):
    with pytest.raises(ValueError, match="at least 16"):
        GatewaySettings(token=token)
    assert GatewaySettings(token=token, local=True).token == token
    monkeypatch.setenv("DILOCO_TOKEN", token)
    assert main(["gateway", "--nats-url", "nats://127.0.0.1:1"]) == 2
    assert "at least 16" in capsys.readouterr().err


def test_the_token_comes_from_the_environment_or_a_file_never_a_flag(tmp_path, capsys):
    path = tmp_path / "token"
    path.write_text(GATEWAY_TOKEN + "\n")
    assert GatewaySettings(token_file=path).token == GATEWAY_TOKEN
    with pytest.raises(ValueError, match="not both"):
        GatewaySettings(token=GATEWAY_TOKEN, token_file=path)
    with pytest.raises(ValueError, match="cannot read"):
        GatewaySettings(token_file=tmp_path / "missing")
    with pytest.raises(SystemExit):  # a command line would show it in ps
        main(["gateway", "--token", GATEWAY_TOKEN])
    assert "unrecognized arguments: --token" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_local_gateway_needs_no_token(memory_nats):
    with gateway(memory_nats.url, token="", local=True) as local:
        assert local.post("/jobs", json={"job": "loc", "units": 1}).status_code == 201
        assert local.delete("/jobs/loc").status_code == 200


@pytest.mark.timeout(120)
def test_a_gateway_without_token_refuses_to_start(memory_nats, monkeypatch, capsys):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    monkeypatch.delenv("DILOCO_LOCAL", raising=False)
    assert main(["gateway", "--nats-url", memory_nats.url]) == 2
    assert "needs an API token" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_unknown_jobs_and_units_and_bad_names(client):
    assert "not found" in client.get("/jobs/none").json()["detail"]
    assert client.get("/jobs/none").status_code == 404
    assert client.get("/jobs/none/metrics").status_code == 404
    assert client.get("/jobs/none/units/0").status_code == 404
    assert client.post("/jobs/none/units/0/pause", headers=AUTH).status_code == 404
    bad = client.post("/jobs/bad!name/units/0/pause", headers=AUTH)
    assert bad.status_code == 422 and "job" in bad.text
    assert client.get("/jobs/bad!name").status_code == 422
    assert client.post("/jobs/g/units/-1/resume", headers=AUTH).status_code == 422
    assert client.post("/jobs/g/units/x/resume", headers=AUTH).status_code == 422
    assert client.get("/jobs/g/units/1000001").status_code == 422


# ---- malformed records ----------------------------------------------------------------------

MALFORMED_JOB = "mal"
#: Every kind of key a GET route reads, with the model its value must fit.
KEYS = [
    (subjects.STATUS_BUCKET, subjects.unit_status_key(MALFORMED_JOB, 0), UnitStatus),
    (subjects.STATUS_BUCKET, subjects.outer_status_key(MALFORMED_JOB, 0), OuterStatus),
    (subjects.DESIRED_BUCKET, subjects.desired_key(MALFORMED_JOB, 0), DesiredRecord),
    (subjects.JOBS_BUCKET, subjects.job_key(MALFORMED_JOB), JobRecord),
]
GET_ROUTES = [
    "/jobs",
    f"/jobs/{MALFORMED_JOB}",
    f"/jobs/{MALFORMED_JOB}/metrics",
    f"/jobs/{MALFORMED_JOB}/units/0",
    "/metrics",
    "/readyz",
]
#: Records with the right keys and wrong values.
wrong_fields = st.fixed_dictionaries(
    {"unit": json_values, "state": json_values, "spec": json_values, "model": json_values}
)
malformed = (
    st.binary(min_size=1, max_size=64)
    | json_values.map(lambda v: json.dumps(v).encode())
    | wrong_fields.map(lambda v: json.dumps(v).encode())
)


def fits(model: type[Record], data: bytes) -> bool:
    try:
        model.model_validate_json(data)
    except ValueError:
        return False
    return True


def rejected_total(client: TestClient) -> float:
    text = client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("diloco_gateway_records_rejected_total{")
    )


@pytest.mark.timeout(180)
def test_malformed_records_read_as_missing_and_are_counted(client):
    """Whatever bytes lie under a key a route reads, every GET answers 200, 404 or (readiness)
    503, never 500, and the rejection counter moves when the bytes do not fit the record."""
    spec = JobSpec(job=MALFORMED_JOB, units=1)
    valid = [
        UnitStatus(unit=0),
        outer_status(),
        DesiredRecord(state="running"),
        JobRecord(spec=spec, state="running", units=1, created=0, updated=0),
    ]

    @settings(
        max_examples=6,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=malformed)
    @example(data=b"\xff\xfe")
    @example(data=b"null")
    @example(data=b'{"unit": 0, "state": "flying"}')
    @example(data=b'{"unit": 0, "train_loss": NaN}')
    @example(data=b'{"unit": 0, "counters": {"published": -1}}')
    @example(data=b'{"unit": 3}')
    @example(data=b'{"spec": {"job": "other"}, "state": "created", "units": 1}')
    def check(data: bytes) -> None:
        for bucket, key, model in KEYS:
            for (other_bucket, other_key, _), record in zip(KEYS, valid, strict=True):
                put(client, other_bucket, other_key, record)
            put(client, bucket, key, data)
            before = records.rejections.total()
            for path in GET_ROUTES:
                response = client.get(path)
                allowed = {200, 404, 503} if path == "/readyz" else {200, 404}
                assert response.status_code in allowed, (key, data, path, response.text)
            pause = client.post(f"/jobs/{MALFORMED_JOB}/units/0/pause", headers=AUTH)
            assert pause.status_code < 500, (key, data, pause.text)
            if not fits(model, data):
                assert records.rejections.total() > before, (key, data)

    check()
    assert rejected_total(client) == records.rejections.total() > 0
    # A job created over a malformed record replaces it.
    put(client, subjects.JOBS_BUCKET, MALFORMED_JOB, b"{}")
    created = client.post("/jobs", json={"job": MALFORMED_JOB, "units": 1}, headers=AUTH)
    assert created.status_code == 201, created.text
