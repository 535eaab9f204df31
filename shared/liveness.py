"""A process's liveness file: touched by the process while its loop runs, read by a container's
health check.

A service given ``--liveness-file`` touches it at each heartbeat; the check
``python -m shared.liveness FILE MAX_AGE_S`` exits 0 while the file is younger than
``MAX_AGE_S`` seconds and 1 otherwise (missing included). Docker's health checks run it in
compose's containers (docker-compose.yml, ``services/orchestration/compose``), where an unhealthy
job container is killed and started again by the controller.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def mark(path: str | None) -> None:
    """Touch the liveness file ``path`` (None: the process has none). A file that cannot be
    written is logged, never raised: liveness must not stop the service."""
    if path is None:
        return
    try:
        Path(path).touch()
    except OSError as err:
        log.warning("liveness file %s not touched: %s", path, err)


def age_s(path: str) -> float | None:
    """Seconds since the file was last touched (None: it does not exist)."""
    try:
        return max(0.0, time.time() - Path(path).stat().st_mtime)
    except OSError:
        return None


def main(argv: list[str]) -> int:
    """``python -m shared.liveness FILE MAX_AGE_S``: 0 if FILE is younger than MAX_AGE_S."""
    if len(argv) != 2:
        print("usage: python -m shared.liveness FILE MAX_AGE_S", file=sys.stderr)
        return 2
    path, max_age_s = argv[0], float(argv[1])
    age = age_s(path)
    if age is None or age > max_age_s:
        print(f"{path}: {'missing' if age is None else f'{age:.0f} s old'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
