"""``diloco up``: run a whole local cluster — nats-server, outer, gateway, N learners — to the end.

The cluster starts (``services.orchestration.local.cluster``), the units are released together
(``services.orchestration.local.release``), and then about twice a second this loop reads the job's
status records, shows progress, heals the cluster, and about once a second matches the processes of
the registry's jobs with the registry. The run ends by itself once every unit has finished and the
outer has applied (and evaluated) everything they published, when the time limit passes, when the
outer or nats-server is left dead, or on SIGINT/SIGTERM; then the cluster stops, and the summary is
printed and written to ``<data-dir>/summary.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import nats.errors

from services.learner.unit_state import read_state_file, state_file
from services.orchestration import commands
from services.orchestration.children import Launch, popen
from services.orchestration.local import files, release
from services.orchestration.local.chaos import unit_of_target
from services.orchestration.local.cluster import Cluster
from services.orchestration.local.progress import Throughput, progress_line, summary_lines
from services.orchestration.local.records import RunSummary
from services.orchestration.local.settings import UpSettings
from services.orchestration.registry import Registry, read_registry
from shared import kv, ledger, retry, subjects, transport
from shared.goodput import Goodput, job_goodput
from shared.job_status import JobStatus, read_job_status
from shared.records.jobs import DesiredRecord, DesiredState
from shared.records.link import LinkStatus
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStateFile, UnitStatus
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams

STATUS_READ_TIMEOUT_S = 3.0  # bounds a status read while NATS is down, so healing goes on
RECONCILE_EVERY_S = 1.0  # how often the registry's jobs are read and their processes matched
TICK_S = 0.5  # the loop's period
CLOSE_TIMEOUT_S = 5.0
NATS_ERRORS = (*retry.NATS_ERRORS, kv.KvError, transport.TransportError)
SUCCESS = ("finished", "interrupted")  # the reasons a run ends with exit code 0


def job_is_complete(outer: OuterStatus | None, units: Mapping[int, UnitStatus]) -> bool:
    """The outer runs, every round any unit ever published (across its restarts) was applied or
    rejected, and the outer evaluated the result (``outer`` and ``units`` just read)."""
    if outer is None or outer.state != "running":
        return False
    last = outer.evaluation.last
    evaluated = last is not None and last.version == outer.version
    return evaluated and ledger.balance(outer, units).balanced


@dataclass
class _Watch:
    """What the loop knows between two ticks: the last status records read and its flags."""

    released: bool
    outer: OuterStatus | None = None
    units: dict[int, UnitStatus] = field(default_factory=dict)
    links: dict[str, LinkStatus] = field(default_factory=dict)
    nats_reachable: bool = True
    last_reconcile: float = 0.0
    throughput: Throughput = field(default_factory=Throughput)
    status: JobStatus | None = None  # the last read of the job's status records
    started_at: float | None = None  # when the units were started (together), unix seconds
    chaos_offset_s: float | None = None  # how far the failure schedule had run by then
    # (job, unit) shut out, with the unit's state file as its killed learner left it (this
    # run's job; None for a registry job's unit, or where there is none).
    quarantined: dict[tuple[str, int], UnitStateFile | None] = field(default_factory=dict)

    def start(self, cluster: Cluster) -> None:
        """Note that the units start now, and how far the failure schedule has run."""
        self.started_at = time.time()
        self.chaos_offset_s = time.monotonic() - cluster.chaos_started

    def goodput(self) -> Goodput | None:
        """Each unit's goodput from its first training to its end (or the last read)."""
        return job_goodput(self.status) if self.status is not None else None


