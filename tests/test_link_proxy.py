"""The link shaper keeps its promises on loopback: rate, delay, jitter, stalls and cuts."""

from __future__ import annotations

import asyncio
import hashlib
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.link.pacing import Delay, SerialLine
from services.link.proxy import LinkProxy
from shared.link_spec import (
    LinkSpec,
    Outage,
    parse_link,
    parse_links,
    parse_outages,
)
from tests import virtual_clock
from tests.helpers import wait_for_async
from tests.loopback import Sink, echo_server, port_of, round_trips

# ---- the spec ---------------------------------------------------------------------------------


def test_links_parse_in_tc_units() -> None:
    assert parse_link("100mbit/25ms") == LinkSpec(rate_bps=100e6, delay_s=0.025)
    assert parse_link("512kbit") == LinkSpec(rate_bps=512e3)
    assert parse_link("1.5Gbit/1s/200ms") == LinkSpec(rate_bps=1.5e9, delay_s=1, jitter_s=0.2)
    assert parse_link("unlimited/10ms") == LinkSpec(delay_s=0.01)
    assert parse_links("1mbit", 3) == [LinkSpec(rate_bps=1e6)] * 3
    assert [s.rate_bps for s in parse_links("1mbit,2mbit", 2)] == [1e6, 2e6]
    outage = Outage(start_s=90, duration_s=0.5, mode="cut")
    assert outage.text() == "1.5m+500ms:cut" and parse_outages(outage.text()) == [outage]
    assert parse_link("512kbit/0.5ms").text() == "512kbit/500us"
    assert parse_link("unlimited").text() == "unlimited/0ms"
    assert parse_outages("1m+10s:cut, 5s+2s") == [
        Outage(start_s=5, duration_s=2),
        Outage(start_s=60, duration_s=10, mode="cut"),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("100mb", "expected a rate"),
        ("0mbit", "above zero"),
        ("10mbit/25", "expected a duration"),
        ("10mbit/1ms/5ms", "cannot exceed"),
        ("1mbit/1ms/1ms/1ms", "expected a link"),
        ("", "expected a link"),
    ],
)
def test_a_malformed_link_is_refused_with_what_is_expected(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_link(text)


def test_malformed_lists_of_links_and_outages_are_refused() -> None:
    with pytest.raises(ValueError, match="1 or 3"):
        parse_links("1mbit,2mbit", 3)
    with pytest.raises(ValueError, match="overlap"):
        parse_outages("1s+5s,3s+1s")
    with pytest.raises(ValueError, match="expected an outage"):
        parse_outages("5s:stall")
    with pytest.raises(ValueError, match="expected an outage"):
        parse_outages("5s+1s:drop")


@given(
    rate=st.none() | st.floats(1, 1e11),
    delay=st.floats(0, 60),
    jitter_share=st.floats(0, 1),
)
def test_a_spec_written_out_parses_back_the_same(rate, delay, jitter_share) -> None:
    spec = LinkSpec(rate_bps=rate, delay_s=delay, jitter_s=delay * jitter_share)
    again = parse_link(spec.text())
    assert again.rate_bps == (None if rate is None else pytest.approx(rate, rel=1e-11))
    assert again.delay_s == pytest.approx(spec.delay_s, rel=1e-11)
    assert again.jitter_s == pytest.approx(spec.jitter_s, rel=1e-11)


# ---- pacing (pure) ----------------------------------------------------------------------------


def test_a_serial_line_carries_bytes_at_its_rate_and_saves_no_credit() -> None:
    line = SerialLine(1000.0)
    assert line.send(500, now=10.0) == (10.0, 10.5)
    assert line.send(500, now=10.1) == (10.5, 11.0)  # queued behind the first
    assert line.send(100, now=20.0) == (20.0, 20.1)  # idle time is not saved up
    assert line.busy_s == pytest.approx(1.1)
    assert SerialLine(None).send(10**9, now=3.0) == (3.0, 3.0)
    assert SerialLine(8e6 / 8).slice_bytes() == 20_000  # 20 ms at 8 Mbit/s
    assert SerialLine(1e3).slice_bytes() == 1024 and SerialLine(1e9).slice_bytes() == 64 << 10
    with pytest.raises(ValueError):
        SerialLine(0.0)


@given(st.lists(st.floats(0, 10), min_size=1, max_size=50), st.integers(0, 2**32))
def test_jitter_stays_within_its_bounds_and_never_reorders(times, seed) -> None:
    delay = Delay(0.05, 0.02, random.Random(seed))
    crossed = sorted(times)
    arrivals = [delay.arrival(t) for t in crossed]
    assert arrivals == sorted(arrivals)
    for t, arrival in zip(crossed, arrivals, strict=True):
        assert arrival >= t + 0.03 - 1e-9
    # Never later than the latest jittered arrival of any chunk up to it.
    assert all(a <= max(crossed[: i + 1]) + 0.07 + 1e-9 for i, a in enumerate(arrivals))


# ---- the proxy on loopback, on a virtual clock ------------------------------------------------
#
# The proxy takes its time from the event loop, so on tests.virtual_clock its rate, delay and
# outages play out exactly as scheduled, in no wall time, however busy the machine is. How close
# the real clock comes to the schedule is bench/timing.py's claim.


async def all_arrived(sink: Sink, size: int) -> None:
    await wait_for_async(lambda: sink.total >= size, 30, f"{size} bytes", interval_s=0.005)


@pytest.mark.parametrize("mbit", [1, 10, 100])
def test_no_prefix_crosses_faster_than_the_cap_and_the_whole_crosses_at_it(mbit: int) -> None:
    """Two seconds' worth of bytes at the cap: at no moment has the receiver more bytes than
    the cap allows since they were written, first byte to last it sees the cap, and the link
    counted every byte."""
    rate = mbit * 1e6 / 8  # bytes per second
    size = int(rate * 2.0)

    async def run() -> tuple[Sink, float, int]:
        sink = Sink()
        proxy = LinkProxy(LinkSpec(rate_bps=mbit * 1e6), "127.0.0.1", await sink.start())
        _, writer = await asyncio.open_connection("127.0.0.1", await proxy.start())
        written_at = asyncio.get_running_loop().time()
        writer.write(b"\x5a" * size)
        await writer.drain()
        await all_arrived(sink, size)
        writer.close()
        counted = proxy.counters().bytes_up
        await proxy.close()
        await sink.close()
        return sink, written_at, counted

    sink, written_at, counted = virtual_clock.run(run())
    assert counted == size
    arrived = 0
    for at, chunk in sink.received:
        arrived += chunk
        allowed = rate * (at - written_at)
        assert arrived <= allowed * (1 + 1e-9), f"{arrived} bytes {at - written_at:.6f} s in"
    (first, first_size), (last, _) = sink.received[0], sink.received[-1]
    seen = (size - first_size) / (last - first)
    # Exact on the virtual clock, except that the clock may jump past a loopback segment the
    # kernel hands over late, which can only lower the rate.
    assert rate * 0.98 <= seen <= rate * (1 + 1e-9), f"{seen * 8 / 1e6:.6f} Mbit/s"


def test_delay_adds_its_one_way_time_each_way_and_jitter_spreads_it() -> None:
    """A round trip over a 25 ms link takes 50 ms more than without it; with ±10 ms of jitter
    the round trips spread, within their bounds."""

    async def run() -> tuple[list[float], list[float], list[float]]:
        echo = await echo_server()
        echo_port = port_of(echo)
        direct = await round_trips(echo_port, 20)
        steady = LinkProxy(parse_link("unlimited/25ms"), "127.0.0.1", echo_port)
        jittery = LinkProxy(parse_link("unlimited/25ms/10ms"), "127.0.0.1", echo_port, seed=1)
        shaped = await round_trips(await steady.start(), 20)
        spread = await round_trips(await jittery.start(), 30)
        for proxy in (steady, jittery):
            await proxy.close()
        echo.close()
        return direct, shaped, spread

    direct, shaped, spread = virtual_clock.run(run())
    # A loopback segment the kernel hands over late makes one round trip longer, never shorter;
    # the medians and the lower bound are exact, the upper bound leaves it 10 ms.
    added = statistics.median(shaped) - statistics.median(direct)
    assert added == pytest.approx(0.050, abs=1e-9), f"added {added * 1e3:.6f} ms, expected 50"
    assert min(shaped) >= 0.050 - 1e-9
    assert min(spread) >= 0.030 - 1e-9 and max(spread) <= 0.070 + 0.010
    assert statistics.pstdev(spread) > 0.002


def test_a_stall_holds_every_byte_until_it_ends_then_delivers_them_all() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        sink = Sink()
        proxy = LinkProxy(parse_link("10mbit"), "127.0.0.1", await sink.start())
        _, writer = await asyncio.open_connection("127.0.0.1", await proxy.start())
        payload = random.Random(0).randbytes(400_000)
        writer.write(payload[:100_000])
        await all_arrived(sink, 100_000)
        stalled_at = loop.time()
        stall = asyncio.create_task(proxy.stall(1.0))
        await asyncio.sleep(0)  # the stall begins
        assert proxy.counters().outage == "stall"
        writer.write(payload[100_000:])
        await stall
        assert loop.time() - stalled_at == pytest.approx(1.0)
        await all_arrived(sink, len(payload))
        assert sink.digest.digest() == hashlib.sha256(payload).digest()
        # Nothing written during the stall crossed before it ended.
        before_end = [n for at, n in sink.received if at < stalled_at + 1.0]
        assert sum(before_end) == 100_000, "bytes crossed during the stall"
        counters = proxy.counters()
        assert (counters.outage, counters.outages, counters.connections) == (None, 1, 1)
        writer.close()
        await proxy.close()
        await sink.close()

    virtual_clock.run(run())


def test_a_cut_closes_connections_and_refuses_new_ones_until_it_ends() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        echo = await echo_server()
        proxy = LinkProxy(LinkSpec(), "127.0.0.1", port_of(echo))
        port = await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"hello"
        cut_at = loop.time()
        cut = asyncio.create_task(proxy.cut(0.5))
        assert await asyncio.wait_for(reader.read(), 2) == b""  # closed by the link
        refused_reader, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(refused_reader.read(), 2) == b""
        await cut
        assert loop.time() - cut_at == pytest.approx(0.5)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"again")
        assert await reader.readexactly(5) == b"again"
        assert proxy.counters().connects == 2 and proxy.counters().outages == 1
        writer.close()
        await proxy.close()
        echo.close()

    virtual_clock.run(run())


