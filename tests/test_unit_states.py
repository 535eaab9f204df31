"""Real learners obey the desired states the gateway writes: ``idle`` (created, not started)
trains nothing, ``running`` trains, ``stopped`` flushes, reports stopped and exits 0; and a
unit started with ``--initial-state idle`` (docker-compose's learners) of a job nobody
registered waits idle until it is started through the gateway."""

from __future__ import annotations

import httpx
import pytest

from services.orchestration.nats_server import free_port
from shared.records.unit import UnitStatus
from tests.helpers import AUTH, next_heartbeats, read_status, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

MANAGED = "states"  # created through the gateway
WAITING = "waiting"  # never registered: its learner starts idle on its own


@pytest.mark.timeout(400)
def test_learners_idle_until_started_and_exit_when_stopped(nats_server, services):
    port = free_port()
    services.start(
        "gateway",
        "gateway",
        *("--nats-url", nats_server.url, "--port", str(port)),
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=AUTH)

    def created():
        try:
            spec = {"job": MANAGED, "model": "tiny", "units": 1, "h_steps": 5}
            return client.post("/jobs", json=spec).status_code == 201
        except httpx.TransportError:
            return False

    def unit_status(job: str) -> UnitStatus:
        return read_status(nats_server.url, job)[1].get(0) or UnitStatus(unit=0, state="starting")

    try:
        wait_for(created, 60, "the gateway to create the job")
        learner = services.start(
            "learner",
            "learner",
            *("--nats-url", nats_server.url, "--job", MANAGED, "--model", "tiny"),
            *("--unit", "0", "--num-units", "1", "--max-steps", "100000", "--h-steps", "5"),
            *("--slowdown", "3"),  # paced: it only needs to keep training
            *("--status-interval-s", "0.5"),
        )
        services.start(
            "learner-waiting",
            "learner",
            *("--nats-url", nats_server.url, "--job", WAITING, "--model", "tiny", "--unit", "0"),
            *("--num-units", "1", "--max-steps", "100000", "--initial-state", "idle"),
            *("--slowdown", "3"),
            *("--status-interval-s", "0.5"),
        )
        for job in (MANAGED, WAITING):
            wait_for(lambda j=job: unit_status(j).state == "idle", 180, f"{job}'s unit to idle")
        # Idle over three more heartbeats each: nothing trained before it is started.
        beats = next_heartbeats(nats_server.url, [(MANAGED, 0), (WAITING, 0)], 3, 60)
        for (job, _), records in beats.items():
            assert [(r.step, r.state) for r in records] == [(0, "idle")] * 3, job
        view = client.get(f"/jobs/{MANAGED}").json()
        assert view["units"][0]["state"] == "idle" and view["units"][0]["desired"] == "idle"

        assert client.post(f"/jobs/{MANAGED}/start").json()["state"] == "running"
        response = client.post(f"/jobs/{WAITING}/units/0/start")
        assert response.status_code == 200, response.text
        wait_for(
            lambda: unit_status(MANAGED).counter("published") >= 1,
            120,
            "the started unit to train and publish",
        )
        wait_for(lambda: unit_status(WAITING).step > 5, 60, "the waiting unit to train")

        assert client.post(f"/jobs/{MANAGED}/stop").json()["state"] == "stopped"
        assert learner.wait(timeout=90) == 0
        final = unit_status(MANAGED)
        assert (final.state, final.desired, final.unsent) == ("stopped", "stopped", 0)
        view = client.get(f"/jobs/{MANAGED}").json()
        assert view["units"][0]["state"] == "stopped"
    except Exception:
        print(services.logs())
        raise
