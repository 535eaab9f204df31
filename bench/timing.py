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

The raw figures (bytes and their times, every round trip, when each outage was seen, when the
global version changed after the kill) go to ``bench/results/timing.json`` with the run's
provenance; the section is rendered from that file, the claims (``claims``) checked against it.
Exits 1 when a claim fails or is not measured (``--only`` leaves the other part's claims
unmeasured). ``--quick`` is the smoke version: half a second of bytes per rate, and a 3 s sync
timeout watched for 6 s after a kill once every unit had one round applied; results in a
temporary folder.

    .venv/bin/python bench/timing.py [--only link|sync] [--write]
    .venv/bin/python bench/timing.py --render [--write]   # the section from the stored results
    .venv/bin/python bench/timing.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from evidence import (
    Claim,
    Provenance,
    note,
    publish,
    ratio_at_least,
    ratio_at_most,
    ratio_within,
    render_claims,
    results_path,
    save,
)
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.link.proxy import LinkProxy
from services.orchestration.nats_server import start_nats_server
from shared.link_spec import LinkSpec, Outage, parse_link, parse_outages
from tests.helpers import ServiceProcesses, read_status, wait_for
from tests.loopback import Sink, echo_server, port_of, round_trips

SECTION = "## Timing on the real clock"
NAME = "timing"
PROGRAM = ".venv/bin/python bench/timing.py"
RATES_MBIT = [1, 10, 100]
RATE_SECONDS = 2.0  # seconds' worth of bytes sent through each rate
ROUND_TRIPS = 20
DELAY_S = 0.025
OUTAGES = "0.2s+0.2s,0.6s+0.2s:cut"
SAMPLE_EVERY_S = 0.005
SYNC_TIMEOUT_S = 6.0
SYNC_WATCH_S = 12.0
SYNC_ROUNDS = 2  # rounds of every unit applied before the kill
# The claims' bounds (this module's docstring):
RATE_RANGE = (0.9, 1.1)  # seen rate / cap
DELAY_RANGE = (0.9, 1.1)  # added round trip / twice the one-way delay
OUTAGE_OFF = 0.25  # at most: how far an outage began or ended from its schedule / its duration
SYNC_HOLD = 0.7  # at least: the longest gap between versions after a kill / the sync timeout
QUICK = {"rate_seconds": 0.5, "sync_timeout_s": 3.0, "sync_watch_s": 6.0, "sync_rounds": 1}


class RateRun(BaseModel):
    """Bytes through a rate-capped link: how many, and when the receiver saw the first and the
    last chunk (seconds on the loop's clock; the first chunk's bytes are not counted in the
    rate, as they arrived at its start)."""

    mbit: float
    size: int
    first_chunk: int
    first_s: float
    last_s: float

    def seen_mbit(self) -> float | None:
        """The rate the receiver saw, Mbit/s (None when it came in one chunk)."""
        seconds = self.last_s - self.first_s
        return (self.size - self.first_chunk) * 8 / seconds / 1e6 if seconds > 0 else None


class DelayRun(BaseModel):
    """Round trips (seconds) to an echo, direct and through a link that delays each way."""

    delay_s: float
    direct_s: list[float]
    shaped_s: list[float]

    def added_ms(self) -> float | None:
        """The median shaped round trip minus the median direct one, ms."""
        if not self.direct_s or not self.shaped_s:
            return None
        return (statistics.median(self.shaped_s) - statistics.median(self.direct_s)) * 1e3


class OutageRun(BaseModel):
    """One scheduled outage, and the first and last samples (seconds after the link started)
    in which the link was in its mode (None: never seen)."""

    outage: Outage
    seen_from_s: float | None
    seen_to_s: float | None

    def off_ms(self) -> float | None:
        """How far it began or ended from its schedule, ms (the larger)."""
        if self.seen_from_s is None or self.seen_to_s is None:
            return None
        end = self.outage.start_s + self.outage.duration_s
        return max(abs(self.seen_from_s - self.outage.start_s), abs(self.seen_to_s - end)) * 1e3


