"""Tests for shared.codec: round trips, quantisation error bounds, and hostile input."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.codec import (
    CODECS,
    CodecError,
    TensorSpec,
    decode_tensors,
    dequantize_int8,
    encode_tensors,
    quantize_int8,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
names = st.text(min_size=0, max_size=12)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)
tensor_dicts = st.dictionaries(
    names, hnp.arrays(np.float32, shapes, elements=finite_f32), max_size=6
)


def _block_absmax(x: np.ndarray, block_size: int) -> np.ndarray:
    """Per-element absmax of the block each element belongs to (reference implementation)."""
    flat = np.abs(x.reshape(-1).astype(np.float64))
    n_blocks = -(-flat.size // block_size)
    padded = np.zeros(n_blocks * block_size)
    padded[: flat.size] = flat
    return np.repeat(padded.reshape(n_blocks, block_size).max(axis=1), block_size)[: flat.size]


def _assert_int8_bound(x: np.ndarray, y: np.ndarray, block_size: int) -> None:
    # Round-to-nearest with scale = absmax / 127 gives |error| <= absmax / 254; allow a few
    # float32 ulps of arithmetic slack plus one subnormal ulp for tiny scales.
    err = np.abs(x.reshape(-1).astype(np.float64) - y.reshape(-1).astype(np.float64))
    bound = _block_absmax(x, block_size) / 254 * (1 + 1e-4) + 2.0**-149
    assert np.all(err <= bound), float(np.max(err - bound))


def _corruptible() -> tuple[bytes, dict]:
    rng = np.random.default_rng(1)
    tensors = {"a": rng.standard_normal((7, 9)).astype(np.float32), "b": np.arange(5.0)}
    return encode_tensors(tensors, "int8", block_size=16)


# --------------------------------------------------------------------------- round trips


@SETTINGS
@given(tensor_dicts)
def test_fp32_round_trip_is_exact(tensors: dict[str, np.ndarray]) -> None:
    payload, description = encode_tensors(tensors, "fp32")
    out = decode_tensors(payload, description)
    assert list(out) == sorted(tensors)
    for name, arr in tensors.items():
        assert out[name].dtype == np.float32
        assert out[name].shape == arr.shape
        np.testing.assert_array_equal(out[name], arr)


@SETTINGS
@given(tensor_dicts, st.sampled_from([1, 3, 8, 256]))
def test_int8_round_trip_within_half_scale(tensors: dict[str, np.ndarray], block_size: int) -> None:
    payload, description = encode_tensors(tensors, "int8", block_size=block_size)
    out = decode_tensors(payload, description)
    assert list(out) == sorted(tensors)
    for name, arr in tensors.items():
        assert out[name].shape == arr.shape and out[name].dtype == np.float32
        _assert_int8_bound(arr, out[name], block_size)


@pytest.mark.parametrize("block_size", [32, 256, 4096])
def test_int8_relative_l2_error_on_gaussian(block_size: int) -> None:
    x = np.random.default_rng(0).standard_normal(1_000_003).astype(np.float32) * 3e-3
    payload, description = encode_tensors({"g": x}, "int8", block_size=block_size)
    y = decode_tensors(payload, description)["g"]
    rel = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert rel < 0.01
    _assert_int8_bound(x, y, block_size)


@pytest.mark.parametrize("codec", CODECS)
def test_zero_empty_scalar_and_odd_sized_tensors(codec: str) -> None:
    rng = np.random.default_rng(2)
    tensors = {
        "zeros": np.zeros((3, 300), np.float32),
        "empty": np.zeros((0, 5), np.float32),
        "empty1d": np.zeros(0, np.float32),
        "scalar": np.float32(-2.5),
        "odd": rng.standard_normal(257).astype(np.float32),
        "f64": rng.standard_normal((2, 3)),  # converted to float32
        "int": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    payload, description = encode_tensors(tensors, codec)
    out = decode_tensors(payload, description)
    for name, arr in tensors.items():
        arr = np.asarray(arr, np.float32)
        assert out[name].shape == arr.shape and out[name].dtype == np.float32
        if codec == "fp32" or name in ("zeros", "empty", "empty1d", "scalar"):
            np.testing.assert_array_equal(out[name], arr)
        else:
            _assert_int8_bound(arr, out[name], 256)
    assert out["scalar"].flags.writeable and out["odd"].flags.writeable


@pytest.mark.parametrize("codec", CODECS)
def test_no_tensors(codec: str) -> None:
    payload, description = encode_tensors({}, codec)
    assert description["raw_size"] == 0 and description["tensors"] == []
    assert decode_tensors(payload, description) == {}


def test_description_is_plain_and_self_describing() -> None:
    payload, description = encode_tensors({"b": np.ones(3), "a": np.ones((2, 2))}, "int8", 4, 3)
    assert description == {
        "codec": "int8",
        "block_size": 4,
        "zstd_level": 3,
        "raw_size": 2 * (4 + 4),
        "tensors": [["a", [2, 2], "float32"], ["b", [3], "float32"]],
    }
    assert isinstance(payload, bytes)


def test_blocks_never_mix_tensors() -> None:
    # A tiny tensor next to a huge one keeps its own precision.
    tensors = {"a": np.full(3, 1e6, np.float32), "b": np.array([1e-3, -2e-3], np.float32)}
    out = decode_tensors(*encode_tensors(tensors, "int8", block_size=256))
    _assert_int8_bound(tensors["b"], out["b"], 256)


def test_extreme_magnitudes_stay_finite_and_bounded() -> None:
    big = np.float32(np.finfo(np.float32).max)
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    x = np.array([big, -big, 1.0, tiny, 3 * tiny, -2 * tiny, 0.0, 5 * tiny], np.float32)
    for block_size in (1, 2, 3, 8):
        y = decode_tensors(*encode_tensors({"x": x}, "int8", block_size=block_size))["x"]
        assert np.isfinite(y).all()
        _assert_int8_bound(x, y, block_size)


# --------------------------------------------------------------------------- quantize_int8


@SETTINGS
@given(
    hnp.arrays(np.float32, st.integers(0, 300), elements=finite_f32),
    st.integers(1, 64),
)
def test_quantize_dequantize(x: np.ndarray, block_size: int) -> None:
    codes, scales = quantize_int8(x, block_size)
    n_blocks = -(-x.size // block_size)
    assert codes.dtype == np.int8 and codes.shape == (n_blocks * block_size,)
    assert scales.dtype == np.float32 and scales.shape == (n_blocks,)
    assert codes.min(initial=0) >= -127
    assert np.all(codes[x.size :] == 0)
    y = dequantize_int8(codes, scales, x.size)
    assert y.shape == x.shape and y.dtype == np.float32
    err = np.abs(x.astype(np.float64) - y)
    per_element_scale = np.repeat(scales.astype(np.float64), block_size)[: x.size]
    assert np.all(err <= per_element_scale / 2 * (1 + 1e-4) + 2.0**-149)
    _assert_int8_bound(x, y, block_size)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_rejects_non_finite(bad: float) -> None:
    x = np.ones(10, np.float32)
    x[7] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        quantize_int8(x, 4)


def test_quantize_and_dequantize_validate_arguments() -> None:
    with pytest.raises(CodecError, match="1-D"):
        quantize_int8(np.ones((2, 2), np.float32), 4)
    for block_size in (0, -1, 1.5, True, 1 << 30):
        with pytest.raises(CodecError, match="block_size"):
            quantize_int8(np.ones(4, np.float32), block_size)
    codes, scales = quantize_int8(np.ones(10, np.float32), 4)
    with pytest.raises(CodecError, match=r"block\(s\)"):
        dequantize_int8(codes, scales, 13)
    with pytest.raises(CodecError, match=r"block\(s\)"):
        dequantize_int8(codes, scales, 8)
    with pytest.raises(CodecError, match="equal blocks"):
        dequantize_int8(codes[:-1], scales, 10)
    with pytest.raises(CodecError):
        dequantize_int8(codes.astype(np.int16), scales, 10)
    with pytest.raises(CodecError):
        dequantize_int8(codes, scales, -1)
    with pytest.raises(CodecError):
        dequantize_int8(codes, scales[:0], 0)
    assert dequantize_int8(codes[:0], scales[:0], 0).shape == (0,)


# --------------------------------------------------------------------------- encode errors


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("position", [0, 255, 256, 299])
def test_encode_rejects_non_finite(codec: str, bad: float, position: int) -> None:
    x = np.ones(300, np.float32)
    x[position] = bad
    with pytest.raises(CodecError, match=r"'bad'.*NaN/Inf"):
        encode_tensors({"ok": np.ones(3), "bad": x}, codec)


def test_encode_rejects_float64_overflow() -> None:
    with pytest.raises(CodecError, match="NaN/Inf"):
        encode_tensors({"x": np.array([1e300])}, "int8")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"codec": "int4"}, "unknown codec"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": "256"}, "block_size"),
        ({"zstd_level": 99}, "zstd_level"),
        ({"zstd_level": 1.0}, "zstd_level"),
    ],
)
def test_encode_rejects_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode_tensors({"x": np.ones(3)}, **kwargs)


@pytest.mark.parametrize(
    "tensors",
    [{1: np.ones(3)}, {"c": np.ones(3, np.complex64)}, {"s": np.array(["a"])}, {"b": [True]}],
)
def test_encode_rejects_bad_tensors(tensors: dict) -> None:
    with pytest.raises(CodecError):
        encode_tensors(tensors)


def test_zstd_level_is_used() -> None:
    x = {"x": np.tile(np.arange(1000, dtype=np.float32), 50)}
    fast, _ = encode_tensors(x, "fp32", zstd_level=-50)
    strong, description = encode_tensors(x, "fp32", zstd_level=19)
    assert len(strong) < len(fast)
    assert description["zstd_level"] == 19


# --------------------------------------------------------------------------- decode errors


def test_corrupted_payload_byte_is_detected() -> None:
    payload, description = _corruptible()
    for position in range(len(payload)):
        corrupted = bytearray(payload)
        corrupted[position] ^= 0x01
        with pytest.raises(CodecError):
            decode_tensors(bytes(corrupted), description)


def test_truncated_or_extended_payload_is_rejected() -> None:
    payload, description = _corruptible()
    for end in range(len(payload)):
        with pytest.raises(CodecError):
            decode_tensors(payload[:end], description)
    with pytest.raises(CodecError, match="decompress"):
        decode_tensors(payload + b"\0", description)
    with pytest.raises(CodecError, match="decompress"):
        decode_tensors(payload + payload, description)


def test_empty_payload_with_trailing_garbage_is_rejected() -> None:
    payload, description = encode_tensors({}, "int8")
    with pytest.raises(CodecError, match="empty zstd frame"):
        decode_tensors(payload + b"junk", description)


def _with(description: dict, **changes: object) -> dict:
    out = copy.deepcopy(description)
    out.update(changes)
    return out


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"codec": "int4"}, "unknown codec 'int4'"),
        ({"codec": None}, "unknown codec"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2**40}, "block_size"),
        ({"block_size": 8}, "raw_size .* needs"),
        ({"zstd_level": "fast"}, "zstd_level"),
        ({"raw_size": -1}, "raw_size"),
        ({"raw_size": 1.5}, "raw_size"),
        ({"raw_size": True}, "raw_size"),
        ({"raw_size": 12}, r"raw_size 12 does not match .* needs \d+ bytes"),
        ({"tensors": "a"}, "tensors must be a list"),
        ({"tensors": [["a", [3], "float32"]]}, "does not match"),
        ({"tensors": [["a", [-1, 2], "float32"]]}, "non-negative"),
        ({"tensors": [["a", [2.0], "float32"]]}, "non-negative ints"),
        ({"tensors": [["a", [True], "float32"]]}, "non-negative ints"),
        ({"tensors": [["a", [3], "float64"]]}, "dtype"),
        ({"tensors": [["a", 3, "float32"]]}, "shape"),
        ({"tensors": [["a", [1] * 40, "float32"]]}, "shape"),
        ({"tensors": [["a", [0, 2**62, 2**62], "float32"]]}, "too large"),
        ({"tensors": [[1, [3], "float32"]]}, "name must be str"),
        ({"tensors": [["a", [3]]]}, r"\[name, shape, dtype\]"),
        ({"tensors": [["b", [3], "float32"], ["a", [3], "float32"]]}, "sorted"),
        ({"tensors": [["a", [3], "float32"], ["a", [3], "float32"]]}, "unique"),
    ],
)
def test_bad_description_is_rejected(changes: dict, match: str) -> None:
    payload, description = _corruptible()
    with pytest.raises(CodecError, match=match):
        decode_tensors(payload, _with(description, **changes))


def test_missing_or_unknown_description_keys() -> None:
    payload, description = _corruptible()
    partial = _with(description)
    del partial["raw_size"]
    with pytest.raises(CodecError, match=r"missing \['raw_size'\]"):
        decode_tensors(payload, partial)
    with pytest.raises(CodecError, match="unknown"):
        decode_tensors(payload, _with(description, extra=1))
    for not_a_mapping in (None, [], "int8", 3):
        with pytest.raises(CodecError, match="mapping"):
            decode_tensors(payload, not_a_mapping)  # type: ignore[arg-type]


def test_raw_size_limit_is_checked_before_decompressing() -> None:
    huge = {"codec": "fp32", "block_size": 256, "zstd_level": 1, "raw_size": 4 * 10**12,
            "tensors": [["a", [10**12], "float32"]]}  # fmt: skip
    with pytest.raises(CodecError, match="exceeds the limit"):
        decode_tensors(b"not even zstd", huge)
    payload, description = _corruptible()
    with pytest.raises(CodecError, match="exceeds the limit"):
        decode_tensors(payload, description, max_raw_size=description["raw_size"] - 1)
    assert decode_tensors(payload, description, max_raw_size=description["raw_size"])


def test_zip_bomb_cannot_expand_past_raw_size() -> None:
    # A frame that honestly declares 64 MiB, presented with a description claiming 4 bytes.
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    description = {"codec": "fp32", "block_size": 256, "zstd_level": 1, "raw_size": 4,
                   "tensors": [["a", [1], "float32"]]}  # fmt: skip
    with pytest.raises(CodecError, match="declares"):
        decode_tensors(bomb, description)
    # The same data streamed without a content size in the frame header.
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    no_size = stream.compress(b"\0" * (1 << 20)) + stream.flush()
    with pytest.raises(CodecError, match="no content size"):
        decode_tensors(no_size, description)


def test_decoded_values_are_validated() -> None:
    description = {"codec": "fp32", "block_size": 256, "zstd_level": 1, "raw_size": 4,
                   "tensors": [["a", [1], "float32"]]}  # fmt: skip
    nan = zstandard.ZstdCompressor().compress(np.array([np.nan], np.float32).tobytes())
    with pytest.raises(CodecError, match="NaN/Inf"):
        decode_tensors(nan, description)
    int8 = {"codec": "int8", "block_size": 2, "zstd_level": 1, "raw_size": 6,
            "tensors": [["a", [2], "float32"]]}  # fmt: skip
    bad_code = np.array([-128, 1], np.int8).tobytes() + np.float32(1).tobytes()
    with pytest.raises(CodecError, match="-128"):
        decode_tensors(zstandard.ZstdCompressor().compress(bad_code), int8)
    for scale in (-1.0, np.inf, np.nan):
        bad_scale = np.array([1, 1], np.int8).tobytes() + np.float32(scale).tobytes()
        with pytest.raises(CodecError, match="scales"):
            decode_tensors(zstandard.ZstdCompressor().compress(bad_scale), int8)


def test_payload_must_be_bytes() -> None:
    _, description = _corruptible()
    with pytest.raises(CodecError, match="bytes"):
        decode_tensors("text", description)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- fuzzing


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzzed_payload_raises_codec_error_or_decodes_correct_shapes(data: st.DataObject) -> None:
    codec = data.draw(st.sampled_from(CODECS))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tensors = {"a": rng.standard_normal((5, 7)), "b": rng.standard_normal(40)}
    payload, description = encode_tensors(tensors, codec, block_size=16)
    mutated = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(mutated) - 1))
        mutated[position] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, len(mutated)))]
    try:
        out = decode_tensors(bytes(mutated), description)
    except CodecError:
        return
    for name, arr in tensors.items():
        assert out[name].shape == arr.shape and out[name].dtype == np.float32
        assert np.isfinite(out[name]).all()


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzzed_description_raises_only_codec_error(data: st.DataObject) -> None:
    payload, description = _corruptible()
    description = copy.deepcopy(description)
    key = data.draw(st.sampled_from([*description, "extra"]))
    description[key] = data.draw(json_like)
    try:
        out = decode_tensors(payload, description)
    except CodecError:
        return
    specs = [TensorSpec(n, tuple(s), d) for n, s, d in description["tensors"]]
    assert [out[s.name].shape for s in specs] == [s.shape for s in specs]


@settings(max_examples=100, deadline=None)
@given(json_like, st.binary(max_size=64))
def test_garbage_description_raises_only_codec_error(description: object, payload: bytes) -> None:
    with pytest.raises(CodecError):
        decode_tensors(payload, description)  # type: ignore[arg-type]
