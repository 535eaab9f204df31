"""`diloco up`: runs a whole cluster, heals it, finishes by itself, and never leaves a process
behind. (SIGTERM stopping a running cluster: ``tests/test_up_jobs.py`` ends that way, and
``tests/test_local_run_up.py`` sends SIGINT and SIGTERM to stand-in services.)"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from services.orchestration.local import files
from services.orchestration.local.records import RunSummary
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
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
        _wait_until_both_train(out_path)
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
    summary = _finished_learned_balanced(data_dir, out_path)
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


@pytest.mark.timeout(540)
def test_up_on_a_three_node_cluster_trains_through_kill_9_of_a_node(tmp_path, jax_cache):
    """``--nats-cluster 3``: every stream and bucket has three replicas; each learner reaches
    its own node through its shaped link, which fails over to the other nodes. The node that
    learner 0's link forwards to is killed with SIGKILL mid-run and restarted, then the
    outer: the run finishes by itself, the model learned, the books balance (no upload
    applied twice or lost), no process is left."""
    process, data_dir, out_path = start_up(
        tmp_path,
        jax_cache,
        *("--max-steps", "300", "--h-steps", "10", "--slowdowns", "3,3"),
        *("--nats-cluster", "3", "--link", "1gbit", "--tls"),
    )
    try:
        nodes = {"nats-0", "nats-1", "nats-2"}
        wait_for(
            lambda: nodes | {"learner-0", "learner-1"} <= set(live_pids(data_dir)), 120, "pids"
        )
        record = files.read_pids(data_dir)
        assert record is not None and record.nats_url is not None
        assert len(record.nats_url.split(",")) == 3, record.nats_url
        admin = NatsSettings(
            nats_url=record.nats_url,
            nats_credentials=record.nats_credentials,
            nats_ca_file=record.nats_ca_file,
        )
        assert asyncio.run(_replicas(admin)) == {3}
        _wait_until_both_train(out_path)
        os.kill(live_pids(data_dir)["nats-0"], signal.SIGKILL)
        wait_for(lambda: "nats-0 restarted" in out_path.read_text(), 60, "nats-0's restart")
        version = _version(out_path)
        wait_for(lambda: _version(out_path) >= version + 3, 60, "the version to advance")
        # The outer's lease (a compare-and-set on a replicated bucket) and its checkpoint (a
        # replicated stream) carry the restarted outer on: each upload is applied once.
        os.kill(live_pids(data_dir)["outer"], signal.SIGKILL)
        assert process.wait(timeout=400) == 0, out_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    output = out_path.read_text()
    assert "3-node JetStream cluster" in output, output
    assert "nats-0 exited with code -9; restart #1 in 1.0s" in output, output
    assert "nats-0 restarted (restart #1" in output, output
    summary = _finished_learned_balanced(data_dir, out_path)
    assert summary.restarts["nats-0"] == summary.restarts["outer"] == 1
    assert summary.restarts["nats-1"] == summary.restarts["nats-2"] == 0


def _wait_until_both_train(out_path: Path) -> None:
    """Until a progress line of ``diloco up`` shows both units training."""
    wait_for(
        lambda: any(
            " u0 runn" in line and " u1 runn" in line for line in out_path.read_text().splitlines()
        ),
        240,
        "both units to be training",
    )


def _finished_learned_balanced(data_dir: Path, out_path: Path) -> RunSummary:
    """The run's summary, once checked: it finished by itself, the model learned (the eval
    fell by more than 1 nats/byte), both units' books balance, and no process is left."""
    output = out_path.read_text()
    line = next(x for x in output.splitlines() if x.startswith("held-out eval loss"))
    init_loss, final_loss = (float(x) for x in line.split()[3:6:2])
    assert final_loss < init_loss - 1.0, output
    assert "all services stopped" in output
    assert live_pids(data_dir) == {}
    assert cluster_processes(data_dir, out_path) == []
    summary = files.read_summary(data_dir)
    assert summary is not None and summary.reason == "finished", summary
    assert summary.ledger.balanced and set(summary.units) == {0, 1}, summary.ledger
    return summary


def _version(out_path: Path) -> int:
    """The global version in the last progress line of ``diloco up`` (-1 before the first)."""
    lines = [x for x in out_path.read_text().splitlines() if x.startswith("[") and "] v" in x]
    number = lines[-1].split("] v", 1)[1].split()[0] if lines else "-"
    return int(number) if number.isdigit() else -1


async def _replicas(settings: NatsSettings) -> set[int]:
    """The replicas of every stream (KV buckets are streams too), as ``settings``' user."""
    nc = await connect(settings, "test")
    try:
        js = nc.jetstream()
        names = [stream.config.name for stream in await js.streams_info()]
        return {(await js.stream_info(name)).config.num_replicas for name in names}
    finally:
        await nc.close()