async def supervise(cluster: Cluster, stop: asyncio.Event) -> RunSummary:
    """Show progress and heal the cluster until the run completes, ``stop`` is set, the time
    limit passes or the outer or nats-server is left dead after its restarts.

    While nats-server is down (and being restarted) the status reads fail or are skipped; the
    connection reconnects by itself and the loop goes on with the last records read.

    Returns:
        The run's summary: why it ended, the last status records read, throughput, restarts
        and the ledger's balance.
    """
    s = cluster.settings

    async def quiet(_err: Exception) -> None:
        """Connection errors while nats-server is down: the loop reports the outage once."""

    admin = cluster.admin_settings()
    nc = await connect(admin, "diloco-up", error_cb=quiet)
    js = nc.jetstream()
    await ensure_streams(js, admin.nats_replicas)
    desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
    jobs_kv = await js.key_value(subjects.JOBS_BUCKET)
    started = time.monotonic()
    last_print = 0.0
    watch = _Watch(released=not s.start_together)
    if watch.released:
        watch.start(cluster)
    reason = "interrupted"

    async def read() -> None:
        """Read the job's status records."""
        if not nc.is_connected:
            raise nats.errors.ConnectionReconnectingError
        status = await asyncio.wait_for(read_job_status(nc, js, s.job), STATUS_READ_TIMEOUT_S)
        watch.status = status
        watch.outer = status.outer_record()
        watch.units = with_quarantined_state_files(cluster, status.unit_records(), watch)
        watch.links = {name: entry.record for name, entry in status.links.items()}

    async def act(elapsed: float) -> None:
        """Match the registry's processes and release the units, when due."""
        if time.monotonic() - watch.last_reconcile >= RECONCILE_EVERY_S:
            registry = await asyncio.wait_for(
                read_registry(nc, jobs_kv, desired_kv, s.job), STATUS_READ_TIMEOUT_S
            )
            watch.last_reconcile = time.monotonic()
            if not stop.is_set():
                cluster.reconcile(registry)
                await shut_out_quarantined(cluster, registry, desired_kv, watch)
        alive = [unit for unit, child in enumerate(cluster.learners) if child.alive()]
        if not watch.released and release.all_ready(alive, watch.units, elapsed):
            await asyncio.wait_for(
                release.set_desired(desired_kv, s.job, s.learners, "running"),
                STATUS_READ_TIMEOUT_S,
            )
            watch.released = True
            watch.start(cluster)
            cluster.print(f"[{elapsed:6.1f}s] all units ready: starting them together")

    try:
        while not stop.is_set():
            elapsed = time.monotonic() - started
            fresh = False
            try:
                await read()
                fresh = True
                await act(elapsed)
                if not watch.nats_reachable:
                    cluster.print(f"[{elapsed:6.1f}s] NATS reachable again")
                    watch.nats_reachable = True
            except NATS_ERRORS as err:
                if watch.nats_reachable:
                    cluster.print(
                        f"[{elapsed:6.1f}s] NATS unreachable ({type(err).__name__}): "
                        "status reads paused"
                    )
                    watch.nats_reachable = False
            if fresh:
                watch.throughput.observe(watch.units)
            if time.monotonic() - last_print >= s.progress_every_s:
                cluster.print(progress_line(elapsed, watch.outer, watch.units))
                last_print = time.monotonic()
            await inject_failures(cluster, desired_kv, watch.released)
            # A lost learner never stops the others; crashed children come back after a backoff.
            ended = cluster.heal(stop.is_set)
            if ended is not None:
                reason = ended
                break
            if fresh and cluster.ready_to_end() and job_is_complete(watch.outer, watch.units):
                reason = "finished"
                break
            if target_reached(watch.outer, s.stop_at_eval):
                reason = f"target eval {s.stop_at_eval:g} nats/byte reached"
                break
            if elapsed > s.max_duration_s:
                reason = f"time limit {s.max_duration_s:.0f}s reached"
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=TICK_S)
    finally:
        with contextlib.suppress(*NATS_ERRORS):
            await asyncio.wait_for(nc.close(), timeout=CLOSE_TIMEOUT_S)
    return RunSummary(
        reason=reason,
        elapsed_s=time.monotonic() - started,
        outer=watch.outer,
        units=watch.units,
        links=watch.links,
        tokens_per_s=watch.throughput.tokens_per_s(),
        restarts=cluster.supervisor.restarts(),
        ledger=ledger.balance(watch.outer, watch.units),
        chaos=[e for e in cluster.chaos if e.at_s <= time.monotonic() - cluster.chaos_started],
        goodput=watch.goodput(),
        started_at=watch.started_at,
        chaos_offset_s=watch.chaos_offset_s if cluster.chaos else None,
    )


