"""A learner's checkpoint files under ``<checkpoint-dir>/J/unit-<u>/``, read back by the same unit
after a restart: the checkpoint's metadata (:class:`LearnerCheckpointMeta`, ``checkpoint.py``).
Its state file, which ``diloco up`` reads too, is ``shared.records.unit.UnitStateFile``."""

from __future__ import annotations

from pydantic import (
    Field,
)

from shared.records import (
    Count,
    Record,
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
