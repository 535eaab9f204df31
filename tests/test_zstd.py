"""shared.zstd: frames into a caller's buffer and back, through python-zstandard's public API."""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest
import zstandard

from shared.codec import zstd
from shared.codec.config import MAX_ZSTD_LEVEL, MIN_ZSTD_LEVEL


def _raw(n: int = 100_000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 16, n, dtype=np.uint8)


def _compress(raw: np.ndarray, level: int = 1, checksum: bool = False) -> bytes:
    dst = np.empty(zstd.compress_bound(raw.size), np.uint8)
    return bytes(dst[: zstd.Compressor(level, checksum).compress_into(raw, dst)])


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("level", [zstd.MIN_LEVEL, -1, 1, 3])
def test_frames_are_standard_zstd_with_size_and_optional_checksum(
    level: int, checksum: bool
) -> None:
    raw = _raw()
    frame = _compress(raw, level, checksum)
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == raw.size and params.has_checksum == checksum
    assert zstandard.ZstdDecompressor().decompress(frame) == raw.tobytes()
    assert zstd.frame_content_size(memoryview(frame)) == raw.size
    out = zstd.decompress(memoryview(frame), raw.size)
    assert out.dtype == np.uint8 and not out.flags.writeable
    np.testing.assert_array_equal(out, raw)


def test_frames_go_into_a_slice_of_the_callers_buffer_and_nothing_past_them() -> None:
    raw = _raw()
    room = np.full(zstd.compress_bound(raw.size) + 64, 7, np.uint8)
    n = zstd.Compressor(1).compress_into(raw, room[32:])
    assert (room[:32] == 7).all() and (room[32 + n :] == 7).all()
    assert zstd.decompress(memoryview(room[32 : 32 + n]), raw.size).tobytes() == raw.tobytes()


def test_too_small_buffers_raise_and_write_nothing() -> None:
    raw = _raw()
    room = np.full(64, 7, np.uint8)
    with pytest.raises(zstd.ZstdError, match="compression failed"):
        zstd.Compressor(1).compress_into(raw, room[:32])
    assert (room == 7).all()


@pytest.mark.parametrize(
    "size", [0, 1, 255, 256, 2047, (128 << 10) - 1, 128 << 10, (128 << 10) + 1, 1 << 20]
)
def test_compress_bound_holds_for_incompressible_data(size: int) -> None:
    raw = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    for level in (zstd.MIN_LEVEL, -1, 1, 19):
        assert len(_compress(raw, level, checksum=True)) <= zstd.compress_bound(size)
    assert zstd.compress_bound(size) >= size + (size >> 8)


def test_compress_bound_is_zstds_formula() -> None:
    """ZSTD_COMPRESSBOUND from zstd.h: a 64-byte margin for empty input, none from 128 KiB."""
    assert zstd.compress_bound(0) == 64
    assert zstd.compress_bound(2048) == 2048 + 8 + 63
    assert zstd.compress_bound(128 << 10) == (128 << 10) + 512
    assert zstd.compress_bound(1 << 20) == (1 << 20) + 4096


def test_bad_frames_raise_zstd_error() -> None:
    raw = _raw(1000)
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(raw.tobytes())
    with pytest.raises(zstd.ZstdError, match="not a zstd frame"):
        zstd.frame_content_size(memoryview(b"junk" * 10))
    with pytest.raises(zstd.ZstdError, match="not a zstd frame"):
        zstd.decompress(memoryview(b"junk" * 10), 40)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(b"x")
    assert zstd.frame_content_size(memoryview(no_size)) is None
    with pytest.raises(zstd.ZstdError, match="declares no content size"):
        zstd.decompress(memoryview(no_size), 1)
    with pytest.raises(zstd.ZstdError, match="declares 1000 bytes, expected 999"):
        zstd.decompress(memoryview(frame), 999)
    with pytest.raises(zstd.ZstdError, match="not a whole zstd frame"):
        zstd.decompress(memoryview(frame[:-3]), raw.size)
    with pytest.raises(zstd.ZstdError, match="1 bytes follow the zstd frame"):
        zstd.decompress(memoryview(frame + b"\0"), raw.size)
    empty = zstandard.ZstdCompressor(write_checksum=True).compress(b"")
    with pytest.raises(zstd.ZstdError, match=f"{len(empty)} bytes follow the zstd frame"):
        zstd.decompress(memoryview(frame + empty), raw.size)
    corrupt = bytearray(frame)
    corrupt[-1] ^= 0xFF  # the checksum
    with pytest.raises(zstd.ZstdError, match="checksum"):
        zstd.decompress(memoryview(bytes(corrupt)), raw.size)


