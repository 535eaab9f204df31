"""The files of a ``diloco up`` run: ``pids.json`` (:class:`PidsFile`) and ``summary.json``
(:class:`RunSummary`, with the :class:`ChaosEvent` failures it injected), read by
``bench/`` and the tests."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import (
    Field,
    NonNegativeFloat,
)

from shared.goodput import Goodput
from shared.ledger import Books
from shared.records import (
    Count,
    Record,
)
from shared.records.link import LinkStatus
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStatus


class PidsFile(Record):
    """``<data-dir>/pids.json``: the live children of ``diloco up``, for chaos tests."""

    supervisor: int
    nats_url: str | None = None
    nats_credentials: str | None = None  # the admin's credentials file
    nats_ca_file: str | None = None  # the CA of nats-server's certificate (--tls)
    pids: dict[str, int] = {}
    restarts: dict[str, Count] = {}


ChaosKind = Literal["kill", "pause", "cut"]

CHAOS_KINDS: tuple[str, ...] = get_args(ChaosKind)


class ChaosEvent(Record):
    """One injected failure of ``diloco up --chaos-mtbf-s``
    (``services/orchestration/local/chaos.py``)."""

    at_s: NonNegativeFloat = Field(description="when it starts, seconds after the learners")
    target: str = Field(max_length=100, description="learner-<u>, outer or nats-server")
    kind: ChaosKind
    repair_s: NonNegativeFloat = Field(description="how long it lasts")


class RunSummary(Record):
    """``<data-dir>/summary.json``: how a ``diloco up`` run ended."""

    reason: str
    elapsed_s: NonNegativeFloat
    outer: OuterStatus | None = None
    units: dict[Count, UnitStatus] = {}
    links: dict[str, LinkStatus] = Field({}, description="shaped links by name, last read")
    tokens_per_s: NonNegativeFloat | None = None
    restarts: dict[str, Count] = {}
    ledger: Books
    chaos: list[ChaosEvent] = Field([], description="failures injected, in time order")
    goodput: Goodput | None = Field(
        None, description="from each unit's first training to its end (or the last read)"
    )
    started_at: NonNegativeFloat | None = Field(
        None, description="when the units were started (together), unix seconds"
    )
    chaos_offset_s: float | None = Field(
        None, description="seconds the failure schedule (``chaos``) had run when they started"
    )
