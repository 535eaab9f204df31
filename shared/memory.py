"""Keep freed memory in the process, for services that allocate the same large buffers over
and over.

The outer allocates arrays of a whole fragment (44 MB of float32 for ``medium``) for every
upload it decodes, scales and merges, and a buffer of its whole state (params and optimizer
state, 130 MB for ``medium``) for every checkpoint. By default glibc's ``malloc`` serves
requests of over 32 MiB with a fresh ``mmap`` and gives them back with ``munmap`` on ``free``;
it trims a heap's free top above 128 KiB; and each thread allocates from an arena of its own
whose heaps hold at most 64 MiB, so a larger buffer made on a worker thread is always a fresh
``mmap``. Every such buffer then costs page faults and the zeroing of all its pages, each
time: in the load test that was the outer's largest cost (``perf``: ``clear_page_erms``).
:func:`keep_freed_memory` has ``malloc`` serve every request from the one main heap and never
give freed memory back: the process reuses it, and its resident size stays at its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# mallopt takes an int: the heap trims only a free top of 2 GiB or more.
_TRIM_AT = 2**31 - 1


def keep_freed_memory() -> bool:
    """Have glibc's ``malloc`` keep freed memory for reuse (see the module docstring).

    Call it at the start of a process, before its threads allocate.

    Returns:
        Whether it took effect: False where the C library is not glibc (musl, macOS), which
        then allocates as it always does.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no mallopt in this C library: freed memory is returned as usual")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_AT))
    return all(mallopt(param, value) == 1 for param, value in settings)
