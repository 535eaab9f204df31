"""What the rest of the job tells one learner unit: its desired state, where its round numbers
continue, and its peers' speeds.

* The desired state (``shared.records.DesiredRecord`` in KV ``diloco_desired``) is read when
  a write of it is heard (a subscription to its KV subject), and every ``DESIRED_POLL_S`` in
  case a notification was missed (while reconnecting; every ``WAITING_POLL_S`` while the unit
  waits to be resumed). It starts from the one the unit's state file remembers, so a paused
  unit restarted while NATS is down stays paused, and every change is remembered there.
* The outer's next round for this unit (``OuterStatus.next_round``) is read once at start-up, so
  that a unit without a state file never reuses a round the outer has applied.
* With Dynamic Local Updates, every unit's speed (``UnitStatus.tokens_per_s`` of the running
  units) is polled every ``RATES_POLL_S``.

On a slow link these reads share the unit's link with its uploads and params, so they are few:
a notified read per change, a poll every few seconds, and peers' speeds (whole status records)
at the pace DyLU needs them (it uses them once per sync period).

A missing record reads as no news; a malformed one is rejected (``shared.records``) and
changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from services.learner.settings import LearnerSettings
from services.learner.unit_state import UnitState
from shared import kv, subjects
from shared.cancel import raise_if_cancelling
from shared.outer_shards import read_outer_status
from shared.records.jobs import DesiredRecord, DesiredState
from shared.records.unit import UnitStatus
from shared.retry import NATS_ERRORS

log = logging.getLogger(__name__)

DESIRED_POLL_S = 5.0  # fallback for a missed notification
# The same while the unit waits to be resumed (paused or idle): a missed resume costs it the whole
# wait, and a unit that waits sends nothing else.
WAITING_POLL_S = 1.0
DESIRED_RETRY_S = 0.5  # after a read that failed
# A write can be heard before JetStream has stored it: nats-server hands a published message to
# the subject's subscribers and queues it for the stream at once. A read that finds no change
# after a heard write is made again this often, this many times, not only at the next poll.
DESIRED_RECHECK_S = 0.2
DESIRED_RECHECKS = 5
RATES_POLL_S = 10.0
OUTER_STATUS_TIMEOUT_S = 2.0


class UnitControl:
    """The unit's desired state, the outer's next round for it and its peers' speeds.

    The training thread reads the attributes at step boundaries; the link's event loop updates
    them.

    Attributes:
        desired_state: what the unit should do (``idle``, ``running``, ``paused``, ``stopped``).
        desired_known: set after the first read of the desired state; by then
            ``outer_next_round`` is known too.
        outer_next_round: 1 + the last round of this unit the outer applied (0 if none).
        unit_rates: tokens/s of every running unit that reported a speed.
    """

    def __init__(self, settings: LearnerSettings, unit_state: UnitState) -> None:
        """Args:
        settings: the unit's settings (job, unit, units, ``initial_state``).
        unit_state: the unit's durable record; its desired state is the starting one when it
            was loaded from a file, and every change is written to it.
        """
        self.settings = settings
        self.unit_state = unit_state
        initial: DesiredState = "idle" if settings.initial_state == "idle" else "running"
        self._initial = initial
        self.desired_state: DesiredState = unit_state.desired if unit_state.loaded else initial
        self.desired_known = threading.Event()
        self.outer_next_round = 0
        self.unit_rates: dict[int, float] = {}

    async def read_outer_next_round(self, status_kv: Any) -> int:
        """1 + the last round of this unit the outer has applied, from the outer's status
        record (0 when there is none, it is malformed or it cannot be read quickly)."""
        try:
            outer = await asyncio.wait_for(
                read_outer_status(status_kv, self.settings.job), timeout=OUTER_STATUS_TIMEOUT_S
            )
        except NATS_ERRORS as err:
            log.info("outer status not read: %r", err)
            return 0
        return outer.next_round(self.settings.unit) if outer is not None else 0

    async def follow_desired(self, desired_kv: Any, nc: Any) -> None:
        """Follow the unit's desired state (forever): read it once, then whenever a write of it
        is heard on ``nc`` (again every ``DESIRED_RECHECK_S`` while a read does not find it yet)
        and at least every ``DESIRED_POLL_S`` (``WAITING_POLL_S`` while it is not running)."""
        changed = asyncio.Event()

        async def on_write(_msg: Any) -> None:
            changed.set()

        subscription = None
        rechecks = 0  # reads left to find the write last heard
        while True:
            changed.clear()
            try:
                if subscription is None:
                    subject = subjects.desired_subject(self.settings.job, self.settings.unit)
                    subscription = await nc.subscribe(subject, cb=on_write)
                before = self.desired_state
                await self.read_desired(desired_kv)
                if rechecks and self.desired_state == before:
                    wait_s, rechecks = DESIRED_RECHECK_S, rechecks - 1
                else:
                    rechecks = 0
                    running = self.desired_state == "running"
                    wait_s = DESIRED_POLL_S if running else WAITING_POLL_S
            except NATS_ERRORS as err:
                log.info("desired-state read: %r", err)
                wait_s = DESIRED_RETRY_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=wait_s)
            if changed.is_set():
                rechecks = DESIRED_RECHECKS
            raise_if_cancelling()

    async def read_desired(self, desired_kv: Any) -> None:
        """Read the desired state once: a missing record means the ``--initial-state``, a
        malformed one changes nothing; then ``desired_known`` is set.

        Raises:
            TimeoutError, OSError, nats.errors.Error: NATS unreachable.
        """
        key = subjects.desired_key(self.settings.job, self.settings.unit)
        found = await kv.get_with_revision(desired_kv, key, DesiredRecord)
        if found is None:
            state = self._initial
        else:
            record, _revision = found
            state = record.state if record is not None else self.desired_state
        if state != self.desired_state:
            log.info("desired state of unit %d: %s", self.settings.unit, state)
            self.desired_state = state
            self.unit_state.set_desired(state)  # remembered across restarts
        self.desired_known.set()

    async def poll_rates(self, status_kv: Any) -> None:
        """Follow every unit's measured speed, for Dynamic Local Updates (forever)."""
        while True:
            self.unit_rates = await self.read_rates(status_kv)
            await asyncio.sleep(RATES_POLL_S)
            raise_if_cancelling()

    async def read_rates(self, status_kv: Any) -> dict[int, float]:
        """Tokens/s of every unit whose status record says it is running at a known speed
        (a unit whose record is missing, malformed or unreadable is left out)."""
        rates = {}
        for unit in range(self.settings.num_units):
            key = subjects.unit_status_key(self.settings.job, unit)
            try:
                status = await kv.get(status_kv, key, UnitStatus)
            except NATS_ERRORS as err:
                log.debug("speed of unit %d: %r", unit, err)
                continue
            if status is not None and status.state == "running" and status.tokens_per_s > 0:
                rates[unit] = status.tokens_per_s
        return rates
