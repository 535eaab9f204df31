"""``diloco up``: a whole local cluster — nats-server, outer, gateway, N learners — supervised.

Every service runs as its own process, started with the same ``diloco <service>`` command that
docker-compose runs. This supervisor shows live progress read from the status KV bucket, heals
the cluster (a child that crashes is started again with the same command line after a backoff,
nats-server on the same port and JetStream store; see ``services.supervisor``), ends the run by
itself once every unit has finished and the outer has applied (and evaluated) everything they
published, and on Ctrl-C/SIGTERM stops the services in a safe order: learners first (they upload
what they have), then the outer and gateway, then nats-server. Children are also tied to this
process with PR_SET_PDEATHSIG, so even a kill -9 of the supervisor leaves no process behind.
The live children's PIDs are kept in ``<data-dir>/pids.json`` for chaos tests.

Besides its own job, ``diloco up`` runs the jobs of the registry (created through the gateway's
``POST /jobs``): about once a second it reads the jobs and desired unit states from KV and starts
or stops their outer and learner processes to match (``services.reconcile`` decides what; the
processes are supervised like the others, named ``<job>/outer`` and ``<job>/learner-<u>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import nats.errors
import nats.js.errors
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from services import reconcile
from services.gateway.jobs import JobRecord
from services.learner.settings import InnerSettings, LearnerSettings
from services.outer.settings import OuterAlgorithmSettings
from services.supervisor import DEFAULT_MAX_RESTARTS, RestartPolicy, State, Supervisor
from shared import broker, ledger, subjects, transport
from shared.settings import ENV_PREFIX, JobSpec, NatsSettings, to_flags

STOP_GRACE_S = 30.0
SUMMARY_FILE = "summary.json"  # in the data dir: the final statuses, ledger and restarts
READY_TIMEOUT_S = 300.0
STATUS_READ_TIMEOUT_S = 3.0  # bounds a status read while NATS is down, so healing goes on
RECONCILE_EVERY_S = 1.0  # how often the registry's jobs are read and their processes matched
NATS = "nats-server"
ESSENTIAL = ("outer", NATS)  # without these nothing can go on: the run ends if they stay dead
NATS_ERRORS = (TimeoutError, OSError, nats.errors.Error, transport.TransportError)


class UpSettings(JobSpec, InnerSettings, OuterAlgorithmSettings):
    """Options of ``diloco up``: the job, every learner and outer option (passed on to the
    services), and the local cluster's own (each also settable as ``DILOCO_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    learners: int = Field(4, ge=1, le=64, description="number of learner units to start")
    slowdowns: str = Field(
        "",
        description="comma-separated slowdown factor per unit, e.g. 1,1,2,4 (emulates "
        "heterogeneous hardware; the token budget is shared in proportion to speed)",
    )
    data_dir: str = Field(
        "data", description="folder for logs, the JAX cache and the NATS store (emptied at start)"
    )
    gateway_port: int = Field(8000, ge=0, le=65535, description="gateway HTTP port (0 = free)")
    token: str = Field(
        "",
        description="the gateway's API token (default: a new random one, printed at start and "
        "written to <data-dir>/token)",
    )
    nats_port: int = Field(0, ge=0, le=65535, description="nats-server port (0 = free)")
    eval_every_s: float = Field(10.0, gt=0, description="seconds between held-out evals")
    progress_every_s: float = Field(5.0, gt=0, description="seconds between progress lines")
    max_duration_s: float = Field(
        1800.0, gt=0, description="stop the run after this many seconds even if not finished"
    )
    start_together: bool = Field(
        True,
        description="create the units paused and start them together once all are ready "
        "(data loaded, step compiled), so that their speeds compare fairly",
    )
    learner_threads: int = Field(
        1, ge=1, le=64, description="CPU threads each learner's XLA may use"
    )
    max_restarts: int = Field(
        DEFAULT_MAX_RESTARTS,
        ge=0,
        description="restarts of each crashed child before it is left dead (the run then ends "
        "if it is the outer or nats-server); restarts back off from 1 s to 10 s",
    )

    def unit_steps(self) -> list[int]:
        """Inner steps of each unit: the job's budget (learners × max-steps) shared in proportion
        to speed, so that slow units do less of it and every unit finishes at about the same
        time (with equal speeds: max-steps each)."""
        speeds = [1.0 / f for f in self.unit_slowdowns()]
        total = self.learners * self.max_steps
        return [max(1, round(total * v / sum(speeds))) for v in speeds]

    def unit_slowdowns(self) -> list[float]:
        """The slowdown factor of each unit."""
        if not self.slowdowns.strip():
            return [1.0] * self.learners
        return [float(x) for x in self.slowdowns.split(",")]

    @model_validator(mode="after")
    def _check_up(self) -> UpSettings:
        try:
            factors = self.unit_slowdowns()
        except ValueError:
            raise ValueError(
                f"slowdowns must be numbers like 1,1,2,4, got {self.slowdowns!r}"
            ) from None
        if len(factors) != self.learners or any(not 1 <= f <= 100 for f in factors):
            raise ValueError(
                f"slowdowns needs {self.learners} factors in [1, 100], got {self.slowdowns!r}"
            )
        if self.min_quorum > self.learners:
            raise ValueError(f"min-quorum {self.min_quorum} > learners {self.learners}")
        return self


