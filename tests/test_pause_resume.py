"""Pausing a unit through the gateway really stops it; the others and the version go on."""

from __future__ import annotations

import httpx
import pytest

from services.orchestration.nats_server import free_port
from tests.helpers import AUTH, next_heartbeats, read_status, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

JOB = "pause"


@pytest.mark.timeout(400)
def test_pause_stops_one_unit_while_the_rest_go_on_then_resume(nats_server, services):
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    job_flags = ["--nats-url", nats_server.url, "--job", JOB, "--model", "tiny"]
    services.start("outer", "outer", *job_flags, "--num-units", "2", "--eval-every-s", "30")
    services.start(
        "gateway",
        "gateway",
        *("--nats-url", nats_server.url, "--job", JOB, "--port", str(port)),
    )
    for unit in range(2):
        services.start(
            f"learner-{unit}",
            "learner",
            *job_flags,
            "--unit",
            str(unit),
            "--num-units",
            "2",
            "--max-steps",
            "100000",
            "--slowdown",  # paced: they only need to keep training
            "3",
            "--h-steps",
            "5",
            "--status-interval-s",
            "0.5",
        )
    client = httpx.Client(base_url=gateway, timeout=10, headers=AUTH)

    def job_view():
        try:
            response = client.get(f"/jobs/{JOB}")
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    def units_published(minimum):
        view = job_view()
        if (
            view
            and len(view["units"]) == 2
            and all(u["published"] >= minimum for u in view["units"])
        ):
            return view
        return None

    try:
        wait_for(lambda: units_published(2), 180, "both units to publish twice", interval_s=0.5)
        # Readiness follows the outer's heartbeat, which its first merges (compiled on the
        # event loop) can hold up for a few seconds on a loaded machine.
        last = {}

        def ready():
            response = client.get("/readyz")
            last["detail"] = response.text
            return response.status_code == 200

        try:
            wait_for(ready, 60, "/readyz to say ready", interval_s=0.5)
        except AssertionError as err:
            raise AssertionError(f"{err}; its last answer: {last.get('detail')}") from None

        response = client.post(f"/jobs/{JOB}/units/1/pause")
        assert response.status_code == 200, response.text
        assert response.json() == {"job": JOB, "unit": 1, "desired": "paused"}

        def unit1_paused():
            view = job_view()
            return view if view and view["units"][1]["state"] == "paused" else None

        paused_view = wait_for(unit1_paused, 30, "unit 1 to report paused")

        def outer_caught_up_with_unit1():
            outer, units = read_status(nats_server.url, JOB)
            ledger = outer.unit_ledger(1)
            applied = ledger.applied if ledger is not None else 0
            unit = units[1]
            # Every upload handed to the link has met its fate (a paused unit's queue still
            # drains), and every published one is applied.
            fates = sum(unit.counter(c) for c in ("published", "dropped_unsent", "rejected_local"))
            settled = fates == unit.counter("queued")
            return (outer, units) if settled and applied == unit.counter("published") else None

        # Whatever unit 1 uploaded before the pause gets applied; after that, nothing more.
        outer_before, units_before = wait_for(
            outer_caught_up_with_unit1, 60, "the outer to apply unit 1's uploads"
        )

        def the_others_went_on():
            outer, units = read_status(nats_server.url, JOB)
            published = units[0].counter("published")
            went_on = published >= units_before[0].counter("published") + 2
            return went_on and outer.version > outer_before.version

        # The window: unit 0 publishes twice more and the version moves on, and unit 1
        # reports twice more after that (its record is no older than the window).
        wait_for(the_others_went_on, 60, "unit 0 and the version to go on")
        next_heartbeats(nats_server.url, [(JOB, 1)], 2, 30)
        outer_after, units_after = read_status(nats_server.url, JOB)

        # The paused unit neither trains nor publishes...
        assert units_after[1].step == units_before[1].step
        assert units_after[1].counter("published") == units_before[1].counter("published")
        assert outer_after.units[1].applied == outer_before.units[1].applied
        # ...while the other unit and the global version go on.
        assert units_after[0].counter("published") > units_before[0].counter("published")
        assert outer_after.version > outer_before.version
        assert paused_view["units"][0]["state"] == "running"

        response = client.post(f"/jobs/{JOB}/units/1/resume")
        assert response.status_code == 200 and response.json()["desired"] == "running"
        published_at_pause = units_after[1].counter("published")
        step_at_pause = units_after[1].step

        def unit1_publishes_again():
            _, units = read_status(nats_server.url, JOB)
            return units[1].counter("published") >= published_at_pause + 2 and units[1]

        resumed = wait_for(unit1_publishes_again, 60, "unit 1 to publish again after resume")
        # It resumed from where it was, not from step 0.
        assert resumed.step > step_at_pause

        # Unknown units are refused, and nothing is written for them.
        assert client.post(f"/jobs/{JOB}/units/7/pause").status_code == 404
        assert client.post("/jobs/bad%20name/units/0/pause").status_code == 422
    except Exception:
        print(services.logs())
        raise
