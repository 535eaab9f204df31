"""Timing claims on the wall clock: the link shaper's rate, delay and outages; a sync round's hold.

The tests prove the link shaper's behaviour on a virtual clock (``tests/test_link_proxy.py``),
where its schedule plays out exactly. Here the same schedule runs on the wall clock, through the
same loopback servers (``tests/loopback.py``), and each claim is a ratio measured within this
run:

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
from shared.link_spec import LinkSpec, parse_link, parse_outages
from tests.helpers import ServiceProcesses, read_status, wait_for
from tests.loopback import Sink, echo_server, port_of, round_trips

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


async def rate_claim(mbit: int) -> Claim:
    sink = Sink()
    proxy = LinkProxy(LinkSpec(rate_bps=mbit * 1e6), "127.0.0.1", await sink.start())
    size = int(mbit * 1e6 / 8 * 2.0)
    _, writer = await asyncio.open_connection("127.0.0.1", await proxy.start())
    writer.write(b"\x5a" * size)
    await writer.drain()
    while sink.total < size:
        await asyncio.sleep(0.005)
    (first, first_size), (last, _) = sink.received[0], sink.received[-1]
    writer.close()
    await proxy.close()
    await sink.close()
    seen_bps = (size - first_size) * 8 / (last - first)
    return Claim(f"rate at {mbit} Mbit/s: seen / cap", seen_bps / (mbit * 1e6), 0.9, 1.1)


async def delay_claim() -> Claim:
    server = await echo_server()
    direct = statistics.median(await round_trips(port_of(server), 20))
    proxy = LinkProxy(LinkSpec(delay_s=DELAY_S), "127.0.0.1", port_of(server))
    shaped = statistics.median(await round_trips(await proxy.start(), 20))
    await proxy.close()
    server.close()
    return Claim(
        "delay 25 ms: added round trip / 50 ms", (shaped - direct) / (2 * DELAY_S), 0.9, 1.1
    )


async def outage_claims() -> list[Claim]:
    server = await echo_server()
    proxy = LinkProxy(parse_link("unlimited"), "127.0.0.1", port_of(server))
    await proxy.start()
    loop = asyncio.get_running_loop()
    started = loop.time()
    outages = parse_outages(OUTAGES)
    schedule = asyncio.create_task(proxy.run_outages(outages))
    seen: list[tuple[float, str | None]] = []
    while not schedule.done():
        seen.append((loop.time() - started, proxy.counters().outage))
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


def sync_hold_claim() -> Claim:
    job = "timing-sync"
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats_server(Path(tmp, "nats"))
        services = ServiceProcesses(Path(tmp), Path(tmp, "jax-cache"))
        flags = [
            *("--nats-url", server.url, "--job", job, "--model", "tiny", "--seed", "1"),
            *("--mode", "sync", "--sync-timeout-s", str(SYNC_TIMEOUT_S), "--num-units", "3"),
        ]
        try:
            services.start("outer", "outer", *flags, "--eval-every-s", "60")
            wait_for(
                lambda: (s := read_status(server.url, job)[0]) is not None and s.state == "running",
                300,
                "the outer to run",
            )
            learners = [
                services.start(
                    f"learner-{unit}",
                    "learner",
                    *flags,
                    *("--unit", str(unit), "--max-steps", "100000", "--h-steps", "10"),
                    *("--no-dynamic-h", "--slowdown", "3"),
                )
                for unit in range(3)
            ]

            def every_unit_applied_twice() -> bool:
                status = read_status(server.url, job)[0]
                ledger = status.units if status is not None else {}
                return all(u in ledger and ledger[u].applied >= 2 for u in range(3))

            wait_for(every_unit_applied_twice, 300, "two rounds of every unit applied")
            learners[2].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            changes, version = [killed_at], None
            while time.monotonic() - killed_at < SYNC_WATCH_S:
                status = read_status(server.url, job)[0]
                if status is not None:
                    if version is not None and status.version != version:
                        changes.append(time.monotonic())
                    version = status.version
                time.sleep(0.1)
            changes.append(time.monotonic())
        finally:
            services.stop_all()
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
