"""A real learner obeys the desired states the gateway writes: ``idle`` (created, not
started) trains nothing, ``running`` trains, ``stopped`` flushes, reports stopped and exits 0."""

from __future__ import annotations

import time

import httpx
import pytest

from shared.broker import free_port
from tests.conftest import AUTH, GATEWAY_TOKEN, read_status, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

JOB = "states"


@pytest.mark.timeout(400)
def test_learner_idles_until_started_and_exits_when_stopped(nats_server, services):
    port = free_port()
    services.start(
        "gateway",
        "gateway",
        *("--nats-url", nats_server.url, "--port", str(port), "--token", GATEWAY_TOKEN),
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=AUTH)

    def created():
        try:
            spec = {"job": JOB, "model": "tiny", "units": 1, "h_steps": 5}
            return client.post("/jobs", json=spec).status_code == 201
        except httpx.TransportError:
            return False

    try:
        wait_for(created, 60, "the gateway to create the job")
        learner = services.start(
            "learner",
            "learner",
            *("--nats-url", nats_server.url, "--job", JOB, "--model", "tiny"),
            *("--unit", "0", "--num-units", "1", "--max-steps", "100000", "--h-steps", "5"),
            *("--status-interval-s", "0.5"),
        )

        def unit_status() -> dict:
            return read_status(nats_server.url, JOB)[1].get(0, {})

        wait_for(lambda: unit_status().get("state") == "idle", 180, "the unit to report idle")
        time.sleep(3)
        assert unit_status()["step"] == 0 and unit_status()["state"] == "idle"
        view = client.get(f"/jobs/{JOB}").json()
        assert view["units"][0]["state"] == "idle" and view["units"][0]["desired"] == "idle"

        assert client.post(f"/jobs/{JOB}/start").json()["state"] == "running"
        wait_for(
            lambda: unit_status().get("counters", {}).get("published", 0) >= 1,
            120,
            "the started unit to train and publish",
        )
        assert client.post(f"/jobs/{JOB}/stop").json()["state"] == "stopped"
        assert learner.wait(timeout=90) == 0
        final = unit_status()
        assert final["state"] == "stopped" and final["desired"] == "stopped"
        assert final["unsent"] == 0
        view = client.get(f"/jobs/{JOB}").json()
        assert view["units"][0]["state"] == "stopped"
    except Exception:
        print(services.logs())
        raise


@pytest.mark.timeout(300)
def test_unit_started_with_initial_state_idle_waits_for_a_start(nats_server, services):
    """``--initial-state idle`` (docker-compose's learners): a unit of a job nobody registered
    waits idle until it is started through the gateway."""
    job = "waiting"
    port = free_port()
    services.start(
        "gateway",
        "gateway",
        *("--nats-url", nats_server.url, "--port", str(port), "--token", GATEWAY_TOKEN),
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=AUTH)
    services.start(
        "learner",
        "learner",
        *("--nats-url", nats_server.url, "--job", job, "--model", "tiny", "--unit", "0"),
        *("--num-units", "1", "--max-steps", "100000", "--initial-state", "idle"),
        *("--status-interval-s", "0.5"),
    )

    def unit_status() -> dict:
        return read_status(nats_server.url, job)[1].get(0, {})

    wait_for(lambda: unit_status().get("state") == "idle", 180, "the unit to report idle")
    time.sleep(3)
    assert unit_status()["step"] == 0
    response = client.post(f"/jobs/{job}/units/0/start")
    assert response.status_code == 200, response.text
    wait_for(lambda: unit_status().get("step", 0) > 5, 60, "the started unit to train")