def _popen(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``diloco <args>`` in its own session, appending its output to ``log_path``."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,
            preexec_fn=broker.terminate_with_parent,
        )


@dataclass
class Child:
    """A supervised service process; ``args`` and ``env`` start it again after a crash."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        """Whether the current process is still running."""
        return self.process.poll() is None

    def restart(self, number: int) -> None:
        """Start the same command line again (the log gets a marker line first)."""
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"\n==== diloco up: restart #{number} ====\n".encode())
        self.process = _popen(self.args, self.env, self.log_path)


@dataclass
class Cluster:
    """The processes of one ``diloco up`` run and their restart bookkeeping."""

    settings: UpSettings
    out: TextIO = sys.stdout
    server: broker.NatsServer | None = None
    learners: list[Child] = field(default_factory=list)
    services: list[Child] = field(default_factory=list)
    job_children: list[Child] = field(default_factory=list)  # processes of registry jobs
    registry_busy: bool = False  # the last registry read found a job that is not stopped
    gateway_url: str = ""
    token: str = ""
    supervisor: Supervisor = field(init=False)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(RestartPolicy(max_restarts=self.settings.max_restarts))

    @property
    def nats_url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def pids_path(self) -> Path:
        """``<data-dir>/pids.json``: the live children's PIDs, for chaos tests."""
        return Path(self.settings.data_dir) / "pids.json"

    def _spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        may_finish: bool = False,
    ) -> Child:
        logs = Path(self.settings.data_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name.replace('/', '-')}.log"
        child = Child(name, _popen(args, env or {}, log_path), log_path, args, env or {})
        self.supervisor.add(name, time.monotonic(), may_finish=may_finish)
        return child

    def job_flags(self) -> list[str]:
        """Flags every service of the job gets: NATS URL and the job definition."""
        return ["--nats-url", self.nats_url, *to_flags(self.settings, JobSpec.model_fields)]

    def start_services(self) -> None:
        """Start nats-server, the outer and the gateway."""
        s = self.settings
        data_dir = Path(s.data_dir)
        store = data_dir / "nats"
        # Each run is a fresh job: learners number their rounds from 0, and JetStream would
        # drop a new run's uploads as duplicates of the last run's within its dedupe window;
        # a learner would restore the last run's checkpoint.
        for stale in (store, self.checkpoint_dir):
            if stale.exists():
                shutil.rmtree(stale)
        self.server = broker.start_nats_server(
            store, port=s.nats_port, new_session=True, die_with_parent=True
        )
        self.supervisor.add(NATS, time.monotonic())
        self.print(f"nats-server  {self.nats_url}  (fresh JetStream store {store})")
        cache_env = {"DILOCO_JAX_CACHE": str((data_dir / "jax-cache").resolve())}
        outer_flags = to_flags(s, OuterAlgorithmSettings.model_fields)
        self.services.append(
            self._spawn(
                "outer",
                [
                    "outer",
                    *self.job_flags(),
                    "--num-units",
                    str(s.learners),
                    *outer_flags,
                    "--eval-every-s",
                    str(s.eval_every_s),
                ],
                cache_env,
            )
        )
        port = s.gateway_port or broker.free_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.token = s.token or secrets.token_urlsafe(24)
        token_path = write_token(data_dir, self.token)
        gateway_args = ["gateway", "--nats-url", self.nats_url, "--job", s.job]
        # The token goes by environment, not on the command line (where `ps` would show it).
        self.services.append(
            self._spawn(
                "gateway",
                [*gateway_args, "--port", str(port), "--local"],
                {"DILOCO_TOKEN": self.token},
            )
        )
        self.print(
            f"gateway      {self.gateway_url}  (GET /jobs/{s.job}, /readyz)"
            f"  token: {self.token}  (also in {token_path})"
        )
        self.write_pids()

    @property
    def checkpoint_dir(self) -> Path:
        """Where learners checkpoint, so that a restarted one goes on where it was."""
        return (Path(self.settings.data_dir) / "units").resolve()

    def cache_env(self) -> dict[str, str]:
        """Environment of every JAX service: the shared compilation cache."""
        return {"DILOCO_JAX_CACHE": str((Path(self.settings.data_dir) / "jax-cache").resolve())}

    def learner_env(self) -> dict[str, str]:
        """Environment of a learner: the cache and bounded XLA threads."""
        threads = self.settings.learner_threads
        return {
            **self.cache_env(),
            # Several JAX processes share few cores: bound each one's threads (DESIGN.md §6).
            "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'} "
            f"intra_op_parallelism_threads={threads}",
            "OMP_NUM_THREADS": str(threads),
        }

    def start_learners(self) -> None:
        """Start the learner processes (after ``start_services``)."""
        s = self.settings
        data_dir = Path(s.data_dir)
        learner_env = self.learner_env()
        inner_flags = to_flags(s, set(InnerSettings.model_fields) - {"max_steps"})
        if "checkpoint_dir" in LearnerSettings.model_fields:
            inner_flags += ["--checkpoint-dir", str(self.checkpoint_dir)]
        for unit, (slowdown, steps) in enumerate(
            zip(s.unit_slowdowns(), s.unit_steps(), strict=True)
        ):
            self.learners.append(
                self._spawn(
                    f"learner-{unit}",
                    [
                        "learner",
                        *self.job_flags(),
                        "--unit",
                        str(unit),
                        "--num-units",
                        str(s.learners),
                        "--slowdown",
                        str(slowdown),
                        "--max-steps",
                        str(steps),
                        *inner_flags,
                    ],
                    learner_env,
                    may_finish=True,  # a learner that exits 0 has trained all its steps
                )
            )
        self.print(
            f"{s.learners} learners     model {s.model}, {s.max_steps} steps each, H={s.h_steps}"
            f"  (logs in {data_dir / 'logs'})"
        )
        self.write_pids()

    def print(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def job_learners(self) -> list[Child]:
        """The learner processes of registry jobs."""
        return [c for c in self.job_children if not c.name.endswith("/outer")]

    def job_outers(self) -> list[Child]:
        """The outer processes of registry jobs."""
        return [c for c in self.job_children if c.name.endswith("/outer")]

    def children(self) -> list[Child]:
        """Every service process (learners first), not nats-server."""
        return [*self.learners, *self.job_learners(), *self.services, *self.job_outers()]

    def reconcile(self, records: dict[str, JobRecord], desired: dict[str, dict[int, str]]) -> None:
        """Start and stop the processes of registry jobs to match ``records`` and ``desired``
        (just read from KV); see ``services.reconcile``."""
        names = {c.name for c in self.job_children}
        states = {n: st for n, st in self.supervisor.states().items() if n in names}
        actions = reconcile.plan(
            records,
            desired,
            states,
            self.supervisor.retired(),
            own_job=self.settings.job,
            checkpoint_dir=str(self.checkpoint_dir),
        )
        self.registry_busy = any(
            job != self.settings.job and r.state != "stopped" for job, r in records.items()
        )
        for action in actions:
            if isinstance(action, reconcile.Spawn):
                command, *flags = action.args
                learner = action.role == "learner"
                child = self._spawn(
                    action.name,
                    [command, "--nats-url", self.nats_url, *flags],
                    self.learner_env() if learner else self.cache_env(),
                    may_finish=learner,  # a learner that exits 0 was stopped or has finished
                )
                self.job_children.append(child)
                self.print(f"job {action.job}: started {action.name} (pid {child.process.pid})")
            else:
                child = next(c for c in self.job_children if c.name == action.name)
                self.supervisor.retire(action.name)
                if child.alive():
                    child.process.send_signal(signal.SIGTERM)
                self.print(f"job {action.job}: its learners are done, stopping {action.name}")
        if actions:
            self.write_pids()

    def jobs_busy(self) -> bool:
        """A registry job is not stopped, or one of its processes still runs."""
        names = {c.name for c in self.job_children}
        states = {n: st for n, st in self.supervisor.states().items() if n in names}
        return self.registry_busy or bool(reconcile.active_children(states))

    def pids(self) -> dict[str, int]:
        """PIDs of the live children by name (``nats-server``, ``outer``, ``gateway``,
        ``learner-<unit>``), e.g. for a chaos test that kills some of them."""
        pids = {}
        if self.server is not None and self.server.alive():
            pids[NATS] = self.server.pid
        for child in self.children():
            if child.alive():
                pids[child.name] = child.process.pid
        return pids

    def write_pids(self) -> None:
        """Write ``pids.json`` atomically: this supervisor's PID, the NATS URL, the live
        children's PIDs and the restart counts."""
        record = {
            "supervisor": os.getpid(),
            "nats_url": self.server.url if self.server is not None else None,
            "pids": self.pids(),
            "restarts": self.supervisor.restarts(),
        }
        path = self.pids_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)

    def learners_done(self) -> bool:
        """Every learner has finished (exit 0) or is left dead after its restarts."""
        return all(
            self.supervisor.state(child.name) in (State.FINISHED, State.GAVE_UP)
            for child in self.learners
        )

    def _exit_code(self, name: str) -> int | None:
        if name == NATS:
            assert self.server is not None
            return self.server.process.poll()
        return next(c for c in self.children() if c.name == name).process.poll()

    def _log_path(self, name: str) -> Path:
        if name == NATS:
            assert self.server is not None
            return self.server.log_path
        return next(c for c in self.children() if c.name == name).log_path

    def heal(self, stopping: Callable[[], bool]) -> str | None:
        """Notice children that exited and restart those whose backoff is over (none once
        ``stopping()``); returns why the run must end (the outer or nats-server is left dead
        after its restarts), else None."""
        now = time.monotonic()
        changed = False
        ended = None
        for name in self.supervisor.running():
            code = self._exit_code(name)
            if code is None:
                continue
            changed = True
            decision = self.supervisor.exited(name, code, now)
            if decision.state is State.FINISHED:
                if reconcile.job_of(name) is not None:
                    self.print(f"{name} exited with code {code} (done)")
                continue
            self.print(f"{decision.line()}  (log {self._log_path(name)})")
            if decision.state is State.GAVE_UP and name in ESSENTIAL and ended is None:
                ended = (
                    f"stopped: {name} exited with code {code} and was not restarted "
                    f"(max-restarts {decision.max_restarts} reached)"
                )
        if ended is None:
            for name in self.supervisor.due(now):
                if stopping():
                    break
                self._restart(name)
                changed = True
        if changed:
            self.write_pids()
        return ended

    def _restart(self, name: str) -> None:
        number = self.supervisor.restarts()[name] + 1
        if name == NATS:
            assert self.server is not None
            # Same port and config, same JetStream store: clients reconnect by themselves.
            self.server.restart(ready_timeout_s=None)
            pid = self.server.pid
        else:
            child = next(c for c in self.children() if c.name == name)
            child.restart(number)
            pid = child.process.pid
        self.supervisor.restarted(name, time.monotonic())
        self.print(f"{name} restarted (restart #{number}, pid {pid})")

    def stop(self) -> None:
        """Stop everything: learners, then outer and gateway, then NATS; kill stragglers."""
        for group in (
            [*self.learners, *self.job_learners()],
            [*self.services, *self.job_outers()],
        ):
            for child in group:
                if child.alive():
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.print(
                        f"{child.name} did not stop in {STOP_GRACE_S:.0f}s: killing it "
                        f"(its stack is dumped to {child.log_path})"
                    )
                    child.process.send_signal(signal.SIGUSR1)  # faulthandler: dump all threads
                    time.sleep(0.5)
                    child.process.kill()
                    child.process.wait(timeout=10)
        if self.server is not None:
            self.server.stop()
        with contextlib.suppress(OSError):
            self.write_pids()  # no live PIDs any more: a chaos script must not kill reused ones


