"""TCP on loopback for trying the link shaper (``tests/test_link_proxy.py`` on a virtual clock,
``bench/timing.py`` on the wall clock): a sink that notes when each chunk came, an echo, and
round trips through it, all timed on the running loop's clock."""

from __future__ import annotations

import asyncio
import hashlib


class Sink:
    """A TCP server that reads everything, noting when (on the loop's clock) each chunk came."""

    def __init__(self) -> None:
        self.received: list[tuple[float, int]] = []
        self.digest = hashlib.sha256()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def total(self) -> int:
        return sum(n for _, n in self.received)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            self.received.append((asyncio.get_running_loop().time(), len(data)))
            self.digest.update(data)
        writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


async def echo_server() -> asyncio.Server:
    """A TCP server that sends back everything it reads."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def port_of(server: asyncio.Server) -> int:
    """The port ``server`` listens on."""
    return int(server.sockets[0].getsockname()[1])


async def round_trips(port: int, count: int) -> list[float]:
    """The times of ``count`` 4-byte round trips, one after another, to an echo at ``port``."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(count):
        start = loop.time()
        writer.write(b"ping")
        await reader.readexactly(4)
        times.append(loop.time() - start)
    writer.close()
    return times
