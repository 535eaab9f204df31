"""What every codec kernel is compiled with, and the float32 bit patterns they test.

The kernels (:mod:`shared.codec.quantize`, :mod:`shared.codec.dequantize`,
:mod:`shared.codec.floats`) are compiled by Numba with these options: ``nogil``, so a caller
may run them beside zstd or JAX in another thread; ``cache``, so a later process loads them
from disk (docs/CODEC.md, "Compile once"); no bounds checks; and only the fast-math flags
below.
"""

from __future__ import annotations

import numpy as np

# NaN/Inf semantics stay IEEE (no nnan/ninf) because finiteness is checked in the kernels
# themselves. No "reassoc" or "arcp" in the kernels: with them LLVM rewrites x * (qmax / absmax)
# into (x * qmax) / absmax, a division per value, and rounds ties differently in different
# inlined copies of the same loop (the error-feedback path disagreed with the plain one). The
# integer reductions (absmax over the float bits) vectorise without reassociation.
FASTMATH = {"nsz", "contract"}
JIT = {"nogil": True, "cache": True, "boundscheck": False, "fastmath": FASTMATH}
# Helpers are inlined into the kernels at Numba-IR level: compiled as separate functions, their
# array arguments lose what LLVM knows about them (fresh, non-aliasing scratch) and the loops
# vectorise worse. Two are deliberately not inlined, to keep flags of their own:
# _quantize_exact (strict IEEE) and _quantize_ternary (reassociation, which its float sums
# need to vectorise).
INLINE = {**JIT, "inline": "always"}
REDUCE = {**JIT, "fastmath": FASTMATH | {"reassoc"}}

ABS_MASK = np.uint32(0x7FFFFFFF)
EXP_MASK = np.uint32(0x7F800000)  # |bits| >= this: Inf or NaN
F32_MAX = float(np.finfo(np.float32).max)
