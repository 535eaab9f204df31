"""The gateway's job registry and job/unit control through FastAPI's TestClient and the
in-memory NATS server: every endpoint, bad input (422 naming the field), unknown jobs and units
(404), invalid transitions (409), and that a refused call changes nothing; then the ``diloco``
client commands against a served gateway."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi.testclient import TestClient

from services.cli import main
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.orchestration.nats_server import free_port
from shared import kv, subjects
from shared.records.jobs import DesiredRecord
from shared.records.unit import UnitStatus
from tests.helpers import AUTH, GATEWAY_TOKEN, wait_for
from tests.memory_nats import MemoryNats

SPEC = {"job": "j1", "model": "tiny", "units": 3, "h_steps": 10, "codec": "int4", "seed": 7}


def settings_for(nats_url: str) -> GatewaySettings:
    return GatewaySettings(nats_url=nats_url, token=GATEWAY_TOKEN)


@pytest.fixture
def client(memory_nats: MemoryNats) -> Iterator[TestClient]:
    """A gateway app in this process, connected to NATS, sending the token."""
    with TestClient(create_app(settings_for(memory_nats.url)), headers=AUTH) as client:
        wait_for(lambda: client.app.state.link.connected, 30, "the gateway to reach NATS")
        yield client


def desired(client: TestClient, job: str, units: int) -> list[str | None]:
    """The desired state of units 0..units-1 as stored in KV (None: never written)."""

    async def read() -> list[str | None]:
        bucket = client.app.state.link.handles.desired_kv
        found = [
            await kv.get(bucket, subjects.desired_key(job, u), DesiredRecord) for u in range(units)
        ]
        return [record.state if record is not None else None for record in found]

    return client.portal.call(read)


def snapshot(client: TestClient, job: str, units: int = 4) -> tuple:
    """Everything a call could change: the registry, the job view, the desired states."""
    view = client.get(f"/jobs/{job}")
    body = view.json()
    if view.status_code == 200:
        for unit in body["units"]:
            for moving in ("heartbeat_age_s", "last_heartbeat"):
                unit.pop(moving)
    return client.get("/jobs").json(), view.status_code, body, desired(client, job, units)


def assert_refused(client, job, status, method, path, text="", **kwargs):
    """The call answers ``status`` with ``text`` in its message, and changes nothing."""
    before = snapshot(client, job)
    response = client.request(method, path, **kwargs)
    assert response.status_code == status, (method, path, response.text)
    assert text in response.text, (text, response.text)
    assert snapshot(client, job) == before, (method, path)
    return response


@pytest.mark.timeout(120)
def test_job_registry_lifecycle_and_refusals(client):
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
    assert desired(client, "j1", 4) == ["idle", "idle", "idle", None]

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
        assert_refused(client, "j1", 422, "POST", "/jobs", field, json=spec)
    assert_refused(client, "j1", 422, "POST", "/jobs", "", content=b"{not json")
    # The same name again: 409.
    assert_refused(client, "j1", 409, "POST", "/jobs", "exists already", json=SPEC)

    # Invalid transitions from created; unknown jobs; bad names.
    assert_refused(client, "j1", 409, "POST", "/jobs/j1/resume", "cannot resume")
    assert_refused(client, "j1", 409, "POST", "/jobs/j1/pause", "cannot pause")
    for action in ("start", "pause", "resume", "stop"):
        assert_refused(client, "j1", 404, "POST", f"/jobs/nope/{action}", "'nope' not found")
    assert_refused(client, "j1", 404, "DELETE", "/jobs/nope", "not found")
    assert_refused(client, "j1", 404, "GET", "/jobs/nope", "not found")
    assert_refused(client, "j1", 422, "POST", "/jobs/bad!name/start", "job")

    # created -> running -> paused -> running -> stopped, each written to every unit.
    for action, state, unit_state in [
        ("start", "running", "running"),
        ("pause", "paused", "paused"),
        ("resume", "running", "running"),
    ]:
        response = client.post(f"/jobs/j1/{action}")
        assert response.status_code == 200 and response.json()["state"] == state, response.text
        assert desired(client, "j1", 3) == [unit_state] * 3
        assert client.get("/jobs/j1").json()["state"] == state
    assert_refused(client, "j1", 409, "POST", "/jobs/j1/start", "allowed: pause, stop")
    assert_refused(client, "j1", 409, "POST", "/jobs/j1/resume", "cannot resume")
    assert_refused(client, "j1", 409, "DELETE", "/jobs/j1", "stop it before deleting")
    stopped = client.post("/jobs/j1/stop").json()
    assert stopped["state"] == "stopped" and stopped["updated"] >= stopped["created"]
    assert desired(client, "j1", 3) == ["stopped"] * 3
    for action in ("start", "pause", "resume", "stop"):
        assert_refused(client, "j1", 409, "POST", f"/jobs/j1/{action}", "stopped is final")

    deleted = client.delete("/jobs/j1")
    assert deleted.status_code == 200 and deleted.json()["state"] == "stopped"
    assert client.get("/jobs").json() == []
    assert client.get("/jobs/j1").status_code == 404
    # A deleted name can be created again; a created job can be deleted at once.
    assert client.post("/jobs", json=SPEC).status_code == 201
    assert desired(client, "j1", 3) == ["idle"] * 3
    assert client.delete("/jobs/j1").status_code == 200
    assert desired(client, "j1", 3) == ["stopped"] * 3
    # A job stopped while created.
    assert client.post("/jobs", json={**SPEC, "job": "j2", "units": 1}).status_code == 201
    assert client.post("/jobs/j2/stop").json()["state"] == "stopped"


@pytest.mark.timeout(120)
def test_a_jobs_corpus_must_resolve_inside_the_data_root(memory_nats, tmp_path):
    root = tmp_path / "corpora"
    (root / "books").mkdir(parents=True)
    (root / "books" / "a.txt").write_text("text " * 100)
    (root / "escape").symlink_to("/etc")
    refused = {
        "/etc/passwd": "outside the data root",
        "../../../etc": "outside the data root",
        "escape": "outside the data root",  # a symlink out of the root
        "missing.txt": "does not exist",
        "/dev/zero": "outside the data root",
    }
    settings = settings_for(memory_nats.url).model_copy(update={"data_root": root})
    with TestClient(create_app(settings), headers=AUTH) as client:
        wait_for(lambda: client.app.state.link.connected, 30, "the gateway to reach NATS")
        for n, (corpus, reason) in enumerate(refused.items()):
            spec = {**SPEC, "job": f"c{n}", "corpus": corpus}
            assert_refused(client, f"c{n}", 422, "POST", "/jobs", reason, json=spec)
        created = client.post("/jobs", json={**SPEC, "job": "ok", "corpus": "books"})
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["corpus"] == str((root / "books").resolve())
    # Without a data root no job may name a corpus (the built-in one needs none).
    with TestClient(create_app(settings_for(memory_nats.url)), headers=AUTH) as client:
        wait_for(lambda: client.app.state.link.connected, 30, "the gateway to reach NATS")
        spec = {**SPEC, "job": "nr", "corpus": str(root / "books")}
        assert_refused(client, "nr", 422, "POST", "/jobs", "--data-root", json=spec)
        assert client.post("/jobs", json={**SPEC, "job": "builtin"}).status_code == 201


def test_units_transitions_and_scaling(client):
    assert client.post("/jobs", json={**SPEC, "units": 2}).status_code == 201

    started = client.post("/jobs/j1/units/0/start")
    assert started.json() == {"job": "j1", "unit": 0, "desired": "running"}
    assert desired(client, "j1", 2) == ["running", "idle"]
    assert_refused(client, "j1", 409, "POST", "/jobs/j1/units/0/resume", "cannot resume")
    assert_refused(client, "j1", 409, "POST", "/jobs/j1/units/0/start", "cannot start")
    assert_refused(client, "j1", 409, "POST", "/jobs/j1/units/1/pause", "state 'idle'")
    assert_refused(client, "j1", 404, "POST", "/jobs/j1/units/2/start", "has 2 units")
    assert_refused(client, "j1", 404, "POST", "/jobs/nope/units/0/start", "never reported")
    assert_refused(client, "j1", 422, "POST", "/jobs/j1/units/-1/start", "unit")
    assert_refused(client, "j1", 422, "POST", "/jobs/j1/units/x/start", "unit")
    assert_refused(client, "j1", 404, "POST", "/jobs/j1/units/0/restart", "Not Found")
    assert client.post("/jobs/j1/units/0/pause").json()["desired"] == "paused"
    assert client.post("/jobs/j1/units/0/resume").json()["desired"] == "running"
    assert client.post("/jobs/j1/units/1/stop").json()["desired"] == "stopped"
    for action in ("start", "pause", "resume", "stop"):
        assert_refused(client, "j1", 409, "POST", f"/jobs/j1/units/1/{action}", "quarantine")

    # Scale up while created: new units idle.
    scaled = client.put("/jobs/j1/units", json={"units": 4})
    assert scaled.status_code == 200 and scaled.json()["units"] == 4, scaled.text
    assert scaled.json()["spec"]["units"] == 2  # the spec keeps the initial count
    assert desired(client, "j1", 4) == ["running", "stopped", "idle", "idle"]
    assert len(client.get("/jobs/j1").json()["units"]) == 4
    for body in ({"units": 0}, {"units": 65}, {"units": "many"}, {}, {"unit": 3}):
        assert_refused(client, "j1", 422, "PUT", "/jobs/j1/units", "units", json=body)
    assert_refused(client, "j1", 404, "PUT", "/jobs/nope/units", "not found", json={"units": 2})

    # Starting the job runs every unit except the one stopped on its own.
    assert client.post("/jobs/j1/start").json()["state"] == "running"
    assert desired(client, "j1", 4) == ["running", "stopped", "running", "running"]
    # Scale up while running: running; down: the highest indexes are stopped.
    assert client.put("/jobs/j1/units", json={"units": 5}).json()["units"] == 5
    assert desired(client, "j1", 5)[4] == "running"
    # A quarantined unit stays so: no job action changes it (docs/SECURITY.md).
    assert client.post("/jobs/j1/units/2/quarantine").json()["desired"] == "quarantined"
    for action in ("start", "pause", "resume", "stop", "quarantine"):
        assert_refused(client, "j1", 409, "POST", f"/jobs/j1/units/2/{action}", "final")
    assert client.post("/jobs/j1/pause").json()["state"] == "paused"
    assert client.post("/jobs/j1/resume").json()["state"] == "running"
    assert desired(client, "j1", 5)[:3] == ["running", "stopped", "quarantined"]
    assert client.put("/jobs/j1/units", json={"units": 1}).json()["units"] == 1
    assert desired(client, "j1", 5) == ["running", "stopped", "quarantined", "stopped", "stopped"]
    assert_refused(client, "j1", 404, "POST", "/jobs/j1/units/3/resume", "has 1 units")

    assert client.post("/jobs/j1/stop").status_code == 200
    assert_refused(client, "j1", 409, "PUT", "/jobs/j1/units", "stopped", json={"units": 2})
    assert_refused(client, "j1", 409, "POST", "/jobs/j1/units/0/start", "stopped")


@pytest.mark.timeout(120)
def test_unmanaged_job_of_diloco_up_keeps_working(client):
    """A job that only has status records (``diloco up``): shown, its units controllable one
    by one, but no job-level changes."""

    async def heartbeat() -> None:
        bucket = await client.app.state.link.handles.js.key_value(subjects.STATUS_BUCKET)
        record = UnitStatus(unit=0, state="running", step=5, counters={"published": 1})
        await kv.put(bucket, subjects.unit_status_key("up", 0), record)

    client.portal.call(heartbeat)
    view = client.get("/jobs/up").json()
    assert not view["managed"] and view["state"] is None and view["spec"] is None
    assert [(u["unit"], u["state"], u["desired"], u["published"]) for u in view["units"]] == [
        (0, "running", "running", 1)
    ]
    assert client.get("/jobs").json() == []
    for action in ("start", "pause", "resume", "stop"):
        assert_refused(client, "up", 409, "POST", f"/jobs/up/{action}", "not created")
    assert_refused(client, "up", 409, "DELETE", "/jobs/up", "not created")
    assert_refused(client, "up", 409, "PUT", "/jobs/up/units", "not created", json={"units": 2})
    assert_refused(client, "up", 404, "POST", "/jobs/up/units/1/pause", "never reported")
    assert_refused(client, "up", 409, "POST", "/jobs/up/units/0/resume", "cannot resume")
    assert client.post("/jobs/up/units/0/pause").json()["desired"] == "paused"
    assert desired(client, "up", 1) == ["paused"]
    assert client.post("/jobs/up/units/0/resume").json()["desired"] == "running"


@contextmanager
def served(nats_url: str) -> Iterator[str]:
    """A gateway served over HTTP by uvicorn in a thread of this process; yields its URL."""
    port = free_port()
    # log_config=None: uvicorn leaves the process's logging alone (its handlers would keep
    # pytest's capture stream of this test after the test closed it).
    config = uvicorn.Config(
        create_app(settings_for(nats_url)), host="127.0.0.1", port=port, log_config=None
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "uvicorn to serve the gateway")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.timeout(120)
def test_cli_drives_the_gateway(memory_nats, tmp_path, monkeypatch, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text('job = "cli"\nmodel = "tiny"\nunits = 2\n[sync]\nh-steps = 5\ncodec = "int2"\n')

    with served(memory_nats.url) as gateway:

        def diloco(*args: str, token: str = GATEWAY_TOKEN) -> tuple[int, str, str]:
            monkeypatch.setenv("DILOCO_TOKEN", token)
            code = main([*args, "--gateway", gateway])
            out, err = capsys.readouterr()
            return code, out, err

        def ok(*args: str):
            code, out, err = diloco(*args)
            assert code == 0, (args, err)
            return json.loads(out)

        wait_for(lambda: diloco("jobs")[0] == 0, 30, "the gateway to reach NATS")
        created = ok("job", "create", "-f", str(spec))
        assert created["state"] == "created" and created["spec"]["h_steps"] == 5
        assert created["spec"]["codec"] == "int2"
        assert [job["job"] for job in ok("jobs")] == ["cli"]
        assert ok("job", "show", "cli")["unit_count"] == 2
        assert ok("job", "start", "cli")["state"] == "running"
        code, _, err = diloco("job", "start", "cli")
        assert code == 1 and "409" in err and "cannot start" in err
        assert ok("unit", "pause", "cli", "1") == {"job": "cli", "unit": 1, "desired": "paused"}
        assert ok("unit", "resume", "cli", "1")["desired"] == "running"
        code, _, err = diloco("unit", "stop", "cli", "9")
        assert code == 1 and "404" in err and "has 2 units" in err
        assert ok("units", "scale", "cli", "3")["units"] == 3
        assert ok("job", "pause", "cli")["state"] == "paused"
        assert ok("job", "resume", "cli")["state"] == "running"
        # The token from a file instead of the environment; without either, 401.
        token_file = tmp_path / "token"
        token_file.write_text(GATEWAY_TOKEN + "\n")
        code, out, err = diloco("job", "pause", "cli", "--token-file", str(token_file), token="")
        assert code == 0 and json.loads(out)["state"] == "paused", err
        code, _, err = diloco("job", "resume", "cli", token="")
        assert code == 1 and "401" in err
        with pytest.raises(SystemExit):  # no --token flag: ps would show it
            diloco("job", "resume", "cli", "--token", GATEWAY_TOKEN)
        assert "unrecognized arguments: --token" in capsys.readouterr().err
        assert ok("job", "resume", "cli")["state"] == "running"
        code, _, err = diloco("job", "stop", "cli", token="wrong")
        assert code == 1 and "401" in err and "API token" in err
        assert ok("job", "stop", "cli")["state"] == "stopped"
        code, _, err = diloco("unit", "stop", "cli", "0")  # the job is stopped
        assert code == 1 and "409" in err
        assert ok("job", "delete", "cli")["job"] == "cli"
        assert ok("jobs") == []

        spec.write_text('job = "cli"\nunits = 0\ncodec = "int3"\n')
        code, _, err = diloco("job", "create", "-f", str(spec))
        assert code == 1 and "422" in err
        assert "body.units" in err and "body.codec" in err
        code, _, err = diloco("job", "create", "-f", str(tmp_path / "missing.toml"))
        assert code == 2 and "cannot read spec file" in err
        assert ok("jobs") == []
    code, _, err = diloco("jobs")
    assert code == 1 and "cannot reach the gateway" in err


async def test_a_stale_delete_is_a_conflict_and_changes_nothing(memory_nats: MemoryNats) -> None:
    """Two deletes of the same read: the second is refused as a conflict (HTTP 409), not as a
    NATS error (503), and the newer record it did not see stays."""
    from services.gateway.registry import Conflict, Registry
    from shared.records.jobs import JobSpec
    from shared.transport.connection import connect
    from shared.transport.streams import ensure_streams

    nc = await connect(settings_for(memory_nats.url), "test-registry")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        registry = Registry(
            nc,
            await js.key_value(subjects.JOBS_BUCKET),
            await js.key_value(subjects.DESIRED_BUCKET),
        )
        await registry.create_job(JobSpec(**SPEC))
        record, revision = await registry.read_job("j1")
        await registry.replace_job(record, revision)  # someone else changed it meanwhile
        with pytest.raises(Conflict):
            await registry.delete_job("j1", revision)
        assert await registry.read_job("j1") is not None
    finally:
        await nc.close()
