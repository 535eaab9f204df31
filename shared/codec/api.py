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

The compiled kernels live in :mod:`shared.codec.quantize`, :mod:`shared.codec.dequantize`
and :mod:`shared.codec.floats`; the segments they run on in :mod:`shared.codec.segments`.
With ``error_feedback`` the codec keeps, per tensor, the residual ``e`` of what earlier rounds
failed to send, and encodes ``x + e`` (standard error feedback:
``e ← e + Δ; c = Q(e); e ← e − c``). The state passed to ``encode`` is *consumed*: its buffers
are updated in place and handed back in the returned state (as with JAX buffer donation), so
keep only the returned one; reusing a consumed state raises :class:`CodecError`. After an
encoding error the state is consumed too; start again from ``init``. ``state.residual`` is a
plain dict of arrays, so it can be checkpointed.

``encode`` returns a :class:`shared.codec.description.Description` with the payload: everything
needed to decode it (codec, block size, segment size, each zstd frame's size and XXH3-64,
the tensors' names and shapes). Segments keep the encoder's working set in cache (quantise
4 MiB, compress it while it is still there), let large payloads be coded on several threads
(``threads``), and bound every allocation the decoder makes to one segment plus the output.
The payload is the frames back to back, each copied into one buffer as soon as it is
compressed (see :mod:`shared.codec.zstd`).

The decoder treats the payload as hostile (its description was checked when it was parsed,
:meth:`Description.parse`): the declared size is bounded *before* anything is allocated or
decompressed, every frame is checked against its checksum before it is decompressed, decoded
scales, codes and values are validated, and any problem raises :class:`CodecError`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np

from shared.codec import floats, quantize
from shared.codec.config import (
    BLOCK_CODECS,
    BLOCK_MULTIPLE,
    CODECS,
    CodecConfig,
    CodecError,
    is_int,
)
from shared.codec.description import Description, n_blocks, unit_elements
from shared.codec.layout import Layout, sorted_names
from shared.codec.segments import (
    Plan,
    SegmentDecoder,
    SegmentEncoder,
    read_only,
    run,
    segment_plan,
    worker_threads,
)

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "DEFAULT_MAX_RAW_SIZE",
    "Codec",
    "CodecState",
    "decode_tensors",
    "encode",
    "encode_flat",
    "encode_tensors",
    "extend_state",
    "init_state",
    "make_codec",
    "sum_of_squares",
    "warm_up",
]

DEFAULT_MAX_RAW_SIZE = 2**31
DEFAULT_MAX_OUTPUT_BYTES = 2**34

_F32 = np.dtype("<f4")
_DTYPE_OF = operator.attrgetter("dtype")
_SHAPE_OF = operator.attrgetter("shape")
_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")


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
    for sample in (values, read_only):
        sum_of_squares(sample)


def sum_of_squares(array: Any) -> float:
    """Σ x² over every value of ``array``, taken as float32, summed in float64 (a compiled
    kernel: one pass at memory speed; the outer's norm of every upload)."""
    flat = np.ascontiguousarray(np.asarray(array, _F32)).reshape(-1)
    return float(floats.sum_of_squares(flat))


# --------------------------------------------------------------------------- encoding


def encode(
    tensors: Mapping[str, Any], config: CodecConfig, state: CodecState | None = None
) -> tuple[memoryview, Description, CodecState]:
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
    layout = Layout.from_checked(tuple(names), tuple(map(_SHAPE_OF, arrays)))
    residual = _take_residual(layout, config, state)
    plan = segment_plan(config.codec, config.block_size, layout)
    addresses = None
    if config.codec in BLOCK_CODECS:  # the block kernels take the tensors by address
        addresses = read_only(np.array(list(map(quantize.address, arrays)), np.int64))
    encoder = SegmentEncoder(layout, arrays, residual, config, addresses)
    return _encode(plan, encoder, residual)


def encode_flat(
    values: np.ndarray, layout: Layout, config: CodecConfig, state: CodecState | None = None
) -> tuple[memoryview, Description, CodecState]:
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
    plan = segment_plan(config.codec, config.block_size, layout)
    # The kernel finds each tensor at its offset in ``values``.
    encoder = SegmentEncoder(layout, values, residual, config, plan.byte_offsets)
    return _encode(plan, encoder, residual)


def _encode(
    plan: Plan, encoder: SegmentEncoder, residual: dict[str, np.ndarray]
) -> tuple[memoryview, Description, CodecState]:
    """Encode every segment of ``plan`` with ``encoder``; the payload and description."""
    config = encoder.config
    # One buffer for the whole payload, allocated by NumPy (huge pages where the kernel
    # offers them); each frame is compressed straight into it.
    bounds = plan.bounds
    out = np.empty(plan.total_bound, np.uint8)
    jobs = plan.jobs
    threads = worker_threads(config.threads, plan.raw_size)
    if threads <= 1 or len(jobs) <= 1:
        coded, end = [], 0
        for job, bound in zip(jobs, bounds, strict=True):
            coded.append(encoder(job, out[end : end + bound]))
            end += coded[-1][0]
    else:  # each frame into its own slot, then moved down to close the gaps
        slots = list(accumulate(bounds, initial=0))
        coded = run(
            lambda i: encoder(jobs[i], out[slots[i] : slots[i + 1]]), range(len(jobs)), threads
        )
        end = 0
        for slot, (size, _) in zip(slots, coded, strict=False):
            out[end : end + size] = out[slot : slot + size]  # overlap-safe; slot >= end
            end += size
    description = Description(
        codec=config.codec,
        block_size=config.block_size,
        segment=plan.segment,
        zstd_level=config.zstd_level,
        raw_size=plan.raw_size,
        frames=tuple(size for size, _ in coded),
        checksums=tuple(checksum for _, checksum in coded),
        layout=encoder.layout,
    )
    out.setflags(write=False)
    payload = memoryview(out)[:end]
    return payload, description, CodecState(residual if config.error_feedback else {})


