"""Tests for shared.codec: round trips, error bounds, error feedback, and hostile input."""

from __future__ import annotations

import copy
import math
import re
import subprocess
import sys
import threading
from itertools import accumulate, pairwise

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.codec import api, segments
from shared.codec import description as description_module
from shared.codec.api import (
    CodecState,
    encode,
    encode_flat,
    encode_tensors,
    extend_state,
    init_state,
    make_codec,
)
from shared.codec.config import BITS, BLOCK_CODECS, CODECS, CodecConfig, CodecError
from shared.codec.description import FORMAT_VERSION, MAX_SEGMENT_UNITS, Description
from shared.codec.layout import Layout, TensorSpec
from shared.codec.segments import SEGMENT_ELEMENTS, THREADS_MIN_BYTES

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOSSY = ("bf16", "int8", "int4", "int2")
F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).smallest_subnormal)  # 2^-149

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
names = st.text(min_size=0, max_size=12)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)
tensor_dicts = st.dictionaries(
    names, hnp.arrays(np.float32, shapes, elements=finite_f32), max_size=6
)
block_sizes = st.sampled_from([16, 32, 256])


def decode(payload: object, description: Description | dict, **kwargs: object) -> dict:
    """``api.decode_tensors``; a description in its wire form (a map, possibly hostile) is
    parsed first, as the wire envelope parses it."""
    if not isinstance(description, Description):
        description = Description.parse(description)
    return api.decode_tensors(payload, description, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- reference bounds


def _blocks(x: np.ndarray, block_size: int) -> np.ndarray:
    """``x`` flattened to float64, zero-padded and cut into rows of ``block_size``."""
    flat = np.asarray(x, np.float64).reshape(-1)
    padded = np.zeros(-(-flat.size // block_size) * block_size)
    padded[: flat.size] = flat
    return padded.reshape(-1, block_size)


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _rounds_to_inf_in_bf16(x: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        return not np.isfinite(_bf16(x)).all()


def assert_within_bound(codec: str, x: np.ndarray, y: np.ndarray, block_size: int) -> None:
    """The per-codec error bound of the module docstring, with float32 arithmetic slack."""
    x = np.asarray(x, np.float32)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.isfinite(y).all()
    if codec == "fp32":
        np.testing.assert_array_equal(y, x)
        return
    if codec == "bf16":
        # Bit for bit what ml_dtypes does, so within half a bf16 ulp: 2^-8 relative, or
        # half the bf16 subnormal spacing (2^-134) below the normal range.
        np.testing.assert_array_equal(y, _bf16(x))
        err = np.abs(x.astype(np.float64) - y)
        assert np.all(err <= 2.0**-8 * np.abs(x.astype(np.float64)) + 2.0**-134)
        return
    xb, yb = _blocks(x, block_size), _blocks(y, block_size)
    err = np.abs(xb - yb)
    absmax = np.abs(xb).max(axis=1, keepdims=True)
    if codec in ("int8", "int4"):
        # Round to nearest with scale = absmax / qmax: |err| <= absmax / (2 qmax), plus a few
        # float32 ulps of absmax (x / scale is rounded before it is rounded to a code) and
        # one subnormal ulp where the scale is subnormal.
        bound = absmax / (254 if codec == "int8" else 14) + absmax * 2.0**-21 + TINY
        assert np.all(err <= bound), float(np.max(err - bound))
    else:  # int2: a contraction on every non-zero block, exact on zero blocks
        err_norm = np.linalg.norm(err, axis=1)
        x_norm = np.linalg.norm(xb, axis=1)
        zero = x_norm == 0
        assert np.all(err_norm[zero] == 0)
        assert np.all(err_norm[~zero] < x_norm[~zero]), (err_norm, x_norm)


def _round_trip(codec: str, tensors: dict, block_size: int = 256) -> dict[str, np.ndarray]:
    payload, description = encode_tensors(tensors, codec, block_size=block_size)
    return decode(payload, description)


def _signed(payload: bytes, description: dict) -> dict:
    """``description`` with the checksums of ``payload`` cut as its ``frames`` say: what a
    sender that knows the format sends, so that the checks behind the checksum are reached."""
    out = copy.deepcopy(description)
    frames = out["frames"]
    if isinstance(frames, list | tuple) and all(type(f) is int and f > 0 for f in frames):
        cuts = pairwise(accumulate(frames, initial=0))
        out["checksums"] = [xxhash.xxh3_64_intdigest(bytes(payload)[a:b]) for a, b in cuts]
    return out


def _corruptible(codec: str = "int8") -> tuple[bytes, dict]:
    """A small payload, as ``bytes`` so that tests can cut and splice it."""
    rng = np.random.default_rng(1)
    tensors = {"a": rng.standard_normal((7, 9)).astype(np.float32), "b": np.arange(5.0)}
    payload, description = encode_tensors(tensors, codec, block_size=16)
    return bytes(payload), description.to_wire()


# --------------------------------------------------------------------------- round trips


@SETTINGS
@given(st.sampled_from(CODECS), tensor_dicts, block_sizes)
def test_round_trip_within_error_bound(codec: str, tensors: dict, block_size: int) -> None:
    if codec == "bf16" and any(_rounds_to_inf_in_bf16(a) for a in tensors.values()):
        with pytest.raises(CodecError, match="round to Inf"):
            encode_tensors(tensors, codec, block_size=block_size)
        return
    out = _round_trip(codec, tensors, block_size)
    assert list(out) == sorted(tensors)
    for name, arr in tensors.items():
        assert_within_bound(codec, arr, out[name], block_size)


@SETTINGS
@given(
    st.sampled_from(LOSSY),
    st.integers(0, 2**32 - 1),
    st.integers(1, 5000),
    st.integers(-140, 120),
    st.sampled_from([16, 256, 4096]),
)
def test_error_bound_on_scaled_gaussian(
    codec: str, seed: int, size: int, exponent: int, block_size: int
) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(size) * 2.0**exponent).astype(np.float32)
    x[rng.random(size) < 0.1] = 0  # some exact zeros, sometimes whole zero blocks
    out = _round_trip(codec, {"x": x}, block_size)
    assert_within_bound(codec, x, out["x"], block_size)


REL_L2 = {"bf16": 0.003, "int8": 0.01, "int4": 0.15, "int2": 0.5}


@pytest.mark.parametrize(
    ("codec", "block_size"),
    [("bf16", 256)] + [(c, b) for c in BLOCK_CODECS for b in (16, 256, 4096)],
)
def test_relative_l2_error_on_gaussian(codec: str, block_size: int) -> None:
    x = np.random.default_rng(0).standard_normal(1_000_003).astype(np.float32) * 3e-3
    y = _round_trip(codec, {"g": x}, block_size)["g"]
    rel = np.linalg.norm(y - x) / np.linalg.norm(x)
    # int4 at 4096: absmax of 4096 Gaussians is ~3.9 sigma, so the rounding error
    # step / sqrt(12) with step = absmax / 7 is ~0.16 sigma; 0.15 is out of reach.
    limit = 0.17 if (codec, block_size) == ("int4", 4096) else REL_L2[codec]
    assert rel < limit
    assert_within_bound(codec, x, y, block_size)


def test_bf16_matches_ml_dtypes_on_special_values() -> None:
    bf16_max = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    one = np.float32(1)
    x = np.array(
        [
            0.0, -0.0, 1.0, -1.0, bf16_max, -bf16_max, TINY, -TINY, 3 * TINY,
            2.0**-126, 2.0**-133, 3 * 2.0**-134,  # subnormal ties
            one + 2.0**-8, one + 3 * 2.0**-8, one + 2.0**-8 + 2.0**-23,  # ties and near-ties
            np.nextafter(np.float32(bf16_max), np.float32(np.inf)),  # rounds back to max
        ],
        np.float32,
    )  # fmt: skip
    out = _round_trip("bf16", {"x": x})["x"]
    assert_within_bound("bf16", x, out, 256)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(x))


# The smallest float32 that rounds to Inf in bfloat16: half an ulp above its maximum.
BF16_INF_EDGE = float(np.array(0x7F7F8000, np.uint32).view(np.float32))


@pytest.mark.parametrize("value", [F32_MAX, -F32_MAX, BF16_INF_EDGE, -BF16_INF_EDGE])
def test_bf16_rejects_values_that_round_to_inf(value: float) -> None:
    with pytest.raises(CodecError, match="'x' has values .* round to Inf"):
        encode_tensors({"x": np.array([1.0, value], np.float32)}, "bf16")


@pytest.mark.parametrize("codec", CODECS)
def test_zero_empty_scalar_and_odd_sized_tensors(codec: str) -> None:
    rng = np.random.default_rng(2)
    tensors = {
        "zeros": np.zeros((3, 300), np.float32),
        "empty": np.zeros((0, 5), np.float32),
        "empty1d": np.zeros(0, np.float32),
        "empty3d": np.zeros((4, 0, 7), np.float32),
        "scalar": np.float32(-2.5),
        "odd": rng.standard_normal(257).astype(np.float32),
        "f64": rng.standard_normal((2, 3)),  # converted to float32
        "int": np.arange(6, dtype=np.int32).reshape(2, 3),
        "fortran": np.asfortranarray(rng.standard_normal((5, 7)).astype(np.float32)),
        "strided": rng.standard_normal(100).astype(np.float32)[::-3],
    }
    out = _round_trip(codec, tensors, 16)
    assert list(out) == sorted(tensors)
    for name, arr in tensors.items():
        arr = np.asarray(arr, np.float32)
        assert_within_bound(codec, arr, out[name], 16)
        if name in ("zeros", "empty", "empty1d", "empty3d"):
            np.testing.assert_array_equal(out[name], arr)
        assert out[name].flags.writeable


@pytest.mark.parametrize("codec", CODECS)
def test_no_tensors(codec: str) -> None:
    payload, description = encode_tensors({}, codec)
    assert payload == b""
    assert description.raw_size == 0 and description.tensors == []
    assert description.frames == () and description.checksums == ()
    assert decode(payload, description) == {}


def test_description_is_plain_and_self_describing() -> None:
    rng = np.random.default_rng(0)
    tensors = {"layer/w": rng.standard_normal((2, 3)), "layer/b": rng.standard_normal(3)}
    payload, encoded = encode_tensors(tensors, "int4", 256, 3)
    description = encoded.to_wire()
    assert Description.parse(description) == encoded
    frames = description.pop("frames")
    checksums = description.pop("checksums")
    assert description == {
        "version": FORMAT_VERSION,
        "codec": "int4",
        "bits": 4,
        "block_size": 256,
        "segment": 2,  # one frame of both tensors' blocks
        "zstd_level": 3,
        "raw_size": 2 * (4 + 128),
        "tensors": [["layer/b", [3], "float32"], ["layer/w", [2, 3], "float32"]],
    }
    assert isinstance(payload, memoryview) and payload.readonly and payload.c_contiguous
    assert len(frames) == 1 and frames == [len(payload)]
    assert checksums == [xxhash.xxh3_64_intdigest(payload)]
    assert zstandard.ZstdDecompressor().decompress(bytes(payload))  # a standard zstd frame


@pytest.mark.parametrize("codec", CODECS)
def test_description_survives_msgpack(codec: str) -> None:
    rng = np.random.default_rng(3)
    tensors = {"b": rng.standard_normal(3), "a": rng.standard_normal(2 * SEGMENT_ELEMENTS)}
    payload, description = encode_tensors(tensors, codec, block_size=16)
    assert len(description.frames) > 1
    packed = msgpack.packb(description.to_wire())
    unpacked = msgpack.unpackb(packed)
    assert unpacked == description.to_wire()
    direct = decode(payload, description)
    via_msgpack = decode(payload, unpacked)
    for name in tensors:
        np.testing.assert_array_equal(direct[name], via_msgpack[name])


@pytest.mark.parametrize("codec", BLOCK_CODECS)
def test_blocks_never_mix_tensors(codec: str) -> None:
    # A tiny tensor next to a huge one keeps its own precision.
    tensors = {"a": np.full(3, 1e6, np.float32), "b": np.array([1e-3, -2e-3], np.float32)}
    out = _round_trip(codec, tensors, 256)
    assert_within_bound(codec, tensors["b"], out["b"], 256)
    assert np.all(out["b"] != 0)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("codec", CODECS)
def test_extreme_magnitudes_stay_finite_and_bounded(codec: str, block_size: int) -> None:
    big = F32_MAX if codec != "bf16" else float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    x = np.array([big, -big, 1.0, TINY, 3 * TINY, -2 * TINY, 0.0, 5 * TINY], np.float32)
    x = np.concatenate([x, np.full(40, big, np.float32), np.full(40, 3 * TINY, np.float32)])
    y = _round_trip(codec, {"x": x}, block_size)["x"]
    assert_within_bound(codec, x, y, block_size)


def test_segments_split_tensors_and_blocks_into_frames() -> None:
    # Tensors straddle segment boundaries; each frame is one segment.
    rng = np.random.default_rng(4)
    tensors = {
        "a": rng.standard_normal(SEGMENT_ELEMENTS - 5).astype(np.float32),
        "b": rng.standard_normal(SEGMENT_ELEMENTS + 77).astype(np.float32),
        "c": np.float32(4.0),
    }
    for codec, block_size in [("fp32", 16), ("bf16", 16), ("int4", 16), ("int8", 1 << 20)]:
        payload, description = encode_tensors(tensors, codec, block_size=block_size)
        unit = block_size if codec in BLOCK_CODECS else 1
        units = sum(-(-np.size(a) // unit) for a in tensors.values())
        # Frames of one size, the nearest whole number of nominal segments (here 2).
        segment = description.segment
        assert segment == -(-units // max(1, round(units * unit / SEGMENT_ELEMENTS)))
        assert 2 / 3 <= segment * unit / SEGMENT_ELEMENTS <= 3 / 2
        assert len(description.frames) == -(-units // segment)
        assert sum(description.frames) == len(payload)
        out = decode(payload, description)
        for name, arr in tensors.items():
            assert_within_bound(codec, arr, out[name], block_size)


def test_codec_workers_outlive_a_payload() -> None:
    """The worker threads (with their scratch buffers and zstd contexts) serve every payload
    of the process, not one each: five runs on two threads see at most two threads (Linux
    numbers every new thread afresh)."""

    def worker(_: int) -> int:
        return threading.get_native_id()

    seen = set()
    for _ in range(5):
        seen |= set(segments.run(worker, list(range(64)), 2))
    assert threading.get_native_id() not in seen
    assert 1 <= len(seen) <= 2, seen


@pytest.mark.parametrize("layout", ["contiguous", "read-only", "strided", "float64"])
def test_sum_of_squares_is_the_float64_sum(layout: str) -> None:
    x = np.random.default_rng(3).laplace(0, 0.01, 100_003).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64) ** 2))
    if layout == "read-only":
        x.setflags(write=False)
    elif layout == "strided":
        x = x[::3]
        exact = float(np.sum(x.astype(np.float64) ** 2))
    elif layout == "float64":
        x = x.astype(np.float64)  # taken as float32, as the outer's pieces are
    assert api.sum_of_squares(x) == pytest.approx(exact, rel=1e-12)
    assert api.sum_of_squares(np.zeros((0, 4), np.float32)) == 0.0


def test_large_payload_on_threads() -> None:
    """Threaded encode is byte-identical, threaded decode equal, above THREADS_MIN_BYTES."""
    x = np.random.default_rng(5).standard_normal(THREADS_MIN_BYTES // 4 + SEGMENT_ELEMENTS)
    tensors = {"x": x.astype(np.float32), "y": np.ones(3, np.float32)}
    payload, description = encode_tensors(tensors, "fp32")
    assert description.raw_size >= THREADS_MIN_BYTES and len(description.frames) > 2
    threaded, threaded_description, _ = encode(tensors, CodecConfig("fp32", threads=2))
    assert threaded == payload and threaded_description == description
    for threads in (2, -1):
        out = decode(payload, description, threads=threads)
        np.testing.assert_array_equal(out["x"], tensors["x"])
        np.testing.assert_array_equal(out["y"], tensors["y"])
    # A corrupt frame in the middle is still a CodecError from a worker thread.
    frames = description.frames
    corrupt = bytearray(payload)
    corrupt[frames[0] + frames[1] // 2] ^= 0xFF
    with pytest.raises(CodecError):
        decode(bytes(corrupt), description, threads=2)


# --------------------------------------------------------------------------- flat buffers


def _flat(tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    layout = Layout({name: np.shape(a) for name, a in tensors.items()})
    values = np.empty(layout.size, np.float32)
    for name, view in layout.views(values).items():
        view[...] = tensors[name]
    return values, layout


@SETTINGS
@given(tensor_dicts, st.sampled_from(CODECS), block_sizes, st.booleans())
def test_encode_flat_is_encode_of_the_views(
    tensors: dict, codec: str, block_size: int, feedback: bool
) -> None:
    values, layout = _flat(tensors)
    config = CodecConfig(codec, block_size, error_feedback=feedback and codec != "fp32")
    shapes = {name: np.shape(a) for name, a in tensors.items()}
    states = [init_state(config, shapes) for _ in range(2)]
    for _ in range(2):  # twice: the second round uses the residuals of the first
        try:
            a, da, states[0] = encode(layout.views(values), config, states[0])
        except CodecError as err:  # values that round to Inf, or overflow with the residual
            with pytest.raises(CodecError, match=re.escape(str(err))):
                encode_flat(values, layout, config, states[1])
            return
        b, db, states[1] = encode_flat(values, layout, config, states[1])
        assert bytes(a) == bytes(b) and da == db
        for name in states[0].residual:
            np.testing.assert_array_equal(states[0].residual[name], states[1].residual[name])
    out = decode(b, db)
    expected = dict(zip(layout.names, layout.shapes, strict=True))
    assert {n: o.shape for n, o in out.items()} == expected


def test_layout_is_sorted_immutable_and_hashable() -> None:
    layout = Layout({"b": (2, 3), "a": [4], "c": ()})
    assert layout.names == ("a", "b", "c") and layout.shapes == ((4,), (2, 3), ())
    assert layout.sizes == (4, 6, 1) and layout.offsets == (0, 4, 10) and layout.size == 11
    same = Layout({"a": (np.int64(4),), "b": (2, 3), "c": []})
    assert same == layout and hash(same) == hash(layout) and same is not layout
    assert Layout({"a": (4,), "b": (3, 2), "c": ()}) != layout
    with pytest.raises(AttributeError):
        layout.size = 3  # type: ignore[misc]
    views = layout.views(np.arange(11, dtype=np.float32))
    assert views["b"].shape == (2, 3) and views["b"][0, 0] == 4 and views["c"] == 10
    for bad, match in [
        ({1: (2,)}, "names must be str"),
        ({"a": (-1,)}, "non-negative ints"),
        ({"a": (2.0,)}, "non-negative ints"),
        ({"a": (True,)}, "non-negative ints"),
        ({"a": 3}, "non-negative ints"),
        ([("a", (1,))], "mapping"),
    ]:
        with pytest.raises(CodecError, match=match):
            Layout(bad)  # type: ignore[arg-type]


def test_encode_flat_rejects_other_buffers_and_non_finite_values() -> None:
    values, layout = _flat({"a": np.ones((3, 4)), "b": np.ones(5)})
    config = CodecConfig("int8")
    for bad in (
        values[:-1],
        values.astype(np.float64),
        values.reshape(1, -1),
        np.concatenate([values, values])[::2],
        list(values),
    ):
        with pytest.raises(CodecError, match="contiguous 1-D float32 array of the layout's 17"):
            encode_flat(bad, layout, config)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="codec.Layout"):
        encode_flat(values, {"a": (3, 4), "b": (5,)}, config)  # type: ignore[arg-type]
    values[13] = np.nan
    for codec in CODECS:
        with pytest.raises(CodecError, match="tensor 'b' contains 1 NaN/Inf"):
            encode_flat(values, layout, CodecConfig(codec))


def test_threaded_error_feedback_encode_is_identical() -> None:
    x = np.random.default_rng(6).standard_normal(7_000_000).astype(np.float32)
    results = []
    for threads in (0, 2):
        config = CodecConfig("int8", block_size=16, threads=threads, error_feedback=True)
        state = init_state(config, {"x": x.shape})
        payload, description, state = encode({"x": x}, config, state)
        assert description.raw_size >= THREADS_MIN_BYTES
        results.append((payload, description, state.residual["x"]))
    (p0, d0, r0), (p2, d2, r2) = results
    assert p0 == p2 and d0 == d2
    np.testing.assert_array_equal(r0, r2)
    y = decode(p2, d2, threads=2)["x"]
    np.testing.assert_allclose(y + r2, x, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- error feedback


def _accumulate(codec: str, error_feedback: bool, rounds: int = 100) -> tuple[dict, float, dict]:
    """Encode ``rounds`` fresh Gaussian pseudo-gradients; accumulated error norm by round."""
    shapes = {"w": (64, 50), "b": (7,)}
    init, encode_fn, decode_fn = make_codec(CodecConfig(codec, error_feedback=error_feedback))
    state = init(shapes)
    rng = np.random.default_rng(7)
    decoded = {n: np.zeros(s) for n, s in shapes.items()}
    true = {n: np.zeros(s) for n, s in shapes.items()}
    norms: dict[int, float] = {}
    single = 0.0
    for r in range(1, rounds + 1):
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        payload, description, state = encode_fn(grads, state)
        out = decode_fn(payload, description)
        for n in shapes:
            decoded[n] += out[n]
            true[n] += grads[n]
        if r == 1:
            single = math.sqrt(sum(np.sum((out[n] - grads[n].astype(float)) ** 2) for n in shapes))
        norms[r] = math.sqrt(sum(np.sum((decoded[n] - true[n]) ** 2) for n in shapes))
    residual = state.residual
    return norms, single, {n: (decoded[n] - true[n], residual.get(n)) for n in shapes}


@pytest.mark.parametrize("codec", ["int2", "int4", "bf16"])
def test_error_feedback_keeps_the_accumulated_error_bounded(codec: str) -> None:
    norms, single, errors = _accumulate(codec, error_feedback=True)
    # What was sent adds up to what was given minus what is still owed.
    for error, residual in errors.values():
        np.testing.assert_allclose(error, -residual, rtol=0, atol=1e-4)
    assert single > 0
    assert norms[100] <= 2 * norms[10]
    assert norms[100] <= 3 * single

    norms, single, errors = _accumulate(codec, error_feedback=False)
    assert all(residual is None for _, residual in errors.values())
    # Independent errors: the accumulated error grows like sqrt(rounds).
    assert norms[100] > 2 * norms[10]
    assert norms[100] > 5 * single


def test_error_feedback_state_is_consumed() -> None:
    config = CodecConfig("int4", error_feedback=True)
    state = init_state(config, {"x": (40,)})
    x = {"x": np.linspace(-1, 1, 40, dtype=np.float32)}
    _, _, new_state = encode(x, config, state)
    assert state.consumed and not new_state.consumed
    with pytest.raises(CodecError, match="already used"):
        encode(x, config, state)
    encode(x, config, new_state)
    with pytest.raises(CodecError, match="already used"):
        encode(x, config, new_state)


def test_error_feedback_failed_encode_consumes_the_state() -> None:
    config = CodecConfig("int2", error_feedback=True)
    state = init_state(config, {"x": (40,)})
    bad = np.ones(40, np.float32)
    bad[20] = np.nan
    with pytest.raises(CodecError, match="NaN/Inf"):
        encode({"x": bad}, config, state)
    with pytest.raises(CodecError, match="already used"):
        encode({"x": np.ones(40, np.float32)}, config, state)


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_error_feedback_overflow_is_rejected(codec: str) -> None:
    config = CodecConfig(codec, error_feedback=True)
    state = init_state(config, {"x": (3,)})
    state.residual["x"][:] = 3e38
    with pytest.raises(CodecError, match="'x' plus its error-feedback residual overflows"):
        encode({"x": np.full(3, 3e38, np.float32)}, config, state)


@pytest.mark.parametrize(
    ("residual", "match"),
    [
        ({}, "has none for tensor 'x'"),
        ({"x": np.zeros(5, np.float32)}, r"float32\[5\] for tensor 'x' of shape \[2, 3\]"),
        ({"x": np.zeros((3, 2), np.float32)}, r"float32\[3, 2\]"),
        ({"x": np.zeros((2, 3))}, r"float64\[2, 3\]"),
        ({"x": [[0.0] * 3] * 2}, "has list"),
    ],
)
def test_error_feedback_state_must_match_the_tensors(residual: dict, match: str) -> None:
    config = CodecConfig("int4", error_feedback=True)
    with pytest.raises(CodecError, match=match):
        encode({"x": np.ones((2, 3))}, config, CodecState(residual))


def test_error_feedback_needs_a_state_and_plain_codecs_ignore_it() -> None:
    with pytest.raises(CodecError, match="needs the state"):
        encode({"x": np.ones(3)}, CodecConfig("int4", error_feedback=True))
    config = CodecConfig("int4")
    assert init_state(config, {"x": (3,)}).residual == {}
    stale = CodecState({"x": np.zeros(3, np.float32)}, consumed=True)
    payload, description, state = encode({"x": np.ones(3)}, config, stale)
    assert state.residual == {} and decode(payload, description)["x"].shape == (3,)


def test_error_feedback_on_a_subset_of_the_tensors() -> None:
    """Fragments send subsets; the residuals of the other tensors are kept as they are."""
    config = CodecConfig("int2", error_feedback=True)
    rng = np.random.default_rng(8)
    grads = {"a": rng.standard_normal(100).astype(np.float32), "b": np.ones((3, 3), np.float32)}
    state = init_state(config, {n: g.shape for n, g in grads.items()})
    payload, description, state = encode({"a": grads["a"]}, config, state)
    out = decode(payload, description)
    assert list(out) == ["a"]
    np.testing.assert_allclose(out["a"] + state.residual["a"], grads["a"], atol=1e-5)
    np.testing.assert_array_equal(state.residual["b"], 0)
    owed_a = state.residual["a"].copy()
    payload, description, state = encode({"b": grads["b"]}, config, state)
    np.testing.assert_array_equal(state.residual["a"], owed_a)
    payload, description, state = encode(grads, config, state)
    out = decode(payload, description)
    np.testing.assert_allclose(out["a"] + state.residual["a"], grads["a"] + owed_a, atol=1e-5)


def test_extend_state_adds_zero_residuals_for_new_tensors_only() -> None:
    config = CodecConfig("int4", error_feedback=True)
    state = init_state(config, {"a": (4,)})
    _, _, state = encode({"a": np.arange(4.0) + 0.3}, config, state)
    owed = state.residual["a"]
    assert owed.any()
    extended = extend_state(config, state, {"a": (4,), "b": (2, 2)})
    assert extended is state and state.residual["a"] is owed
    assert state.residual["b"].shape == (2, 2) and not state.residual["b"].any()
    _, _, state = encode({"b": np.ones((2, 2))}, config, state)
    assert extend_state(CodecConfig("int4"), CodecState(), {"a": (4,)}).residual == {}


def test_error_feedback_residual_can_be_checkpointed() -> None:
    """A restored residual (copied, Fortran-ordered, read-only) gives the same next round."""
    config = CodecConfig("int4", block_size=16, error_feedback=True)
    rng = np.random.default_rng(9)
    shapes = {"w": (6, 10)}
    state = init_state(config, shapes)
    _, _, state = encode({"w": rng.standard_normal((6, 10))}, config, state)
    grads = {"w": rng.standard_normal((6, 10)).astype(np.float32)}
    saved = state.residual["w"].copy()
    expected_payload, _, expected = encode(grads, config, state)
    restorations = [
        saved.copy(),
        np.asfortranarray(saved),
        np.frombuffer(saved.tobytes(), np.float32).reshape(6, 10),  # read-only
    ]
    for restored in restorations:
        payload, _, next_state = encode(grads, config, CodecState({"w": restored}))
        assert payload == expected_payload
        np.testing.assert_array_equal(next_state.residual["w"], expected.residual["w"])


def test_make_codec_binds_the_config() -> None:
    config = CodecConfig("int8", block_size=32, zstd_level=5, error_feedback=True)
    codec = make_codec(config, max_raw_size=1000)
    state = codec.init({"x": (2, 16)})
    assert state.residual["x"].shape == (2, 16) and state.residual["x"].dtype == np.float32
    x = {"x": np.arange(32, dtype=np.float32).reshape(2, 16)}
    payload, description, state = codec.encode(x, state)
    assert description.block_size == 32 and description.zstd_level == 5
    np.testing.assert_allclose(codec.decode(payload, description)["x"], x["x"], atol=31 / 254)
    big, big_description = encode_tensors({"x": np.ones(1000)}, "fp32")
    with pytest.raises(CodecError, match="exceeds the limit of 1000"):
        codec.decode(big, big_description)


# --------------------------------------------------------------------------- encode errors


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("position", [0, 15, 16, 255, 256, 299])
def test_encode_rejects_non_finite(codec: str, bad: float, position: int) -> None:
    x = np.ones(300, np.float32)
    x[position] = bad
    with pytest.raises(CodecError, match=r"'bad' contains 1 NaN/Inf"):
        encode_tensors({"ok": np.ones(3), "bad": x}, codec, block_size=16)


def test_encode_rejects_float64_overflow() -> None:
    with pytest.raises(CodecError, match="NaN/Inf"):
        encode_tensors({"x": np.array([1e300])}, "int8")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"codec": "int3"}, "unknown codec"),
        ({"codec": None}, "unknown codec"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 8}, "block_size"),
        ({"block_size": 24}, "block_size"),
        ({"block_size": 17}, "block_size"),
        ({"block_size": (1 << 20) + 16}, "block_size"),
        ({"block_size": "256"}, "block_size"),
        ({"block_size": 256.0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"zstd_level": 99}, "zstd_level"),
        ({"zstd_level": -(1 << 17) - 1}, "zstd_level"),
        ({"zstd_level": 1.0}, "zstd_level"),
        ({"threads": -2}, "threads"),
        ({"threads": 1.5}, "threads"),
        ({"threads": True}, "threads"),
        ({"error_feedback": 1}, "error_feedback must be a bool"),
        ({"codec": "fp32", "error_feedback": True}, "lossy codec"),
    ],
)
def test_config_rejects_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        CodecConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"codec": "int3"}, {"block_size": 8}, {"zstd_level": 99}, {"block_size": "16"}]
)
def test_encode_tensors_rejects_bad_options(kwargs: dict) -> None:
    with pytest.raises(CodecError):
        encode_tensors({"x": np.ones(3)}, **{"codec": "int8", **kwargs})


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({1: np.ones(3)}, "names must be str"),
        ({"c": np.ones(3, np.complex64)}, "non-real dtype complex64"),
        ({"s": np.array(["a"])}, "non-real dtype"),
        ({"b": [True]}, "non-real dtype bool"),
        ({"b": np.ones(3, bool)}, "non-real dtype bool"),
        ({"o": None}, "non-real dtype object"),
        ({"t": np.array(["2020-01-01"], "datetime64[D]")}, "non-real dtype"),
        ({"r": [[1.0, 2.0], [3.0]]}, "'r' is not an array"),
        ([("a", np.ones(3))], "must be a mapping"),
    ],
)
def test_encode_rejects_bad_tensors(tensors: object, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode_tensors(tensors, "int8")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype",
    [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.int8, np.int64, np.uint8,
     np.uint64],
)  # fmt: skip
def test_encode_accepts_real_dtypes(dtype: type) -> None:
    x = np.array([[0, 1, 2], [3, 100, 7]]).astype(dtype)
    out = _round_trip("fp32", {"x": x, "scalar": dtype(5), "list": [1, 2.5]})
    np.testing.assert_array_equal(out["x"], x.astype(np.float32))
    assert out["scalar"].shape == () and out["scalar"] == 5
    np.testing.assert_array_equal(out["list"], [1, 2.5])


