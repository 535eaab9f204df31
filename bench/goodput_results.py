"""``bench/results/goodput.json``: the runs of ``bench/goodput.py``, the target they are judged
against, and the invocations that made them. ``bench/quality.py`` and ``bench/scaling.py`` read
it through these models."""

from __future__ import annotations

import sys
from pathlib import Path

from evidence import Provenance
from pydantic import BaseModel, Field

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sim.cluster.model import GoodputRun  # noqa: E402

__all__ = ["GoodputResults", "GoodputRun", "Target", "load"]


class Target(BaseModel):
    """The target eval, defined from the first run before any other ran."""

    nats_per_byte: float
    source: str = Field(description="the run it was derived from, and how")
    commit: str
    defined_before: list[str] = Field(description="the runs not yet measured when it was set")


class GoodputResults(BaseModel):
    """Every run, the target, and each invocation that ran some of them."""

    provenance: list[Provenance] = []
    target: Target | None = None
    runs: dict[str, GoodputRun] = {}


def load(path: Path) -> GoodputResults:
    """The stored results (a clear error when there are none)."""
    if not path.exists():
        raise SystemExit(f"{path}: no stored results (run bench/goodput.py first)")
    return GoodputResults.model_validate_json(path.read_text())
