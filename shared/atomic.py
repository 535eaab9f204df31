"""Crash-safe file replacement: a reader sees the old file or the new one, never a torn one.

The new content goes to a temporary file beside the target, which is flushed, fsynced and
renamed over the target with ``os.replace`` (atomic on POSIX); then the directory is fsynced so
that the rename itself survives a power cut. A crash at any point leaves at most a stale
temporary file, which the next write overwrites and which readers never look at.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"


def temp_file(path: Path) -> Path:
    """The temporary file a write of ``path`` goes through (``<name>.tmp`` beside it)."""
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_dir(directory: Path) -> None:
    """Make renames and creations in ``directory`` durable (best effort where unsupported)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some file systems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Replace ``path`` with what ``write`` writes to the file handle it is given.

    Callers serialise writes to one path (the temporary file name is fixed).

    Raises:
        OSError: when the file cannot be written; ``path`` is then unchanged.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_file(path)
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (see :func:`atomic_write`)."""
    atomic_write(path, lambda handle: handle.write(data))


PRIVATE = 0o600


def write_private_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``, readable and writable by its owner only (a secret).

    The temporary file is made private before the data goes into it, so the secret is never in
    a file that others may read.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(temp_file(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE)
    try:
        os.fchmod(fd, PRIVATE)  # also when a stale temporary file had other bits
    finally:
        os.close(fd)
    atomic_write_bytes(path, data)
