"""Compiled kernels of the unquantised codecs: fp32 (a checked copy) and bf16.

``bf16`` rounds to nearest even, bit for bit as ``ml_dtypes.bfloat16`` does. Compiled with the
options of :mod:`shared.codec.jit`. Every kernel returns -1, or 0 if a value is (or, for
bf16, rounds to) NaN/Inf.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from shared.codec.jit import ABS_MASK, EXP_MASK, INLINE, JIT, REDUCE

__all__ = ["decode_bf16", "decode_fp32", "encode_bf16", "encode_fp32", "sum_of_squares"]


@njit(**JIT)
def encode_fp32(x, out):  # pragma: no cover - compiled
    """Copy float32 ``x`` into ``out``; returns -1, or 0 if any value is NaN/Inf."""
    bits = x.view(np.uint32)
    m = np.uint32(0)
    for i in range(x.size):
        out[i] = x[i]
        m = max(m, np.uint32(bits[i] & ABS_MASK))  # uint32 lanes, not uint64
    return 0 if m >= EXP_MASK else -1


@njit(**JIT)
def decode_fp32(raw, out):  # pragma: no cover - compiled
    """Copy float32 ``raw`` into ``out``; returns -1, or 0 if any value is NaN/Inf."""
    return encode_fp32(raw, out)


@njit(**INLINE)
def _round_bf16(src, out):  # pragma: no cover - compiled
    """bfloat16 bits of float32 ``src`` (nearest, ties to even); -1, or 0 on NaN/Inf."""
    sbits = src.view(np.uint32)
    m = np.uint32(0)
    for i in range(src.size):
        m = max(m, np.uint32(sbits[i] & ABS_MASK))
    if m >= EXP_MASK:
        return 0
    bad = np.uint16(0)
    for i in range(src.size):
        u = sbits[i]
        r = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> 16)
        out[i] = r
        # Values within half a bf16 ulp of float32 max round up to Inf.
        bad |= np.uint16(1) if (r & np.uint16(0x7F80)) == np.uint16(0x7F80) else np.uint16(0)
    return 0 if bad else -1


@njit(**JIT)
def encode_bf16(x, res, use_res, out):  # pragma: no cover - compiled
    """Round float32 ``x`` (+ residual) to bfloat16 bits in ``out`` (uint16).

    Returns -1, or 0 if a value is (or rounds to) NaN/Inf; with ``use_res`` the residual is
    then left holding ``x + r`` and must be discarded by the caller.
    """
    if not use_res:
        return _round_bf16(x, out)
    n = x.size
    for i in range(n):
        res[i] = x[i] + res[i]
    bad = _round_bf16(res, out)
    if bad >= 0:
        return bad
    chunk = 4096
    tmp = np.empty(min(n, chunk), np.float32)
    tbits = tmp.view(np.uint32)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        ob = out[lo:hi]
        rb = res[lo:hi]
        for i in range(hi - lo):
            tbits[i] = np.uint32(ob[i]) << np.uint32(16)
        for i in range(hi - lo):
            rb[i] = rb[i] - tmp[i]
    return -1


@njit(**JIT)
def decode_bf16(raw, out):  # pragma: no cover - compiled
    """Widen bfloat16 bits ``raw`` (uint16) to float32 ``out``; -1, or 0 on NaN/Inf."""
    ob = out.view(np.uint32)
    bad = np.uint16(0)
    for i in range(raw.size):
        u = raw[i]
        bad |= np.uint16(1) if (u & np.uint16(0x7F80)) == np.uint16(0x7F80) else np.uint16(0)
        ob[i] = np.uint32(u) << np.uint32(16)
    return 0 if bad else -1


@njit(**REDUCE)
def sum_of_squares(x):  # pragma: no cover - compiled
    """Σ x² of float32 ``x`` (1-D), each square and the sum in float64.

    Reassociated (``REDUCE``), so that the sum runs in vector lanes: one pass at memory speed,
    where NumPy's float64 ``einsum`` widens the values in small buffers first.
    """
    total = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        total += v * v
    return total
