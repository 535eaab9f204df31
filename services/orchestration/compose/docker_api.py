"""Containers as the controller's children: the Docker Engine API over its Unix socket.

:class:`ContainerLauncher` is a ``services.orchestration.children.Launch``: where ``diloco up``
starts a ``diloco <service>`` process, the controller starts a container of the same image with that
command line. The container it returns answers what the supervisor asks of a process (``poll``,
``send_signal``, ``kill``, ``wait``, ``pid``), so ``Child``, ``Supervisor`` and ``reconcile`` work
on containers unchanged.

Each job container is made like the controller's own (its image, networks and the volumes it
mounts, but the secrets volume), named ``<project>-<child>`` and labelled with the compose
project, so that ``docker compose down --remove-orphans`` would find one left behind. A file that
an environment variable of :data:`COPIED_FILES` names is copied into the container before it
starts (the container's own NATS credentials and the CA), readable by the container's user
only: no job container sees another's password or the secrets volume.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

API = "http://docker/v1.41"  # Docker 20.10 and newer
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
NOT_FOUND, CONFLICT = 404, 409
PROJECT_LABEL = "com.docker.compose.project"
CHILD_LABEL = "io.decoupled-diloco.child"  # the child's name (``<job>/learner-1``)


class DockerError(RuntimeError):
    """The Docker Engine API refused a request (``status``: its HTTP status) or cannot be
    reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class DockerApi:
    """A small client of the Docker Engine API on a Unix socket."""

    socket: str
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), timeout=60.0)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One API call; returns the decoded JSON body (None when empty).

        Raises:
            DockerError: the engine answered with an error or cannot be reached.
        """
        try:
            response = self.client.request(method, API + path, **kwargs)
        except httpx.HTTPError as err:
            raise DockerError(f"{method} {path}: {err}") from err
        if response.status_code >= 400:
            raise DockerError(
                f"{method} {path}: {response.status_code} {response.text.strip()}",
                response.status_code,
            )
        return response.json() if response.content else None

    def inspect(self, container: str) -> dict[str, Any]:
        """``docker inspect`` of one container."""
        return self.request("GET", f"/containers/{container}/json")

    def remove(self, container: str) -> None:
        """Remove a container, running or not; one that does not exist is fine."""
        try:
            self.request("DELETE", f"/containers/{container}", params={"force": "true"})
        except DockerError as err:
            if err.status != NOT_FOUND:
                raise

    def signal(self, container: str, sig: int) -> None:
        """Send ``sig`` to the container's main process; one that is not running is fine."""
        try:
            self.request(
                "POST", f"/containers/{container}/kill", params={"signal": signal.Signals(sig).name}
            )
        except DockerError as err:
            if err.status not in (NOT_FOUND, CONFLICT):  # gone, or not running
                raise


@dataclass(frozen=True)
class Template:
    """What every job container shares with the controller's own container."""

    project: str
    image: str
    network: str
    mounts: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, api: DockerApi, container: str, skip_targets: set[str]) -> Template:
        """The template of the container ``container`` (the controller's own): its image, first
        network and volumes, but those mounted at ``skip_targets``."""
        info = api.inspect(container)
        networks = list(info["NetworkSettings"]["Networks"])
        if not networks:
            raise DockerError(f"container {container} is on no network")
        mounts = tuple(
            {"Type": "volume", "Source": m["Name"], "Target": m["Destination"]}
            for m in info["Mounts"]
            if m["Type"] == "volume" and m["Destination"] not in skip_targets
        )
        project = info["Config"]["Labels"].get(PROJECT_LABEL, "diloco")
        return cls(project, info["Image"], networks[0], mounts)  # the very image, by id


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


@dataclass
class Container:
    """A running job container, seen as a process (``subprocess.Popen``'s methods the
    supervisor uses)."""

    api: DockerApi
    name: str
    pid: int
    returncode: int | None = None
    health: str | None = None  # Docker's health status, for a container with a health check
    _polled: float = 0.0

    def poll(self) -> int | None:
        """The container's exit code once it stopped, else None (asks the engine at most every
        :data:`POLL_EVERY_S`). A container that is gone counts as killed (137)."""
        if self.returncode is not None or time.monotonic() - self._polled < POLL_EVERY_S:
            return self.returncode
        self._polled = time.monotonic()
        try:
            state = self.api.inspect(self.name)["State"]
        except DockerError as err:
            if err.status != NOT_FOUND:
                return None  # the engine is busy: ask again later
            self.returncode = 137
            return self.returncode
        self.health = (state.get("Health") or {}).get("Status")
        if state["Running"] or state["Status"] in ("created", "restarting"):
            return None
        self.returncode = int(state["ExitCode"])
        return self.returncode

    def unhealthy(self) -> bool:
        """Whether it runs but its health check fails (as of the last poll)."""
        return self.returncode is None and self.health == "unhealthy"

    def send_signal(self, sig: int) -> None:
        """Signal the container's main process."""
        self.api.signal(self.name, sig)

    def kill(self) -> None:
        """SIGKILL the container."""
        self.api.signal(self.name, signal.SIGKILL)

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


@dataclass
class ContainerLauncher:
    """Starts ``diloco <args>`` as a job container (a
    ``services.orchestration.children.Launch``)."""

    api: DockerApi
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
        self.api.remove(name)
        body: dict[str, Any] = {
            "Image": self.template.image,
            "Cmd": list(args),
            "Env": [f"{key}={value}" for key, value in environment.items()],
            "Labels": {PROJECT_LABEL: self.template.project, CHILD_LABEL: log_path.stem},
            "StopTimeout": STOP_TIMEOUT_S,
            "HostConfig": {
                "Mounts": list(self.template.mounts),
                "NetworkMode": self.template.network,
                "Init": True,
            },
        }
        if LIVENESS_VARIABLE in environment:
            check = ["python", "-m", "shared.liveness", environment[LIVENESS_VARIABLE]]
            body["Healthcheck"] = {
                "Test": ["CMD", *check, str(HEALTH_MAX_AGE_S)],
                "Interval": 5 * NANOSECONDS,
                "Timeout": 5 * NANOSECONDS,
                "Retries": 3,
                "StartPeriod": HEALTH_START_S * NANOSECONDS,
            }
        self.api.request("POST", "/containers/create", params={"name": name}, json=body)
        if files:
            self.api.request(
                "PUT",
                f"/containers/{name}/archive",
                params={"path": HOME},
                content=_archive(files),
                headers={"Content-Type": "application/x-tar"},
            )
        self.api.request("POST", f"/containers/{name}/start")
        pid = int(self.api.inspect(name)["State"]["Pid"])
        with open(log_path, "a") as log:
            log.write(f"container {name} started (docker logs {name})\n")
        return Container(self.api, name, pid)


def remove_children(api: DockerApi, project: str) -> list[str]:
    """Stop (SIGTERM: learners upload what they have, within :data:`STOP_TIMEOUT_S`) and
    remove every job container of ``project``, left by a controller that was killed; returns
    their names."""
    filters = json.dumps({"label": [f"{PROJECT_LABEL}={project}", CHILD_LABEL]})
    found = api.request("GET", "/containers/json", params={"all": "true", "filters": filters})
    left = [Container(api, c["Names"][0].lstrip("/"), 0) for c in found]
    for container in left:
        container.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for container in left:
        with contextlib.suppress(subprocess.TimeoutExpired):  # then removed by force
            container.wait(max(0.0, deadline - time.monotonic()))
        api.remove(container.name)
    return [container.name for container in left]
