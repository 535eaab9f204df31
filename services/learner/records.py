"""A learner's own files under ``<checkpoint-dir>/J/unit-<u>/``, read back by the same unit after a
restart: the state file (:class:`UnitStateFile`, ``unit_state.py``) and the checkpoint's metadata
(:class:`LearnerCheckpointMeta`, ``checkpoint.py``)."""

from __future__ import annotations

from pydantic import (
    Field,
    NonNegativeFloat,
)

from shared.records import (
    Count,
    Record,
    RoundRanges,
)
from shared.records.jobs import DesiredState


class UnitStateFile(Record):
    """A learner's small durable record: rounds used and published, desired state, lifetime
    counters (``services/learner/unit_state.py``)."""

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


class FragmentSyncRecord(Record):
    """Where one fragment of a learner stands between two uploads."""

    base_version: Count
    steps: Count
    tokens: Count
    loss_sum: float
    target: int = Field(ge=1)


class UnitIdentity(Record):
    """Which unit a learner checkpoint belongs to."""

    job: str
    unit: Count
    model: str
    fragments: int = Field(ge=1)


class LearnerCheckpointMeta(Record):
    """The ``meta`` entry of a learner's ``checkpoint.npz`` (``services/learner/checkpoint.py``)."""

    identity: UnitIdentity
    step: Count
    round: Count
    current_h: int = Field(ge=1)
    syncs: list[FragmentSyncRecord]
    staggered: bool = Field(description="the fragments' uploads are spread over the period")
    tokens_total: Count
    param_names: list[str]
    opt_leaves: Count
    residual_names: list[str] = []
    taken_at: float = Field(description="unix time of the snapshot (for humans)")