def encode_tensors(
    tensors: Mapping[str, Any],
    codec: str,
    block_size: int = CodecConfig.block_size,
    zstd_level: int = CodecConfig.zstd_level,
) -> tuple[memoryview, Description]:
    """Encode without error feedback; returns ``(payload, description)``. See :func:`encode`."""
    payload, description, _ = encode(tensors, CodecConfig(codec, block_size, zstd_level))
    return payload, description


def _prepare(tensors: Any) -> tuple[list[str], list[np.ndarray]]:
    names = sorted_names(tensors, "tensors must be a mapping of name -> array")
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


# --------------------------------------------------------------------------- decoding


#: Alignment of decoded tensors, in bytes: JAX's CPU backend uses a NumPy array aligned to 64
#: bytes in place, and copies any other (44 MB per ``medium`` upload the outer merges).
ALIGNMENT = 64


def _aligned_floats(count: int) -> np.ndarray:
    """An uninitialised float32 array of ``count`` values starting on an ``ALIGNMENT``-byte
    boundary (``np.empty`` guarantees 16 bytes)."""
    raw = np.empty(4 * count + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + 4 * count].view(np.float32)


def decode_tensors(
    payload: bytes | memoryview,
    description: Description,
    max_raw_size: int = DEFAULT_MAX_RAW_SIZE,
    threads: int = 0,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> dict[str, np.ndarray]:
    """Decode a payload produced by :func:`encode`, using only it and its description.

    Args:
        payload: The compressed bytes (hostile: checked frame by frame).
        description: What :func:`encode` returned with the payload, or what
            :meth:`Description.parse` made of it after a trip over the wire.
        max_raw_size: Largest uncompressed size accepted; checked before decompressing.
            The float32 output is larger: up to 2x (bf16), 4x (int8), 8x (int4) or 16x (int2).
        threads: Worker threads for payloads of at least 8 MiB raw (0: calling thread,
            -1: one per CPU).
        max_output_bytes: Largest float32 output (padding included) accepted; checked
            before anything is allocated.

    Returns:
        Name -> writable float32 array with the described shape, in sorted-name order (views
        of one buffer that starts on an ``ALIGNMENT``-byte boundary; with a block codec, whose
        pieces start on whole blocks of 16 values or more, every piece does).

    Raises:
        CodecError: for a raw size or output over its limit, a payload that is not exactly
            the described zstd frames, or decoded values that are not finite or not valid
            codes/scales.
    """
    if not is_int(threads) or threads < -1:
        raise CodecError(f"threads must be an int >= -1, got {threads!r:.100}")
    if not isinstance(description, Description):
        raise CodecError(f"description must be a Description, got {type(description).__name__}")
    # Checked before anything else is computed or allocated.
    if description.raw_size > max_raw_size:
        raise CodecError(
            f"raw_size {description.raw_size} exceeds the limit of {max_raw_size} bytes"
        )
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        payload = memoryview(payload).cast("B")
    except TypeError as exc:  # a non-contiguous memoryview
        raise CodecError(f"payload must be contiguous bytes: {exc}") from exc
    frames = description.frames
    if sum(frames) != len(payload):
        raise CodecError(
            f"payload has {len(payload)} bytes; its {len(frames)} frame(s) add up to {sum(frames)}"
        )
    unit = unit_elements(description.codec, description.block_size)
    values_count = description.units * unit
    if 4 * values_count > max_output_bytes:
        raise CodecError(
            f"payload decodes to {4 * values_count} bytes of float32, over the limit of "
            f"{max_output_bytes}"
        )
    try:
        values = _aligned_floats(values_count)
    except MemoryError as exc:  # raw_size is within max_raw_size, but the output is 2-16x that
        raise CodecError(
            f"cannot allocate {values_count * 4} bytes for the decoded tensors"
        ) from exc
    offsets = list(accumulate(frames, initial=0))
    jobs = [(index, payload[offsets[index] : offsets[index + 1]]) for index in range(len(frames))]
    run(SegmentDecoder(description, values), jobs, worker_threads(threads, description.raw_size))
    layout = description.layout
    starts = accumulate((n_blocks(n, unit) * unit for n in layout.sizes), initial=0)
    return {
        name: values[start : start + size].reshape(shape)
        for name, shape, size, start in zip(
            layout.names, layout.shapes, layout.sizes, starts, strict=False
        )  # starts has one extra
    }
