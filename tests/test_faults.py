"""Fault injection with real processes, a real nats-server and ``kill -9`` (docs/RELIABILITY.md).

Every test is seeded (kill moments come from ``random.Random(seed)``) and ends by balancing the
books with :func:`shared.ledger.balance`: every round a unit published was applied exactly once
or rejected with a reason. A recorder also listens to every params announcement and checks that
a version number never stands for two different sets of params.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import numpy as np
import pytest

from services.orchestration.nats_server import (
    NatsServer,
    cluster_url,
    start_nats_cluster,
    start_nats_server,
)
from shared import records, subjects
from shared.codec import api as codec
from shared.ledger import Books, balance
from shared.nats_auth import Identity
from shared.records.outer import OuterStatus, ParamsHead, UnitLedger
from shared.records.unit import UnitStatus
from shared.settings.nats import NatsSettings
from shared.transport.blobs import ATTEMPT_TIMEOUT_S, chunk_size_for, publish_blob
from shared.transport.connection import connect
from shared.transport.params import publish_params, read_latest_params
from shared.transport.streams import ensure_streams
from shared.wire.chunks import upload_id
from shared.wire.envelope import pack_envelope, unpack_envelope
from tests.helpers import (
    SecureNats,
    job_status,
    next_heartbeats,
    publish_uploads,
    read_status,
    upload_blob,
    wait_for,
)

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

LEASE_S = "1"


def job_flags(url: str, job: str) -> list[str]:
    # One fragment: the hand-made uploads and params of these tests carry the whole model.
    return ["--nats-url", url, "--job", job, "--model", "tiny", "--seed", "1", "--fragments", "1"]


def start_outer(
    services, url: str, job: str, name: str, units: int, *extra: str, env: dict | None = None
):
    return services.start(
        name,
        "outer",
        *job_flags(url, job),
        *extra,
        "--num-units",
        str(units),
        "--eval-every-s",
        "3",
        "--lease-s",
        LEASE_S,
        "--status-interval-s",
        "0.3",
        env=env,
    )


def start_learner(services, url: str, job: str, unit: int, units: int, ckpt: Path, steps: int):
    return services.start(
        f"learner-{unit}",
        "learner",
        *job_flags(url, job),
        "--unit",
        str(unit),
        "--num-units",
        str(units),
        "--max-steps",
        str(steps),
        "--h-steps",
        "10",
        "--batch-size",
        "8",
        "--no-dynamic-h",
        "--slowdown",
        "3",
        "--status-interval-s",
        "0.5",
        "--checkpoint-dir",
        str(ckpt),
    )


def kill9(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


def outer_status(url: str, job: str) -> OuterStatus | None:
    return read_status(url, job)[0]


def outer_running(url: str, job: str) -> bool:
    status = outer_status(url, job)
    return status is not None and status.state == "running"


def outer_applied(url: str, job: str) -> int:
    status = outer_status(url, job)
    return status.applied if status is not None else 0


def unit_status(url: str, job: str, unit: int) -> UnitStatus | None:
    return read_status(url, job)[1].get(unit)


def current_leader(url: str, job: str, outers: dict[str, subprocess.Popen]) -> str | None:
    """Name of the live outer process that leads the job (by its fresh heartbeat), if any."""
    entry = job_status(url, job).outer
    if entry is None or entry.record.state != "running" or entry.age_s > 1.0:
        return None
    pid = entry.record.holder.split(":")[1]
    for name, process in outers.items():
        if process.poll() is None and str(process.pid) == pid:
            return name
    return None


class HeadRecorder:
    """Records every params head announced for a job: (fragment, version) -> params checksums,
    and each fragment's newest version (:meth:`versions`)."""

    def __init__(self, url: str, job: str) -> None:
        self.url, self.job = url, job
        self.checksums: dict[tuple[int, int], set[int | None]] = defaultdict(set)
        self._newest: dict[int, int] = {}
        self._lock = threading.Lock()
        self.malformed = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        assert self._ready.wait(20), "head recorder could not connect"

    async def _run(self) -> None:
        nc = await connect(NatsSettings(nats_url=self.url), "head-recorder")

        async def on_head(msg) -> None:
            head = records.decode(ParamsHead, msg.data, msg.subject)
            if head is None:
                self.malformed += 1
                return
            fragment = int(msg.subject.split(".")[3])
            with self._lock:
                self.checksums[fragment, head.version].add(head.params_checksum)
                self._newest[fragment] = max(head.version, self._newest.get(fragment, -1))

        await nc.subscribe(subjects.params_head_subject(self.job, "*"), cb=on_head)
        self._ready.set()
        await asyncio.to_thread(self._stop.wait)
        await nc.close()

    def versions(self) -> dict[int, int]:
        """Per fragment, the newest version announced so far."""
        with self._lock:
            return dict(self._newest)

    def advanced(self, since: dict[int, int]) -> bool:
        """Whether a fragment's version was announced above ``since`` (:meth:`versions`)."""
        return any(v > since.get(fragment, -1) for fragment, v in self.versions().items())

    def stop(self) -> dict[tuple[int, int], set[int | None]]:
        self._stop.set()
        self._thread.join(10)
        assert self.malformed == 0, f"{self.malformed} malformed params heads"
        return self.checksums


