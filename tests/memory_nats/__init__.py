"""An in-memory NATS server with JetStream for the unit tier: no nats-server process, nothing
on disk.

:class:`MemoryNats` listens on a loopback port and speaks the NATS client protocol, so the real
nats-py client talks to it unchanged (its ``JetStreamContext``, ``KeyValue``, pull
subscriptions, acks, errors and reconnects included) and services started in the test process
connect to its URL as to nats-server. It models what this project relies on: streams with
wildcard subjects, limits (per subject, bytes, messages, message size, age; discard old or new,
per subject too), ``Nats-Msg-Id`` deduplication, expected-last-sequence checks (KV
compare-and-set), rollups, direct and API message gets, stream info with a subject listing and
the server's time, purges, durable pull consumers with explicit acks, naks, terms, progress and
ack-wait redelivery, work-queue retention, core subscriptions with wildcards and queue groups,
request/reply with "no responders", ``max_payload``, and a kill and restart that keep the
store. Each module says what it simplifies; ``tests/test_memory_nats_contract.py`` runs the same
assertions against it and against nats-server.

Modules: ``broker`` (the server, routing, lifetime), ``connection`` (the client protocol),
``jetstream`` (the ``$JS.API`` and acks), ``streams`` (a stream's store and limits),
``consumers`` (pull consumers), ``subjects`` (wildcards), ``headers`` (header blocks).
"""

from __future__ import annotations

from tests.memory_nats.broker import MemoryNats, start_memory_nats

__all__ = ["MemoryNats", "start_memory_nats"]
