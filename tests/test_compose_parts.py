"""The parts of the compose cluster that need no Docker engine: the broker's secrets, users added
to a credentials folder by another process, and the controller's job containers as the Docker SDK
asks a stand-in engine for them (tests/fake_docker.py): how each is made and given its files,
watched, signalled, removed. The cluster itself runs on a real engine in tests/test_compose.py."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import docker.errors
import pytest
from docker.types import Mount

from services.orchestration.compose import docker_api
from services.orchestration.compose.broker import make_secrets, route_secret
from services.orchestration.compose.controller import Controller
from services.orchestration.compose.settings import BrokerSettings, ControllerSettings
from services.orchestration.nats_server import BrokerError, ClusterNode
from shared import liveness, nats_auth
from shared.nats_auth import Credentials, CredentialsError, Identity
from tests.fake_docker import FakeDockerServer
from tests.helpers import REPO, wait_for

ROOT = Path(__file__).resolve().parent.parent


def test_the_broker_makes_the_secrets_once_and_keeps_them(tmp_path: Path) -> None:
    settings = BrokerSettings(secrets_dir=tmp_path, store_dir=tmp_path / "store")
    credentials, files = make_secrets(settings)
    assert files is not None and files.ca_cert.exists()
    token = (tmp_path / "api-token").read_text()
    admin = (tmp_path / "credentials" / "admin.json").read_bytes()
    for path in (tmp_path / "api-token", tmp_path / "credentials" / "gateway.json", files.key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert '"user": "gateway"' in credentials.authorization_block()
    # A restart keeps every secret: connected clients and the token stay valid.
    ca = files.ca_cert.read_bytes()
    again, files_again = make_secrets(settings)
    assert (tmp_path / "api-token").read_text() == token
    assert (tmp_path / "credentials" / "admin.json").read_bytes() == admin
    assert files_again is not None and files_again.ca_cert.read_bytes() == ca
    assert again.authorization_block().count('"user"') == 2
    assert make_secrets(settings.model_copy(update={"tls": False}))[1] is None


def test_the_first_node_makes_the_routes_secret_and_the_others_read_it(tmp_path: Path) -> None:
    secret = route_secret(tmp_path)
    assert stat.S_IMODE((tmp_path / "route-secret").stat().st_mode) == 0o600
    assert route_secret(tmp_path) == secret and len(secret) >= 16
    node = ClusterNode("n1", "0.0.0.0:6222", ("nats-route://nats:6222",), secret)
    assert f'"nats-route://route:{secret}@nats:6222"' in node.block()
    # A secret that would break the configuration (or is too short to be one) is refused.
    for bad in ("short", 'x" }, authorization { user: "a', "a" * 20 + "@evil"):
        (tmp_path / "route-secret").write_text(f"{bad}\n")
        with pytest.raises(BrokerError, match="route secret"):
            ClusterNode("n1", "0.0.0.0:6222", ("nats-route://nats:6222",), route_secret(tmp_path))


def test_users_another_process_adds_are_loaded_and_bad_files_skipped(tmp_path: Path) -> None:
    server_side = Credentials(tmp_path)
    server_side.ensure(Identity("admin"))
    controller = Credentials(tmp_path)
    learner = Identity("learner", "my-job", unit=3)
    path, new = controller.ensure(learner)
    assert new
    assert server_side.load() == (["learner-my-job-3"], [])
    assert "learner-my-job-3" in server_side.authorization_block()
    assert server_side.load() == ([], [])
    # The same identity again (a restarted controller) keeps the file and its password.
    before = path.read_bytes()
    assert Credentials(tmp_path).ensure(learner) == (path, True)
    assert path.read_bytes() == before
    # A file under another user's name, or readable by others, is skipped with the reason.
    (tmp_path / "outer-x.json").write_bytes(before)
    os.chmod(tmp_path / "outer-x.json", 0o600)
    (tmp_path / "gateway.json").write_bytes(b"{}")
    os.chmod(tmp_path / "gateway.json", 0o644)
    added, problems = server_side.load()
    assert added == [] and len(problems) == 2
    assert any("readable by others" in p for p in problems)
    assert any("learner-my-job-3" in p for p in problems)
    with pytest.raises(CredentialsError, match="another identity"):
        Credentials(tmp_path).ensure(Identity("outer", "x"))


def test_diloco_credentials_makes_a_joining_units_user_the_broker_loads(tmp_path: Path) -> None:
    """``diloco credentials`` (README, a unit on another machine): the unit's user is made in
    the secrets folder, where the broker loads it, and its file is printed; asked again, the
    same user; a malformed job name is refused with the reason."""
    broker = make_secrets(BrokerSettings(secrets_dir=tmp_path, tls=False))[0]
    command = [sys.executable, "-m", "services.cli", "credentials", "--secrets-dir", str(tmp_path)]

    def credentials(job: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "--job", job, "--unit", "4"], capture_output=True, text=True, cwd=REPO
        )

    printed = json.loads(credentials("demo").stdout)
    assert (printed["user"], printed["role"], printed["unit"]) == ("learner-demo-4", "learner", 4)
    assert broker.load() == (["learner-demo-4"], [])
    assert json.loads(credentials("demo").stdout) == printed
    refused = credentials("no job")
    assert refused.returncode == 2 and "--job" in refused.stderr


def test_a_credentials_file_names_its_identity() -> None:
    who = Identity("link", "j-1", link="0")
    assert nats_auth.identity_of(nats_auth.new_credentials(who)) == who
    forged = nats_auth.new_credentials(who).model_copy(update={"user": "admin"})
    with pytest.raises(CredentialsError, match="another identity"):
        nats_auth.identity_of(forged)


@pytest.fixture
def engine() -> Iterator[FakeDockerServer]:
    """A stand-in Docker engine on a Unix socket (tests/fake_docker.py), with the controller's
    own container: on the project's network, with the secrets, units and socket mounted."""
    folder = Path(tempfile.mkdtemp(prefix="docker-", dir="/tmp"))  # a socket path is short
    server = FakeDockerServer(folder / "docker.sock")
    volume = {"Type": "volume", "Driver": "local"}
    server.engine.add(
        "controller",
        Image="sha256:" + "c" * 64,
        Config={"Labels": {docker_api.PROJECT_LABEL: "diloco"}, "Tty": False},
        NetworkSettings={"Networks": {"diloco_default": {}}},
        Mounts=[
            {**volume, "Name": "diloco_secrets", "Destination": "/secrets"},
            {**volume, "Name": "diloco_units", "Destination": "/units"},
            {"Type": "bind", "Source": "/var/run/docker.sock", "Destination": "/var/run/x"},
        ],
    )
    yield server
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


