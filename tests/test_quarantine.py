"""A unit quarantined through the REST API (``POST /jobs/{job}/units/{unit}/quarantine``) is
shut out of a ``diloco up`` run: the outer refuses its uploads, its NATS user is removed (its
credentials no longer connect), its learner is stopped for good, and the rest of the job
trains to the end with balanced books."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from services.orchestration.local import files
from services.orchestration.local.records import RunSummary
from shared import subjects, transport
from shared.settings.nats import NatsSettings
from shared.transport.blobs import publish_blob
from shared.transport.connection import connect
from shared.wire.chunks import upload_id
from tests.helpers import start_up, up_gateway, upload_blob, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

JOB = "demo"
FORGED = 10_000  # the round of the forged upload
STEPS = 120  # each unit's


def connects(url: str, credentials: str) -> bool:
    async def attempt() -> bool:
        settings = NatsSettings(nats_url=url, nats_credentials=credentials)
        try:
            nc = await connect(settings, "quarantine-test")
        except transport.TransportError:
            return False
        await nc.close()
        return True

    return asyncio.run(attempt())


def publish_as(url: str, credentials: str, unit: int, round_: int) -> None:
    """Publish a tiny-model upload as ``unit`` (with the admin's user: the unit's is gone)."""

    async def publish() -> None:
        nc = await connect(NatsSettings(nats_url=url, nats_credentials=credentials), "forger")
        try:
            blob = upload_blob(JOB, unit, round_, base=0, seed=round_)
            await publish_blob(
                nc.jetstream(),
                subjects.grads_subject(JOB, unit, 0),
                blob,
                upload_id(JOB, unit, round_, 0),
                64 << 10,
            )
        finally:
            await nc.close()

    asyncio.run(publish())


@pytest.mark.timeout(400)
def test_a_unit_quarantined_through_the_gateway_is_shut_out_of_the_run(tmp_path, jax_cache):
    process, data_dir, out_path = start_up(
        tmp_path,
        jax_cache,
        *("--learners", "3", "--max-steps", str(STEPS), "--h-steps", "10", "--slowdowns", "3,3,3"),
        *("--fragments", "1"),  # the forged upload below carries the whole model
    )
    try:
        record = wait_for(lambda: files.read_pids(data_dir), 60, "pids.json")
        assert record.nats_url is not None and record.nats_credentials is not None
        client = up_gateway(data_dir, out_path)

        def published(unit: int) -> int:
            view = client.get(f"/jobs/{JOB}").json()
            return next((u["published"] for u in view.get("units", []) if u["unit"] == unit), 0)

        # Units 0 and 2 first publish: three units have sent, peer review's start is over.
        wait_for(lambda: published(0) >= 1 and published(2) >= 1, 240, "units 0 and 2 to publish")
        # Unit 2 waits, paused, until the forged upload below is judged: the job cannot end
        # (and its gateway go) before that, however loaded the machine.
        assert client.post(f"/jobs/{JOB}/units/2/pause").status_code == 200
        kept = tmp_path / "unit-0.json"
        own = data_dir / "credentials" / f"learner-{JOB}-0.json"
        shutil.copy(own, kept)
        assert connects(record.nats_url, str(kept))

        answer = client.post(f"/jobs/{JOB}/units/0/quarantine")
        assert answer.status_code == 200 and answer.json()["desired"] == "quarantined"
        wait_for(lambda: "unit 0 quarantined" in out_path.read_text(), 60, "the quarantine")
        assert not own.exists() and not connects(record.nats_url, str(kept))
        # Final: no action brings it back.
        assert client.post(f"/jobs/{JOB}/units/0/resume").status_code == 409
        # An upload in its name (here sent by the admin), once the outer knows, is refused and
        # counted (one sent before the outer read the quarantine could be merged already).
        outer_log = data_dir / "logs" / "outer.log"
        wait_for(lambda: "unit 0 is quarantined" in outer_log.read_text(), 30, "the outer to know")
        publish_as(record.nats_url, record.nats_credentials, 0, FORGED)

        def refused() -> bool:
            view = client.get(f"/jobs/{JOB}/units/0").json()
            return view.get("rejected", {}).get("quarantined", 0) >= 1

        wait_for(refused, 60, "the forged upload to be refused as quarantined")
        assert client.post(f"/jobs/{JOB}/units/2/resume").status_code == 200
        assert process.wait(timeout=300) == 0, out_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    summary = RunSummary.model_validate_json((data_dir / "summary.json").read_text())
    assert summary.reason == "finished" and summary.ledger.balanced, summary.ledger
    # Only unit 0's uploads were refused: units 1 and 2 did not judge each other by unit 0's
    # (nor unit 1 by unit 2's while it was paused).
    assert summary.outer is not None
    assert set(summary.outer.rejected) == {"quarantined"}, summary.outer.rejected
    rejected, applied = (
        rounds.get(0, [])
        for rounds in (summary.outer.rejected_rounds, summary.outer.applied_rounds)
    )
    assert any(first <= FORGED <= last for first, last in rejected), rejected
    assert not any(first <= FORGED <= last for first, last in applied), applied
    assert summary.restarts["learner-0"] == 0
    assert summary.units[0].step < STEPS
    assert summary.units[1].step == summary.units[2].step == STEPS
