"""The compiled kernel that turns packed int8/int4/int2 blocks back into float32.

It inverts :func:`shared.codec.quantize.encode_blocks` (the schemes and the planar packing
are described there) and is compiled with the options of :mod:`shared.codec.jit`. Its input
comes off the wire, so it also checks it: it returns -1, or the index of the first block with
an invalid scale or code; blocks before it may already have been written.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from shared.codec.jit import EXP_MASK, F32_MAX, JIT

__all__ = ["decode_blocks"]


@njit(**JIT)
def decode_blocks(codes, scales, bits, block_size, out):  # pragma: no cover - compiled
    """Invert :func:`encode_blocks` into ``out`` (``len(scales) * block_size`` float32).

    Returns -1, or the index of the first block whose scale is negative/NaN/Inf or so large
    that ``qmax * scale`` overflows (the encoder never writes one; see :func:`_absmax_scale`),
    or whose codes are outside the scheme (-128 for int8, -8 for int4, the unused ``10`` for
    int2).
    """
    bpb = block_size * bits // 8
    qmax = 127 if bits == 8 else (7 if bits == 4 else 1)
    sbits = scales.view(np.uint32)
    codes8 = codes.view(np.int8)  # made once, not per block
    for b in range(scales.size):
        if sbits[b] >= EXP_MASK:  # NaN/Inf, or the sign bit set (the encoder writes +0.0)
            return b
        if float(scales[b]) * qmax > F32_MAX:  # a finite scale whose largest code is Inf
            return b
        scale = scales[b]
        cb = codes[b * bpb : (b + 1) * bpb]
        ob = out[b * block_size : (b + 1) * block_size]
        bad = np.uint8(0)
        # Validity is folded into branch-free reductions so that the loops vectorise.
        if bits == 8:
            c8 = codes8[b * bpb : (b + 1) * bpb]
            low = np.int8(127)
            for i in range(block_size):
                code = c8[i]
                low = min(low, code)
                ob[i] = np.float32(code) * scale
            bad = np.uint8(low == -128)
        elif bits == 4:
            h = block_size // 2
            lo = ob[:h]
            hi = ob[h:]
            c8 = codes8[b * bpb : (b + 1) * bpb]
            low = np.int8(0)
            # Every step stays in int8 (shifts sign-extend the nibbles); in wider integers
            # the loop vectorises over fewer lanes and runs at half the speed.
            for j in range(h):
                byte = c8[j]
                a = np.int8(np.int8(byte << np.int8(4)) >> np.int8(4))
                c = np.int8(byte >> np.int8(4))
                low = min(low, min(a, c))
                lo[j] = np.float32(a) * scale
                hi[j] = np.float32(c) * scale
            bad = np.uint8(low == -8)
        else:
            h = block_size // 4
            o0 = ob[:h]
            o1 = ob[h : 2 * h]
            o2 = ob[2 * h : 3 * h]
            o3 = ob[3 * h :]
            for j in range(h):
                byte = np.int32(cb[j])
                # A field is 10 (invalid) where its high bit is set and its low bit is not.
                bad |= np.uint8((byte >> 1) & ~byte & 0x55)
                o0[j] = np.float32((byte & 1) - (byte & 2)) * scale
                o1[j] = np.float32(((byte >> 2) & 1) - ((byte >> 2) & 2)) * scale
                o2[j] = np.float32(((byte >> 4) & 1) - ((byte >> 4) & 2)) * scale
                o3[j] = np.float32(((byte >> 6) & 1) - ((byte >> 6) & 2)) * scale
        if bad:
            return b
    return -1
