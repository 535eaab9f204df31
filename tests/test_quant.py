"""Tests for the codec kernels (quantize, dequantize, floats) against NumPy references.

Arguments have the types shared.codec passes (C-contiguous arrays; read-only inputs to the
decode kernels, as np.frombuffer gives), so the kernels compile once for both test files.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.codec import dequantize, floats, quantize
from shared.codec.description import bytes_per_block

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QMAX = {8: 127, 4: 7, 2: 1}
F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).smallest_subnormal)
NO_RES = np.zeros(0, np.float32)

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
bits_st = st.sampled_from([8, 4, 2])
block_size_st = st.sampled_from([16, 32, 64])
values = hnp.arrays(np.float32, st.integers(0, 300), elements=finite_f32)


def _readonly(a: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.ascontiguousarray(a).tobytes(), a.dtype)


def encode(x: np.ndarray, bits: int, block_size: int, res: np.ndarray | None = None) -> tuple:
    """``(scales, codes, returned)`` of encode_blocks; ``res`` (if given) is updated."""
    n_blocks = -(-x.size // block_size)
    scales = np.full(n_blocks, -1.0, np.float32)
    codes = np.zeros(n_blocks * bytes_per_block(bits, block_size), np.uint8)
    use_res = res is not None
    returned = quantize.encode_blocks(
        x, res if use_res else NO_RES, use_res, bits, block_size, scales, codes
    )
    return scales, codes, returned


def decode(codes: np.ndarray, scales: np.ndarray, bits: int, block_size: int) -> tuple:
    """``(values, returned)`` of decode_blocks; unwritten values are NaN."""
    out = np.full(scales.size * block_size, np.nan, np.float32)
    returned = dequantize.decode_blocks(_readonly(codes), _readonly(scales), bits, block_size, out)
    return out, returned


def unpack_fields(codes: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """The raw code field of every element, in element order (planar layout)."""
    rows = codes.reshape(-1, block_size * bits // 8)
    if bits == 8:
        return rows.view(np.int8).reshape(-1).astype(np.int32)
    mask = (1 << bits) - 1
    planes = [(rows.astype(np.int32) >> (bits * k)) & mask for k in range(8 // bits)]
    return np.concatenate(planes, axis=1).reshape(-1)


def to_codes(fields: np.ndarray, bits: int) -> np.ndarray:
    """Signed codes of valid fields (int4 two's complement; int2 01 = +1, 11 = -1)."""
    if bits == 4:
        return np.where(fields >= 8, fields - 16, fields)
    if bits == 2:
        return np.where(fields == 3, -1, fields)
    return fields


def pack_reference(q: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """Planar packing in NumPy: byte j of a block holds codes j, j + h, j + 2h, ..."""
    rows = q.astype(np.int32).reshape(-1, block_size)
    if bits == 8:
        return rows.astype(np.int8).view(np.uint8).reshape(-1)
    per_byte = 8 // bits
    planes = np.split(rows & ((1 << bits) - 1), per_byte, axis=1)
    packed = sum(plane << (bits * k) for k, plane in enumerate(planes))
    return packed.astype(np.uint8).reshape(-1)


def _padded_blocks(x: np.ndarray, block_size: int) -> np.ndarray:
    padded = np.zeros(-(-x.size // block_size) * block_size)
    padded[: x.size] = x
    return padded.reshape(-1, block_size)


# --------------------------------------------------------------------------- block kernels


def test_bytes_per_block() -> None:
    assert bytes_per_block(8, 16) == 16
    assert bytes_per_block(4, 16) == 8
    assert bytes_per_block(2, 16) == 4
    assert bytes_per_block(2, 1 << 20) == 1 << 18


@SETTINGS
@given(values, bits_st, block_size_st)
def test_encode_blocks_writes_valid_scales_and_codes(
    x: np.ndarray, bits: int, block_size: int
) -> None:
    scales, codes, returned = encode(x, bits, block_size)
    assert returned == -1
    qmax = QMAX[bits]
    # Scales: finite, +0.0 or positive, and no code decodes to Inf.
    assert np.isfinite(scales).all() and not np.signbit(scales).any()
    assert np.all(scales.astype(np.float64) * qmax <= F32_MAX)
    fields = unpack_fields(codes, bits, block_size)
    invalid = {8: -128, 4: 8, 2: 2}[bits]
    assert not np.any(fields == invalid)
    q = to_codes(fields, bits)
    assert np.all(np.abs(q) <= qmax)
    assert np.all(q[x.size :] == 0)  # zero padding quantises to zero
    np.testing.assert_array_equal(pack_reference(q, bits, block_size), codes)

    xb = _padded_blocks(x, block_size)
    absmax = np.abs(xb).max(axis=1)
    if bits == 2:
        # The least-squares scale of the kept (non-zero code) elements, and a contraction.
        qb = q.reshape(-1, block_size)
        kept = qb != 0
        assert np.all(np.sign(xb[kept]) == qb[kept])
        err = np.linalg.norm(xb - qb * scales[:, None].astype(np.float64), axis=1)
        norm = np.linalg.norm(xb, axis=1)
        assert np.all(err[norm == 0] == 0) and np.all(err[norm > 0] < norm[norm > 0])
        assert np.all(kept.any(axis=1) == (norm > 0))
        mean_kept = np.abs(xb * kept).sum(axis=1) / np.maximum(kept.sum(axis=1), 1)
        np.testing.assert_allclose(scales, mean_kept, rtol=1e-5, atol=TINY)
    else:
        # The scale covers absmax to within one float32 rounding (a normal scale may round
        # down by an ulp, far below the scale / 2 error bound; subnormal ones are rounded up),
        # qmax * scale stays finite, and the scale is within rounding of absmax / qmax.
        covered = scales.astype(np.float64) * qmax >= absmax * (1 - 2.0**-23)
        assert np.all(covered | (absmax > 2.0**127))
        np.testing.assert_allclose(scales, absmax / qmax, rtol=1e-6, atol=TINY)

    out, returned = decode(codes, scales, bits, block_size)
    assert returned == -1
    expected = q.reshape(-1, block_size) * scales[:, None].astype(np.float64)
    np.testing.assert_array_equal(out, expected.astype(np.float32).reshape(-1))


@pytest.mark.parametrize(
    ("bits", "x", "expected"),
    [
        # int8: codes are the bytes themselves.
        (8, [127, -1, 5] + [0] * 13, [127, 255, 5] + [0] * 13),
        # int4: scale 1 (absmax 7); byte j = code j | code j+8 << 4.
        (4, [7, -7, 1, 0, 0, 0, 0, 0, -1, 2, 0, 0, 0, 0, 0, 3], [0xF7, 0x29, 1, 0, 0, 0, 0, 0x30]),
        # int2: scale 1; byte j = code j | code j+4 << 2 | code j+8 << 4 | code j+12 << 6.
        (2, [1, -1, 0, 0, 0, 1, 0, 0, 0, 0, -1, 0, 1, 0, 0, -1], [0x41, 0x07, 0x30, 0xC0]),
    ],
)
def test_planar_packing_layout(bits: int, x: list[int], expected: list[int]) -> None:
    scales, codes, returned = encode(np.array(x, np.float32), bits, 16)
    assert returned == -1
    if bits != 8:
        assert scales[0] == 1
    assert codes.tolist() == expected
    out, returned = decode(codes, scales, bits, 16)
    assert returned == -1
    np.testing.assert_array_equal(out, np.array(x, np.float32) * scales[0])


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("position", [0, 15, 16, 40])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_blocks_reports_the_first_non_finite_block(
    bits: int, position: int, bad: float
) -> None:
    x = np.ones(48, np.float32)
    x[position] = bad
    x[47] = np.nan  # a later bad block does not matter
    _, _, returned = encode(x, bits, 16)
    assert returned == position // 16


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad_block", [0, 15, 16, 17, 31, 40])
def test_grouped_blocks_match_single_blocks_and_report_the_first_bad_one(
    bits: int, bad_block: int
) -> None:
    """Whole blocks are encoded 16 at a time; results and the reported block are the same
    as one block at a time (the error-feedback path, with a zero residual)."""
    rng = np.random.default_rng(bad_block)
    x = (rng.standard_normal(45 * 16) * 10.0 ** rng.integers(-40, 30, 45 * 16)).astype(np.float32)
    x[5 * 16 : 6 * 16] = 0  # a zero block, and a tiny one, inside the first group
    x[7 * 16 : 8 * 16] *= np.float32(1e-35)
    grouped = encode(x, bits, 16)
    single = encode(x, bits, 16, np.zeros_like(x))
    np.testing.assert_array_equal(grouped[0], single[0])
    np.testing.assert_array_equal(grouped[1], single[1])
    x[bad_block * 16 + 3] = np.inf
    x[44 * 16] = np.nan  # a later bad block does not matter
    assert encode(x, bits, 16)[2] == bad_block


@SETTINGS
@given(values, st.data(), bits_st, block_size_st)
def test_encode_blocks_fuses_error_feedback(
    x: np.ndarray, data: st.DataObject, bits: int, block_size: int
) -> None:
    res = data.draw(hnp.arrays(np.float32, x.size, elements=st.floats(-1e3, 1e3, width=32)))
    with np.errstate(over="ignore"):
        v = x + res
    if not np.isfinite(v).all():
        return
    expected_scales, expected_codes, _ = encode(v, bits, block_size)
    new_res = res.copy()
    scales, codes, returned = encode(x, bits, block_size, new_res)
    assert returned == -1
    # It quantises x + r ...
    np.testing.assert_array_equal(scales, expected_scales)
    np.testing.assert_array_equal(codes, expected_codes)
    # ... and keeps what quantisation left out (up to a fused multiply-add's rounding).
    out, _ = decode(codes, scales, bits, block_size)
    out = out[: x.size].astype(np.float64)
    exact = v - out
    assert np.all(np.abs(new_res - exact) <= (np.abs(out) + np.abs(exact)) * 2.0**-23 + TINY)


def _segment(tensors: list[np.ndarray], bits: int, block_size: int, residuals=None) -> tuple:
    """``(scales, codes, returned)`` of encode_segment, each tensor one piece, in order."""
    rows, first = [], 0
    for t, x in enumerate(tensors):
        units = -(-x.size // block_size)
        rows.append((t, 0, x.size, first, units))
        first += units
    pieces = np.array(rows, np.int64).reshape(-1, 5)
    raw = np.zeros(first * (4 + bytes_per_block(bits, block_size)), np.uint8)
    raw[: 4 * first].view(np.float32)[:] = -1.0
    addresses = np.array([quantize.address(x) for x in tensors], np.int64)
    res = addresses if residuals is None else np.array([quantize.address(r) for r in residuals])
    for array in (pieces, addresses, res):
        array.setflags(write=False)  # as the codec passes them (one compiled version)
    returned = quantize.encode_segment(
        0, addresses, res, pieces, residuals is not None, bits, block_size, raw
    )
    return raw[: 4 * first].view(np.float32), raw[4 * first :], returned


@SETTINGS
@given(st.lists(values, min_size=1, max_size=5), bits_st, block_size_st, st.booleans())
def test_encode_segment_is_encode_blocks_per_piece(
    tensors: list[np.ndarray], bits: int, block_size: int, feedback: bool
) -> None:
    tensors = [x for x in tensors if x.size] or [np.ones(3, np.float32)]
    residuals = [np.full(x.size, 0.25, np.float32) for x in tensors] if feedback else None
    scales, codes, returned = _segment(tensors, bits, block_size, residuals)
    assert returned == (-1, -1)
    new_res = [np.full(x.size, 0.25, np.float32) for x in tensors]
    expected = [encode(x, bits, block_size, r if feedback else None)
                for x, r in zip(tensors, new_res, strict=True)]  # fmt: skip
    np.testing.assert_array_equal(scales, np.concatenate([e[0] for e in expected]))
    np.testing.assert_array_equal(codes, np.concatenate([e[1] for e in expected]))
    if feedback:  # the residuals were updated in place, through their addresses
        np.testing.assert_array_equal(np.concatenate(residuals), np.concatenate(new_res))


def test_encode_segment_reports_the_piece_and_block() -> None:
    tensors = [np.ones(20, np.float32), np.ones(50, np.float32), np.ones(5, np.float32)]
    tensors[1][37] = np.nan
    _, _, returned = _segment(tensors, 8, 16)
    assert returned == (1, 2)


def test_failed_error_feedback_encode_reports_the_block() -> None:
    x = np.ones(64, np.float32)
    res = np.zeros(64, np.float32)
    res[33] = F32_MAX
    x[33] = F32_MAX
    _, _, returned = encode(x, 8, 16, res)
    assert returned == 2


def test_tiny_blocks_quantise_exactly() -> None:
    # Blocks with absmax below 2^-100 take an exact float64 path; under fastmath "arcp" the
    # division once became a float32 multiplication by an infinite 1 / scale.
    x = np.zeros(16, np.float32)
    x[:2] = [3.3155089e-37, 2.5767993e-37]
    scales, codes, _ = encode(x, 8, 16)
    assert unpack_fields(codes, 8, 16)[:2].tolist() == [127, 99]
    for exponent in (-149, -140, -130, -120, -101):
        x = (np.linspace(-1, 1, 32) * 2.0**exponent).astype(np.float32)
        for bits in (8, 4):
            scales, codes, _ = encode(x, bits, 16)
            out, _ = decode(codes, scales, bits, 16)
            absmax = np.repeat(np.abs(_padded_blocks(x, 16)).max(axis=1), 16)
            err = np.abs(out - x.astype(np.float64))
            assert np.all(err <= absmax / (2 * QMAX[bits]) + TINY)


@pytest.mark.parametrize("magnitude", [F32_MAX, 3e37, TINY, 2 * TINY, 1e-40])
def test_ternary_keeps_extreme_blocks(magnitude: float) -> None:
    # A float32 sum of large values overflows and the float32 threshold of subnormal ones
    # rounds up to the values themselves; neither may zero a non-zero block.
    x = np.full(16, magnitude, np.float32)
    x[::3] *= -1
    x[1] = 0
    scales, codes, _ = encode(x, 2, 16)
    out, returned = decode(codes, scales, 2, 16)
    assert returned == -1 and np.isfinite(out).all()
    x64 = x.astype(np.float64)
    assert np.linalg.norm(out - x64) < np.linalg.norm(x64)
    np.testing.assert_array_equal(np.sign(out), np.sign(x))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_zero_blocks_and_no_blocks(bits: int) -> None:
    scales, codes, returned = encode(np.zeros(40, np.float32), bits, 16)
    assert returned == -1 and scales.tolist() == [0, 0, 0] and not codes.any()
    assert not np.signbit(scales).any()
    out, returned = decode(codes, scales, bits, 16)
    assert returned == -1 and not out.any()
    scales, codes, returned = encode(np.zeros(0, np.float32), bits, 16)
    assert returned == -1 and scales.size == 0 and codes.size == 0
    out, returned = decode(codes, scales, bits, 16)
    assert returned == -1 and out.size == 0


@SETTINGS
@given(bits_st, st.data())
def test_decode_blocks_matches_reference_or_reports_first_bad_block(
    bits: int, data: st.DataObject
) -> None:
    n_blocks, block_size = data.draw(st.integers(1, 4)), 16
    codes = data.draw(hnp.arrays(np.uint8, n_blocks * bytes_per_block(bits, block_size)))
    scales = data.draw(hnp.arrays(np.float32, n_blocks))  # any bits: NaN, -0.0, huge, ...
    out, returned = decode(codes, scales, bits, block_size)
    fields = unpack_fields(codes, bits, block_size).reshape(n_blocks, block_size)
    invalid = {8: -128, 4: 8, 2: 2}[bits]
    s64 = scales.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        bad_scale = ~np.isfinite(s64) | np.signbit(scales) | (s64 * QMAX[bits] > F32_MAX)
    bad = bad_scale | (fields == invalid).any(axis=1)
    first = int(np.argmax(bad)) if bad.any() else -1
    assert returned == first
    good = n_blocks if first == -1 else first
    expected = to_codes(fields[:good], bits) * s64[:good, None]
    np.testing.assert_array_equal(out[: good * block_size], expected.astype(np.float32).ravel())
    assert np.isfinite(out[: good * block_size]).all()


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("scale", [-1.0, -0.0, -TINY, np.inf, -np.inf, np.nan])
def test_decode_blocks_rejects_bad_scales(bits: int, scale: float) -> None:
    scales = np.array([1.0, 1.0, scale, 1.0], np.float32)
    codes = np.zeros(4 * bytes_per_block(bits, 16), np.uint8)
    out, returned = decode(codes, scales, bits, 16)
    assert returned == 2
    assert not out[:32].any()  # blocks before the bad one are written


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_blocks_rejects_scales_whose_largest_code_overflows(bits: int) -> None:
    qmax = QMAX[bits]
    largest = np.float32(F32_MAX / qmax)
    if float(largest) * qmax > F32_MAX:
        largest = np.nextafter(largest, np.float32(0))
    codes = np.zeros(2 * bytes_per_block(bits, 16), np.uint8)
    out, returned = decode(codes, np.array([largest, largest], np.float32), bits, 16)
    assert returned == -1
    too_large = np.nextafter(largest, np.float32(np.inf))
    _, returned = decode(codes, np.array([largest, too_large], np.float32), bits, 16)
    assert returned == 1
    # The encoder never writes such a scale, even for the largest float32 values.
    x = np.full(16, -F32_MAX, np.float32)
    scales, codes, _ = encode(x, bits, 16)
    assert scales[0] <= largest
    out, returned = decode(codes, scales, bits, 16)
    assert returned == -1 and np.isfinite(out).all()
    assert np.all(np.abs(out - x.astype(np.float64)) <= F32_MAX / (2 * qmax) * (1 + 2.0**-20))


@pytest.mark.parametrize(
    ("bits", "byte", "position"),
    [(8, 0x80, 0), (8, 0x80, 37), (4, 0x08, 17), (4, 0x80, 3), (2, 0x02, 9), (2, 0x80, 5)],
)
def test_decode_blocks_rejects_invalid_codes(bits: int, byte: int, position: int) -> None:
    codes = np.zeros(3 * bytes_per_block(bits, 16), np.uint8)
    codes[position] = byte
    _, returned = decode(codes, np.ones(3, np.float32), bits, 16)
    assert returned == position // bytes_per_block(bits, 16)


# --------------------------------------------------------------------------- fp32 and bf16


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def _finite_from_bits(raw: np.ndarray) -> np.ndarray:
    x = raw.view(np.float32)
    return x[np.isfinite(x)].copy()


@SETTINGS
@given(hnp.arrays(np.uint32, st.integers(0, 200)))
def test_fp32_kernels_copy_and_detect_non_finite(raw: np.ndarray) -> None:
    x = raw.view(np.float32).copy()
    out = np.zeros_like(x)
    expected = 0 if not np.isfinite(x).all() else -1
    assert floats.encode_fp32(x, out) == expected
    np.testing.assert_array_equal(out.view(np.uint32), raw)
    out = np.zeros_like(x)
    assert floats.decode_fp32(_readonly(x), out) == expected
    np.testing.assert_array_equal(out.view(np.uint32), raw)


@SETTINGS
@given(hnp.arrays(np.uint32, st.integers(0, 200)))
def test_bf16_rounding_matches_ml_dtypes(raw: np.ndarray) -> None:
    """Every float32 bit pattern: finite values round exactly as ml_dtypes rounds them."""
    x = _finite_from_bits(raw)
    out = np.zeros(x.size, np.uint16)
    returned = floats.encode_bf16(x, NO_RES, False, out)
    expected = _bf16_bits(x)
    overflow = (expected & 0x7F80) == 0x7F80  # finite values that round to Inf
    assert returned == (0 if overflow.any() else -1)
    if returned == -1:
        np.testing.assert_array_equal(out, expected)
        widened = np.zeros(x.size, np.float32)
        assert floats.decode_bf16(_readonly(out), widened) == -1
        np.testing.assert_array_equal(widened, expected.view(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, F32_MAX, -F32_MAX])
def test_encode_bf16_rejects_values_that_are_or_round_to_inf(bad: float) -> None:
    x = np.ones(100, np.float32)
    x[57] = bad
    assert floats.encode_bf16(x, NO_RES, False, np.zeros(100, np.uint16)) == 0
    res = np.zeros(100, np.float32)
    assert floats.encode_bf16(x, res, True, np.zeros(100, np.uint16)) == 0


@SETTINGS
@given(hnp.arrays(np.uint16, st.integers(0, 200)))
def test_decode_bf16_widens_and_detects_non_finite(raw: np.ndarray) -> None:
    out = np.zeros(raw.size, np.float32)
    returned = floats.decode_bf16(_readonly(raw), out)
    non_finite = (raw & 0x7F80) == 0x7F80
    assert returned == (0 if non_finite.any() else -1)
    np.testing.assert_array_equal(out.view(np.uint32), raw.astype(np.uint32) << 16)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(0, 10_000))
def test_encode_bf16_fuses_error_feedback(seed: int, size: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size).astype(np.float32)
    res = (rng.standard_normal(size) * 1e-2).astype(np.float32)
    v = x + res
    out = np.zeros(size, np.uint16)
    assert floats.encode_bf16(x, res, True, out) == -1
    np.testing.assert_array_equal(out, _bf16_bits(v))
    sent = out.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(res, v - sent)  # exact: v - round(v) is representable
