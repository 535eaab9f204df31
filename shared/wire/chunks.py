"""Chunk framing on NATS: upload ids, chunk headers, cutting a blob into chunks, reassembly.

NATS caps a message at the server's ``max_payload`` (1 MiB by default), so a blob (a packed
envelope, :mod:`shared.wire.envelope`, or one of the outer's checkpoints) is cut with
:func:`split_chunks` and each chunk is published with :func:`chunk_headers`; the receiver
parses those headers with :func:`parse_chunk_headers` and rebuilds the blob with a
:class:`Reassembler`. An upload id (:func:`upload_id`) names the blob.

Everything that parses received bytes treats them as hostile: any problem raises
:class:`WireError` (a ``ValueError``), and sizes are checked before memory is committed.
"""

from __future__ import annotations

import numbers
import re
from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.records import JOB_NAME_PATTERN

__all__ = [
    "MAX_COUNTER",
    "ChunkInfo",
    "Reassembler",
    "WireError",
    "byte_view",
    "chunk_headers",
    "is_int",
    "parse_chunk_headers",
    "parse_upload_id",
    "split_chunks",
    "upload_id",
    "validate_job_name",
]

HEADER_MSG_ID = "Nats-Msg-Id"
HEADER_UPLOAD = "Diloco-Upload"
HEADER_CHUNK = "Diloco-Chunk"
HEADER_SIZE = "Diloco-Size"

# Upload ids are upload_id() output or similar ("job.params.v7"): no spaces, and no ":" since
# that separates the upload from the chunk index in Nats-Msg-Id.
_UPLOAD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")
# Digit counts are bounded so a hostile header cannot make int() chew on a huge string.
_CHUNK_RE = re.compile(r"(0|[1-9][0-9]{0,11})/([1-9][0-9]{0,11})")
_SIZE_RE = re.compile(r"0|[1-9][0-9]{0,15}")
#: The largest round, version, fragment or unit number on the wire.
MAX_COUNTER = (1 << 63) - 1


