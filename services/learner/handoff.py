"""What the training thread hands on at a step boundary: the uploads the core took go to the
link, durably numbered, and snapshots of the inner state go to the checkpoint writer (one that
matches each hand-off of uploads, and one every ``--checkpoint-every-s`` between uploads).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.learner.checkpoint import CheckpointWriter, take_snapshot
from services.learner.core import LearnerCore, Upload
from services.learner.link import LearnerLink
from services.learner.unit_state import UnitState


def hand_off(
    uploads: list[Upload],
    core: LearnerCore,
    link: LearnerLink,
    unit_state: UnitState,
    writer: CheckpointWriter | None,
    tokens_total: int,
) -> None:
    """Hand uploads just taken from ``core`` to the link, durably numbered.

    First the state file records that every round below ``core.round`` is used (so a restarted
    unit can never reuse one, even if it crashes right after a publish), then a snapshot goes to
    the checkpoint writer (taken now, the anchor matches these uploads), then the uploads are
    queued.
    """
    if not uploads:
        return
    unit_state.reserve(core.round)
    if writer is not None:
        writer.submit(take_snapshot(core, tokens_total, link.residual_copy()))
    for upload in uploads:
        link.submit(upload)


class Handoff:
    """The hand-offs of one unit's training thread, and when the last snapshot was taken."""

    def __init__(
        self,
        core: LearnerCore,
        link: LearnerLink,
        unit_state: UnitState,
        writer: CheckpointWriter | None,
        checkpoint_every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
        core: the unit's protocol core.
        link: the unit's link (uploads, the error-feedback residual).
        unit_state: the unit's durable record (rounds handed out).
        writer: the checkpoint writer; None without ``--checkpoint-dir``.
        checkpoint_every_s: seconds between snapshots within a sync period (0: only at
            uploads).
        clock: seconds on a monotonic clock.
        """
        self.core = core
        self.link = link
        self.unit_state = unit_state
        self.writer = writer
        self.checkpoint_every_s = checkpoint_every_s
        self._clock = clock
        self._snapshot_at = clock()

    def after_step(self, uploads: list[Upload], tokens_total: int) -> None:
        """Hand off the ``uploads`` a step made due (with their snapshot); without any, take a
        snapshot if ``checkpoint_every_s`` have passed since the last one."""
        hand_off(uploads, self.core, self.link, self.unit_state, self.writer, tokens_total)
        now = self._clock()
        if uploads:
            self._snapshot_at = now
        elif self.writer is not None and 0 < self.checkpoint_every_s <= now - self._snapshot_at:
            self.writer.submit(take_snapshot(self.core, tokens_total, self.link.residual_copy()))
            self._snapshot_at = now

    def flush(self, tokens_total: int) -> None:
        """Hand off what is left at the end of training: every fragment's unsent steps."""
        hand_off(
            self.core.flush(), self.core, self.link, self.unit_state, self.writer, tokens_total
        )

    def close(self, tokens_total: int) -> None:
        """Write the final checkpoint and stop the writer. Call after the link flushed its
        queue, so that the residual includes every upload that went out."""
        if self.writer is not None:
            self.writer.close(
                final=take_snapshot(self.core, tokens_total, self.link.residual_copy())
            )
