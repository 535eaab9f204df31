"""The in-memory broker: a NATS server with JetStream that lives in the test process.

It listens on a loopback port and runs its own event loop on a daemon thread, so any client
(nats-py in any thread or event loop of the test, a service run in-process) connects to its
URL exactly as to nats-server. All broker state is touched on that loop only.

Routing, as on the server: a publish to a subject some stream captures is stored (and acked to
its reply subject); every publish reaches the matching subscriptions (``*`` and ``>``
wildcards, queue groups get one copy per group); ``$JS.API.>`` requests are answered by
:class:`~tests.memory_nats.jetstream.JetStream`; a request nobody answers gets the status
``503`` ("no responders") that nats-py turns into ``NoRespondersError``.

:meth:`MemoryNats.kill` drops every connection and stops listening, :meth:`MemoryNats.restart`
listens again on the same port with everything stored kept (a file store's restart), so clients
that reconnect forever find it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from tests.memory_nats import headers
from tests.memory_nats.connection import ClientConnection
from tests.memory_nats.jetstream import ACK_PREFIX, API_PREFIX, LATER, JetStream
from tests.memory_nats.subjects import matches

T = TypeVar("T")

HOST = "127.0.0.1"
DEFAULT_MAX_PAYLOAD = 1 << 20  # nats-server's default
SERVER_VERSION = "2.11.0"  # what the broker says it is: nats-py enables features by version
CALL_TIMEOUT_S = 10.0


@dataclass
class Subscription:
    """One client's interest in a subject."""

    connection: ClientConnection
    sid: str
    subject: str
    queue: str | None
    remaining: int = 0  # deliveries left before an ``UNSUB <sid> <max>`` ends it; 0: no limit


