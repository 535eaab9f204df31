"""The restart policy of ``diloco up`` (``services.orchestration.supervisor``) and how a ``Cluster``
heals itself with it: backoff, learners that finish, max-restarts, pids.json. No JAX: the children
here are tiny Python processes, and one test restarts a real nats-server."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.orchestration import nats_server
from services.orchestration.local import files
from services.orchestration.local.chaos import nats_names
from services.orchestration.local.cluster import Cluster
from services.orchestration.local.settings import UpSettings
from services.orchestration.supervisor import Decision, RestartPolicy, State, Supervisor


def test_backoff_starts_at_one_second_doubles_to_ten_and_resets_after_a_long_run():
    policy = RestartPolicy()
    delays, previous = [], None
    for _ in range(7):
        previous = policy.next_backoff_s(previous, ran_s=2.0)
        delays.append(previous)
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert policy.next_backoff_s(10.0, ran_s=59.9) == 10.0
    assert policy.next_backoff_s(10.0, ran_s=60.0) == 1.0


def test_a_crashed_child_is_restarted_after_its_backoff_and_counted():
    supervisor = Supervisor()
    supervisor.add("outer", now=0.0)
    decision = supervisor.exited("outer", -9, now=5.0)
    assert decision == Decision("outer", -9, State.WAITING, 1.0, 1, 1000)
    assert decision.line() == "outer exited with code -9; restart #1 in 1.0s"
    assert supervisor.due(5.9) == []
    assert supervisor.due(6.0) == ["outer"]
    assert supervisor.restarted("outer", now=6.0) == 1
    assert supervisor.state("outer") is State.RUNNING
    # Crashing again soon: the backoff doubles; after a long run it starts again from 1 s.
    assert supervisor.exited("outer", 1, now=7.0).delay_s == 2.0
    supervisor.restarted("outer", now=9.0)
    assert supervisor.exited("outer", 1, now=10.0).delay_s == 4.0
    supervisor.restarted("outer", now=14.0)
    third = supervisor.exited("outer", -15, now=100.0)
    assert (third.delay_s, third.restart) == (1.0, 4)
    assert supervisor.restarts() == {"outer": 3}


def test_a_learner_exiting_zero_has_finished_and_one_exiting_non_zero_is_restarted():
    supervisor = Supervisor()
    supervisor.add("learner-0", 0.0, may_finish=True)
    supervisor.add("learner-1", 0.0, may_finish=True)
    supervisor.add("gateway", 0.0)
    done = supervisor.exited("learner-0", 0, 1.0)
    assert done.state is State.FINISHED and done.line() == ""
    assert supervisor.exited("learner-1", -9, 1.0).state is State.WAITING
    # A service exiting 0 while the run goes on is unexpected: it comes back too.
    assert supervisor.exited("gateway", 0, 1.0).state is State.WAITING
    assert sorted(supervisor.due(10.0)) == ["gateway", "learner-1"]
    assert supervisor.running() == []


def test_a_child_is_left_dead_after_max_restarts():
    supervisor = Supervisor(RestartPolicy(max_restarts=2))
    supervisor.add("nats-server", 0.0)
    for restart in (1, 2):
        assert supervisor.exited("nats-server", 1, 0.0).restart == restart
        supervisor.restarted("nats-server", 0.0)
    gave_up = supervisor.exited("nats-server", 1, 0.0)
    assert gave_up.state is State.GAVE_UP
    assert gave_up.line() == "nats-server exited with code 1; not restarted: max-restarts 2 reached"
    assert supervisor.due(1e9) == []
    assert Supervisor(RestartPolicy(max_restarts=0)).policy.max_restarts == 0


def test_misreported_transitions_are_refused():
    supervisor = Supervisor()
    supervisor.add("outer", 0.0)
    with pytest.raises(ValueError, match="no restart scheduled"):
        supervisor.restarted("outer", 1.0)
    supervisor.exited("outer", 1, 1.0)
    with pytest.raises(ValueError, match="not running"):
        supervisor.exited("outer", 1, 1.0)


# --- Cluster.heal with stand-in children -------------------------------------------------------

# Each stand-in's first argument says what it does: run until killed, crash, or finish.
SCRIPTS = {"run": "import time; time.sleep(60)", "crash": "raise SystemExit(3)", "done": ""}


def _fake_popen(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen([sys.executable, "-c", SCRIPTS[args[0]]], stdout=log_file)


@pytest.fixture
def fake_cluster(tmp_path: Path):
    settings = UpSettings(learners=2, data_dir=str(tmp_path))
    cluster = Cluster(settings, out=io.StringIO(), launch=_fake_popen)
    cluster.supervisor = Supervisor(RestartPolicy(initial_backoff_s=0.05, max_restarts=1))
    yield cluster
    cluster.stop()


def _heal_until(cluster: Cluster, done, timeout_s: float = 10.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ended = cluster.heal(lambda: False)
        if ended is not None or done():
            return ended
        time.sleep(0.02)
    raise AssertionError(f"cluster did not settle:\n{cluster.out.getvalue()}")  # type: ignore[attr-defined]


def test_cluster_restarts_a_crashed_learner_lets_a_finished_one_be_and_writes_pids(fake_cluster):
    cluster = fake_cluster
    cluster.services.append(cluster.spawn("outer", ["run"]))
    cluster.learners.append(cluster.spawn("learner-0", ["done"], may_finish=True))
    crashing = cluster.spawn("learner-1", ["crash"], may_finish=True)
    cluster.learners.append(crashing)
    first_pid = crashing.process.pid
    # learner-1 crashes, is restarted once, crashes again and is left dead (max-restarts 1).
    _heal_until(cluster, cluster.learners_done)
    output = cluster.out.getvalue()
    assert "learner-1 exited with code 3; restart #1 in 0.1s" in output, output
    assert "learner-1 restarted (restart #1, pid " in output
    assert "learner-1 exited with code 3; not restarted: max-restarts 1 reached" in output
    assert "learner-0" not in output  # finished: neither restarted nor reported
    assert crashing.process.pid != first_pid
    assert crashing.log_path.read_text().count("==== diloco up: restart #1 ====") == 1
    record = files.read_pids(cluster.data_dir)
    assert record is not None
    assert record.pids == {"outer": cluster.services[0].pid} == cluster.pids()
    assert record.restarts == {"outer": 0, "learner-0": 0, "learner-1": 1}
    cluster.stop()
    record = files.read_pids(cluster.data_dir)
    assert record is not None and record.pids == {}


def test_cluster_run_ends_when_the_outer_is_left_dead_but_not_for_the_gateway(fake_cluster):
    cluster = fake_cluster
    cluster.services.append(cluster.spawn("gateway", ["crash"]))
    gateway_state = lambda: cluster.supervisor.state("gateway")  # noqa: E731
    assert _heal_until(cluster, lambda: gateway_state() is State.GAVE_UP) is None
    cluster.services.append(cluster.spawn("outer", ["crash"]))
    ended = _heal_until(cluster, lambda: False)
    assert ended == (
        "stopped: outer exited with code 3 and was not restarted (max-restarts 1 reached)"
    )
    assert cluster.supervisor.restarts() == {"gateway": 1, "outer": 1}


def test_cluster_does_not_restart_while_stopping(fake_cluster):
    cluster = fake_cluster
    cluster.supervisor = Supervisor(RestartPolicy(initial_backoff_s=0.0, max_restarts=1))
    cluster.services.append(cluster.spawn("outer", ["crash"]))
    cluster.services[0].process.wait()
    cluster.heal(lambda: True)  # notices the exit; with no backoff the restart is due at once
    assert cluster.heal(lambda: True) is None
    assert cluster.supervisor.state("outer") is State.WAITING
    assert cluster.supervisor.restarts() == {"outer": 0}
    assert cluster.heal(lambda: False) is None  # not stopping: the due restart happens
    assert cluster.supervisor.restarts() == {"outer": 1}


# --- nats-server restarted in place -------------------------------------------------------------


@pytest.mark.slow  # a real nats-server
def test_a_killed_nats_server_restarts_on_its_port_with_its_jetstream_store(tmp_path):
    import nats

    async def publish_then_read(url: str, publish: bool) -> int:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            if publish:
                await js.add_stream(name="KEEP", subjects=["keep.>"])
                await js.publish("keep.a", b"accepted")
            return (await js.stream_info("KEEP")).state.messages
        finally:
            await nc.close()

    server = nats_server.start_nats_server(tmp_path / "nats")
    try:
        url, pid = server.url, server.pid
        assert asyncio.run(publish_then_read(url, publish=True)) == 1
        server.kill()
        assert not server.alive()
        server.restart()
        assert (server.url, server.alive(), server.ready()) == (url, True, True)
        assert server.pid != pid
        assert asyncio.run(publish_then_read(url, publish=False)) == 1
        with pytest.raises(nats_server.BrokerError, match="still running"):
            server.restart()
    finally:
        server.stop()
    assert nats_names(1) == ["nats-server"] and nats_names(3) == ["nats-0", "nats-1", "nats-2"]


@pytest.mark.slow  # a real nats-server
def test_a_served_monitoring_port_tells_whether_the_server_is_healthy(tmp_path):
    port = nats_server.free_port()
    server = nats_server.start_nats_server(tmp_path / "nats", http_port=port)
    try:
        assert server.http_port == port and server.healthy()
        server.kill()
        assert not server.healthy()
        with pytest.raises(nats_server.BrokerError, match="not healthy"):
            server.wait_healthy(0.3)
        server.restart()
        server.wait_healthy(20)
    finally:
        server.stop()
    bare = nats_server.start_nats_server(tmp_path / "bare")
    try:
        with pytest.raises(nats_server.BrokerError, match="no monitoring port"):
            bare.healthy()
    finally:
        bare.stop()
