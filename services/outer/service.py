"""The outer optimizer service: consume pseudo-gradients durably, merge them, publish versions.

Protocol per fetched batch of chunk messages (docs/ARCHITECTURE.md, "life of a pseudo-gradient"):

1. reassemble chunks into uploads and validate each complete upload (envelope, job, model,
   fragment, codec, shapes, staleness: ``intake.py``, ``validation.py``); a bad one is counted
   by reason in the books (``ledger.py``);
2. offer each good one to ``OuterCore``, whose merge policy decides when a fragment is merged
   (every arrival alone, or a quorum plus an adaptive grace window);
3. when the uploads pause (no message for ``IDLE_COMMIT_S``), or the last commit is
   ``--commit-every-s`` old: commit a checkpoint of the whole outer state (``checkpoint.py``;
   fenced by the leader lease, ``lease.py``), then publish the new global params of every
   fragment merged since the last commit, then ack the chunks of every upload that went into
   those merges and terminate (after copying them to the dead-letter subject) those of every
   rejected upload (``publishing.py``). While uploads keep coming, many merges thus share one
   commit and one publish of the params: the uploads are applied in the same order.

So a message is acknowledged only once what it changed is durable, and a restarted outer
resumes from the last commit: uploads applied before it are recognised by (unit, round) and
acknowledged without being applied again; everything after it is redelivered and applied once.
docs/RELIABILITY.md lists the guarantees and how each is tested.

With ``--shards M``, this process is shard ``--shard k`` of the job's outer: it does all of the
above for the fragments it owns (p mod M = k) only, with a consumer, lease, checkpoint and
status record of its own; shard 0 also evaluates the whole model, reading the other shards'
params from their committed checkpoints (docs/ARCHITECTURE.md, "Outer shards").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import jax
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.outer import checkpoint, restore
from services.outer.core import MergeResult, OuterCore
from services.outer.downlink import DownlinkServer
from services.outer.evaluator import EvalCopy, Evaluator
from services.outer.intake import Intake
from services.outer.lease import Lease, LeaseLost, new_holder_id
from services.outer.ledger import OuterLedger
from services.outer.publishing import DeadLetters, params_envelope, publish_fragment
from services.outer.settings import OuterSettings
from services.outer.status import Progress, leader_status, standby_status, status_key
from services.outer.validation import UploadRules
from shared import data, evaluation, fragments, kv, liveness, model, pytree, subjects
from shared.cancel import raise_if_cancelling
from shared.codec import api as codec
from shared.records.jobs import DesiredRecord
from shared.records.outer import (
    CheckpointInfo,
    OuterState,
    OuterStatus,
    StandbyStatus,
)
from shared.retry import NATS_ERRORS, QUICK, retry
from shared.runtime import configure_jax, freeze_startup_heap
from shared.transport import TransportError
from shared.transport.blobs import ATTEMPT_TIMEOUT_S, chunk_size_for
from shared.transport.connection import connect_with_retry
from shared.transport.streams import prepare_streams

log = logging.getLogger(__name__)

ACK_WAIT_S = 300.0
DESIRED_POLL_S = 2.0  # seconds between reads of the units' desired states
# A pause this long without any upload message lets the outer commit what it merged (under a
# steady stream of uploads it commits every --commit-every-s instead).
IDLE_COMMIT_S = 0.1
# While uploads keep coming, commits (checkpoint, params publish, acknowledgements) take at most
# this share of the outer's time: the next one waits for --commit-every-s, or for
# (1 / COMMIT_SHARE - 1) times as long as the last one took, whichever is longer, but at most
# COMMIT_STRETCH times --commit-every-s, which bounds the memory held: everything merged since
# the last commit stays in memory until it.
COMMIT_SHARE = 0.1
COMMIT_STRETCH = 2.0


class OuterService:
    """One job's outer optimizer, run with :meth:`run` until ``stop`` is set.

    Raises :class:`LeaseLost` from :meth:`run` if another outer took over the job.
    """

    def __init__(self, settings: OuterSettings, stop: asyncio.Event) -> None:
        self.settings = settings
        self.stop = stop
        self.ledger = OuterLedger()
        self.progress = Progress()
        self.dead_letters = DeadLetters(settings.job)
        self.state: OuterState = "starting"
        self.holder = new_holder_id()
        self.lease: Lease | None = None
        self.leader_seen = ""
        self.lost: LeaseLost | None = None
        self.chunk_size = 0
        self.downlink: DownlinkServer | None = None  # with --params-downlink delta, when leading
        self._nc: Any = None
        self._checkpoint_seq = 0
        self.idle_units: set[int] = set()  # paused, stopped or quarantined (desired states)
        self.set_aside: set[int] = set()  # of those, the units peer review sets aside
        self._dirty = False  # the state changed since the last commit
        self._committed_at = 0.0  # time.monotonic() of the last commit
        self._settle_s = 0.0  # seconds the last commit, publish and acknowledgement took
        self._uncommitted: list[MergeResult] = []  # merges since the last commit
        self._shard_tokens: dict[int, int] = {}  # tokens the other shards had applied
        self._shard_checkpoints: dict[int, str] = {}  # the other shards' checkpoints read
        self._outer_kv: Any = None

    # ---- set-up ----------------------------------------------------------------------------

    def build_math(self) -> None:
        """Load the eval data, build the model template, the core and the intake (slow: JAX)."""
        configure_jax()
        s = self.settings
        cfg = model.get_config(s.model)
        corpus = data.split_corpus(
            data.load_corpus(s.corpus, s.corpus_max_bytes), s.heldout_fraction
        )
        batches = data.eval_batches(corpus.heldout, cfg.seq_len, s.eval_batch_size, s.eval_batches)
        template = model.init_params(cfg, jax.random.PRNGKey(s.seed))
        self.evaluator = Evaluator(evaluation.make_evaluator(cfg, batches), template)
        self.param_bytes = 4 * model.param_count(template)
        named = pytree.flatten_named(template)
        self.core = OuterCore(named, s.outer_algorithm())
        self.fragments = fragments.shard_fragments(s.shard, s.shards, self.core.plan.count)
        # Compile the codec kernels beside the outer step (Numba releases the GIL).
        codec_warm_up = threading.Thread(target=codec.warm_up, name="codec-warm-up")
        codec_warm_up.start()
        self.core.warm_up()
        codec_warm_up.join()
        rules = UploadRules(
            job=s.job,
            model=s.model,
            piece_shapes=[
                {k: v.shape for k, v in self.core.plan.extract(named, p).items()}
                for p in range(self.core.plan.count)
            ],
            max_upload_bytes=s.max_upload_bytes,
            max_tensor_bytes=self.max_params_bytes,
            seq_len=cfg.seq_len,
            decode_threads=s.decode_threads,
            max_steps=s.h_steps,
            batch_size=s.batch_size,
        )
        self.intake = Intake(
            rules,
            self.core,
            self.ledger,
            self.dead_letters,
            s.max_pending_uploads,
            s.max_pending_bytes,
        )

    @property
    def max_params_bytes(self) -> int:
        return 2 * self.param_bytes + (1 << 20)

    @property
    def max_checkpoint_bytes(self) -> int:
        # Params plus up to three optimizer buffers of the same size, plus the ledger.
        return 4 * self.param_bytes + (64 << 20)

    def core_versions(self) -> list[int]:
        return [self.core.version(p) for p in range(self.core.plan.count)]

    async def _restore(self, js: Any, store: checkpoint.CheckpointStore) -> None:
        """Continue from the committed checkpoint; without one (a new job, or a lease record
        that was unreadable), from the newest published params, else from version 0."""
        assert self.lease is not None
        s, pointer = self.settings, self.lease.pointer
        if pointer is not None:
            snapshot = checkpoint.loads(await store.read(pointer))
            restore.from_checkpoint(
                snapshot,
                pointer,
                s.job,
                s.model,
                self.core,
                self.ledger,
                self.progress,
                self.fragments,
            )
            self.intake.order.restore(snapshot.fingerprints)
            return
        await restore.from_published_params(
            js,
            s.job,
            s.model,
            self.max_params_bytes,
            self.core,
            self.ledger,
            self.progress,
            self.fragments,
        )
        self._dirty = True  # no checkpoint to continue from: one is written at once

    async def subscribe(self, js: Any) -> Any:
        """(Re)create the durable consumer and bind to it.

        The consumer is deleted first, so that everything still in the work-queue stream
        (uploads a crashed outer had received but not acknowledged) is delivered again now,
        not when its ack wait runs out. Only the lease holder does this.
        """
        s = self.settings
        durable = subjects.outer_consumer(s.job, s.shard)
        filters = subjects.grads_filters(s.job, self.fragments, self.core.plan.count)
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=filters[0] if len(filters) == 1 else None,
            filter_subjects=filters if len(filters) > 1 else None,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ACK_WAIT_S,
            max_deliver=-1,
            max_ack_pending=100_000,
        )
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_consumer(subjects.GRADS_STREAM, durable)
        await js.add_consumer(subjects.GRADS_STREAM, config)
        return await js.pull_subscribe_bind(durable=durable, stream=subjects.GRADS_STREAM)

    # ---- main loop -------------------------------------------------------------------------

    async def run(self) -> OuterStatus | StandbyStatus:
        """Serve until ``stop`` is set; returns the final status record.

        Raises:
            LeaseLost: another outer took over this job (this one must exit; its supervisor
                restarts it as a standby).
        """
        await asyncio.get_running_loop().run_in_executor(None, self.build_math)
        freeze_startup_heap()
        nc = await connect_with_retry(
            self.settings, f"outer-{self.settings.job}", stopping=self.stop.is_set
        )
        if nc is None:
            return self.status_record()
        js = nc.jetstream()
        self._nc = nc
        self.chunk_size = chunk_size_for(nc)
        await self._retry(lambda: prepare_streams(js, self.settings), "create streams")
        status_kv = await js.key_value(subjects.STATUS_BUCKET)
        outer_kv = await js.key_value(subjects.OUTER_BUCKET)
        self._outer_kv = outer_kv
        self.state = "standby"
        # The lease's records are small: a write whose answer a broker failover lost is retried
        # after ATTEMPT_TIMEOUT_S, not after the context's default 5 s.
        lease_js = nc.jetstream(timeout=ATTEMPT_TIMEOUT_S)
        lease = Lease(
            await lease_js.key_value(subjects.OUTER_BUCKET),
            subjects.lease_key(self.settings.job, self.settings.shard),
            self.holder,
            self.settings.lease_s,
        )
        self.lease = lease
        tasks = [
            asyncio.create_task(self._heartbeat(status_kv)),
            asyncio.create_task(self._watch_desired(js)),
        ]
        try:
            if await lease.acquire(self.stop.is_set, self._on_standby):
                with contextlib.suppress(*NATS_ERRORS):
                    await status_kv.delete(self._status_key())  # this process's standby record
                tasks.append(asyncio.create_task(lease.keep_alive(self._on_lease_lost)))
                await self._lead(js)
        finally:
            if self.lost is None and self.state in ("running", "restoring"):
                self.state = "stopped"
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                if self.lost is None and lease.revision:
                    await lease.release()
                await kv.put(status_kv, self._status_key(), self.status_record())
                await asyncio.wait_for(nc.close(), timeout=5)
            except NATS_ERRORS as err:
                log.warning("closing NATS: %s", err)
        if self.lost is not None:
            raise self.lost
        return self.status_record()

    async def _lead(self, js: Any) -> None:
        """Restore, commit, announce the committed versions, then serve until stopping."""
        assert self.lease is not None
        s = self.settings
        log.info(
            "outer %s leads shard %d of %d of job %s (fragments %s, epoch %d)",
            self.holder,
            s.shard,
            s.shards,
            s.job,
            list(self.fragments),
            self.lease.epoch,
        )
        self.state = "restoring"
        store = checkpoint.CheckpointStore(
            js, s.job, s.shard, self.chunk_size, self.max_checkpoint_bytes
        )
        await self._restore(js, store)
        if self._dirty and not await self._commit(store):
            return
        with contextlib.suppress(*NATS_ERRORS):
            await store.purge_epochs_before(self._purgeable_before())
        if s.params_downlink == "delta":
            self.downlink = DownlinkServer(
                s.job,
                s.model,
                self.core.plan.count,
                s.params_delta_codec,
                self.chunk_size,
                self.max_params_bytes,
            )
        for fragment in self.fragments:
            # Announce the committed versions (a crash may have come between commit and
            # publish); a version is always announced with the same params.
            if not await self._publish(js, fragment):
                return
        if self.evaluates and self.progress.evaluation.last is None:
            await self._follow_others(js)
            await self._evaluate(self._eval_copy())  # saved by the next commit
        sub = await self._retry(lambda: self.subscribe(js), "subscribe")
        wants: list[Any] = []
        if self.downlink is not None:
            downlink = self.downlink
            wants = await self._retry(
                lambda: downlink.subscribe(self._nc, js, self.fragments), "serve wants"
            )
        self.state = "running"
        try:
            await self._serve(js, sub, store)
        finally:
            for subscription in wants:
                with contextlib.suppress(*NATS_ERRORS):
                    await subscription.unsubscribe()

    def _purgeable_before(self) -> int:
        """Checkpoint chunks of epochs below this one may be deleted: older than this
        leader's epoch and than the committed checkpoint's (a leader that restored a
        checkpoint and has not committed one of its own must leave the restored one for
        the next leader, should it be killed before its first commit)."""
        assert self.lease is not None
        pointer = self.lease.pointer
        committed = pointer.epoch if pointer is not None else self.lease.epoch
        return min(committed, self.lease.epoch)

    async def _serve(self, js: Any, sub: Any, store: checkpoint.CheckpointStore) -> None:
        last_eval = time.monotonic()
        # An evaluation of a large model takes seconds: it runs beside this loop, which goes on
        # merging, on a copy of the params taken here (no merge runs at that moment).
        evaluation: asyncio.Task[None] | None = None
        try:
            while not self._stopping():
                if evaluation is not None and evaluation.done():
                    evaluation.result()
                    evaluation = None
                    self._dirty = True  # the evaluation goes into the next checkpoint
                    last_eval = time.monotonic()
                idle = await self._serve_once(js, sub, store)
                if idle is None:
                    break
                due = time.monotonic() - last_eval >= self.settings.eval_every_s
                if (
                    self.evaluates
                    and evaluation is None
                    and (due or (idle and self.settings.eval_when_idle))
                ):
                    await self._follow_others(js)
                    last = self.progress.evaluation.last
                    if last is None or last.version != self.core.total_version:
                        evaluation = asyncio.create_task(self._evaluate(self._eval_copy()))
        finally:
            if evaluation is not None:
                evaluation.cancel()
                await asyncio.gather(evaluation, return_exceptions=True)
        if self.lost is None and self._dirty:
            # Stopping: commit what was merged, so that the next leader need not merge it again.
            await self._settle_up(js, store)

    async def _serve_once(
        self, js: Any, sub: Any, store: checkpoint.CheckpointStore
    ) -> bool | None:
        """Fetch, take and merge once; commit, publish and acknowledge when the uploads pause
        (no message for ``IDLE_COMMIT_S``) or the last commit is ``--commit-every-s`` old.
        Returns whether nothing came (idle), or None when stopping."""
        deadline = self.core.next_deadline()
        wait_s = 1.0 if deadline is None else min(1.0, max(0.05, deadline - time.monotonic()))
        if self._dirty:
            wait_s = min(wait_s, IDLE_COMMIT_S)
        try:
            msgs = await retry(
                lambda w=wait_s: self._fetch(sub, w),
                "fetch uploads",
                on=(nats.errors.Error,),
                stopping=self._stopping,
                backoff=QUICK,
            )
        except nats.errors.Error:
            return None
        # Every pass: an upload that came after the pause made the unit a peer again.
        for unit in self.set_aside:
            self.core.set_aside(unit)
        if self.intake.withdraw_quarantined():
            self._dirty = True
        if await self.intake.take(msgs):
            self._dirty = True  # rejections are committed before they are dead-lettered
        for arrival, rejected in self.core.settle(time.monotonic()):
            self.intake.reject_held(arrival, rejected)
            self._dirty = True
        self._uncommitted += await self.merge_due(time.monotonic())
        # While uploads keep coming, go on taking and merging, and commit once for all of them
        # when the budget is spent: a checkpoint of the whole state every few uploads cost the
        # outer as much CPU as the uploads themselves (docs/NETWORK.md, "Load test").
        idle = not msgs
        due = time.monotonic() - self._committed_at >= self._commit_interval()
        if self._dirty and (due or idle):
            started = time.monotonic()
            if not await self._settle_up(js, store):
                return None
            self._settle_s = time.monotonic() - started
        return idle

    def _commit_interval(self) -> float:
        """Seconds of merging, while uploads keep coming, from one commit to the next:
        ``--commit-every-s``, or longer where the last commit took more than ``COMMIT_SHARE``
        of that, up to ``COMMIT_STRETCH`` times as long (0: after every fetch)."""
        every = self.settings.commit_every_s
        stretched = min(self._settle_s * (1 / COMMIT_SHARE - 1), COMMIT_STRETCH * every)
        return max(every, stretched)

    async def _settle_up(self, js: Any, store: checkpoint.CheckpointStore) -> bool:
        """Commit, then publish every fragment merged since the last commit, acknowledge the
        uploads those merges used and dead-letter the rejected ones; False if stopping first
        (nothing acknowledged: JetStream redelivers it to the next leader)."""
        if not await self._commit(store):
            return False
        results, self._uncommitted = self._uncommitted, []
        for fragment in sorted({r.fragment for r in results}):
            if not await self._publish(js, fragment):
                return False
        for result in results:
            for arrival in result.arrivals:
                for msg in arrival.messages:
                    with contextlib.suppress(nats.errors.Error):
                        await msg.ack()
        await self.dead_letters.flush(js)
        return True

    async def _fetch(self, sub: Any, wait_s: float) -> list[Any]:
        """The next batch of chunk messages; none if nothing came within ``wait_s``."""
        try:
            return await sub.fetch(self.settings.fetch_batch, timeout=wait_s)
        except TimeoutError:  # nats.errors.TimeoutError is one too
            return []

    def _stopping(self) -> bool:
        return self.stop.is_set() or self.lost is not None

    async def _retry(self, make_call: Any, what: str) -> Any:
        return await retry(make_call, what, stopping=self.stop.is_set, backoff=QUICK)

    def _on_standby(self, holder: str) -> None:
        if holder != self.leader_seen:
            log.info("standing by: job %s is led by %s", self.settings.job, holder)
        self.leader_seen = holder

    def _on_lease_lost(self, lost: LeaseLost) -> None:
        log.error("%s: stopping at once", lost)
        self.lost = lost
        self.state = "deposed"

    # ---- merges, checkpoints, publishing ---------------------------------------------------

    async def merge_due(self, now: float) -> list[MergeResult]:
        """Merge every fragment whose policy says so and enter it in the books.

        The merges run on a worker thread, so that the event loop goes on renewing the lease
        and sending heartbeats: a merge can take seconds (each new number of units in a merge
        compiles its combine; a large model's step is slow), and an outer that falls silent
        that long looks not ready, or loses its lease to a standby. Nothing else changes the
        core meanwhile (this loop fetches again only after the merges); the books, which the
        heartbeat reads, are updated here on the loop. Nothing is published or acknowledged
        here: that follows the next commit.
        """
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(None, self._merge_all_due, now)
        for result in results:
            self._dirty = True
            self.ledger.merged(result.arrivals, result.staleness, result.share, result.steps)
            self.intake.merged(result.arrivals)
            self.progress.merged(result, self.ledger.tokens_applied)
        return results

    def _merge_all_due(self, now: float) -> list[MergeResult]:
        results = []
        while due := self.core.due(now):
            results += [self.core.merge(fragment) for fragment in due]
        return results

    def snapshot(self) -> checkpoint.OuterSnapshot:
        """The whole outer state as it stands (merge buffers aside: see ``checkpoint.py``)."""
        versions, params, leaves = self.core.export_state(self.fragments)
        return checkpoint.OuterSnapshot(
            job=self.settings.job,
            model=self.settings.model,
            versions=versions,
            params=params,
            opt_leaves=leaves,
            fragments=list(self.fragments),
            ledger=self.ledger.to_record(),
            evaluation=self.progress.evaluation,
            norms=self.core.guard.history(),
            peers=self.core.peers.history() if self.core.peers is not None else [],
            fingerprints=self.intake.order.history(),
        )

    async def _commit(self, store: checkpoint.CheckpointStore) -> bool:
        """Write a checkpoint and commit it through the lease; False if stopping first.

        Raises:
            LeaseLost: another outer leads the job now; nothing was committed.
        """
        lease = self.lease
        assert lease is not None
        started = time.monotonic()
        # Serialised on a worker thread (hundreds of MB for a large model), so that the lease
        # and the heartbeat go on meanwhile; nothing changes the state this snapshot reads
        # until the commit is done (the fetch loop waits for it; an evaluation replaces its
        # record rather than changing it).
        snapshot = self.snapshot()
        blob = await asyncio.get_running_loop().run_in_executor(None, checkpoint.dumps, snapshot)
        previous = lease.pointer
        # Never overwrite the committed checkpoint: alternate slots within an epoch.
        slot = 1 - previous.slot if previous is not None and previous.epoch == lease.epoch else 0
        self._checkpoint_seq += 1
        seq, versions = self._checkpoint_seq, self.core_versions()
        try:
            pointer = await retry(
                lambda: store.write(blob, lease.epoch, seq, slot, versions),
                f"write checkpoint {seq}",
                on=(TransportError, *NATS_ERRORS),
                stopping=self.stop.is_set,
            )
        except (TransportError, *NATS_ERRORS):
            log.warning("stopping before checkpoint %d was written", seq)
            return False
        try:
            await lease.commit(pointer)
        except LeaseLost as lost:
            self._on_lease_lost(lost)
            raise
        self._dirty = False
        self._committed_at = time.monotonic()
        self.progress.checkpoints += 1
        self.progress.last_checkpoint = CheckpointInfo(
            id=pointer.id,
            bytes=pointer.size,
            versions=versions,
            seconds=round(time.monotonic() - started, 4),
        )
        return True

    async def _publish(self, js: Any, fragment: int) -> bool:
        """Publish a fragment's committed params; False if stopping first. With the delta
        downlink, the units' wants are answered from this version on before its head is
        out (a unit that saw the head asks for a version the outer can send)."""
        s, version = self.settings, self.core.version(fragment)
        params = self.core.fragment_params(fragment)
        blob, checksum = params_envelope(
            s.job, s.model, fragment, version, self.ledger.tokens_applied, params, s.params_codec
        )
        if self.downlink is not None:
            await self.downlink.published(fragment, version, params, blob)
        return await publish_fragment(
            js,
            self.chunk_size,
            s.job,
            fragment,
            version,
            blob,
            checksum,
            stopping=self.stop.is_set,
            applied={unit: books.last_round for unit, books in self.ledger.units.items()},
        )

    @property
    def evaluates(self) -> bool:
        """Whether this outer evaluates the global params: shard 0 does, for the job."""
        return self.settings.shard == 0

    def _eval_copy(self) -> tuple[EvalCopy, int]:
        """A copy of the global params to evaluate, with the tokens the job had applied."""
        tokens = self.ledger.tokens_applied + sum(self._shard_tokens.values())
        return self.evaluator.copy(self.core), tokens

    async def _follow_others(self, js: Any) -> None:
        """Bring the other shards' fragments to their newest committed state (the whole model
        is evaluated), and note the tokens each of those shards had applied then."""
        s = self.settings
        if s.shards == 1:
            return
        try:
            tokens = await restore.follow_shards(
                js,
                self._outer_kv,
                s.job,
                s.model,
                self.core,
                s.shard,
                s.shards,
                self.max_checkpoint_bytes,
                self._shard_checkpoints,
            )
        except (checkpoint.CheckpointError, TransportError, *NATS_ERRORS) as err:
            log.info("the other shards' checkpoints not read: %r", err)
            return
        self._shard_tokens.update(tokens)

    async def _evaluate(self, copy: tuple[EvalCopy, int]) -> None:
        """Evaluate a copy of the global params and enter the result."""
        self.progress.evaluated(await self.evaluator.run(*copy))

    # ---- status ----------------------------------------------------------------------------

    def status_record(self) -> OuterStatus | StandbyStatus:
        """The outer's heartbeat record: a standby's, or a leader's with its books."""
        if self.state == "standby":
            return standby_status(
                self.settings.model, self.holder, self.leader_seen, self.settings.shard
            )
        core = getattr(self, "core", None)
        lease = self.lease
        return leader_status(
            state=self.state,
            model=self.settings.model,
            holder=self.holder,
            epoch=lease.epoch if lease is not None and lease.revision else None,
            versions=self.core_versions() if core is not None else [],
            buffered=len(self.intake.buffered) if core is not None else 0,
            ledger=self.ledger,
            progress=self.progress,
            downlink=self.downlink.counts() if self.downlink is not None else None,
            shard=self.settings.shard,
            shards=self.settings.shards,
        )

    def _status_key(self) -> str:
        return status_key(self.settings.job, self.settings.shard, self.state, self.holder)

    async def _watch_desired(self, js: Any) -> None:
        """Every ``DESIRED_POLL_S``, read the job's units' desired states: the uploads of a
        unit quarantined through the REST API are refused from then on (``quarantined``), and
        a unit paused, stopped or quarantined after it had uploaded is set aside as a peer
        (:func:`units_set_aside`; ``OuterCore.set_aside``, applied by the fetch loop) until it
        is wanted running again."""
        desired_kv = None
        while True:
            raise_if_cancelling()
            try:
                if desired_kv is None:
                    desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
                seen = max(self.ledger.units, default=-1) + 1
                idle = set()
                for unit in range(max(self.settings.num_units, seen)):
                    key = subjects.desired_key(self.settings.job, unit)
                    record = await kv.get(desired_kv, key, DesiredRecord)
                    if record is None:
                        continue
                    if record.state in ("paused", "stopped", "quarantined"):
                        idle.add(unit)
                    if record.state == "quarantined":
                        if unit not in self.intake.quarantined:
                            log.warning("unit %d is quarantined: its uploads are refused", unit)
                        self.intake.quarantined.add(unit)
                self.set_aside = units_set_aside(
                    idle, self.idle_units, self.set_aside, self.core.reviewed_units()
                )
                self.idle_units = idle
            except NATS_ERRORS as err:
                log.info("reading the units' desired states: %r", err)
            await asyncio.sleep(DESIRED_POLL_S)

    async def _heartbeat(self, status_kv: Any) -> None:
        while True:
            raise_if_cancelling()
            try:
                await kv.put(status_kv, self._status_key(), self.status_record())
            except NATS_ERRORS as err:
                log.info("heartbeat: %r", err)
            liveness.mark(self.settings.liveness_file)
            await asyncio.sleep(self.settings.status_interval_s)


def units_set_aside(
    idle: set[int], idle_before: set[int], set_aside: set[int], uploaded: set[int]
) -> set[int]:
    """The units peer review sets aside, from this read of the desired states (``idle``:
    paused, stopped or quarantined), the last read's (``idle_before``) and what it set aside
    then: a unit that turned idle after peer review recorded an upload of it (``uploaded``),
    for as long as it stays idle. Not one idle since before its first upload: a job's units
    wait paused until they start together, and for up to a poll after the start the outer
    still reads them paused while their first uploads come (set aside then, every upload had
    no peers and was merged unjudged)."""
    return {
        unit for unit in idle if unit in set_aside or (unit not in idle_before and unit in uploaded)
    }
