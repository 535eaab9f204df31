"""The description of a payload: everything a decoder needs to know about it, as a typed model.

The encoder (:mod:`shared.codec.api`) returns a :class:`Description` with every payload; the
wire envelope (:mod:`shared.wire.envelope`) carries it as a plain msgpack map
(:meth:`Description.to_wire`) and builds it back with :meth:`Description.parse`, which treats
that map as hostile and checks every field once; the decoder then takes the model as it is.
The map of a two-tensor int4 payload::

    {"version": 1, "codec": "int4", "bits": 4, "block_size": 256, "segment": 2,
     "zstd_level": 1, "raw_size": 264, "frames": [38],
     "checksums": [3021263609467155988],
     "tensors": [["layer/b", [3], "float32"], ["layer/w", [2, 3], "float32"]]}

Raw (uncompressed) layout, tensors in sorted-name order, little-endian throughout. A *unit*
is one value for ``fp32`` / ``bf16`` and one block of ``block_size`` values for the block
codecs (each tensor is cut into its own blocks, the last one zero-padded, so a block never
mixes two tensors). The units of all tensors, in order, are cut into *segments* of
``segment`` units, and each segment is one zstd frame:

* ``fp32`` / ``bf16``: the segment's values, 4 or 2 bytes each.
* ``int8`` / ``int4`` / ``int2``: the segment's ``m`` float32 scales, then its ``m`` packed
  code blocks (planar packing, see :mod:`shared.codec.quantize`).

``frames`` lists the compressed size of every frame (the payload is the frames back to back)
and ``checksums`` the XXH3-64 of every frame's bytes (an unsigned int).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

from shared.codec.config import (
    BITS,
    BLOCK_CODECS,
    CODECS,
    CodecError,
    check_block_size,
    check_zstd_level,
    is_int,
)
from shared.codec.layout import DTYPE, Layout, TensorSpec

__all__ = [
    "FORMAT_VERSION",
    "MAX_NDIM",
    "MAX_RAW_SIZE",
    "MAX_SEGMENT_UNITS",
    "Description",
    "bytes_per_block",
    "raw_size_of",
    "unit_bytes",
    "unit_elements",
]

FORMAT_VERSION = 1
MAX_NDIM = 32
MAX_SEGMENT_UNITS = 1 << 26
# No payload is this large; decoders set their own, far lower limits (decode_tensors).
MAX_RAW_SIZE = 1 << 62

_MAX_ELEMENTS = 1 << 60
_U64_MAX = (1 << 64) - 1
_KEYS = frozenset(
    {"version", "codec", "bits", "block_size", "segment", "zstd_level", "raw_size", "frames",
     "checksums", "tensors"}
)  # fmt: skip
_SEQUENCES = frozenset({list, tuple})


def bytes_per_block(bits: int, block_size: int) -> int:
    """Packed code bytes of one block (its scale not included)."""
    return block_size * bits // 8


def n_blocks(size: int, block_size: int) -> int:
    """Blocks of ``block_size`` that ``size`` values fill (the last one may be partial)."""
    return -(-size // block_size)


def unit_elements(codec: str, block_size: int) -> int:
    """Values per unit: a block for the block codecs, one value otherwise."""
    return block_size if codec in BLOCK_CODECS else 1


def unit_bytes(codec: str, block_size: int) -> int:
    """Raw bytes per unit: a block's scale and codes, or one value."""
    if codec in BLOCK_CODECS:
        return 4 + bytes_per_block(BITS[codec], block_size)
    return BITS[codec] // 8


def raw_size_of(codec: str, block_size: int, sizes: Iterable[int]) -> int:
    """Raw bytes of tensors of ``sizes`` values: each tensor's units, all of one size."""
    unit = unit_elements(codec, block_size)
    return unit_bytes(codec, block_size) * sum(n_blocks(n, unit) for n in sizes)


