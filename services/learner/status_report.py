"""The training thread's part of the unit's status record (``shared.records.UnitStatus``).

About twice per ``--status-interval-s`` (and at once on a change of state) the training loop's
:class:`StatusReport` hands the link the fields only the training thread knows: its state,
where the core stands (step, round, the fragments' base versions), what the
:class:`~services.learner.accounting.TrainingAccount` tallies (tokens, speeds, time training
and waiting, the loss average), and the job's fixed facts from the settings. The link's
heartbeat adds what the link knows (desired state, unsent queue, counters, latencies) when it
writes the record (``heartbeat.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from services.learner.accounting import Tally, TrainingAccount
from services.learner.core import LearnerCore
from services.learner.link import LearnerLink
from services.learner.settings import LearnerSettings
from shared.records.unit import AdoptionPoint, UnitState


class StatusReport:
    """Reports the training thread's fields of the unit's ``UnitStatus`` to the link.

    Attributes:
        state: what the unit reports it is doing (``running``, ``paused``, ``finishing``, ...).
    """

    def __init__(
        self,
        settings: LearnerSettings,
        core: LearnerCore,
        account: TrainingAccount,
        link: LearnerLink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
        settings: the unit's settings (``status_interval_s`` and the job's fixed facts).
        core: the unit's protocol core (step, round, base versions).
        account: the training thread's books.
        link: where the fields go (:meth:`LearnerLink.set_status`).
        clock: seconds on a monotonic clock (how often to report).
        """
        self.settings = settings
        self.core = core
        self.account = account
        self.link = link
        self.state: UnitState = "running"
        self._clock = clock
        self._reported_at: float | None = None
        # Facts that do not change while the process runs.
        self._fixed: dict[str, Any] = {
            "max_steps": settings.max_steps,
            "slowdown": settings.slowdown,
            "model": settings.model,
            "num_units": settings.num_units,
            "tokens_per_step": core.tokens_per_step,
        }

    def report(self, force: bool = False) -> None:
        """Hand the link the fields as of now, unless the last report is less than half a
        status interval old (``force``: report anyway, and write the lifetime figures)."""
        now = self._clock()
        interval_s = self.settings.status_interval_s / 2
        if not force and self._reported_at is not None and now - self._reported_at < interval_s:
            return
        self._reported_at = now
        self.link.set_status(**self.fields(self.account.tally(write_lifetime=force)))

    def fields(self, tally: Tally) -> dict[str, Any]:
        """The training thread's ``UnitStatus`` fields: state, core, ``tally`` and settings."""
        versions = self.core.base_versions()
        return {
            "state": self.state,
            "step": self.core.step,
            "round": self.core.round,
            "base_version": sum(versions),
            "base_versions": versions,
            "staggered": self.core.staggered,
            "adoptions": [
                AdoptionPoint(
                    step=a.step,
                    fragment=a.fragment,
                    version=a.version,
                    skipped=max(0, a.version - a.previous - 1),
                )
                for a in self.core.adoptions
            ],
            "tokens": tally.tokens,
            "train_loss": round(tally.train_loss, 4) if math.isfinite(tally.train_loss) else None,
            "tokens_per_s": round(tally.tokens_per_s, 1),
            "compute_tokens_per_s": round(tally.compute_tokens_per_s, 1),
            "training_s": round(tally.training_s, 3),
            "sync_wait_s": round(tally.sync_wait_s, 3),
            "lifetime_s": None if tally.lifetime_s is None else round(tally.lifetime_s, 3),
            "lifetime_training_s": round(tally.lifetime_training_s, 3),
            **self._fixed,
        }
