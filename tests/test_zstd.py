"""shared.zstd: frames into and out of caller-owned buffers."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zstandard
from zstandard._cffi import ffi, lib

from shared import zstd


def _raw(n: int = 100_000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 16, n, dtype=np.uint8)


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("level", [zstd.MIN_LEVEL, -1, 1, 3])
def test_frames_are_standard_zstd_with_size_and_optional_checksum(
    level: int, checksum: bool
) -> None:
    raw = _raw()
    dst = np.empty(zstd.compress_bound(raw.size), np.uint8)
    n = zstd.Compressor(level, checksum).compress_into(raw, dst)
    frame = bytes(dst[:n])
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == raw.size and params.has_checksum == checksum
    assert zstandard.ZstdDecompressor().decompress(frame) == raw.tobytes()
    out = np.empty(raw.size, np.uint8)
    assert zstd.frame_content_size(memoryview(frame)) == raw.size
    assert zstd.decompress_into(memoryview(frame), out) == raw.size
    np.testing.assert_array_equal(out, raw)


def test_too_small_buffers_raise_and_write_nothing_past_them() -> None:
    raw = _raw()
    room = np.full(64, 7, np.uint8)
    with pytest.raises(zstd.ZstdError, match="compression failed"):
        zstd.Compressor(1).compress_into(raw, room[:32])
    assert (room[32:] == 7).all()
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(raw.tobytes())
    with pytest.raises(zstd.ZstdError):
        zstd.decompress_into(memoryview(frame), room[:32])
    assert (room[32:] == 7).all()


def test_bad_frames_raise_zstd_error() -> None:
    raw = _raw(1000)
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(raw.tobytes())
    out = np.empty(raw.size, np.uint8)
    with pytest.raises(zstd.ZstdError, match="not a zstd frame"):
        zstd.frame_content_size(memoryview(b"junk" * 10))
    assert (
        zstd.frame_content_size(
            memoryview(zstandard.ZstdCompressor(write_content_size=False).compress(b"x"))
        )
        is None
    )
    with pytest.raises(zstd.ZstdError, match="not a whole zstd frame"):
        zstd.decompress_into(memoryview(frame[:-3]), out)
    with pytest.raises(zstd.ZstdError, match="follow the zstd frame"):
        zstd.decompress_into(memoryview(frame + b"\0"), out)
    corrupt = bytearray(frame)
    corrupt[-1] ^= 0xFF  # the checksum
    with pytest.raises(zstd.ZstdError, match="checksum"):
        zstd.decompress_into(memoryview(bytes(corrupt)), out)


def test_level_is_range_checked() -> None:
    for level in (zstd.MIN_LEVEL - 1, zstd.MAX_LEVEL + 1):
        with pytest.raises(ValueError, match="zstd level"):
            zstd.Compressor(level)


def test_each_thread_gets_its_own_compressor() -> None:
    seen: list[zstd.Compressor] = []
    thread = threading.Thread(target=lambda: seen.append(zstd.Compressor.for_thread(1)))
    thread.start()
    thread.join()
    mine = zstd.Compressor.for_thread(1)
    assert mine is zstd.Compressor.for_thread(1)
    assert seen[0] is not mine and zstd.Compressor.for_thread(-1) is not mine
    assert zstd.Compressor.for_thread(1, checksum=True) is not mine


def _parameter(compressor: zstd.Compressor, parameter: int) -> int:
    value = ffi.new("int *")
    assert not lib.ZSTD_isError(lib.ZSTD_CCtx_getParameter(compressor._cctx, parameter, value))
    return value[0]


@pytest.mark.parametrize(("level", "hash_log"), [(-1, zstd.FAST_HASH_LOG), (-50, 10), (1, 0)])
def test_fast_levels_cap_the_hash_table(level: int, hash_log: int) -> None:
    """0 is zstd's "use the level's default"."""
    assert _parameter(zstd.Compressor(level), lib.ZSTD_c_hashLog) == hash_log
    raw = _raw()
    dst = np.empty(zstd.compress_bound(raw.size), np.uint8)
    n = zstd.Compressor(level).compress_into(raw, dst)
    assert zstandard.ZstdDecompressor().decompress(bytes(dst[:n])) == raw.tobytes()
