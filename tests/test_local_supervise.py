"""The loop of ``diloco up`` (``services.orchestration.local.run.supervise``) against the
in-memory NATS server, with stand-in children and status records written by the test: it
releases the units together, shows progress, notices an unreachable NATS, and ends the run once
the books balance. No JAX."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

from services.orchestration.local import files, release, run
from services.orchestration.local.cluster import Cluster
from services.orchestration.local.records import RunSummary
from services.orchestration.local.run import supervise
from services.orchestration.local.settings import UpSettings
from shared import kv, subjects
from shared.records.jobs import DesiredRecord
from shared.records.outer import EvalRecord, EvaluationRecord, OuterStatus
from shared.records.unit import UnitStatus
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from tests.helpers import wait_for_async

JOB = "own"
# Says it is ready, runs until SIGTERM, then exits 0 as a learner that uploaded what it had.
STAND_IN = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
STAND_IN += "print('ready', flush=True); time.sleep(60)"


def stand_in(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen([sys.executable, "-c", STAND_IN], stdout=log_file)


async def until(predicate, what: str) -> None:
    await wait_for_async(predicate, 20, what)


def _has(out: io.StringIO, *parts: str, lines: int = 1) -> bool:
    """Whether ``lines`` lines of ``out`` each hold every one of ``parts``."""
    found = [line for line in out.getvalue().splitlines() if all(p in line for p in parts)]
    return len(found) >= lines


def _has_text(path: Path, text: str) -> bool:
    return text in path.read_text()


def test_supervise_releases_the_units_together_and_finishes_when_the_books_balance(
    memory_nats, tmp_path, monkeypatch
):
    monkeypatch.setattr(run, "TICK_S", 0.1)  # the loop's period (0.5 s in diloco up)
    settings = UpSettings(job=JOB, learners=2, data_dir=str(tmp_path), progress_every_s=0.2)
    out = io.StringIO()
    cluster = Cluster(settings, out=out, launch=stand_in)
    cluster.servers = [memory_nats]
    cluster.services.append(cluster.spawn("outer", ["outer"]))
    for unit in range(2):
        cluster.learners.append(cluster.spawn(f"learner-{unit}", ["learner"], may_finish=True))

    async def scenario() -> RunSummary:
        await release.hold_units(NatsSettings(nats_url=memory_nats.url), JOB, 2)
        nc = await connect(NatsSettings(nats_url=memory_nats.url), "test")
        js = nc.jetstream()
        status_kv = await js.key_value(subjects.STATUS_BUCKET)
        desired_kv = await js.key_value(subjects.DESIRED_BUCKET)

        async def desired(unit: int) -> str | None:
            found = await kv.get(desired_kv, subjects.desired_key(JOB, unit), DesiredRecord)
            return found.state if found else None

        async def put_unit(status: UnitStatus) -> None:
            await kv.put(status_kv, subjects.unit_status_key(JOB, status.unit), status)

        stop = asyncio.Event()
        loop = asyncio.create_task(supervise(cluster, stop))
        try:
            await put_unit(UnitStatus(unit=0, state="paused"))
            # A progress line shows a status the loop has read and acted on (it releases the
            # units before it prints): unit 1 has not reported ready, so neither is released.
            await until(lambda: _has(out, "| u0 paus 0"), "unit 0 seen paused")
            assert [await desired(0), await desired(1)] == ["paused", "paused"]
            await put_unit(UnitStatus(unit=1, state="paused"))

            async def released() -> bool:
                return [await desired(0), await desired(1)] == ["running", "running"]

            await until(released, "both units released")
            published = [(0, 2)]
            for unit in range(2):
                status = UnitStatus(
                    unit=unit, state="finished", step=30, published_rounds=published
                )
                await put_unit(status)
            last = EvalRecord(version=6, tokens=6000, nats_per_byte=4.0, bits_per_byte=5.8)
            outer = OuterStatus(
                state="running",
                model="tiny",
                holder="h",
                version=6,
                applied=6,
                applied_rounds={0: published, 1: published},
                evaluation=EvaluationRecord(init=last, last=last),
            )
            await kv.put(status_kv, subjects.outer_status_key(JOB, 0), outer)
            # Two progress lines show the balanced books: the loop judged them at least once
            # (after the first line) and went on, since the learners still run.
            await until(
                lambda: _has(out, "v6 ", "| u0 fini 30", "| u1 fini 30", lines=2),
                "two looks at the balanced books",
            )
            assert not loop.done()
            memory_nats.kill()  # an outage: the loop goes on with the last records read
            await until(lambda: _has(out, "NATS unreachable"), "the outage to be noticed")
            memory_nats.restart()
            await until(lambda: _has(out, "NATS reachable again"), "NATS to come back")
            for child in cluster.learners:
                await until(lambda c=child: _has_text(c.log_path, "ready"), "stand-in ready")
                child.terminate()
            return await asyncio.wait_for(loop, 20)
        finally:
            stop.set()
            await nc.close()

    try:
        summary = asyncio.run(scenario())
    finally:
        cluster.stop()
    text = out.getvalue()
    assert summary.reason == "finished", text
    assert summary.ledger.balanced and summary.ledger.published == 6
    assert set(summary.units) == {0, 1} and summary.outer is not None
    assert "all units ready: starting them together" in text
    assert "| u0 fini 30 loss - 0 tok/s | u1 fini 30" in text
    assert files.read_pids(tmp_path) is not None
