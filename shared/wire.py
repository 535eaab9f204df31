"""Wire format between learners and the outer: a versioned msgpack envelope, chunked for NATS.

An :class:`Envelope` carries one compressed tensor payload (see :mod:`shared.codec`) plus the
metadata the receiver needs. :func:`pack_envelope` turns it into one msgpack map with a wire
version and an XXH3-64 checksum of the payload. NATS caps a message
at the server's ``max_payload`` (1 MiB by default), so a packed envelope is cut with
:func:`split_chunks` and each chunk is published with :func:`chunk_headers`; the receiver
parses those headers with :func:`parse_chunk_headers` and rebuilds the envelope with a
:class:`Reassembler`.

Everything that parses received bytes treats them as hostile: any problem raises
:class:`WireError` (a ``ValueError``), and sizes are checked before memory is committed.
"""

from __future__ import annotations

import math
import numbers
import re
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import numpy as np
import xxhash

from shared.records import JOB_NAME_PATTERN

__all__ = [
    "DEFAULT_MAX_ENVELOPE_SIZE",
    "KINDS",
    "WIRE_VERSION",
    "ChunkInfo",
    "Envelope",
    "Reassembler",
    "WireError",
    "chunk_headers",
    "pack_envelope",
    "parse_chunk_headers",
    "payload_checksum",
    "split_chunks",
    "unpack_envelope",
    "upload_id",
    "validate_job_name",
]

WIRE_VERSION = 1
KINDS = ("pseudo_grad", "params")

DEFAULT_MAX_ENVELOPE_SIZE = 1 << 30

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
_MAX_COUNTER = (1 << 63) - 1
_MAX_MODEL_LEN = 128

# Per-field byte budgets for unpacking. msgpack turns one input byte into an object of up
# to ~64 bytes (an empty list or dict), so every field is measured before it is built and
# only the payload, a single bytes object, may be large.
_MAX_TOP_LEVEL_KEYS = 32
_MAX_KEY_BYTES = 64
_MAX_SCALAR_BYTES = 1024
_MAX_CODEC_BYTES = 1 << 20
_LIMITS = {
    "max_str_len": _MAX_CODEC_BYTES,
    "max_array_len": 1 << 16,
    "max_map_len": 64,
    "max_ext_len": 0,
}


class WireError(ValueError):
    """Raised for any envelope, header or chunk that does not follow the wire format."""


@dataclass(frozen=True)
class Envelope:
    """One message between a learner and the outer.

    Attributes:
        kind: ``"pseudo_grad"`` (learner -> outer) or ``"params"`` (outer -> learners).
        job: Job name; see :func:`validate_job_name`.
        unit: Learner unit index; ``-1`` for messages from the outer.
        round: Per-unit counter (for ``"params"``: the global version).
        fragment: Fragment index within a round (0 until streaming fragments exist).
        base_version: Global version the pseudo-gradient was computed against
            (for ``"params"``: its own version).
        inner_steps: Inner optimizer steps behind this message.
        tokens: Tokens processed for this message.
        train_loss: Mean training loss over those steps.
        codec: The description returned by :func:`shared.codec.encode_tensors`.
        sent_at: Unix time in seconds at which the message was sent.
        payload: The compressed tensors (``bytes``, or the read-only ``memoryview`` that
            :func:`shared.codec.encode` returns; unpacking always gives ``bytes``).
        model: Model size name, so the receiver can reject a mismatch.
    """

    kind: str
    job: str
    unit: int
    round: int
    fragment: int
    base_version: int
    inner_steps: int
    tokens: int
    train_loss: float
    codec: dict
    sent_at: float
    payload: bytes | memoryview
    model: str = ""


_FIELDS = tuple(f.name for f in fields(Envelope))
_REQUIRED = frozenset(_FIELDS) - {"model"}
_COUNTERS = ("round", "fragment", "base_version", "inner_steps", "tokens")


def _is_int(value: Any) -> bool:
    # Integral admits NumPy integers; bool is one too, but True is never a meaningful counter.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


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


