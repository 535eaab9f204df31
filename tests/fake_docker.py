"""A stand-in Docker engine on a Unix socket, for the compose controller's unit tests.

It answers the few Engine API (v1.41) calls that ``services.orchestration.compose.docker_api``
makes through the Docker SDK, from containers it keeps in memory, and records each request, so
a test drives the real SDK over a real socket and checks what reached the engine. It runs no
process: a container "exits" when it is sent SIGTERM (code 0) or SIGKILL (code 137), and its log
is whatever the test puts there. tests/test_compose.py runs the controller on a real engine.
"""

from __future__ import annotations

import json
import socketserver
import struct
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

PREFIX = "/v1.41"
EXIT_ON_SIGNAL = {"SIGTERM": 0, "SIGKILL": 137}  # what a signal does to a fake container


@dataclass
class Request:
    """One request the engine received."""

    method: str
    path: str  # without the API version prefix
    query: dict[str, str]
    body: bytes


@dataclass
class FakeDockerEngine:
    """Containers by id (each one its ``docker inspect`` document) and the requests received."""

    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    archives: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)  # by name
    logs: dict[str, bytes] = field(default_factory=dict)  # by name
    refuse: dict[tuple[str, str], int] = field(default_factory=dict)  # (method, verb) → status

    def add(self, name: str, **attrs: Any) -> dict[str, Any]:
        """A container ``name`` with ``attrs`` over a stopped container's defaults."""
        container: dict[str, Any] = {
            "Id": uuid.uuid4().hex,
            "Name": f"/{name}",
            "Image": "sha256:" + "0" * 64,
            "Config": {"Labels": {}, "Tty": False},
            "State": {"Status": "created", "Running": False, "ExitCode": 0, "Pid": 0},
            "Mounts": [],
            "NetworkSettings": {"Networks": {}},
            **attrs,
        }
        self.containers[container["Id"]] = container
        return container

    def find(self, ref: str) -> dict[str, Any] | None:
        """The container whose id or name is ``ref``."""
        for container in self.containers.values():
            if ref in (container["Id"], container["Name"].lstrip("/")):
                return container
        return None

    def named(self, method: str, path: str) -> list[Request]:
        """The requests of ``method`` whose path is ``path``."""
        return [r for r in self.requests if (r.method, r.path) == (method, path)]

    def handle(self, request: Request) -> tuple[int, Any]:
        """The status and JSON body (or bytes) answering ``request``."""
        parts = request.path.strip("/").split("/")
        if parts == ["containers", "json"]:
            return 200, self._list(json.loads(request.query.get("filters", "{}")))
        if parts == ["containers", "create"]:
            return self._create(request.query["name"], json.loads(request.body))
        container = self.find(parts[1]) if len(parts) >= 2 else None
        if container is None:
            return 404, {"message": f"No such container: {parts[-1]}"}
        verb = parts[2] if len(parts) == 3 else ""
        refused = self.refuse.get((request.method, verb))
        if refused is not None:
            return refused, {"message": "refused by the test"}
        state, name = container["State"], container["Name"].lstrip("/")
        if (request.method, verb) == ("GET", "json"):
            return 200, container
        if (request.method, verb) == ("PUT", "archive"):
            self.archives.setdefault(name, []).append((request.query["path"], request.body))
            return 200, None
        if (request.method, verb) == ("POST", "start"):
            state.update(Status="running", Running=True, Pid=4000 + len(self.requests))
            return 204, None
        if (request.method, verb) == ("POST", "kill"):
            if not state["Running"]:
                return 409, {"message": f"container {name} is not running"}
            code = EXIT_ON_SIGNAL.get(request.query.get("signal", "SIGKILL"))
            if code is not None:
                state.update(Status="exited", Running=False, ExitCode=code, Pid=0)
            return 204, None
        if (request.method, verb) == ("GET", "logs"):
            return 200, self.logs.get(name, b"")
        if (request.method, verb) == ("DELETE", ""):
            if state["Running"] and request.query.get("force") != "True":
                return 409, {"message": f"container {name} is running"}
            del self.containers[container["Id"]]
            return 204, None
        return 400, {"message": f"the fake engine does not answer {request.method} {request.path}"}

    def _list(self, filters: dict[str, list[str]]) -> list[dict[str, Any]]:
        def labelled(container: dict[str, Any]) -> bool:
            labels = container["Config"]["Labels"]
            for wanted in filters.get("label", []):
                key, _, value = wanted.partition("=")
                if key not in labels or (value and labels[key] != value):
                    return False
            return True

        return [
            {"Id": c["Id"], "Names": [c["Name"]], "Labels": c["Config"]["Labels"]}
            for c in self.containers.values()
            if labelled(c)
        ]

    def _create(self, name: str, body: dict[str, Any]) -> tuple[int, Any]:
        if self.find(name) is not None:
            return 409, {"message": f"the name {name} is in use"}
        config = {key: value for key, value in body.items() if key != "HostConfig"}
        container = self.add(
            name, Image=body["Image"], Config=config, HostConfig=body.get("HostConfig", {})
        )
        return 201, {"Id": container["Id"], "Warnings": []}


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    engine: FakeDockerEngine


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # the SDK keeps its connection open
    server: _Server

    def _answer(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        request = Request(
            self.command,
            url.path.removeprefix(PREFIX),
            {key: values[-1] for key, values in parse_qs(url.query).items()},
            self.rfile.read(length),
        )
        self.server.engine.requests.append(request)
        status, body = self.server.engine.handle(request)
        if request.path.endswith("/logs") and status == 200:
            # A container without a TTY: its output as stdout frames (stream, size, data).
            payload = struct.pack(">BxxxL", 1, len(body)) + body if body else b""
            content_type = "application/vnd.docker.raw-stream"
        else:
            payload = b"" if body is None else json.dumps(body).encode()
            content_type = "application/json"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the engine's requests are in ``FakeDockerEngine.requests``."""


class FakeDockerServer:
    """A :class:`FakeDockerEngine` served on the Unix socket ``socket`` until :meth:`close`."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.engine = FakeDockerEngine()
        self._server = _Server(str(socket), _Handler)
        self._server.engine = self.engine
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and remove the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self.socket.unlink(missing_ok=True)
