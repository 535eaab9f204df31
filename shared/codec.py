"""Tensor codec: named float32 tensors <-> one compressed payload and a self-describing dict.

Learners publish pseudo-gradients as ``(payload, description)``. The description is a plain,
msgpack-able dict that says everything needed to decode the payload::

    {"codec": "int8", "block_size": 256, "zstd_level": 1, "raw_size": 2052,
     "tensors": [["layer/b", [4], "float32"], ["layer/w", [2, 3], "float32"]]}

Raw (uncompressed) layout, tensors in sorted-name order, little-endian throughout:

* ``fp32``: every tensor flattened and concatenated as float32.
* ``int8``: blockwise absmax quantisation. Each tensor is split into its own blocks of
  ``block_size`` elements (the last block zero-padded), so a block never mixes two tensors.
  All int8 codes (``n_blocks * block_size`` bytes) come first, then all float32 scales
  (``n_blocks * 4`` bytes).

The raw bytes are compressed as a single zstd frame that records its content size and a
checksum, so corruption is detected and the decoder knows the exact output size up front.

The decoder treats payload and description as hostile: every field is checked, the declared
size is bounded *before* anything is decompressed, and any problem raises :class:`CodecError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import numpy as np
import zstandard

__all__ = [
    "CODECS",
    "CodecError",
    "TensorSpec",
    "decode_tensors",
    "dequantize_int8",
    "encode_tensors",
    "quantize_int8",
]

CODECS = ("fp32", "int8")

# Bounds a description must respect. Block sizes outside this range are either pointless
# (scale overhead larger than the codes) or a sign of a garbled description.
MIN_BLOCK_SIZE = 1
MAX_BLOCK_SIZE = 1 << 20
MAX_NDIM = 32
# zstd accepts negative "fast" levels down to ZSTD_minCLevel() == -(1 << 17).
MIN_ZSTD_LEVEL = -(1 << 17)
MAX_ZSTD_LEVEL = zstandard.MAX_COMPRESSION_LEVEL
DEFAULT_MAX_RAW_SIZE = 2**31

_DTYPE = "float32"
_MAX_ELEMENTS = 1 << 60
_F32 = np.dtype("<f4")
_INT8_MAX = 127
# The quantiser works on about this many elements at a time so its float32 scratch buffer
# stays in cache; one pass over a whole 10M-element tensor is about twice as slow.
_QUANT_CHUNK_ELEMENTS = 1 << 18
_DESCRIPTION_KEYS = frozenset({"codec", "block_size", "zstd_level", "raw_size", "tensors"})


class CodecError(ValueError):
    """Raised for any tensor that cannot be encoded or any payload that cannot be decoded."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor in a payload.

    Attributes:
        name: Tensor name (the key in the mapping given to :func:`encode_tensors`).
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


# --------------------------------------------------------------------------- quantisation


def _check_block_size(block_size: Any) -> int:
    if not _is_int(block_size) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(
            f"block_size must be an int in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}"
        )
    return int(block_size)


def _n_blocks(size: int, block_size: int) -> int:
    return -(-size // block_size)


def _block_scales(blocks: np.ndarray) -> np.ndarray:
    """Float32 scale per row of ``blocks`` such that ``|x| / scale <= 127`` for every element.

    NaN propagates through max/min, and an Inf gives an Inf scale, so a non-finite input
    always yields a non-finite scale; callers check the scales instead of re-scanning the data.
    """
    absmax = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))
    scales = absmax / np.float32(_INT8_MAX)
    # A subnormal scale is coarse (few mantissa bits), and round-to-nearest can leave it a
    # whole ulp below absmax/127, which would push codes past 127 and break the error bound.
    # Round those up by one ulp (exact check in float64; only tiny blocks are affected).
    too_small = scales.astype(np.float64) * _INT8_MAX < absmax.astype(np.float64)
    too_small &= scales < np.finfo(np.float32).tiny
    if too_small.any():
        scales[too_small] = np.nextafter(scales[too_small], np.float32(np.inf))
    # Near float32 max, 127 * scale can round up to Inf on decode; round those scales down
    # (codes are clipped to 127, costing at most one ulp of accuracy).
    with np.errstate(over="ignore", invalid="ignore"):
        overflows = np.isinf(scales * np.float32(_INT8_MAX)) & np.isfinite(scales)
    if overflows.any():
        scales[overflows] = np.nextafter(scales[overflows], np.float32(0))
    return scales


