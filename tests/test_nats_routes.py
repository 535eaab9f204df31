"""A JetStream cluster's routes (``services.orchestration.nats_server.ClusterNode``), on real
nats-servers: the nodes join each other over mutual TLS with the routes' secret, and a server
that dials a node's route port without that secret, without TLS, or with a certificate of
another CA is refused, and never becomes a route."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.orchestration.nats_server import (
    ClusterNode,
    NatsServer,
    free_port,
    new_route_secret,
    start_nats_cluster,
    start_nats_server,
)
from shared import tls
from tests.helpers import wait_for

pytestmark = pytest.mark.nats

# What the node dialled logs when it refuses each stranger.
REFUSALS = {
    "a wrong secret": 'authentication error - User "route"',
    "no TLS": "TLS route handshake error",
    "another CA's certificate": "TLS route handshake error",
}


def monitor(server: NatsServer, endpoint: str) -> Any:
    """A monitoring endpoint's answer (``routez``, ``varz``)."""
    url = f"http://127.0.0.1:{server.http_port}/{endpoint}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[list[NatsServer], tls.ServerFiles]]:
    """Two nodes with TLS for clients and routes, as ``diloco up --nats-cluster 2 --tls``."""
    files = tls.make_server_files(tmp_path / "tls", ["127.0.0.1", "localhost"])
    servers = start_nats_cluster(
        tmp_path / "cluster", 2, monitor=True, route_tls=files, tls=files.server_block()
    )
    yield servers, files
    for server in servers:
        server.stop()


@pytest.mark.parametrize("stranger", sorted(REFUSALS))
def test_only_a_node_with_the_routes_secret_and_the_clusters_certificate_joins(
    secured: tuple[list[NatsServer], tls.ServerFiles], tmp_path: Path, stranger: str
) -> None:
    servers, files = secured
    # The nodes joined each other (each route is a pool of connections).
    assert all(monitor(server, "routez")["num_routes"] >= 1 for server in servers)
    dialled = servers[0]
    cluster = monitor(dialled, "varz")["cluster"]
    assert cluster["tls_required"] and cluster["tls_verify"], cluster
    joined = monitor(dialled, "routez")["num_routes"]
    match = re.search(r'user: "route", password: "([^"]+)"', dialled.config_path.read_text())
    assert match is not None
    secret, route_tls = match.group(1), files
    if stranger == "a wrong secret":
        secret = new_route_secret()
    elif stranger == "no TLS":
        route_tls = None
    else:
        route_tls = tls.make_server_files(tmp_path / "other-ca", ["127.0.0.1", "localhost"])
    node = ClusterNode(
        "stranger",
        f"127.0.0.1:{free_port()}",
        (f"nats-route://127.0.0.1:{cluster['cluster_port']}",),
        secret,
        route_tls,
    )
    offset = dialled.log_path.stat().st_size
    rogue = start_nats_server(tmp_path / "stranger", http_port=free_port(), cluster=node)
    try:

        def refused() -> bool:
            with open(dialled.log_path, "rb") as log:
                log.seek(offset)
                return REFUSALS[stranger].encode() in log.read()

        wait_for(refused, 30, f"the node to refuse a stranger with {stranger}")
        assert monitor(rogue, "routez")["num_routes"] == 0
        routes = monitor(dialled, "routez")
        assert routes["num_routes"] == joined, routes
        assert all(route.get("remote_name") != "stranger" for route in routes["routes"]), routes
    finally:
        rogue.stop()
