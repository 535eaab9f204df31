"""The files ``diloco up`` leaves in its data folder for people and scripts.

* ``token`` — the gateway's API token (plain text, readable by its owner only);
* ``pids.json`` — :class:`shared.records.PidsFile`: the live children's PIDs, rewritten as they
  start, exit and restart (chaos tests pick their victims from it);
* ``summary.json`` — :class:`shared.records.RunSummary`: how the run ended.

Every file is replaced atomically (``shared.atomic``), so a reader sees the previous content or
the new one, never a torn file. The readers never raise: a missing, unreadable or malformed file
reads as None (a malformed one is counted in ``shared.records.rejections``).
"""

from __future__ import annotations

from pathlib import Path

from services.orchestration.local.records import PidsFile, RunSummary
from shared import atomic, records
from shared.records import R

TOKEN_FILE = "token"
PIDS_FILE = "pids.json"
SUMMARY_FILE = "summary.json"


def write_token(data_dir: Path, token: str) -> Path:
    """Write the gateway's API token to ``<data-dir>/token``, readable by its owner only.

    Returns:
        The token file's path.
    """
    path = data_dir / TOKEN_FILE
    atomic.write_private_bytes(path, f"{token}\n".encode())
    return path


def write_pids(data_dir: Path, pids: PidsFile) -> None:
    """Replace ``<data-dir>/pids.json``."""
    atomic.atomic_write_bytes(data_dir / PIDS_FILE, records.encode(pids))


def read_pids(data_dir: Path) -> PidsFile | None:
    """``<data-dir>/pids.json``, or None when it is missing or malformed."""
    return _read(data_dir / PIDS_FILE, PidsFile)


def write_summary(data_dir: Path, summary: RunSummary) -> None:
    """Replace ``<data-dir>/summary.json``."""
    atomic.atomic_write_bytes(data_dir / SUMMARY_FILE, records.encode(summary))


def read_summary(data_dir: Path) -> RunSummary | None:
    """``<data-dir>/summary.json``, or None when it is missing or malformed."""
    return _read(data_dir / SUMMARY_FILE, RunSummary)


def _read(path: Path, model: type[R]) -> R | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return records.decode(model, data, str(path))