class SyncRun(BaseModel):
    """``--mode sync`` after a SIGKILL of one unit (once every unit had ``rounds`` rounds
    applied): when (seconds after the kill) the global version changed in the watch window, and
    when the watch ended."""

    timeout_s: float
    rounds: int
    changes_s: list[float]
    watched_s: float

    def longest_gap_s(self) -> float:
        """The longest time between two versions (the kill and the watch's end count as
        changes)."""
        moments = [0.0, *self.changes_s, self.watched_s]
        return max(b - a for a, b in zip(moments[:-1], moments[1:], strict=True))


class TimingResults(BaseModel):
    """``bench/results/timing.json``."""

    provenance: Provenance
    rates: list[RateRun] = []
    delay: DelayRun | None = None
    outages: list[OutageRun] = []
    sync: SyncRun | None = None


async def measure_rate(mbit: float, seconds: float) -> RateRun:
    sink = Sink()
    proxy = LinkProxy(LinkSpec(rate_bps=mbit * 1e6), "127.0.0.1", await sink.start())
    size = int(mbit * 1e6 / 8 * seconds)
    _, writer = await asyncio.open_connection("127.0.0.1", await proxy.start())
    writer.write(b"\x5a" * size)
    await writer.drain()
    while sink.total < size:
        await asyncio.sleep(0.005)
    (first, first_chunk), (last, _) = sink.received[0], sink.received[-1]
    writer.close()
    await proxy.close()
    await sink.close()
    return RateRun(mbit=mbit, size=size, first_chunk=first_chunk, first_s=first, last_s=last)


async def measure_delay(delay_s: float, count: int) -> DelayRun:
    server = await echo_server()
    direct = await round_trips(port_of(server), count)
    proxy = LinkProxy(LinkSpec(delay_s=delay_s), "127.0.0.1", port_of(server))
    shaped = await round_trips(await proxy.start(), count)
    await proxy.close()
    server.close()
    return DelayRun(delay_s=delay_s, direct_s=direct, shaped_s=shaped)


async def measure_outages(text: str) -> list[OutageRun]:
    server = await echo_server()
    proxy = LinkProxy(parse_link("unlimited"), "127.0.0.1", port_of(server))
    await proxy.start()
    loop = asyncio.get_running_loop()
    started = loop.time()
    outages = parse_outages(text)
    schedule = asyncio.create_task(proxy.run_outages(outages))
    seen: list[tuple[float, str | None]] = []
    while not schedule.done():
        seen.append((loop.time() - started, proxy.counters().outage))
        await asyncio.sleep(SAMPLE_EVERY_S)
    await proxy.close()
    server.close()
    runs = []
    for outage in outages:
        during = [t for t, mode in seen if mode == outage.mode]
        runs.append(
            OutageRun(
                outage=outage,
                seen_from_s=min(during) if during else None,
                seen_to_s=max(during) if during else None,
            )
        )
    return runs


async def measure_link(results: TimingResults) -> None:
    c = results.provenance.configuration
    for mbit in c["rates_mbit"]:
        results.rates.append(await measure_rate(mbit, c["rate_seconds"]))
    results.delay = await measure_delay(c["delay_s"], c["round_trips"])
    results.outages = await measure_outages(c["outages"])


