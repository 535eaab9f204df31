"""What an upload codec configuration is, and how it is validated, without the codec's kernels.

Settings and the gateway validate a codec choice here without importing Numba or libzstd;
:mod:`shared.codec.api` encodes and decodes with a :class:`CodecConfig` (its docstring
describes every scheme).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

CodecName = Literal["fp32", "bf16", "int8", "int4", "int2"]
BITS: dict[str, int] = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "int2": 2}
CODECS: tuple[str, ...] = get_args(CodecName)
BLOCK_CODECS = ("int8", "int4", "int2")
if tuple(BITS) != CODECS:
    raise ImportError("BITS and CodecName must name the same codecs, in the same order")

# Block sizes are multiples of 16 so that every packed block is a whole number of 32-bit
# words (int2 packs 4 codes per byte) and every scale stays 4-byte aligned in the raw layout.
BLOCK_MULTIPLE = 16
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 1 << 20
# libzstd's ZSTD_minCLevel() and ZSTD_maxCLevel(). shared/codec/zstd.py checks the maximum against
# python-zstandard's MAX_COMPRESSION_LEVEL at import; python-zstandard does not expose the minimum.
MIN_ZSTD_LEVEL = -(1 << 17)
MAX_ZSTD_LEVEL = 22


class CodecError(ValueError):
    """Raised for any tensor that cannot be encoded or any payload that cannot be decoded."""


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (Python or NumPy), not a bool."""
    # bool is an int subclass, but True is never a meaningful size or count. The exact-type
    # test first: descriptions hold thousands of plain ints, and it is the cheap one.
    return type(value) is int or (
        isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
    )


def check_block_size(block_size: Any) -> int:
    """``block_size`` as an int; raises :class:`CodecError` unless it is a valid block size."""
    if (
        not is_int(block_size)
        or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
        or block_size % BLOCK_MULTIPLE
    ):
        raise CodecError(
            f"block_size must be a multiple of {BLOCK_MULTIPLE} in "
            f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r:.100}"
        )
    return int(block_size)


def check_zstd_level(level: Any) -> int:
    """``level`` as an int; raises :class:`CodecError` unless libzstd accepts it."""
    if not is_int(level) or not MIN_ZSTD_LEVEL <= level <= MAX_ZSTD_LEVEL:
        raise CodecError(
            f"zstd_level must be an int in [{MIN_ZSTD_LEVEL}, {MAX_ZSTD_LEVEL}], got {level!r}"
        )
    return int(level)


@dataclass(frozen=True)
class CodecConfig:
    """How pseudo-gradients are encoded; validated on construction. Its defaults are the
    settings' (``shared.settings.codec``, ``shared.settings.resources``): written here once.

    Attributes:
        codec: One of :data:`CODECS`.
        block_size: Elements per quantisation block (block codecs); a multiple of 16.
        zstd_level: zstd level; negative levels are fast and barely compress.
        threads: Worker threads (quantise + zstd) for payloads of at least 8 MiB raw; 0
            codes on the calling thread, -1 uses one thread per CPU.
        error_feedback: Keep the quantisation residual and add it to the next round.
    """

    codec: str = "int8"
    block_size: int = 256
    zstd_level: int = 1
    threads: int = 0
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise CodecError(f"unknown codec {self.codec!r}; expected one of {CODECS}")
        check_block_size(self.block_size)
        check_zstd_level(self.zstd_level)
        if not is_int(self.threads) or self.threads < -1:
            raise CodecError(f"threads must be an int >= -1, got {self.threads!r}")
        if not isinstance(self.error_feedback, bool):
            raise CodecError(f"error_feedback must be a bool, got {self.error_feedback!r}")
        if self.error_feedback and self.codec == "fp32":
            raise CodecError("error_feedback needs a lossy codec; fp32 loses nothing")
