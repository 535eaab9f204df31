"""Timing claims on the real clock: the link shaper keeps its rate, delay and outage schedule.

The tests prove these behaviours on a virtual clock (``tests/test_link_proxy.py``), where the
schedule plays out exactly. Here the same schedule runs on the wall clock, on loopback, and
each claim is a ratio measured within this run:

* **rate**: two seconds' worth of bytes through a 1, 10 and 100 Mbit/s link; the rate the
  receiver sees, first byte to last, over the cap: within 1 ± 0.1;
* **delay**: the median round trip through a 25 ms link minus the median direct one, over the
  50 ms the link adds: within 1 ± 0.1;
* **outages**: a 0.2 s stall at 0.2 s and a 0.2 s cut at 0.6 s after the link started; how far
  each began and ended from its schedule (sampled every 5 ms), over its duration: at most 0.25.

And one of synchronous DiLoCo (``tests/test_sync_mode.py`` proves the behaviour, the merge
policy's wait on its own clock ``tests/test_outer_core.py``):

* **sync hold**: ``--mode sync`` with three learners (tiny model), one killed with SIGKILL once
  every unit has had two rounds applied; the longest time between two global versions in the
  12 s after the kill (a round waits for the silent unit up to ``--sync-timeout-s``, 6 s), over
  that timeout: at least 0.7.

Exits 1 when a claim fails.

    .venv/bin/python bench/timing.py [--only link|sync] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from report import shown_command, write_section  # bench/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.link.proxy import LinkProxy
from services.orchestration.nats_server import start_nats_server
from shared import transport
from shared.job_status import read_job_status
from shared.kv import KvError
from shared.link_spec import LinkSpec, parse_link, parse_outages
from shared.records import OuterStatus
from shared.settings import NatsSettings

SECTION = "## Timing on the real clock"
RATES_MBIT = [1, 10, 100]
DELAY_S = 0.025
OUTAGES = "0.2s+0.2s,0.6s+0.2s:cut"
SYNC_TIMEOUT_S = 6.0
SYNC_WATCH_S = 12.0


@dataclass(frozen=True)
class Claim:
    """One measured ratio and the range it must fall in."""

    name: str
    ratio: float
    low: float
    high: float

    @property
    def holds(self) -> bool:
        return self.low <= self.ratio <= self.high

    def allowed(self) -> str:
        return f"≥ {self.low:g}" if self.high == float("inf") else f"{self.low:g} – {self.high:g}"


async def receiver() -> tuple[asyncio.Server, list[tuple[float, int]]]:
    """A TCP server that reads everything, noting when each chunk came (monotonic seconds)."""
    received: list[tuple[float, int]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            received.append((time.monotonic(), len(data)))
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), received


async def echo() -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def port_of(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


async def rate_claim(mbit: int) -> Claim:
    server, received = await receiver()
    proxy = LinkProxy(LinkSpec(rate_bps=mbit * 1e6), "127.0.0.1", port_of(server))
    size = int(mbit * 1e6 / 8 * 2.0)
    _, writer = await asyncio.open_connection("127.0.0.1", await proxy.start())
    writer.write(b"\x5a" * size)
    await writer.drain()
    while sum(n for _, n in received) < size:
        await asyncio.sleep(0.005)
    (first, first_size), (last, _) = received[0], received[-1]
    writer.close()
    await proxy.close()
    server.close()
    seen_bps = (size - first_size) * 8 / (last - first)
    return Claim(f"rate at {mbit} Mbit/s: seen / cap", seen_bps / (mbit * 1e6), 0.9, 1.1)


async def median_round_trip(port: int, count: int = 20) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(count):
        start = time.monotonic()
        writer.write(b"ping")
        await reader.readexactly(4)
        times.append(time.monotonic() - start)
    writer.close()
    return statistics.median(times)


async def delay_claim() -> Claim:
    server = await echo()
    direct = await median_round_trip(port_of(server))
    proxy = LinkProxy(LinkSpec(delay_s=DELAY_S), "127.0.0.1", port_of(server))
    shaped = await median_round_trip(await proxy.start())
    await proxy.close()
    server.close()
    return Claim(
        "delay 25 ms: added round trip / 50 ms", (shaped - direct) / (2 * DELAY_S), 0.9, 1.1
    )


async def outage_claims() -> list[Claim]:
    server = await echo()
    proxy = LinkProxy(parse_link("unlimited"), "127.0.0.1", port_of(server))
    await proxy.start()
    started = time.monotonic()
    outages = parse_outages(OUTAGES)
    schedule = asyncio.create_task(proxy.run_outages(outages))
    seen: list[tuple[float, str | None]] = []
    while not schedule.done():
        seen.append((time.monotonic() - started, proxy.counters().outage))
        await asyncio.sleep(0.005)
    await proxy.close()
    server.close()
    claims = []
    for outage in outages:
        during = [t for t, mode in seen if mode == outage.mode]
        off = max(
            abs(min(during) - outage.start_s),
            abs(max(during) - (outage.start_s + outage.duration_s)),
        )
        claims.append(
            Claim(
                f"{outage.text()}: off schedule / duration",
                off / outage.duration_s,
                0.0,
                0.25,
            )
        )
    return claims


async def link_claims() -> list[Claim]:
    claims = [await rate_claim(mbit) for mbit in RATES_MBIT]
    claims.append(await delay_claim())
    return claims + await outage_claims()


def outer_status(url: str, job: str) -> OuterStatus | None:
    async def read() -> OuterStatus | None:
        nc = await transport.connect(NatsSettings(nats_url=url), "bench-timing")
        try:
            return (await read_job_status(nc, nc.jetstream(), job)).outer_record()
        finally:
            await nc.close()

    try:
        return asyncio.run(read())
    except KvError:  # no status bucket yet: no outer has started
        return None


def until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def sync_hold_claim() -> Claim:
    job = "timing-sync"
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats_server(Path(tmp, "nats"))
        flags = [
            *("--nats-url", server.url, "--job", job, "--model", "tiny", "--seed", "1"),
            *("--mode", "sync", "--sync-timeout-s", str(SYNC_TIMEOUT_S), "--num-units", "3"),
        ]
        env = {**os.environ, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
        processes: list[subprocess.Popen[bytes]] = []

        def start(*args: str) -> subprocess.Popen[bytes]:
            command = [sys.executable, "-m", "services.cli", *args]
            with open(Path(tmp, f"{len(processes)}.log"), "wb") as log:
                process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
            processes.append(process)
            return process

        try:
            start("outer", *flags, "--eval-every-s", "60")
            until(
                lambda: (s := outer_status(server.url, job)) is not None and s.state == "running",
                300,
                "the outer to run",
            )
            learners = [
                start(
                    "learner",
                    *flags,
                    *("--unit", str(unit), "--max-steps", "100000", "--h-steps", "10"),
                    *("--no-dynamic-h", "--slowdown", "3"),
                )
                for unit in range(3)
            ]

            def every_unit_applied_twice() -> bool:
                status = outer_status(server.url, job)
                ledger = status.units if status is not None else {}
                return all(u in ledger and ledger[u].applied >= 2 for u in range(3))

            until(every_unit_applied_twice, 300, "two rounds of every unit applied")
            learners[2].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            changes, version = [killed_at], None
            while time.monotonic() - killed_at < SYNC_WATCH_S:
                status = outer_status(server.url, job)
                if status is not None:
                    if version is not None and status.version != version:
                        changes.append(time.monotonic())
                    version = status.version
                time.sleep(0.1)
            changes.append(time.monotonic())
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
            server.stop()
    longest = max(b - a for a, b in zip(changes[:-1], changes[1:], strict=True))
    name = f"sync hold: longest gap between versions after a kill / {SYNC_TIMEOUT_S:g} s timeout"
    return Claim(name, longest / SYNC_TIMEOUT_S, 0.7, float("inf"))


def table(claims: list[Claim], command: str) -> str:
    lines = [
        SECTION,
        "",
        f"`{command}` — on the wall clock of this machine, {os.cpu_count()} cores: the link "
        "shaper (`services/link/proxy.py`) on loopback, and a sync round held for a killed "
        "unit (`diloco outer` and three `diloco learner`s, tiny model). Each row a ratio "
        "measured within the run and the range the claim allows; the tests prove the same "
        "behaviour on a virtual or logical clock.",
        "",
        "| claim | ratio | allowed | holds |",
        "|---|---|---|---|",
    ]
    for claim in claims:
        lines.append(
            f"| {claim.name} | {claim.ratio:.3f} | {claim.allowed()} "
            f"| {'yes' if claim.holds else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["link", "sync"], help="measure only these claims")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    claims = []
    if args.only in (None, "link"):
        claims += asyncio.run(link_claims())
    if args.only in (None, "sync"):
        claims.append(sync_hold_claim())
    text = table(claims, shown_command(".venv/bin/python bench/timing.py"))
    print(text)
    if args.write:
        write_section(SECTION, text)
    failed = [claim.name for claim in claims if not claim.holds]
    if failed:
        raise SystemExit(f"claims that failed: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