def write_token(data_dir: Path, token: str) -> Path:
    """Write the gateway's API token to ``<data-dir>/token``, readable by its owner only."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)  # also when the file existed with other bits
        handle.write(token + "\n")
    return path


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def progress_line(elapsed_s: float, outer: dict | None, units: dict[int, dict]) -> str:
    """One line of live progress: global version, eval loss, per-unit step/loss/tokens/s."""
    outer = outer or {}
    evaluation = outer.get("eval") or {}
    parts = [
        f"[{elapsed_s:6.1f}s] v{outer.get('version', '-')}",
        f"eval {_fmt(evaluation.get('nats_per_byte'), '.3f')} nats/B",
    ]
    for unit in sorted(units):
        status = units[unit]
        parts.append(
            f"u{unit} {status.get('state', '?')[:4]} {status.get('step', 0)}"
            f" loss {_fmt(status.get('train_loss'), '.2f')}"
            f" {_fmt(status.get('tokens_per_s'), '.0f')} tok/s"
        )
    return " | ".join(parts)


async def _read_statuses(kv: Any, job: str, learners: int) -> tuple[dict | None, dict[int, dict]]:
    outer = await transport.get_json(kv, subjects.outer_status_key(job))
    units = {}
    for unit in range(learners):
        status = await transport.get_json(kv, subjects.unit_status_key(job, unit))
        if status is not None:
            units[unit] = status
    return outer, units


def _all_ready(cluster: Cluster, units: dict[int, dict], elapsed_s: float) -> bool:
    """Every live learner waits paused (loaded and compiled), or start-up took too long."""
    alive = [i for i, child in enumerate(cluster.learners) if child.alive()]
    ready = all(units.get(i, {}).get("state") == "paused" for i in alive)
    return ready or elapsed_s > READY_TIMEOUT_S


async def pause_all(cluster: Cluster) -> None:
    """Create every unit paused (before the learners start) so they can start together."""
    s = cluster.settings
    nc = await transport.connect(NatsSettings(nats_url=cluster.nats_url), "diloco-up")
    try:
        js = nc.jetstream()
        await transport.ensure_streams(js)
        desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
        for unit in range(s.learners):
            await transport.put_desired(desired_kv, s.job, unit, "paused")
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


def run_is_complete(cluster: Cluster, outer: dict | None, units: dict[int, dict]) -> bool:
    """All learners finished (or are left dead), the outer runs, applied all they published and
    evaluated the result (``outer`` and ``units`` must have just been read), and no registry
    job is left to run (one that is not stopped keeps the cluster up)."""
    if not cluster.learners_done() or cluster.jobs_busy() or not outer:
        return False
    if cluster.supervisor.state("outer") is not State.RUNNING:
        return False
    # Every round any unit ever published (across its restarts) was applied or rejected.
    evaluated = (outer.get("eval") or {}).get("version") == outer.get("version")
    return (
        outer.get("state") == "running" and ledger.balance(outer, units)["balanced"] and evaluated
    )


async def read_registry(
    jobs_kv: Any, desired_kv: Any, own_job: str
) -> tuple[dict[str, JobRecord], dict[str, dict[int, str]]]:
    """The registry's jobs (but ``own_job``) and, for those not stopped, their units' desired
    states. A record that does not parse is left out (the gateway writes only valid ones)."""
    keys = await transport.kv_keys(jobs_kv)
    records: dict[str, JobRecord] = {}
    desired: dict[str, dict[int, str]] = {}
    for key in sorted(keys):
        if key == own_job:
            continue
        try:
            entry = await jobs_kv.get(subjects.job_key(key))
        except nats.js.errors.KeyNotFoundError:
            continue
        if not entry.value:
            continue
        try:
            record = JobRecord.model_validate_json(entry.value)
        except ValidationError:
            continue
        records[key] = record
        if record.state == "stopped":
            continue
        states = desired[key] = {}
        for unit in range(record.units):
            found = await transport.get_json(desired_kv, subjects.desired_key(key, unit))
            if found and found.get("state") in transport.DESIRED_STATES:
                states[unit] = found["state"]
    return records, desired


async def _release_all(desired_kv: Any, job: str, learners: int) -> None:
    for unit in range(learners):
        await transport.put_desired(desired_kv, job, unit, "running")


async def supervise(cluster: Cluster, stop: asyncio.Event) -> dict[str, Any]:
    """Print progress and heal the cluster until the run completes, ``stop`` is set, the time
    limit passes or the outer or nats-server is left dead after its restarts.

    While nats-server is down (and being restarted) the status reads fail or are skipped; the
    connection reconnects by itself and the loop goes on.

    Returns:
        ``reason``, ``elapsed_s``, the last ``outer`` and ``units`` statuses read,
        ``tokens_per_s`` and ``restarts`` (per child name).
    """
    s = cluster.settings

    async def quiet(_err: Exception) -> None:
        """Connection errors while nats-server is down: the loop reports the outage once."""

    nc = await transport.connect(
        NatsSettings(nats_url=cluster.nats_url), "diloco-up", error_cb=quiet
    )
    js = nc.jetstream()
    await transport.ensure_streams(js)
    kv = await js.key_value(subjects.STATUS_BUCKET)
    desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
    jobs_kv = await js.key_value(subjects.JOBS_BUCKET)
    started = time.monotonic()
    last_print = 0.0
    last_reconcile = 0.0
    outer: dict | None = None
    units: dict[int, dict] = {}
    reason = "interrupted"
    nats_reachable = True
    # Training throughput is measured from the first inner step seen to the last token counted,
    # so start-up (imports, JIT compilation) and shutdown do not dilute it.
    first_step_at: float | None = None
    tokens_at_first_step = 0
    tokens_seen, tokens_changed_at = 0, started
    released = not s.start_together
    try:
        while not stop.is_set():
            elapsed = time.monotonic() - started
            fresh = False
            try:
                if not nc.is_connected:
                    raise nats.errors.ConnectionReconnectingError
                outer, units = await asyncio.wait_for(
                    _read_statuses(kv, s.job, s.learners), STATUS_READ_TIMEOUT_S
                )
                fresh = True
                if time.monotonic() - last_reconcile >= RECONCILE_EVERY_S:
                    records, desired = await asyncio.wait_for(
                        read_registry(jobs_kv, desired_kv, s.job), STATUS_READ_TIMEOUT_S
                    )
                    last_reconcile = time.monotonic()
                    if not stop.is_set():
                        cluster.reconcile(records, desired)
                if not released and _all_ready(cluster, units, elapsed):
                    await asyncio.wait_for(
                        _release_all(desired_kv, s.job, s.learners), STATUS_READ_TIMEOUT_S
                    )
                    released = True
                    cluster.print(f"[{elapsed:6.1f}s] all units ready: starting them together")
                if not nats_reachable:
                    cluster.print(f"[{elapsed:6.1f}s] NATS reachable again")
                    nats_reachable = True
            except NATS_ERRORS as err:
                if nats_reachable:
                    cluster.print(
                        f"[{elapsed:6.1f}s] NATS unreachable ({type(err).__name__}): "
                        "status reads paused"
                    )
                    nats_reachable = False
            if fresh:
                tokens = sum(u.get("tokens", 0) for u in units.values())
                if tokens > tokens_seen:
                    if first_step_at is None:
                        first_step_at = time.monotonic()
                        tokens_at_first_step = tokens
                    tokens_seen, tokens_changed_at = tokens, time.monotonic()
            if time.monotonic() - last_print >= s.progress_every_s:
                cluster.print(progress_line(elapsed, outer, units))
                last_print = time.monotonic()
            # A lost learner never stops the others; crashed children come back after a backoff.
            ended = cluster.heal(stop.is_set)
            if ended is not None:
                reason = ended
                break
            if fresh and run_is_complete(cluster, outer, units):
                reason = "finished"
                break
            if elapsed > s.max_duration_s:
                reason = f"time limit {s.max_duration_s:.0f}s reached"
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
    finally:
        with contextlib.suppress(*NATS_ERRORS):
            await asyncio.wait_for(nc.close(), timeout=5)
    training_s = tokens_changed_at - first_step_at if first_step_at is not None else 0.0
    return {
        "reason": reason,
        "elapsed_s": time.monotonic() - started,
        "outer": outer,
        "units": units,
        "tokens_per_s": (tokens_seen - tokens_at_first_step) / training_s if training_s else None,
        "restarts": cluster.supervisor.restarts(),
    }


def staleness_summary(histogram: dict[str, int]) -> str:
    """A staleness histogram in one short phrase: the whole of it when it has few values,
    else its median, 90th percentile and maximum."""
    counts = sorted((int(k), int(v)) for k, v in histogram.items())
    if len(counts) <= 6:
        return str({str(k): v for k, v in counts})
    total, running, marks = sum(v for _, v in counts), 0, {}
    for value, count in counts:
        running += count
        for name, share in (("median", 0.5), ("p90", 0.9)):
            if name not in marks and running >= share * total:
                marks[name] = value
    return f"median {marks['median']}, p90 {marks['p90']}, max {counts[-1][0]}"


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The end-of-run summary: initial vs final held-out loss, versions, tokens."""
    outer = result.get("outer") or {}
    init = outer.get("eval_init") or {}
    final = outer.get("eval") or {}
    lines = [
        f"run {result['reason']} after {result['elapsed_s']:.0f}s",
        f"global version      {outer.get('version', '-')}"
        f"  ({outer.get('applied', 0)} pseudo-gradients applied,"
        f" rejected {outer.get('rejected') or {}})",
        f"outer merges        {outer.get('merges', 0)}  (staleness of applied updates: "
        f"{staleness_summary(outer.get('staleness') or {})})",
        f"tokens applied      {outer.get('tokens_applied', 0):,}",
        f"training throughput {_fmt(result.get('tokens_per_s'), ',.0f')} tokens/s (all units)",
        f"held-out eval loss  {_fmt(init.get('nats_per_byte'), '.4f')} -> "
        f"{_fmt(final.get('nats_per_byte'), '.4f')} nats/byte "
        f"({_fmt(final.get('bits_per_byte'), '.4f')} bits/byte) at version {final.get('version')}",
    ]
    books = result.get("ledger") or ledger.balance(outer, result.get("units", {}))
    lines.append(
        f"ledger              {'balanced' if books['balanced'] else 'NOT balanced'}: "
        f"{books['published']} rounds published, {books['applied']} applied once, "
        f"{books['rejected']} rejected"
        + ("" if books["balanced"] else f"; {'; '.join(books['problems'][:3])}")
    )
    restarts = result.get("restarts") or {}
    if restarts:
        lines.append(
            "restarts            " + ", ".join(f"{name} {n}" for name, n in restarts.items())
        )
    for unit, status in sorted(result.get("units", {}).items()):
        counters = status.get("counters", {})
        lines.append(
            f"unit {unit}: {status.get('state')} at step {status.get('step')},"
            f" {counters.get('published', 0)} uploads, train loss {status.get('train_loss')}"
        )
    return lines


