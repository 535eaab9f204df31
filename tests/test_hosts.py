"""Hosts, not processes: the three broker nodes, the two outer shards and each learner run in
network namespaces of their own, joined by veth links to one switch (a bridge in a namespace of its
own), each learner's link shaped by ``tc`` in both directions. Every process connects as its own
NATS user over TLS (the broker's certificate names the nodes' addresses), to every node's
address, and the brokers' routes are mutual TLS with the routes password; nothing reaches
another host but over those links. This is as close as one machine
gets to separate machines (docs/RELIABILITY.md, "Hosts, not processes").

Needs root and a kernel that allows network namespaces (``ip netns``) with ``tc``'s ``tbf``;
elsewhere the test is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared import ledger
from shared.job_status import JobStatus, read_job_status
from shared.nats_auth import Credentials, Identity
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from tests.helpers import wait_for

pytestmark = pytest.mark.slow  # real processes, namespaces and nats-server (run by make test)

SUBNET = "10.213.7"  # the switch's /24: brokers .1-.3, outer shards .10+, learners .20+, tests .254
SHARDS = 2  # outer shards, each on its host, owning one of the job's two fragments
LINK_RATE = "20mbit"  # each learner's link, each direction
JOB, UNITS, STEPS = "hosts", 2, 150
# Creates the streams and buckets as the admin, with three replicas, once the cluster has
# elected its metadata leader.
CREATE_STREAMS = """
import asyncio, sys
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams
async def main():
    nc = await connect(NatsSettings(), "stream-creator")
    await ensure_streams(nc.jetstream(), 3)
    await nc.close()
for attempt in range(60):
    try:
        asyncio.run(main())
        break
    except Exception as err:
        print("retrying:", repr(err), flush=True)
        import time; time.sleep(1)