def test_scheduled_outages_run_at_their_times() -> None:
    # Moments (s after the link started) just inside and just outside each outage.
    expected = {
        0.1: None,
        0.199: None,
        0.201: "stall",
        0.399: "stall",
        0.401: None,
        0.599: None,
        0.601: "cut",
        0.799: "cut",
        0.801: None,
    }

    async def run() -> dict[float, str | None]:
        loop = asyncio.get_running_loop()
        echo = await echo_server()
        proxy = LinkProxy(LinkSpec(), "127.0.0.1", port_of(echo))
        started = loop.time()
        await proxy.start()
        schedule = asyncio.create_task(proxy.run_outages(parse_outages("0.2s+0.2s,0.6s+0.2s:cut")))
        seen = {}
        for moment in expected:
            await asyncio.sleep(started + moment - loop.time())
            seen[moment] = proxy.counters().outage
        await schedule
        await proxy.close()
        echo.close()
        return seen

    assert virtual_clock.run(run()) == expected


def test_a_connection_goes_to_the_next_upstream_while_the_first_is_unreachable() -> None:
    async def run() -> None:
        echo = await echo_server()
        closed = await echo_server()
        closed_port = port_of(closed)
        closed.close()
        await closed.wait_closed()  # nothing listens there now
        proxy = LinkProxy(
            LinkSpec(), "127.0.0.1", closed_port, fallbacks=[("127.0.0.1", port_of(echo))]
        )
        port = await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"hello"
        writer.close()
        lone = LinkProxy(LinkSpec(), "127.0.0.1", closed_port)
        reader, writer = await asyncio.open_connection("127.0.0.1", await lone.start())
        assert await asyncio.wait_for(reader.read(), 5) == b""  # no upstream: closed
        writer.close()
        await proxy.close()
        await lone.close()
        echo.close()

    asyncio.run(run())
