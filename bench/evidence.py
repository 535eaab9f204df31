"""What makes a benchmark evidence: its raw results stored with where they came from, its
claims checked in code, and its BENCHMARKS.md section rendered from the stored results.

Every benchmark script follows one pattern:

* it measures, and stores the raw figures with a :class:`Provenance` (commit, command,
  configuration, machine, how long it ran) in ``bench/results/<name>.json``;
* ``--render`` runs nothing: it renders the section from that file (so a table is always the
  stored figures, never in-memory ones);
* its claims are :class:`Claim` objects computed from the stored figures, shown under its table,
  and :func:`exit_on` makes the script exit non-zero when one fails or was not measured;
* ``--quick`` is its smoke version (``make bench-quick``): the same code path at a small scale,
  writing under :func:`quick_dir` instead of ``bench/results/`` and leaving BENCHMARKS.md alone.
  A quick run's claims are printed, but only an unmeasured one fails it: small runs are not
  expected to reach the full run's figures, only to produce every one of them.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from report import REPO, commit, shown_command, write_section

RESULTS_DIR = REPO / "bench" / "results"


def machine() -> str:
    """This machine, as the results name it."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


class Provenance(BaseModel):
    """Where a set of raw results came from."""

    commit: str = Field(description="git HEAD when the run started, '-dirty' if edited")
    command: str = Field(description="the command line that made the results")
    machine: str
    started: str = Field(description="UTC, ISO 8601")
    seconds: float = Field(0.0, description="the whole run's wall-clock seconds")
    configuration: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def start(cls, program: str, configuration: dict[str, Any], *own: Path) -> Provenance:
        """The provenance of a run starting now: ``program`` with this process's arguments."""
        return cls(
            commit=commit(*own),
            command=shown_command(program),
            machine=machine(),
            started=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            configuration=configuration,
        )

    def line(self, path: Path) -> str:
        """The sentence under a section's heading that names the command, commit and file."""
        try:
            shown = path.relative_to(REPO)
        except ValueError:
            shown = path
        return (
            f"`{self.command}` at commit `{self.commit}` on {self.machine}, "
            f"{self.started}; {self.seconds / 60:.1f} min in all. Raw results: `{shown}`."
        )


@dataclass
class Claim:
    """One claim of a benchmark: what it says, what was measured, and whether it holds
    (``None``: not measured)."""

    text: str
    measured: str
    holds: bool | None


def at_most(text: str, value: float | None, bound: float, spec: str = ".3f") -> Claim:
    """``value ≤ bound``."""
    if value is None:
        return Claim(text, "not measured", None)
    return Claim(text, format(value, spec), value <= bound)


def at_least(text: str, value: float | None, bound: float, spec: str = ".3f") -> Claim:
    """``value ≥ bound``."""
    if value is None:
        return Claim(text, "not measured", None)
    return Claim(text, format(value, spec), value >= bound)


def ratio_at_most(text: str, value: float | None, base: float | None, bound: float) -> Claim:
    """``value / base ≤ bound``."""
    if value is None or base is None or base == 0:
        return Claim(text, "not measured", None)
    ratio = value / base
    return Claim(text, f"{value:.4f} / {base:.4f} = {ratio:.3f}", ratio <= bound)


def ratio_at_least(text: str, value: float | None, base: float | None, bound: float) -> Claim:
    """``value / base ≥ bound``."""
    if value is None or base is None or base == 0:
        return Claim(text, "not measured", None)
    ratio = value / base
    return Claim(text, f"{value:.4f} / {base:.4f} = {ratio:.3f}", ratio >= bound)


def ratio_within(
    text: str, value: float | None, base: float | None, low: float, high: float
) -> Claim:
    """``low ≤ value / base ≤ high``."""
    if value is None or base is None or base == 0:
        return Claim(text, "not measured", None)
    ratio = value / base
    return Claim(text, f"{value:.4f} / {base:.4f} = {ratio:.3f}", low <= ratio <= high)


def render_claims(claims: Iterable[Claim]) -> str:
    """The claims as the list under a table."""
    lines = ["Claims (checked by the script; it exits 1 when one fails or is not measured):", ""]
    for claim in claims:
        verdict = {True: "holds", False: "FAILS", None: "NOT MEASURED"}[claim.holds]
        lines.append(f"- {verdict}: {claim.text} ({claim.measured})")
    return "\n".join(lines) + "\n"


def failures(claims: Iterable[Claim], quick: bool = False) -> list[Claim]:
    """The claims that make the run fail: every one that does not hold, or in a quick run only
    those not measured."""
    if quick:
        return [c for c in claims if c.holds is None]
    return [c for c in claims if not c.holds]


def exit_on(claims: list[Claim], quick: bool = False) -> None:
    """Exit 1, naming them, when :func:`failures` finds any."""
    failed = failures(claims, quick)
    for claim in claims:
        verdict = {True: "holds", False: "fails", None: "not measured"}[claim.holds]
        print(f"claim {verdict}: {claim.text} ({claim.measured})", file=sys.stderr)
    if failed:
        names = "; ".join(c.text for c in failed)
        kind = "are not measured" if quick else "fail or are not measured"
        raise SystemExit(f"{len(failed)} of {len(claims)} claims {kind}: {names}")


def publish(section: str, text: str, claims: list[Claim], write: bool, quick: bool) -> None:
    """Print a rendered section, write it into BENCHMARKS.md when asked (never from a quick
    run), and exit on its claims (:func:`exit_on`)."""
    print(text)
    if write and not quick:
        write_section(section, text)
    exit_on(claims, quick)


def quick_dir() -> Path:
    """Where quick runs store their results: ``$BENCH_QUICK_DIR`` or a fresh temporary folder."""
    chosen = os.environ.get("BENCH_QUICK_DIR")
    path = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="bench-quick-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def results_path(name: str, quick: bool) -> Path:
    """``bench/results/<name>.json``, or its place under :func:`quick_dir` in a quick run."""
    return (quick_dir() if quick else RESULTS_DIR) / f"{name}.json"


def save(path: Path, results: BaseModel) -> None:
    """Write ``results`` (a model holding a :class:`Provenance`) as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results.model_dump_json(indent=1) + "\n")


def note(text: str) -> None:
    """A progress line on stderr, so that stdout keeps the rendered section."""
    print(text, file=sys.stderr, flush=True)