def test_frames_of_no_content_are_read_whole() -> None:
    """python-zstandard's one-shot decompress returns b"" for a frame that declares no content
    without reading the rest: such frames go through a stream instead."""
    empty = zstandard.ZstdCompressor(write_checksum=True).compress(b"")
    assert zstd.decompress(memoryview(empty), 0).size == 0
    with pytest.raises(zstd.ZstdError, match="4 bytes follow the zstd frame"):
        zstd.decompress(memoryview(empty + b"junk"), 0)
    with pytest.raises(zstd.ZstdError, match="not a whole zstd frame"):
        zstd.decompress(memoryview(empty[:-2]), 0)
    corrupt = bytearray(empty)
    corrupt[-1] ^= 0xFF
    with pytest.raises(zstd.ZstdError, match="checksum"):
        zstd.decompress(memoryview(bytes(corrupt)), 0)


def _rle_frame(declared: int, blocks: int, block_size: int) -> bytes:
    """A hand-made frame (RFC 8878) declaring ``declared`` bytes, holding ``blocks`` RLE
    blocks of ``block_size`` bytes each: 4 bytes of input per block, whatever its size."""
    header = bytes([0x28, 0xB5, 0x2F, 0xFD, 0x40, 0x38]) + struct.pack("<H", declared - 256)
    body = b"".join(
        ((block_size << 3) | (1 << 1) | (i == blocks - 1)).to_bytes(3, "little") + b"\x07"
        for i in range(blocks)
    )
    return header + body


def test_a_frame_that_outgrows_its_declared_size_stops_there() -> None:
    """A bomb: 80 KB of input that would expand to 2 GB, declaring 1000 bytes, or none."""
    assert zstd.decompress(memoryview(_rle_frame(1000, 1, 1000)), 1000).tobytes() == b"\7" * 1000
    with pytest.raises(zstd.ZstdError, match="bad zstd frame"):
        zstd.decompress(memoryview(_rle_frame(1000, 20_000, 100_000)), 1000)
    empty = bytes([0x28, 0xB5, 0x2F, 0xFD, 0x20, 0x00])  # single segment, content size 0
    with pytest.raises(zstd.ZstdError, match="bad zstd frame"):
        zstd.decompress(memoryview(empty + _rle_frame(1000, 20_000, 100_000)[8:]), 0)


def test_level_bounds_are_zstds() -> None:
    assert (zstd.MIN_LEVEL, zstd.MAX_LEVEL) == (MIN_ZSTD_LEVEL, MAX_ZSTD_LEVEL)
    assert zstd.MAX_LEVEL == zstandard.MAX_COMPRESSION_LEVEL
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


@pytest.mark.parametrize("level", [-1, -50])
def test_fast_levels_cap_the_hash_table_and_keep_the_levels_other_parameters(
    level: int,
) -> None:
    """Only the hash log is set: the frames are those of the level with that one parameter
    changed (libzstd still adapts the rest to each input's size), and differ from the
    level's default where the cap binds."""
    compressor = zstd.Compressor(level)
    assert compressor.parameters is not None
    assert compressor.parameters.hash_log == zstd.FAST_HASH_LOG
    assert compressor.parameters.compression_level == level
    rng = np.random.default_rng(1)
    for size in (1000, 100_000, 1 << 20):
        raw = (rng.standard_normal(size) * 20).astype(np.int8).view(np.uint8)
        frame = _compress(raw, level)
        explicit = zstandard.ZstdCompressionParameters.from_level(
            level, source_size=size, hash_log=zstd.FAST_HASH_LOG, write_content_size=1
        )
        assert frame == zstandard.ZstdCompressor(compression_params=explicit).compress(raw)
        assert zstd.decompress(memoryview(frame), size).tobytes() == raw.tobytes()
    # 8-byte words drawn from 4,000: their matches need more hash entries than 2^10.
    words = rng.integers(0, 256, (4000, 8), dtype=np.uint8)
    raw = words[rng.integers(0, len(words), 1 << 17)].reshape(-1)
    default = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    assert len(_compress(raw, level)) > len(default)


def test_positive_levels_use_the_levels_own_parameters() -> None:
    raw = _raw()
    assert zstd.Compressor(3).parameters is None
    assert _compress(raw, 3) == zstandard.ZstdCompressor(level=3).compress(raw)
