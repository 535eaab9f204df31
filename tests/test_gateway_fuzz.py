"""Property-based fuzzing of the gateway's OpenAPI schema (schemathesis + hypothesis) against a
live gateway and nats-server, with the API token: valid and invalid requests to every operation
must never get a 5xx, and the gateway must still answer afterwards."""

from __future__ import annotations

import collections
import time

import httpx
import pytest

from shared.broker import free_port
from tests.conftest import AUTH, GATEWAY_TOKEN, wait_for

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

MAX_EXAMPLES = 400  # about 15 s against a local gateway
TIME_LIMIT_S = 50.0


@pytest.mark.timeout(300)
def test_fuzzed_requests_never_get_a_server_error(nats_server, services):
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation.modes import GenerationMode

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    services.start(
        "gateway",
        "gateway",
        *("--nats-url", nats_server.url, "--port", str(port), "--token", GATEWAY_TOKEN),
    )
    client = httpx.Client(base_url=url, timeout=10, headers=AUTH)

    def ready():
        try:
            return client.get("/jobs").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(ready, 60, "the gateway to reach NATS")
    # An outer for the gateway's job (--job demo by default), so that /readyz is 200 too and
    # the fuzzer may accept no 5xx at all.
    services.start(
        "outer", "outer", *("--nats-url", nats_server.url, "--job", "demo", "--model", "tiny")
    )
    wait_for(lambda: client.get("/readyz").status_code == 200, 120, "the job's outer to run")
    # Jobs named like the schema's examples, so that generated calls also reach real records.
    for name in ("demo", "0"):
        assert client.post("/jobs", json={"job": name, "model": "tiny", "units": 2}).is_success

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    strategy = st.one_of(
        schema.as_strategy(), schema.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    )
    seen: collections.Counter[tuple[str, int]] = collections.Counter()
    started = time.monotonic()

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def fuzz(case) -> None:
        if time.monotonic() - started > TIME_LIMIT_S:
            return
        response = case.call(base_url=url, headers=AUTH, timeout=10)
        seen[(case.method, response.status_code)] += 1
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: "
            f"{response.text[:500]} (body {case.body!r})"
        )

    try:
        fuzz()
    except Exception:
        print(services.logs())
        raise
    print(sorted(seen.items()))
    statuses = {status for _, status in seen}
    assert statuses & {200, 201} and statuses & {422}, seen  # both kinds of input got through
    assert client.get("/healthz").json() == {"status": "ok"}
