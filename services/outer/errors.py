"""The rejection of an upload, raised wherever the outer judges one (intake, validation, the
core and its norm guard) and counted by its reason.

The reasons are one vocabulary, :data:`RejectionReason`: the outer's books count rejections by
it (``OuterLedger.rejected``), its status record and checkpoints carry those counts, and the
gateway and the tests read them. ``LedgerRecord.rejected`` keeps ``dict[str, int]``, so that a
gateway, or an outer restoring a checkpoint, accepts a reason that a newer outer counts rather
than reject the whole record. No JAX here.
"""

from __future__ import annotations

from typing import Literal, get_args

RejectionReason = Literal[
    # Chunks that make no upload (services/outer/intake.py).
    "bad_chunk_header",  # a chunk without valid upload, index and size headers
    "bad_chunk",  # a chunk its upload's reassembly refuses (inconsistent layout, oversize)
    "incomplete_upload",  # evicted before all its chunks arrived
    # A complete upload that fails a check (services/outer/validation.py lists them).
    "bad_envelope",
    "wrong_kind",
    "wrong_job",
    "wrong_model",
    "inconsistent_ids",
    "wrong_fragment",
    "unknown_unit",
    "implausible_work",
    "bad_payload",
    "shape_mismatch",
    # A valid upload sent again (services/outer/order.py).
    "round_replayed",  # a round below one of the same unit the outer already took
    "payload_replayed",  # the same payload as an upload accepted recently
    # A valid upload the core does not merge (services/outer/core.py, norm_guard.py).
    "future_base_version",
    "too_stale",
    "norm_outlier",
    # A valid upload its peers' latest uploads do not vouch for (services/outer/peers.py).
    "too_frequent",  # more often than PACE_FACTOR x the median peer's pace
    "direction_outlier",  # its median cosine with the peers' uploads below DIRECTION_FLOOR
    # An upload of a unit quarantined through the REST API (its desired state).
    "quarantined",
]
#: Every rejection reason.
REJECTION_REASONS: tuple[RejectionReason, ...] = get_args(RejectionReason)


class Rejected(Exception):
    """An upload that is not applied; ``reason`` is the counter it is recorded under."""

    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: RejectionReason = reason
        self.detail = detail