def test_zstd_level_is_used() -> None:
    x = {"x": np.tile(np.arange(1000, dtype=np.float32), 50)}
    fast, _ = encode_tensors(x, "fp32", zstd_level=-50)
    strong, description = encode_tensors(x, "fp32", zstd_level=19)
    assert len(strong) < len(fast)
    assert description.zstd_level == 19


# --------------------------------------------------------------------------- decode errors


@pytest.mark.parametrize("codec", CODECS)
def test_corrupted_payload_byte_is_detected(codec: str) -> None:
    payload, description = _corruptible(codec)
    for position in range(len(payload)):
        corrupted = bytearray(payload)
        corrupted[position] ^= 0x01
        with pytest.raises(CodecError):
            decode(bytes(corrupted), description)


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_or_extended_payload_is_rejected(codec: str) -> None:
    payload, description = _corruptible(codec)
    for end in range(len(payload)):
        with pytest.raises(CodecError, match="payload has"):
            decode(payload[:end], description)
        # Truncated, but described as such: the frame itself is cut short.
        with pytest.raises(CodecError):
            decode(payload[:end], _with(description, frames=[end or 1]))
    with pytest.raises(CodecError, match="payload has"):
        decode(payload + b"\0", description)
    extended = _with(description, frames=[len(payload) + 1])
    with pytest.raises(CodecError, match="checksum"):
        decode(payload + b"\0", extended)
    with pytest.raises(CodecError, match="decompress"):
        decode(payload + b"\0", _signed(payload + b"\0", extended))
    doubled = _with(description, frames=[2 * len(payload)])
    with pytest.raises(CodecError, match="decompress"):
        decode(payload + payload, _signed(payload + payload, doubled))


