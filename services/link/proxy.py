"""A userspace TCP proxy that shapes the link between its clients and one upstream server.

Every connection accepted on the listening port is forwarded to the upstream (nats-server),
each direction through the link's :class:`~services.link.pacing.SerialLine` (the rate cap,
shared by all connections) and a per-connection :class:`~services.link.pacing.Delay`. Bytes are
counted as they are delivered. Outages: :meth:`LinkProxy.stall` holds every byte until it ends;
:meth:`LinkProxy.cut` closes every connection and refuses new ones until it ends.

Back-pressure is the link's: the proxy reads the next slice from a socket only once the slice
before it has crossed the line, so a fast sender fills its own socket buffers and waits, as it
would on a slow link. Toxiproxy's bandwidth, latency and timeout toxics are the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from services.link.pacing import Delay, SerialLine
from shared.link_spec import LinkSpec, Outage, OutageMode

log = logging.getLogger(__name__)

#: Chunks that crossed the line and wait out their delay, per connection and direction.
MAX_IN_FLIGHT_CHUNKS = 4096


@dataclass(frozen=True)
class LinkCounters:
    """What has crossed a link since it started.

    Attributes:
        bytes_up: client → upstream bytes delivered.
        bytes_down: upstream → client bytes delivered.
        busy_up_s: seconds the upstream direction's line was busy (0 without a rate cap).
        busy_down_s: the same for the downstream direction.
        uptime_s: seconds since the link started.
        connections: connections open now.
        connects: connections accepted in all.
        outage: the outage in progress (``stall`` or ``cut``), or None.
        outages: outages begun so far.
    """

    bytes_up: int
    bytes_down: int
    busy_up_s: float
    busy_down_s: float
    uptime_s: float
    connections: int
    connects: int
    outage: OutageMode | None
    outages: int


@dataclass
class _Direction:
    """One direction of the link: its line and its delivered bytes."""

    line: SerialLine
    delivered: int = 0


class LinkProxy:
    """A shaped TCP link from ``listen_host:listen_port`` to ``upstream_host:upstream_port``.

    Use within one event loop: ``await start()``, then ``await close()``.
    """

    def __init__(
        self,
        spec: LinkSpec,
        upstream_host: str,
        upstream_port: int,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int | None = None,
        fallbacks: Sequence[tuple[str, int]] = (),
    ) -> None:
        """Args:
        spec: the link's rate, delay and jitter.
        upstream_host, upstream_port: where connections are forwarded to.
        listen_host, listen_port: where clients connect (port 0: a free one).
        seed: seeds the jitter (None: from the OS).
        fallbacks: where a connection goes instead, tried in order, while the upstream is
            unreachable (the other nodes of a NATS cluster).
        """
        self.spec = spec
        self.upstream = (upstream_host, upstream_port)
        self.fallbacks = tuple(fallbacks)
        self.listen = (listen_host, listen_port)
        self._rng = random.Random(seed)
        self._up = _Direction(SerialLine(spec.rate_bytes_per_s))
        self._down = _Direction(SerialLine(spec.rate_bytes_per_s))
        self._passable = asyncio.Event()
        self._passable.set()
        self._outage: OutageMode | None = None
        self._outages = 0
        self._connects = 0
        self._connections: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._started = 0.0

    @property
    def port(self) -> int:
        """The listening port (once started)."""
        assert self._server is not None, "the link is not started"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> int:
        """Listen for clients; returns the port."""
        self._started = asyncio.get_running_loop().time()
        self._server = await asyncio.start_server(self._accept, *self.listen)
        return self.port

    async def close(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self._close_connections()

    def counters(self) -> LinkCounters:
        """What has crossed the link so far."""
        return LinkCounters(
            bytes_up=self._up.delivered,
            bytes_down=self._down.delivered,
            busy_up_s=self._up.line.busy_s,
            busy_down_s=self._down.line.busy_s,
            uptime_s=asyncio.get_running_loop().time() - self._started,
            connections=len(self._connections),
            connects=self._connects,
            outage=self._outage,
            outages=self._outages,
        )

    async def stall(self, duration_s: float) -> None:
        """Hold every byte for ``duration_s``: nothing is read or delivered, nothing is lost."""
        self._begin("stall")
        self._passable.clear()
        try:
            await asyncio.sleep(duration_s)
        finally:
            self._passable.set()
            self._outage = None

    async def cut(self, duration_s: float) -> None:
        """Close every connection now and refuse new ones for ``duration_s``."""
        self._begin("cut")
        try:
            await self._close_connections()
            await asyncio.sleep(duration_s)
        finally:
            self._outage = None

    async def run_outages(self, outages: list[Outage]) -> None:
        """Run scheduled outages, each at its start counted from the link's start."""
        loop = asyncio.get_running_loop()
        for outage in outages:
            await _sleep_until(loop, self._started + outage.start_s)
            log.info("link outage: %s for %.1f s", outage.mode, outage.duration_s)
            if outage.mode == "stall":
                await self.stall(outage.duration_s)
            else:
                await self.cut(outage.duration_s)
            log.info("link outage over")

    def _begin(self, mode: OutageMode) -> None:
        if self._outage is not None:
            raise RuntimeError(f"an outage ({self._outage}) is already in progress")
        self._outage = mode
        self._outages += 1

    async def _close_connections(self) -> None:
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- connections -----------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._outage == "cut":
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._connects += 1
        self._connections.add(task)
        try:
            await self._forward(reader, writer)
        except asyncio.CancelledError:
            pass  # cut, or the link closes
        finally:
            self._connections.discard(task)
            _close(writer)

    async def _forward(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        for upstream in (self.upstream, *self.fallbacks):
            try:
                up_reader, up_writer = await asyncio.open_connection(*upstream)
                break
            except OSError as err:
                log.debug("upstream %s:%d unreachable: %s", *upstream, err)
        else:
            return
        pipes = [
            asyncio.create_task(self._pipe(client_reader, up_writer, self._up)),
            asyncio.create_task(self._pipe(up_reader, client_writer, self._down)),
        ]
        try:
            # Either side closing ends the connection (what crossed before is delivered first).
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            _close(up_writer)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: _Direction
    ) -> None:
        """Carry one direction of a connection until EOF or an error."""
        loop = asyncio.get_running_loop()
        delay = Delay(self.spec.delay_s, self.spec.jitter_s, self._rng)
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(MAX_IN_FLIGHT_CHUNKS)
        deliverer = asyncio.create_task(self._deliver(queue, writer, direction))
        try:
            while not deliverer.done():  # done early: the far side is gone
                await self._passable.wait()
                try:
                    data = await reader.read(direction.line.slice_bytes())
                except OSError:
                    break
                if not data:
                    break
                # The next slice is read while this one crosses, so the line never idles
                # while the sender has bytes; back-pressure holds the sender one slice behind.
                start, crossed = direction.line.send(len(data), loop.time())
                await _sleep_until(loop, start)
                await queue.put((delay.arrival(crossed), data))
            if not deliverer.done():
                await queue.put(None)
            await deliverer
        finally:
            deliverer.cancel()
            await asyncio.gather(deliverer, return_exceptions=True)

    async def _deliver(
        self,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        writer: asyncio.StreamWriter,
        direction: _Direction,
    ) -> None:
        loop = asyncio.get_running_loop()
        while (item := await queue.get()) is not None:
            arrival, data = item
            await _sleep_until(loop, arrival)
            await self._passable.wait()
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                return
            direction.delivered += len(data)


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    wait = when - loop.time()
    if wait > 0:
        await asyncio.sleep(wait)


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        writer.close()