def write_summary(path: Path, result: dict[str, Any]) -> None:
    """Write the run's result (final statuses, ledger, restarts) as JSON, atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str, indent=1))
    os.replace(tmp, path)


def run_up(settings: UpSettings, out: TextIO = sys.stdout) -> int:
    """Run a local cluster to completion (or until SIGINT/SIGTERM); returns an exit code."""
    cluster = Cluster(settings, out=out)
    stop = asyncio.Event()

    def on_signal(signum: int, _frame: object) -> None:
        cluster.print(f"signal {signum}: stopping the cluster")
        loop.call_soon_threadsafe(stop.set)

    loop = asyncio.new_event_loop()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster.print(f"diloco up: job {settings.job}")
    try:
        cluster.start_services()
        if settings.start_together:
            loop.run_until_complete(pause_all(cluster))
        cluster.start_learners()
        result = loop.run_until_complete(supervise(cluster, stop))
        result["ledger"] = ledger.balance(result.get("outer"), result.get("units", {}))
        write_summary(Path(settings.data_dir) / SUMMARY_FILE, result)
        for line in summary_lines(result):
            cluster.print(line)
        return 0 if result["reason"] in ("finished", "interrupted") else 1
    finally:
        cluster.print("stopping services ...")
        cluster.stop()
        cluster.print("all services stopped")
        loop.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