class MemoryNats:
    """A NATS server with JetStream in memory, on ``127.0.0.1`` and a free port.

    Use :func:`start_memory_nats` (or the ``memory_nats`` fixture), then connect to
    :attr:`url`; :meth:`stop` at the end.
    """

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self.host = HOST
        self.port = 0
        self.jetstream = JetStream(self._send, self.has_interest)
        self._subscriptions: dict[tuple[int, str], Subscription] = {}
        self._connections: set[ClientConnection] = set()
        self._client_ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # ---- lifetime (called from the test's thread) -----------------------------------------

    @property
    def url(self) -> str:
        """Client URL, e.g. ``nats://127.0.0.1:40123``."""
        return f"nats://{self.host}:{self.port}"

    def start(self) -> MemoryNats:
        """Start the loop's thread and listen; returns self."""
        self._thread.start()
        self._call(self._listen())
        return self

    @property
    def pid(self) -> int:
        """The process the broker runs in: the test's own (``diloco up`` records a server's
        PID)."""
        return os.getpid()

    def alive(self) -> bool:
        """Whether it listens (between :meth:`kill` and :meth:`restart` it does not)."""
        return self._server is not None

    def kill(self) -> None:
        """Drop every connection and stop listening, as a killed server would."""
        self._call(self._go_down())

    def restart(self) -> None:
        """Listen again on the same port, with every stream, consumer and message kept."""
        self._call(self._listen())

    def stop(self) -> None:
        """Go down for good and end the loop's thread."""
        if self._thread.is_alive():
            self._call(self._shut_down())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=CALL_TIMEOUT_S)
            self._loop.close()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(CALL_TIMEOUT_S)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _go_down(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._connections):
            connection.close()
            self.forget(connection)
        self.jetstream.drop_requests()

    async def _shut_down(self) -> None:
        await self._go_down()
        current = asyncio.current_task()
        serving = [task for task in asyncio.all_tasks() if task is not current]
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = ClientConnection(self, reader, writer, next(self._client_ids))
        self._connections.add(connection)
        # Cancelled when the broker stops: asyncio would log a cancelled handler as an error.
        with contextlib.suppress(asyncio.CancelledError):
            await connection.serve()

    # ---- what connections ask for (on the loop) -------------------------------------------

    def info(self, client_id: int) -> dict[str, Any]:
        """The ``INFO`` a new client is greeted with."""
        return {
            "server_id": "MEMORY",
            "server_name": "memory-nats",
            "version": SERVER_VERSION,
            "proto": 1,
            "go": "python",
            "host": self.host,
            "port": self.port,
            "headers": True,
            "max_payload": self.max_payload,
            "jetstream": True,
            "client_id": client_id,
            "client_ip": HOST,
        }

    def subscribe(
        self, connection: ClientConnection, sid: str, subject: str, queue: str | None
    ) -> None:
        key = (connection.client_id, sid)
        self._subscriptions[key] = Subscription(connection, sid, subject, queue)

    def unsubscribe(self, connection: ClientConnection, sid: str, after: int) -> None:
        key = (connection.client_id, sid)
        subscription = self._subscriptions.get(key)
        if subscription is None:
            return
        if after > 0:
            subscription.remaining = after
        else:
            del self._subscriptions[key]

    def forget(self, connection: ClientConnection) -> None:
        """A connection ended: its subscriptions go with it."""
        self._connections.discard(connection)
        for key in [k for k in self._subscriptions if k[0] == connection.client_id]:
            del self._subscriptions[key]

    def has_interest(self, subject: str) -> bool:
        """Whether any subscription matches ``subject``."""
        return any(matches(s.subject, subject) for s in self._subscriptions.values())

    def publish(
        self,
        origin: ClientConnection,
        subject: str,
        reply: str,
        header_block: bytes,
        data: bytes,
    ) -> None:
        """Route one published message."""
        if subject.startswith(API_PREFIX):
            answer = self.jetstream.api(subject, reply, data)
            if answer is None:
                self._no_responders(origin, reply)
            elif answer != LATER and reply:
                self._send(reply, "", *answer)
            return
        if subject.startswith(ACK_PREFIX):
            if self.jetstream.acknowledge(subject, data) and reply:
                self._send(reply, "", b"", b"")
            return
        stream = self.jetstream.stream_for(subject)
        ack = self.jetstream.capture(stream, subject, header_block, data) if stream else None
        delivered = self._send(subject, reply, header_block, data)
        if ack is not None and reply:
            self._send(reply, "", b"", ack)
        elif stream is None and not delivered:
            self._no_responders(origin, reply)

    def _no_responders(self, origin: ClientConnection, reply: str) -> None:
        if reply and origin.wants_no_responders:
            self._send(reply, "", headers.status(503), b"")

    def _send(
        self, subject: str, reply: str, header_block: bytes, data: bytes, to: str | None = None
    ) -> int:
        """Deliver to every subscription matching ``to`` (default: ``subject``; a consumer
        sends a stored message, with its own subject, to a request's inbox), one member per
        queue group; returns how many got it."""
        target = subject if to is None else to
        chosen: list[Subscription] = []
        groups: dict[str, list[Subscription]] = {}
        for subscription in list(self._subscriptions.values()):
            if not matches(subscription.subject, target):
                continue
            if subscription.queue is None:
                chosen.append(subscription)
            else:
                groups.setdefault(subscription.queue, []).append(subscription)
        chosen += [random.choice(members) for members in groups.values()]
        for subscription in chosen:
            subscription.connection.deliver(subject, subscription.sid, reply, header_block, data)
            if subscription.remaining:
                subscription.remaining -= 1
                if subscription.remaining == 0:
                    key = (subscription.connection.client_id, subscription.sid)
                    self._subscriptions.pop(key, None)
        return len(chosen)


def start_memory_nats(max_payload: int = DEFAULT_MAX_PAYLOAD) -> MemoryNats:
    """A started :class:`MemoryNats` (call ``stop()`` when done)."""
    return MemoryNats(max_payload).start()