def _launcher(server: FakeDockerServer) -> docker_api.ContainerLauncher:
    client = docker_api.engine_client(str(server.socket))
    template = docker_api.Template.of(client, "controller", skip_targets={"/secrets"})
    return docker_api.ContainerLauncher(client, template)


def test_a_job_container_is_named_after_its_child() -> None:
    assert docker_api.container_name("diloco", Path("/logs/demo-learner-1.log")) == (
        "diloco-demo-learner-1"
    )


def test_a_job_container_is_made_like_the_controllers_and_gets_only_its_files(
    engine: FakeDockerServer, tmp_path: Path
) -> None:
    launch = _launcher(engine)
    assert launch.template == docker_api.Template(
        "diloco",
        "sha256:" + "c" * 64,
        "diloco_default",
        (Mount(target="/units", source="diloco_units", type="volume"),),
    )
    (tmp_path / "learner.json").write_bytes(b"secret")
    (tmp_path / "ca.pem").write_bytes(b"ca")
    env = {
        "DILOCO_NATS_CREDENTIALS": str(tmp_path / "learner.json"),
        "DILOCO_NATS_CA_FILE": str(tmp_path / "ca.pem"),
        "DILOCO_LIVENESS_FILE": "/tmp/diloco.alive",
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    }
    log_path = tmp_path / "demo-learner-1.log"
    container = launch(["learner", "--unit", "1"], env, log_path)

    assert container.name == "diloco-demo-learner-1" and container.poll() is None
    (create,) = engine.engine.named("POST", "/containers/create")
    assert create.query == {"name": "diloco-demo-learner-1"}
    body = json.loads(create.body)
    assert (body["Image"], body["Cmd"]) == ("sha256:" + "c" * 64, ["learner", "--unit", "1"])
    assert sorted(body["Env"]) == [
        "DILOCO_LIVENESS_FILE=/tmp/diloco.alive",
        f"DILOCO_NATS_CA_FILE={docker_api.HOME}/nats/ca.pem",
        f"DILOCO_NATS_CREDENTIALS={docker_api.HOME}/nats/credentials.json",
        "XLA_FLAGS=--xla_cpu_multi_thread_eigen=false",
    ]
    assert body["Labels"] == {
        docker_api.PROJECT_LABEL: "diloco",
        docker_api.CHILD_LABEL: "demo-learner-1",
    }
    assert body["StopTimeout"] == docker_api.STOP_TIMEOUT_S
    assert body["Healthcheck"]["Test"] == [
        *("CMD", "python", "-m", "shared.liveness", "/tmp/diloco.alive"),
        str(docker_api.HEALTH_MAX_AGE_S),
    ]
    assert body["Healthcheck"]["StartPeriod"] == docker_api.HEALTH_START_S * 10**9
    host = body["HostConfig"]
    assert (host["NetworkMode"], host["Init"]) == ("diloco_default", True)
    assert [(m["Source"], m["Target"]) for m in host["Mounts"]] == [("diloco_units", "/units")]
    # The files go in before the start: only its own, readable by the image's user only.
    verbs = [r.path.rsplit("/", 1)[-1] for r in engine.engine.requests]
    assert verbs.index("archive") < verbs.index("start")
    ((target, archive),) = engine.engine.archives["diloco-demo-learner-1"]
    assert target == docker_api.HOME
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {"nats", "nats/credentials.json", "nats/ca.pem"}
        assert members["nats"].isdir() and members["nats"].mode == 0o700
        secret = members["nats/credentials.json"]
        assert (secret.mode, secret.uid, secret.gid) == (0o600, 10001, 10001)  # Dockerfile's
        assert tar.extractfile(secret).read() == b"secret"
    assert "container diloco-demo-learner-1 started" in log_path.read_text()
    # Started again, the child's earlier container is removed first.
    again = launch(["learner", "--unit", "1"], env, log_path)
    assert again.handle.id != container.handle.id
    assert engine.engine.named("DELETE", "/containers/diloco-demo-learner-1")
    assert container.wait(timeout=5) == docker_api.KILLED  # the first one is gone