def test_empty_payload_with_trailing_garbage_is_rejected() -> None:
    payload, description = encode_tensors({}, "int8")
    with pytest.raises(CodecError, match="payload has 4 bytes"):
        decode(bytes(payload) + b"junk", description)


def test_frame_with_a_second_frame_appended_is_rejected() -> None:
    """One described frame must be exactly one zstd frame, not a valid one plus more."""
    payload, description = _corruptible()
    extra = zstandard.ZstdCompressor(write_checksum=True).compress(b"")
    frames = description["frames"]
    appended = _with(description, frames=[frames[0] + len(extra)])
    with pytest.raises(CodecError, match="follow the zstd frame"):
        decode(payload + extra, _signed(payload + extra, appended))


def _with(description: dict, **changes: object) -> dict:
    out = copy.deepcopy(description)
    out.update(changes)
    return out


def _two_frames() -> tuple[bytes, dict]:
    x = np.random.default_rng(10).standard_normal(SEGMENT_ELEMENTS + 100).astype(np.float32)
    payload, description = encode_tensors({"x": x}, "int8", block_size=SEGMENT_ELEMENTS // 2)
    assert len(description.frames) == 2
    return payload, description.to_wire()


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ("all", "frames must list"),
        ("none", "frames must list"),
        ("dict", "frames must list"),
        ("one", "frames must list the compressed size of each of the 2 frame"),
        ("three", "frames must list"),
        ("zero", "positive ints"),
        ("negative", "positive ints"),
        ("float", "positive ints"),
        ("str", "positive ints"),
        ("bool", "positive ints"),
        ("shifted", "zstd|decompress|declares"),
        ("sum", "payload has"),
    ],
)
def test_wrong_frames_list_is_rejected(frames: str, match: str) -> None:
    payload, description = _two_frames()
    a, b = description["frames"]
    frames = {
        "all": len(payload),
        "none": None,
        "dict": {"0": a, "1": b},
        "one": [len(payload)],
        "three": [a, b - 1, 1],
        "zero": [len(payload), 0],
        "negative": [len(payload) + 1, -1],
        "float": [float(a), b],
        "str": [str(a), b],
        "bool": [True, len(payload) - 1],
        "shifted": [a + 1, b - 1],
        "sum": [a, b + 1],
    }[frames]
    with pytest.raises(CodecError, match=match):
        decode(payload, _signed(payload, _with(description, frames=frames)))


