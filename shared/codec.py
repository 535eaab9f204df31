"""Pseudo-gradient codec: named float32 tensors <-> one compressed, self-describing payload.

A codec is a set of three functions with explicit state, in the style of optax
(:class:`Codec`, made by :func:`make_codec`)::

    codec = make_codec(CodecConfig("int4", error_feedback=True))
    state = codec.init(shapes)                      # error-feedback residuals (zeros)
    payload, description, state = codec.encode(tensors, state)
    tensors = codec.decode(payload, description)    # needs nothing but the two values

Tensors held back to back in one float32 buffer are encoded with :func:`encode_flat` and a
:class:`Layout` (names, shapes, offsets) made once: same payload, less work per call.

Schemes (``codec``), all with fp32 scales and fp32 accumulation:

========  ====  ===================================================================
name      bits  values
========  ====  ===================================================================
``fp32``  32    exact
``bf16``  16    round to nearest even; ``|err| <= 2^-8 |x|`` (plus 2^-134 if subnormal)
``int8``  8     blockwise absmax, codes in [-127, 127]; ``|err| <= absmax / 254``
``int4``  4     blockwise absmax, codes in [-7, 7]; ``|err| <= absmax / 14``
``int2``  2     blockwise ternary {-s, 0, s} (TWN); ``‖err‖ < ‖x‖`` per non-zero block
========  ====  ===================================================================

The bounds are per element, ``absmax`` being the largest ``|x|`` of the element's block;
``int8`` / ``int4`` add float32 rounding (a few ulps of ``absmax``) and at most one subnormal
ulp (2^-149) where the scale is subnormal. A zero block always decodes to zeros. Bit for
bit, ``bf16`` is ``x.astype(ml_dtypes.bfloat16)`` (a value that rounds to Inf is rejected).
The relative L2 error each scheme reaches on real and Gaussian pseudo-gradients is measured
by ``bench/codec.py`` (BENCHMARKS.md).

Per-element quantisation kernels live in :mod:`shared.quant`. With ``error_feedback`` the
codec keeps, per tensor, the residual ``e`` of what earlier rounds failed to send, and
encodes ``x + e`` (standard error feedback: ``e ← e + Δ; c = Q(e); e ← e − c``). The state
passed to ``encode`` is *consumed*: its buffers are updated in place and handed back in the
returned state (as with JAX buffer donation), so keep only the returned one; reusing a
consumed state raises :class:`CodecError`. After an encoding error the state is consumed
too; start again from ``init``. ``state.residual`` is a plain dict of arrays, so it can be
checkpointed.

The description (a plain msgpack-able dict) says everything needed to decode::

    {"version": 1, "codec": "int4", "bits": 4, "block_size": 256, "segment": 2,
     "zstd_level": 1, "raw_size": 264, "frames": [38],
     "checksums": [3021263609467155988],
     "tensors": [["layer/b", [3], "float32"], ["layer/w", [2, 3], "float32"]]}

Raw (uncompressed) layout, tensors in sorted-name order, little-endian throughout. A *unit*
is one value for ``fp32`` / ``bf16`` and one block of ``block_size`` values for the block
codecs (each tensor is cut into its own blocks, the last one zero-padded, so a block never
mixes two tensors). The units of all tensors, in order, are cut into *segments* of
``segment`` units (equal segments, as many as is nearest to one per 4 MiB of float32 input,
at least one), and each segment is one zstd frame:

* ``fp32`` / ``bf16``: the segment's values, 4 or 2 bytes each.
* ``int8`` / ``int4`` / ``int2``: the segment's ``m`` float32 scales, then its ``m`` packed
  code blocks (planar packing, see :mod:`shared.quant`).

``frames`` lists the compressed size of every frame; the payload is the frames back to back,
each copied into one buffer as soon as it is compressed (see :mod:`shared.zstd`).
``checksums`` holds the XXH3-64 of every frame's bytes (as an unsigned int), which the
decoder checks before it decompresses the frame, so corruption is detected; each frame also
records its content size, so the decoder knows its exact output size before decompressing
it. Segments keep the encoder's working set in cache (quantise 4 MiB, compress it while it
is still there), let large payloads be coded on several threads (``threads``), and bound
every allocation the decoder makes to one segment plus the output.

The decoder treats payload and description as hostile: every field is checked, the declared
size is bounded *before* anything is decompressed, decoded scales, codes and values are
validated, and any problem raises :class:`CodecError`.
"""

from __future__ import annotations

import math
import operator
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate, chain, pairwise
from typing import Any, NamedTuple

import numpy as np
import xxhash