class WireError(ValueError):
    """Raised for any envelope, header or chunk that does not follow the wire format."""


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (Python or NumPy), not a bool."""
    # Integral admits NumPy integers; bool is one too, but True is never a meaningful counter.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def validate_job_name(job: str) -> str:
    """Check a job name: 1-64 chars of ``[A-Za-z0-9_-]``, starting with a letter or digit.

    Job names end up in NATS subjects, stream names and upload ids, so nothing else is safe.

    Args:
        job: The candidate name.

    Returns:
        ``job`` unchanged.

    Raises:
        WireError: if ``job`` is not a str or does not match.
    """
    if not isinstance(job, str) or not JOB_NAME_PATTERN.fullmatch(job):
        raise WireError(f"job name must match ^[A-Za-z0-9][A-Za-z0-9_-]{{0,63}}$, got {job!r:.100}")
    return job


def upload_id(job: str, unit: int, round: int, fragment: int) -> str:
    """Name one upload (one packed envelope), e.g. ``"job.u3.r17.f0"``.

    Args:
        job: Valid job name.
        unit: Unit index, or -1 for the outer.
        round: Round (or version) counter, >= 0.
        fragment: Fragment index, >= 0.

    Returns:
        The id; it contains no spaces and is used in the NATS ``Nats-Msg-Id`` header.

    Raises:
        WireError: for an invalid job name or out-of-range counters.
    """
    validate_job_name(job)
    if not is_int(unit) or not -1 <= unit <= MAX_COUNTER:
        raise WireError(f"unit must be an int >= -1, got {unit!r:.100}")
    for name, value in (("round", round), ("fragment", fragment)):
        if not is_int(value) or not 0 <= value <= MAX_COUNTER:
            raise WireError(f"{name} must be a non-negative int, got {value!r:.100}")
    return f"{job}.u{unit}.r{round}.f{fragment}"


_UPLOAD_ID_RE = re.compile(
    r"(?P<job>[A-Za-z0-9][A-Za-z0-9_-]{0,63})\.u(?P<unit>-1|0|[1-9][0-9]{0,18})"
    r"\.r(?P<round>0|[1-9][0-9]{0,18})\.f(?P<fragment>0|[1-9][0-9]{0,18})"
)


def parse_upload_id(upload: str) -> tuple[str, int, int, int]:
    """Invert :func:`upload_id`: ``(job, unit, round, fragment)``.

    Raises:
        WireError: if ``upload`` is not an id :func:`upload_id` could have made.
    """
    match = _UPLOAD_ID_RE.fullmatch(upload) if isinstance(upload, str) else None
    if match is None:
        raise WireError(f"not an upload id: {upload!r:.100}")
    unit, round_, fragment = (int(match[k]) for k in ("unit", "round", "fragment"))
    if max(unit, round_, fragment) > MAX_COUNTER:
        raise WireError(f"upload id counters out of range: {upload!r:.100}")
    return match["job"], unit, round_, fragment


@dataclass(frozen=True)
class ChunkInfo:
    """Where one chunk belongs.

    Attributes:
        upload: Upload id from :func:`upload_id`.
        index: Chunk index, ``0 <= index < count``.
        count: Number of chunks in the upload, >= 1.
        total_size: Size of the whole blob in bytes.
    """

    upload: str
    index: int
    count: int
    total_size: int


def _check_info(info: ChunkInfo) -> None:
    if not isinstance(info.upload, str) or not _UPLOAD_RE.fullmatch(info.upload):
        raise WireError(f"invalid upload id {info.upload!r:.100}")
    if not all(is_int(v) for v in (info.index, info.count, info.total_size)):
        raise WireError(f"chunk index, count and total_size must be ints, got {info!r:.200}")
    if info.count < 1 or not 0 <= info.index < info.count:
        raise WireError(f"chunk {info.index}/{info.count} is out of range")
    # Every chunk of a non-empty blob holds at least one byte; an empty blob is one chunk.
    if info.total_size < 0 or info.count > max(1, info.total_size):
        raise WireError(f"{info.count} chunks cannot carry {info.total_size} bytes")


def chunk_headers(info: ChunkInfo) -> dict[str, str]:
    """NATS headers for one chunk.

    ``Nats-Msg-Id`` makes JetStream drop a re-published chunk inside its duplicate window.

    Args:
        info: The chunk's position.

    Returns:
        Header dict for ``js.publish(..., headers=...)``.

    Raises:
        WireError: if ``info`` is out of range.
    """
    _check_info(info)
    return {
        HEADER_MSG_ID: f"{info.upload}:{info.index}",
        HEADER_UPLOAD: info.upload,
        HEADER_CHUNK: f"{info.index}/{info.count}",
        HEADER_SIZE: str(info.total_size),
    }


def parse_chunk_headers(headers: Mapping[str, str] | None) -> ChunkInfo:
    """Read a chunk's position from its NATS headers.

    Args:
        headers: ``msg.headers`` (``None`` when the message has none).

    Returns:
        The parsed, range-checked position.

    Raises:
        WireError: if a header is missing, malformed, out of range, or ``Nats-Msg-Id``
            (when present) disagrees with the others.
    """
    if not isinstance(headers, Mapping):
        raise WireError("message has no chunk headers")
    values = {}
    for name in (HEADER_UPLOAD, HEADER_CHUNK, HEADER_SIZE):
        value = headers.get(name)
        if not isinstance(value, str):
            raise WireError(f"missing or non-str header {name!r}")
        values[name] = value
    chunk = _CHUNK_RE.fullmatch(values[HEADER_CHUNK])
    if chunk is None:
        got = values[HEADER_CHUNK]
        raise WireError(f"header {HEADER_CHUNK} must be 'index/count', got {got!r:.40}")
    if not _SIZE_RE.fullmatch(values[HEADER_SIZE]):
        got = values[HEADER_SIZE]
        raise WireError(f"header {HEADER_SIZE} must be a byte count, got {got!r:.40}")
    info = ChunkInfo(
        upload=values[HEADER_UPLOAD],
        index=int(chunk.group(1)),
        count=int(chunk.group(2)),
        total_size=int(values[HEADER_SIZE]),
    )
    _check_info(info)
    msg_id = headers.get(HEADER_MSG_ID)
    if msg_id is not None and msg_id != f"{info.upload}:{info.index}":
        raise WireError(f"header {HEADER_MSG_ID} {msg_id!r:.100} does not match chunk {info}")
    return info


def byte_view(data: Any, what: str) -> memoryview:
    """A flat byte view of any contiguous bytes-like object (len() then counts bytes).

    Raises:
        WireError: ``data`` is not contiguous bytes; the message names it as ``what``.
    """
    try:
        return memoryview(data).cast("B")
    except TypeError as exc:
        raise WireError(f"{what} must be contiguous bytes, got {type(data).__name__}") from exc


def split_chunks(blob: bytes | memoryview, chunk_size: int) -> list[memoryview]:
    """Cut a blob into chunks of ``chunk_size`` bytes (the last one may be shorter).

    The chunks are views of ``blob``, not copies: the publisher copies each once anyway, into
    its protocol command.

    Args:
        blob: Bytes to send; unchanged while the chunks are in use.
        chunk_size: Bytes per chunk, > 0.

    Returns:
        At least one chunk; an empty blob gives one empty chunk.

    Raises:
        WireError: if ``chunk_size`` is not a positive int.
    """
    if not is_int(chunk_size) or chunk_size <= 0:
        raise WireError(f"chunk_size must be a positive int, got {chunk_size!r:.100}")
    view = byte_view(blob, "blob")
    if not len(view):
        return [view]
    return [view[i : i + chunk_size] for i in range(0, len(view), chunk_size)]


class _Upload:
    """Receive state of one incomplete upload."""

    __slots__ = ("buffer", "chunk_size", "count", "received", "remaining", "sender", "total_size")

    def __init__(self, count: int, total_size: int, chunk_size: int, sender: Hashable) -> None:
        self.count = count
        self.total_size = total_size
        self.chunk_size = chunk_size
        self.sender = sender
        # Committed at once: bytearray(n) writes its n zero bytes.
        self.buffer = bytearray(total_size)
        self.received = bytearray(count)
        self.remaining = count


def _implied_chunk_size(info: ChunkInfo, length: int) -> int:
    """Chunk size implied by one chunk's length; WireError if no layout fits."""
    if info.index < info.count - 1:
        size = length
    else:
        # The last chunk holds what is left after count-1 full chunks.
        size, rest = divmod(info.total_size - length, info.count - 1)
        if rest or info.total_size < length:
            raise WireError(
                f"last chunk of {info.upload} is {length} bytes, which does not fit "
                f"{info.count} chunks totalling {info.total_size} bytes"
            )
    last = info.total_size - (info.count - 1) * size
    if size < 1 or not 1 <= last <= size:
        raise WireError(
            f"chunk {info.index}/{info.count} of {info.upload} is {length} bytes, which does "
            f"not fit {info.count} chunks totalling {info.total_size} bytes"
        )
    return size


