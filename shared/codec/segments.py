"""How a payload is cut into segments, and the per-segment encoder and decoder.

The units of a layout's tensors (blocks, or values for fp32 and bf16; see
:mod:`shared.codec.description`) are cut into equal segments, each one zstd frame. A
:class:`Plan` says where each segment's pieces come from; it depends on the layout alone, so
it is cached (a learner sends the same layout every round). :class:`SegmentEncoder`
quantises one segment into a per-thread scratch buffer and compresses it while it is still in
cache; :class:`SegmentDecoder` checks one frame's checksum, decompresses it and dequantises
it into its slice of the output. :func:`run` runs either over all segments, on worker
threads for large payloads: the kernels release the GIL (Numba ``nogil``) and so does
python-zstandard around libzstd.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import xxhash

from shared.codec import dequantize, floats, quantize, zstd
from shared.codec.config import BITS, BLOCK_CODECS, CodecConfig, CodecError
from shared.codec.description import Description, n_blocks, raw_size_of, unit_bytes, unit_elements
from shared.codec.layout import Layout

__all__ = [
    "SEGMENT_ELEMENTS",
    "THREADS_MIN_BYTES",
    "Plan",
    "SegmentDecoder",
    "SegmentEncoder",
    "segment_plan",
    "read_only",
    "run",
    "worker_threads",
]

# Elements per segment (one zstd frame), nominally: 4 MiB of float32 (a payload's frames are
# all of one size, within a factor 1.5 of this; see _plan). A segment's raw bytes (1 MiB for
# int8) are still in cache when zstd reads them, and there are few enough frames that the
# per-frame output buffers cost little (each frame's fresh output allocation page-faults, so
# many small frames are slower; bench/codec.py measures it).
SEGMENT_ELEMENTS = 1 << 20
MAX_SEGMENT_UNITS = 1 << 26
# Payloads below this many raw bytes are coded on the calling thread whatever threads says.
THREADS_MIN_BYTES = 8 << 20

_F32 = np.dtype("<f4")
_F32_MAX = float(np.finfo(np.float32).max)
_EMPTY = np.zeros(0, np.float32)
_LOCAL = threading.local()
_MAX_SCRATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class Plan:
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
def segment_plan(codec: str, block_size: int, layout: Layout) -> Plan:
    """The :class:`Plan` of ``layout``."""
    unit = unit_elements(codec, block_size)
    sizes = layout.sizes
    # Frames of equal size, as close to SEGMENT_ELEMENTS values as a whole number of them
    # allows: no tiny last frame (a 1M-value payload cut per tensor into blocks is a few
    # blocks over 2^20 values, which made a second frame of its own).
    total = sum(n_blocks(n, unit) for n in sizes)
    segment = max(1, -(-total // max(1, round(total * unit / SEGMENT_ELEMENTS))))
    segments: list[np.ndarray] = []
    current: list[tuple[int, int, int, int, int]] = []
    fill = 0
    for index, size in enumerate(sizes):
        units, done = n_blocks(size, unit), 0
        while done < units:
            take = min(units - done, segment - fill)
            current.append((index, done * unit, min(size, (done + take) * unit), fill, take))
            fill, done = fill + take, done + take
            if fill == segment:
                segments.append(np.array(current, np.int64))
                current, fill = [], 0
    if current:
        segments.append(np.array(current, np.int64))
    per_unit = unit_bytes(codec, block_size)
    raw_bytes = tuple(int(rows[-1, 3] + rows[-1, 4]) * per_unit for rows in segments)
    byte_offsets = np.array(layout.offsets, np.int64) * _F32.itemsize
    for rows in (*segments, byte_offsets):
        rows.setflags(write=False)
    bounds = tuple(zstd.compress_bound(n) for n in raw_bytes)
    return Plan(
        segment=segment,
        raw_size=raw_size_of(codec, block_size, sizes),
        jobs=tuple(zip(segments, raw_bytes, strict=True)),
        bounds=bounds,
        total_bound=sum(bounds),
        byte_offsets=byte_offsets,
    )


def worker_threads(threads: int, raw_size: int) -> int:
    if threads == 0 or raw_size < THREADS_MIN_BYTES:
        return 0
    return os.cpu_count() or 1 if threads == -1 else threads


def run(function: Callable[[Any], Any], items: list, threads: int) -> list:
    """``[function(x) for x in items]``, on ``threads`` worker threads if more than one.

    The kernels release the GIL (Numba ``nogil``) and so does zstd, so threads really run
    in parallel. The workers live as long as the process (one pool per thread count), so each
    keeps its scratch buffers and zstd context from one payload to the next: fresh threads
    would allocate and page-fault them again for every payload.
    """
    if threads <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    return list(_pool(threads).map(function, items))


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` codec workers (made on first use)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="codec")
        return pool


def _forget_pools() -> None:
    """A forked child has none of its parent's threads: it makes its own pools."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