def test_frames_may_be_numpy_ints_or_a_tuple() -> None:
    payload, description = _two_frames()
    frames = tuple(np.int64(f) for f in description["frames"])
    out = decode(payload, _with(description, frames=frames))
    assert out["x"].shape == (SEGMENT_ELEMENTS + 100,)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"version": 0}, "version 0 is not 1"),
        ({"version": 2}, "version 2 is not 1"),
        ({"version": "1"}, "version '1' is not 1"),
        ({"version": True}, "version True is not 1"),
        ({"version": 1.0}, "version 1.0 is not 1"),
        ({"version": None}, "version None"),
        ({"codec": "int3"}, "unknown codec 'int3'"),
        ({"codec": None}, "unknown codec"),
        ({"codec": ["int8"]}, "unknown codec"),
        ({"codec": "int4"}, "'int4' has 4 bits, description says 8"),
        ({"bits": 4}, "'int8' has 8 bits, description says 4"),
        ({"bits": "8"}, "bits"),
        ({"bits": 8.0}, "bits"),
        ({"bits": True}, "bits"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 8}, "block_size"),
        ({"block_size": 2**40}, "block_size"),
        ({"block_size": 16.0}, "block_size"),
        ({"block_size": 32}, r"raw_size .* needs \d+ bytes"),
        ({"segment": 0}, "segment"),
        ({"segment": -1}, "segment"),
        ({"segment": 2**27}, "segment"),
        ({"segment": 1.5}, "segment"),
        ({"segment": True}, "segment"),
        ({"segment": 1}, "frames must list the compressed size of each of the 5 frame"),
        ({"zstd_level": "fast"}, "zstd_level"),
        ({"zstd_level": 10**6}, "zstd_level"),
        ({"raw_size": -1}, "raw_size"),
        ({"raw_size": 1.5}, "raw_size"),
        ({"raw_size": True}, "raw_size"),
        ({"raw_size": "120"}, "raw_size"),
        ({"raw_size": 12}, r"raw_size 12 does not match .* needs \d+ bytes"),
        ({"raw_size": 2**100}, "exceeds the limit"),
        ({"checksums": None}, "checksums must list the XXH3-64 of each of the 1 frame"),
        ({"checksums": []}, "checksums must list"),
        ({"checksums": [1, 2]}, "checksums must list"),
        ({"checksums": [-1]}, "unsigned 64-bit ints"),
        ({"checksums": [2**64]}, "unsigned 64-bit ints"),
        ({"checksums": [1.0]}, "unsigned 64-bit ints"),
        ({"checksums": [True]}, "unsigned 64-bit ints"),
        ({"checksums": ["1"]}, "unsigned 64-bit ints"),
        ({"checksums": [0]}, "frame 0 does not match its XXH3-64 checksum"),
        ({"tensors": "a"}, "tensors must be a list"),
        ({"tensors": {"a": [3]}}, "tensors must be a list"),
        ({"tensors": [["a", [3], "float32"]]}, "does not match"),
        ({"tensors": [["a", [-1, 2], "float32"]]}, "non-negative"),
        ({"tensors": [["a", [2.0], "float32"]]}, "non-negative ints"),
        ({"tensors": [["a", [True], "float32"]]}, "non-negative ints"),
        ({"tensors": [["a", [3], "float64"]]}, "dtype"),
        ({"tensors": [["a", [3], None]]}, "dtype"),
        ({"tensors": [["a", 3, "float32"]]}, "shape"),
        ({"tensors": [["a", [1] * 40, "float32"]]}, "shape"),
        ({"tensors": [["a", [0, 2**62, 2**62], "float32"]]}, "too large"),
        ({"tensors": [[1, [3], "float32"]]}, "name must be str"),
        ({"tensors": [["a", [3]]]}, r"\[name, shape, dtype\]"),
        ({"tensors": ["a"]}, r"\[name, shape, dtype\]"),
        ({"tensors": [["b", [3], "float32"], ["a", [3], "float32"]]}, "sorted"),
        ({"tensors": [["a", [3], "float32"], ["a", [3], "float32"]]}, "unique"),
    ],
)
def test_bad_description_is_rejected(changes: dict, match: str) -> None:
    payload, description = _corruptible()
    with pytest.raises(CodecError, match=match):
        decode(payload, _with(description, **changes))


