"""Containers as the controller's children, through the Docker SDK (the ``docker`` package).

:class:`ContainerLauncher` is a ``services.orchestration.children.Launch``: where ``diloco up``
starts a ``diloco <service>`` process, the controller starts a container of the same image with that
command line. The container it returns answers what the supervisor asks of a process (``poll``,
``send_signal``, ``kill``, ``wait``, ``pid``), so ``Child``, ``Supervisor`` and ``reconcile`` work
on containers unchanged.

Each job container is made like the controller's own (its image, network and the volumes it
mounts, but the secrets volume), named ``<project>-<child>`` and labelled with the compose
project, so that ``docker compose down --remove-orphans`` would find one left behind. A file that
an environment variable of :data:`COPIED_FILES` names is copied into the container before it
starts (the container's own NATS credentials and the CA), readable by the container's user
only: no job container sees another's password or the secrets volume.

Every call of the engine may raise one of :data:`ENGINE_ERRORS`: ``docker.errors.APIError`` when
the engine refused it (its HTTP status is ``status_code``), a ``requests`` error when the engine
did not answer (connection refused, timed out).
"""

from __future__ import annotations

import contextlib
import io
import re
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
import requests
from docker.models.containers import Container as DockerContainer
from docker.types import Healthcheck, Mount

API_VERSION = "1.41"  # Docker 20.10 and newer
REQUEST_TIMEOUT_S = 60  # any one call of the engine
#: What a call of the engine may raise (see the module's docstring).
ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)
#: Environment variables that name a file the container gets a copy of, and where it goes.
COPIED_FILES = {
    "DILOCO_NATS_CREDENTIALS": "nats/credentials.json",
    "DILOCO_NATS_CA_FILE": "nats/ca.pem",
}
HOME = "/home/diloco"  # the image's user's home: the copied files go below it
USER_ID = 10001  # the image's user (Dockerfile)
STOP_TIMEOUT_S = 30  # docker stop's grace before SIGKILL: learners upload what they have
POLL_EVERY_S = 0.5  # how often a state read may ask the engine (the supervisor polls often)
#: A job container whose environment names a liveness file (``shared.liveness``) gets a health
#: check on it: unhealthy once the file is older than HEALTH_MAX_AGE_S (after a start period
#: for imports and compilation).
LIVENESS_VARIABLE = "DILOCO_LIVENESS_FILE"
HEALTH_MAX_AGE_S = 30
HEALTH_START_S = 180
NANOSECONDS = 1_000_000_000
KILLED = 137  # the exit code of a container that is gone: killed (128 + SIGKILL)
NOT_FOUND, CONFLICT = 404, 409
PROJECT_LABEL = "com.docker.compose.project"
CHILD_LABEL = "io.decoupled-diloco.child"  # the child's name (``<job>/learner-1``)


class TemplateError(RuntimeError):
    """The controller's own container cannot serve as the job containers' template."""


def engine_client(socket: str) -> docker.DockerClient:
    """A client of the Docker engine on the Unix socket ``socket`` (no call is made yet)."""
    return docker.DockerClient(
        base_url=f"unix://{socket}", version=API_VERSION, timeout=REQUEST_TIMEOUT_S
    )


def remove_container(client: docker.DockerClient, name: str) -> None:
    """Remove a container, running or not (``docker rm -f``); one that does not exist is fine."""
    with contextlib.suppress(docker.errors.NotFound):
        client.api.remove_container(name, force=True)


@dataclass(frozen=True)
class Template:
    """What every job container shares with the controller's own container."""

    project: str
    image: str
    network: str
    mounts: tuple[Mount, ...]

    @classmethod
    def of(cls, client: docker.DockerClient, container: str, skip_targets: set[str]) -> Template:
        """The template of the container ``container`` (the controller's own): its image, first
        network and volumes, but those mounted at ``skip_targets``.

        Raises:
            TemplateError: the container is on no network.
        """
        own = client.containers.get(container)
        networks = list(own.attrs["NetworkSettings"]["Networks"])
        if not networks:
            raise TemplateError(
                f"container {container} is on no network: run the controller as a service of "
                "docker-compose.yml, whose network the job containers join"
            )
        mounts = tuple(
            Mount(target=m["Destination"], source=m["Name"], type="volume")
            for m in own.attrs["Mounts"]
            if m["Type"] == "volume" and m["Destination"] not in skip_targets
        )
        project = own.labels.get(PROJECT_LABEL, "diloco")
        return cls(project, own.attrs["Image"], networks[0], mounts)  # the very image, by id


def container_name(project: str, log_path: Path) -> str:
    """The container of a child: ``<project>-<child>`` (``diloco-demo-learner-1``), from the
    child's log name, which names it uniquely."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{project}-{log_path.stem}")


def _archive(files: dict[str, bytes]) -> bytes:
    """A tar of ``files`` (path below :data:`HOME` → contents), owned by the image's user,
    mode 0600 (folders 0700)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        folders = sorted({str(Path(p).parent) for p in files} - {"."})
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o700, USER_ID, USER_ID
            tar.addfile(info)
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.uid, info.gid = len(data), 0o600, USER_ID, USER_ID
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _health_check(liveness_file: str) -> Healthcheck:
    """Unhealthy once ``liveness_file`` is older than :data:`HEALTH_MAX_AGE_S`."""
    return Healthcheck(
        test=["CMD", "python", "-m", "shared.liveness", liveness_file, str(HEALTH_MAX_AGE_S)],
        interval=5 * NANOSECONDS,
        timeout=5 * NANOSECONDS,
        retries=3,
        start_period=HEALTH_START_S * NANOSECONDS,
    )


