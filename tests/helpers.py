"""Helpers the tests share: waiting for a condition, reading status records, service processes.

Fixtures live in ``conftest.py``; everything a test module imports lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import inspect
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from services.orchestration.local import files
from shared.job_status import JobStatus, read_job_status
from shared.kv import KvError
from shared.nats_auth import Identity
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStatus
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.cli import settings_from_args
from shared.settings.nats import NatsSettings
from shared.transport.blobs import chunk_size_for, publish_blob
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams, prepare_streams

if TYPE_CHECKING:
    import pytest
    from pydantic_settings import BaseSettings

    from services.orchestration.local.records import RunSummary
    from services.outer.core import OuterAlgorithm
from shared.records import Stamped

REPO = Path(__file__).resolve().parents[1]
GATEWAY_TOKEN = "test-token-0123456789"  # every gateway a test starts has it (DILOCO_TOKEN)
AUTH = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}

T = TypeVar("T")
SettingsT = TypeVar("SettingsT", bound="BaseSettings")


def run_dir(factory: pytest.TempPathFactory) -> Path:
    """A folder shared by every worker of this run (``pytest -n``: the workers' base
    temporary folders sit side by side in it)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def computed_once(factory: pytest.TempPathFactory, name: str, compute: Callable[[], str]) -> str:
    """``compute()``'s text, computed once for the whole run: the first worker to ask computes
    it under a file lock, the others (and later asks) read what it wrote."""
    shared = run_dir(factory)
    result = shared / f"{name}.txt"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            result.write_text(compute())
    return result.read_text()


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def wait_for_async(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
) -> T:
    """``wait_for`` inside a coroutine: poll ``predicate`` (a function or a coroutine function)
    until it returns something truthy, the event loop running meanwhile; fail with ``what`` on
    timeout. The deadline is wall time, also on ``tests.virtual_clock``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def job_status(nats_url: str, job: str, credentials: str | None = None) -> JobStatus:
    """The outer's and every unit's status record of ``job``, with their ages (``credentials``:
    the file of the user to connect as, e.g. ``diloco up``'s admin)."""

    async def read() -> JobStatus:
        settings = NatsSettings(nats_url=nats_url, nats_credentials=credentials)
        nc = await connect(settings, "test-reader")
        try:
            return await read_job_status(nc, nc.jetstream(), job)
        except KvError:  # no service has created the status bucket yet
            return JobStatus(job)
        finally:
            await nc.close()

    return asyncio.run(read())


def read_status(
    nats_url: str, job: str, credentials: str | None = None
) -> tuple[OuterStatus | None, dict[int, UnitStatus]]:
    """The outer's and every unit's status record of ``job`` (without their ages)."""
    status = job_status(nats_url, job, credentials)
    return status.outer_record(), status.unit_records()


def next_heartbeats(
    nats_url: str,
    units: Iterable[tuple[str, int]],
    count: int,
    timeout_s: float,
    credentials: str | None = None,
) -> dict[tuple[str, int], list[UnitStatus]]:
    """The next ``count`` status records of each ``(job, unit)``, each a new heartbeat (a new
    revision of its KV entry), as they come (a unit that beats faster than the others while
    they are awaited has its first ``count`` returned).

    A window measured in the units' own heartbeats, in which a test checks what a unit must not
    do (train while paused, say): it stretches with the units when the machine is busy, where a
    sleep would not."""
    wanted = set(units)

    def entries() -> dict[tuple[str, int], Stamped[UnitStatus]]:
        statuses = {job: job_status(nats_url, job, credentials) for job in {j for j, _ in wanted}}
        return {
            (job, unit): entry
            for job, unit in wanted
            if (entry := statuses[job].units.get(unit)) is not None
        }

    since = {who: entry.revision for who, entry in entries().items()}
    seen: dict[tuple[str, int], dict[int, UnitStatus]] = {who: {} for who in wanted}

    def enough() -> bool:
        for who, entry in entries().items():
            if entry.revision > since.get(who, 0):
                seen[who][entry.revision] = entry.record
        return all(len(records) >= count for records in seen.values())

    wait_for(enough, timeout_s, f"{count} heartbeats of each of {sorted(wanted)}")
    return {who: [records[r] for r in sorted(records)][:count] for who, records in seen.items()}


class ServiceProcesses:
    """Starts ``diloco <service>`` processes and guarantees they are gone after the test."""

    def __init__(self, workdir: Path, jax_cache: Path) -> None:
        self.workdir = workdir
        self.jax_cache = jax_cache
        self.children: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(
        self, name: str, *args: str, env: dict[str, str] | None = None, netns: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``diloco <args>`` logging to ``<workdir>/<name>.log`` (``env``: variables
        on top of this process's; ``netns``: in that network namespace, by ``ip netns exec``,
        which execs the command: the process is the service's own)."""
        log_path = self.workdir / f"{name}.log"
        env = {
            **os.environ,
            **(env or {}),
            "DILOCO_JAX_CACHE": str(self.jax_cache),
            "DILOCO_TOKEN": GATEWAY_TOKEN,
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
            "PYTHONUNBUFFERED": "1",
        }
        with open(log_path, "ab") as log_file:
            prefix = ["ip", "netns", "exec", netns] if netns is not None else []
            process = subprocess.Popen(
                [*prefix, sys.executable, "-m", "services.cli", *args],
                cwd=REPO,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.children.append((name, process, log_path))
        return process

    def log(self, name: str) -> str:
        """The log of the process started as ``name``."""
        for child_name, _, path in self.children:
            if child_name == name:
                return path.read_text(errors="replace")
        return ""

    def logs(self) -> str:
        """The tail of every process's log (for assertion messages)."""
        return "\n".join(
            f"==== {n} ====\n{p.read_text(errors='replace')[-3000:]}" for n, _, p in self.children
        )

    def stop_all(self) -> None:
        """SIGTERM every process still running, then SIGKILL those that do not stop in 20 s
        (after they dumped their threads' stacks into their logs: SIGUSR1, faulthandler)."""
        for _, process, _ in self.children:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 20
        for _, process, log_path in self.children:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logged = log_path.stat().st_size
                process.send_signal(signal.SIGUSR1)
                with contextlib.suppress(AssertionError):  # killed without its stacks, then
                    wait_for(
                        lambda path=log_path, size=logged: (
                            b"most recent call first" in path.read_bytes()[size:]
                        ),
                        5,
                        "its threads' stacks in its log",
                        interval_s=0.05,
                    )
                process.kill()
                process.wait()


# ---- diloco up ------------------------------------------------------------------------------


def processes_mentioning(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (our data dir), except us."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


def cluster_processes(data_dir: Path, out_path: Path) -> list[str]:
    """Live processes of one `diloco up` run: nats-server (its config lives in the data dir)
    and every service (their command lines carry the server's unique URL)."""
    url = next(
        line.split()[1]
        for line in out_path.read_text().splitlines()
        if line.startswith("nats-server")
    )
    return sorted(set(processes_mentioning(str(data_dir)) + processes_mentioning(url + " ")))


def up_gateway(data_dir: Path, out_path: Path) -> Any:
    """An ``httpx.Client`` of the gateway of a ``diloco up`` started with :func:`start_up`
    (its URL from the output, its token from the data folder), once it answers."""
    import httpx

    url = wait_for(
        lambda: next(
            (
                line.split()[1]
                for line in out_path.read_text().splitlines()
                if line.startswith("gateway ")
            ),
            None,
        ),
        60,
        "the gateway line",
    )
    token = (data_dir / "token").read_text().strip()
    wait_for(lambda: answers_http(url + "/readyz"), 120, "the gateway to answer")
    return httpx.Client(base_url=url, timeout=10, headers={"Authorization": f"Bearer {token}"})


def start_up(
    tmp_path: Path, jax_cache: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path, Path]:
    """Start ``diloco up`` (tiny model, two learners unless ``extra`` says otherwise) with
    ``env`` added to its environment, which its children inherit."""
    data_dir = tmp_path / "cluster-data"
    out_path = tmp_path / "up.out"
    env = {
        **os.environ,
        "DILOCO_JAX_CACHE": str(jax_cache),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    with open(out_path, "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "up",
                "--data-dir",
                str(data_dir),
                "--gateway-port",
                "0",
                "--model",
                "tiny",
                "--learners",
                "2",
                "--progress-every-s",
                "1",
                "--eval-every-s",
                "2",
                *extra,
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return process, data_dir, out_path


def run_up_to_end(
    tmp_path: Path, jax_cache: Path, *extra: str, timeout_s: float = 400
) -> tuple[RunSummary, str]:
    """A whole ``diloco up`` run (:func:`start_up`) to its end: its summary, which says it
    finished with its books balanced, and its output."""
    process, data_dir, out_path = start_up(tmp_path, jax_cache, *extra)
    try:
        assert process.wait(timeout=timeout_s) == 0, out_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    output = out_path.read_text()
    summary = files.read_summary(data_dir)
    assert summary is not None and summary.reason == "finished", output
    assert summary.ledger.balanced, summary.ledger
    return summary, output


def live_pids(data_dir: Path) -> dict[str, int]:
    """The live children's PIDs by name, from ``pids.json`` (empty until it is written)."""
    record = files.read_pids(data_dir)
    return record.pids if record is not None else {}


def answers_http(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (with any status)."""
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def upload_blob(
    job: str,
    unit: int,
    round_: int,
    base: int,
    seed: int,
    scale: float = 1e-3,
    shared: float = 0.0,
) -> bytes:
    """A wire envelope of a tiny-model pseudo-gradient: Gaussian noise of standard deviation
    ``scale`` (seeded), int8-encoded, as unit ``unit``'s round ``round_`` on ``base``. With
    ``shared`` non-zero, ``shared`` × a direction every such upload has in common is added (the
    agreement of honest units' uploads; a negative ``shared`` goes against them)."""
    import jax
    import numpy as np

    from shared import model, pytree
    from shared.codec import api as codec
    from shared.wire.envelope import PseudoGradEnvelope, pack_envelope

    named = pytree.flatten_named(model.init_params(model.get_config("tiny"), jax.random.PRNGKey(1)))
    rng, common = np.random.default_rng(seed), np.random.default_rng(1 << 20)
    delta = {
        k: (
            (rng.standard_normal(v.shape) + shared * common.standard_normal(v.shape)) * scale
        ).astype(np.float32)
        for k, v in named.items()
    }
    payload, description = codec.encode_tensors(delta, "int8")
    envelope = PseudoGradEnvelope(
        job=job,
        unit=unit,
        round=round_,
        fragment=0,
        base_version=base,
        inner_steps=10,
        # 10 steps of 2 to 8 sequences: varied, within what the job's batch (16) allows.
        tokens=1280 + 64 * (seed % 64),
        train_loss=3.0,
        codec=description,
        sent_at=1.7e9,
        payload=payload,
        model="tiny",
    )
    return pack_envelope(envelope)


def publish_uploads(
    url: str,
    job: str,
    count: int,
    scales: dict[int, float] | None = None,
    first: int = 0,
    secure: SecureNats | None = None,
) -> None:
    """Store ``count`` uploads of three units (upload k: unit k % 3, round k // 3) in the job's
    grads stream, from upload ``first`` on; upload k's noise has standard deviation
    ``scales.get(k, 1e-3)``, and as much again along a direction they share (honest units
    agree: peer review judges by it). With ``secure``, each unit publishes as its own NATS
    user."""
    from shared import subjects
    from shared.nats_auth import Identity
    from shared.wire.chunks import upload_id

    async def publish() -> None:
        uploads = range(first, first + count)
        connections = {}
        for unit in sorted({k % 3 for k in uploads}):
            settings = (
                NatsSettings(nats_url=url)
                if secure is None
                else secure.settings(Identity("learner", job, unit=unit))
            )
            nc = await connect(settings, f"upload-publisher-{unit}")
            await prepare_streams(nc.jetstream(), settings)
            connections[unit] = nc
        for k in uploads:  # in order: the stream holds them as numbered
            unit, round_ = k % 3, k // 3
            nc = connections[unit]
            # The outer offers a whole fetched batch (up to 32 messages) before merging it, so
            # a base version 40 behind the upload's position is always one it has reached.
            scale = (scales or {}).get(k, 1e-3)
            blob = upload_blob(job, unit, round_, max(0, k - 40), k, scale, shared=1.0)
            await publish_blob(
                nc.jetstream(),
                subjects.grads_subject(job, unit, 0),
                blob,
                upload_id(job, unit, round_, 0),
                chunk_size_for(nc),
            )
        for nc in connections.values():
            await nc.close()

    asyncio.run(publish())


class SecureNats:
    """A nats-server with the users ``diloco up`` would make (``shared.nats_auth``), the admin
    having created the streams."""

    def __init__(self, root: Path, identities: list[Identity]) -> None:
        from services.orchestration.nats_server import start_nats_server
        from shared.nats_auth import Credentials

        self.credentials = Credentials(root / "credentials")
        for who in [Identity("admin"), *identities]:
            self.credentials.ensure(who)
        self.server = start_nats_server(
            root / "nats", authorization=self.credentials.authorization_block()
        )

        async def create_streams() -> None:
            nc = await connect(self.settings(Identity("admin")), "admin")
            await ensure_streams(nc.jetstream())
            await nc.close()

        asyncio.run(create_streams())

    @property
    def url(self) -> str:
        return self.server.url

    def path(self, who: Identity) -> str:
        """The credentials file of ``who``."""
        return str(self.credentials.ensure(who)[0])

    def settings(self, who: Identity) -> NatsSettings:
        """How ``who`` connects."""
        return NatsSettings(nats_url=self.url, nats_credentials=self.path(who))

    def env(self, who: Identity) -> dict[str, str]:
        """The environment of a service process that connects as ``who``."""
        return {"DILOCO_NATS_CREDENTIALS": self.path(who)}


def outer_algorithm(num_units: int = 1, **changes: object) -> OuterAlgorithm:
    """The outer core's algorithm for a job of ``num_units`` units: the shipped settings with
    ``changes`` (field names of ``AlgorithmSettings``), and one fragment unless ``changes`` say
    otherwise (the tests' toy models have fewer tensors than the shipped fragments)."""
    return AlgorithmSettings(**{"fragments": 1, **changes}).outer_algorithm(num_units)


def service_settings(cls: type[SettingsT], argv: list[str]) -> SettingsT:
    """The settings a service builds from a command line a launcher gives it
    (``argv[0]`` is the service's name, as in ``diloco <service> ...``)."""
    return settings_from_args(cls, argv[1:])


def load_bench_script(name: str, monkeypatch: Any) -> ModuleType:
    """``bench/<name>.py`` as a module (``bench/`` on ``sys.path``, as when run as a script),
    registered in ``sys.modules`` for the test's duration (dataclasses look their module up
    while defined)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(
        f"{name}_under_test", REPO / "bench" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module