def test_missing_or_unknown_description_keys() -> None:
    payload, description = _corruptible()
    for key in description:
        partial = _with(description)
        del partial[key]
        with pytest.raises(CodecError, match=rf"missing \['{key}'\]"):
            decode(payload, partial)
    with pytest.raises(CodecError, match="unknown"):
        decode(payload, _with(description, extra=1))
    with pytest.raises(CodecError, match="unknown"):
        decode(payload, _with(description, **{"1": 1}))
    for not_a_mapping in (None, [], "int8", 3, [("version", 2)]):
        with pytest.raises(CodecError, match="mapping"):
            decode(payload, not_a_mapping)  # type: ignore[arg-type]


def _fp32_description(raw_size: int, shape: list[int], frames: list[bytes]) -> dict:
    return {"version": FORMAT_VERSION, "codec": "fp32", "bits": 32, "block_size": 256,
            "segment": SEGMENT_ELEMENTS, "zstd_level": 1, "raw_size": raw_size,
            "frames": [len(f) for f in frames],
            "checksums": [xxhash.xxh3_64_intdigest(f) for f in frames],
            "tensors": [["a", shape, "float32"]]}  # fmt: skip


def test_raw_size_limit_is_checked_before_decompressing() -> None:
    n = 10**12
    frames = -(-n // MAX_SEGMENT_UNITS)  # a well-formed description of 4 TB, in few frames
    huge = _with(_fp32_description(4 * n, [n], [b"x"]), segment=MAX_SEGMENT_UNITS,
                 frames=[1] * frames, checksums=[0] * frames)  # fmt: skip
    with pytest.raises(CodecError, match="exceeds the limit"):
        decode(b"not even zstd", huge)
    payload, description = _corruptible()
    with pytest.raises(CodecError, match="exceeds the limit"):
        decode(payload, description, max_raw_size=description["raw_size"] - 1)
    assert decode(payload, description, max_raw_size=description["raw_size"])


def test_output_too_large_to_allocate_is_a_codec_error() -> None:
    # int2 decodes to 16x its raw size; a raw size allowed by a careless limit can still
    # describe more output than any machine has. Either the allocation fails (CodecError)
    # or, with memory overcommit, the one-byte frames do.
    n = 1 << 42  # 16 TiB of float32 in 2^22 blocks, 2^10 to a frame
    description = {"version": FORMAT_VERSION, "codec": "int2", "bits": 2, "block_size": 1 << 20,
                   "segment": 1 << 10, "zstd_level": 1, "raw_size": (n >> 20) * (4 + (1 << 18)),
                   "frames": [1] * (1 << 12),
                   "checksums": [xxhash.xxh3_64_intdigest(b"\0")] * (1 << 12),
                   "tensors": [["a", [n], "float32"]]}  # fmt: skip
    with pytest.raises(CodecError, match="over the limit"):
        decode(b"\0" * (1 << 12), description, max_raw_size=1 << 41)
    # With the output limit lifted, the allocation or the one-byte frames fail instead.
    with pytest.raises(CodecError):
        decode(b"\0" * (1 << 12), description, max_raw_size=1 << 41,
                       max_output_bytes=1 << 50)  # fmt: skip


def test_zip_bomb_cannot_expand_past_raw_size() -> None:
    # A frame that honestly declares 64 MiB, presented with a description claiming 4 bytes.
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(CodecError, match="declares 67108864 bytes; the description implies 4"):
        decode(bomb, _fp32_description(4, [1], [bomb]))
    # The same data streamed without a content size in the frame header.
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    no_size = stream.compress(b"\0" * (1 << 20)) + stream.flush()
    with pytest.raises(CodecError, match="no content size"):
        decode(no_size, _fp32_description(4, [1], [no_size]))
    with pytest.raises(CodecError, match="not a zstd frame"):
        decode(b"\0" * 8, _fp32_description(4, [1], [b"\0" * 8]))


def test_every_frame_is_checked_against_its_checksum() -> None:
    raw = np.array([1.5], np.float32).tobytes()
    frame = _frame(raw)
    description = _fp32_description(4, [1], [frame])
    assert decode(frame, description)["a"][0] == 1.5
    for checksum in (0, description["checksums"][0] ^ 1, 2**64 - 1):
        with pytest.raises(CodecError, match="frame 0 does not match its XXH3-64 checksum"):
            decode(frame, _with(description, checksums=[checksum]))
    # Any standard zstd frame is read: with zstd's own checksum too (then checked as well).
    with_xxh64 = zstandard.ZstdCompressor(write_content_size=True, write_checksum=True)
    framed = with_xxh64.compress(raw)
    assert decode(framed, _fp32_description(4, [1], [framed]))["a"][0] == 1.5
    broken = framed[:-1] + bytes([framed[-1] ^ 0xFF])  # zstd's checksum, then re-signed
    with pytest.raises(CodecError, match="checksum"):
        decode(broken, _fp32_description(4, [1], [broken]))


def _frame(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=True, write_checksum=False).compress(raw)


def _crafted(codec: str, scales: list[float], codes: bytes, block_size: int = 16) -> tuple:
    """A hand-made one-frame payload of ``len(scales)`` blocks and its description."""
    raw = np.array(scales, np.float32).tobytes() + codes
    frame = _frame(raw)
    description = {"version": FORMAT_VERSION, "codec": codec, "bits": BITS[codec],
                   "block_size": block_size, "segment": SEGMENT_ELEMENTS // block_size,
                   "zstd_level": 1,
                   "raw_size": len(raw), "frames": [len(frame)],
                   "checksums": [xxhash.xxh3_64_intdigest(frame)],
                   "tensors": [["a", [len(scales) * block_size], "float32"]]}  # fmt: skip
    return frame, description


def _code_bytes(codec: str, blocks: int, bad: dict | None = None, fill: int | None = None) -> bytes:
    """Code bytes of 16-value blocks, each byte ``fill`` (default: +1 codes), but ``bad``
    {index: byte}."""
    if fill is None:
        fill = {"int8": 0x01, "int4": 0x11, "int2": 0x55}[codec]
    block_size = 16
    codes = bytearray([fill]) * (blocks * block_size * BITS[codec] // 8)
    for index, byte in (bad or {}).items():
        codes[index] = byte
    return bytes(codes)


def test_crafted_valid_block_payloads_decode() -> None:
    for codec in BLOCK_CODECS:
        frame, description = _crafted(codec, [0.5, 2.0], _code_bytes(codec, 2))
        out = decode(frame, description)["a"]
        np.testing.assert_array_equal(out, [0.5] * 16 + [2.0] * 16)


@pytest.mark.parametrize(
    ("codec", "index", "byte", "match"),
    [
        ("int8", 0, 0x80, r"invalid int8 code \(-128\) in block 0"),
        ("int8", 16 + 15, 0x80, r"invalid int8 code \(-128\) in block 1"),
        ("int4", 0, 0x18, r"invalid int4 code \(-8\) in block 0"),  # low nibble
        ("int4", 8 + 7, 0x81, r"invalid int4 code \(-8\) in block 1"),  # high nibble
        ("int2", 0, 0b01010110, r"invalid int2 code \(0b10\) in block 0"),
        ("int2", 1, 0b01011001, r"invalid int2 code \(0b10\) in block 0"),
        ("int2", 4 + 2, 0b01100101, r"invalid int2 code \(0b10\) in block 1"),
        ("int2", 4 + 3, 0b10010101, r"invalid int2 code \(0b10\) in block 1"),
    ],
)
def test_invalid_codes_are_rejected(codec: str, index: int, byte: int, match: str) -> None:
    frame, description = _crafted(codec, [1.0, 1.0], _code_bytes(codec, 2, bad={index: byte}))
    with pytest.raises(CodecError, match=match):
        decode(frame, description)


@pytest.mark.parametrize(
    ("codec", "scale"),
    [(c, s) for c in BLOCK_CODECS for s in (-1.0, -0.0, -TINY, np.inf, -np.inf, np.nan)]
    + [("int8", "huge"), ("int4", "huge")],  # int2 codes are at most 1: any finite scale is fine
)
def test_invalid_scales_are_rejected(codec: str, scale: float | str) -> None:
    qmax = {"int8": 127, "int4": 7, "int2": 1}[codec]
    # The largest scale whose largest code decodes to a finite value.
    largest = np.float32(F32_MAX / qmax)
    if float(largest) * qmax > F32_MAX:
        largest = np.nextafter(largest, np.float32(0))
    if scale == "huge":  # finite, but its largest code would decode to Inf
        scale = float(np.nextafter(largest, np.float32(np.inf)))
    frame, description = _crafted(codec, [1.0, scale], _code_bytes(codec, 2))
    with pytest.raises(CodecError, match="negative, non-finite or too large scale in block 1"):
        decode(frame, description)
    codes = _code_bytes(codec, 2, fill={"int8": 0x7F, "int4": 0x77, "int2": 0x55}[codec])
    frame, description = _crafted(codec, [1.0, float(largest)], codes)  # all codes +qmax
    out = decode(frame, description)["a"]
    assert np.isfinite(out).all() and out.max() == np.float32(float(largest) * qmax)


@pytest.mark.parametrize(
    ("codec", "raw"),
    [
        ("fp32", np.array([1.0, np.nan], np.float32).tobytes()),
        ("fp32", np.array([np.inf, 1.0], np.float32).tobytes()),
        ("bf16", np.array([0x3F80, 0x7F80], "<u2").tobytes()),  # 1.0, Inf
        ("bf16", np.array([0xFF80, 0x3F80], "<u2").tobytes()),  # -Inf
        ("bf16", np.array([0x7FC1, 0x3F80], "<u2").tobytes()),  # NaN
    ],
)
def test_decoded_values_are_validated(codec: str, raw: bytes) -> None:
    frame = _frame(raw)
    description = _fp32_description(len(raw), [2], [frame])
    description.update(codec=codec, bits=BITS[codec])
    with pytest.raises(CodecError, match="NaN/Inf values in frame 0"):
        decode(frame, description)


def test_payload_must_be_bytes() -> None:
    payload, description = _corruptible()
    with pytest.raises(CodecError, match="bytes"):
        decode("text", description)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="bytes"):
        decode(list(payload), description)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="contiguous"):
        decode(memoryview(payload + payload)[::2], description)
    expected = decode(payload, description)
    for view in (bytearray(payload), memoryview(payload), np.frombuffer(payload, np.uint8).data):
        out = decode(view, description)
        for name in expected:
            np.testing.assert_array_equal(out[name], expected[name])


