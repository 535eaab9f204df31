"""`diloco up`: runs a whole cluster, heals it, finishes by itself, and never leaves a process
behind. (SIGTERM stopping a running cluster: ``tests/test_up_jobs.py`` ends that way, and
``tests/test_local_run_up.py`` sends SIGINT and SIGTERM to stand-in services.)"""

from __future__ import annotations

import os
import signal

import pytest

from services.orchestration.local import files
from tests.helpers import answers_http, cluster_processes, live_pids, start_up, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)


@pytest.mark.timeout(540)
def test_up_trains_to_the_end_through_restarts_of_gateway_and_nats_server(tmp_path, jax_cache):
    """A whole run over TLS, every process connected as its own NATS user: the gateway and
    nats-server are killed and restarted on the way, the run finishes by itself, the model
    learned, the books balance, no process stepped outside its permissions, and no process is
    left."""
    # Paced (slowdown 3) like the e2e test: unpaced tiny units outrun the outer's first merges.
    process, data_dir, out_path = start_up(
        tmp_path,
        jax_cache,
        *("--max-steps", "150", "--h-steps", "10", "--slowdowns", "3,3", "--tls"),
    )
    try:
        everyone = {"nats-server", "outer", "gateway", "learner-0", "learner-1"}
        # pids.json is rewritten as children start: the learners come last.
        pids = wait_for(lambda: everyone <= set(p := live_pids(data_dir)) and p, 120, "pids")
        record = files.read_pids(data_dir)
        assert record is not None and record.supervisor == process.pid
        gateway_url = next(
            line.split()[1]
            for line in out_path.read_text().splitlines()
            if line.startswith("gateway ")
        )
        wait_for(lambda: answers_http(gateway_url + "/readyz"), 120, "the gateway to answer")
        os.kill(pids["gateway"], signal.SIGKILL)
        wait_for(
            lambda: "gateway restarted (restart #1" in out_path.read_text(), 30, "gateway restart"
        )
        wait_for(lambda: answers_http(gateway_url + "/readyz"), 120, "the gateway to come back")
        wait_for(
            lambda: any(
                " u0 runn" in line and " u1 runn" in line
                for line in out_path.read_text().splitlines()
            ),
            240,
            "both units to be training",
        )
        os.kill(live_pids(data_dir)["nats-server"], signal.SIGKILL)
        assert process.wait(timeout=400) == 0, out_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    output = out_path.read_text()
    assert "gateway exited with code -9; restart #1 in 1.0s" in output, output
    assert "nats-server exited with code -9; restart #1 in 1.0s" in output, output
    assert "nats-server restarted (restart #1" in output
    assert "run finished" in output, output
    restarts = next(x for x in output.splitlines() if x.startswith("restarts "))
    assert "nats-server 1," in restarts and "gateway 1," in restarts, restarts
    line = next(x for x in output.splitlines() if x.startswith("held-out eval loss"))
    init_loss, final_loss = (float(x) for x in line.split()[3:6:2])
    assert final_loss < init_loss - 1.0, output
    assert "all services stopped" in output
    assert live_pids(data_dir) == {}
    assert cluster_processes(data_dir, out_path) == []
    summary = files.read_summary(data_dir)
    assert summary is not None and summary.reason == "finished", summary
    assert summary.ledger.balanced and set(summary.units) == {0, 1}, summary.ledger
    assert summary.restarts["nats-server"] == summary.restarts["gateway"] == 1
    server_log = (data_dir / "nats" / "nats-server.log").read_text()
    assert "TLS required for client connections" in server_log
    # A params want the old server delivered just before its kill, still queued for the
    # outer's callback, is answered after the outer reconnects: the new server never granted
    # that reply and refuses it (the unit asks again). Any other violation fails.
    violations = [x for x in server_log.splitlines() if "Violation" in x]
    stale_reply = 'outer-demo" - Publish Violation - Subject "_INBOX.learner-demo-'
    assert [x for x in violations if stale_reply not in x] == [], violations
    assert len(violations) <= 2, violations