from shared import quant, zstd
from shared.codec_config import (
    BITS,
    BLOCK_CODECS,
    BLOCK_MULTIPLE,
    CODECS,
    CodecConfig,
    CodecError,
    check_block_size,
    check_zstd_level,
    is_int,
)

__all__ = [
    "BLOCK_CODECS",
    "CODECS",
    "FORMAT_VERSION",
    "Codec",
    "CodecConfig",
    "CodecError",
    "CodecState",
    "Layout",
    "TensorSpec",
    "decode_tensors",
    "encode",
    "encode_flat",
    "encode_tensors",
    "extend_state",
    "warm_up",
    "init_state",
    "make_codec",
]

FORMAT_VERSION = 1
MAX_NDIM = 32
DEFAULT_MAX_RAW_SIZE = 2**31
DEFAULT_MAX_OUTPUT_BYTES = 2**34
# Elements per segment (one zstd frame), nominally: 4 MiB of float32 (a payload's frames are
# all of one size, within a factor 1.5 of this; see _plan). A segment's raw bytes (1 MiB for
# int8) are still in cache when zstd reads them, and there are few enough frames that the
# per-frame output buffers cost little (each frame's fresh output allocation page-faults, so
# many small frames are slower; bench/codec.py measures it).
SEGMENT_ELEMENTS = 1 << 20
MAX_SEGMENT_UNITS = 1 << 26
# Payloads below this many raw bytes are coded on the calling thread whatever threads says.
THREADS_MIN_BYTES = 8 << 20

_DTYPE = "float32"
_MAX_ELEMENTS = 1 << 60
_F32 = np.dtype("<f4")
_F32_MAX = float(np.finfo(np.float32).max)
_EMPTY = np.zeros(0, np.float32)
_LOCAL = threading.local()
_MAX_SCRATCH_BYTES = 64 << 20
_DESCRIPTION_KEYS = frozenset(
    {"version", "codec", "bits", "block_size", "segment", "zstd_level", "raw_size", "frames",
     "checksums", "tensors"}
)  # fmt: skip
_U64_MAX = (1 << 64) - 1
_SEQUENCES = frozenset({list, tuple})
_DTYPE_OF = operator.attrgetter("dtype")
_SHAPE_OF = operator.attrgetter("shape")
_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor in a payload.

    Attributes:
        name: Tensor name (the key in the mapping given to :func:`encode`).
        shape: Array shape; every dimension is a non-negative int.
        dtype: Decoded dtype name; always ``"float32"``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = _DTYPE

    @property
    def size(self) -> int:
        """Number of elements (``math.prod(shape)``; 1 for a scalar)."""
        return math.prod(self.shape)


