"""zstd frames compressed into and decompressed out of caller-owned buffers.

python-zstandard's ``compress`` / ``decompress`` return a fresh ``bytes`` object per call.
For a payload of hundreds of MiB that costs a page fault per 4 KiB page written (and the
codec then joined the frames into yet another ``bytes``), which took more time than
quantising. This module calls libzstd through the cffi bindings that python-zstandard
ships (``zstandard._cffi``, the same library and version as its C backend), so that

* :meth:`Compressor.compress_into` writes one frame straight into a slice of the payload
  buffer (allocated once per payload, by NumPy, which asks for huge pages), and
* :func:`decompress_into` writes one frame into a reused per-thread scratch buffer that
  is still in cache when the dequantiser reads it.

cffi releases the GIL around every libzstd call, so worker threads compress in parallel.
Frames are ordinary zstd frames with the content size; anything that reads zstd reads
them. They carry zstd's own XXH64 checksum only if asked (``checksum=True``): the codec
checks each frame with XXH3 instead, which is about six times faster here (63 vs 11 GB/s),
and zstd's checksum was a third of the time of decompressing an int8 frame.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from zstandard._cffi import ffi, lib

__all__ = [
    "FAST_HASH_LOG",
    "MAX_LEVEL",
    "MIN_LEVEL",
    "Compressor",
    "ZstdError",
    "compress_bound",
    "decompress_into",
    "frame_content_size",
]

MIN_LEVEL = int(lib.ZSTD_minCLevel())
FAST_HASH_LOG = 10
MAX_LEVEL = int(lib.ZSTD_maxCLevel())
_LOCAL = threading.local()


class ZstdError(ValueError):
    """A frame that is not exactly one valid zstd frame of the expected size."""


def compress_bound(size: int) -> int:
    """Largest frame :meth:`Compressor.compress_into` can write for ``size`` input bytes."""
    return int(lib.ZSTD_compressBound(size))


def _check(code: int, what: str) -> int:
    if lib.ZSTD_isError(code):
        raise ZstdError(f"{what}: {ffi.string(lib.ZSTD_getErrorName(code)).decode()}")
    return int(code)


class Compressor:
    """Writes zstd frames (content size, and an XXH64 checksum if ``checksum``) at one level.

    Negative (fast) levels also cap zstd's match-finder hash table at 2^FAST_HASH_LOG
    entries (zstd's own choice for a 1 MiB input is 2^13, 32 KiB): a table of 4 KiB stays in
    L1 beside the data. On the codec's payloads (``bench/codec.py`` data, 10M values, level
    -1) that compressed 1.4-1.8x faster; the ratio of int8, bf16 and fp32 payloads did not
    change in the fourth digit, int4 lost 0.6% and int2 3% of zstd's (small) gain.

    A compression context is not thread-safe; :meth:`for_thread` hands each thread its own.
    """

    def __init__(self, level: int, checksum: bool = False) -> None:
        if not MIN_LEVEL <= level <= MAX_LEVEL:
            raise ValueError(f"zstd level must be in [{MIN_LEVEL}, {MAX_LEVEL}], got {level}")
        self.level = level
        self.checksum = checksum
        self._cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        if self._cctx == ffi.NULL:
            raise MemoryError("cannot allocate a zstd compression context")
        parameters = [
            (lib.ZSTD_c_compressionLevel, level),
            (lib.ZSTD_c_checksumFlag, int(checksum)),
            (lib.ZSTD_c_contentSizeFlag, 1),
        ]
        if level < 0:
            parameters.append((lib.ZSTD_c_hashLog, FAST_HASH_LOG))
        for parameter, value in parameters:
            _check(lib.ZSTD_CCtx_setParameter(self._cctx, parameter, value), "zstd parameter")

    @classmethod
    def for_thread(cls, level: int, checksum: bool = False) -> Compressor:
        """This thread's compressor for ``level`` and ``checksum`` (created on first use)."""
        compressors = _LOCAL.__dict__.setdefault("compressors", {})
        compressor = compressors.get((level, checksum))
        if compressor is None:
            compressor = compressors[level, checksum] = cls(level, checksum)
        return compressor

    def compress_into(self, src: np.ndarray, dst: np.ndarray) -> int:
        """Compress contiguous ``src`` into one frame at the start of ``dst``; return its size.

        ``dst`` (contiguous uint8) needs ``compress_bound(src.nbytes)`` bytes to be sure of
        room; with less, :class:`ZstdError` may be raised.
        """
        n = lib.ZSTD_compress2(
            self._cctx,
            ffi.from_buffer(dst, require_writable=True),
            dst.nbytes,
            ffi.from_buffer(src),
            src.nbytes,
        )
        return _check(n, "zstd compression failed")


def _dctx() -> Any:
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = ffi.gc(lib.ZSTD_createDCtx(), lib.ZSTD_freeDCtx)
        if dctx == ffi.NULL:
            raise MemoryError("cannot allocate a zstd decompression context")
        _LOCAL.dctx = dctx
    return dctx


def frame_content_size(frame: memoryview) -> int | None:
    """The content size a frame's header declares (None if it declares none).

    Raises:
        ZstdError: ``frame`` does not start with a valid zstd frame header.
    """
    size = lib.ZSTD_getFrameContentSize(ffi.from_buffer(frame), len(frame))
    if size == lib.ZSTD_CONTENTSIZE_ERROR:
        raise ZstdError("not a zstd frame (bad magic number or header)")
    return None if size == lib.ZSTD_CONTENTSIZE_UNKNOWN else int(size)


def decompress_into(frame: memoryview, dst: np.ndarray) -> int:
    """Decompress ``frame``, which must be exactly one zstd frame, into ``dst``.

    Returns the number of bytes written. libzstd never writes past ``dst`` and verifies the
    frame's checksum, if it has one.

    Raises:
        ZstdError: ``frame`` is not exactly one well-formed frame (trailing bytes included),
            fails its checksum, or needs more room than ``dst`` has.
    """
    src = ffi.from_buffer(frame)
    size = _check(lib.ZSTD_findFrameCompressedSize(src, len(frame)), "not a whole zstd frame")
    if size != len(frame):
        raise ZstdError(f"{len(frame) - size} bytes follow the zstd frame")
    dst_ptr = ffi.from_buffer(dst, require_writable=True)
    return _check(lib.ZSTD_decompressDCtx(_dctx(), dst_ptr, dst.nbytes, src, size), "bad frame")
