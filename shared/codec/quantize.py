"""Compiled kernels that quantise float32 blocks into packed codes (int8, int4, int2).

These are the inner loops of the codec's encoder (:mod:`shared.codec.segments`); they know
nothing about tensors, names, zstd or payload layout. Each kernel works on one contiguous run
of blocks and is compiled by Numba with the options of :mod:`shared.codec.jit`. The loops are
written so that LLVM vectorises them: no Python objects, no per-element branches that depend
on data, and slices instead of offset arithmetic so indices are provably in range.
:mod:`shared.codec.dequantize` inverts them.

Schemes (``bits`` selects one):

* ``8`` / ``4`` — symmetric absmax: ``scale = absmax / qmax`` with ``qmax`` 127 or 7, codes
  ``round(x / scale)`` in ``[-qmax, qmax]``, so ``|x - x̂| <= scale / 2`` per element.
* ``2`` — ternary ("TWN", Li et al. 2016): threshold ``t = 0.7 * mean|x|``, codes
  ``sign(x)`` where ``|x| > t`` else 0, scale = mean ``|x|`` over the kept elements. This
  is the least-squares scale for the kept set, so ``‖x - x̂‖ < ‖x‖`` for every non-zero
  block: the quantiser is a contraction, which is what error feedback needs.

Codes of a block are packed *planar*: for ``c = 8 / bits`` codes per byte, byte ``j`` holds
codes ``j, j + bs/c, j + 2 bs/c, …`` in its low-to-high bit fields (two's complement for int4;
``00`` = 0, ``01`` = +1, ``11`` = -1 for int2). Planar packing reads and writes whole
contiguous rows, so it vectorises where interleaved packing would not.

Error feedback is fused in: with ``use_res`` the kernel quantises ``v = x + r`` and writes
``r ← v - x̂`` back into ``r`` in the same pass over the block.

:func:`encode_segment` runs :func:`encode_blocks` over the pieces of many tensors in one
call, so that a payload of many small tensors costs one kernel call per segment instead of
one per tensor.

Every kernel returns -1, or the index of the first block holding NaN/Inf (detected from the
float bits, which cannot be optimised away).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

from shared.codec.jit import ABS_MASK, EXP_MASK, F32_MAX, INLINE, JIT, REDUCE

__all__ = ["address", "encode_blocks", "encode_segment"]

# Below this absmax, qmax / absmax overflows float32; such blocks take an exact float64 path.
_TINY_ABSMAX = np.float32(2.0**-100)
# Above this, qmax * (absmax / qmax) may round past float32 max; such blocks take the checked path.
_HUGE_ABSMAX = np.float32(2.0**120)
_TWN_THRESHOLD = np.float32(0.7)


@njit(**INLINE)
def _load(x, res, use_res, buf):  # pragma: no cover - compiled
    """Copy x (+ r) into the block scratch, zero-pad it, return max |bits| (NaN/Inf >= EXP)."""
    k = x.size
    if use_res:
        for i in range(k):
            buf[i] = x[i] + res[i]
    else:
        for i in range(k):
            buf[i] = x[i]
    for i in range(k, buf.size):
        buf[i] = 0
    return _absmax_bits(buf)


@njit(**INLINE)
def _absmax_scale(absmax, qmax):  # pragma: no cover - compiled
    """Float32 scale with qmax * scale >= absmax (no code overflow) and finite qmax * scale."""
    scale = np.float32(absmax / np.float32(qmax))
    if float(scale) * qmax < float(absmax):  # only subnormal scales round this far
        scale = np.nextafter(scale, np.float32(np.inf))
    if float(scale) * qmax > F32_MAX:  # would decode to Inf
        scale = np.nextafter(scale, np.float32(0))
    return scale


@njit(**{**JIT, "fastmath": False})
def _quantize_exact(buf, scale, qmax, q):  # pragma: no cover - compiled
    """Codes of a block with a (near-)subnormal or a huge scale, in exact float64.

    Not fastmath: ``arcp``/``reassoc`` let LLVM turn ``x * (qmax / absmax)`` into
    ``(x * qmax) / absmax``, which overflows to Inf for values near float32 max, and compute
    ``x / scale`` as ``x * (1 / scale)``, where ``1 / scale`` overflows for subnormal scales;
    either way every code would clip to qmax.
    """
    for i in range(buf.size):
        v = min(max(float(buf[i]) / float(scale), -float(qmax)), float(qmax))
        q[i] = np.int8(np.int32(np.rint(v)))


@njit(**INLINE)
def _quantize_ordinary(src, absmax, qmax, q):  # pragma: no cover - compiled
    """Codes round(v / scale) of a block with absmax in [_TINY_ABSMAX, _HUGE_ABSMAX] into
    int8 ``q``; returns the scale.

    Ordinary magnitudes need none of _absmax_scale's ulp corrections and are safe to compute
    with fastmath (|x| * qmax stays finite). |v| <= absmax, so |v * inv| <= qmax (1 + 2^-22)
    < qmax + 1/2: every code is in [-qmax, qmax] without clipping. Rounding is half to even
    (one vcvtps2dq per 16 values; no branches).
    """
    fq = np.float32(qmax)
    inv = fq / absmax
    for i in range(src.size):
        q[i] = np.int8(np.int32(np.rint(src[i] * inv)))
    return absmax / fq


@njit(**INLINE)
def _quantize_absmax(buf, absmax, qmax, q):  # pragma: no cover - compiled
    """Codes round(v / scale) in [-qmax, qmax] into int8 ``q``; returns the scale.

    Tiny and huge blocks take the exact path (see :func:`_quantize_exact`)."""
    if _TINY_ABSMAX <= absmax <= _HUGE_ABSMAX:
        return _quantize_ordinary(buf, absmax, qmax, q)
    scale = _absmax_scale(absmax, qmax)
    if scale > 0:
        _quantize_exact(buf, scale, qmax, q)
    else:
        for i in range(buf.size):
            q[i] = 0
    return scale


@njit(**REDUCE)
def _quantize_ternary(buf, q):  # pragma: no cover - compiled
    """Ternary codes {-1, 0, 1} into ``q``; returns the least-squares scale of the kept set."""
    total = np.float32(0)
    for i in range(buf.size):
        total += abs(buf[i])
    threshold = _TWN_THRESHOLD * total / np.float32(buf.size)
    kept_sum = np.float32(0)
    kept = np.int32(0)
    for i in range(buf.size):
        a = abs(buf[i])
        big = a > threshold
        kept_sum += a * np.float32(big)
        kept += np.int32(big)
    if kept > 0 and kept_sum <= F32_MAX:
        for i in range(buf.size):
            v = buf[i]
            q[i] = np.int8(v > threshold) - np.int8(v < -threshold)
        return kept_sum / np.float32(kept)
    # Nothing kept: a zero block, or float32 failed (the sum of large values overflowed and
    # made the threshold Inf, or the threshold of subnormals rounded up to the values
    # themselves). Redo it in float64, where a non-zero block always keeps its largest value.
    total64 = 0.0
    for i in range(buf.size):
        total64 += abs(float(buf[i]))
    threshold64 = float(_TWN_THRESHOLD) * total64 / buf.size
    sum64 = 0.0
    kept = np.int32(0)
    for i in range(buf.size):
        v64 = float(buf[i])
        q[i] = np.int8(v64 > threshold64) - np.int8(v64 < -threshold64)
        if abs(v64) > threshold64:
            sum64 += abs(v64)
            kept += np.int32(1)
    return np.float32(sum64 / kept) if kept > 0 else np.float32(0)


@njit(**INLINE)
def _pack(q, bits, out):  # pragma: no cover - compiled
    """Planar-pack int4 or int2 codes ``q`` (one block) into ``out`` (``q.size * bits / 8``)."""
    if bits == 4:
        h = q.size // 2
        lo = q[:h]
        hi = q[h:]
        for j in range(h):
            out[j] = np.uint8(lo[j] & np.int8(15)) | np.uint8(np.uint8(hi[j]) << np.uint8(4))
    else:
        h = q.size // 4
        q0 = q[:h]
        q1 = q[h : 2 * h]
        q2 = q[2 * h : 3 * h]
        q3 = q[3 * h :]
        for j in range(h):
            out[j] = np.uint8(
                (q0[j] & 3) | ((q1[j] & 3) << 2) | ((q2[j] & 3) << 4) | ((q3[j] & 3) << 6)
            )


@njit(**INLINE)
def _residual(buf, q, scale, res):  # pragma: no cover - compiled
    """New error-feedback residual: what quantisation left out of this block."""
    for i in range(res.size):
        res[i] = buf[i] - np.float32(q[i]) * scale


@njit(**INLINE)
def _absmax_bits(x):  # pragma: no cover - compiled
    """max |bits| of float32 ``x``: the bits of max |x|, or >= EXP_MASK if any NaN/Inf."""
    return _absmax_of_bits(x.view(np.uint32))


@njit(**INLINE)
def _absmax_of_bits(bits):  # pragma: no cover - compiled
    """:func:`_absmax_bits` of the float32 values whose bits (uint32) are ``bits``."""
    m = np.uint32(0)
    for i in range(bits.size):
        m = max(m, np.uint32(bits[i] & ABS_MASK))  # uint32 lanes, not uint64
    return m


@njit(**INLINE)
def _encode_block(src, absmax, bits, qmax, scratch, packed):  # pragma: no cover - compiled
    """Quantise one whole block ``src`` into ``packed``; returns its scale.

    int8 codes are quantised straight into the output; narrower ones go through ``scratch``
    and are packed after (separate call sites keep each array's layout static, which
    vectorisation needs).
    """
    if bits == 8:
        return _quantize_absmax(src, absmax, qmax, packed.view(np.int8))
    if bits == 2:
        scale = _quantize_ternary(src, scratch)
    else:
        scale = _quantize_absmax(src, absmax, qmax, scratch)
    _pack(scratch, bits, packed)
    return scale


@njit(**INLINE)
def _quantize_pack4(src, absmax, packed):  # pragma: no cover - compiled
    """int4 codes of an ordinary-magnitude block, quantised and packed in one pass.

    The same codes as ``_quantize_absmax`` followed by ``_pack`` (the block's two halves go
    to the low and high nibbles), without the round trip through scratch. Returns the scale.
    """
    fq = np.float32(7)
    inv = fq / absmax
    h = src.size // 2
    lo = src[:h]
    hi = src[h:]
    for j in range(h):
        a = np.int8(np.int32(np.rint(lo[j] * inv)))
        c = np.int8(np.int32(np.rint(hi[j] * inv)))
        packed[j] = np.uint8(a & np.int8(15)) | np.uint8(np.uint8(c) << np.uint8(4))
    return absmax / fq


# Whole blocks per group on the plain path of encode_blocks (see _encode_groups).
_GROUP = 16


@njit(**INLINE)
def _encode_groups(x, xbits, bits, block_size, qmax, scales, codes, codes8, scratch):
    """int8/int4 codes of the whole blocks of ``x`` (no error feedback), _GROUP at a time.

    The absmax reductions of a group are independent of each other, so the CPU overlaps
    them; one block at a time, each would wait for its own reduction and divisions.
    Returns the number of blocks done: it stops before the first group holding a non-finite
    value, and leaves the tail (fewer than _GROUP blocks) to the caller's block loop.

    The per-block dispatch below repeats the one in :func:`_encode_blocks` on purpose: in a
    shared inline helper the fast paths do not vectorise as well (``bench/codec.py`` shows it).
    """
    bpb = block_size * bits // 8
    group = np.empty(_GROUP, np.uint32)
    absmaxes = group.view(np.float32)
    full = x.size // block_size
    start = 0
    while start + _GROUP <= full:
        worst = np.uint32(0)
        for g in range(_GROUP):
            lo = (start + g) * block_size
            m = _absmax_of_bits(xbits[lo : lo + block_size])
            group[g] = m
            worst = max(worst, m)
        if worst >= EXP_MASK:
            return start
        for g in range(_GROUP):
            b = start + g
            xb = x[b * block_size : (b + 1) * block_size]
            absmax = absmaxes[g]
            ordinary = _TINY_ABSMAX <= absmax <= _HUGE_ABSMAX
            if bits == 8 and ordinary:
                scales[b] = _quantize_ordinary(xb, absmax, 127, codes8[b * bpb : (b + 1) * bpb])
            elif bits == 4 and ordinary:
                scales[b] = _quantize_pack4(xb, absmax, codes[b * bpb : (b + 1) * bpb])
            else:
                scales[b] = _encode_block(
                    xb, absmax, bits, qmax, scratch, codes[b * bpb : (b + 1) * bpb]
                )
        start += _GROUP
    return start


@njit(**JIT)
def encode_blocks(x, res, use_res, bits, block_size, scales, codes):  # pragma: no cover
    """Quantise 1-D float32 ``x`` (last block zero-padded) into ``scales`` and packed ``codes``.

    Args:
        x: Values; ``len(scales) == ceil(len(x) / block_size)``.
        res: Error-feedback residual, same length as ``x``; read and updated if ``use_res``.
        use_res: Quantise ``x + res`` and store the new residual.
        bits: 8, 4 or 2.
        block_size: Elements per block (a multiple of 16).
        scales: float32 output, one per block.
        codes: uint8 output, ``len(scales) * block_size * bits // 8``.

    Returns:
        -1, or the index of the first block holding NaN/Inf; with ``use_res`` the residual is
        then partly updated and must be discarded by the caller.
    """
    buf = np.empty(block_size, np.float32)
    scratch = np.empty(block_size, np.int8)
    return _encode_blocks(x, res, use_res, bits, block_size, scales, codes, buf, scratch)


@njit(**INLINE)
def _encode_blocks(  # pragma: no cover - compiled
    x, res, use_res, bits, block_size, scales, codes, buf, scratch
):
    """:func:`encode_blocks` with its work buffers (``block_size`` float32 and int8) given."""
    n = x.size
    bpb = block_size * bits // 8
    qmax = 127 if bits == 8 else 7
    one = np.zeros(1, np.uint32)
    one_f32 = one.view(np.float32)
    # Views are made once: made per block (in the helpers), they cost a fifth of the time.
    xbits = x.view(np.uint32)
    codes8 = codes.view(np.int8)
    start = 0
    if not use_res and bits != 2:
        start = _encode_groups(x, xbits, bits, block_size, qmax, scales, codes, codes8, scratch)
    for b in range(start, scales.size):
        lo = b * block_size
        hi = min(lo + block_size, n)
        xb = x[lo:hi]
        rb = res[lo:hi]
        packed = codes[b * bpb : (b + 1) * bpb]
        # A whole block without error feedback is read in place; otherwise the block is
        # first summed with its residual (or zero-padded) into ``buf``.
        if not use_res and hi - lo == block_size:
            m = _absmax_of_bits(xbits[lo:hi])
            if m >= EXP_MASK:
                return b
            one[0] = m
            absmax = one_f32[0]
            ordinary = _TINY_ABSMAX <= absmax <= _HUGE_ABSMAX
            if bits == 8 and ordinary:
                scales[b] = _quantize_ordinary(xb, absmax, 127, codes8[b * bpb : (b + 1) * bpb])
            elif bits == 4 and ordinary:
                scales[b] = _quantize_pack4(xb, absmax, packed)
            else:
                scales[b] = _encode_block(xb, absmax, bits, qmax, scratch, packed)
        else:
            m = _load(xb, rb, use_res, buf)
            if m >= EXP_MASK:
                return b
            one[0] = m
            scale = _encode_block(buf, one_f32[0], bits, qmax, scratch, packed)
            scales[b] = scale
            if use_res:
                if bits == 8:
                    _residual(buf, packed.view(np.int8), scale, rb)
                else:
                    _residual(buf, scratch, scale, rb)
    return -1


def address(array: np.ndarray) -> int:
    """The data address of a contiguous ``array``, for :func:`encode_segment`."""
    return array.ctypes.data


@intrinsic
def _float32_at(typingctx, address):  # pragma: no cover - compiled
    """The float32 pointer at integer ``address`` (for :func:`numba.carray`)."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.CPointer(types.float32)(types.intp), codegen