def assert_no_version_published_twice(checksums: dict[tuple[int, int], set[int | None]]) -> None:
    twice = {key: values for key, values in checksums.items() if len(values) > 1}
    assert not twice, f"versions announced with different params: {twice}"
    assert checksums, "no params announcement was recorded"


def assert_books_balance(url: str, job: str) -> Books:
    outer, units = read_status(url, job)
    books = balance(outer, units)
    print("ledger:", books.model_dump_json())
    assert books.balanced, books.problems
    return books


def wait_caught_up(url: str, job: str, timeout_s: float = 120) -> None:
    """Every published round is applied or rejected, and nothing is buffered."""

    def caught_up() -> bool:
        try:
            outer, units = read_status(url, job)
        except nats.errors.Error:  # the status bucket has no leader yet (a node just restarted)
            return False
        return outer is not None and outer.state == "running" and balance(outer, units).balanced

    wait_for(caught_up, timeout_s, "the outer to apply every published round", interval_s=0.5)


def stop_units_and_balance(services, learners: list, url: str, job: str) -> Books:
    """SIGTERM the units (they upload what they have and exit 0), wait until the outer has
    dealt with every published round, and check that the books balance."""
    for learner in learners:
        learner.send_signal(signal.SIGTERM)
    for learner in learners:
        assert learner.wait(timeout=60) == 0, services.logs()
    wait_caught_up(url, job)
    return assert_books_balance(url, job)


# --------------------------------------------------------------------------- the outer


@dataclasses.dataclass
class Replicated:
    """A running three-node cluster whose streams and buckets have three replicas."""

    servers: list[NatsServer]

    @property
    def url(self) -> str:
        return cluster_url(self.servers)


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[Replicated]:
    """A fresh three-node JetStream cluster, its streams and buckets created with three
    replicas, stopped after the test."""
    servers = start_nats_cluster(tmp_path / "nats", 3, monitor=True)
    try:
        _create_streams(cluster_url(servers), 3)
        yield Replicated(servers)
    finally:
        for server in servers:
            server.stop()


@pytest.mark.timeout(600)
def test_outer_killed_at_random_moments_loses_and_duplicates_nothing(
    nats_cluster, services, tmp_path
) -> None:
    """4 kill -9s of the leading outer at seeded random moments (some right after it took
    over), with two more outers standing by, so that most takeovers are by a warm standby
    and none waits for a killed process to restart: the job never has two leaders, never
    announces a version twice, and the books balance. Every killed outer is restarted and
    stands by in its turn. With the replay test's two, the tests kill an outer 6 times.

    On a three-node cluster, every stream and bucket with three replicas: the lease is a
    compare-and-set on a replicated bucket, the checkpoints and the uploads' work queue are
    replicated streams (docs/RELIABILITY.md, "A replicated broker")."""
    url = nats_cluster.url
    job, units, kills = "killouter", 2, 4
    rng = random.Random(20261130)
    recorder = HeadRecorder(url, job)
    outers = {"a": start_outer(services, url, job, "outer-a", units)}
    learners = [
        start_learner(services, url, job, u, units, tmp_path / "units", 100_000)
        for u in range(units)
    ]
    wait_for(lambda: outer_applied(url, job) >= 2, 180, "training")
    for name in ("b", "c"):  # standbys, ready before the first kill
        outers[name] = start_outer(services, url, job, f"outer-{name}", units)
    # On a loaded machine, standbys still starting at the kills left every takeover to the
    # killed outer, restarted at once: all 4 kills hit "a" (a CI run).
    for name in ("b", "c"):
        wait_for(
            lambda n=name: "standing by" in services.log(f"outer-{n}"),
            120,
            f"outer-{name} to stand by",
        )
    killed_holders: list[str] = []
    killed_names: list[str] = []
    for kill in range(kills):
        # The leader is whichever live outer holds the lease and heartbeats now.
        leader = wait_for(
            lambda: current_leader(url, job, outers),
            120,
            f"a leader before kill {kill}",
        )
        status = outer_status(url, job)
        assert status is not None
        # The moment of the kill, drawn from the seeded schedule: what the test varies.
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0.0, 0.3))  # right after it took over
        else:
            time.sleep(rng.uniform(0.2, 3.0))
        killed_holders.append(status.holder)
        killed_names.append(leader)
        kill9(outers[leader])
        outers[leader] = start_outer(services, url, job, f"outer-{leader}", units)
    # Let it run a little after the last kill, then stop the units (they flush what they have).
    wait_for(lambda: outer_running(url, job), 120, "leader")
    books = stop_units_and_balance(services, learners, url, job)
    assert books.applied >= 10 and books.rejected == 0
    status = outer_status(url, job)
    assert status is not None and status.holder not in killed_holders
    assert len(set(killed_names)) >= 2, "standbys must have taken over"
    assert status.epoch is not None
    assert status.epoch >= kills + 1  # every kill of a leader led to a new leadership epoch
    assert status.version == status.merges, "each merge must make exactly one version"
    assert status.restored_from.kind == "checkpoint"
    assert_no_version_published_twice(recorder.stop())
    # Never two leaders: every outer that lost the lease exited with the lease-lost code, and
    # each process that was not killed by us is either the leader or a standby.
    for name, process in outers.items():
        assert process.poll() in (None, 75), services.log(f"outer-{name}")


