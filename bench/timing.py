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

Exits 1 when a claim fails.

    .venv/bin/python bench/timing.py [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from report import shown_command, write_section  # bench/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.link.proxy import LinkProxy
from shared.link_spec import LinkSpec, parse_link, parse_outages

SECTION = "## Timing on the real clock"
RATES_MBIT = [1, 10, 100]
DELAY_S = 0.025
OUTAGES = "0.2s+0.2s,0.6s+0.2s:cut"


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


async def measure() -> list[Claim]:
    claims = [await rate_claim(mbit) for mbit in RATES_MBIT]
    claims.append(await delay_claim())
    return claims + await outage_claims()


def table(claims: list[Claim], command: str) -> str:
    lines = [
        SECTION,
        "",
        f"`{command}` — the link shaper (`services/link/proxy.py`) on loopback, on the wall "
        "clock of this machine: each row a ratio measured within the run and the range the "
        "claim allows (the tests prove the same schedule on a virtual clock).",
        "",
        "| claim | ratio | allowed | holds |",
        "|---|---|---|---|",
    ]
    for claim in claims:
        lines.append(
            f"| {claim.name} | {claim.ratio:.3f} | {claim.low:g} – {claim.high:g} "
            f"| {'yes' if claim.holds else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    claims = asyncio.run(measure())
    text = table(claims, shown_command(".venv/bin/python bench/timing.py"))
    print(text)
    if args.write:
        write_section(SECTION, text)
    failed = [claim.name for claim in claims if not claim.holds]
    if failed:
        raise SystemExit(f"claims that failed: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