@pytest.mark.parametrize("block_size", [16, 256])
def test_decoded_tensors_are_aligned_so_jax_uses_them_in_place(block_size: int) -> None:
    """Each piece of a block codec's output starts on a 64-byte boundary, whatever the
    allocator returned, so that the outer's JAX step reads it without a copy."""
    rng = np.random.default_rng(0)
    tensors = {
        name: rng.standard_normal(size).astype(np.float32)
        for name, size in (("a", 1000), ("b", 37), ("c", 4096))
    }
    payload, description, _ = encode(tensors, CodecConfig("int8", block_size), CodecState())
    for _ in range(4):  # allocations land on different boundaries
        out = decode(payload, description)
        for piece in out.values():
            assert piece.ctypes.data % api.ALIGNMENT == 0
        on_device = jax.device_put(out["c"])
        assert on_device.unsafe_buffer_pointer() == out["c"].ctypes.data


@pytest.mark.parametrize("threads", [-2, 1.5, "2", None, True])
def test_decode_threads_must_be_valid(threads: object) -> None:
    payload, description = _corruptible()
    with pytest.raises(CodecError, match="threads"):
        decode(payload, description, threads=threads)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- fuzzing


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzzed_payload_raises_codec_error_or_decodes_correct_shapes(data: st.DataObject) -> None:
    codec = data.draw(st.sampled_from(CODECS))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tensors = {"a": rng.standard_normal((5, 7)), "b": rng.standard_normal(40)}
    payload, encoded = encode_tensors(tensors, codec, block_size=16)
    description = encoded.to_wire()
    mutated = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(mutated) - 1))
        mutated[position] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, len(mutated)))]
        if data.draw(st.booleans()):  # and say so in the description
            description["frames"] = [len(mutated) or 1]
    if data.draw(st.booleans()):  # and sign it, so that zstd and the kernels see it
        description = _signed(bytes(mutated), description)
    try:
        out = decode(bytes(mutated), description)
    except CodecError:
        return
    for name, arr in tensors.items():
        assert out[name].shape == arr.shape and out[name].dtype == np.float32
        assert np.isfinite(out[name]).all()


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(BLOCK_CODECS), st.binary(min_size=0, max_size=64), st.data())
def test_fuzzed_raw_block_data_raises_codec_error_or_decodes_finite(
    codec: str, scale_bytes: bytes, data: st.DataObject
) -> None:
    """Well-formed frames around arbitrary scales and codes: rejected, or finite values."""
    blocks = 2
    raw_scales = (scale_bytes + b"\0" * 8)[:8]
    codes = data.draw(st.binary(min_size=blocks * 16 * BITS[codec] // 8, max_size=64))
    codes = codes[: blocks * 16 * BITS[codec] // 8]
    frame, description = _crafted(codec, [0.0] * blocks, codes)
    frame = _frame(raw_scales + codes)
    description = _signed(frame, _with(description, frames=[len(frame)]))
    try:
        out = decode(frame, description)["a"]
    except CodecError as exc:
        assert "scale" in str(exc) or "code" in str(exc)
        return
    assert out.shape == (blocks * 16,) and np.isfinite(out).all()


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)

# Per field, values that are wrong (or occasionally right) for it.
hostile_fields = {
    "version": st.sampled_from([1, 3, "2", True, 2.0, -2, 2**70]),
    "codec": st.sampled_from([*CODECS, "int3", "", None, 8]),
    "bits": st.sampled_from([2, 4, 8, 16, 32, 0, -8, "8", 8.0, True]),
    "block_size": st.integers(-64, 1 << 21) | st.sampled_from([16.0, "16", True]),
    "segment": st.integers(-2, 1 << 27) | st.sampled_from([1.0, "1", True]),
    "zstd_level": st.integers(-(1 << 18), 40) | st.sampled_from([1.0, None]),
    "raw_size": st.integers(-(2**40), 2**70) | st.sampled_from([0, 1.0, "1", True]),
    "frames": st.lists(st.integers(-5, 2**40) | st.sampled_from([1.0, "1", True]), max_size=5),
    "checksums": st.lists(st.integers(-5, 2**65) | st.sampled_from([1.0, "1", True]), max_size=5),
    "tensors": st.lists(
        st.tuples(names, st.lists(st.integers(-2, 2**63), max_size=4), st.just("float32")),
        max_size=3,
    ),
}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(CODECS), st.data())
def test_hostile_description_fields_raise_only_codec_error(codec: str, data: st.DataObject) -> None:
    payload, description = _corruptible(codec)
    for key in data.draw(st.sets(st.sampled_from(sorted(hostile_fields)), min_size=1)):
        description[key] = data.draw(hostile_fields[key])
    try:
        out = decode(payload, description, max_raw_size=1 << 20)
    except CodecError:
        return
    for name, shape, _ in description["tensors"]:
        assert out[name].shape == tuple(shape) and np.isfinite(out[name]).all()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzzed_description_raises_only_codec_error(data: st.DataObject) -> None:
    payload, description = _corruptible(data.draw(st.sampled_from(CODECS)))
    description = copy.deepcopy(description)
    key = data.draw(st.sampled_from([*description, "extra"]))
    description[key] = data.draw(json_like)
    try:
        out = decode(payload, description)
    except CodecError:
        return
    specs = [TensorSpec(n, tuple(s), d) for n, s, d in description["tensors"]]
    assert [out[s.name].shape for s in specs] == [s.shape for s in specs]


tensor_entries = st.lists(
    st.tuples(
        st.text(max_size=3) | st.sampled_from([None, 1, b"a"]),
        st.lists(st.integers(-1, 6) | st.sampled_from([2.0, True, np.int64(3), 2**61]), max_size=3)
        | st.sampled_from([None, 3, "3"]),
        st.sampled_from(["float32", "float64", None, ["float32"]]),
    ).map(list)
    | st.sampled_from([None, "a", ["a", [1]], ("a", [1], "float32"), ["a", (2,), "float32"]]),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(tensor_entries)
def test_fast_tensor_list_check_agrees_with_the_per_entry_checks(entries: list) -> None:
    """The C-level fast path accepts a subset of what the per-entry checks accept, with the
    same result, and defers everything else to them."""
    fast = description_module._parse_plain_tensors(entries)
    try:
        specs = [description_module._parse_tensor_entry(i, e) for i, e in enumerate(entries)]
        slow = (
            [s.name for s in specs],
            [s.shape for s in specs],
            [s.size for s in specs],
        )
        ok = all(a.name < b.name for a, b in pairwise(specs))
    except CodecError:
        ok = False
    if fast is not None:
        assert ok and fast == slow
    if ok:
        assert description_module._parse_tensors(entries) == slow


@settings(max_examples=100, deadline=None)
@given(json_like, st.binary(max_size=64))
def test_garbage_description_raises_only_codec_error(description: object, payload: bytes) -> None:
    with pytest.raises(CodecError):
        decode(payload, description)  # type: ignore[arg-type]


hostile_dtypes = st.sampled_from(
    [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint16, np.uint64, bool]
)


@SETTINGS
@given(st.sampled_from(CODECS), hostile_dtypes, st.data())
def test_hostile_tensors_raise_codec_error_or_round_trip(
    codec: str, dtype: type, data: st.DataObject
) -> None:
    arr = data.draw(hnp.arrays(dtype, shapes))  # floats include NaN, Inf and huge float64
    tensors = {"x": arr, "y": np.ones(2, np.float32)}
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = arr.astype(np.float32)
    if dtype is bool:
        match = "non-real dtype bool"
    elif not np.isfinite(x32).all():
        match = "'x' contains .* NaN/Inf"
    elif codec == "bf16" and _rounds_to_inf_in_bf16(x32):
        match = "round to Inf"
    else:
        out = _round_trip(codec, tensors, 16)
        assert_within_bound(codec, x32, out["x"], 16)
        return
    with pytest.raises(CodecError, match=match):
        encode_tensors(tensors, codec, block_size=16)


def test_warm_up_compiles_every_kernel() -> None:
    from shared.codec import dequantize, floats, quantize
    from shared.codec.api import warm_up

    warm_up()  # encodes and decodes a sample with every codec, with and without feedback
    kernels = {
        "encode_segment": quantize.encode_segment,
        "decode_blocks": dequantize.decode_blocks,
        **{name: getattr(floats, name)
           for name in ("encode_bf16", "decode_bf16", "encode_fp32", "decode_fp32")},
    }  # fmt: skip
    assert {name: bool(k.signatures) for name, k in kernels.items()} == dict.fromkeys(kernels, True)


_WARM_UP_CHECK = """
import numpy as np
from shared.codec import api as codec, dequantize, floats, quantize
from shared.codec.config import CODECS, CodecConfig
from shared.codec.layout import Layout

kernels = [quantize.encode_segment, dequantize.decode_blocks, floats.encode_bf16,
           floats.decode_bf16, floats.encode_fp32, floats.decode_fp32]
codec.warm_up()
before = [len(k.signatures) for k in kernels]
layout = Layout({"a": (70,), "b": (3, 40)})
shapes = dict(zip(layout.names, layout.shapes))
for writable in (True, False):
    values = np.linspace(-1, 1, layout.size, dtype=np.float32)
    values.setflags(write=writable)
    for name in CODECS:
        for feedback in (False, True) if name != "fp32" else (False,):
            config = CodecConfig(name, 16, error_feedback=feedback)
            flat = codec.encode_flat(values, layout, config, codec.init_state(config, shapes))
            codec.encode(layout.views(values), config, codec.init_state(config, shapes))
            codec.decode_tensors(flat[0], flat[1])
after = [len(k.signatures) for k in kernels]
assert before == after, ("compiled after warm_up", before, after)
"""


def test_warm_up_compiles_every_kernel_version_that_encoding_and_decoding_use():
    """Services call warm_up at start-up; nothing they encode or decode may compile a kernel
    version of its own afterwards. One did (encode_flat's read-only offsets): with a cold Numba
    cache, a learner's first upload compiled for ~10 s while its queue overflowed. A fresh
    process, so that versions other tests compiled cannot hide a missing one."""
    result = subprocess.run(
        [sys.executable, "-c", _WARM_UP_CHECK], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