def _validate(env: Envelope) -> None:
    """Raise WireError unless every field of ``env`` has an allowed type and value."""
    if env.kind not in KINDS:
        raise WireError(f"kind must be one of {KINDS}, got {env.kind!r:.100}")
    validate_job_name(env.job)
    if not _is_int(env.unit):
        raise WireError(f"unit must be an int, got {env.unit!r:.100}")
    # Learners are numbered from 0; -1 marks the outer, which is the only sender of params.
    if env.kind == "pseudo_grad" and not 0 <= env.unit <= _MAX_COUNTER:
        raise WireError(f"pseudo_grad unit must be in [0, {_MAX_COUNTER}], got {env.unit}")
    if env.kind == "params" and env.unit != -1:
        raise WireError(f"params messages come from the outer and need unit -1, got {env.unit}")
    for name in _COUNTERS:
        value = getattr(env, name)
        if not _is_int(value) or not 0 <= value <= _MAX_COUNTER:
            raise WireError(f"{name} must be an int in [0, {_MAX_COUNTER}], got {value!r:.100}")
    # The loss is a report, not an input to the outer's math: a diverged unit may say NaN.
    if not _is_real(env.train_loss):
        raise WireError(f"train_loss must be a number, got {env.train_loss!r:.100}")
    if not _is_real(env.sent_at) or not 0 <= env.sent_at < math.inf:
        raise WireError(
            f"sent_at must be finite non-negative unix seconds, got {env.sent_at!r:.100}"
        )
    if not isinstance(env.codec, dict) or not all(isinstance(k, str) for k in env.codec):
        raise WireError(f"codec must be a dict with str keys, got {type(env.codec).__name__}")
    if not isinstance(env.payload, bytes | memoryview):
        raise WireError(f"payload must be bytes or memoryview, got {type(env.payload).__name__}")
    if isinstance(env.payload, memoryview) and not (
        env.payload.c_contiguous and env.payload.itemsize == 1
    ):
        raise WireError("a memoryview payload must be contiguous bytes (itemsize 1)")
    if not isinstance(env.model, str) or len(env.model) > _MAX_MODEL_LEN:
        raise WireError(f"model must be a str of at most {_MAX_MODEL_LEN} chars")


def pack_envelope(env: Envelope) -> bytes:
    """Serialise an envelope as one msgpack map with ``"v"`` and ``"checksum"`` added.

    Args:
        env: The envelope; validated with the same rules as :func:`unpack_envelope`.

    Returns:
        The msgpack bytes (typically larger than one NATS message; see :func:`split_chunks`).

    Raises:
        WireError: if a field has a wrong type or value, or the codec dict cannot be packed.
    """
    _validate(env)
    body: dict[str, Any] = {"v": WIRE_VERSION}
    body.update({name: getattr(env, name) for name in _FIELDS})
    # Plain Python numbers on the wire, whatever NumPy scalar types the sender used.
    for name in ("unit", *_COUNTERS):
        body[name] = int(body[name])
    body["train_loss"] = float(env.train_loss)
    body["sent_at"] = float(env.sent_at)
    body["checksum"] = payload_checksum(env.payload)
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"envelope cannot be packed: {exc}") from exc


_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack bin8 / bin16 / bin32 markers
_MAP_LENGTH_BYTES = {0xDE: 2, 0xDF: 4}  # msgpack map16 / map32 markers


def _field_limit(key: str) -> int | None:
    """Largest encoded size accepted for a field's value (None: no limit but max_size)."""
    if key == "payload":
        return None
    return _MAX_SCALAR_BYTES if key in _FIELDS or key in ("v", "checksum") else _MAX_CODEC_BYTES


def _read_length(view: memoryview, start: int, size: int, what: str) -> int:
    if start + size > len(view):
        raise WireError(f"envelope is truncated in the header of {what}")
    return int.from_bytes(view[start : start + size], "big")


def _object_end(view: memoryview, start: int, limit: int | None, what: str) -> int:
    """Offset just past the msgpack object at ``start``, found without building it."""
    if start >= len(view):
        raise WireError(f"envelope is truncated: {what} is missing")
    length_bytes = _BIN_LENGTH_BYTES.get(view[start])
    if length_bytes is not None:
        # Measure bins from their header, so the (large) payload is not copied to find its end.
        body = start + 1 + length_bytes
        end = body + _read_length(view, start + 1, length_bytes, what)
        if end > len(view):
            raise WireError(f"envelope is truncated: {what} needs {end - body} bytes")
    else:
        window = len(view) - start if limit is None else min(limit + 1, len(view) - start)
        # Feeding a bounded window keeps both the copy and the walk small; skip() walks an
        # object without allocating it.
        unpacker = msgpack.Unpacker(max_buffer_size=window, **_LIMITS)
        unpacker.feed(view[start : start + window])
        try:
            unpacker.skip()
        except msgpack.OutOfData:
            bound = "" if limit is None else f" or longer than {limit} bytes"
            raise WireError(f"{what} is truncated{bound}") from None
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise WireError(f"{what} is not valid msgpack: {exc}") from exc
        end = start + unpacker.tell()
    if limit is not None and end - start > limit:
        raise WireError(f"{what} is {end - start} bytes, at most {limit} allowed")
    return end


