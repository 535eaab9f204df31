"""Starting the units of ``diloco up``'s own job together, so that their speeds compare fairly.

Before the learners start, every unit's desired state is set to ``paused``: each learner loads
its data, compiles its step and waits. Once every live learner reports ``paused`` (or start-up
took longer than :data:`READY_TIMEOUT_S`), all are set to ``running`` at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from shared import kv, subjects
from shared.records.jobs import DesiredRecord, DesiredState
from shared.records.unit import UnitStatus
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams

READY_TIMEOUT_S = 300.0
CLOSE_TIMEOUT_S = 5.0


async def set_desired(desired_kv: Any, job: str, units: int, state: DesiredState) -> None:
    """Set the desired state of units ``0 .. units-1`` of ``job``."""
    record = DesiredRecord(state=state)
    for unit in range(units):
        await kv.put(desired_kv, subjects.desired_key(job, unit), record)


async def hold_units(nats: NatsSettings, job: str, units: int) -> None:
    """Create every unit paused (before the learners start), so they can start together.

    Raises:
        transport.TransportError, TimeoutError, nats.errors.Error: NATS unreachable.
    """
    nc = await connect(nats, "diloco-up")
    try:
        js = nc.jetstream()
        await ensure_streams(js, nats.nats_replicas)
        await set_desired(await js.key_value(subjects.DESIRED_BUCKET), job, units, "paused")
    finally:
        await asyncio.wait_for(nc.close(), timeout=CLOSE_TIMEOUT_S)


def all_ready(alive: Iterable[int], units: Mapping[int, UnitStatus], elapsed_s: float) -> bool:
    """Every live learner (``alive``: their unit indexes) waits paused, loaded and compiled,
    or start-up took too long to wait any more."""
    ready = all(unit in units and units[unit].state == "paused" for unit in alive)
    return ready or elapsed_s > READY_TIMEOUT_S
