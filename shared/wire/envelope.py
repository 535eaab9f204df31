"""The envelope: one message between learners and the outer, as one versioned msgpack map.

Two kinds of message travel, each with its own type and only its own fields:

* :class:`PseudoGradEnvelope` (``"pseudo_grad"``): a learner's upload to the outer.
* :class:`ParamsEnvelope` (``"params"``): a fragment's global params, from the outer.

Each carries a compressed tensor payload and its :class:`~shared.codec.description.Description`.
:func:`pack_envelope` writes one msgpack map: the wire version ``"v"``, the ``"kind"``, the
type's fields (the description as its plain map), and an XXH3-64 ``"checksum"`` of the
payload. :func:`unpack_envelope` returns the type the ``"kind"`` names, so a reader checks the
kind with ``isinstance``. The packed map is usually larger than one NATS message; it travels
in chunks (:mod:`shared.wire.chunks`).

Unpacking treats the bytes as hostile: every field is measured before it is built (msgpack
turns one input byte into an object of up to ~64 bytes, an empty list or dict, so only the
payload, a single bin, may be large), then type- and range-checked, the description is parsed
once (:meth:`Description.parse`), and the payload is checked against its checksum. Any
problem raises :class:`~shared.wire.chunks.WireError`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack
import numpy as np
import xxhash

from shared.codec.config import CodecError
from shared.codec.description import Description
from shared.wire.chunks import MAX_COUNTER, WireError, byte_view, is_int, validate_job_name

__all__ = [
    "DEFAULT_MAX_ENVELOPE_SIZE",
    "WIRE_VERSION",
    "Envelope",
    "ParamsEnvelope",
    "PseudoGradEnvelope",
    "pack_envelope",
    "payload_checksum",
    "unpack_envelope",
]

WIRE_VERSION = 2
DEFAULT_MAX_ENVELOPE_SIZE = 1 << 30
MAX_MODEL_LEN = 128


@dataclass(frozen=True, kw_only=True)
class PseudoGradEnvelope:
    """A learner's upload: one fragment's pseudo-gradient Δ = θ_base − θ_local.

    Attributes:
        job: Job name; see :func:`~shared.wire.chunks.validate_job_name`.
        model: Model size name, so that the outer can reject a mismatch.
        unit: Learner unit index, >= 0.
        round: The unit's upload counter (never reused).
        fragment: Parameter fragment p.
        base_version: Global version of the fragment the pseudo-gradient was computed against.
        inner_steps: Inner optimizer steps behind it.
        tokens: Tokens processed for it.
        train_loss: Mean training loss over those steps (may be NaN: a diverged unit says so).
        codec: The payload's description.
        sent_at: Unix time in seconds at which it was sent.
        payload: The compressed tensors (``bytes``, or a read-only ``memoryview``: what the
            codec returns, and what unpacking gives, a view of the received bytes).
    """

    kind: ClassVar[str] = "pseudo_grad"
    _counters: ClassVar[tuple[str, ...]] = (
        "unit",
        "round",
        "fragment",
        "base_version",
        "inner_steps",
        "tokens",
    )

    job: str
    model: str
    unit: int
    round: int
    fragment: int
    base_version: int
    inner_steps: int
    tokens: int
    train_loss: float
    codec: Description
    sent_at: float
    payload: bytes | memoryview


@dataclass(frozen=True, kw_only=True)
class ParamsEnvelope:
    """One version of one fragment's global params, published by the outer.

    Attributes:
        job: Job name; see :func:`~shared.wire.chunks.validate_job_name`.
        model: Model size name, so that a learner can reject a mismatch.
        fragment: Parameter fragment p.
        version: The fragment's global version.
        tokens: Tokens the outer had applied to the model when it published this version.
        codec: The payload's description.
        sent_at: Unix time in seconds at which it was published.
        payload: The compressed params (as for :class:`PseudoGradEnvelope`).
    """

    kind: ClassVar[str] = "params"
    _counters: ClassVar[tuple[str, ...]] = ("fragment", "version", "tokens")

    job: str
    model: str
    fragment: int
    version: int
    tokens: int
    codec: Description
    sent_at: float
    payload: bytes | memoryview


Envelope = PseudoGradEnvelope | ParamsEnvelope
_TYPES: dict[str, type[PseudoGradEnvelope] | type[ParamsEnvelope]] = {
    cls.kind: cls for cls in (PseudoGradEnvelope, ParamsEnvelope)
}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in _TYPES.values()}

# Per-field byte budgets for unpacking (see the module docstring).
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
_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack bin8 / bin16 / bin32 markers
_MAP_LENGTH_BYTES = {0xDE: 2, 0xDF: 4}  # msgpack map16 / map32 markers


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def _validate(env: Envelope) -> None:
    """Raise WireError unless every field of ``env`` has an allowed type and value."""
    if not isinstance(env, PseudoGradEnvelope | ParamsEnvelope):
        raise WireError(f"not an envelope: {type(env).__name__}")
    validate_job_name(env.job)
    if not isinstance(env.model, str) or len(env.model) > MAX_MODEL_LEN:
        raise WireError(f"model must be a str of at most {MAX_MODEL_LEN} chars")
    for name in env._counters:
        value = getattr(env, name)
        if not is_int(value) or not 0 <= value <= MAX_COUNTER:
            raise WireError(f"{name} must be an int in [0, {MAX_COUNTER}], got {value!r:.100}")
    # The loss is a report, not an input to the outer's math: a diverged unit may say NaN.
    if isinstance(env, PseudoGradEnvelope) and not _is_real(env.train_loss):
        raise WireError(f"train_loss must be a number, got {env.train_loss!r:.100}")
    if not _is_real(env.sent_at) or not 0 <= env.sent_at < math.inf:
        raise WireError(
            f"sent_at must be finite non-negative unix seconds, got {env.sent_at!r:.100}"
        )
    if not isinstance(env.codec, Description):
        raise WireError(f"codec must be a Description, got {type(env.codec).__name__}")
    if not isinstance(env.payload, bytes | memoryview):
        raise WireError(f"payload must be bytes or memoryview, got {type(env.payload).__name__}")
    if isinstance(env.payload, memoryview) and not (
        env.payload.c_contiguous and env.payload.itemsize == 1
    ):
        raise WireError("a memoryview payload must be contiguous bytes (itemsize 1)")


def pack_envelope(env: Envelope) -> bytes:
    """Serialise an envelope as one msgpack map with ``"v"``, ``"kind"`` and ``"checksum"``.

    Args:
        env: The envelope; validated with the same rules as :func:`unpack_envelope`.

    Returns:
        The msgpack bytes (typically larger than one NATS message; see
        :func:`shared.wire.chunks.split_chunks`).

    Raises:
        WireError: if a field has a wrong type or value.
    """
    _validate(env)
    body: dict[str, Any] = {"v": WIRE_VERSION, "kind": env.kind}
    body.update({name: getattr(env, name) for name in _FIELDS[type(env)]})
    # Plain Python numbers on the wire, whatever NumPy scalar types the sender used.
    for name in env._counters:
        body[name] = int(body[name])
    if isinstance(env, PseudoGradEnvelope):
        body["train_loss"] = float(env.train_loss)
    body["sent_at"] = float(env.sent_at)
    body["codec"] = env.codec.to_wire()
    body["checksum"] = payload_checksum(env.payload)
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"envelope cannot be packed: {exc}") from exc


def _field_limit(key: str) -> int | None:
    """Largest encoded size accepted for a field's value (None: no limit but max_size)."""
    if key == "payload":
        return None
    return _MAX_CODEC_BYTES if key == "codec" else _MAX_SCALAR_BYTES


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