def measure_sync(timeout_s: float, watch_s: float, rounds: int) -> SyncRun:
    job = "timing-sync"
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats_server(Path(tmp, "nats"))
        services = ServiceProcesses(Path(tmp), Path(tmp, "jax-cache"))
        flags = [
            *("--nats-url", server.url, "--job", job, "--model", "tiny", "--seed", "1"),
            *("--mode", "sync", "--sync-timeout-s", f"{timeout_s:g}", "--num-units", "3"),
        ]
        try:
            services.start("outer", "outer", *flags, "--eval-every-s", "60")
            wait_for(
                lambda: (s := read_status(server.url, job)[0]) is not None and s.state == "running",
                300,
                "the outer to run",
            )
            note("sync hold: the outer runs; starting the learners")
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

            def every_unit_applied() -> bool:
                status = read_status(server.url, job)[0]
                ledger = status.units if status is not None else {}
                return all(u in ledger and ledger[u].applied >= rounds for u in range(3))

            wait_for(every_unit_applied, 300, f"{rounds} rounds of every unit applied")
            note(f"sync hold: every unit had {rounds} round(s) applied; killing learner-2")
            learners[2].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            changes, version = [], None
            while time.monotonic() - killed_at < watch_s:
                status = read_status(server.url, job)[0]
                if status is not None:
                    if version is not None and status.version != version:
                        changes.append(round(time.monotonic() - killed_at, 3))
                    version = status.version
                time.sleep(0.1)
            watched = round(time.monotonic() - killed_at, 3)
        finally:
            services.stop_all()
            server.stop()
    return SyncRun(timeout_s=timeout_s, rounds=rounds, changes_s=changes, watched_s=watched)


def measure(args: argparse.Namespace, path: Path) -> TimingResults:
    """The link's cases, then the sync hold (as ``--only`` says); saved after each part."""
    configuration = {
        "only": args.only,
        "rates_mbit": RATES_MBIT,
        "rate_seconds": args.rate_seconds,
        "delay_s": DELAY_S,
        "round_trips": ROUND_TRIPS,
        "outages": OUTAGES,
        "sample_every_s": SAMPLE_EVERY_S,
        "sync_timeout_s": args.sync_timeout_s,
        "sync_watch_s": args.sync_watch_s,
        "sync_rounds": args.sync_rounds,
    }
    results = TimingResults(provenance=Provenance.start(PROGRAM, configuration, path))
    started = time.monotonic()

    def checkpoint() -> None:
        results.provenance.seconds = round(time.monotonic() - started, 1)
        save(path, results)

    if args.only in (None, "link"):
        note("link shaper: rates, delay, outages")
        asyncio.run(measure_link(results))
        checkpoint()
    if args.only in (None, "sync"):
        note("sync hold: an outer and three learners, one killed")
        results.sync = measure_sync(args.sync_timeout_s, args.sync_watch_s, args.sync_rounds)
    checkpoint()
    return results


