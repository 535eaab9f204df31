"""Property-based fuzzing of the gateway's OpenAPI schema (schemathesis + hypothesis) against a
live gateway process and nats-server, with the API token: valid and invalid requests to every
operation must never get a 5xx, and the gateway must still answer afterwards."""

from __future__ import annotations

import asyncio
import collections
import time

import httpx
import pytest

from services.orchestration.nats_server import free_port
from shared import kv, subjects
from shared.records.outer import OuterStatus
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams
from tests.helpers import AUTH, wait_for

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

MAX_EXAMPLES = 400
TIME_LIMIT_S = 50.0
JOB = "demo"  # the gateway's --job (its default), and the schema's example job name


def outer_heartbeat(nats_url: str) -> None:
    """One running outer's status record for the gateway's job."""

    async def write() -> None:
        nc = await connect(NatsSettings(nats_url=nats_url), "test-outer")
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            bucket = await js.key_value(subjects.STATUS_BUCKET)
            record = OuterStatus(state="running", model="tiny", holder="test")
            await kv.put(bucket, subjects.outer_status_key(JOB, 0), record)
        finally:
            await nc.close()

    asyncio.run(write())


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
        *("--nats-url", nats_server.url, "--port", str(port)),
        *("--job", JOB, "--heartbeat-timeout-s", "3600"),
    )
    client = httpx.Client(base_url=url, timeout=10, headers=AUTH)

    def ready():
        try:
            return client.get("/jobs").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(ready, 60, "the gateway to reach NATS")
    # A heartbeat of the job's outer that stays fresh for the whole run, so that /readyz is
    # 200 too and the fuzzer may accept no 5xx at all.
    outer_heartbeat(nats_server.url)
    assert client.get("/readyz").status_code == 200
    # Jobs named like the schema's examples, so that generated calls also reach real records.
    for name in (JOB, "0"):
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