async def shut_out_quarantined(
    cluster: Cluster, registry: Registry, desired_kv: Any, watch: _Watch
) -> None:
    """Quarantine (``Cluster.quarantine``) each unit, of this run's job or a registry job,
    whose desired state became ``quarantined`` (through the REST API)."""
    s = cluster.settings
    wanted = {
        (job, unit)
        for job, states in registry.desired.items()
        for unit, st in states.items()
        if st == "quarantined"
    }
    for unit in range(s.learners):
        record = await kv.get(desired_kv, subjects.desired_key(s.job, unit), DesiredRecord)
        if record is not None and record.state == "quarantined":
            wanted.add((s.job, unit))
    for job, unit in sorted(wanted - watch.quarantined.keys()):
        cluster.quarantine(job, unit)  # its learner has exited: the file no longer changes
        state = None
        if job == s.job:
            path = state_file(commands.checkpoint_dir(s), job, unit)
            state = read_state_file(path, job, unit)
        watch.quarantined[(job, unit)] = state


def with_quarantined_state_files(
    cluster: Cluster, units: dict[int, UnitStatus], watch: _Watch
) -> dict[int, UnitStatus]:
    """``units`` with the state file of each of this run's quarantined units folded into its
    status record (``ledger.with_state_file``): its learner is killed and its NATS user gone,
    so its status record stops where it was, while the outer may still have applied the rounds
    it published since. Without them the books would never balance and the run never end."""
    for (job, unit), state in watch.quarantined.items():
        if job == cluster.settings.job and state is not None:
            units[unit] = ledger.with_state_file(units.get(unit), unit, state)
    return units


def target_reached(outer: OuterStatus | None, target: float | None) -> bool:
    """Whether the outer's newest held-out eval is at or below ``target`` (never without one)."""
    if target is None or outer is None or outer.evaluation.last is None:
        return False
    loss = outer.evaluation.last.nats_per_byte
    return loss is not None and loss <= target


async def inject_failures(cluster: Cluster, desired_kv: Any, released: bool) -> None:
    """Start the failures whose time has come and end the pauses whose repair is over, each
    shown with its time (``chaos.py``). Before the units are released (``--start-together``)
    a pause ends without a resume: the release starts every unit."""
    if not cluster.chaos:
        return
    now = time.monotonic() - cluster.chaos_started
    for event in cluster.chaos_clock.starting(now):
        cluster.print(
            f"[chaos {event.at_s:7.1f}s] {event.kind} {event.target} for {event.repair_s:.1f} s"
        )
        unit = unit_of_target(event.target)
        if event.kind == "kill":
            cluster.kill_for_chaos(event)
        elif event.kind == "pause" and unit is not None:
            await _set_desired(cluster, desired_kv, unit, "paused")
        # A cut is the unit's link's own outage, scheduled when the link started.
    for event in cluster.chaos_clock.pauses_ending(now):
        unit = unit_of_target(event.target)
        assert unit is not None
        if released:
            await _set_desired(cluster, desired_kv, unit, "running")
            cluster.print(f"[chaos {now:7.1f}s] resume {event.target}")


async def _set_desired(cluster: Cluster, desired_kv: Any, unit: int, state: DesiredState) -> None:
    key = subjects.desired_key(cluster.settings.job, unit)
    try:
        await asyncio.wait_for(
            kv.put(desired_kv, key, DesiredRecord(state=state)), STATUS_READ_TIMEOUT_S
        )
    except NATS_ERRORS as err:
        cluster.print(f"chaos: unit {unit} not set {state} ({type(err).__name__})")


def run_up(settings: UpSettings, out: TextIO = sys.stdout, launch: Launch = popen) -> int:
    """Run a local cluster to completion (or until SIGINT/SIGTERM).

    Args:
        settings: the run's options.
        out: where the progress and the summary go.
        launch: starts the service processes (a stand-in in tests).

    Returns:
        The exit code: 0 when the run finished or was interrupted, else 1.
    """
    cluster = Cluster(settings, out=out, launch=launch)
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
            loop.run_until_complete(
                release.hold_units(cluster.admin_settings(), settings.job, settings.learners)
            )
        cluster.start_learners()
        summary = loop.run_until_complete(supervise(cluster, stop))
        files.write_summary(cluster.data_dir, summary)
        for line in summary_lines(summary):
            cluster.print(line)
        return 0 if summary.reason in SUCCESS else 1
    finally:
        cluster.print("stopping services ...")
        cluster.stop()
        cluster.print("all services stopped")
        loop.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
