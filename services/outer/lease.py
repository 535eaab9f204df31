"""One active outer per job: a leader lease in JetStream KV that also fences checkpoints.

The lease is one ``shared.records.LeaseRecord`` per job (bucket ``diloco_outer``, key
``<job>``): the holder (``host:pid:nonce``), its leadership epoch, a beat counter, whether it
was released, and the pointer to the committed checkpoint (``shared.records.CheckpointPointer``).
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
* **Unreadable record.** A record that does not parse as a ``LeaseRecord`` is rejected
  (counted in ``shared.records.rejections`` at every read) and treated as held by an unknown
  leader: a standby takes it over once it has not changed for ``lease_s``, with epoch
  ``revision + 1`` (no epoch ever written to the key exceeds its revision, since each
  takeover adds one to the epoch and at least one to the revision), and without a checkpoint
  pointer, so the new leader continues from the published params.

A publish whose answer was lost (a timeout) may or may not have been applied; the record is
then read back, and the write counts as done if the record holds this holder and epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import uuid
from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors

from shared import records
from shared.cancel import raise_if_cancelling
from shared.kv import get_with_revision
from shared.records.outer import CheckpointPointer, LeaseRecord
from shared.retry import QUICK, retry

log = logging.getLogger(__name__)

#: What a standby reports as the leader while the lease record is unreadable.
UNREADABLE = "(unreadable lease record)"
RELEASE_TIMEOUT_S = 3.0
POLL_JITTER = 0.2  # a standby polls every poll_s times a factor within 1 ± this


class LeaseLost(RuntimeError):
    """Another outer holds the lease now; this one must stop applying updates."""


def new_holder_id() -> str:
    """A unique name for this process: ``host:pid:nonce``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class _Watch:
    """How long a record's revision has gone unchanged, on this process's monotonic clock (the
    running event loop's, which also paces the polls, so that a test can drive both)."""

    def __init__(self) -> None:
        self._clock = asyncio.get_running_loop().time
        self.revision = -1
        self.since = self._clock()

    def unchanged_s(self, revision: int) -> float:
        if revision != self.revision:
            self.revision, self.since = revision, self._clock()
        return self._clock() - self.since


class Lease:
    """The leader lease of one job, held by at most one outer at a time."""

    def __init__(self, kv: Any, key: str, holder: str, lease_s: float) -> None:
        self.kv = kv
        self.key = key
        self.holder = holder
        self.lease_s = lease_s
        self.poll_s = min(1.0, lease_s / 4)
        self.record: LeaseRecord | None = None
        self.revision = 0
        self._lock = asyncio.Lock()

    @property
    def epoch(self) -> int:
        """This leadership's epoch (valid once acquired)."""
        return self.record.epoch if self.record is not None else 0

    @property
    def pointer(self) -> CheckpointPointer | None:
        """The committed checkpoint pointer (None before the first checkpoint of the job)."""
        return self.record.pointer if self.record is not None else None

    async def acquire(self, stopping: Callable[[], bool], on_wait: Callable[[str], None]) -> bool:
        """Wait until this process holds the lease; False if ``stopping()`` came first.

        ``on_wait`` is told who holds the lease while this one waits (for the status record).
        """
        watch = _Watch()
        while not stopping():
            try:
                if await self._try_to_take(watch, on_wait):
                    return True
            except (TimeoutError, nats.errors.Error) as err:
                log.info("lease: %r", err)
            await asyncio.sleep(self.poll_s * random.uniform(1 - POLL_JITTER, 1 + POLL_JITTER))
        return False

    async def _try_to_take(self, watch: _Watch, on_wait: Callable[[str], None]) -> bool:
        """One look at the record: take it if it is free, released or silent for ``lease_s``."""
        found = await get_with_revision(self.kv, self.key, LeaseRecord)
        if found is None:
            return await self._write(1, None, 0, create=True)
        record, revision = found
        silent = watch.unchanged_s(revision) >= self.lease_s
        if record is None:
            if not silent:
                on_wait(UNREADABLE)
                return False
            log.warning(
                "the lease record %s is unreadable and unchanged for %ss: taking it over "
                "without its checkpoint pointer (continuing from the published params)",
                self.key,
                self.lease_s,
            )
            return await self._write(revision + 1, None, revision)
        if not (record.released or silent):
            on_wait(record.holder)
            return False
        if not await self._write(record.epoch + 1, record.pointer, revision):
            return False
        why = "released" if record.released else f"silent for {self.lease_s}s"
        log.info("took the lease from %s (%s)", record.holder, why)
        return True

    async def _write(
        self,
        epoch: int,
        pointer: CheckpointPointer | None,
        last: int,
        create: bool = False,
        released: bool = False,
    ) -> bool:
        """Compare-and-set the record (as this holder); False if another holder has it.

        A write whose answer was lost may have landed: a failed compare-and-set is followed by a
        read, and a record with this holder and epoch (no one else writes those) is adopted
        and the write made again on top of it.

        Raises:
            TimeoutError, nats.errors.Error: NATS unreachable (nothing known to be written).
        """
        while True:
            record = LeaseRecord(
                holder=self.holder,
                epoch=epoch,
                beat=(self.record.beat if self.record is not None else 0) + 1,
                released=released,
                pointer=pointer,
            )
            value = records.encode(record)
            try:
                if create:
                    revision = await self.kv.create(self.key, value)
                else:
                    revision = await self.kv.update(self.key, value, last=last)
            except nats.js.errors.KeyWrongLastSequenceError:
                found = await get_with_revision(self.kv, self.key, LeaseRecord)
                current = found[0] if found is not None else None
                if current is None or (current.holder, current.epoch) != (self.holder, epoch):
                    return False
                self.record, self.revision = current, found[1]
                last, create = self.revision, False
                continue
            self.record, self.revision = record, int(revision)
            return True

    async def _change(
        self, commit: CheckpointPointer | None = None, released: bool = False
    ) -> None:
        """Compare-and-set a change of the held record (``commit``: a new checkpoint pointer;
        None keeps the current one), retried (``shared.retry``) while NATS is unreachable.

        Raises:
            LeaseLost: another holder changed the record.
        """

        def write() -> Any:
            pointer = commit if commit is not None else self.pointer
            return self._write(self.epoch, pointer, self.revision, released=released)

        async with self._lock:
            written = await retry(
                write,
                f"write the lease {self.key}",
                on=(TimeoutError, nats.errors.Error),
                backoff=QUICK,
            )
        if not written:
            raise LeaseLost(f"outer {self.holder} lost the lease of {self.key}")

    async def renew(self) -> None:
        """Show that this leader is alive.

        Raises:
            LeaseLost: another outer took the lease.
        """
        await self._change()

    async def commit(self, pointer: CheckpointPointer) -> None:
        """Make ``pointer`` the job's committed checkpoint (fenced by the lease).

        Raises:
            LeaseLost: another outer took the lease; nothing was committed.
        """
        await self._change(commit=pointer)

    async def release(self) -> None:
        """Hand the lease over at once (clean shutdown); best effort."""
        with contextlib.suppress(TimeoutError, LeaseLost):
            await asyncio.wait_for(self._change(released=True), timeout=RELEASE_TIMEOUT_S)

    async def keep_alive(self, on_lost: Callable[[LeaseLost], None]) -> None:
        """Renew forever (a task); calls ``on_lost`` and returns when the lease is lost."""
        while True:
            raise_if_cancelling()
            await asyncio.sleep(self.lease_s / 4)
            try:
                await self.renew()
            except LeaseLost as lost:
                on_lost(lost)
                return
