"""The server side of one client connection: the NATS client protocol over a socket.

The protocol (docs.nats.io, "Client Protocol"): the server greets with ``INFO {json}``; the
client sends ``CONNECT {json}``, ``PING`` (answered ``PONG``), ``SUB <subject> [queue] <sid>``,
``UNSUB <sid> [max]``, ``PUB <subject> [reply] <size>`` and ``HPUB <subject> [reply]
<header size> <total size>`` each followed by its payload; the server delivers ``MSG`` and
``HMSG`` in the same shapes. A payload over ``max_payload`` ends the connection with
``-ERR 'Maximum Payload Violation'``, as on the server.

Simplified: no authentication, TLS, ``verbose`` (+OK) or ``echo: false``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.memory_nats.broker import MemoryNats

CRLF = b"\r\n"


class ClientConnection:
    """One connected client: reads its commands, writes what the broker delivers to it."""

    def __init__(
        self,
        broker: MemoryNats,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_id: int,
    ) -> None:
        self.broker = broker
        self.reader = reader
        self.writer = writer
        self.client_id = client_id
        self.options: dict[str, Any] = {}

    @property
    def wants_no_responders(self) -> bool:
        """Whether the client asked to hear "no responders" (status 503) for requests."""
        return bool(self.options.get("headers") and self.options.get("no_responders"))

    async def serve(self) -> None:
        """Greet the client, then handle its commands until it leaves."""
        self.send_line(b"INFO " + json.dumps(self.broker.info(self.client_id)).encode())
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    return
                try:
                    go_on = await self._command(line.rstrip(CRLF).decode(errors="replace"))
                except (ValueError, IndexError):  # a malformed command: the server hangs up
                    self.send_line(b"-ERR 'Unknown Protocol Operation'")
                    return
                if not go_on:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self.broker.forget(self)
            self.close()

    async def _command(self, line: str) -> bool:
        """Handle one command; False ends the connection."""
        op, _, rest = line.partition(" ")
        op = op.upper()
        args = rest.split()
        if op == "PING":
            self.send_line(b"PONG")
        elif op in ("PONG", ""):
            pass
        elif op == "CONNECT":
            self.options = json.loads(rest or "{}")
        elif op == "SUB":
            subject, queue, sid = (args[0], None, args[1]) if len(args) == 2 else args[:3]
            self.broker.subscribe(self, sid, subject, queue)
        elif op == "UNSUB":
            self.broker.unsubscribe(self, args[0], int(args[1]) if len(args) > 1 else 0)
        elif op in ("PUB", "HPUB"):
            return await self._publish(op, args)
        else:
            self.send_line(b"-ERR 'Unknown Protocol Operation'")
            return False
        return True

    async def _publish(self, op: str, args: list[str]) -> bool:
        sizes = 2 if op == "HPUB" else 1
        subject, reply = args[0], args[1] if len(args) > 1 + sizes else ""
        total = int(args[-1])
        header_size = int(args[-2]) if op == "HPUB" else 0
        if total > self.broker.max_payload:
            self.send_line(b"-ERR 'Maximum Payload Violation'")
            return False
        payload = await self.reader.readexactly(total + len(CRLF))
        self.broker.publish(self, subject, reply, payload[:header_size], payload[header_size:total])
        return True

    def deliver(self, subject: str, sid: str, reply: str, header_block: bytes, data: bytes) -> None:
        """Write a ``MSG`` (or ``HMSG`` with headers) for subscription ``sid``."""
        reply_part = f" {reply}" if reply else ""
        if header_block:
            size = len(header_block) + len(data)
            line = f"HMSG {subject} {sid}{reply_part} {len(header_block)} {size}"
            self.writer.write(line.encode() + CRLF + header_block + data + CRLF)
        else:
            line = f"MSG {subject} {sid}{reply_part} {len(data)}"
            self.writer.write(line.encode() + CRLF + data + CRLF)

    def send_line(self, line: bytes) -> None:
        self.writer.write(line + CRLF)

    def close(self) -> None:
        """Drop the connection at once (the client sees it as a lost server)."""
        with contextlib.suppress(Exception):
            self.writer.transport.abort()