class SegmentEncoder:
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
            self.base = quantize.address(values) if isinstance(values, np.ndarray) else 0
            self.residual_addresses = (
                read_only(np.array([quantize.address(residual[n]) for n in self.names], np.int64))
                if residual
                else addresses
            )

    def __call__(self, job: tuple[np.ndarray, int], dst: np.ndarray) -> tuple[int, int]:
        """Quantise the segment ``job`` (its pieces and raw size) into scratch, compress it
        into ``dst``; return the frame's size and XXH3-64 checksum."""
        pieces, raw_bytes = job
        raw = _scratch(raw_bytes)
        if self.block:  # every tensor of the segment in one kernel call
            piece, _ = quantize.encode_segment(
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
                bad = floats.encode_fp32(flat, raw.view(_F32)[first : first + units])
            else:
                bad = floats.encode_bf16(
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


def _check_finite(name: str, arr: np.ndarray) -> None:
    if not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise CodecError(
            f"tensor {name!r} contains {bad} NaN/Inf value(s); refusing to encode "
            "a non-finite pseudo-gradient"
        )


class SegmentDecoder:
    """Decompresses one frame and decodes it into its slice of the output values."""

    def __init__(self, description: Description, values: np.ndarray) -> None:
        """Decode into ``values``: all units of ``description``, back to back (with padding)."""
        self.description = description
        self.values = values
        self.total_units = description.units
        self.unit = unit_elements(description.codec, description.block_size)
        self.unit_bytes = unit_bytes(description.codec, description.block_size)

    def __call__(self, job: tuple[int, memoryview]) -> None:
        index, frame = job
        description = self.description
        first = index * description.segment
        units = min(description.segment, self.total_units - first)
        if xxhash.xxh3_64_intdigest(frame) != description.checksums[index]:
            raise CodecError(
                f"payload frame {index} does not match its XXH3-64 checksum (corrupted?)"
            )
        raw = _decompress(frame, units * self.unit_bytes)
        out = self.values[first * self.unit : (first + units) * self.unit]
        if description.codec == "fp32":
            bad = floats.decode_fp32(raw.view(_F32), out)
        elif description.codec == "bf16":
            bad = floats.decode_bf16(raw.view("<u2"), out)
        else:
            scales = raw[: 4 * units].view(_F32)
            bits = BITS[description.codec]
            bad = dequantize.decode_blocks(
                raw[4 * units :], scales, bits, description.block_size, out
            )
            if bad >= 0:
                block = first + bad
                scale = scales[bad]
                qmax = {8: 127, 4: 7, 2: 1}[bits]
                if not np.isfinite(scale) or np.signbit(scale) or float(scale) * qmax > _F32_MAX:
                    raise CodecError(
                        f"payload holds a negative, non-finite or too large scale in block {block}"
                    )
                invalid = {8: "-128", 4: "-8", 2: "0b10"}[bits]
                name = description.codec
                raise CodecError(
                    f"payload holds an invalid {name} code ({invalid}) in block {block}"
                )
        if bad >= 0:
            raise CodecError(f"payload decodes to NaN/Inf values in frame {index}")


def read_only(array: np.ndarray) -> np.ndarray:
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
