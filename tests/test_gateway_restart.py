"""Killing and restarting the gateway mid-run changes nothing about the job or its units: the
registry and desired states live in JetStream KV, and units never talk to the gateway."""

from __future__ import annotations

import signal

import httpx
import pytest

from services.orchestration.nats_server import free_port
from tests.helpers import AUTH, read_status, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

JOB = "gwrestart"


def _view(client: httpx.Client) -> dict | None:
    try:
        response = client.get(f"/jobs/{JOB}")
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def _stable(view: dict) -> dict:
    """The parts of the job view a gateway restart must not change."""
    units = [{k: u[k] for k in ("unit", "desired", "state")} for u in view["units"]]
    return {k: view[k] for k in ("job", "managed", "state", "unit_count", "spec")} | {
        "units": units
    }


@pytest.mark.timeout(400)
def test_gateway_kill_and_restart_changes_nothing(nats_server, services):
    port = free_port()
    gateway_args = ["gateway", "--nats-url", nats_server.url, "--port", str(port)]
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=AUTH)
    gateway = services.start("gateway", *gateway_args)
    spec = {"job": JOB, "model": "tiny", "units": 2, "h_steps": 5, "seed": 3}

    def created() -> bool:
        try:
            return client.post("/jobs", json=spec).status_code == 201
        except httpx.TransportError:
            return False

    wait_for(created, 60, "the gateway to create the job")
    job_flags = ["--nats-url", nats_server.url, "--job", JOB, "--model", "tiny", "--seed", "3"]
    services.start("outer", "outer", *job_flags, "--num-units", "2", "--lease-s", "1")
    for unit in range(2):
        services.start(
            f"learner-{unit}",
            "learner",
            *job_flags,
            *("--unit", str(unit), "--num-units", "2", "--max-steps", "100000"),
            *("--slowdown", "3"),  # paced: they only need to keep training
            *("--h-steps", "5", "--status-interval-s", "0.5"),
        )
    assert client.post(f"/jobs/{JOB}/start").status_code == 200
    assert client.post(f"/jobs/{JOB}/units/1/pause").status_code == 200

    def settled() -> dict | None:
        view = _view(client)
        states = [u["state"] for u in view["units"]] if view else []
        return view if states == ["running", "paused"] and view["outer_alive"] else None

    before = wait_for(settled, 180, "unit 0 running, unit 1 paused and the outer alive")
    step0 = read_status(nats_server.url, JOB)[1][0].step

    gateway.send_signal(signal.SIGKILL)
    gateway.wait(timeout=10)
    # Without the gateway the units go on as they were told.
    wait_for(
        lambda: read_status(nats_server.url, JOB)[1][0].step > step0 + 10,
        60,
        "unit 0 to keep training while the gateway is down",
    )
    services.start("gateway-2", *gateway_args)
    after = wait_for(settled, 60, "the restarted gateway to serve the job")
    assert _stable(after) == _stable(before)
    assert after["version"] >= before["version"]
    # The restarted gateway takes changes as before (same token from settings).
    assert client.post(f"/jobs/{JOB}/units/1/resume").status_code == 200
    wait_for(
        lambda: (v := _view(client)) and v["units"][1]["state"] == "running",
        60,
        "unit 1 to resume through the restarted gateway",
    )
