"""Writing benchmark tables into BENCHMARKS.md, one ``## section`` per benchmark."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "BENCHMARKS.md"
OUTPUTS = ("bench/results", "BENCHMARKS.md", "bench/*.png")
HEADER = "# Benchmarks\n\nEvery figure comes from the command written above its table.\n"


def commit(*own: Path) -> str:
    """HEAD, marked ``-dirty`` when tracked files differ from it, other than ``own`` (the
    results a benchmark writes itself, so that its second run in one invocation is not; paths
    outside the repository are not tracked anyway) and the benchmarks' outputs (``OUTPUTS``:
    results, tables and plots are what runs write, not the code they ran)."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    inside = [path for path in own if path.resolve().is_relative_to(REPO)]
    excluded = [f":!{path.resolve().relative_to(REPO)}" for path in inside]
    excluded += [f":!{path}" for path in OUTPUTS]
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", *excluded], cwd=REPO)
    return (head or "unknown") + ("-dirty" if changed.returncode else "")


def shown_command(program: str) -> str:
    """The command line shown above a table: ``program`` and this run's arguments, without
    ``--write``."""
    shown = [argument for argument in sys.argv[1:] if argument != "--write"]
    return " ".join([program, shlex.join(shown)]).strip()


def write_section(section: str, table: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) the section that starts with the heading ``section``."""
    text = path.read_text() if path.exists() else HEADER
    if section in text:
        start = text.index(section)
        end = text.find("\n## ", start + 1)
        rest = text[end + 1 :] if end != -1 else ""
        text = text[:start] + table.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    else:
        text = text.rstrip("\n") + "\n\n" + table
    path.write_text(text)
