"""The outer optimizer service: consume pseudo-gradients durably, merge them, publish versions.

Protocol per fetched batch of chunk messages (docs/ARCHITECTURE.md, "life of a pseudo-gradient"):

1. reassemble chunks into uploads (``shared.wire.Reassembler``);
2. validate each complete upload (envelope, job, model, fragment, codec, shapes, finiteness,
   staleness); a bad one is terminated (never redelivered), copied to the dead-letter subject
   and counted by reason;
3. offer each good one to ``OuterCore``, whose merge policy decides when a fragment is merged
   (every arrival alone, or a quorum plus an adaptive grace window);
4. commit a checkpoint of the whole outer state (``checkpoint.py``; fenced by the leader lease,
   ``lease.py``), then publish the new global params of every merged fragment, then ack the
   chunks of every upload that went into a merge and terminate (after copying them to the
   dead-letter subject) those of every rejected upload.

So a message is acknowledged only once what it changed is durable, and a restarted outer
resumes from the last commit: uploads applied before it are recognised by (unit, round) and
acknowledged without being applied again; everything after it is redelivered and applied once.
docs/RELIABILITY.md lists the guarantees and how each is tested.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import nats.errors
import nats.js.errors
import numpy as np
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.outer import checkpoint
from services.outer.core import MergeResult, OuterCore, Rejected
from services.outer.lease import Lease, LeaseLost, new_holder_id
from services.outer.policy import Arrival
from services.outer.settings import OuterSettings
from shared import codec, data, evaluation, model, pytree, subjects, transport, wire
from shared.ledger import RoundSet
from shared.runtime import configure_jax
from shared.transport import TransportError

log = logging.getLogger(__name__)

ACK_WAIT_S = 300.0
EVAL_HISTORY = 200
TRAIN_HISTORY = 200  # points of [tokens applied, mean train loss] kept in the status record


@dataclass
class UnitLedger:
    """What the outer has applied from one unit."""

    applied: int = 0
    last_round: int = -1
    last_staleness: int = 0
    tokens: int = 0
    last_train_loss: float | None = None


@dataclass
class OuterLedger:
    """Counters for the status record, saved in every checkpoint, so that the books balance:
    every upload received is applied exactly once (``applied_rounds``) or rejected with a
    reason (``rejected``, ``rejected_rounds``)."""

    applied: int = 0
    merges: int = 0
    deduplicated: int = 0  # redelivered chunk messages of uploads applied before
    tokens_applied: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    units: dict[int, UnitLedger] = field(default_factory=dict)
    staleness: collections.Counter[int] = field(default_factory=collections.Counter)
    # Accepted uploads by the codec named in their description, and their compressed bytes.
    codecs: collections.Counter[str] = field(default_factory=collections.Counter)
    payload_bytes: int = 0
    # Per unit, the rounds applied and the rounds rejected (also the deduplication set).
    applied_rounds: dict[int, RoundSet] = field(default_factory=dict)
    rejected_rounds: dict[int, RoundSet] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (checkpoints)."""
        return {
            "applied": self.applied,
            "merges": self.merges,
            "deduplicated": self.deduplicated,
            "tokens_applied": self.tokens_applied,
            "rejected": dict(self.rejected),
            "units": {str(u): vars(stats) for u, stats in self.units.items()},
            "staleness": {str(k): v for k, v in self.staleness.items()},
            "codecs": dict(self.codecs),
            "payload_bytes": self.payload_bytes,
            "applied_rounds": {str(u): r.ranges() for u, r in self.applied_rounds.items()},
            "rejected_rounds": {str(u): r.ranges() for u, r in self.rejected_rounds.items()},
        }

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> OuterLedger:
        """Inverse of :meth:`to_dict`."""
        return cls(
            applied=int(value["applied"]),
            merges=int(value["merges"]),
            deduplicated=int(value["deduplicated"]),
            tokens_applied=int(value["tokens_applied"]),
            rejected=collections.Counter({str(k): int(v) for k, v in value["rejected"].items()}),
            units={int(u): UnitLedger(**stats) for u, stats in value["units"].items()},
            staleness=collections.Counter({int(k): int(v) for k, v in value["staleness"].items()}),
            codecs=collections.Counter({str(k): int(v) for k, v in value["codecs"].items()}),
            payload_bytes=int(value["payload_bytes"]),
            applied_rounds={int(u): RoundSet(r) for u, r in value["applied_rounds"].items()},
            rejected_rounds={int(u): RoundSet(r) for u, r in value["rejected_rounds"].items()},
        )

    def is_done(self, unit: int, round_: int) -> str | None:
        """``"applied"`` or ``"rejected"`` if this upload was dealt with already, else None."""
        if round_ in self.applied_rounds.get(unit, ()):
            return "applied"
        if round_ in self.rejected_rounds.get(unit, ()):
            return "rejected"
        return None