def test_a_job_container_answers_like_a_process(engine: FakeDockerServer, tmp_path: Path) -> None:
    container = _launcher(engine)(["outer"], {}, tmp_path / "demo-outer.log")
    assert container.pid > 0 and container.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        container.wait(timeout=0.1)
    # A failing health check shows at the next poll; the engine's log can be read back.
    engine.engine.find(container.name)["State"]["Health"] = {"Status": "unhealthy"}
    wait_for(
        lambda: container.poll() is None and container.unhealthy(),
        5,
        "a poll to ask the engine",
        interval_s=0.05,
    )
    engine.engine.logs[container.name] = b"step 1\nThread 0x7f (most recent call first):\n"
    assert container.log_tail(2).endswith("(most recent call first):\n")
    (logs,) = engine.engine.named("GET", f"/containers/{container.handle.id}/logs")
    assert logs.query["tail"] == "2"
    container.send_signal(signal.SIGUSR1)  # its stacks; it runs on
    assert container.poll() is None
    container.kill()
    assert container.wait(timeout=5) == 137 and not container.unhealthy()
    container.send_signal(signal.SIGTERM)  # not running any more: fine
    kills = engine.engine.named("POST", f"/containers/{container.handle.id}/kill")
    assert [r.query["signal"] for r in kills] == ["SIGUSR1", "SIGKILL", "SIGTERM"]


def test_an_engine_error_keeps_its_http_status(engine: FakeDockerServer, tmp_path: Path) -> None:
    container = _launcher(engine)(["outer"], {}, tmp_path / "demo-outer.log")
    engine.engine.refuse[("POST", "kill")] = 500
    with pytest.raises(docker.errors.APIError) as refused:
        container.send_signal(signal.SIGTERM)
    assert refused.value.status_code == 500
    # A poll the engine cannot answer is tried again later; a removed container was killed.
    engine.engine.refuse[("GET", "json")] = 500
    reads = len(engine.engine.requests)
    wait_for(
        lambda: container.poll() is None and len(engine.engine.requests) > reads,
        5,
        "a poll the engine refuses",
        interval_s=0.05,
    )
    assert container.poll() is None
    del engine.engine.refuse[("GET", "json")]
    docker_api.remove_container(container.handle.client, container.name)
    docker_api.remove_container(container.handle.client, container.name)  # gone: fine
    assert container.wait(timeout=5) == docker_api.KILLED
    # No engine at all: the requests error is one of ENGINE_ERRORS.
    nowhere = docker_api.engine_client(str(tmp_path / "no-engine.sock"))
    with pytest.raises(docker_api.ENGINE_ERRORS):
        docker_api.Template.of(nowhere, "controller", skip_targets=set())


def test_a_controller_off_any_network_is_refused(engine: FakeDockerServer) -> None:
    engine.engine.add("alone")
    client = docker_api.engine_client(str(engine.socket))
    with pytest.raises(docker_api.TemplateError, match="on no network"):
        docker_api.Template.of(client, "alone", skip_targets=set())