@dataclass(frozen=True)
class Description:
    """Everything needed to decode one payload (see the module docstring).

    Built by the encoder, or by :meth:`parse` from a received map; the constructor itself
    checks nothing, so code that builds one by hand must keep its fields consistent.

    Attributes:
        codec: One of :data:`shared.codec.config.CODECS`.
        block_size: Values per quantisation block (block codecs; a multiple of 16).
        segment: Units per segment (one zstd frame; the last may hold fewer).
        zstd_level: The level the frames were compressed at (for the record).
        raw_size: Uncompressed bytes of all frames together.
        frames: Compressed size of each frame, in payload order.
        checksums: XXH3-64 of each frame's bytes.
        layout: The tensors' names and shapes, in sorted-name order.
    """

    codec: str
    block_size: int
    segment: int
    zstd_level: int
    raw_size: int
    frames: tuple[int, ...]
    checksums: tuple[int, ...]
    layout: Layout

    @property
    def bits(self) -> int:
        """Bits per value of the codec."""
        return BITS[self.codec]

    @property
    def units(self) -> int:
        """Units (blocks or values) of all tensors together."""
        return self.raw_size // unit_bytes(self.codec, self.block_size)

    @property
    def tensors(self) -> list[TensorSpec]:
        """Name, shape and dtype of each tensor, in sorted-name order."""
        return [
            TensorSpec(n, s) for n, s in zip(self.layout.names, self.layout.shapes, strict=True)
        ]

    def to_wire(self) -> dict[str, Any]:
        """The description as a plain msgpack-able map (the module docstring shows one)."""
        return {
            "version": FORMAT_VERSION,
            "codec": self.codec,
            "bits": self.bits,
            "block_size": self.block_size,
            "segment": self.segment,
            "zstd_level": self.zstd_level,
            "raw_size": self.raw_size,
            "frames": list(self.frames),
            "checksums": list(self.checksums),
            "tensors": [
                [name, list(shape), DTYPE]
                for name, shape in zip(self.layout.names, self.layout.shapes, strict=True)
            ],
        }

    @classmethod
    def parse(cls, description: Any) -> Description:
        """Check a received map (hostile: any msgpack-able value) and build its model.

        Args:
            description: What :meth:`to_wire` made, after a msgpack round trip (lists instead
                of tuples and NumPy ints are accepted too).

        Returns:
            The description.

        Raises:
            CodecError: for anything but a map of exactly the described keys with consistent
                values: another format version (named in the message), an unknown codec,
                ``bits`` that do not match it, a bad block size, segment or zstd level, a
                ``raw_size`` that is not what the tensors need, unsorted or repeated names,
                bad shapes or dtypes, or not one frame size and checksum per segment.
        """
        return _parse(description)


