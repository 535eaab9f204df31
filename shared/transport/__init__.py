"""NATS, the one channel between services: connecting, the streams and buckets with their limits,
chunked blobs, the params channel and dead letters.

* ``connection`` — connect as a user (over TLS), reconnect forever, retry the first connect;
* ``streams`` — every stream and KV bucket, its limits, and who may create them;
* ``blobs`` — a blob published as chunk messages with a bounded window, each retried under its
  ``Nats-Msg-Id``;
* ``pace`` — how fast a connection's publishes are acknowledged: the link a publish's timeout
  allows for;
* ``params`` — the params channel: a fragment's global params as chunks plus a head, and reads
  that see exactly one version;
* ``dead_letters`` — copies of rejected messages with their reason.

Everything here has an explicit timeout. Pseudo-gradients and parameters travel as msgpack
envelopes (``shared.wire``) split into chunks no larger than the server's ``max_payload`` minus
header slack. Typed KV records are read and written with ``shared.kv``. docs/ARCHITECTURE.md
describes the layout.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """A NATS operation failed after its retries."""
