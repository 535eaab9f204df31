"""`diloco up --links`: every learner reaches NATS through its own shaped link; a five-second
stall of every link while the units train loses nothing."""

from __future__ import annotations

import pytest

from services.local import files
from tests.helpers import cluster_processes, job_status, start_up, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

OUTAGE_AT_S = 30  # after the links start; the units train from about 10 s to 60 s after
STEPS = 500


@pytest.mark.timeout(400)
def test_units_train_through_shaped_links_and_a_stall_loses_nothing(tmp_path, jax_cache):
    process, data_dir, out_path = start_up(
        tmp_path,
        jax_cache,
        *("--max-steps", str(STEPS), "--h-steps", "10", "--slowdowns", "3,3"),
        *("--links", "20mbit/10ms,5mbit/25ms", "--link-outages", f"{OUTAGE_AT_S}s+5s"),
    )
    try:
        record = wait_for(lambda: files.read_pids(data_dir), 60, "pids.json")
        assert record.nats_url is not None

        def stalled():
            status = job_status(record.nats_url, "demo")
            links = [status.links.get(name) for name in ("0", "1")]
            if all(link is not None and link.record.outage == "stall" for link in links):
                return status
            return None

        during = wait_for(stalled, 240, "both links to stall", interval_s=0.5)
        steps_during = {unit: entry.record.step for unit, entry in during.units.items()}
        # The units' last heartbeats before the stall: they were training.
        assert {u: e.record.state for u, e in during.units.items()} == {
            0: "running",
            1: "running",
        }, steps_during
        assert all(0 < step < STEPS for step in steps_during.values()), steps_during
        assert process.wait(timeout=300) == 0, out_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    output = out_path.read_text()
    summary = files.read_summary(data_dir)
    assert summary is not None and summary.reason == "finished", output
    assert summary.ledger.balanced and summary.ledger.rejected == 0, summary.ledger
    assert {u: s.step for u, s in summary.units.items()} == {0: STEPS, 1: STEPS}
    for status in summary.units.values():
        # Measured on the unit's clock; the training loop never waits for the network.
        assert status.upload_latency is not None and status.upload_latency.count >= 10
        assert status.params_latency is not None and status.params_latency.count >= 1
        assert status.network_wait_s < 1.0, status.network_wait_s
    assert set(summary.links) == {"0", "1"}
    for name, link in summary.links.items():
        assert link.outages == 1 and link.outage is None, link
        assert link.bytes_up > 0 and link.bytes_down > 0, link
        # Every upload crossed the link: its bytes up are at least the bytes the unit published.
        assert link.bytes_up >= summary.units[int(name)].counter("bytes_sent"), link
    assert summary.links["1"].spec.text() == "5mbit/25ms"
    assert "  link 20mbit/10ms: " in output and "  link 5mbit/25ms: " in output, output
    assert "link-0 0" in output and "link-1 0" in output  # the restarts line
    assert cluster_processes(data_dir, out_path) == []
