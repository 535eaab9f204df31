"""A learner unit's heartbeat: :class:`UnitStatus` in KV ``diloco_status``, key ``J.unit.<u>``,
written by learner u, read by the gateway, ``diloco up`` and the other learners (their speeds)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import (
    Field,
    NonNegativeFloat,
)

from shared.model_config import ModelSize
from shared.records import (
    MAX_ERROR_CHARS,
    Count,
    Record,
    RoundRanges,
    Stamped,
    liveness,
)
from shared.records.jobs import DesiredState
from shared.unit_counters import CounterName

#: What a unit reports about itself.
UnitState = Literal["starting", "idle", "running", "paused", "finishing", "finished", "stopped"]

UNIT_STATES: tuple[str, ...] = get_args(UnitState)

#: Unit states in which a silent unit is not lost: it ended on purpose.
ENDED_STATES = ("finished", "stopped")


class LatencySummary(Record):
    """Percentiles of a unit's recent durations of one kind, on its own monotonic clock."""

    count: Count = Field(description="durations measured in all")
    p50_s: NonNegativeFloat
    p95_s: NonNegativeFloat
    p99_s: NonNegativeFloat
    max_s: NonNegativeFloat


class AdoptionPoint(Record):
    """A global version of a fragment the unit adopted, at one of its inner steps."""

    step: Count
    fragment: Count
    version: Count
    skipped: Count = Field(description="versions published since the one it replaced, unseen")


class UnitStatus(Record):
    """A learner unit's heartbeat (every ``--status-interval-s``)."""

    unit: Count
    state: UnitState = "starting"
    desired: DesiredState = "running"
    step: Count = 0
    max_steps: Count | None = None
    round: Count = Field(0, description="the next round number this unit hands out")
    base_version: Count = Field(0, description="sum of the fragments' base versions")
    base_versions: list[Count] = []
    staggered: bool = Field(
        False, description="whether the unit spreads its fragments' uploads over the period"
    )
    adoptions: list[AdoptionPoint] = Field([], description="the unit's newest adoptions")
    train_loss: float | None = None
    tokens: Count = Field(0, description="tokens trained, across restarts (with checkpoints)")
    tokens_per_s: NonNegativeFloat = Field(0.0, description="recent training speed")
    training_s: NonNegativeFloat = Field(
        0.0, description="seconds this process has spent training (not paused or idle)"
    )
    compute_tokens_per_s: NonNegativeFloat = Field(
        0.0,
        description="the unit's healthy speed over its life: tokens it computed (steps trained "
        "again after a crash included) over the seconds it spent computing (waits at sync "
        "points excluded), across restarts (goodput's yardstick)",
    )
    slowdown: float = Field(1.0, ge=1.0)
    model: ModelSize | None = Field(None, description="the model the unit trains")
    num_units: Count = Field(0, description="units of the job, as the unit was started")
    tokens_per_step: Count = Field(0, description="tokens one inner step trains (batch × seq)")
    upload_latency: LatencySummary | None = Field(
        None, description="an upload's time from the training loop to JetStream's acceptance"
    )
    params_latency: LatencySummary | None = Field(
        None,
        description="a global's time from its head's notification to the training loop taking it",
    )
    sync_latency: LatencySummary | None = Field(
        None,
        description="an upload's time from its sync point to the first params head that "
        "includes it (the outer applied it and published the result)",
    )
    network_wait_s: NonNegativeFloat = Field(
        0.0, description="seconds the training loop spent in calls to the NATS link"
    )
    lifetime_s: NonNegativeFloat | None = Field(
        None,
        description="seconds since the unit first trained, on its own clock and across its "
        "restarts (time dead, paused or waiting included): goodput's window",
    )
    lifetime_training_s: NonNegativeFloat = Field(
        0.0,
        description="seconds the unit's processes spent training (not dead, paused or idle), "
        "across restarts: its up time within goodput's window",
    )
    sync_wait_s: NonNegativeFloat = Field(
        0.0,
        description="seconds the training loop waited at sync points for the merged global "
        "(--mode sync; 0 in the decoupled mode)",
    )
    unsent: Count = Field(0, description="uploads queued, not yet accepted by JetStream")
    counters: dict[str, Count] = Field({}, description="this process's counters")
    lifetime: dict[str, Count] = Field({}, description="upload counters across restarts")
    published_rounds: RoundRanges = Field([], description="rounds JetStream accepted (lifetime)")
    next_round: Count = 0
    last_published_round: Count | None = None
    restored_from_step: Count | None = None
    last_error: str = Field("", max_length=MAX_ERROR_CHARS)

    def counter(self, name: CounterName) -> int:
        """One of this process's counters (0 when it was never counted)."""
        return self.counters.get(name, 0)


def unit_liveness(entry: Stamped[UnitStatus] | None, timeout_s: float) -> str:
    """A unit's shown state: ``absent`` (never reported), ``lost``, or what it reports."""
    if entry is None:
        return "absent"
    return liveness(entry.record.state, entry.age_s, timeout_s, ENDED_STATES)


class UnitStateFile(Record):
    """A learner's small durable record, ``<checkpoint-dir>/J/unit-<u>/state.json``: rounds
    used and published, desired state, lifetime counters. Written and read back by the unit
    (``services/learner/unit_state.py``); read by ``diloco up`` for a unit it stopped for good
    (a quarantined one), whose status record can no longer catch up."""

    job: str
    unit: Count
    next_round: Count = Field(0, description="first round number never handed out yet")
    desired: DesiredState = "running"
    published: RoundRanges = Field([], description="rounds JetStream accepted (lifetime)")
    lifetime: dict[str, Count] = {}
    first_trained_at: NonNegativeFloat | None = Field(
        None, description="when the unit first trained (unix seconds, its own clock)"
    )
    trained_s: NonNegativeFloat = Field(
        0.0, description="seconds the unit's processes have spent training, across restarts"
    )
    computing_s: NonNegativeFloat = Field(
        0.0, description="of those, seconds computing (waits at sync points excluded)"
    )
    computed_tokens: Count = Field(
        0, description="tokens computed meanwhile (steps trained again after a crash included)"
    )