class Reassembler:
    """Collects chunks (any order, duplicates allowed) and returns each blob once complete.

    A whole upload is preallocated as one bytearray when its first chunk arrives, so memory is
    bounded by ``max_pending_bytes`` (plus, for a moment, the upload that goes over it): when
    the incomplete uploads hold more than that, or are more than ``max_pending_uploads``, one
    is evicted: the least recently active upload of the sender holding the most incomplete
    uploads. One sender that floods the reassembler thus evicts its own uploads, not the
    others'; among senders of one upload each, the least recently active upload goes. A
    completed upload is forgotten, so redelivered chunks of it start it again; deduplicating
    whole uploads is the caller's job.
    """

    def __init__(
        self,
        max_upload_bytes: int,
        max_pending_uploads: int,
        max_pending_bytes: int | None = None,
    ) -> None:
        """Create an empty reassembler.

        Args:
            max_upload_bytes: Largest accepted ``total_size``.
            max_pending_uploads: Most incomplete uploads held at once, >= 1.
            max_pending_bytes: Most bytes the incomplete uploads' buffers hold at once,
                >= ``max_upload_bytes``; None: ``max_pending_uploads * max_upload_bytes``.

        Raises:
            WireError: if a limit is not a valid int.
        """
        if max_pending_bytes is None and is_int(max_upload_bytes) and is_int(max_pending_uploads):
            max_pending_bytes = max_pending_uploads * max_upload_bytes
        for name, value, low in (
            ("max_upload_bytes", max_upload_bytes, 0),
            ("max_pending_uploads", max_pending_uploads, 1),
            ("max_pending_bytes", max_pending_bytes, max_upload_bytes),
        ):
            if not is_int(value) or value < low:
                raise WireError(f"{name} must be an int >= {low}, got {value!r:.100}")
        self._max_upload_bytes = max_upload_bytes
        self._max_pending = max_pending_uploads
        self._max_pending_bytes = max_pending_bytes
        # Insertion order doubles as recency order: each chunk moves its upload to the end.
        self._uploads: OrderedDict[str, _Upload] = OrderedDict()
        self._sender_uploads: defaultdict[Hashable, int] = defaultdict(int)
        self._pending_bytes = 0
        self._evicted: list[str] = []
        self.evicted = 0
        """Number of incomplete uploads evicted so far."""
        self.duplicates = 0
        """Number of chunks ignored because they had already been received."""

    @property
    def pending(self) -> int:
        """Number of incomplete uploads currently held."""
        return len(self._uploads)

    @property
    def pending_bytes(self) -> int:
        """Bytes the incomplete uploads' buffers hold."""
        return self._pending_bytes

    def take_evicted(self) -> list[str]:
        """Ids of the uploads evicted since the last call, oldest eviction first."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def add(
        self, info: ChunkInfo, data: bytes, sender: Hashable | None = None
    ) -> memoryview | None:
        """Store one chunk.

        A chunk that raises leaves the reassembler unchanged.

        Args:
            info: The chunk's position, usually from :func:`parse_chunk_headers`.
            data: The chunk bytes.
            sender: Who sent the upload (e.g. its unit, from an authenticated subject), for
                the evictions; taken from the upload's first chunk. None: the upload id.

        Returns:
            The whole blob (a read-only view of the buffer it was assembled in, not a copy)
            when this chunk completes its upload, else ``None`` (also for a chunk already
            received).

        Raises:
            WireError: if ``total_size`` exceeds ``max_upload_bytes``, ``count`` or
                ``total_size`` disagree with earlier chunks of the upload, the chunk length
                does not fit the layout (all chunks but the last of equal size), or the
                index is out of range.
        """
        _check_info(info)
        if info.total_size > self._max_upload_bytes:
            raise WireError(
                f"upload {info.upload} is {info.total_size} bytes, "
                f"at most {self._max_upload_bytes} allowed"
            )
        view = byte_view(data, "chunk data")
        length = len(view)
        if info.count > 1:
            chunk_size = _implied_chunk_size(info, length)
        elif length == info.total_size:
            chunk_size = length
        else:
            raise WireError(
                f"single-chunk upload {info.upload} is {length} bytes, "
                f"header says {info.total_size}"
            )
        upload = self._uploads.get(info.upload)
        if upload is not None and (upload.count, upload.total_size, upload.chunk_size) != (
            info.count,
            info.total_size,
            chunk_size,
        ):
            raise WireError(
                f"chunk {info.index}/{info.count} ({length} bytes, total {info.total_size}) "
                f"of {info.upload} disagrees with earlier chunks: {upload.count} chunks of "
                f"{upload.chunk_size} bytes, total {upload.total_size}"
            )
        if info.count == 1:
            return view.toreadonly()
        if upload is None:
            upload = _Upload(
                info.count, info.total_size, chunk_size, info.upload if sender is None else sender
            )
            self._hold(info.upload, upload)
            self._evict_beyond_limits()
            if info.upload not in self._uploads:
                return None  # evicted at once: its sender holds the most
        else:
            self._uploads.move_to_end(info.upload)

        if upload.received[info.index]:
            self.duplicates += 1
            return None
        start = info.index * chunk_size
        upload.buffer[start : start + length] = view
        upload.received[info.index] = 1
        upload.remaining -= 1
        if upload.remaining:
            return None
        self._release(info.upload)
        return memoryview(upload.buffer).toreadonly()

    def discard(self, upload: str) -> None:
        """Drop an incomplete upload (no error if unknown).

        Args:
            upload: The upload id.
        """
        if upload in self._uploads:
            self._release(upload)

    def _hold(self, upload_id: str, upload: _Upload) -> None:
        self._uploads[upload_id] = upload
        self._sender_uploads[upload.sender] += 1
        self._pending_bytes += upload.total_size

    def _release(self, upload_id: str) -> _Upload:
        upload = self._uploads.pop(upload_id)
        self._pending_bytes -= upload.total_size
        self._sender_uploads[upload.sender] -= 1
        if not self._sender_uploads[upload.sender]:
            del self._sender_uploads[upload.sender]
        return upload

    def _evict_beyond_limits(self) -> None:
        while (
            len(self._uploads) > self._max_pending or self._pending_bytes > self._max_pending_bytes
        ):
            most = max(self._sender_uploads.values())
            victim = next(
                upload_id
                for upload_id, upload in self._uploads.items()
                if self._sender_uploads[upload.sender] == most
            )
            self._release(victim)
            self.evicted += 1
            self._evicted.append(victim)