def _quantize_blocks(blocks: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """Quantise ``blocks`` (n, block_size) float32 into ``codes`` (n, block_size) int8 and
    ``scales`` (n,) float32, in place, chunk by chunk to keep the scratch buffer in cache."""
    n_blocks, block_size = blocks.shape
    step = max(1, min(n_blocks, _QUANT_CHUNK_ELEMENTS // block_size))
    scratch = np.empty((step, block_size), np.float32)
    for start in range(0, n_blocks, step):
        chunk = blocks[start : start + step]
        tmp = scratch[: chunk.shape[0]]
        chunk_scales = _block_scales(chunk)
        scales[start : start + step] = chunk_scales
        # All-zero blocks have scale 0; divide by 1 instead so their codes come out 0.
        divisor = np.where(chunk_scales > 0, chunk_scales, np.float32(1))
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            np.divide(chunk, divisor[:, None], out=tmp)
            np.rint(tmp, out=tmp)
            np.clip(tmp, -_INT8_MAX, _INT8_MAX, out=tmp)
            # NaN codes (from NaN/Inf input) are garbage here; the caller rejects the
            # non-finite scale of such a block.
            np.copyto(codes[start : start + step], tmp, casting="unsafe")


def _quantize_into(flat: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """Quantise 1-D float32 ``flat`` into ``codes`` (n_blocks, block_size) and ``scales``.

    Whole blocks are quantised straight from a view of ``flat``; only a ragged last block is
    copied into a zero-padded scratch row, so a big tensor is never copied as a whole.
    """
    block_size = codes.shape[1]
    full = flat.size // block_size
    if full:
        _quantize_blocks(
            flat[: full * block_size].reshape(full, block_size), codes[:full], scales[:full]
        )
    if full < codes.shape[0]:
        tail = np.zeros((1, block_size), np.float32)
        tail[0, : flat.size - full * block_size] = flat[full * block_size :]
        _quantize_blocks(tail, codes[full:], scales[full:])


def quantize_int8(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax int8 quantisation of a 1-D float32 array.

    The array is zero-padded to a multiple of ``block_size``; each block gets one float32
    scale ``absmax / 127`` and codes ``round(x / scale)`` in [-127, 127], so the
    reconstruction error is at most ``scale / 2`` per element.

    Args:
        x: 1-D array of finite values; converted to float32.
        block_size: Elements per block, in [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE].

    Returns:
        ``(codes, scales)``: int8 codes of length ``n_blocks * block_size`` (padding included)
        and float32 scales of length ``n_blocks = ceil(len(x) / block_size)``.

    Raises:
        CodecError: if ``x`` is not 1-D, contains NaN/Inf, or ``block_size`` is invalid.
    """
    block_size = _check_block_size(block_size)
    x = np.asarray(x)
    if x.ndim != 1:
        raise CodecError(f"quantize_int8 expects a 1-D array, got shape {x.shape}")
    x = x.astype(np.float32, copy=False)
    n_blocks = _n_blocks(x.size, block_size)
    codes = np.empty(n_blocks * block_size, np.int8)
    scales = np.empty(n_blocks, np.float32)
    _quantize_into(x, codes.reshape(n_blocks, block_size), scales)
    if not np.isfinite(scales).all():
        raise CodecError("quantize_int8 input contains NaN or Inf")
    return codes, scales


def dequantize_int8(codes: np.ndarray, scales: np.ndarray, size: int) -> np.ndarray:
    """Invert :func:`quantize_int8`.

    The block size is ``len(codes) // len(scales)``.

    Args:
        codes: 1-D int8 codes of length ``n_blocks * block_size``.
        scales: 1-D float32 scales, one per block.
        size: Number of elements to return (the unpadded length).

    Returns:
        A new, writable 1-D float32 array of length ``size``.

    Raises:
        CodecError: if the lengths are inconsistent with each other or with ``size``.
    """
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    if codes.ndim != 1 or scales.ndim != 1 or codes.dtype != np.int8:
        raise CodecError(
            f"expected 1-D int8 codes and 1-D scales, got {codes.dtype}{codes.shape} "
            f"and {scales.dtype}{scales.shape}"
        )
    if not _is_int(size) or size < 0:
        raise CodecError(f"size must be a non-negative int, got {size!r}")
    n_blocks = scales.size
    if n_blocks == 0:
        if codes.size or size:
            raise CodecError(f"no scales given for {codes.size} codes and size {size}")
        return np.empty(0, np.float32)
    block_size = codes.size // n_blocks
    if block_size == 0 or codes.size != n_blocks * block_size:
        raise CodecError(f"{codes.size} codes do not split into {n_blocks} equal blocks")
    if _n_blocks(size, block_size) != n_blocks:
        raise CodecError(
            f"size {size} needs {_n_blocks(size, block_size)} block(s) of {block_size}, "
            f"got {n_blocks}"
        )
    out = np.empty((n_blocks, block_size), np.float32)
    np.multiply(codes.reshape(n_blocks, block_size), scales.astype(np.float32)[:, None], out=out)
    return out.reshape(-1)[:size]


# --------------------------------------------------------------------------- encoding


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True is never a meaningful size or count.
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _as_float32(name: Any, value: Any) -> np.ndarray:
    if not isinstance(name, str):
        raise CodecError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    arr = np.asarray(value)
    # Real numbers only; bfloat16 (from ml_dtypes/JAX) has kind "V" but converts exactly.
    if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16":
        raise CodecError(f"tensor {name!r} has non-real dtype {arr.dtype}")
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


def _check_zstd_level(level: Any) -> int:
    if not _is_int(level) or not MIN_ZSTD_LEVEL <= level <= MAX_ZSTD_LEVEL:
        raise CodecError(
            f"zstd_level must be an int in [{MIN_ZSTD_LEVEL}, {MAX_ZSTD_LEVEL}], got {level!r}"
        )
    return int(level)


def encode_tensors(
    tensors: Mapping[str, np.ndarray],
    codec: str = "int8",
    block_size: int = 256,
    zstd_level: int = 1,
) -> tuple[bytes, dict]:
    """Encode named tensors into one zstd-compressed payload.

    Args:
        tensors: Name -> array of real numbers (any shape, converted to float32).
        codec: One of :data:`CODECS`.
        block_size: Elements per quantisation block (``int8``); validated for both codecs
            and recorded in the description.
        zstd_level: zstd compression level.

    Returns:
        ``(payload, description)``; the description is a plain dict of str/int/list values
        that :func:`decode_tensors` needs alongside the payload.

    Raises:
        CodecError: unknown codec, invalid block size or level, non-str name, non-real dtype,
            or any NaN/Inf value.
    """
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
    block_size = _check_block_size(block_size)
    zstd_level = _check_zstd_level(zstd_level)
    if not isinstance(tensors, Mapping):
        raise CodecError(f"tensors must be a mapping of name -> array, got {type(tensors)}")
    for name in tensors:
        if not isinstance(name, str):
            raise CodecError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    names = sorted(tensors)
    arrays = [_as_float32(name, tensors[name]) for name in names]
    shapes = [[int(d) for d in a.shape] for a in arrays]

    raw = _pack_fp32(names, arrays) if codec == "fp32" else _pack_int8(names, arrays, block_size)
    description = {
        "codec": codec,
        "block_size": block_size,
        "zstd_level": zstd_level,
        "raw_size": len(raw),
        "tensors": [[n, shape, _DTYPE] for n, shape in zip(names, shapes, strict=True)],
    }
    # Content size + checksum in the frame: the decoder can bound its output before
    # decompressing and detect corruption that still decompresses.
    compressor = zstandard.ZstdCompressor(
        level=zstd_level, write_content_size=True, write_checksum=True
    )
    return compressor.compress(raw), description


def _pack_fp32(names: list[str], arrays: list[np.ndarray]) -> memoryview:
    total = sum(a.size for a in arrays)
    flat = np.empty(total, _F32)
    offset = 0
    for name, arr in zip(names, arrays, strict=True):
        _check_finite(name, arr)
        flat[offset : offset + arr.size] = arr.reshape(-1)
        offset += arr.size
    return memoryview(flat).cast("B")


def _pack_int8(names: list[str], arrays: list[np.ndarray], block_size: int) -> memoryview:
    blocks_per = [_n_blocks(a.size, block_size) for a in arrays]
    n_blocks = sum(blocks_per)
    # One raw buffer; codes and scales are quantised straight into views of it.
    raw = np.empty(n_blocks * (block_size + _F32.itemsize), np.uint8)
    codes = raw[: n_blocks * block_size].view(np.int8).reshape(n_blocks, block_size)
    scales = raw[n_blocks * block_size :].view(_F32)
    first = 0
    for name, arr, nb in zip(names, arrays, blocks_per, strict=True):
        if nb == 0:
            continue
        last = first + nb
        _quantize_into(arr.reshape(-1), codes[first:last], scales[first:last])
        if not np.isfinite(scales[first:last]).all():
            _check_finite(name, arr)  # raises with a count of the bad values
            raise CodecError(f"tensor {name!r} produced non-finite int8 scales")
        first = last
    return memoryview(raw)


# --------------------------------------------------------------------------- decoding


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
    if not all(_is_int(d) and d >= 0 for d in shape):
        raise CodecError(f"tensor {name!r}: shape must hold non-negative ints, got {shape!r}")
    # Zero-size tensors pass the raw_size check whatever their other dimensions are, but
    # NumPy still refuses shapes whose non-zero dimensions multiply past its index range.
    if math.prod(d or 1 for d in shape) > _MAX_ELEMENTS:
        raise CodecError(f"tensor {name!r}: shape {shape!r} is too large")
    if dtype != _DTYPE:
        raise CodecError(f"tensor {name!r}: dtype must be {_DTYPE!r}, got {dtype!r:.200}")
    return TensorSpec(name, tuple(int(d) for d in shape), dtype)


def _parse_description(description: Any, max_raw_size: int) -> tuple[str, int, int, list]:
    """Validate a description; returns ``(codec, block_size, raw_size, specs)``."""
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
    codec = description["codec"]
    if not isinstance(codec, str) or codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r:.100}; expected one of {CODECS}")
    block_size = _check_block_size(description["block_size"])
    _check_zstd_level(description["zstd_level"])
    raw_size = description["raw_size"]
    if not _is_int(raw_size) or raw_size < 0:
        raise CodecError(f"raw_size must be a non-negative int, got {raw_size!r:.100}")
    raw_size = int(raw_size)
    # Checked before anything else is computed or allocated.
    if raw_size > max_raw_size:
        raise CodecError(f"raw_size {raw_size} exceeds the limit of {max_raw_size} bytes")

    entries = description["tensors"]
    if not isinstance(entries, list | tuple):
        raise CodecError(f"description tensors must be a list, got {type(entries).__name__}")
    specs = [_parse_tensor_entry(i, e) for i, e in enumerate(entries)]
    for prev, cur in pairwise(specs):
        # The encoder writes sorted names; this also rules out duplicates.
        if not prev.name < cur.name:
            raise CodecError(
                f"tensor names must be unique and sorted, got {prev.name!r} before {cur.name!r}"
            )

    if codec == "fp32":
        expected = _F32.itemsize * sum(s.size for s in specs)
    else:
        n_blocks = sum(_n_blocks(s.size, block_size) for s in specs)
        expected = n_blocks * (block_size + _F32.itemsize)
    if expected != raw_size:
        raise CodecError(
            f"raw_size {raw_size} does not match the {len(specs)} tensor(s) described: "
            f"codec {codec!r} with block_size {block_size} needs {expected} bytes"
        )
    return codec, block_size, raw_size, specs


def _decompress(payload: Any, raw_size: int) -> bytes:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise CodecError(f"payload is not a zstd frame: {exc}") from exc
    # python-zstandard allocates whatever the frame header declares (ignoring
    # max_output_size), so the header must be checked against the validated raw_size first.
    if declared != raw_size:
        found = "no content size" if declared == -1 else f"{declared} bytes"
        raise CodecError(f"zstd frame declares {found}; description says raw_size {raw_size}")
    dctx = zstandard.ZstdDecompressor()
    try:
        if raw_size == 0:
            # decompress() returns b"" for a zero-size header without reading further, so
            # use the streaming object to make sure the frame and nothing else is there.
            dobj = dctx.decompressobj()
            raw = dobj.decompress(payload)
            if raw or not dobj.eof or dobj.unused_data:
                raise CodecError("payload is not exactly one empty zstd frame")
        else:
            raw = dctx.decompress(payload, max_output_size=raw_size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"payload failed to decompress: {exc}") from exc
    if len(raw) != raw_size:
        raise CodecError(f"payload decompressed to {len(raw)} bytes, expected {raw_size}")
    return raw


def decode_tensors(
    payload: bytes, description: Mapping, max_raw_size: int = DEFAULT_MAX_RAW_SIZE
) -> dict[str, np.ndarray]:
    """Decode a payload produced by :func:`encode_tensors`.

    Args:
        payload: The compressed bytes.
        description: The description dict returned by :func:`encode_tensors` (possibly after
            a msgpack round trip, so lists instead of tuples are fine).
        max_raw_size: Largest uncompressed size accepted; checked before decompressing.

    Returns:
        Name -> writable float32 array with the described shape, in sorted-name order.

    Raises:
        CodecError: for an invalid description, a raw size over the limit, a payload that is
            not exactly one matching zstd frame, or decoded values that are not finite or
            not valid int8 codes/scales.
    """
    codec, block_size, raw_size, specs = _parse_description(description, max_raw_size)
    raw = _decompress(payload, raw_size)

    if codec == "fp32":
        # Copy so the caller gets writable arrays rather than views of immutable bytes.
        values = np.frombuffer(raw, _F32).astype(np.float32)
        if not np.isfinite(values).all():
            raise CodecError("payload decodes to NaN/Inf values")
        starts = accumulate((s.size for s in specs), initial=0)
    else:
        n_blocks = raw_size // (block_size + _F32.itemsize)
        codes = np.frombuffer(raw, np.int8, count=n_blocks * block_size)
        scales = np.frombuffer(raw, _F32, offset=n_blocks * block_size)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise CodecError("payload holds negative or non-finite int8 scales")
        if n_blocks and codes.min() < -_INT8_MAX:
            raise CodecError("payload holds int8 code -128, outside [-127, 127]")
        values = dequantize_int8(codes, scales, n_blocks * block_size)
        padded = (_n_blocks(s.size, block_size) * block_size for s in specs)
        starts = accumulate(padded, initial=0)
    return {
        s.name: values[start : start + s.size].reshape(s.shape)
        for s, start in zip(specs, starts, strict=False)  # starts has one extra
    }