class Layout:
    """Names and shapes of a payload's tensors, in sorted-name order, and where each one
    sits in a flat float32 buffer that holds them back to back (see :func:`encode_flat`).

    Immutable and hashable, with the hash computed once: a sender makes one per set of
    tensors it sends (a learner: one per fragment) and passes it with every payload.

    Attributes:
        names: Tensor names, sorted.
        shapes: Shape of each tensor.
        sizes: Number of values of each tensor.
        offsets: Index of each tensor's first value in the flat buffer.
        size: Number of values in all (the flat buffer's length).
    """

    __slots__ = ("_hash", "names", "offsets", "shapes", "size", "sizes")

    def __init__(self, shapes: Mapping[str, Iterable[int]]) -> None:
        """Args:
            shapes: Name -> shape (a sequence of non-negative ints).

        Raises:
            CodecError: a name that is not a str, or a shape that is not non-negative ints.
        """
        names = _sorted_names(shapes, "shapes must be a mapping of name -> shape")
        checked = []
        for name in names:
            shape = shapes[name]
            if not isinstance(shape, Iterable) or not all(is_int(d) and d >= 0 for d in shape):
                raise CodecError(
                    f"tensor {name!r}: shape must be non-negative ints, got {shape!r:.100}"
                )
            checked.append(tuple(int(d) for d in shape))
        self._set(tuple(names), tuple(checked))

    @classmethod
    def _trusted(cls, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> Layout:
        """A layout of names and shapes that are already checked (sorted str, valid)."""
        layout = cls.__new__(cls)
        layout._set(names, shapes)
        return layout

    def _set(self, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> None:
        sizes = tuple(map(math.prod, shapes))
        offsets = tuple(accumulate(sizes, initial=0))
        for attribute, value in (
            ("names", names),
            ("shapes", shapes),
            ("sizes", sizes),
            ("offsets", offsets[:-1]),
            ("size", offsets[-1]),
            ("_hash", hash((names, shapes))),
        ):
            object.__setattr__(self, attribute, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Layout is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self is other or (
            self._hash == other._hash and self.names == other.names and self.shapes == other.shapes
        )

    def __repr__(self) -> str:
        return f"Layout({len(self.names)} tensors, {self.size} values)"

    def views(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """Name -> the tensor's view of the flat buffer ``values`` (``size`` values)."""
        return {
            name: values[offset : offset + size].reshape(shape)
            for name, shape, size, offset in zip(
                self.names, self.shapes, self.sizes, self.offsets, strict=True
            )
        }


@dataclass
class CodecState:
    """Error-feedback residuals, one float32 array per tensor name (empty without EF).

    Consumed by :func:`encode`, which returns its successor; see the module docstring.
    """

    residual: dict[str, np.ndarray] = field(default_factory=dict)
    consumed: bool = False


class Codec(NamedTuple):
    """The three functions of one codec configuration (see :func:`make_codec`)."""

    init: Callable[[Mapping[str, Iterable[int]]], CodecState]
    encode: Callable[[Mapping[str, Any], CodecState], tuple[memoryview, dict, CodecState]]
    decode: Callable[[bytes, Mapping], dict[str, np.ndarray]]


def make_codec(config: CodecConfig, max_raw_size: int = DEFAULT_MAX_RAW_SIZE) -> Codec:
    """Bind :func:`init_state`, :func:`encode` and :func:`decode_tensors` to ``config``."""
    return Codec(
        init=lambda shapes: init_state(config, shapes),
        encode=lambda tensors, state: encode(tensors, config, state),
        decode=lambda payload, description: decode_tensors(payload, description, max_raw_size),
    )


def init_state(config: CodecConfig, shapes: Mapping[str, Iterable[int]]) -> CodecState:
    """Zero residuals for tensors of the given shapes (none unless ``error_feedback``)."""
    return extend_state(config, CodecState(), shapes)


def extend_state(
    config: CodecConfig, state: CodecState, shapes: Mapping[str, Iterable[int]]
) -> CodecState:
    """Add zero residuals for the tensors ``state`` does not know yet (in place; returned).

    A learner that sends its model in fragments calls this before a fragment's first upload.
    """
    if config.error_feedback:
        for name, shape in shapes.items():
            if name not in state.residual:
                state.residual[name] = np.zeros(tuple(shape), np.float32)
    return state


def warm_up() -> None:
    """Compile every kernel, or load it from Numba's on-disk cache (``__pycache__``).

    The first compile takes several seconds; services call this at start-up, off their
    critical path, so the first upload is not delayed by it.
    """
    values = np.linspace(-1, 1, 3 * BLOCK_MULTIPLE, dtype=np.float32)
    read_only = values.copy()
    read_only.setflags(write=False)  # e.g. arrays handed over from JAX
    for name in CODECS:
        config = CodecConfig(name, BLOCK_MULTIPLE, error_feedback=name != "fp32")
        for sample in ({"w": values}, {"w": read_only}):
            state = init_state(config, {"w": values.shape})
            payload, description, _ = encode(sample, config, state)
            decode_tensors(payload, description)
            encode(sample, CodecConfig(name, BLOCK_MULTIPLE))


# --------------------------------------------------------------------------- validation


def _n_blocks(size: int, block_size: int) -> int:
    return -(-size // block_size)


def _unit(codec: str, block_size: int) -> int:
    """Elements per layout unit: a block for block codecs, one element otherwise."""
    return block_size if codec in BLOCK_CODECS else 1


def _unit_bytes(codec: str, block_size: int) -> int:
    if codec in BLOCK_CODECS:
        return _F32.itemsize + quant.bytes_per_block(BITS[codec], block_size)
    return BITS[codec] // 8


def _raw_size(codec: str, block_size: int, sizes: Iterable[int]) -> int:
    unit = _unit(codec, block_size)
    return _unit_bytes(codec, block_size) * sum(_n_blocks(n, unit) for n in sizes)


@dataclass(frozen=True)
class _Plan:
    """How the tensors of one layout (names, shapes) are cut into segments, and everything
    about the payload that depends on the layout alone. Cached: a learner sends the same
    layout every round.

    ``jobs[i]`` is ``(pieces, raw bytes)`` of segment ``i``, ``pieces`` an int64 array of rows
    ``(tensor, lo, hi, first, units)``: values ``[lo, hi)`` of tensor ``tensor`` fill units
    ``[first, first + units)`` of the segment.
    """

    segment: int
    raw_size: int
    jobs: tuple[tuple[np.ndarray, int], ...]
    bounds: tuple[int, ...]  # the largest frame of each segment
    total_bound: int
    byte_offsets: np.ndarray  # int64: each tensor's first byte in a flat float32 buffer


@lru_cache(maxsize=64)
def _plan(codec: str, block_size: int, layout: Layout) -> _Plan:
    """The :class:`_Plan` of ``layout``."""
    unit = _unit(codec, block_size)
    sizes = layout.sizes
    # Frames of equal size, as close to SEGMENT_ELEMENTS values as a whole number of them
    # allows: no tiny last frame (a 1M-value payload cut per tensor into blocks is a few
    # blocks over 2^20 values, which made a second frame of its own).
    total = sum(_n_blocks(n, unit) for n in sizes)
    segment = max(1, -(-total // max(1, round(total * unit / SEGMENT_ELEMENTS))))
    segments: list[np.ndarray] = []
    current: list[tuple[int, int, int, int, int]] = []
    fill = 0
    for index, size in enumerate(sizes):
        units, done = _n_blocks(size, unit), 0
        while done < units:
            take = min(units - done, segment - fill)
            current.append((index, done * unit, min(size, (done + take) * unit), fill, take))
            fill, done = fill + take, done + take
            if fill == segment:
                segments.append(np.array(current, np.int64))
                current, fill = [], 0
    if current:
        segments.append(np.array(current, np.int64))
    unit_bytes = _unit_bytes(codec, block_size)
    raw_bytes = tuple(int(rows[-1, 3] + rows[-1, 4]) * unit_bytes for rows in segments)
    byte_offsets = np.array(layout.offsets, np.int64) * _F32.itemsize
    for rows in (*segments, byte_offsets):
        rows.setflags(write=False)
    bounds = tuple(zstd.compress_bound(n) for n in raw_bytes)
    return _Plan(
        segment=segment,
        raw_size=_raw_size(codec, block_size, sizes),
        jobs=tuple(zip(segments, raw_bytes, strict=True)),
        bounds=bounds,
        total_bound=sum(bounds),
        byte_offsets=byte_offsets,
    )


# --------------------------------------------------------------------------- encoding


def encode(
    tensors: Mapping[str, Any], config: CodecConfig, state: CodecState | None = None
) -> tuple[memoryview, dict, CodecState]:
    """Encode named tensors into one payload (a run of zstd frames) and its description.

    Args:
        tensors: Name -> array of real numbers (any shape, converted to float32).
        config: The codec configuration.
        state: From :func:`init_state` or a previous ``encode`` (required, and consumed,
            with ``error_feedback``; ignored otherwise).

    Returns:
        ``(payload, description, new_state)``. ``payload`` is a read-only ``memoryview`` of
        the buffer the frames were compressed into (no copy is made; ``bytes(payload)``
        makes one). Anything that takes bytes-like objects (msgpack, zlib, sockets,
        :func:`decode_tensors`) takes it as it is.

    Raises:
        CodecError: non-str name, non-real dtype, any NaN/Inf value, a tensor the state does
            not know (or of another shape), or a consumed state.
    """
    names, arrays = _prepare(tensors)
    layout = Layout._trusted(tuple(names), tuple(map(_SHAPE_OF, arrays)))
    residual = _take_residual(layout, config, state)
    plan = _plan(config.codec, config.block_size, layout)
    addresses = None
    if config.codec in BLOCK_CODECS:  # the block kernels take the tensors by address
        addresses = _read_only(np.array(list(map(quant.address, arrays)), np.int64))
    encoder = _SegmentEncoder(layout, arrays, residual, config, addresses)
    return _encode(plan, encoder, residual)


def encode_flat(
    values: np.ndarray, layout: Layout, config: CodecConfig, state: CodecState | None = None
) -> tuple[memoryview, dict, CodecState]:
    """:func:`encode` of tensors held back to back in one flat buffer: the same payload and
    description as ``encode(layout.views(values), config, state)``, without the work per
    tensor (checks, addresses) that weighs on a payload of many small tensors.

    Args:
        values: C-contiguous 1-D float32 array of ``layout.size`` values: each tensor's
            values (C order) at ``layout.offsets``.
        layout: The tensors' names and shapes; make it once and pass it every time.
        config, state: As for :func:`encode`.

    Raises:
        CodecError: as :func:`encode`, or ``values`` not such an array.
    """
    if not isinstance(layout, Layout):
        raise CodecError(f"layout must be a codec.Layout, got {type(layout).__name__}")
    if (
        type(values) is not np.ndarray
        or values.dtype is not _F32
        or values.ndim != 1
        or not values.flags.c_contiguous
        or values.size != layout.size
    ):
        found = f"{type(values).__name__}"
        if isinstance(values, np.ndarray):
            found = f"{values.dtype}{list(values.shape)}, contiguous={values.flags.c_contiguous}"
        raise CodecError(
            f"values must be a contiguous 1-D float32 array of the layout's {layout.size} "
            f"values, got {found}"
        )
    residual = _take_residual(layout, config, state)
    plan = _plan(config.codec, config.block_size, layout)
    # The kernel finds each tensor at its offset in ``values``.
    encoder = _SegmentEncoder(layout, values, residual, config, plan.byte_offsets)
    return _encode(plan, encoder, residual)


def _encode(
    plan: _Plan, encoder: _SegmentEncoder, residual: dict[str, np.ndarray]
) -> tuple[memoryview, dict, CodecState]:
    """Encode every segment of ``plan`` with ``encoder``; the payload and description."""
    config = encoder.config
    # One buffer for the whole payload, allocated by NumPy (huge pages where the kernel
    # offers them); each frame is compressed straight into it.
    bounds = plan.bounds
    out = np.empty(plan.total_bound, np.uint8)
    jobs = plan.jobs
    threads = _threads(config.threads, plan.raw_size)
    if threads <= 1 or len(jobs) <= 1:
        coded, end = [], 0
        for job, bound in zip(jobs, bounds, strict=True):
            coded.append(encoder(job, out[end : end + bound]))
            end += coded[-1][0]
    else:  # each frame into its own slot, then moved down to close the gaps
        slots = list(accumulate(bounds, initial=0))
        coded = _map(
            lambda i: encoder(jobs[i], out[slots[i] : slots[i + 1]]), range(len(jobs)), threads
        )
        end = 0
        for slot, (size, _) in zip(slots, coded, strict=False):
            out[end : end + size] = out[slot : slot + size]  # overlap-safe; slot >= end
            end += size
    frames = [size for size, _ in coded]
    description = {
        "version": FORMAT_VERSION,
        "codec": config.codec,
        "bits": BITS[config.codec],
        "block_size": config.block_size,
        "segment": plan.segment,
        "zstd_level": config.zstd_level,
        "raw_size": plan.raw_size,
        "frames": frames,
        "checksums": [checksum for _, checksum in coded],
        "tensors": [
            [name, list(shape), _DTYPE]
            for name, shape in zip(encoder.layout.names, encoder.layout.shapes, strict=True)
        ],
    }
    out.setflags(write=False)
    payload = memoryview(out)[:end]
    return payload, description, CodecState(residual if config.error_feedback else {})


def encode_tensors(
    tensors: Mapping[str, Any], codec: str = "int8", block_size: int = 256, zstd_level: int = 1
) -> tuple[memoryview, dict]:
    """Encode without error feedback; returns ``(payload, description)``. See :func:`encode`."""
    payload, description, _ = encode(tensors, CodecConfig(codec, block_size, zstd_level))
    return payload, description


def _threads(threads: int, raw_size: int) -> int:
    if threads == 0 or raw_size < THREADS_MIN_BYTES:
        return 0
    return os.cpu_count() or 1 if threads == -1 else threads


def _map(function: Callable[[Any], Any], items: list, threads: int) -> list:
    """``[function(x) for x in items]``, on ``threads`` worker threads if more than one.

    The kernels release the GIL (Numba ``nogil``) and so does zstd, so threads really run
    in parallel; each worker thread keeps its own scratch buffers and zstd context.
    """
    if threads <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="codec") as pool:
        return list(pool.map(function, items))


class _SegmentEncoder:
    """Quantises one segment into per-thread scratch and compresses it into one frame."""

    def __init__(
        self,
        layout: Layout,
        values: list[np.ndarray] | np.ndarray,
        residual: dict[str, np.ndarray],
        config: CodecConfig,
        addresses: np.ndarray | None,
    ) -> None:
        """``values``: the tensors (a list in layout order), or the flat buffer of them all;
        ``addresses`` (block codecs only): each tensor's data address, or (a flat buffer)
        its offset in bytes."""
        self.layout = layout
        self.names = layout.names
        self.values = values
        self.residual = residual
        self.config = config
        self.bits = BITS[config.codec]
        self.block = config.codec in BLOCK_CODECS
        if self.block:  # the block kernels take every tensor of a segment in one call
            self.addresses = addresses
            self.base = quant.address(values) if isinstance(values, np.ndarray) else 0
            self.residual_addresses = (
                _read_only(np.array([quant.address(residual[n]) for n in self.names], np.int64))
                if residual
                else addresses
            )

    def __call__(self, job: tuple[np.ndarray, int], dst: np.ndarray) -> tuple[int, int]:
        """Quantise the segment ``job`` (its pieces and raw size) into scratch, compress it
        into ``dst``; return the frame's size and XXH3-64 checksum."""
        pieces, raw_bytes = job
        raw = _scratch(raw_bytes)
        if self.block:  # every tensor of the segment in one kernel call
            piece, _ = quant.encode_segment(
                self.base,
                self.addresses,
                self.residual_addresses,
                pieces,
                self.residual_addresses is not self.addresses,
                self.bits,
                self.config.block_size,
                raw,
            )
            if piece >= 0:
                self._reject(*map(int, pieces[piece, :3]))
        else:
            self._values(pieces, raw)
        size = zstd.Compressor.for_thread(self.config.zstd_level).compress_into(raw, dst)
        return size, xxhash.xxh3_64_intdigest(dst[:size])  # the frame is still in cache

    def _flat(self, tensor: int) -> np.ndarray:
        if isinstance(self.values, np.ndarray):
            offset = self.layout.offsets[tensor]
            return self.values[offset : offset + self.layout.sizes[tensor]]
        return self.values[tensor].reshape(-1)

    def _flat_residual(self, tensor: int) -> np.ndarray:
        res = self.residual.get(self.names[tensor])
        return _EMPTY if res is None else res.reshape(-1)

    def _values(self, pieces: np.ndarray, raw: np.ndarray) -> None:
        for tensor, lo, hi, first, units in pieces.tolist():
            flat = self._flat(tensor)[lo:hi]
            res = self._flat_residual(tensor)
            res = res[lo:hi] if res.size else res
            if self.config.codec == "fp32":
                bad = quant.encode_fp32(flat, raw.view(_F32)[first : first + units])
            else:
                bad = quant.encode_bf16(
                    flat, res, bool(res.size), raw.view("<u2")[first : first + units]
                )
            if bad >= 0:
                self._reject(tensor, lo, hi)

    def _reject(self, tensor: int, lo: int, hi: int) -> None:
        """Raise the CodecError for a piece that a kernel refused."""
        name = self.names[tensor]
        _check_finite(name, self._flat(tensor)[lo:hi])  # raises with a count of bad values
        if not self._flat_residual(tensor).size:  # only bf16 gets here: a value rounded up to Inf
            raise CodecError(
                f"tensor {name!r} has values within half a bfloat16 ulp of the "
                "float32 maximum, which round to Inf"
            )
        # The input was finite, so its sum with the error-feedback residual overflowed.
        raise CodecError(f"tensor {name!r} plus its error-feedback residual overflows")


def _sorted_names(mapping: Any, not_a_mapping: str) -> list[str]:
    """The keys of ``mapping``, which must all be str, sorted."""
    if not isinstance(mapping, Mapping):
        raise CodecError(f"{not_a_mapping}, got {type(mapping)}")
    for name in mapping:
        if not isinstance(name, str):
            raise CodecError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    return sorted(mapping)


def _prepare(tensors: Any) -> tuple[list[str], list[np.ndarray]]:
    names = _sorted_names(tensors, "tensors must be a mapping of name -> array")
    arrays = list(map(tensors.__getitem__, names))
    # The common case, contiguous float32 arrays, checked in passes that run in C: a
    # payload can hold thousands of tensors.
    if (
        {np.ndarray}.issuperset(map(type, arrays))
        and {_F32}.issuperset(map(_DTYPE_OF, arrays))
        and all(map(_C_CONTIGUOUS, arrays))
    ):
        return names, arrays
    arrays = [_as_float32(n, a) for n, a in zip(names, arrays, strict=True)]
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return names, [a if a.flags.c_contiguous else a.copy(order="C") for a in arrays]


def _take_residual(
    layout: Layout, config: CodecConfig, state: CodecState | None
) -> dict[str, np.ndarray]:
    if not config.error_feedback:
        return {}
    if state is None:
        raise CodecError("error_feedback needs the state from init_state or the last encode")
    if state.consumed:
        raise CodecError("this codec state was already used; keep the one encode returned")
    state.consumed = True
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        res = state.residual.get(name)
        if not isinstance(res, np.ndarray) or res.shape != shape or res.dtype != np.float32:
            found = "none" if res is None else type(res).__name__
            if isinstance(res, np.ndarray):
                found = f"{res.dtype}{list(res.shape)}"
            raise CodecError(
                f"error-feedback state has {found} for tensor {name!r} of shape {list(shape)}"
            )
        if not (res.flags.c_contiguous and res.flags.writeable):
            # The kernels update the residual in place through a flat view, which for these
            # (say a restored checkpoint) would be a copy, or would not be writable.
            state.residual[name] = res.copy(order="C")
    return state.residual


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class _Description:
    """A checked description: what the decoder needs to know about a payload."""

    codec: str
    block_size: int
    segment: int
    raw_size: int
    frames: list[int]
    checksums: list[int]
    names: list[str]
    shapes: list[tuple[int, ...]]
    sizes: list[int]


def _parse_description(description: Any, max_raw_size: int) -> _Description:
    if not isinstance(description, Mapping):
        raise CodecError(f"description must be a mapping, got {type(description).__name__}")
    keys = set(description)
    if keys != _DESCRIPTION_KEYS:
        missing = sorted(map(str, _DESCRIPTION_KEYS - keys))
        unknown = sorted(map(repr, keys - _DESCRIPTION_KEYS))
        raise CodecError(
            f"description keys must be {sorted(_DESCRIPTION_KEYS)}; "
            f"missing {missing}, unknown {unknown}"
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
    check_zstd_level(description["zstd_level"])
    raw_size = description["raw_size"]
    if not is_int(raw_size) or raw_size < 0:
        raise CodecError(f"raw_size must be a non-negative int, got {raw_size!r:.100}")
    raw_size = int(raw_size)
    # Checked before anything else is computed or allocated.
    if raw_size > max_raw_size:
        raise CodecError(f"raw_size {raw_size} exceeds the limit of {max_raw_size} bytes")

    names, shapes, sizes = _parse_tensors(description["tensors"])
    expected = _raw_size(codec, block_size, sizes)
    if expected != raw_size:
        raise CodecError(
            f"raw_size {raw_size} does not match the {len(names)} tensor(s) described: "
            f"codec {codec!r} with block_size {block_size} needs {expected} bytes"
        )
    frames = description["frames"]
    n_frames = _n_blocks(raw_size // _unit_bytes(codec, block_size), segment)
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
    return _Description(
        codec,
        block_size,
        int(segment),
        raw_size,
        [int(f) for f in frames],
        [int(c) for c in checksums],
        names,
        shapes,
        sizes,
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
    if dtypes.count(_DTYPE) != len(dtypes) or max(map(len, shapes)) > MAX_NDIM:
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


def decode_tensors(
    payload: bytes,
    description: Mapping,
    max_raw_size: int = DEFAULT_MAX_RAW_SIZE,
    threads: int = 0,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> dict[str, np.ndarray]:
    """Decode a payload produced by :func:`encode`, using only it and its description.

    Args:
        payload: The compressed bytes.
        description: The description dict returned by :func:`encode` (possibly after a
            msgpack round trip, so lists instead of tuples are fine).
        max_raw_size: Largest uncompressed size accepted; checked before decompressing.
            The float32 output is larger: up to 2x (bf16), 4x (int8), 8x (int4) or 16x (int2).
        threads: Worker threads for payloads of at least 8 MiB raw (0: calling thread,
            -1: one per CPU).
        max_output_bytes: Largest float32 output (padding included) accepted; checked
            before anything is allocated.

    Returns:
        Name -> writable float32 array with the described shape, in sorted-name order.

    Raises:
        CodecError: for an invalid or other-version description, a raw size over the limit,
            a payload that is not exactly the described zstd frames, or decoded values that
            are not finite or not valid codes/scales.
    """
    if not is_int(threads) or threads < -1:
        raise CodecError(f"threads must be an int >= -1, got {threads!r:.100}")
    layout = _parse_description(description, max_raw_size)
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        payload = memoryview(payload).cast("B")
    except TypeError as exc:  # a non-contiguous memoryview
        raise CodecError(f"payload must be contiguous bytes: {exc}") from exc
    if sum(layout.frames) != len(payload):
        raise CodecError(
            f"payload has {len(payload)} bytes; its {len(layout.frames)} frame(s) "
            f"add up to {sum(layout.frames)}"
        )
    unit = _unit(layout.codec, layout.block_size)
    total_units = layout.raw_size // _unit_bytes(layout.codec, layout.block_size)
    if 4 * total_units * unit > max_output_bytes:
        raise CodecError(
            f"payload decodes to {4 * total_units * unit} bytes of float32, over the limit of "
            f"{max_output_bytes}"
        )
    try:
        values = np.empty(total_units * unit, np.float32)
    except MemoryError as exc:  # raw_size is within max_raw_size, but the output is 2-16x that
        raise CodecError(
            f"cannot allocate {total_units * unit * 4} bytes for the decoded tensors"
        ) from exc
    offsets = list(accumulate(layout.frames, initial=0))
    jobs = [
        (index, payload[offsets[index] : offsets[index + 1]]) for index in range(len(layout.frames))
    ]
    decoder = _SegmentDecoder(layout, values, total_units)
    _map(decoder, jobs, _threads(threads, layout.raw_size))
    starts = accumulate((_n_blocks(n, unit) * unit for n in layout.sizes), initial=0)
    return {
        name: values[start : start + size].reshape(shape)
        for name, shape, size, start in zip(
            layout.names, layout.shapes, layout.sizes, starts, strict=False
        )  # starts has one extra
    }


class _SegmentDecoder:
    """Decompresses one frame and decodes it into its slice of the output values."""

    def __init__(self, layout: _Description, values: np.ndarray, total_units: int) -> None:
        self.layout = layout
        self.values = values
        self.total_units = total_units
        self.unit = _unit(layout.codec, layout.block_size)
        self.unit_bytes = _unit_bytes(layout.codec, layout.block_size)

    def __call__(self, job: tuple[int, memoryview]) -> None:
        index, frame = job
        layout = self.layout
        first = index * layout.segment
        units = min(layout.segment, self.total_units - first)
        if xxhash.xxh3_64_intdigest(frame) != layout.checksums[index]:
            raise CodecError(
                f"payload frame {index} does not match its XXH3-64 checksum (corrupted?)"
            )
        raw = _decompress(frame, units * self.unit_bytes)
        out = self.values[first * self.unit : (first + units) * self.unit]
        if layout.codec == "fp32":
            bad = quant.decode_fp32(raw.view(_F32), out)
        elif layout.codec == "bf16":
            bad = quant.decode_bf16(raw.view("<u2"), out)
        else:
            scales = raw[: 4 * units].view(_F32)
            bits = BITS[layout.codec]
            bad = quant.decode_blocks(raw[4 * units :], scales, bits, layout.block_size, out)
            if bad >= 0:
                block = first + bad
                scale = scales[bad]
                qmax = {8: 127, 4: 7, 2: 1}[bits]
                if not np.isfinite(scale) or np.signbit(scale) or float(scale) * qmax > _F32_MAX:
                    raise CodecError(
                        f"payload holds a negative, non-finite or too large scale in block {block}"
                    )
                invalid = {8: "-128", 4: "-8", 2: "0b10"}[bits]
                raise CodecError(
                    f"payload holds an invalid {layout.codec} code ({invalid}) in block {block}"
                )
        if bad >= 0:
            raise CodecError(f"payload decodes to NaN/Inf values in frame {index}")


# --------------------------------------------------------------------------- helpers


def _as_float32(name: Any, value: Any) -> np.ndarray:
    if not isinstance(name, str):
        raise CodecError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:  # e.g. a ragged nested list
        raise CodecError(f"tensor {name!r} is not an array: {exc}") from exc
    # Real numbers only; bfloat16 (from ml_dtypes/JAX) has kind "V" but converts exactly.
    if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16":
        raise CodecError(f"tensor {name!r} has non-real dtype {arr.dtype}")
    if arr.dtype == _F32:
        return arr
    # float64 values beyond float32 range overflow to Inf here and are rejected afterwards.
    with np.errstate(over="ignore", invalid="ignore"):
        return arr.astype(np.float32, copy=False)


def _check_finite(name: str, arr: np.ndarray) -> None:
    if not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise CodecError(
            f"tensor {name!r} contains {bad} NaN/Inf value(s); refusing to encode "
            "a non-finite pseudo-gradient"
        )


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
    if dtype != _DTYPE:
        raise CodecError(f"tensor {name!r}: dtype must be {_DTYPE!r}, got {dtype!r:.200}")
    return TensorSpec(name, shape, dtype)


def _read_only(array: np.ndarray) -> np.ndarray:
    """``array``, made read-only: every int64 array the kernels get is, so that Numba compiles
    one version of each (the layout's cached offsets are read-only)."""
    array.setflags(write=False)
    return array


def _scratch(nbytes: int) -> np.ndarray:
    """``nbytes`` of this thread's reusable scratch (one segment's raw bytes).

    Reusing it keeps its pages mapped and in cache; at 8 MiB or more NumPy asks the kernel
    for transparent huge pages, so the kernels and zstd miss the TLB less. A segment larger
    than ``_MAX_SCRATCH_BYTES`` gets its own buffer.
    """
    if nbytes > _MAX_SCRATCH_BYTES:
        return np.empty(nbytes, np.uint8)
    scratch = getattr(_LOCAL, "scratch", None)
    if scratch is None or scratch.size < nbytes:
        scratch = _LOCAL.scratch = np.empty(max(nbytes, 8 << 20), np.uint8)
    return scratch[:nbytes]


def _decompress(frame: memoryview, size: int) -> np.ndarray:
    """Exactly one zstd frame that must declare and hold ``size`` bytes, decompressed
    (a read-only uint8 array)."""
    try:
        declared = zstd.frame_content_size(frame)
    except zstd.ZstdError as exc:
        raise CodecError(f"payload frame is not a zstd frame: {exc}") from exc
    if declared != size:
        found = "no content size" if declared is None else f"{declared} bytes"
        raise CodecError(f"zstd frame declares {found}; the description implies {size}")
    try:
        return zstd.decompress(frame, size)
    except zstd.ZstdError as exc:
        raise CodecError(f"payload frame failed to decompress: {exc}") from exc
