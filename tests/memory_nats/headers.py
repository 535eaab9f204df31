"""NATS message headers on the wire: ``NATS/1.0[ <status> <description>]\\r\\n`` followed by
``Key: Value`` lines and an empty line."""

from __future__ import annotations

VERSION_LINE = b"NATS/1.0"
CRLF = b"\r\n"

Headers = list[tuple[str, str]]


def parse(block: bytes) -> Headers:
    """The ``Key: Value`` pairs of a header block, in order (repeated keys kept)."""
    pairs: Headers = []
    for line in block.split(CRLF)[1:]:
        if not line:
            continue
        key, _, value = line.decode(errors="replace").partition(":")
        pairs.append((key.strip(), value.strip()))
    return pairs


def value(pairs: Headers, key: str) -> str | None:
    """The last value of ``key`` (header names compare case-sensitively, as the server
    does), or None."""
    found = None
    for name, text in pairs:
        if name == key:
            found = text
    return found


def encode(pairs: Headers, status: str = "") -> bytes:
    """A header block with ``pairs`` and an optional inline ``status`` (``"404 No Messages"``)."""
    first = VERSION_LINE + (b" " + status.encode() if status else b"")
    lines = [first, *(f"{key}: {text}".encode() for key, text in pairs)]
    return CRLF.join(lines) + CRLF + CRLF


def status(code: int, description: str = "") -> bytes:
    """A status-only header block, as the server sends for "no messages", timeouts and
    "no responders"."""
    return encode([], f"{code} {description}".strip())
