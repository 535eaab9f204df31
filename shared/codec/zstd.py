"""zstd frames for the codec, through python-zstandard's public API.

* :meth:`Compressor.compress_into` compresses one frame (``ZstdCompressor.compress``) and
  copies it at once into a slice of the caller's payload buffer, so that a payload of many
  frames is one NumPy buffer (allocated once per payload; NumPy asks for huge pages) and
  never a ``b"".join`` of them.
* :func:`decompress` returns one frame's bytes as a read-only NumPy view, after checking
  that the frame declares, and decompresses to, exactly the size the caller expects; the
  dequantiser reads that view directly.

python-zstandard's C backend releases the GIL while libzstd compresses or decompresses, so
worker threads code frames in parallel. Frames are ordinary zstd frames with the content
size; anything that reads zstd reads them. They carry zstd's own XXH64 checksum only if
asked (``checksum=True``): the codec checks each frame with XXH3 instead, which is several
times faster (docs/CODEC.md).
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from shared.codec.config import MAX_ZSTD_LEVEL, MIN_ZSTD_LEVEL

__all__ = [
    "FAST_HASH_LOG",
    "MAX_LEVEL",
    "MIN_LEVEL",
    "Compressor",
    "ZstdError",
    "compress_bound",
    "decompress",
    "frame_content_size",
]

# libzstd's ZSTD_minCLevel(), which python-zstandard does not expose; lower levels would be
# clamped to it.
MIN_LEVEL = MIN_ZSTD_LEVEL
MAX_LEVEL = zstandard.MAX_COMPRESSION_LEVEL
if MAX_LEVEL != MAX_ZSTD_LEVEL:
    raise ImportError(
        f"libzstd's highest level is {MAX_LEVEL}, shared/codec/config.py says "
        f"{MAX_ZSTD_LEVEL}: update shared/codec/config.py to this libzstd"
    )
FAST_HASH_LOG = 10
_BOUND_MARGIN_BELOW = 128 << 10
_LOCAL = threading.local()


class ZstdError(ValueError):
    """A frame that is not exactly one valid zstd frame of the expected size."""


def compress_bound(size: int) -> int:
    """Largest frame :meth:`Compressor.compress_into` can write for ``size`` input bytes.

    zstd's ``ZSTD_COMPRESSBOUND`` (zstd.h), a formula that is part of its stable API.
    """
    margin = (_BOUND_MARGIN_BELOW - size) >> 11 if size < _BOUND_MARGIN_BELOW else 0
    return size + (size >> 8) + margin


class Compressor:
    """Writes zstd frames (content size, and an XXH64 checksum if ``checksum``) at one level.

    Negative (fast) levels also cap zstd's match-finder hash table at 2^FAST_HASH_LOG
    entries (zstd's own choice for a 1 MiB input is 2^13, 32 KiB): a table of 4 KiB stays in
    L1 beside the data, which compresses int8 payloads faster for almost no loss of ratio
    (docs/CODEC.md, "Speed", "Fast zstd levels", with the command that measures it).

    A ``zstandard.ZstdCompressor`` is not thread-safe; :meth:`for_thread` hands each thread
    its own.
    """

    def __init__(self, level: int, checksum: bool = False) -> None:
        if not MIN_LEVEL <= level <= MAX_LEVEL:
            raise ValueError(f"zstd level must be in [{MIN_LEVEL}, {MAX_LEVEL}], got {level}")
        self.level = level
        self.checksum = checksum
        # The level's own parameters (which libzstd adapts to each input's size), only the
        # hash log set explicitly.
        self.parameters = (
            zstandard.ZstdCompressionParameters(
                compression_level=level,
                hash_log=FAST_HASH_LOG,
                write_checksum=int(checksum),
                write_content_size=1,
            )
            if level < 0
            else None
        )
        if self.parameters is None:
            self._cctx = zstandard.ZstdCompressor(
                level=level, write_checksum=checksum, write_content_size=True
            )
        else:
            self._cctx = zstandard.ZstdCompressor(compression_params=self.parameters)

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
        room; with less, :class:`ZstdError` may be raised, and nothing is written.
        """
        try:
            frame = self._cctx.compress(src)
        except zstandard.ZstdError as exc:
            raise ZstdError(f"zstd compression failed: {exc}") from exc
        size = len(frame)
        if size > dst.nbytes:
            raise ZstdError(
                f"zstd compression failed: a frame of {size} bytes does not fit in {dst.nbytes}"
            )
        dst[:size] = np.frombuffer(frame, np.uint8)
        return size


def _dctx() -> zstandard.ZstdDecompressor:
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx


def frame_content_size(frame: memoryview) -> int | None:
    """The content size a frame's header declares (None if it declares none).

    Raises:
        ZstdError: ``frame`` does not start with a valid zstd frame header.
    """
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise ZstdError(f"not a zstd frame (bad magic number or header): {exc}") from exc
    return None if size < 0 else size


def decompress(frame: memoryview, size: int) -> np.ndarray:
    """``frame``, which must be exactly one zstd frame of ``size`` bytes, decompressed.

    Returns a read-only uint8 array of ``size`` bytes. The frame's header must declare
    ``size`` (checked before anything is allocated); libzstd verifies the frame's checksum,
    if it has one.

    Raises:
        ZstdError: ``frame`` is not exactly one well-formed frame (trailing bytes included),
            does not declare ``size`` bytes or decompress to them, or fails its checksum.
    """
    declared = frame_content_size(frame)
    if declared != size:
        found = "no content size" if declared is None else f"{declared} bytes"
        raise ZstdError(f"zstd frame declares {found}, expected {size}")
    try:
        if size:
            out = _dctx().decompress(frame, max_output_size=size, allow_extra_data=False)
        else:  # python-zstandard returns b"" for such a frame without reading it
            out = _decompress_streaming(frame)
    except zstandard.ZstdError as exc:
        raise ZstdError(_why(frame, exc)) from exc
    if len(out) != size:
        raise ZstdError(f"zstd frame decompressed to {len(out)} bytes, expected {size}")
    return np.frombuffer(out, np.uint8)


def _decompress_streaming(frame: memoryview) -> bytes:
    """``frame`` decompressed through a stream, which reads all of it; raises
    ``zstandard.ZstdError`` unless it is exactly one whole frame."""
    stream = _dctx().decompressobj()
    out = stream.decompress(frame)
    if not stream.eof:
        raise zstandard.ZstdError("the frame is truncated")
    if stream.unused_data:
        raise zstandard.ZstdError(f"{len(stream.unused_data)} bytes of unused data")
    return out


def _why(frame: memoryview, error: zstandard.ZstdError) -> str:
    """What is wrong with a frame that failed to decompress (found again through a stream,
    for the message: python-zstandard's one-shot errors do not say where the frame ends).

    The frame declares the size the caller expects, and libzstd stops a frame whose blocks
    outgrow its declared content size, so the stream holds at most that much.
    """
    stream = _dctx().decompressobj()
    try:
        stream.decompress(frame)
    except zstandard.ZstdError:
        return f"bad zstd frame: {error}"
    if not stream.eof:
        return f"not a whole zstd frame (truncated): {error}"
    if stream.unused_data:
        return f"{len(stream.unused_data)} bytes follow the zstd frame"
    return f"bad zstd frame: {error}"