def _bin_body(key: str, span: memoryview) -> memoryview:
    """The bytes of a msgpack bin, as a view of ``span`` (no copy)."""
    length_bytes = _BIN_LENGTH_BYTES.get(span[0])
    if length_bytes is None:
        found = type(_decode_field(key, span)).__name__
        raise WireError(f"envelope field {key!r} must be bytes, got {found}")
    return span[1 + length_bytes :]


def unpack_envelope(data: bytes, max_size: int = DEFAULT_MAX_ENVELOPE_SIZE) -> Envelope:
    """Parse and validate bytes produced by :func:`pack_envelope`.

    Args:
        data: The (reassembled) message bytes.
        max_size: Largest accepted ``len(data)``.

    Returns:
        A :class:`PseudoGradEnvelope` or a :class:`ParamsEnvelope`, as its ``"kind"`` says.
        Its payload is a read-only view of ``data``.

    Raises:
        WireError: if ``data`` is too large, not a msgpack map, has the wrong or no wire
            version, an unknown kind, lacks a field of its kind, has an unknown or mistyped
            field, a negative counter, a bad job name, a codec description that does not
            parse (the reason from :meth:`Description.parse`), or a payload that does not
            match its checksum.
    """
    view = byte_view(data, "envelope")
    if len(view) > max_size:
        raise WireError(f"envelope is {len(view)} bytes, at most {max_size} allowed")
    spans = _field_spans(view)
    # Version first: a newer sender's message must be reported as such, not as bad fields.
    if "v" not in spans:
        raise WireError("envelope has no wire version field 'v'")
    version = _decode_field("v", spans.pop("v"))
    if not is_int(version) or version != WIRE_VERSION:
        raise WireError(
            f"unsupported wire version {version!r:.100}; expected {WIRE_VERSION} "
            "(are all services on the same release?)"
        )
    if "kind" not in spans:
        raise WireError("envelope fields wrong: missing ['kind']")
    kind = _decode_field("kind", spans.pop("kind"))
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"kind must be one of {sorted(_TYPES)}, got {kind!r:.100}")
    expected = {*_FIELDS[cls], "checksum"}
    unknown = sorted(set(spans) - expected)
    missing = sorted(expected - set(spans))
    if unknown or missing:
        raise WireError(f"envelope fields wrong: missing {missing}, unknown {str(unknown)[:200]}")
    payload = _bin_body("payload", spans.pop("payload"))
    values = {key: _decode_field(key, span) for key, span in spans.items()}
    checksum = values.pop("checksum")
    if isinstance(values.get("train_loss"), int) and not isinstance(values["train_loss"], bool):
        values["train_loss"] = float(values["train_loss"])
    try:
        values["codec"] = Description.parse(values["codec"])
    except CodecError as err:
        raise WireError(f"envelope field 'codec': {err}") from err
    env = cls(**values, payload=payload)
    _validate(env)
    actual = payload_checksum(payload)
    if not is_int(checksum) or checksum != actual:
        raise WireError(
            f"payload checksum mismatch: header says {checksum!r:.40}, payload has {actual}"
        )
    return env


def payload_checksum(payload: bytes | memoryview) -> int:
    """The envelope's ``checksum`` field: XXH3-64 of the payload bytes."""
    return xxhash.xxh3_64_intdigest(payload)
