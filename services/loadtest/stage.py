"""One stage of a load test: a fresh nats-server and outer, N synthetic units, one measurement.

1. nats-server starts on an empty JetStream store and ``diloco outer`` on it (``--num-units``
   N, evaluating only at start: the load test measures merging, not evaluating), or one
   ``diloco outer --shard k`` per outer shard; the stage waits until the outer (every shard)
   reports ``running``. Its status is the shards' combined (``shared.outer_shards``), its CPU
   the sum of theirs.
2. N synthetic units (``unit.py``) start, each through its own shaped link (``LinkProxy``, in
   this process) unless the link is unshaped.
3. After the warm-up, the outer's status record and the units' counts are read at the start and
   the end of a window of ``stage_s``: rates are their differences over the window's length (the
   outer writes its record every second, so a rate may be off by a second's worth).
4. The units stop making uploads and send what they queued; the stage waits until the outer
   has applied (or rejected) every published upload, and for the heads that end their sync
   latencies.
5. Everything stops; the outer's last status record is balanced against the rounds each unit
   published (``shared.ledger.balance``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.link.proxy import LinkProxy
from services.loadtest.payloads import PayloadPool
from services.loadtest.records import LoadtestStage
from services.loadtest.report import StageNumbers, judge
from services.loadtest.settings import LoadtestSettings
from services.loadtest.unit import SyntheticUnit, UnitPlan
from services.orchestration import nats_server
from services.orchestration.children import popen
from shared import kv, subjects
from shared.latency import Latencies
from shared.ledger import balance
from shared.outer_shards import read_outer_status
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStatus
from shared.retry import NATS_ERRORS
from shared.settings.algorithm import InnerAlgorithmSettings
from shared.settings.nats import NatsSettings
from shared.settings.workload import BudgetSettings
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams

# A synthetic upload stands for the work of a learner of the shipped settings: H steps of its
# batch size.
H_STEPS = InnerAlgorithmSettings().h_steps
BATCH_SIZE = BudgetSettings().batch_size
log = logging.getLogger(__name__)

JOB = "loadtest"
OUTER_START_S = 600.0  # a cold JAX cache compiles the outer's programs first
POLL_S = 0.5
SYNC_WAIT_S = 30.0  # after the drain: the longest wait for the heads that end sync latencies
STOP_S = 60.0


class StageError(RuntimeError):
    """A stage could not be run (the outer did not start or died)."""


@dataclass
class Snapshot:
    """Counts at one moment of a stage."""

    at: float
    outer: OuterStatus
    published: int
    outer_cpu_s: float
    broker_cpu_s: float
    generator_cpu_s: float
    params_bytes: int


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stage:
    """One stage (see the module docstring); :meth:`run` returns its record."""

    def __init__(
        self,
        settings: LoadtestSettings,
        units: int,
        pools: list[PayloadPool],
        say: Callable[[str], None],
    ) -> None:
        """Args:
        settings: the load test's.
        units: the stage's synthetic units.
        pools: the pre-encoded pseudo-gradients of each fragment.
        say: prints a line.
        """
        self.settings = settings
        self.count = units
        self.pools = pools
        self.say = say
        self.folder = Path(settings.data_dir) / f"{units}-units"
        self.server: nats_server.NatsServer | None = None
        self.outers: list[subprocess.Popen[bytes]] = []  # one per outer shard
        self.outer_logs: list[Path] = []
        self.links: list[LinkProxy] = []
        self.units: list[SyntheticUnit] = []
        self.status_kv: Any = None

    async def run(self) -> LoadtestStage:
        """Run the stage and stop everything it started, however it ends."""
        if self.folder.exists():
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        self.server = nats_server.start_nats_server(self.folder / "nats", die_with_parent=True)
        nc = None
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            nc = await connect(NatsSettings(nats_url=self.server.url), "loadtest")
            js = nc.jetstream()
            await ensure_streams(js)
            self.status_kv = await js.key_value(subjects.STATUS_BUCKET)
            self._start_outers()
            await self._wait_for_outer()
            tasks = await self._start_units(stop)
            return await self._measure(tasks)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for link in self.links:
                await link.close()
            self._stop_outers()
            if nc is not None:
                with contextlib.suppress(*NATS_ERRORS, TimeoutError):
                    await asyncio.wait_for(nc.close(), 5.0)
            self.server.stop()

    # ---- start ---------------------------------------------------------------------------------

    def _start_outers(self) -> None:
        s = self.settings
        assert self.server is not None
        for shard in range(s.outer_shards):
            args = [
                "outer",
                *("--nats-url", self.server.url, "--job", JOB, "--model", s.model),
                *("--num-units", str(self.count), "--params-codec", s.params_codec),
                *("--eval-every-s", "3600", "--no-eval-when-idle"),
                # The fragments the synthetic units upload in turn (unit.py).
                *("--fragments", str(s.fragments)),
                *("--shards", str(s.outer_shards), "--shard", str(shard)),
            ]
            if s.commit_every_s is not None:
                args += ["--commit-every-s", f"{s.commit_every_s:g}"]
            # One compilation cache for every stage's outer (unless the caller has one).
            cache = os.environ.get("DILOCO_JAX_CACHE") or str(
                Path(s.data_dir, "jax-cache").resolve()
            )
            log_path = self.folder / ("outer.log" if s.outer_shards == 1 else f"outer-{shard}.log")
            self.outers.append(popen(args, {"DILOCO_JAX_CACHE": cache}, log_path))
            self.outer_logs.append(log_path)

    async def _wait_for_outer(self) -> None:
        deadline = time.monotonic() + OUTER_START_S
        while time.monotonic() < deadline:
            self._check_outer()
            status = await self._outer_status()
            if status is not None and status.state == "running":
                return
            await asyncio.sleep(POLL_S)
        raise StageError(f"the outer did not start within {OUTER_START_S:.0f} s")

    def _check_outer(self) -> None:
        for outer, log_path in zip(self.outers, self.outer_logs, strict=True):
            code = outer.poll()
            if code is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise StageError(f"the outer ({log_path.name}) exited with code {code}:\n{tail}")

    async def _start_units(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        s = self.settings
        assert self.server is not None
        spec = s.link_spec()
        shaped = spec.rate_bps is not None or spec.delay_s > 0
        rng = random.Random(s.seed)
        tasks = []
        for unit in range(self.count):
            url = self.server.url
            if shaped:
                link = LinkProxy(
                    spec, self.server.host, self.server.port, seed=rng.randrange(1 << 30)
                )
                url = f"nats://127.0.0.1:{await link.start()}"
                self.links.append(link)
            plan = UnitPlan(
                job=JOB,
                model=s.model,
                unit=unit,
                upload_every_s=s.upload_every_s,
                fragments=s.fragments,
                inner_steps=H_STEPS,
                tokens=H_STEPS * BATCH_SIZE * self.pools[0].seq_len,
                fetch_params=s.params_fetch == "newest",
                max_unsent=s.max_unsent,
                max_params_bytes=2 * max(pool.fp32_bytes for pool in self.pools) + (1 << 20),
            )
            synthetic = SyntheticUnit(plan, self.pools, random.Random(rng.random()))
            self.units.append(synthetic)
            tasks.append(asyncio.create_task(synthetic.run(url, stop)))
        return tasks

    # ---- measure -------------------------------------------------------------------------------

    async def _measure(self, tasks: list[asyncio.Task[None]]) -> LoadtestStage:
        s = self.settings
        before = await self._outer_status()
        applied = before.applied if before is not None else 0
        await self._sleep(s.warmup(), tasks)
        # And until the outer has applied an upload of this stage: its first merges compile
        # (a new number of units per merge compiles its combine), which took a loaded 2-core
        # machine longer than a short warm-up, and the window then measured the compiler.
        await self._until(lambda outer: outer.applied > applied, s.drain_s, tasks)
        start = await self._snapshot()
        await self._sleep(s.stage_s, tasks)
        end = await self._snapshot()
        self.say(f"  {self.count} units: window done, draining")
        for unit in self.units:
            unit.stop_producing()
        drained_from = time.monotonic()
        await self._until(
            lambda outer: self._done(outer) >= self._published() and not self._unsent(),
            s.drain_s,
            tasks,
        )
        drain_s = time.monotonic() - drained_from
        sync_deadline = time.monotonic() + SYNC_WAIT_S
        while any(u.tally.sync_pending() for u in self.units) and time.monotonic() < sync_deadline:
            await asyncio.sleep(POLL_S)
        final = await self._final_outer_status()
        return self._record(start, end, drain_s, final)

    async def _sleep(self, seconds: float, tasks: list[asyncio.Task[None]]) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._check_outer()
            _raise_failed(tasks)
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))

    async def _until(
        self,
        condition: Callable[[OuterStatus], bool],
        timeout_s: float,
        tasks: list[asyncio.Task[None]],
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            outer = await self._outer_status()
            if outer is not None and condition(outer):
                return
            await self._sleep(POLL_S, tasks)
        log.warning("%d units: the outer did not catch up within %.0f s", self.count, timeout_s)

    async def _snapshot(self) -> Snapshot:
        outer = await self._outer_status()
        if outer is None:
            raise StageError("the outer's status record is missing")
        assert self.server is not None
        return Snapshot(
            at=time.monotonic(),
            outer=outer,
            published=self._published(),
            outer_cpu_s=sum(cpu_seconds(outer.pid) for outer in self.outers),
            broker_cpu_s=cpu_seconds(self.server.pid),
            generator_cpu_s=time.process_time(),
            params_bytes=sum(u.tally.params_bytes for u in self.units),
        )

    async def _outer_status(self) -> OuterStatus | None:
        try:
            record = await read_outer_status(self.status_kv, JOB)
        except (*NATS_ERRORS, kv.KvError, TimeoutError) as err:
            log.info("outer status: %r", err)
            return None
        return record if isinstance(record, OuterStatus) else None

    async def _final_outer_status(self) -> OuterStatus | None:
        """Stop the outer (every shard) and read the status records it writes last."""
        for outer in self.outers:
            outer.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        for outer in self.outers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await loop.run_in_executor(None, outer.wait, STOP_S)
        return await self._outer_status()

    def _published(self) -> int:
        return sum(len(u.tally.published) for u in self.units)

    def _unsent(self) -> int:
        return sum(u.unsent() for u in self.units)

    @staticmethod
    def _done(outer: OuterStatus) -> int:
        return outer.applied + sum(outer.rejected.values())

    def _record(
        self, start: Snapshot, end: Snapshot, drain_s: float, final: OuterStatus | None
    ) -> LoadtestStage:
        window = max(end.at - start.at, 1e-9)
        latencies = Latencies(kept=1 << 22)
        for unit in self.units:
            for sync in unit.tally.syncs.values():
                for value in sync.latencies.values():
                    latencies.add(value)
        units = {
            u.plan.unit: UnitStatus(
                unit=u.plan.unit,
                published_rounds=u.tally.published.ranges(),
                next_round=u.next_round,
            )
            for u in self.units
        }
        applied = end.outer.applied - start.outer.applied
        merges = end.outer.merges - start.outer.merges
        commits = end.outer.checkpoints - start.outer.checkpoints
        numbers = StageNumbers(
            units=self.count,
            offered=self.count * self.settings.fragments / self.settings.upload_every_s,
            ingest=applied / window,
            backlog_start=start.published - self._done(start.outer),
            backlog_end=end.published - self._done(end.outer),
            dropped=sum(u.tally.dropped_unsent for u in self.units),
        )
        saturated, reason = judge(numbers, self.settings.saturation_share)
        return LoadtestStage(
            units=self.count,
            window_s=round(window, 3),
            offered_uploads_per_s=numbers.offered,
            published_per_s=(end.published - start.published) / window,
            ingest_uploads_per_s=numbers.ingest,
            ingest_mb_per_s=(end.outer.payload_bytes - start.outer.payload_bytes) / window / 1e6,
            merges_per_s=merges / window,
            uploads_per_merge=applied / merges if merges else 0.0,
            uploads_per_commit=applied / commits if commits else 0.0,
            sync_latency=latencies.summary(),
            backlog_start=numbers.backlog_start,
            backlog_end=numbers.backlog_end,
            dropped_unsent=numbers.dropped,
            params_mb_per_s=(end.params_bytes - start.params_bytes) / window / 1e6,
            heads_rejected=sum(u.tally.heads_rejected for u in self.units),
            outer_cpu=(end.outer_cpu_s - start.outer_cpu_s) / window,
            broker_cpu=(end.broker_cpu_s - start.broker_cpu_s) / window,
            generator_cpu=(end.generator_cpu_s - start.generator_cpu_s) / window,
            drain_s=round(drain_s, 3),
            books=balance(final, units),
            saturated=saturated,
            reason=reason,
        )

    def _stop_outers(self) -> None:
        for outer in self.outers:
            if outer.poll() is None:
                outer.send_signal(signal.SIGTERM)
        for outer in self.outers:
            try:
                outer.wait(STOP_S)
            except subprocess.TimeoutExpired:
                outer.kill()
                outer.wait()


def _raise_failed(tasks: list[asyncio.Task[None]]) -> None:
    """Raise the error of a unit task that failed."""
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise StageError(f"a synthetic unit failed: {task.exception()!r}")
