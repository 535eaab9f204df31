"""The gateway's job registry and job/unit control over a real gateway and nats-server:
every endpoint, the API token, bad input (422 naming the field), unknown jobs and units (404),
invalid transitions (409) — and that a refused call changes nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from shared import subjects, transport
from shared.broker import free_port
from shared.settings import NatsSettings
from tests.conftest import AUTH, GATEWAY_TOKEN, REPO, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

SPEC = {"job": "j1", "model": "tiny", "units": 3, "h_steps": 10, "codec": "int4", "seed": 7}


def start_gateway(services, nats_url: str, *flags: str) -> tuple[httpx.Client, str]:
    """A gateway with ``flags`` (default: the test token); (client without auth, base URL)."""
    port = free_port()
    flags = flags or ("--token", GATEWAY_TOKEN)
    services.start("gateway", "gateway", "--nats-url", nats_url, "--port", str(port), *flags)
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, timeout=10)

    def ready():
        try:
            return client.get("/jobs").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(ready, 60, "the gateway to answer GET /jobs")
    return client, url


def kv(nats_url: str, action):
    """Run ``action(js)`` against the server's JetStream (the streams/buckets ensured)."""

    async def run():
        nc = await transport.connect(NatsSettings(nats_url=nats_url), "test-kv")
        try:
            js = nc.jetstream()
            await transport.ensure_streams(js)
            return await action(js)
        finally:
            await nc.close()

    return asyncio.run(run())


def desired(nats_url: str, job: str, units: int) -> list[str | None]:
    """The desired state of units 0..units-1 as stored in KV (None: never written)."""

    async def read(js):
        bucket = await js.key_value(subjects.DESIRED_BUCKET)
        states = []
        for unit in range(units):
            record = await transport.get_json(bucket, subjects.desired_key(job, unit))
            states.append(record and record["state"])
        return states

    return kv(nats_url, read)


def snapshot(client: httpx.Client, nats_url: str, job: str, units: int = 4) -> tuple:
    """Everything a call could change: the registry, the job view, the desired states."""
    view = client.get(f"/jobs/{job}")
    body = view.json()
    if view.status_code == 200:
        for unit in body["units"]:
            unit.pop("heartbeat_age_s", None)
    return client.get("/jobs").json(), view.status_code, body, desired(nats_url, job, units)


def assert_refused(client, nats_url, job, status, method, path, text="", **kwargs):
    """The call answers ``status`` with ``text`` in its message, and changes nothing."""
    before = snapshot(client, nats_url, job)
    response = client.request(method, path, **kwargs)
    assert response.status_code == status, (method, path, response.text)
    assert text in response.text, (text, response.text)
    assert snapshot(client, nats_url, job) == before, (method, path)
    return response


