"""Gateway edges: health without NATS, readiness needs a live outer, clear 4xx errors."""

from __future__ import annotations

import httpx
import pytest

from shared.broker import free_port
from tests.conftest import AUTH, GATEWAY_TOKEN, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)


def start_gateway(services, nats_url: str) -> httpx.Client:
    port = free_port()
    services.start(
        "gateway",
        "gateway",
        *("--nats-url", nats_url, "--job", "g", "--port", str(port), "--token", GATEWAY_TOKEN),
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=AUTH)

    def up():
        try:
            return client.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 60, "the gateway to answer /healthz")
    return client


@pytest.mark.timeout(120)
def test_health_and_readiness_without_nats(services):
    client = start_gateway(services, f"nats://127.0.0.1:{free_port()}")  # nothing listens there
    assert client.get("/healthz").json() == {"status": "ok"}
    response = client.get("/readyz")
    assert response.status_code == 503 and "NATS" in response.json()["detail"]
    assert client.get("/jobs/g").status_code == 503


@pytest.mark.timeout(120)
def test_unknown_job_and_unit_and_bad_names(nats_server, services):
    client = start_gateway(services, nats_server.url)
    wait_for(lambda: client.get("/jobs/none").status_code == 404, 30, "the gateway to reach NATS")
    assert "not found" in client.get("/jobs/none").json()["detail"]
    # No outer has ever run for job g: not ready, and the reason says so.
    response = client.get("/readyz")
    assert response.status_code == 503 and "outer of job 'g' not alive" in response.text
    assert client.post("/jobs/none/units/0/pause").status_code == 404
    bad = client.post("/jobs/bad!name/units/0/pause")
    assert bad.status_code == 422 and "job" in bad.text
    assert client.post("/jobs/g/units/-1/resume").status_code == 422
    assert client.post("/jobs/g/units/x/resume").status_code == 422