def claims(results: TimingResults) -> list[Claim]:
    """The docstring's claims, checked against the stored figures (a case the configuration
    names but the results lack is not measured)."""
    c = results.provenance.configuration
    out: list[Claim] = []
    low, high = RATE_RANGE
    for mbit in c.get("rates_mbit", RATES_MBIT):
        run = next((r for r in results.rates if r.mbit == mbit), None)
        out.append(
            ratio_within(
                f"rate at {mbit:g} Mbit/s: seen / cap within {low:g}–{high:g}",
                run.seen_mbit() if run else None,
                mbit,
                low,
                high,
            )
        )
    delay_ms = c.get("delay_s", DELAY_S) * 1e3
    low, high = DELAY_RANGE
    out.append(
        ratio_within(
            f"delay {delay_ms:g} ms: added round trip / {2 * delay_ms:g} ms within "
            f"{low:g}–{high:g}",
            results.delay.added_ms() if results.delay else None,
            2 * delay_ms,
            low,
            high,
        )
    )
    for outage in parse_outages(c.get("outages", OUTAGES)):
        text = f"{outage.text()}: off schedule / duration ≤ {OUTAGE_OFF:g}"
        run = next((r for r in results.outages if r.outage == outage), None)
        if run is not None and run.off_ms() is None:
            out.append(Claim(text, f"never seen in mode {outage.mode}", False))
        else:
            off = run.off_ms() if run else None
            out.append(ratio_at_most(text, off, outage.duration_s * 1e3, OUTAGE_OFF))
    timeout = c.get("sync_timeout_s", SYNC_TIMEOUT_S)
    out.append(
        ratio_at_least(
            f"sync hold: longest gap between versions in the {c.get('sync_watch_s', 0):g} s "
            f"after a kill / the {timeout:g} s sync timeout ≥ {SYNC_HOLD:g}",
            results.sync.longest_gap_s() if results.sync else None,
            timeout,
            SYNC_HOLD,
        )
    )
    return out


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def rows(results: TimingResults) -> list[str]:
    """The table's rows: each case, what was measured and what it is measured against."""
    out = []
    for r in results.rates:
        out.append(
            f"| rate at {r.mbit:g} Mbit/s | {r.size:,} bytes in {r.last_s - r.first_s:.3f} s: "
            f"{_f(r.seen_mbit(), '.3f')} Mbit/s | cap {r.mbit:g} Mbit/s |"
        )
    if (d := results.delay) is not None:
        out.append(
            f"| delay {d.delay_s * 1e3:g} ms each way | median round trip "
            f"{statistics.median(d.shaped_s) * 1e3:.2f} ms shaped, "
            f"{statistics.median(d.direct_s) * 1e3:.2f} ms direct ({len(d.shaped_s)} each): "
            f"{_f(d.added_ms(), '.2f')} ms added | {2 * d.delay_s * 1e3:g} ms |"
        )
    for o in results.outages:
        end = o.outage.start_s + o.outage.duration_s
        seen = (
            "never seen"
            if o.seen_from_s is None or o.seen_to_s is None
            else f"seen {o.seen_from_s:.3f}–{o.seen_to_s:.3f} s: {_f(o.off_ms(), '.1f')} ms off"
        )
        out.append(
            f"| {o.outage.mode} {o.outage.text()} | {seen} | scheduled "
            f"{o.outage.start_s:g}–{end:g} s |"
        )
    if (s := results.sync) is not None:
        changes = ", ".join(f"{t:.1f}" for t in s.changes_s) or "none"
        out.append(
            f"| sync hold after a kill (every unit had {s.rounds} round"
            f"{'s' if s.rounds != 1 else ''} applied) "
            f"| versions at {changes} s after it (watched "
            f"{s.watched_s:.1f} s): longest gap {s.longest_gap_s():.2f} s "
            f"| sync timeout {s.timeout_s:g} s |"
        )
    return out


def render(results: TimingResults, checked: list[Claim], path: Path) -> str:
    """The section, from the stored results only."""
    return "\n".join(
        [
            SECTION,
            "",
            results.provenance.line(path) + " On the wall clock of this machine: the link "
            "shaper (`services/link/proxy.py`) on loopback, and a sync round held for a killed "
            "unit (`diloco outer` and three `diloco learner`s, tiny model). Each claim is a "
            "ratio measured within the run, against the range it allows; the tests prove the "
            "same behaviour on a virtual or logical clock.",
            "",
            "| case | measured | against |",
            "|---|---|---|",
            *rows(results),
            "",
            render_claims(checked),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["link", "sync"], help="measure only these claims")
    parser.add_argument("--render", action="store_true", help="run nothing: render the stored")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    parser.add_argument("--quick", action="store_true", help="smoke version: shorter cases")
    parser.add_argument("--rate-seconds", type=float, default=RATE_SECONDS)
    parser.add_argument("--sync-timeout-s", type=float, default=SYNC_TIMEOUT_S)
    parser.add_argument("--sync-watch-s", type=float, default=SYNC_WATCH_S)
    parser.add_argument("--sync-rounds", type=int, default=SYNC_ROUNDS)
    args = parser.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    path = results_path(NAME, args.quick)
    if args.render:
        if not path.exists():
            raise SystemExit(f"{path}: no stored results (run bench/timing.py first)")
        results = TimingResults.model_validate_json(path.read_text())
    else:
        results = measure(args, path)
    checked = claims(results)
    text = render(results, checked, path)
    publish(SECTION, text, checked, args.write, args.quick)


if __name__ == "__main__":
    main()