@pytest.mark.timeout(120)
def test_the_token_guards_every_change_and_is_required_at_start(nats_server, services):
    # No token and no --local: the gateway refuses to start, saying why.
    refused = subprocess.run(
        [sys.executable, "-m", "services.cli", "gateway", "--nats-url", nats_server.url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert refused.returncode != 0 and "needs an API token" in refused.stderr, refused.stderr

    client, _ = start_gateway(services, nats_server.url)
    url = nats_server.url
    assert client.post("/jobs", json=SPEC, headers=AUTH).status_code == 201
    calls = [
        ("POST", "/jobs", {"json": {**SPEC, "job": "j2"}}),
        ("POST", "/jobs/j1/start", {}),
        ("POST", "/jobs/j1/stop", {}),
        ("POST", "/jobs/j1/units/0/start", {}),
        ("PUT", "/jobs/j1/units", {"json": {"units": 1}}),
        ("DELETE", "/jobs/j1", {}),
    ]
    bad_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {GATEWAY_TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {GATEWAY_TOKEN}x"},
    ]
    for method, path, kwargs in calls:
        for headers in bad_headers:
            response = assert_refused(
                client, url, "j1", 401, method, path, "API token", headers=headers, **kwargs
            )
            assert response.headers["www-authenticate"] == "Bearer"
    # Reads stay open.
    assert client.get("/jobs").status_code == 200 and client.get("/jobs/j1").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    # With the token the same calls work.
    assert client.post("/jobs/j1/start", headers=AUTH).json()["state"] == "running"


@pytest.mark.timeout(120)
def test_a_local_gateway_needs_no_token(nats_server, services):
    client, _ = start_gateway(services, nats_server.url, "--local")
    assert client.post("/jobs", json=SPEC).status_code == 201
    assert client.delete("/jobs/j1").status_code == 200


@pytest.mark.timeout(180)
def test_job_registry_lifecycle_and_refusals(nats_server, services):
    client, _ = start_gateway(services, nats_server.url)
    client.headers.update(AUTH)
    url = nats_server.url
    assert client.get("/jobs").json() == []

    created = client.post("/jobs", json=SPEC)
    assert created.status_code == 201, created.text
    record = created.json()
    assert record["state"] == "created" and record["units"] == 3 and record["job"] == "j1"
    assert record["spec"]["codec"] == "int4" and record["spec"]["max_steps"] == 300
    assert record["spec"]["outer_optimizer"] == "delayed_nesterov"  # defaults are filled in
    assert client.get("/jobs").json() == [record]
    view = client.get("/jobs/j1").json()
    assert view["managed"] and view["state"] == "created" and view["unit_count"] == 3
    assert view["spec"] == record["spec"] and view["outer_state"] == "absent"
    assert [(u["unit"], u["state"], u["desired"]) for u in view["units"]] == [
        (0, "absent", "idle"),
        (1, "absent", "idle"),
        (2, "absent", "idle"),
    ]
    assert desired(url, "j1", 4) == ["idle", "idle", "idle", None]

    # Bad specs: 422 naming the field, nothing stored.
    bad_specs = [
        ({**SPEC, "units": 0}, "units"),
        ({**SPEC, "units": 65}, "units"),
        ({**SPEC, "codec": "int3"}, "codec"),
        ({**SPEC, "model": "huge"}, "model"),
        ({**SPEC, "h_steps": 0}, "h_steps"),
        ({**SPEC, "outer_lr": -1}, "outer_lr"),
        ({**SPEC, "outer_momentum": 1.5}, "outer_momentum"),
        ({**SPEC, "merge_policy": "all"}, "merge_policy"),
        ({**SPEC, "staleness_rule": "linear"}, "staleness_rule"),
        ({**SPEC, "max_staleness": -1}, "max_staleness"),
        ({**SPEC, "seed": -1}, "seed"),
        ({**SPEC, "job": "bad name"}, "job"),
        ({**SPEC, "jobb": "x"}, "jobb"),
        ({**SPEC, "min_quorum": 4}, "min_quorum"),
        ({**SPEC, "max_steps": 10, "token_budget": 1000}, "token_budget"),
        ({k: v for k, v in SPEC.items() if k != "job"}, "job"),
    ]
    for spec, field in bad_specs:
        assert_refused(client, url, "j1", 422, "POST", "/jobs", field, json=spec)
    assert_refused(client, url, "j1", 422, "POST", "/jobs", "", content=b"{not json")
    # The same name again: 409.
    assert_refused(client, url, "j1", 409, "POST", "/jobs", "exists already", json=SPEC)

    # Invalid transitions from created; unknown jobs; bad names.
    assert_refused(client, url, "j1", 409, "POST", "/jobs/j1/resume", "cannot resume")
    assert_refused(client, url, "j1", 409, "POST", "/jobs/j1/pause", "cannot pause")
    for action in ("start", "pause", "resume", "stop"):
        assert_refused(client, url, "j1", 404, "POST", f"/jobs/nope/{action}", "'nope' not found")
    assert_refused(client, url, "j1", 404, "DELETE", "/jobs/nope", "not found")
    assert_refused(client, url, "j1", 404, "GET", "/jobs/nope", "not found")
    assert_refused(client, url, "j1", 422, "POST", "/jobs/bad!name/start", "job")

    # created -> running -> paused -> running -> stopped, each written to every unit.
    for action, state, unit_state in [
        ("start", "running", "running"),
        ("pause", "paused", "paused"),
        ("resume", "running", "running"),
    ]:
        response = client.post(f"/jobs/j1/{action}")
        assert response.status_code == 200 and response.json()["state"] == state, response.text
        assert desired(url, "j1", 3) == [unit_state] * 3
        assert client.get("/jobs/j1").json()["state"] == state
    assert_refused(client, url, "j1", 409, "POST", "/jobs/j1/start", "allowed: pause, stop")
    assert_refused(client, url, "j1", 409, "POST", "/jobs/j1/resume", "cannot resume")
    assert_refused(client, url, "j1", 409, "DELETE", "/jobs/j1", "stop it before deleting")
    stopped = client.post("/jobs/j1/stop").json()
    assert stopped["state"] == "stopped" and stopped["updated"] >= stopped["created"]
    assert desired(url, "j1", 3) == ["stopped"] * 3
    for action in ("start", "pause", "resume", "stop"):
        assert_refused(client, url, "j1", 409, "POST", f"/jobs/j1/{action}", "stopped is final")

    deleted = client.delete("/jobs/j1")
    assert deleted.status_code == 200 and deleted.json()["state"] == "stopped"
    assert client.get("/jobs").json() == []
    assert client.get("/jobs/j1").status_code == 404
    # A deleted name can be created again; a created job can be deleted at once.
    assert client.post("/jobs", json=SPEC).status_code == 201
    assert desired(url, "j1", 3) == ["idle"] * 3
    assert client.delete("/jobs/j1").status_code == 200
    assert desired(url, "j1", 3) == ["stopped"] * 3
    # A job stopped while created.
    assert client.post("/jobs", json={**SPEC, "job": "j2", "units": 1}).status_code == 201
    assert client.post("/jobs/j2/stop").json()["state"] == "stopped"


@pytest.mark.timeout(180)
def test_units_transitions_and_scaling(nats_server, services):
    client, _ = start_gateway(services, nats_server.url)
    client.headers.update(AUTH)
    url = nats_server.url
    assert client.post("/jobs", json={**SPEC, "units": 2}).status_code == 201

    started = client.post("/jobs/j1/units/0/start")
    assert started.json() == {"job": "j1", "unit": 0, "desired": "running"}
    assert desired(url, "j1", 2) == ["running", "idle"]
    assert_refused(client, url, "j1", 409, "POST", "/jobs/j1/units/0/resume", "cannot resume")
    assert_refused(client, url, "j1", 409, "POST", "/jobs/j1/units/0/start", "cannot start")
    assert_refused(client, url, "j1", 409, "POST", "/jobs/j1/units/1/pause", "state 'idle'")
    assert_refused(client, url, "j1", 404, "POST", "/jobs/j1/units/2/start", "has 2 units")
    assert_refused(client, url, "j1", 404, "POST", "/jobs/nope/units/0/start", "never reported")
    assert_refused(client, url, "j1", 422, "POST", "/jobs/j1/units/-1/start", "unit")
    assert_refused(client, url, "j1", 422, "POST", "/jobs/j1/units/x/start", "unit")
    assert_refused(client, url, "j1", 404, "POST", "/jobs/j1/units/0/restart", "Not Found")
    assert client.post("/jobs/j1/units/0/pause").json()["desired"] == "paused"
    assert client.post("/jobs/j1/units/0/resume").json()["desired"] == "running"
    assert client.post("/jobs/j1/units/1/stop").json()["desired"] == "stopped"
    for action in ("start", "pause", "resume", "stop"):
        assert_refused(
            client, url, "j1", 409, "POST", f"/jobs/j1/units/1/{action}", "stopped is final"
        )

    # Scale up while created: new units idle.
    scaled = client.put("/jobs/j1/units", json={"units": 4})
    assert scaled.status_code == 200 and scaled.json()["units"] == 4, scaled.text
    assert scaled.json()["spec"]["units"] == 2  # the spec keeps the initial count
    assert desired(url, "j1", 4) == ["running", "stopped", "idle", "idle"]
    assert len(client.get("/jobs/j1").json()["units"]) == 4
    for body in ({"units": 0}, {"units": 65}, {"units": "many"}, {}, {"unit": 3}):
        assert_refused(client, url, "j1", 422, "PUT", "/jobs/j1/units", "units", json=body)
    assert_refused(
        client, url, "j1", 404, "PUT", "/jobs/nope/units", "not found", json={"units": 2}
    )

    # Starting the job runs every unit except the one stopped on its own.
    assert client.post("/jobs/j1/start").json()["state"] == "running"
    assert desired(url, "j1", 4) == ["running", "stopped", "running", "running"]
    # Scale up while running: running; down: the highest indexes are stopped.
    assert client.put("/jobs/j1/units", json={"units": 5}).json()["units"] == 5
    assert desired(url, "j1", 5)[4] == "running"
    assert client.put("/jobs/j1/units", json={"units": 1}).json()["units"] == 1
    assert desired(url, "j1", 5) == ["running", "stopped", "stopped", "stopped", "stopped"]
    assert_refused(client, url, "j1", 404, "POST", "/jobs/j1/units/3/resume", "has 1 units")

    assert client.post("/jobs/j1/stop").status_code == 200
    assert_refused(client, url, "j1", 409, "PUT", "/jobs/j1/units", "stopped", json={"units": 2})
    assert_refused(client, url, "j1", 409, "POST", "/jobs/j1/units/0/start", "stopped")


@pytest.mark.timeout(120)
def test_unmanaged_job_of_diloco_up_keeps_working(nats_server, services):
    """A job that only has status records (``diloco up``): shown, its units controllable one
    by one, but no job-level changes."""
    client, _ = start_gateway(services, nats_server.url)
    client.headers.update(AUTH)
    url = nats_server.url

    async def heartbeat(js):
        bucket = await js.key_value(subjects.STATUS_BUCKET)
        record = {"state": "running", "step": 5, "counters": {"published": 1}}
        await transport.put_status(bucket, subjects.unit_status_key("up", 0), record)

    kv(url, heartbeat)
    view = client.get("/jobs/up").json()
    assert not view["managed"] and view["state"] is None and view["spec"] is None
    assert [(u["unit"], u["state"], u["desired"]) for u in view["units"]] == [
        (0, "running", "running")
    ]
    assert client.get("/jobs").json() == []
    for action in ("start", "pause", "resume", "stop"):
        assert_refused(client, url, "up", 409, "POST", f"/jobs/up/{action}", "not created")
    assert_refused(client, url, "up", 409, "DELETE", "/jobs/up", "not created")
    assert_refused(
        client, url, "up", 409, "PUT", "/jobs/up/units", "not created", json={"units": 2}
    )
    assert_refused(client, url, "up", 404, "POST", "/jobs/up/units/1/pause", "never reported")
    assert_refused(client, url, "up", 409, "POST", "/jobs/up/units/0/resume", "cannot resume")
    assert client.post("/jobs/up/units/0/pause").json()["desired"] == "paused"
    assert desired(url, "up", 1) == ["paused"]
    assert client.post("/jobs/up/units/0/resume").json()["desired"] == "running"


@pytest.mark.timeout(180)
def test_cli_drives_the_gateway(nats_server, services, tmp_path):
    _, gateway = start_gateway(services, nats_server.url)
    spec = tmp_path / "spec.toml"
    spec.write_text('job = "cli"\nmodel = "tiny"\nunits = 2\n[sync]\nh-steps = 5\ncodec = "int2"\n')

    def diloco(*args: str, token: str = GATEWAY_TOKEN) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli", *args, "--gateway", gateway],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "DILOCO_TOKEN": token},
        )

    def ok(*args: str):
        result = diloco(*args)
        assert result.returncode == 0, (args, result.stderr)
        return json.loads(result.stdout)

    created = ok("job", "create", "-f", str(spec))
    assert created["state"] == "created" and created["spec"]["h_steps"] == 5
    assert created["spec"]["codec"] == "int2"
    assert [job["job"] for job in ok("jobs")] == ["cli"]
    assert ok("job", "show", "cli")["unit_count"] == 2
    assert ok("job", "start", "cli")["state"] == "running"
    again = diloco("job", "start", "cli")
    assert again.returncode == 1 and "409" in again.stderr and "cannot start" in again.stderr
    assert ok("unit", "pause", "cli", "1") == {"job": "cli", "unit": 1, "desired": "paused"}
    assert ok("unit", "resume", "cli", "1")["desired"] == "running"
    missing = diloco("unit", "stop", "cli", "9")
    assert missing.returncode == 1 and "404" in missing.stderr and "has 2 units" in missing.stderr
    assert ok("units", "scale", "cli", "3")["units"] == 3
    assert ok("job", "pause", "cli")["state"] == "paused"
    assert ok("job", "resume", "cli")["state"] == "running"
    denied = diloco("job", "stop", "cli", token="wrong")
    assert denied.returncode == 1 and "401" in denied.stderr and "API token" in denied.stderr
    assert ok("job", "stop", "cli")["state"] == "stopped"
    stopped_unit = diloco("unit", "stop", "cli", "0")  # the job is stopped
    assert stopped_unit.returncode == 1 and "409" in stopped_unit.stderr
    assert ok("job", "delete", "cli")["job"] == "cli"
    assert ok("jobs") == []

    spec.write_text('job = "cli"\nunits = 0\ncodec = "int3"\n')
    invalid = diloco("job", "create", "-f", str(spec))
    assert invalid.returncode == 1 and "422" in invalid.stderr
    assert "body.units" in invalid.stderr and "body.codec" in invalid.stderr
    unreadable = diloco("job", "create", "-f", str(tmp_path / "missing.toml"))
    assert unreadable.returncode == 2 and "cannot read spec file" in unreadable.stderr
    assert ok("jobs") == []


@pytest.mark.timeout(60)
def test_token_file_is_private(tmp_path):
    from services.cluster import write_token

    path = write_token(tmp_path / "d", "abc")
    assert path.read_text() == "abc\n" and (path.stat().st_mode & 0o777) == 0o600
    path.chmod(0o644)
    write_token(tmp_path / "d", "def")
    assert path.read_text() == "def\n" and (path.stat().st_mode & 0o777) == 0o600