@dataclass
class Container:
    """A running job container, seen as a process (``subprocess.Popen``'s methods the
    supervisor uses)."""

    handle: DockerContainer
    pid: int  # its main process on the engine's host, when it started
    returncode: int | None = None
    _polled: float = field(default=0.0, repr=False)

    @property
    def name(self) -> str:
        """The container's name."""
        return self.handle.name

    def poll(self) -> int | None:
        """The container's exit code once it stopped, else None (asks the engine at most every
        :data:`POLL_EVERY_S`). A container that is gone counts as killed (:data:`KILLED`)."""
        if self.returncode is not None or time.monotonic() - self._polled < POLL_EVERY_S:
            return self.returncode
        self._polled = time.monotonic()
        try:
            self.handle.reload()
        except docker.errors.NotFound:
            self.returncode = KILLED
            return self.returncode
        except ENGINE_ERRORS:
            return None  # the engine is busy: ask again later
        state = self.handle.attrs["State"]
        if state["Running"] or state["Status"] in ("created", "restarting"):
            return None
        self.returncode = int(state["ExitCode"])
        return self.returncode

    def unhealthy(self) -> bool:
        """Whether it runs but its health check fails (as of the last poll)."""
        return self.returncode is None and self.handle.health == "unhealthy"

    def send_signal(self, sig: int) -> None:
        """Signal the container's main process; one that is gone or stopped is fine."""
        try:
            self.handle.kill(signal=signal.Signals(sig).name)
        except docker.errors.APIError as err:
            if err.status_code not in (NOT_FOUND, CONFLICT):  # gone, or not running
                raise

    def kill(self) -> None:
        """SIGKILL the container."""
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the container to stop; ``subprocess.TimeoutExpired`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._polled = 0.0
            code = self.poll()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
            time.sleep(POLL_EVERY_S)

    def log_tail(self, lines: int) -> str:
        """The last ``lines`` lines of the container's output (``docker logs --tail``)."""
        return self.handle.logs(tail=lines).decode(errors="replace")


@dataclass
class ContainerLauncher:
    """Starts ``diloco <args>`` as a job container (a
    ``services.orchestration.children.Launch``)."""

    client: docker.DockerClient
    template: Template

    def __call__(self, args: list[str], env: dict[str, str], log_path: Path) -> Container:
        """Start a container for the child whose log is ``log_path`` (an earlier container of
        that child is removed first); a line naming it goes into the log."""
        name = container_name(self.template.project, log_path)
        environment = dict(env)
        files = {}
        for variable, target in COPIED_FILES.items():
            if variable in environment:
                files[target] = Path(environment[variable]).read_bytes()
                environment[variable] = f"{HOME}/{target}"
        remove_container(self.client, name)
        api = self.client.api
        # The low-level call: the SDK's containers.create() has no stop_timeout.
        created = api.create_container(
            self.template.image,
            command=list(args),
            name=name,
            environment=environment,
            labels={PROJECT_LABEL: self.template.project, CHILD_LABEL: log_path.stem},
            stop_timeout=STOP_TIMEOUT_S,
            healthcheck=(
                _health_check(environment[LIVENESS_VARIABLE])
                if LIVENESS_VARIABLE in environment
                else None
            ),
            host_config=api.create_host_config(
                mounts=list(self.template.mounts), network_mode=self.template.network, init=True
            ),
            use_config_proxy=False,  # the environment is exactly ``env``
        )
        handle = self.client.containers.get(created["Id"])
        if files:
            handle.put_archive(HOME, _archive(files))
        handle.start()
        handle.reload()
        with open(log_path, "a") as log:
            log.write(f"container {name} started (docker logs {name})\n")
        return Container(handle, pid=int(handle.attrs["State"]["Pid"]))


def remove_children(client: docker.DockerClient, project: str) -> list[str]:
    """Stop (SIGTERM: learners upload what they have, within :data:`STOP_TIMEOUT_S`) and
    remove every job container of ``project``, left by a controller that was killed; returns
    their names."""
    found = client.containers.list(
        all=True,
        filters={"label": [f"{PROJECT_LABEL}={project}", CHILD_LABEL]},
        ignore_removed=True,
    )
    left = [Container(handle, pid=0) for handle in found]
    running = [container for container in left if container.handle.attrs["State"]["Running"]]
    for container in running:
        container.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for container in running:
        with contextlib.suppress(subprocess.TimeoutExpired):  # then removed by force
            container.wait(max(0.0, deadline - time.monotonic()))
    for container in left:
        remove_container(client, container.name)
    return [container.name for container in left]