def _parse(description: Any) -> Description:
    if not isinstance(description, Mapping):
        raise CodecError(f"description must be a mapping, got {type(description).__name__}")
    keys = set(description)
    if keys != _KEYS:
        missing = sorted(map(str, _KEYS - keys))
        unknown = sorted(map(repr, keys - _KEYS))
        raise CodecError(
            f"description keys must be {sorted(_KEYS)}; missing {missing}, unknown {unknown}"
        )
    version = description["version"]
    if not is_int(version) or version != FORMAT_VERSION:
        raise CodecError(
            f"payload format version {version!r:.50} is not {FORMAT_VERSION}, the only one "
            "this decoder reads (are all services on the same release?)"
        )
    codec = description["codec"]
    if not isinstance(codec, str) or codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r:.100}; expected one of {CODECS}")
    bits = description["bits"]
    if not is_int(bits) or bits != BITS[codec]:
        raise CodecError(f"codec {codec!r} has {BITS[codec]} bits, description says {bits!r:.50}")
    block_size = check_block_size(description["block_size"])
    segment = description["segment"]
    if not is_int(segment) or not 1 <= segment <= MAX_SEGMENT_UNITS:
        raise CodecError(
            f"segment must be an int in [1, {MAX_SEGMENT_UNITS}], got {segment!r:.100}"
        )
    zstd_level = check_zstd_level(description["zstd_level"])
    raw_size = description["raw_size"]
    if not is_int(raw_size) or raw_size < 0:
        raise CodecError(f"raw_size must be a non-negative int, got {raw_size!r:.100}")
    raw_size = int(raw_size)
    if raw_size > MAX_RAW_SIZE:
        raise CodecError(f"raw_size {raw_size} exceeds the limit of {MAX_RAW_SIZE} bytes")

    names, shapes, sizes = _parse_tensors(description["tensors"])
    expected = raw_size_of(codec, block_size, sizes)
    if expected != raw_size:
        raise CodecError(
            f"raw_size {raw_size} does not match the {len(names)} tensor(s) described: "
            f"codec {codec!r} with block_size {block_size} needs {expected} bytes"
        )
    frames = description["frames"]
    n_frames = n_blocks(raw_size // unit_bytes(codec, block_size), segment)
    if not isinstance(frames, list | tuple) or len(frames) != n_frames:
        raise CodecError(
            f"frames must list the compressed size of each of the {n_frames} frame(s), "
            f"got {frames!r:.100}"
        )
    if not all(is_int(f) and f > 0 for f in frames):
        raise CodecError(f"frame sizes must be positive ints, got {frames!r:.100}")
    checksums = description["checksums"]
    if not isinstance(checksums, list | tuple) or len(checksums) != n_frames:
        raise CodecError(
            f"checksums must list the XXH3-64 of each of the {n_frames} frame(s), "
            f"got {checksums!r:.100}"
        )
    if not all(is_int(c) and 0 <= c <= _U64_MAX for c in checksums):
        raise CodecError(f"checksums must be unsigned 64-bit ints, got {checksums!r:.100}")
    return Description(
        codec,
        block_size,
        int(segment),
        zstd_level,
        raw_size,
        tuple(map(int, frames)),
        tuple(map(int, checksums)),
        Layout.from_checked(tuple(names), tuple(shapes)),
    )


def _parse_tensors(entries: Any) -> tuple[list[str], list[tuple[int, ...]], list[int]]:
    """Names, shapes and sizes of the described tensors, all checked."""
    if not isinstance(entries, list | tuple):
        raise CodecError(f"description tensors must be a list, got {type(entries).__name__}")
    fast = _parse_plain_tensors(entries)
    if fast is not None:
        return fast
    specs = [_parse_tensor_entry(i, e) for i, e in enumerate(entries)]
    for prev, cur in pairwise(specs):
        # The encoder writes sorted names; this also rules out duplicates.
        if not prev.name < cur.name:
            raise CodecError(
                f"tensor names must be unique and sorted, got {prev.name!r} before {cur.name!r}"
            )
    return [s.name for s in specs], [s.shape for s in specs], [s.size for s in specs]


def _parse_plain_tensors(
    entries: list | tuple,
) -> tuple[list[str], list[tuple[int, ...]], list[int]] | None:
    """:func:`_parse_tensors` for what encoders write, checked in a few passes that run in C
    (a description can list thousands of tensors). Accepts a subset of what the per-entry
    checks accept, with the same result; None for anything else (a str subclass, a NumPy
    int, a zero or too-large dimension, an error), which :func:`_parse_tensor_entry` then
    explains or accepts."""
    if not entries:
        return [], [], []
    if not _SEQUENCES.issuperset(map(type, entries)) or not {3}.issuperset(map(len, entries)):
        return None
    names, shapes, dtypes = zip(*entries, strict=True)
    if not {str}.issuperset(map(type, names)) or not _SEQUENCES.issuperset(map(type, shapes)):
        return None
    if dtypes.count(DTYPE) != len(dtypes) or max(map(len, shapes)) > MAX_NDIM:
        return None
    dims = list(chain.from_iterable(shapes))
    if not {int}.issuperset(map(type, dims)) or (dims and min(dims) <= 0):
        return None
    if not all(map(operator.lt, names, names[1:])):  # sorted and unique
        return None
    shapes = list(map(tuple, shapes))
    sizes = list(map(math.prod, shapes))
    if max(sizes) > _MAX_ELEMENTS:
        return None
    return list(names), shapes, sizes


def _parse_tensor_entry(index: int, entry: Any) -> TensorSpec:
    if not isinstance(entry, list | tuple) or len(entry) != 3:
        raise CodecError(
            f"description tensors[{index}] must be [name, shape, dtype], got {entry!r:.200}"
        )
    name, shape, dtype = entry
    if not isinstance(name, str):
        raise CodecError(f"description tensors[{index}] name must be str, got {name!r:.200}")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
        raise CodecError(
            f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} ints, got {shape!r:.200}"
        )
    if not all(is_int(d) and d >= 0 for d in shape):
        raise CodecError(f"tensor {name!r}: shape must hold non-negative ints, got {shape!r}")
    shape = tuple(map(int, shape))
    # Zero-size tensors pass the raw_size check whatever their other dimensions are, but
    # NumPy still refuses shapes whose non-zero dimensions multiply past its index range.
    if math.prod(d or 1 for d in shape) > _MAX_ELEMENTS:
        raise CodecError(f"tensor {name!r}: shape {shape!r} is too large")
    if dtype != DTYPE:
        raise CodecError(f"tensor {name!r}: dtype must be {DTYPE!r}, got {dtype!r:.200}")
    return TensorSpec(name, shape, dtype)
