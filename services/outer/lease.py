"""One active outer per job: a leader lease in JetStream KV that also fences checkpoints.

The lease is one KV record per job (bucket ``diloco_outer``, key ``<job>``)::

    {"holder": "host:pid:nonce", "epoch": 7, "beat": 1234, "released": false,
     "pointer": {...committed checkpoint, see checkpoint.Pointer...}, "time": 1.7e9}

Every change is a compare-and-set on the record's revision, so the record is a linearisable
register:

* **Renew.** The leader bumps ``beat`` every ``lease_s / 4`` seconds.
* **Take over.** A standby watches the revision. If it has not changed for ``lease_s``
  seconds of the standby's *own* monotonic clock (so clock skew between machines does not
  matter), the leader is presumed dead and the standby writes itself in with ``epoch + 1``.
  A record marked ``released`` (a leader that stopped cleanly) is taken at once.
* **Commit.** The leader replaces ``pointer`` to commit a checkpoint. A deposed leader's
  compare-and-set fails, raising :class:`LeaseLost`: it can never commit, so it can never
  publish or acknowledge anything (both come after the commit).

A publish whose answer was lost (a timeout) may or may not have been applied; the record is
then read back, and the write counts as done if the record holds this holder's new ``beat``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """Another outer holds the lease now; this one must stop applying updates."""


def new_holder_id() -> str:
    """A unique name for this process: ``host:pid:nonce``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    """The leader lease of one job, held by at most one outer at a time."""

    def __init__(self, kv: Any, key: str, holder: str, lease_s: float) -> None:
        self.kv = kv
        self.key = key
        self.holder = holder
        self.lease_s = lease_s
        self.record: dict[str, Any] = {}
        self.revision = 0
        self._lock = asyncio.Lock()

    @property
    def epoch(self) -> int:
        """This leadership's epoch (valid once acquired)."""
        return int(self.record.get("epoch", 0))

    @property
    def pointer(self) -> dict[str, Any] | None:
        """The committed checkpoint pointer (None before the first checkpoint of the job)."""
        return self.record.get("pointer")

    async def _read(self) -> tuple[dict[str, Any] | None, int]:
        try:
            entry = await self.kv.get(self.key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None, 0
        if not entry.value:
            return None, entry.revision or 0
        try:
            record = json.loads(entry.value)
        except ValueError:
            record = None
        return (record if isinstance(record, dict) else None), entry.revision or 0

    async def acquire(self, stopping: Callable[[], bool], on_wait: Callable[[str], None]) -> bool:
        """Wait until this process holds the lease; False if ``stopping()`` came first.

        ``on_wait`` is told who holds the lease while this one waits (for the status record).
        """
        seen_revision, seen_since = -1, time.monotonic()
        while not stopping():
            try:
                record, revision = await self._read()
                if record is None:
                    if await self._write(1, None, revision, create=revision == 0):
                        return True
                    continue
                if revision != seen_revision:
                    seen_revision, seen_since = revision, time.monotonic()
                lapsed = time.monotonic() - seen_since >= self.lease_s
                if record.get("released") or lapsed:
                    why = "released" if record.get("released") else f"silent for {self.lease_s}s"
                    epoch = int(record.get("epoch", 0)) + 1
                    if await self._write(epoch, record.get("pointer"), revision):
                        log.info("took the lease from %s (%s)", record.get("holder"), why)
                        return True
                    continue
                on_wait(str(record.get("holder")))
            except (TimeoutError, nats.errors.Error) as err:
                log.info("lease: %r", err)
            await asyncio.sleep(min(1.0, self.lease_s / 4))
        return False

    async def _write(
        self,
        epoch: int,
        pointer: dict[str, Any] | None,
        last: int,
        create: bool = False,
        released: bool = False,
    ) -> bool:
        """Compare-and-set the record (as this holder); False if another holder has it.

        A write whose answer was lost may have landed: a failed compare-and-set is followed by a
        read, and a record with this holder and epoch (no one else writes those) is adopted
        and the write retried on top of it.

        Raises:
            TimeoutError, nats.errors.Error: NATS unreachable (nothing known to be written).
        """
        while True:
            record = {
                "holder": self.holder,
                "epoch": epoch,
                "beat": int(self.record.get("beat", 0)) + 1,
                "released": released,
                "pointer": pointer,
                "time": time.time(),
            }
            value = json.dumps(record).encode()
            try:
                if create:
                    revision = await self.kv.create(self.key, value)
                else:
                    revision = await self.kv.update(self.key, value, last=last)
            except nats.js.errors.KeyWrongLastSequenceError:
                current, current_revision = await self._read()
                if current is None or (current.get("holder"), current.get("epoch")) != (
                    self.holder,
                    epoch,
                ):
                    return False
                self.record, self.revision = current, current_revision
                last, create = current_revision, False
                continue
            self.record, self.revision = record, revision
            return True

    async def _change(self, **fields: Any) -> None:
        """Compare-and-set a change of the held record; retries while NATS is unreachable.

        Raises:
            LeaseLost: another holder changed the record.
        """
        async with self._lock:
            backoff = 0.2
            while True:
                try:
                    pointer = fields.get("pointer", self.pointer)
                    released = bool(fields.get("released", False))
                    if await self._write(self.epoch, pointer, self.revision, released=released):
                        return
                    raise LeaseLost(f"outer {self.holder} lost the lease of {self.key}")
                except (TimeoutError, nats.errors.Error) as err:
                    log.warning("lease write failed (%r); retrying in %.1fs", err, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(2.0, backoff * 2)

    async def renew(self) -> None:
        """Show that this leader is alive.

        Raises:
            LeaseLost: another outer took the lease.
        """
        await self._change()

    async def commit(self, pointer: dict[str, Any]) -> None:
        """Make ``pointer`` the job's committed checkpoint (fenced by the lease).

        Raises:
            LeaseLost: another outer took the lease; nothing was committed.
        """
        await self._change(pointer=pointer)

    async def release(self) -> None:
        """Hand the lease over at once (clean shutdown); best effort."""
        with contextlib.suppress(TimeoutError, LeaseLost):
            await asyncio.wait_for(self._change(released=True), timeout=3)

    async def keep_alive(self, on_lost: Callable[[LeaseLost], None]) -> None:
        """Renew forever (a task); calls ``on_lost`` and returns when the lease is lost."""
        while True:
            await asyncio.sleep(self.lease_s / 4)
            try:
                await self.renew()
            except LeaseLost as lost:
                on_lost(lost)
                return