# --------------------------------------------------------------------------- replay


def _final_params(url: str, job: str, version: int) -> dict[str, np.ndarray]:
    """The params of ``version``, once published (the status reports a merge at once; its
    params go out after the commit that covers it)."""

    async def read() -> dict[str, np.ndarray] | None:
        nc = await connect(NatsSettings(nats_url=url), "replay-reader")
        try:
            fetched = await read_latest_params(nc.jetstream(), job, 0, 1 << 30)
            if fetched is None or fetched[0].version < version:
                return None
            assert fetched[0].version == version
            envelope = unpack_envelope(fetched[1], max_size=1 << 30)
            return codec.decode_tensors(envelope.payload, envelope.codec)
        finally:
            await nc.close()

    params: dict[str, np.ndarray] | None = None

    def published() -> bool:
        nonlocal params
        params = asyncio.run(read())
        return params is not None

    wait_for(published, 30, f"{job}: version {version} published")
    assert params is not None
    return params


@pytest.mark.timeout(400)
def test_replay_with_and_without_an_outer_crash_gives_bit_identical_params(
    nats_server, services
) -> None:
    """The same arrival sequence (uploads stored before the outer starts, so their order is
    the stream's) is applied by an outer that runs through, and by one killed midway and
    restarted (twice): the final global params are bit for bit the same. Two of the uploads are
    1000x the usual norm: both runs' norm guards reject the same two (the guard's history is in
    the checkpoint)."""
    count = 72
    hostile = {40: 1.0, 62: 1.0}  # upload position -> noise scale (the usual is 1e-3)
    # One upload per fetch: each is merged and committed on its own, so the applied count
    # climbs in small steps that the test can kill between (with a fetch of 32, a fast outer
    # applied them all within one 0.3 s heartbeat and the kills came too late).
    # fp32 params, so that the published copies show the params bit for bit.
    one_at_a_time = ("--fetch-batch", "1", "--params-codec", "fp32")
    results = {}
    for job, crash in (("replaya", False), ("replayb", True)):
        publish_uploads(nats_server.url, job, count, hostile)
        outer = start_outer(services, nats_server.url, job, f"outer-{job}", 3, *one_at_a_time)
        if crash:
            for kill in range(2):
                wait_for(
                    lambda k=kill, j=job: outer_applied(nats_server.url, j) >= 15 + 30 * k,
                    120,
                    f"{job}: applied before kill {kill}",
                    interval_s=0.05,
                )
                assert outer_applied(nats_server.url, job) < count, "crash came too late"
                kill9(outer)
                outer = start_outer(
                    services, nats_server.url, job, f"outer-{job}-{kill}", 3, *one_at_a_time
                )
        wait_for(
            lambda j=job: outer_applied(nats_server.url, j) == count - len(hostile),
            180,
            f"{job}: every honest upload applied",
        )
        status = outer_status(nats_server.url, job)
        assert status is not None and status.version == count - len(hostile)
        assert status.rejected == {"norm_outlier": len(hostile)}
        assert status.rejected_rounds == {k % 3: [(k // 3, k // 3)] for k in hostile}
        if crash:
            assert status.restored_from.kind == "checkpoint"
        results[job] = _final_params(nats_server.url, job, count - len(hostile))
        kill9(outer)
    a, b = results["replaya"], results["replayb"]
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _unacknowledged(url: str, job: str) -> int:
    """Uploads' chunk messages the outer's consumer has not had acknowledged (pending or
    delivered and waiting for an ack)."""

    async def read() -> int:
        nc = await connect(NatsSettings(nats_url=url), "consumer-reader")
        try:
            info = await nc.jetstream().consumer_info(
                subjects.GRADS_STREAM, subjects.outer_consumer(job, 0)
            )
            return int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        finally:
            await nc.close()

    return asyncio.run(read())


@pytest.mark.timeout(300)
def test_waiting_uploads_share_one_commit_and_merge_as_they_would_one_by_one(
    nats_server, services
) -> None:
    """The same stored uploads, one message per fetch so that more are always waiting: an outer
    that commits after every fetch (``--commit-every-s 0``) and one whose commit budget outlasts
    them (60 s: it commits once the uploads pause) end at the same params bit for bit;
    the second committed a handful of checkpoints, not one per upload, and acknowledged every
    message after its commit."""
    count = 24
    results, commits = {}, {}
    for job, every in (("commiteach", "0"), ("commitbatch", "60")):
        publish_uploads(nats_server.url, job, count)
        outer = start_outer(
            services,
            nats_server.url,
            job,
            f"outer-{job}",
            3,
            "--fetch-batch",
            "1",
            "--params-codec",
            "fp32",
            "--commit-every-s",
            every,
        )

        def committed(j: str = job) -> bool:
            status = outer_status(nats_server.url, j)
            last = status.last_checkpoint if status is not None else None
            return last is not None and last.versions == [count]

        wait_for(committed, 180, f"{job}: every upload applied and committed")
        wait_for(
            lambda j=job: _unacknowledged(nats_server.url, j) == 0,
            30,
            f"{job}: every message acknowledged",
        )
        status = outer_status(nats_server.url, job)
        assert status is not None and status.applied == count and not status.rejected
        commits[job] = status.checkpoints
        results[job] = _final_params(nats_server.url, job, count)
        kill9(outer)
    # About one commit per fetched upload (peer review holds the first few until their peers
    # come, and merges them in one pass), against the first commit, the one once nothing more
    # was waiting and those of the evaluations between.
    assert commits["commiteach"] >= count - 4, commits
    assert commits["commitbatch"] <= count // 4, commits
    a, b = results["commiteach"], results["commitbatch"]
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


# --------------------------------------------------------------------------- nats-server


@pytest.mark.timeout(500)
def test_nats_server_killed_and_restarted_mid_run(nats_server: NatsServer, services, tmp_path):
    job, units = "killnats", 2
    recorder = HeadRecorder(nats_server.url, job)
    start_outer(services, nats_server.url, job, "outer", units)
    wait_for(lambda: outer_running(nats_server.url, job), 120, "outer")
    learners = [
        start_learner(services, nats_server.url, job, u, units, tmp_path / "units", 200)
        for u in range(units)
    ]
    wait_for(lambda: outer_applied(nats_server.url, job) >= 4, 180, "training")
    before = outer_applied(nats_server.url, job)
    logged = {name: len(services.log(name)) for name, _, _ in services.children}
    nats_server.kill()
    # The outage lasts until every service has noticed it (a failed reconnect in its log);
    # meanwhile the learners go on training and queue their uploads.
    wait_for(
        lambda: all("nats error" in services.log(name)[at:] for name, at in logged.items()),
        60,
        "every service to notice the outage",
    )
    server = start_nats_server(nats_server.store_dir, port=nats_server.port)
    try:
        wait_for(
            lambda: outer_applied(server.url, job) > before + 4,
            180,
            "training to go on after the restart",
        )
        for learner in learners:
            assert learner.wait(timeout=300) == 0, services.logs()
        wait_caught_up(server.url, job)
        books = assert_books_balance(server.url, job)
        _, statuses = read_status(server.url, job)
        for unit, status in statuses.items():
            # Every round the unit numbered was published (and so applied), or dropped from
            # its bounded queue during the outage and counted.
            life = status.lifetime
            accounted = books.per_unit[unit].published + life["dropped_unsent"]
            assert accounted + life["rejected_local"] == status.next_round, status
        assert_no_version_published_twice(recorder.stop())
    finally:
        services.stop_all()  # while their server still answers, so that they stop at once
        server.stop()


def _last_election(url: str, job: str, since: float) -> float:
    """Seconds from ``since`` (unix time) to the newest leader election after it among the
    groups the outer's version needs (``VERSION_GROUPS`` and the outer's consumer): 0 when none
    was elected after it. A group still without a leader (one the outer did not need this
    time: it had uploads waiting) does not answer and is left out."""

    async def read() -> list[float]:
        nc = await connect(NatsSettings(nats_url=url), "leader-reader")
        js = nc.jetstream(timeout=2.0)
        durable = subjects.outer_consumer(job, 0)
        infos = [lambda n=name: js.stream_info(n) for name in VERSION_GROUPS]
        infos.append(lambda: js.consumer_info(subjects.GRADS_STREAM, durable))
        elected = []
        try:
            for info in infos:
                with contextlib.suppress(nats.errors.Error):
                    cluster = (await info()).cluster
                    if cluster is not None and cluster.leader_since is not None:
                        elected.append(cluster.leader_since.timestamp())
            return elected
        finally:
            await nc.close()

    return max((at - since for at in asyncio.run(read()) if at > since), default=0.0)


def _grads_leader(url: str) -> str | None:
    """The node that leads the uploads' stream now (None while it has no leader)."""

    async def read() -> str | None:
        nc = await connect(NatsSettings(nats_url=url), "leader-reader")
        try:
            info = await nc.jetstream().stream_info(subjects.GRADS_STREAM)
            return info.cluster.leader if info.cluster is not None else None
        finally:
            await nc.close()

    with contextlib.suppress(Exception):
        return asyncio.run(read())
    return None


def _create_streams(url: str, replicas: int) -> None:
    """Create every stream and bucket with ``replicas`` copies (``start_nats_cluster`` returns
    once the cluster has its JetStream metadata leader, so they can be created at once)."""

    async def create() -> None:
        nc = await connect(NatsSettings(nats_url=url), "stream-creator")
        try:
            await ensure_streams(nc.jetstream(), replicas)
        finally:
            await nc.close()

    asyncio.run(create())


# The groups whose leaders the outer needs to publish a new version: it fetches from its consumer
# of the uploads' stream, commits its checkpoint (a stream) and the pointer to it (in the lease
# bucket), then publishes to the params stream.
VERSION_GROUPS = (
    subjects.GRADS_STREAM,
    subjects.CKPT_STREAM,
    f"KV_{subjects.OUTER_BUCKET}",
    subjects.PARAMS_STREAM,
)
FAILOVER_S = 10.0
# nats-server's Raft elects a new leader for a group whose leader died after a randomised wait
# of 4-9 s plus a campaign of up to 0.8 s, and a consumer only once its stream has one (one
# outer's consumer got its new leader 10.6 s after the kill). Where they take so long that 10 s
# cannot hold, the version must advance within OWN_S of the last of those elections: the
# clients' retries (``shared.retry.QUICK``) and one request lost in the failover
# (``ATTEMPT_TIMEOUT_S``). In 36 kills, 2 runs side by side at a time: the version advanced
# 8.9 s after the kill at most, and 0.58 s after the last election.
OWN_S = ATTEMPT_TIMEOUT_S + 0.5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_three_node_cluster_trains_through_kill_9_of_each_node_in_turn(
    nats_cluster, services, tmp_path
):
    """Three nodes, every stream and bucket (the outer's lease among them) with three
    replicas; the outer and two units connect to all three. Each node in turn, the uploads'
    stream leader first, is killed with SIGKILL during the run: the outer's version advances
    within ``FAILOVER_S`` of each kill (or within ``OWN_S`` of nats-server's election of the
    last leader it needs, where that took longer); the node is started again on its store. At
    the end every unit's rounds are applied exactly once and no version was announced with
    two params."""
    job, units = "cluster", 2
    servers, url = nats_cluster.servers, nats_cluster.url
    recorder = HeadRecorder(url, job)
    start_outer(services, url, job, "outer", units)
    wait_for(lambda: outer_running(url, job), 120, "outer")
    learners = [
        start_learner(services, url, job, u, units, tmp_path / "units", 100_000)
        for u in range(units)
    ]
    wait_for(lambda: outer_applied(url, job) >= 4, 180, "training")
    advanced_after: dict[str, tuple[float, float]] = {}  # node: (version advanced, elected)
    leaders_killed = 0
    alive = {f"n{i}": server for i, server in enumerate(servers)}
    while alive:
        leader = _grads_leader(url)
        name = leader if leader in alive else sorted(alive)[0]
        leaders_killed += name == leader
        server = alive.pop(name)
        before = recorder.versions()
        server.kill()
        killed, killed_at = time.monotonic(), time.time()
        wait_for(
            lambda v=before: recorder.advanced(v),
            3 * FAILOVER_S,
            f"the version to advance after node {name} (leader: {leader}) was killed",
            interval_s=0.05,
        )
        took = time.monotonic() - killed
        advanced_after[name] = (round(took, 2), round(_last_election(url, job, killed_at), 2))
        server.restart()
        # As in a rolling restart, the next node goes down only once this one has caught up
        # (every stream and consumer replica it holds is current): a cluster of three keeps
        # a quorum of current replicas through one node's loss, not through two.
        server.wait_healthy(60)
    print("after each kill (s), the version advanced and the leaders it needs were elected:")
    print(advanced_after)
    late = {n: t for n, t in advanced_after.items() if t[0] > max(FAILOVER_S, t[1] + OWN_S)}
    assert not late, f"the version advanced late (s after the kill, last election): {late}"
    assert leaders_killed >= 1, "no kill hit the uploads' stream leader"
    stop_units_and_balance(services, learners, url, job)
    assert_no_version_published_twice(recorder.stop())


# --------------------------------------------------------------------------- a learner unit


@pytest.mark.timeout(500)
def test_killed_unit_does_not_stop_the_others_and_rejoins_within_30s(
    nats_server, services, tmp_path
) -> None:
    job, units = "killunit", 3
    ckpt = tmp_path / "units"
    start_outer(services, nats_server.url, job, "outer", units)
    wait_for(lambda: outer_running(nats_server.url, job), 120, "outer")
    learners = [
        start_learner(services, nats_server.url, job, u, units, ckpt, 100_000) for u in range(units)
    ]
    victim = 2

    def victim_ledger() -> UnitLedger | None:
        status = outer_status(nats_server.url, job)
        return status.unit_ledger(victim) if status is not None else None

    def version() -> int:
        status = outer_status(nats_server.url, job)
        return status.version if status is not None else 0

    wait_for(
        lambda: (ledger := victim_ledger()) is not None and ledger.applied >= 2,
        180,
        "the victim unit to have two rounds applied",
    )
    kill9(learners[victim])
    killed = unit_status(nats_server.url, job, victim)
    assert killed is not None
    last_round = killed.published_rounds[-1][1]
    version_at_kill = version()
    # The others go on without it, and never wait for it (decoupled: no unit waits at its
    # sync points; --mode sync does, tests/test_sync_mode.py).
    wait_for(
        lambda: version() >= version_at_kill + 4,
        120,
        "the global version to advance without the killed unit",
    )
    for unit in (0, 1):
        survivor = unit_status(nats_server.url, job, unit)
        assert survivor is not None and survivor.sync_wait_s == 0
    restarted_at = time.monotonic()
    version_at_restart = version()
    learners[victim] = start_learner(services, nats_server.url, job, victim, units, ckpt, 100_000)

    def rejoined() -> bool:
        status = unit_status(nats_server.url, job, victim)
        return (
            status is not None
            and status.state == "running"
            and status.restored_from_step is not None
            and sum(status.base_versions or [0]) >= version_at_restart
        )

    wait_for(rejoined, 30, "the restarted unit to train on the current version")
    print(f"rejoined after {time.monotonic() - restarted_at:.1f}s")
    wait_for(
        lambda: (ledger := victim_ledger()) is not None and ledger.last_round > last_round,
        60,
        "a new round of the restarted unit to be applied",
    )
    books = stop_units_and_balance(services, learners, nats_server.url, job)
    final = outer_status(nats_server.url, job)
    assert final is not None
    applied = final.applied_rounds[victim]
    # Round numbers continue: nothing of the victim was applied twice and rounds after the
    # restart are numbered above the ones before it.
    assert applied[-1][1] > last_round and books.per_unit[victim].missing == []


# --------------------------------------------------------------------------- desired state


@pytest.mark.timeout(500)
def test_paused_unit_stays_paused_through_restarts_of_gateway_outer_and_itself(
    nats_server, services, tmp_path
) -> None:
    """The desired state lives in KV (and in the unit's state file): restarting the gateway,
    the outer or the paused unit itself, each with kill -9 and the same command line, never
    needs an operator action and never resumes the unit."""
    import httpx

    from services.orchestration.nats_server import free_port

    job, units = "keeppaused", 2
    ckpt = tmp_path / "units"
    port = free_port()
    from tests.helpers import AUTH

    gateway_args = ["gateway", "--nats-url", nats_server.url, "--job", job, "--port", str(port)]
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=AUTH)

    def unit_view(unit: int) -> dict | None:
        try:
            response = client.get(f"/jobs/{job}")
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        return next((u for u in response.json()["units"] if u["unit"] == unit), None)

    def unit_state(unit: int) -> str | None:
        status = unit_status(nats_server.url, job, unit)
        return status.state if status is not None else None

    def unit_step(unit: int) -> int:
        status = unit_status(nats_server.url, job, unit)
        return status.step if status is not None else 0

    def restored_paused() -> bool:
        status = unit_status(nats_server.url, job, 1)
        return (
            status is not None
            and status.restored_from_step is not None
            and status.state == "paused"
        )

    outer = start_outer(services, nats_server.url, job, "outer", units)
    gateway = services.start("gateway", *gateway_args)
    learners = [
        start_learner(services, nats_server.url, job, u, units, ckpt, 100_000) for u in range(units)
    ]
    wait_for(
        lambda: all(
            (status := unit_status(nats_server.url, job, u)) is not None and status.published_rounds
            for u in range(units)
        ),
        180,
        "uploads",
    )
    assert client.post(f"/jobs/{job}/units/1/pause").status_code == 200
    wait_for(lambda: unit_state(1) == "paused", 30, "unit 1 paused")

    kill9(gateway)
    gateway = services.start("gateway", *gateway_args)
    view = wait_for(lambda: unit_view(1), 60, "the restarted gateway to serve unit 1")
    assert view["desired"] == "paused" and view["state"] == "paused", view

    kill9(outer)
    outer = start_outer(services, nats_server.url, job, "outer", units)
    wait_for(lambda: outer_running(nats_server.url, job), 120, "outer back")

    step_at_kill = unit_step(1)
    kill9(learners[1])
    learners[1] = start_learner(services, nats_server.url, job, 1, units, ckpt, 100_000)
    wait_for(restored_paused, 90, "the restarted unit to come back paused")
    step = unit_step(1)
    assert step <= step_at_kill
    beats = next_heartbeats(nats_server.url, [(job, 1)], 3, 60)[(job, 1)]
    assert [(beat.step, beat.state) for beat in beats] == [(step, "paused")] * 3
    assert unit_state(0) == "running"

    assert client.post(f"/jobs/{job}/units/1/resume").status_code == 200
    wait_for(lambda: unit_step(1) > step + 5, 60, "unit 1 to train again")


# --------------------------------------------------------------------------- poison messages


def _publish_params(url: str, job: str, version: int, params: dict[str, np.ndarray]) -> None:
    """Publish ``params`` as fragment 0's global at ``version``, as an outer would."""
    from services.outer.publishing import params_envelope

    async def publish() -> None:
        nc = await connect(NatsSettings(nats_url=url), "test-params")
        try:
            js = nc.jetstream()
            blob, checksum = params_envelope(job, "tiny", 0, version, 0, params, "fp32")
            chunk = chunk_size_for(nc)
            await publish_params(js, job, 0, version, blob, chunk, checksum)
        finally:
            await nc.close()

    asyncio.run(publish())


@pytest.mark.timeout(300)
def test_a_learner_fed_malformed_heads_wrong_shapes_and_huge_versions_adopts_the_next_genuine(
    nats_server, services, tmp_path
) -> None:
    """What a learner reads as the global params is checked before it touches training: a head
    that is not a head, params of the wrong shapes, and a version beyond any job's reach are
    rejected; a version that is merely too high is replaced by the next genuine head (the newest
    head published is the truth). The unit never stops training."""
    import jax

    from shared import model, pytree

    job = "hostileparams"
    url = nats_server.url
    learner = start_learner(services, url, job, 0, 1, tmp_path / "units", 100_000)

    def unit() -> UnitStatus | None:
        return read_status(url, job)[1].get(0)

    def unit_where(what: str, check) -> UnitStatus:
        return wait_for(lambda: (u := unit()) is not None and check(u) and u, 120, what)

    unit_where("training", lambda u: u.step > 0)
    genuine = pytree.flatten_named(
        model.init_params(model.get_config("tiny"), jax.random.PRNGKey(1))
    )
    name = sorted(genuine)[0]

    async def junk_head(data: bytes) -> None:
        nc = await connect(NatsSettings(nats_url=url), "test-junk")
        await nc.jetstream().publish(subjects.params_head_subject(job, 0), data, timeout=5)
        await nc.close()

    asyncio.run(junk_head(b"\x00 not a head"))
    wrong = {**genuine, name: genuine[name][..., :1]}
    _publish_params(url, job, 5, wrong)
    rejected = unit_where("wrong shapes rejected", lambda u: u.counter("params_rejected") >= 1)
    assert "shape" in rejected.last_error, rejected.last_error
    huge = {"version": records.MAX_VERSION + 1, "upload": "x", "chunks": 1, "sequences": [1]}
    asyncio.run(junk_head(json.dumps({**huge, "size": 1}).encode()))  # refused as a head
    _publish_params(url, job, 10**9, {k: v + 0.01 for k, v in genuine.items()})
    unit_where("the high version adopted", lambda u: u.base_versions == [10**9])
    _publish_params(url, job, 6, genuine)  # genuine again: newest published, lower version
    back = unit_where("the genuine version adopted", lambda u: u.base_versions == [6])
    later = unit_where("still training", lambda u: u.step > back.step)
    assert learner.poll() is None and later.state == "running", services.log("learner-0")
    assert later.counter("params_rejected") == 1, later.counters


@pytest.mark.timeout(300)
def test_poison_upload_is_dead_lettered_once_and_the_outer_goes_on(nats_server, services):
    """A malformed upload is counted by reason, copied with the reason to the dead-letter
    subject, terminated (never redelivered, also not after an outer crash) and the next good
    upload is applied."""
    job = "poison"
    poison = b"\x93not an envelope" * 100
    start_outer(services, nats_server.url, job, "outer", 3)
    wait_for(lambda: outer_running(nats_server.url, job), 120, "outer")

    async def publish(blob: bytes, unit: int, round_: int) -> None:
        nc = await connect(NatsSettings(nats_url=nats_server.url), "poisoner")
        js = nc.jetstream()
        await publish_blob(
            js, subjects.grads_subject(job, unit, 0), blob, upload_id(job, unit, round_, 0), 4096
        )
        await nc.close()

    asyncio.run(publish(poison, 0, 0))
    wait_for(
        lambda: (
            (status := outer_status(nats_server.url, job)) is not None
            and status.rejected == {"bad_envelope": 1}
        ),
        60,
        "the poison upload to be rejected",
    )
    asyncio.run(publish(upload_blob(job, 1, 0, base=0, seed=1), 1, 0))
    wait_for(lambda: outer_applied(nats_server.url, job) == 1, 60, "a good upload")

    async def dead_letters() -> tuple[list, int]:
        nc = await connect(NatsSettings(nats_url=nats_server.url), "dead-reader")
        js = nc.jetstream()
        sub = await js.pull_subscribe(subjects.dead_letter_subject(job), durable=None)
        msgs = []
        with contextlib.suppress(Exception):
            msgs = await sub.fetch(100, timeout=2)
        grads = await js.stream_info(subjects.GRADS_STREAM)
        await nc.close()
        return msgs, grads.state.messages

    msgs, left = asyncio.run(dead_letters())
    assert left == 0, "the poison chunks must be terminated, not left for redelivery"
    assert b"".join(m.data for m in msgs) == poison
    assert all("bad_envelope" in m.headers["Diloco-Reason"] for m in msgs)
    assert {m.headers["Diloco-Subject"] for m in msgs} == {subjects.grads_subject(job, 0, 0)}
    status = outer_status(nats_server.url, job)
    assert status is not None
    assert status.rejected_rounds == {0: [(0, 0)]} and status.applied_rounds == {1: [(0, 0)]}


# --------------------------------------------------------------------------- a hostile unit


def _hostile(job: str, round_: int, base: int, **changes) -> tuple[bytes, str]:
    """Unit 0's upload of ``round_`` with the envelope fields ``changes`` replaced (``scale``:
    the noise's standard deviation; ``cut``: one tensor cut to a single column)."""
    scale, cut = changes.pop("scale", 1e-3), changes.pop("cut", False)
    envelope = unpack_envelope(upload_blob(job, 0, round_, base, 200 + round_, scale))
    if cut:
        tensors = codec.decode_tensors(envelope.payload, envelope.codec)
        name = sorted(tensors)[0]
        payload, description = codec.encode_tensors(
            {**tensors, name: tensors[name][..., :1]}, "int8"
        )
        changes.update(payload=payload, codec=description)
    blob = pack_envelope(dataclasses.replace(envelope, **changes))
    return blob, upload_id(job, 0, round_, 0)


@pytest.mark.timeout(300)
def test_hostile_uploads_from_a_valid_unit_are_rejected_and_honest_rounds_go_on(
    tmp_path, services, request
):
    """Unit 0, connected with its own valid credentials, sends every hostile upload of the
    security review through the wire format: one 1000x the usual norm with staleness 0 (issue
    16: it must not replace the model), tokens of 2^63 - 1, another unit's id, a base version
    from the future, a tensor of the wrong shape, and chunks that are not an upload (NaN and
    Inf cannot even be decoded: tests/test_codec.py). Each is rejected with its reason;
    the outer stays alive, the held-out loss moves by less than 1%, honest rounds of the other
    units are applied, and the books stay bounded (only the job's units appear in them)."""
    job, honest = "hostile", 12
    units = [Identity("learner", job, unit=u) for u in range(3)]
    secure = SecureNats(tmp_path / "secure", [Identity("outer", job), *units])

    def stop() -> None:  # the services first, so that none waits for the server at its end
        services.stop_all()
        secure.server.stop()

    request.addfinalizer(stop)
    url, admin = secure.url, secure.path(Identity("admin"))
    publish_uploads(url, job, honest, secure=secure)  # units 0-2, rounds 0-3, "usual" norm
    outer = start_outer(services, url, job, "outer", 3, env=secure.env(Identity("outer", job)))

    def status() -> OuterStatus | None:
        return read_status(url, job, admin)[0]

    def evaluated(version: int) -> float | None:
        last = (s := status()) is not None and s.evaluation.last
        return last.nats_per_byte if last and last.version == version else None

    before = wait_for(lambda: evaluated(honest), 120, "the honest uploads applied and evaluated")
    hostile = [
        _hostile(job, 4, honest, scale=1.0),  # 1000x the usual norm
        _hostile(job, 5, honest, tokens=(1 << 63) - 1),
        _hostile(job, 6, honest, unit=1),  # says it is unit 1, on unit 0's subject
        _hostile(job, 7, 10**9),  # a base version from the future
        _hostile(job, 8, honest, cut=True),  # a tensor of the wrong shape
    ]

    async def send() -> None:
        nc = await connect(secure.settings(units[0]), "hostile-unit-0")
        js = nc.jetstream()
        subject = subjects.grads_subject(job, 0, 0)
        for blob, upload in hostile:
            await publish_blob(js, subject, blob, upload, 4096)
        await js.publish(subject, b"not a chunk", timeout=5)  # no chunk headers
        garbage = b"\x93junk" * 100  # chunk headers of round 9, a body that is no envelope
        await publish_blob(js, subject, garbage, upload_id(job, 0, 9, 0), 4096)
        await nc.close()

    asyncio.run(send())
    reasons = {
        "norm_outlier": 1,
        "implausible_work": 1,
        "inconsistent_ids": 1,
        "future_base_version": 1,
        "shape_mismatch": 1,
        "bad_chunk_header": 1,
        "bad_envelope": 1,
    }
    wait_for(lambda: (s := status()) and s.rejected == reasons, 60, f"rejections {reasons}")
    publish_uploads(url, job, 2, first=honest + 1, secure=secure)  # units 1 and 2, round 4
    after = wait_for(lambda: evaluated(honest + 2), 120, "the next honest uploads evaluated")
    final = status()
    assert final is not None and outer.poll() is None, services.log("outer")
    assert final.rejected == reasons and final.applied == honest + 2 and final.clipped == 0
    assert set(final.rejected_rounds) == {0} and set(final.units) <= {0, 1, 2}, final
    assert abs(after - before) < 0.01 * before, (before, after)
