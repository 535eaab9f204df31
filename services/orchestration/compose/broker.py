"""``diloco broker``: nats-server in a compose cluster, and the cluster's secrets.

At its first start it makes, in the ``secrets`` volume (``--secrets-dir``): the credentials of the
admin (the controller) and the gateway, a CA and the server's certificate for the names the other
containers use (``--server-names``), the gateway's API token (``api-token``) and, for a cluster,
the routes' password (``route-secret``). Later starts keep them, and the cluster's other nodes,
started after the first, read them: their routes are mutual TLS with that certificate and that
password. Then it runs nats-server with JetStream (every listed user, TLS only; with ``--routes``,
as a node of a JetStream cluster, docker-compose.yml's ``cluster`` profile) and checks the
credentials folder every ``--poll-s``: a user the controller added for a new job's container is
loaded into the running server (a reload, no reconnects), so that container's first connection is
accepted. If nats-server exits, so does this command, with its code (the container's restart
policy starts it again on the same store).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from pathlib import Path

from services.orchestration import nats_server
from services.orchestration.compose.settings import (
    CREDENTIALS_DIR,
    ROUTE_SECRET_FILE,
    TLS_DIR,
    TOKEN_FILE,
    BrokerSettings,
)
from shared import atomic, nats_auth, tls

log = logging.getLogger("diloco.broker")
#: The users every compose cluster has from the start; a job's users come with its containers.
BASE_IDENTITIES = (nats_auth.Identity("admin"), nats_auth.Identity("gateway"))
TOKEN_BYTES = 24


def credentials_of(secrets_dir: Path) -> nats_auth.Credentials:
    """The cluster's credentials folder, every file in it loaded."""
    credentials = nats_auth.Credentials(secrets_dir / CREDENTIALS_DIR)
    _load(credentials, set())
    return credentials


def hand_to_broker(path: Path) -> None:
    """Give a credentials file made by root (the controller, for the Docker socket; ``diloco
    credentials`` in its container) to the credentials folder's owner, the broker's user,
    which must read it."""
    if os.getuid() == 0:
        folder = path.parent.stat()
        os.chown(path, folder.st_uid, folder.st_gid)


def _load(credentials: nats_auth.Credentials, reported: set[str]) -> list[str]:
    """Load the folder's new users; a file that cannot be used is logged once and skipped."""
    added, problems = credentials.load()
    for problem in problems:
        if problem not in reported:
            reported.add(problem)
            log.error("skipped a credentials file: %s", problem)
    return added


def make_secrets(settings: BrokerSettings) -> tuple[nats_auth.Credentials, tls.ServerFiles | None]:
    """Make the cluster's secrets that are missing; returns the credentials (every user so far)
    and, with ``--tls``, the server's TLS files."""
    folder = settings.secrets_dir
    credentials = credentials_of(folder)
    for who in BASE_IDENTITIES:
        credentials.ensure(who)
    token = folder / TOKEN_FILE
    if not token.exists():
        atomic.write_private_bytes(token, f"{secrets.token_urlsafe(TOKEN_BYTES)}\n".encode())
        log.info("made the gateway's API token (%s)", token)
    files = None
    if settings.tls:
        tls_dir = folder / TLS_DIR
        files = tls.ServerFiles(
            tls_dir / "ca.pem", tls_dir / "server.pem", tls_dir / "server-key.pem"
        )
        if not all(path.exists() for path in (files.ca_cert, files.cert, files.key)):
            files = tls.make_server_files(tls_dir, settings.names())
            log.info("made a CA and a certificate for %s (%s)", settings.server_names, tls_dir)
    return credentials, files


def route_secret(folder: Path) -> str:
    """The password of the cluster's routes (``route-secret`` in the secrets folder), made by
    the first node at its first start; the others read it."""
    path = folder / ROUTE_SECRET_FILE
    if not path.exists():
        atomic.write_private_bytes(path, f"{nats_server.new_route_secret()}\n".encode())
        log.info("made the cluster's route secret (%s)", path)
    return path.read_text().strip()


def run_broker(settings: BrokerSettings, stop: threading.Event) -> int:
    """Run nats-server until ``stop`` is set (then stop it gracefully: exit 0) or it exits by
    itself (returns its exit code)."""
    credentials, files = make_secrets(settings)
    routes = settings.route_urls()
    node = None
    if routes:
        node = nats_server.ClusterNode(
            settings.server_name or socket.gethostname(),
            f"{settings.listen_host}:{settings.route_port}",
            tuple(routes),
            route_secret(settings.secrets_dir),
            files,  # routes over mutual TLS where clients are (the certificate names every node)
        )
    server = nats_server.start_nats_server(
        settings.store_dir,
        host=settings.listen_host,
        port=settings.port,
        authorization=credentials.authorization_block(),
        tls=files.server_block() if files is not None else None,
        http_port=settings.http_port,
        ready_timeout_s=60.0,
        cluster=node,
    )
    log.info(
        "nats-server ready on %s:%d (log %s)%s",
        settings.listen_host,
        settings.port,
        server.log_path,
        f", node {node.name} of a cluster routed to {', '.join(routes)}" if node else "",
    )
    reported: set[str] = set()
    try:
        while not stop.wait(settings.poll_s):
            code = server.process.poll()
            if code is not None:
                log.error("nats-server exited with code %d (log %s)", code, server.log_path)
                return code or 1
            added = _load(credentials, reported)
            if added:
                server.reload(credentials.authorization_block())
                log.info("added users %s", ", ".join(added))
    finally:
        server.stop()
    return 0