class OuterService:
    """One job's outer optimizer, run with :meth:`run` until ``stop`` is set.

    Raises :class:`LeaseLost` from :meth:`run` if another outer took over the job.
    """

    def __init__(self, settings: OuterSettings, stop: asyncio.Event) -> None:
        self.settings = settings
        self.stop = stop
        self.ledger = OuterLedger()
        self.accepted_uploads: set[str] = set()
        self.rejected_uploads: set[str] = set()
        self._evictions_seen = 0
        self.eval_init: dict[str, Any] | None = None
        self.eval_last: dict[str, Any] | None = None
        self.eval_history: list[list[float]] = []
        # [tokens applied, mean train loss of the merged uploads] per merge; status only.
        self.train_history: collections.deque[list[float]] = collections.deque(maxlen=TRAIN_HISTORY)
        self.state_name = "starting"
        self.holder = new_holder_id()
        self.lease: Lease | None = None
        self.leader_seen = ""
        self.lost: LeaseLost | None = None
        self.restored_from: dict[str, Any] = {"kind": "new"}
        self.checkpoints = 0
        self.last_checkpoint: dict[str, Any] | None = None
        self._checkpoint_seq = 0
        self._dirty = False
        # Rejected uploads whose messages are terminated once the rejection is committed.
        self._to_terminate: list[tuple[list[Any], str]] = []

    # ---- set-up ----------------------------------------------------------------------------

    def build_math(self) -> None:
        """Load the eval data, build the model template and the outer core (slow: JAX)."""
        configure_jax()
        s = self.settings
        cfg = model.get_config(s.model)
        corpus = data.split_corpus(
            data.load_corpus(s.corpus, s.corpus_max_bytes), s.heldout_fraction
        )
        batches = data.eval_batches(corpus.heldout, cfg.seq_len, s.eval_batch_size, s.eval_batches)
        self.evaluate = evaluation.make_evaluator(cfg, batches)
        self.template = model.init_params(cfg, jax.random.PRNGKey(s.seed))
        self.param_bytes = 4 * model.param_count(self.template)
        named = pytree.flatten_named(self.template)
        self.core = OuterCore(named, s.algorithm(s.num_units, s.fragments))
        # Compile the codec kernels beside the outer step (Numba releases the GIL).
        codec_warm_up = threading.Thread(target=codec.warm_up, name="codec-warm-up")
        codec_warm_up.start()
        self.core.warm_up()
        codec_warm_up.join()
        self.piece_shapes = [
            {k: v.shape for k, v in self.core.plan.extract(named, p).items()}
            for p in range(self.core.plan.count)
        ]

    @property
    def max_params_bytes(self) -> int:
        return 2 * self.param_bytes + (1 << 20)

    @property
    def max_checkpoint_bytes(self) -> int:
        # Params plus up to three optimizer buffers of the same size, plus the ledger.
        return 4 * self.param_bytes + (64 << 20)

    async def _restore(self, js: Any, store: checkpoint.CheckpointStore) -> None:
        """Continue from the committed checkpoint; without one (a new job, or state written
        by a release before checkpoints), from the newest published params, else version 0."""
        assert self.lease is not None
        if self.lease.pointer is not None:
            pointer = checkpoint.Pointer.from_dict(self.lease.pointer)
            snapshot = checkpoint.loads(await store.read(pointer))
            if snapshot.job != self.settings.job or snapshot.model != self.settings.model:
                raise SystemExit(
                    f"job {self.settings.job} has a checkpoint of model {snapshot.model!r}, "
                    f"not {self.settings.model!r}: use another --job or the same --model"
                )
            self.core.import_state(snapshot.versions, snapshot.params, snapshot.opt_leaves)
            self.ledger = OuterLedger.from_dict(snapshot.ledger)
            self.eval_init = snapshot.evaluation.get("init")
            self.eval_last = snapshot.evaluation.get("last")
            self.eval_history = list(snapshot.evaluation.get("history", []))
            self._checkpoint_seq = int(pointer.id.rsplit(".s", 1)[-1])
            self.restored_from = {
                "kind": "checkpoint",
                "id": pointer.id,
                "versions": pointer.versions,
            }
            log.info("restored checkpoint %s (versions %s)", pointer.id, pointer.versions)
            return
        for fragment in range(self.core.plan.count):
            fetched = await transport.read_latest_params(
                js, self.settings.job, fragment, self.max_params_bytes
            )
            if fetched is None:
                continue
            version, blob = fetched
            envelope = wire.unpack_envelope(blob, max_size=self.max_params_bytes)
            if envelope.model != self.settings.model:
                raise SystemExit(
                    f"job {self.settings.job} already has params for model {envelope.model!r}, "
                    f"not {self.settings.model!r}: use another --job or the same --model"
                )
            pieces = codec.decode_tensors(envelope.payload, envelope.codec)
            self.core.restore(fragment, version, pieces)
            self.ledger.tokens_applied = max(self.ledger.tokens_applied, envelope.tokens)
            self.restored_from = {"kind": "params", "versions": self.core_versions()}
            log.warning(
                "fragment %d continues from published version %d without a checkpoint "
                "(outer momentum restarts from zero)",
                fragment,
                version,
            )
        self._dirty = True  # the first checkpoint of this job is written right away

    def core_versions(self) -> list[int]:
        return [self.core.version(p) for p in range(self.core.plan.count)]

    async def subscribe(self, js: Any) -> Any:
        """(Re)create the durable consumer and bind to it.

        The consumer is deleted first, so that everything still in the work-queue stream
        (uploads a crashed outer had received but not acknowledged) is delivered again now,
        not when its ack wait runs out. Only the lease holder does this.
        """
        durable = subjects.outer_consumer(self.settings.job)
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=subjects.grads_filter(self.settings.job),
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

    async def run(self) -> dict[str, Any]:
        """Serve until ``stop`` is set; returns the final status record.

        Raises:
            LeaseLost: another outer took over this job (this one must exit; its supervisor
                restarts it as a standby).
        """
        await asyncio.get_running_loop().run_in_executor(None, self.build_math)
        nc = await transport.connect_with_retry(
            self.settings, f"outer-{self.settings.job}", stopping=self.stop.is_set
        )
        if nc is None:
            return self.status_record()
        js = nc.jetstream()
        await self._retry(lambda: transport.ensure_streams(js), "create streams")
        status_kv = await js.key_value(subjects.STATUS_BUCKET)
        outer_kv = await js.key_value(subjects.OUTER_BUCKET)
        self.state_name = "standby"
        heartbeat = asyncio.create_task(self._heartbeat(status_kv))
        tasks = [heartbeat]
        self.lease = Lease(
            outer_kv, subjects.lease_key(self.settings.job), self.holder, self.settings.lease_s
        )
        try:
            if not await self.lease.acquire(self.stop.is_set, self._on_standby):
                return self.status_record()
            log.info(
                "outer %s leads job %s (epoch %d)", self.holder, self.settings.job, self.lease.epoch
            )
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await status_kv.delete(self._status_key())  # this process's standby record
            self.state_name = "restoring"
            tasks.append(asyncio.create_task(self.lease.keep_alive(self._on_lease_lost)))
            store = checkpoint.CheckpointStore(
                js, self.settings.job, transport.chunk_size_for(nc), self.max_checkpoint_bytes
            )
            await self._restore(js, store)
            if self._dirty:
                await self._commit(store)
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await store.purge_epochs_before(self._purgeable_before())
            for fragment in range(self.core.plan.count):
                # Announce the committed versions (a crash may have come between commit and
                # publish); a version is always announced with the same params.
                await self._publish_until_done(js, fragment)
            if self.eval_init is None:
                self.eval_init = await self._evaluate()
                self.eval_last = self.eval_init
            sub = await self._retry(lambda: self.subscribe(js), "subscribe")
            self.state_name = "running"
            await self._serve(js, sub, store)
        finally:
            if self.lost is None and self.state_name in ("running", "restoring"):
                self.state_name = "stopped"
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                if self.lost is None and self.lease is not None and self.lease.revision:
                    await self.lease.release()
                await transport.put_status(status_kv, self._status_key(), self.status_record())
                await asyncio.wait_for(nc.close(), timeout=5)
            except (TimeoutError, nats.errors.Error) as err:
                log.warning("closing NATS: %s", err)
        if self.lost is not None:
            raise self.lost
        return self.status_record()

    def _purgeable_before(self) -> int:
        """Checkpoint chunks of epochs below this one may be deleted: older than this
        leader's epoch and than the committed checkpoint's. A leader that restored a
        checkpoint and had nothing new to save has not committed one of its own yet; had it
        purged every older epoch, a kill before its first commit left the next leader a
        pointer to deleted chunks, which it could never restore (seen in the outer-kill test).
        """
        assert self.lease is not None
        pointer = self.lease.pointer
        committed = checkpoint.Pointer.from_dict(pointer).epoch if pointer else self.lease.epoch
        return min(committed, self.lease.epoch)

    async def _serve(self, js: Any, sub: Any, store: checkpoint.CheckpointStore) -> None:
        reassembler = wire.Reassembler(
            max_upload_bytes=self.settings.max_upload_bytes,
            max_pending_uploads=self.settings.max_pending_uploads,
        )
        chunk_msgs: dict[str, list[Any]] = collections.defaultdict(list)
        last_eval = time.monotonic()
        while not self.stop.is_set() and self.lost is None:
            deadline = self.core.next_deadline()
            wait_s = 1.0 if deadline is None else min(1.0, max(0.05, deadline - time.monotonic()))
            try:
                msgs = await sub.fetch(self.settings.fetch_batch, timeout=wait_s)
            except (TimeoutError, nats.errors.TimeoutError):
                msgs = []
            except nats.errors.Error as err:
                log.info("fetch: %r", err)
                await asyncio.sleep(0.5)
                continue
            await self.process(js, msgs, reassembler, chunk_msgs)
            results = await self.merge_due(time.monotonic())
            if self._dirty and not await self._commit(store):
                return  # stopping: nothing acknowledged, JetStream redelivers to the next outer
            for fragment in sorted({r.fragment for r in results}):
                if not await self._publish_until_done(js, fragment):
                    return
            for result in results:
                for arrival in result.arrivals:
                    for msg in arrival.context[0]:
                        with contextlib.suppress(nats.errors.Error):
                            await msg.ack()
            await self._terminate_rejected(js)
            idle = not msgs
            due = time.monotonic() - last_eval >= self.settings.eval_every_s
            if self.eval_last["version"] != self.core.total_version and (idle or due):
                self.eval_last = await self._evaluate()
                last_eval = time.monotonic()
                self._dirty = True  # the evaluation record goes into the next checkpoint

    async def _retry(self, make_call: Any, what: str) -> Any:
        return await transport.retry_with_backoff(
            make_call, what, first_backoff_s=0.2, stopping=self.stop.is_set
        )

    def _on_standby(self, holder: str) -> None:
        if holder != self.leader_seen:
            log.info("standing by: job %s is led by %s", self.settings.job, holder)
        self.leader_seen = holder

    def _on_lease_lost(self, lost: LeaseLost) -> None:
        log.error("%s: stopping at once", lost)
        self.lost = lost
        self.state_name = "deposed"

    # ---- checkpoints -----------------------------------------------------------------------

    def snapshot(self) -> checkpoint.OuterSnapshot:
        """The whole outer state as it stands (merge buffers aside: see ``checkpoint.py``)."""
        versions, params, leaves = self.core.export_state()
        return checkpoint.OuterSnapshot(
            job=self.settings.job,
            model=self.settings.model,
            versions=versions,
            params=params,
            opt_leaves=leaves,
            ledger=self.ledger.to_dict(),
            evaluation={
                "init": self.eval_init,
                "last": self.eval_last,
                "history": self.eval_history,
            },
        )

    async def _commit(self, store: checkpoint.CheckpointStore) -> bool:
        """Write a checkpoint and commit it through the lease; False if stopping first.

        Raises:
            LeaseLost: another outer leads the job now; nothing was committed.
        """
        assert self.lease is not None
        started = time.monotonic()
        blob = checkpoint.dumps(self.snapshot())
        previous = self.lease.pointer
        slot = (
            1 - int(previous["slot"]) if previous and previous["epoch"] == self.lease.epoch else 0
        )
        self._checkpoint_seq += 1
        versions = self.core_versions()
        while True:
            try:
                pointer = await store.write(
                    blob, self.lease.epoch, self._checkpoint_seq, slot, versions
                )
                break
            except (TransportError, TimeoutError, nats.errors.Error) as err:
                if self.stop.is_set():
                    log.warning("stopping before checkpoint %d was written", self._checkpoint_seq)
                    return False
                log.warning("writing checkpoint failed (%s); retrying", err)
                await asyncio.sleep(0.5)
        try:
            await self.lease.commit(pointer.to_dict())
        except LeaseLost as lost:
            self._on_lease_lost(lost)
            raise
        self._dirty = False
        self.checkpoints += 1
        self.last_checkpoint = {
            "id": pointer.id,
            "bytes": pointer.size,
            "versions": versions,
            "seconds": round(time.monotonic() - started, 4),
        }
        return True

    async def process(
        self,
        js: Any,
        msgs: list[Any],
        reassembler: wire.Reassembler,
        chunk_msgs: dict[str, list[Any]],
    ) -> None:
        """Reassemble chunk messages, validate complete uploads and offer them to the core."""
        for msg in msgs:
            try:
                info = wire.parse_chunk_headers(msg.headers)
            except wire.WireError as err:
                self._reject([msg], Rejected("bad_chunk_header", str(err)), None)
                continue
            done = self._done(info.upload)
            if done == "applied":
                # Applied and committed before (a redelivery after a crash, or a retry).
                self.ledger.deduplicated += 1
                with contextlib.suppress(nats.errors.Error):
                    await msg.ack()
                continue
            if done == "rejected" or info.upload in self.rejected_uploads:
                # Another chunk (or a redelivery) of a rejected upload: copied to the dead-letter
                # subject (deduplicated there by message id) and terminated once committed.
                self._to_terminate.append(([msg], "chunk of an upload rejected earlier"))
                continue
            if info.upload in self.accepted_uploads:
                continue  # a redelivery of an upload still buffered: acked when it is merged
            chunk_msgs[info.upload].append(msg)
            try:
                blob = reassembler.add(info, msg.data)
            except wire.WireError as err:
                reassembler.discard(info.upload)
                self._reject(
                    chunk_msgs.pop(info.upload), Rejected("bad_chunk", str(err)), info.upload
                )
                continue
            for evicted in self._drain_evicted(reassembler):
                self._reject(
                    chunk_msgs.pop(evicted, []),
                    Rejected("incomplete_upload", f"{evicted} evicted before completion"),
                    evicted,
                )
            if blob is None:
                continue
            upload_msgs = chunk_msgs.pop(info.upload)
            try:
                self._accept(info.upload, msg.subject, blob, upload_msgs)
            except Rejected as rejected:
                self._reject(upload_msgs, rejected, info.upload)

    def _done(self, upload: str) -> str | None:
        """Whether an upload of this job was applied or rejected before (by id)."""
        try:
            job, unit, round_, _ = wire.parse_upload_id(upload)
        except wire.WireError:
            return None
        if job != self.settings.job:
            return None
        return self.ledger.is_done(unit, round_)

    def _drain_evicted(self, reassembler: wire.Reassembler) -> list[str]:
        """Uploads the reassembler evicted since the last call (to terminate their chunks)."""
        new = reassembler.evicted - self._evictions_seen
        self._evictions_seen = reassembler.evicted
        return list(reassembler.recently_evicted[-new:]) if new else []

    def _accept(self, upload: str, subject: str, blob: bytes, upload_msgs: list[Any]) -> None:
        """Validate one complete upload and hand it to the core."""
        try:
            envelope = wire.unpack_envelope(blob, max_size=self.settings.max_upload_bytes)
        except wire.WireError as err:
            raise Rejected("bad_envelope", str(err)) from err
        job = self.settings.job
        if envelope.kind != "pseudo_grad":
            raise Rejected("wrong_kind", f"expected pseudo_grad, got {envelope.kind!r}")
        if envelope.job != job:
            raise Rejected("wrong_job", f"expected job {job!r}, got {envelope.job!r}")
        if envelope.model != self.settings.model:
            raise Rejected(
                "wrong_model", f"expected model {self.settings.model!r}, got {envelope.model!r}"
            )
        if subject != subjects.grads_subject(job, envelope.unit) or upload != wire.upload_id(
            job, envelope.unit, envelope.round, envelope.fragment
        ):
            raise Rejected("inconsistent_ids", f"{upload} on {subject} says unit {envelope.unit}")
        if not 0 <= envelope.fragment < self.core.plan.count:
            raise Rejected(
                "wrong_fragment", f"fragment {envelope.fragment} of {self.core.plan.count}"
            )
        try:
            tensors = codec.decode_tensors(
                envelope.payload,
                envelope.codec,
                max_raw_size=self.max_params_bytes,
                threads=self.settings.decode_threads,
                max_output_bytes=self.max_params_bytes,
            )
        except codec.CodecError as err:
            raise Rejected("bad_payload", str(err)) from err
        expected = self.piece_shapes[envelope.fragment]
        shapes = {k: v.shape for k, v in tensors.items()}
        if shapes != expected:
            raise Rejected(
                "shape_mismatch",
                f"fragment {envelope.fragment}: expected {len(expected)} pieces with the model's "
                f"shapes, got {sorted(shapes)[:3]}...",
            )
        if not all(np.isfinite(t).all() for t in tensors.values()):
            raise Rejected("non_finite", "pseudo-gradient contains NaN or Inf")
        self.ledger.codecs[envelope.codec["codec"]] += 1
        self.ledger.payload_bytes += len(envelope.payload)
        arrival = Arrival(
            unit=envelope.unit,
            round=envelope.round,
            base_version=envelope.base_version,
            inner_steps=envelope.inner_steps,
            tokens=envelope.tokens,
            pseudo_grad=tensors,
            arrived_at=time.monotonic(),
            upload=upload,
            context=(upload_msgs, envelope.train_loss),
        )
        self.core.offer(envelope.fragment, arrival)
        self.accepted_uploads.add(upload)

    async def merge_due(self, now: float) -> list[MergeResult]:
        """Merge every fragment whose policy says so and record it in the ledger.

        The merges run on a worker thread, so that the event loop goes on renewing the lease
        and sending heartbeats: a merge can take seconds (each new number of units in a merge
        compiles its combine, ~1 s per count on an idle CPU and several under load; a large
        model's step is slow), and an outer that falls silent that long looks not ready, or
        loses its lease to a standby. Nothing else changes the core meanwhile (this loop
        fetches again only after the merges); the ledger, which the heartbeat reads, is
        updated here on the loop. Nothing is published or acknowledged here: that follows
        the next commit.
        """
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(None, self._merge_all_due, now)
        for result in results:
            self._record(result)
        return results

    def _merge_all_due(self, now: float) -> list[MergeResult]:
        results = []
        while due := self.core.due(now):
            results += [self.core.merge(fragment) for fragment in due]
        return results

    def _record(self, result: MergeResult) -> None:
        self._dirty = True
        self.ledger.merges += 1
        for arrival, staleness in zip(result.arrivals, result.staleness, strict=True):
            self.ledger.applied_rounds.setdefault(arrival.unit, RoundSet()).add(arrival.round)
            self.accepted_uploads.discard(arrival.upload)
            self.ledger.applied += 1
            self.ledger.tokens_applied += arrival.tokens
            self.ledger.staleness[staleness] += 1
            unit = self.ledger.units.setdefault(arrival.unit, UnitLedger())
            unit.applied += 1
            unit.last_round = max(unit.last_round, arrival.round)
            unit.last_staleness = staleness
            unit.tokens += arrival.tokens
            unit.last_train_loss = arrival.context[1]
        losses = [
            float(a.context[1])
            for a in result.arrivals
            if isinstance(a.context[1], int | float) and math.isfinite(a.context[1])
        ]
        if losses:
            mean = round(sum(losses) / len(losses), 5)
            self.train_history.append([self.ledger.tokens_applied, mean])

    async def _publish_until_done(self, js: Any, fragment: int) -> bool:
        while True:
            try:
                await self._publish(js, fragment)
                return True
            except (TransportError, TimeoutError, nats.errors.Error) as err:
                if self.stop.is_set():
                    log.warning("stopping before fragment %d was published", fragment)
                    return False
                log.warning("publishing fragment %d failed (%s); retrying", fragment, err)
                await asyncio.sleep(0.5)

    async def _publish(self, js: Any, fragment: int) -> None:
        payload, description = codec.encode_tensors(
            self.core.fragment_params(fragment), codec="fp32", zstd_level=1
        )
        version = self.core.version(fragment)
        envelope = wire.Envelope(
            kind="params",
            job=self.settings.job,
            unit=-1,
            round=version,
            fragment=fragment,
            base_version=version,
            inner_steps=0,
            tokens=self.ledger.tokens_applied,
            train_loss=0.0,
            codec=description,
            sent_at=time.time(),
            payload=payload,
            model=self.settings.model,
        )
        await transport.publish_params(
            js,
            self.settings.job,
            fragment,
            version,
            wire.pack_envelope(envelope),
            transport.chunk_size_for(js._nc),
            params_checksum=wire.payload_checksum(payload),
        )

    def _reject(self, msgs: list[Any], rejected: Rejected, upload: str | None) -> None:
        """Count a bad upload (or chunk) by reason; its messages are copied to the dead-letter
        subject and terminated (never redelivered) after the next commit."""
        self._dirty = True
        self.ledger.rejected[rejected.reason] += 1
        log.warning("rejected upload: %s", rejected)
        if upload is not None:
            self.rejected_uploads.add(upload)
            with contextlib.suppress(wire.WireError):
                job, unit, round_, _ = wire.parse_upload_id(upload)
                if job == self.settings.job and unit >= 0:
                    self.ledger.rejected_rounds.setdefault(unit, RoundSet()).add(round_)
        self._to_terminate.append((msgs, str(rejected)))

    async def _terminate_rejected(self, js: Any) -> None:
        """Copy committed rejections to the dead-letter subject, then terminate them."""
        while self._to_terminate:
            msgs, reason = self._to_terminate[0]
            for msg in msgs:
                try:
                    await transport.dead_letter(js, self.settings.job, reason, msg)
                except (TimeoutError, nats.errors.Error) as err:
                    log.warning("dead-letter copy failed (%r); will retry", err)
                    return  # not terminated: retried after the next fetch
            for msg in msgs:
                with contextlib.suppress(nats.errors.Error):
                    await msg.term()
            self._to_terminate.pop(0)

    async def _evaluate(self) -> dict[str, Any]:
        params = pytree.unflatten_named(self.template, self.core.full_params())
        version = self.core.total_version
        result = await asyncio.get_running_loop().run_in_executor(None, self.evaluate, params)
        record = {
            "version": version,
            "tokens": self.ledger.tokens_applied,
            "nats_per_byte": round(result.nats_per_byte, 5),
            "bits_per_byte": round(result.bits_per_byte, 5),
            "time": time.time(),
        }
        self.eval_history.append([version, self.ledger.tokens_applied, record["nats_per_byte"]])
        del self.eval_history[:-EVAL_HISTORY]
        log.info(
            "eval v%d: %.4f nats/byte (%.4f bits/byte)",
            version,
            result.nats_per_byte,
            result.bits_per_byte,
        )
        return record

    # ---- status ----------------------------------------------------------------------------

    def status_record(self) -> dict[str, Any]:
        """The outer's heartbeat/status record as stored in KV."""
        core = getattr(self, "core", None)
        lease = self.lease
        return {
            "state": self.state_name,
            "model": self.settings.model,
            "holder": self.holder,
            "epoch": lease.epoch if lease is not None and lease.revision else None,
            "leader": self.leader_seen if self.state_name == "standby" else self.holder,
            "version": core.total_version if core else 0,
            "versions": [core.version(p) for p in range(core.plan.count)] if core else [],
            "applied": self.ledger.applied,
            "merges": self.ledger.merges,
            "buffered": len(self.accepted_uploads),
            "deduplicated": self.ledger.deduplicated,
            "tokens_applied": self.ledger.tokens_applied,
            "rejected": dict(self.ledger.rejected),
            "staleness": {str(k): v for k, v in sorted(self.ledger.staleness.items())},
            "codecs": dict(self.ledger.codecs),
            "payload_bytes": self.ledger.payload_bytes,
            "units": {str(u): vars(stats) for u, stats in self.ledger.units.items()},
            "applied_rounds": {
                str(u): r.ranges() for u, r in sorted(self.ledger.applied_rounds.items())
            },
            "rejected_rounds": {
                str(u): r.ranges() for u, r in sorted(self.ledger.rejected_rounds.items())
            },
            "checkpoints": self.checkpoints,
            "last_checkpoint": self.last_checkpoint,
            "restored_from": self.restored_from,
            "eval_init": self.eval_init,
            "eval": self.eval_last,
            "eval_history": self.eval_history[-50:],
            "train_history": list(self.train_history),
        }

    def _status_key(self) -> str:
        if self.state_name == "standby":
            return subjects.outer_standby_key(self.settings.job, self.holder)
        return subjects.outer_status_key(self.settings.job)

    async def _heartbeat(self, status_kv: Any) -> None:
        while True:
            try:
                await transport.put_status(status_kv, self._status_key(), self.status_record())
            except (TimeoutError, nats.errors.Error) as err:
                log.info("heartbeat: %r", err)
            await asyncio.sleep(self.settings.status_interval_s)