def test_the_job_containers_a_dead_controller_left_are_stopped_and_removed(
    engine: FakeDockerServer,
) -> None:
    labels = {docker_api.PROJECT_LABEL: "diloco", docker_api.CHILD_LABEL: "demo-outer"}
    running = {"Status": "running", "Running": True, "ExitCode": 0, "Pid": 7}
    engine.engine.add("diloco-demo-outer", Config={"Labels": labels}, State=running)
    # Made but never started (its controller died in between): nothing to wait for.
    engine.engine.add("diloco-demo-learner-0", Config={"Labels": labels})
    other = {**labels, docker_api.PROJECT_LABEL: "other"}
    engine.engine.add("other-demo-outer", Config={"Labels": other}, State=dict(running))
    client = docker_api.engine_client(str(engine.socket))
    removed = docker_api.remove_children(client, "diloco")
    assert sorted(removed) == ["diloco-demo-learner-0", "diloco-demo-outer"]
    names = {c["Name"] for c in engine.engine.containers.values()}
    assert names == {"/controller", "/other-demo-outer"}  # another project's, not a child
    kills = engine.engine.requests
    assert [r.query["signal"] for r in kills if r.path.endswith("/kill")] == ["SIGTERM"]


def test_a_hung_containers_stacks_go_into_the_controllers_log(
    engine: FakeDockerServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = ControllerSettings(secrets_dir=tmp_path / "secrets")
    controller = Controller(settings, _launcher(engine), tmp_path / "logs")
    controller._start("demo/learner-0", ["learner"], {}, may_finish=True)
    name = "diloco-demo-learner-0"
    engine.engine.find(name)["State"]["Health"] = {"Status": "unhealthy"}
    engine.engine.logs[name] = b'Thread 0x7f (most recent call first):\n  File "learner.py"\n'
    container = controller.children["demo/learner-0"].process
    wait_for(lambda: container.poll() is None and container.unhealthy(), 5, "the next poll")
    with caplog.at_level(logging.WARNING, logger="diloco.controller"):
        controller.heal()
    assert "demo/learner-0 is unhealthy" in caplog.text
    assert 'most recent call first):\n  File "learner.py"' in caplog.text
    kills = engine.engine.requests
    assert [r.query["signal"] for r in kills if r.path.endswith("/kill")] == [
        "SIGUSR1",
        "SIGKILL",
    ]


def _print_mirror(apt_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``docker/base-image.sh --print-mirror`` with apt's sources read from ``apt_dir``."""
    return subprocess.run(
        ["bash", str(ROOT / "docker" / "base-image.sh"), "--print-mirror"],
        env={"PATH": os.environ["PATH"], "APT_DIR": str(apt_dir), **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_base_image_takes_its_debian_archive_from_apts_sources(tmp_path: Path) -> None:
    sources = tmp_path / "sources.list.d"
    sources.mkdir()
    missing = _print_mirror(tmp_path)
    assert missing.returncode == 1 and "DEBIAN_MIRROR=" in missing.stderr, missing
    # deb822: a disabled stanza, source packages, another suite, then bookworm's, with a
    # comment and a value that goes on over two lines.
    (sources / "debian.sources").write_text(
        "Types: deb\nURIs: http://disabled.example/debian\nSuites: bookworm\nEnabled: no\n\n"
        "Types: deb-src\nURIs: http://sources.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\n\n"
        "# the main archive\nTypes: deb\nURIs:\n http://archive.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert _print_mirror(tmp_path).stdout == "http://archive.example/debian\n"
    # The one-line format, options in brackets; sources.list is read first.
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] https://one.example/debian "
        "bookworm main\n"
    )
    assert _print_mirror(tmp_path).stdout == "https://one.example/debian\n"
    assert _print_mirror(tmp_path, DEBIAN_MIRROR="http://mine.example/debian").stdout == (
        "http://mine.example/debian\n"
    )


def test_no_registry_or_mirror_host_is_written_in_the_build_scripts() -> None:
    scripts = [ROOT / "Dockerfile", ROOT / "docker-compose.yml", ROOT / "Makefile"]
    scripts += sorted((ROOT / "docker").glob("*.sh"))
    hosts = re.compile(r"deb\.debian\.org|pypi\.org|pythonhosted|docker\.io/|ghcr\.io|quay\.io")
    found = [
        f"{path.name}: {m.group()}" for path in scripts for m in hosts.finditer(path.read_text())
    ]
    assert not found, found


def test_the_controllers_link_option_is_checked_at_start() -> None:
    assert ControllerSettings(link="20mbit/40ms").link == "20mbit/40ms"
    with pytest.raises(ValueError, match="expected a rate"):
        ControllerSettings(link="fast")


def test_the_liveness_check_follows_the_files_age(tmp_path: Path, capsys) -> None:
    alive = tmp_path / "alive"
    assert liveness.main([str(alive), "30"]) == 1  # not touched yet
    liveness.mark(str(alive))
    assert liveness.main([str(alive), "30"]) == 0
    old = alive.stat().st_mtime - 60
    os.utime(alive, (old, old))
    assert liveness.main([str(alive), "30"]) == 1
    assert "s old" in capsys.readouterr().err
    liveness.mark(None)  # no file: nothing to do
    liveness.mark(str(tmp_path / "missing" / "alive"))  # logged, not raised
    assert liveness.main([]) == 2