else:
    sys.exit(1)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_problem() -> str | None:
    """Why this machine cannot run the test (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "no ip or tc command (Debian: apt-get install iproute2)"
    probe = f"dlprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"the kernel refuses a network namespace: {made.stderr.strip()}"
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", LINK_RATE, "burst", "32kb", "latency", "50ms"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if done.returncode != 0:
            return f"tc tbf is not available: {done.stderr.strip()}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


@dataclass
class Network:
    """Namespaces on one switch: ``add(name, host)`` makes namespace ``<prefix><name>`` with
    the address ``SUBNET.<host>`` on its ``eth0``, linked to the switch by a veth pair."""

    prefix: str
    namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.switch = self._namespace("sw")
        self._run(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._run(self.switch, "ip", "link", "set", "br0", "up")

    def _namespace(self, name: str) -> str:
        namespace = f"{self.prefix}{name}"
        _ip("netns", "add", namespace)
        self.namespaces.append(namespace)
        self._run(namespace, "ip", "link", "set", "lo", "up")
        return namespace

    def _run(self, namespace: str, *command: str) -> str:
        return subprocess.run(
            ["ip", "netns", "exec", namespace, *command],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout

    def add(self, name: str, host: int, rate: str | None = None) -> str:
        """A host on the switch (``rate``: its link shaped to that, both ways); returns its
        namespace."""
        namespace = self._namespace(name)
        outside = f"{self.prefix[:6]}{name}"[:15]  # the switch's end of the link
        _ip("link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", outside,
            "netns", self.switch)  # fmt: skip
        self._run(self.switch, "ip", "link", "set", outside, "master", "br0", "up")
        self._run(namespace, "ip", "addr", "add", f"{SUBNET}.{host}/24", "dev", "eth0")
        self._run(namespace, "ip", "link", "set", "eth0", "up")
        if rate is not None:
            shape = ["root", "tbf", "rate", rate, "burst", "32kb", "latency", "100ms"]
            self._run(namespace, "tc", "qdisc", "add", "dev", "eth0", *shape)  # uploads
            self._run(self.switch, "tc", "qdisc", "add", "dev", outside, *shape)  # downloads
        return namespace

    def attach_root(self, host: int) -> None:
        """Give this (the test's own) namespace an address on the switch too, to read the
        job's status as the admin would from a machine of its own."""
        outside = f"{self.prefix[:6]}root"[:15]
        inside = f"{self.prefix[:6]}t"[:15]
        _ip("link", "add", inside, "type", "veth", "peer", "name", outside, "netns", self.switch)
        self._run(self.switch, "ip", "link", "set", outside, "master", "br0", "up")
        _ip("addr", "add", f"{SUBNET}.{host}/24", "dev", inside)
        _ip("link", "set", inside, "up")

    def sent_bytes(self, namespace: str) -> int:
        """Bytes the shaped ``eth0`` of ``namespace`` has sent (its tbf's counter)."""
        out = self._run(namespace, "tc", "-s", "qdisc", "show", "dev", "eth0")
        found = re.search(r"Sent (\d+) bytes", out)
        return int(found.group(1)) if found else 0

    def delete(self) -> None:
        """Delete every namespace (their links go with them)."""
        for namespace in reversed(self.namespaces):
            _ip("netns", "delete", namespace, check=False)


@pytest.fixture
def network() -> Iterator[Network]:
    problem = netns_problem()
    if problem is not None:
        pytest.skip(f"separate hosts: {problem}")
    made = Network(f"dl{os.getpid() % 100000}")
    try:
        yield made
    finally:
        made.delete()


def _status(settings: NatsSettings) -> JobStatus:
    async def read() -> JobStatus:
        nc = await connect(settings, "test-reader")
        try:
            return await read_job_status(nc, nc.jetstream(), JOB)
        finally:
            await nc.close()

    return asyncio.run(read())


@pytest.mark.timeout(600)
def test_brokers_outer_shards_and_learners_on_separate_hosts_train_over_shaped_tls_links(
    network, services, tmp_path
):
    """Three broker hosts routed into one JetStream cluster (streams and buckets with three
    replicas), two outer-shard hosts (one fragment each) and two learner hosts behind
    20 Mbit/s links: the job trains to the end, the books balance, both shards merged, and
    each learner's uploads crossed its shaped link."""
    secrets = tmp_path / "secrets"
    brokers = [f"{SUBNET}.{host}" for host in (1, 2, 3)]
    routes = ",".join(f"nats-route://{address}:6222" for address in brokers)
    url = ",".join(f"tls://{address}:4222" for address in brokers)
    for index, address in enumerate(brokers):
        namespace = network.add(f"b{index}", index + 1)
        services.start(
            f"broker-{index}",
            "broker",
            *("--secrets-dir", str(secrets), "--store-dir", str(tmp_path / f"store{index}")),
            *("--listen-host", address, "--routes", routes, "--server-name", f"n{index}"),
            *("--server-names", ",".join(brokers), "--poll-s", "0.5"),
            netns=namespace,
        )
        if index == 0:  # it makes the secrets (users, CA, certificate) the others load
            wait_for(lambda: "nats-server ready" in services.log("broker-0"), 60, "broker 0")
    outer_ns = [network.add(f"o{shard}", 10 + shard) for shard in range(SHARDS)]
    learner_ns = [network.add(f"l{unit}", 20 + unit, LINK_RATE) for unit in range(UNITS)]
    network.attach_root(254)
    credentials = Credentials(secrets / "credentials")
    ca = str(secrets / "tls" / "ca.pem")

    def user(who: Identity) -> dict[str, str]:
        path, _ = credentials.ensure(who)  # the brokers load new users within --poll-s
        return {"DILOCO_NATS_CREDENTIALS": str(path), "DILOCO_NATS_CA_FILE": ca}

    admin = user(Identity("admin"))
    created = subprocess.run(
        ["ip", "netns", "exec", outer_ns[0], sys.executable, "-c", CREATE_STREAMS],
        env={**os.environ, **admin, "DILOCO_NATS_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert created.returncode == 0, created.stdout + created.stderr + services.logs()
    job = ["--nats-url", url, "--job", JOB, "--model", "tiny", "--seed", "1"]
    work = ["--num-units", str(UNITS), "--h-steps", "10", "--batch-size", "8"]
    work += ["--fragments", str(SHARDS)]
    for shard in range(SHARDS):
        services.start(
            f"outer-{shard}",
            "outer",
            *job,
            *work,
            *("--learner-steps", str(STEPS), "--eval-every-s", "3"),
            *("--shards", str(SHARDS), "--shard", str(shard)),
            env=user(Identity("outer", JOB)),
            netns=outer_ns[shard],
        )
    learners = [
        services.start(
            f"learner-{unit}",
            "learner",
            *job,
            *work,
            *("--unit", str(unit), "--max-steps", str(STEPS), "--slowdown", "3"),
            *("--checkpoint-dir", str(tmp_path / "units")),
            env=user(Identity("learner", JOB, unit=unit)),
            netns=learner_ns[unit],
        )
        for unit in range(UNITS)
    ]
    reader = NatsSettings(nats_url=url, nats_credentials=admin["DILOCO_NATS_CREDENTIALS"],
                          nats_ca_file=ca)  # fmt: skip
    for learner in learners:
        assert learner.wait(timeout=400) == 0, services.logs()

    def balanced() -> ledger.Books | None:
        status = _status(reader)
        books = ledger.balance(status.outer_record(), status.unit_records())
        return books if books.balanced and books.published >= 2 * STEPS // 10 else None

    books = wait_for(balanced, 120, "the outer to apply every published round", interval_s=1)
    status = _status(reader)
    outer = status.outer_record()
    assert outer is not None and outer.evaluation.last is not None
    first, last = outer.evaluation.init, outer.evaluation.last
    assert first is not None and first.nats_per_byte is not None and last.nats_per_byte is not None
    assert last.nats_per_byte < first.nats_per_byte - 1.0, outer.evaluation
    assert outer.shards == SHARDS and min(outer.versions) > 0, outer.versions  # both merged
    sent = {unit: network.sent_bytes(learner_ns[unit]) for unit in range(UNITS)}
    print(f"hosts: books {books}, eval {first.nats_per_byte} -> {last.nats_per_byte}, "
          f"bytes sent over each learner's shaped link {sent}")  # fmt: skip
    uploaded = {
        unit: record.counter("bytes_sent") for unit, record in status.unit_records().items()
    }
    for unit in range(UNITS):
        assert sent[unit] >= uploaded[unit] > 0, (sent, uploaded)
    # The brokers routed to each other (the streams got three replicas) over mutual TLS and
    # with the routes password, which a stranger lacks (tests/test_nats_routes.py).
    for index in range(len(brokers)):
        config = (tmp_path / f"store{index}" / "nats-server.conf").read_text()
        cluster = config[config.index("cluster {") :]
        assert 'user: "route"' in cluster and "verify: true" in cluster, cluster
