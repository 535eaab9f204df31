"""``shared.memory``: a process that keeps freed memory reuses it instead of faulting in fresh
pages for every large buffer."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh interpreter: allocate and free fragment-sized buffers (44 MB, as the outer does
# for every upload of ``medium``) on a worker thread, and print the page faults they cost.
PROGRAM = """
import resource, sys, threading
import numpy as np
from shared.memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def churn():
    for _ in range(20):
        a = np.ones(11_000_000, np.float32)
        b = bytes(a.data)
        del a, b
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
worker = threading.Thread(target=churn)
worker.start()
worker.join()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_kept_memory_is_reused_without_page_faults() -> None:
    kept, with_keep = faults("keep")
    _, without = faults("default")
    assert kept == "True"
    # 20 rounds of 88 MB are 430,000 fresh 4 KiB pages by default; kept, about one round's.
    assert with_keep * 5 < without, (with_keep, without)
