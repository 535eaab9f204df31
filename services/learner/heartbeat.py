"""A learner unit's heartbeat: its ``shared.records.UnitStatus`` in KV ``diloco_status``.

The record is written every ``--status-interval-s`` and once more when the link stops. It
joins what the training thread reports (:meth:`Heartbeat.set_status`: state, step, loss,
speed, time spent in calls to the link, ...) with what the link knows at the moment of
writing: the desired state, the unsent queue, upload and params latencies, this process's
counters (with ``records_rejected``, the records this process could not
parse), the lifetime counts and rounds from the state file, and the last error. Readers judge
liveness by the record's age on the NATS server's clock, so it carries no time of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from services.learner.counters import Counters
from services.learner.params_fetcher import ParamsFetcher
from services.learner.sender import Sender
from services.learner.settings import LearnerSettings
from services.learner.unit_control import UnitControl
from services.learner.unit_state import UnitState
from shared import kv, liveness, records, subjects
from shared.cancel import raise_if_cancelling
from shared.records.unit import UnitStatus
from shared.retry import NATS_ERRORS

log = logging.getLogger(__name__)


class Heartbeat:
    """Builds the unit's status record and writes it to KV."""

    def __init__(
        self,
        settings: LearnerSettings,
        unit_state: UnitState,
        counters: Counters,
        sender: Sender,
        control: UnitControl,
        params: ParamsFetcher,
    ) -> None:
        """Args:
        settings: the unit's settings (job, unit, ``status_interval_s``).
        unit_state: the unit's durable record (lifetime counts, published rounds).
        counters: this process's counters and last error.
        sender: the upload queue (unsent uploads, last published round, upload latency).
        control: the unit's desired state.
        params: the params fetcher (params latency).
        """
        self.settings = settings
        self.unit_state = unit_state
        self.counters = counters
        self.sender = sender
        self.control = control
        self.params = params
        self.restored_from_step: int | None = None
        self._lock = threading.Lock()
        self._progress = UnitStatus(unit=settings.unit)

    def set_status(self, **fields: Any) -> None:
        """Replace the training thread's fields (``UnitStatus`` field names) in the next
        heartbeats.

        Raises:
            TypeError: a name is not a ``UnitStatus`` field.
            pydantic.ValidationError: a value does not fit its field.
        """
        unknown = set(fields) - set(UnitStatus.model_fields)
        if unknown:
            raise TypeError(f"not UnitStatus fields: {sorted(unknown)}")
        with self._lock:
            self._progress = UnitStatus.model_validate(
                {**self._progress.model_dump(), **fields, "unit": self.settings.unit}
            )

    def record(self) -> UnitStatus:
        """The status record as of now."""
        durable = self.unit_state.as_record()
        counters = self.counters.as_dict()
        counters["records_rejected"] = records.rejections.total()
        with self._lock:
            progress = self._progress
        return progress.model_copy(
            update={
                "desired": self.control.desired_state,
                "unsent": self.sender.unsent(),
                "counters": counters,  # this process
                "lifetime": durable.lifetime,  # across restarts (with a state file)
                "published_rounds": durable.published,
                "next_round": durable.next_round,
                "last_published_round": self.sender.last_published_round,
                "restored_from_step": self.restored_from_step,
                "last_error": self.counters.last_error,
                "upload_latency": self.sender.upload_latency.summary(),
                "params_latency": self.params.params_latency.summary(),
                "sync_latency": self.params.sync_latency.latencies.summary(),
            }
        )

    async def put(self, status_kv: Any) -> None:
        """Write the record once.

        Raises:
            TimeoutError, OSError, nats.errors.Error: NATS unreachable.
        """
        key = subjects.unit_status_key(self.settings.job, self.settings.unit)
        await kv.put(status_kv, key, self.record())

    async def run(self, status_kv: Any) -> None:
        """Write the record every ``status_interval_s`` (forever), and touch the liveness
        file, if any, each time (also while NATS is unreachable: the process is alive)."""
        while True:
            try:
                await self.put(status_kv)
            except NATS_ERRORS as err:
                log.info("heartbeat: %r", err)
            liveness.mark(self.settings.liveness_file)
            await asyncio.sleep(self.settings.status_interval_s)
            raise_if_cancelling()