def _field_spans(view: memoryview) -> dict[str, memoryview]:
    """Split a top-level msgpack map into ``key -> encoded value`` without building any value,
    so every field is size-checked before it is decoded."""
    if not len(view):
        raise WireError("envelope is empty, not a msgpack map")
    marker = view[0]
    if 0x80 <= marker <= 0x8F:  # fixmap
        n_keys, pos = marker & 0x0F, 1
    elif marker in _MAP_LENGTH_BYTES:
        size = _MAP_LENGTH_BYTES[marker]
        n_keys, pos = _read_length(view, 1, size, "the map"), 1 + size
    else:
        raise WireError(f"envelope is not a msgpack map (first byte 0x{marker:02x})")
    if n_keys > _MAX_TOP_LEVEL_KEYS:
        raise WireError(f"envelope has {n_keys} fields, at most {_MAX_TOP_LEVEL_KEYS} allowed")
    spans: dict[str, memoryview] = {}
    for index in range(n_keys):
        end = _object_end(view, pos, _MAX_KEY_BYTES, f"envelope key #{index}")
        try:
            key = msgpack.unpackb(view[pos:end], raw=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise WireError(f"envelope key #{index} is not valid msgpack: {exc}") from exc
        if not isinstance(key, str):
            raise WireError(f"envelope keys must be str, got {key!r:.100}")
        if key in spans:
            raise WireError(f"envelope has duplicate field {key!r}")
        pos, end = end, _object_end(view, end, _field_limit(key), f"envelope field {key!r}")
        spans[key] = view[pos:end]
        pos = end
    if pos != len(view):
        raise WireError(f"envelope has {len(view) - pos} trailing bytes")
    return spans


def _decode_field(key: str, span: memoryview) -> Any:
    try:
        return msgpack.unpackb(span, raw=False, max_bin_len=len(span), **_LIMITS)
    except Exception as exc:  # spans were only measured; decoding can still fail
        raise WireError(f"envelope field {key!r} is not valid msgpack: {exc}") from exc


def unpack_envelope(data: bytes, max_size: int = DEFAULT_MAX_ENVELOPE_SIZE) -> Envelope:
    """Parse and validate bytes produced by :func:`pack_envelope`.

    Args:
        data: The (reassembled) message bytes.
        max_size: Largest accepted ``len(data)``.

    Returns:
        The validated envelope.

    Raises:
        WireError: if ``data`` is too large, not a msgpack map, has the wrong or no wire
            version, lacks a field, has an unknown or mistyped field, a negative counter,
            a bad job name, or a payload that does not match its checksum.
    """
    view = _byte_view(data, "envelope")
    if len(view) > max_size:
        raise WireError(f"envelope is {len(view)} bytes, at most {max_size} allowed")
    spans = _field_spans(view)
    # Version first: a newer sender's message must be reported as such, not as bad fields.
    if "v" not in spans:
        raise WireError("envelope has no wire version field 'v'")
    version = _decode_field("v", spans.pop("v"))
    if not _is_int(version) or version != WIRE_VERSION:
        raise WireError(
            f"unsupported wire version {version!r:.100}; expected {WIRE_VERSION} "
            "(are all services on the same release?)"
        )
    allowed = set(_FIELDS) | {"checksum"}
    unknown = sorted(set(spans) - allowed)
    missing = sorted((_REQUIRED | {"checksum"}) - set(spans))
    if unknown or missing:
        raise WireError(f"envelope fields wrong: missing {missing}, unknown {str(unknown)[:200]}")
    values = {key: _decode_field(key, span) for key, span in spans.items()}
    checksum = values.pop("checksum")
    if isinstance(values.get("train_loss"), int) and not isinstance(values["train_loss"], bool):
        values["train_loss"] = float(values["train_loss"])
    env = Envelope(**values)
    _validate(env)
    actual = payload_checksum(env.payload)
    if not _is_int(checksum) or checksum != actual:
        raise WireError(
            f"payload checksum mismatch: header says {checksum!r:.40}, payload has {actual}"
        )
    return env


def payload_checksum(payload: bytes | memoryview) -> int:
    """The envelope's ``checksum`` field: XXH3-64 of the payload bytes."""
    return xxhash.xxh3_64_intdigest(payload)


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
    if not _is_int(unit) or not -1 <= unit <= _MAX_COUNTER:
        raise WireError(f"unit must be an int >= -1, got {unit!r:.100}")
    for name, value in (("round", round), ("fragment", fragment)):
        if not _is_int(value) or not 0 <= value <= _MAX_COUNTER:
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
    if max(unit, round_, fragment) > _MAX_COUNTER:
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
    if not all(_is_int(v) for v in (info.index, info.count, info.total_size)):
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


def _byte_view(data: Any, what: str) -> memoryview:
    """A flat byte view of any contiguous bytes-like object (len() then counts bytes)."""
    try:
        return memoryview(data).cast("B")
    except TypeError as exc:
        raise WireError(f"{what} must be contiguous bytes, got {type(data).__name__}") from exc


def split_chunks(blob: bytes, chunk_size: int) -> list[bytes]:
    """Cut a blob into chunks of ``chunk_size`` bytes (the last one may be shorter).

    Args:
        blob: Bytes to send.
        chunk_size: Bytes per chunk, > 0.

    Returns:
        At least one chunk; an empty blob gives ``[b""]``.

    Raises:
        WireError: if ``chunk_size`` is not a positive int.
    """
    if not _is_int(chunk_size) or chunk_size <= 0:
        raise WireError(f"chunk_size must be a positive int, got {chunk_size!r:.100}")
    view = _byte_view(blob, "blob")
    if not len(view):
        return [b""]
    return [view[i : i + chunk_size].tobytes() for i in range(0, len(view), chunk_size)]


class _Upload:
    """Receive state of one incomplete upload."""

    __slots__ = ("buffer", "chunk_size", "count", "received", "remaining", "total_size")

    def __init__(self, count: int, total_size: int, chunk_size: int) -> None:
        self.count = count
        self.total_size = total_size
        self.chunk_size = chunk_size
        # bytearray(n) is zero-filled lazily by the OS, so memory is committed as chunks land.
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

    Memory is bounded by ``max_pending_uploads * max_upload_bytes``: a whole upload is
    preallocated as one bytearray when its first chunk arrives, and when too many uploads are
    incomplete the least recently active one is evicted. A completed upload is forgotten, so
    redelivered chunks of it start it again; deduplicating whole uploads is the caller's job.
    """

    def __init__(self, max_upload_bytes: int, max_pending_uploads: int) -> None:
        """Create an empty reassembler.

        Args:
            max_upload_bytes: Largest accepted ``total_size``.
            max_pending_uploads: Most incomplete uploads held at once, >= 1.

        Raises:
            WireError: if a limit is not a valid int.
        """
        for name, value, low in (
            ("max_upload_bytes", max_upload_bytes, 0),
            ("max_pending_uploads", max_pending_uploads, 1),
        ):
            if not _is_int(value) or value < low:
                raise WireError(f"{name} must be an int >= {low}, got {value!r:.100}")
        self._max_upload_bytes = max_upload_bytes
        self._max_pending = max_pending_uploads
        # Insertion order doubles as recency order: each chunk moves its upload to the end.
        self._uploads: OrderedDict[str, _Upload] = OrderedDict()
        self._recently_evicted: deque[str] = deque(maxlen=64)
        self.evicted = 0
        """Number of incomplete uploads evicted so far."""
        self.duplicates = 0
        """Number of chunks ignored because they had already been received."""

    @property
    def pending(self) -> int:
        """Number of incomplete uploads currently held."""
        return len(self._uploads)

    @property
    def recently_evicted(self) -> tuple[str, ...]:
        """Ids of the (up to 64) most recently evicted uploads, oldest first."""
        return tuple(self._recently_evicted)

    def add(self, info: ChunkInfo, data: bytes) -> bytes | None:
        """Store one chunk.

        A chunk that raises leaves the reassembler unchanged.

        Args:
            info: The chunk's position, usually from :func:`parse_chunk_headers`.
            data: The chunk bytes.

        Returns:
            The whole blob when this chunk completes its upload, else ``None`` (also for a
            chunk already received).

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
        view = _byte_view(data, "chunk data")
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
            return view.tobytes()
        if upload is None:
            upload = _Upload(info.count, info.total_size, chunk_size)
            self._uploads[info.upload] = upload
            self._evict_beyond_limit()
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
        del self._uploads[info.upload]
        return bytes(upload.buffer)

    def discard(self, upload: str) -> None:
        """Drop an incomplete upload (no error if unknown).

        Args:
            upload: The upload id.
        """
        self._uploads.pop(upload, None)

    def _evict_beyond_limit(self) -> None:
        while len(self._uploads) > self._max_pending:
            oldest, _ = self._uploads.popitem(last=False)
            self.evicted += 1
            self._recently_evicted.append(oldest)
