"""The ``diloco up`` command line the benchmarks run: this checkout's Python, a data folder,
a free gateway port."""

from __future__ import annotations

import sys


def up_command(data_dir: str, *flags: str) -> list[str]:
    """``diloco up`` with its data in ``data_dir``, the gateway on a free port, and ``flags``."""
    return [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--data-dir",
        data_dir,
        "--gateway-port",
        "0",
        *flags,
    ]