@njit(**JIT)
def encode_segment(base, addresses, residuals, pieces, use_res, bits, block_size, raw):
    """:func:`encode_blocks` over the pieces of one segment, tensors given by address.

    Args:
        base: An address (see :func:`address`) added to every entry of ``addresses``: the
            start of a flat float32 buffer that holds every tensor, or 0. An int, not the
            buffer, so that one compiled version serves every caller (a read-only buffer
            would otherwise compile another one at a learner's first upload).
        addresses: int64 per tensor: where its data starts, in bytes past ``base``. Each
            tensor is C-contiguous float32, kept alive by the caller for the whole call, at
            least ``hi`` values long for every piece.
        residuals: Absolute addresses of the error-feedback residual of each tensor, alike
            (read and written if ``use_res``; ignored otherwise).
        pieces: int64 ``[k, 5]``: rows ``(tensor, lo, hi, first, units)``: values
            ``[lo, hi)`` of ``tensor`` fill blocks ``[first, first + units)`` of the segment.
        use_res, bits, block_size: As for :func:`encode_blocks`.
        raw: The segment's output (uint8): its ``m`` float32 scales, then its ``m`` packed
            code blocks, ``m`` being the units the pieces fill.

    Returns:
        ``(-1, -1)``, or ``(piece, block)``: the first piece with a non-finite block and that
        block's index within the piece.
    """
    bpb = block_size * bits // 8
    m = pieces[-1, 3] + pieces[-1, 4]
    scales = raw[: 4 * m].view(np.float32)
    codes = raw[4 * m :]
    buf = np.empty(block_size, np.float32)  # work buffers, made once for all pieces
    scratch = np.empty(block_size, np.int8)
    for p in range(pieces.shape[0]):
        tensor, lo, hi, first, units = pieces[p]
        x = carray(_float32_at(base + addresses[tensor] + 4 * lo), hi - lo)
        res = carray(_float32_at(residuals[tensor] + 4 * lo), (hi - lo) * use_res)
        bad = _encode_blocks(
            x,
            res,
            use_res,
            bits,
            block_size,
            scales[first : first + units],
            codes[first * bpb : (first + units) * bpb],
            buf,
            scratch,
        )
        if bad >= 0:
            return p, bad
    return -1, -1
