"""The outer optimizer service: consume pseudo-gradients durably, merge them, publish versions.

Protocol per fetched batch of chunk messages (docs/ARCHITECTURE.md, "life of a pseudo-gradient"):

1. reassemble chunks into uploads (``shared.wire.Reassembler``);
2. validate each complete upload (envelope, job, model, fragment, codec, shapes, finiteness,
   staleness); a bad one is terminated (never redelivered), copied to the dead-letter subject
   and counted by reason;
3. offer each good one to ``OuterCore``, whose merge policy decides when a fragment is merged
   (every arrival alone, or a quorum plus an adaptive grace window);
4. for every merged fragment, publish its new global params (the durable commit point), and only
   then ack the chunks of every upload that went into it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import nats.errors
import numpy as np
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.outer.core import MergeResult, OuterCore, Rejected
from services.outer.policy import Arrival
from services.outer.settings import OuterSettings
from shared import codec, data, evaluation, model, pytree, subjects, transport, wire
from shared.runtime import configure_jax
from shared.transport import TransportError

log = logging.getLogger(__name__)

ACK_WAIT_S = 300.0
EVAL_HISTORY = 200


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
    """Counters for the status record (and for balancing the books)."""

    applied: int = 0
    merges: int = 0
    deduplicated: int = 0
    tokens_applied: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    units: dict[int, UnitLedger] = field(default_factory=dict)
    staleness: collections.Counter[int] = field(default_factory=collections.Counter)
    # Accepted uploads by the codec named in their description, and their compressed bytes.
    codecs: collections.Counter[str] = field(default_factory=collections.Counter)
    payload_bytes: int = 0


class OuterService:
    """One job's outer optimizer, run with :meth:`run` until ``stop`` is set."""

    def __init__(self, settings: OuterSettings, stop: asyncio.Event) -> None:
        self.settings = settings
        self.stop = stop
        self.ledger = OuterLedger()
        self.accepted_uploads: set[str] = set()
        self.applied_uploads: set[str] = set()
        self.rejected_uploads: set[str] = set()
        self._evictions_seen = 0
        self.eval_init: dict[str, Any] | None = None
        self.eval_last: dict[str, Any] | None = None
        self.eval_history: list[list[float]] = []
        self.state_name = "starting"

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

    async def _restore_or_publish_initial(self, js: Any) -> None:
        """Continue each fragment from its newest published version (versions only go up)."""
        for fragment in range(self.core.plan.count):
            fetched = await transport.read_latest_params(
                js, self.settings.job, fragment, self.max_params_bytes
            )
            if fetched is None:
                await self._publish(js, fragment)
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
            log.info("fragment %d continues from published version %d", fragment, version)

    async def subscribe(self, js: Any) -> Any:
        """Create or update the durable consumer and bind to it."""
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
        # add_consumer creates or updates (pull_subscribe would silently keep an old config).
        await js.add_consumer(subjects.GRADS_STREAM, config)
        return await js.pull_subscribe_bind(durable=durable, stream=subjects.GRADS_STREAM)

    # ---- main loop -------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Serve until ``stop`` is set; returns the final status record."""
        await asyncio.get_running_loop().run_in_executor(None, self.build_math)
        nc = await transport.connect_with_retry(
            self.settings, f"outer-{self.settings.job}", stopping=self.stop.is_set
        )
        if nc is None:
            return self.status_record()
        js = nc.jetstream()
        await transport.ensure_streams(js)
        status_kv = await js.key_value(subjects.STATUS_BUCKET)
        await self._restore_or_publish_initial(js)
        self.eval_init = await self._evaluate()
        self.eval_last = self.eval_init
        sub = await self.subscribe(js)
        self.state_name = "running"
        heartbeat = asyncio.create_task(self._heartbeat(status_kv))
        reassembler = wire.Reassembler(
            max_upload_bytes=self.settings.max_upload_bytes,
            max_pending_uploads=self.settings.max_pending_uploads,
        )
        chunk_msgs: dict[str, list[Any]] = collections.defaultdict(list)
        last_eval = time.monotonic()
        try:
            while not self.stop.is_set():
                deadline = self.core.next_deadline()
                wait_s = (
                    1.0 if deadline is None else min(1.0, max(0.05, deadline - time.monotonic()))
                )
                try:
                    msgs = await sub.fetch(self.settings.fetch_batch, timeout=wait_s)
                except (TimeoutError, nats.errors.TimeoutError):
                    msgs = []
                except nats.errors.Error as err:
                    log.info("fetch: %r", err)
                    await asyncio.sleep(0.5)
                    continue
                await self.process(js, msgs, reassembler, chunk_msgs)
                await self.merge_due(js, time.monotonic())
                idle = not msgs
                due = time.monotonic() - last_eval >= self.settings.eval_every_s
                if self.eval_last["version"] != self.core.total_version and (idle or due):
                    self.eval_last = await self._evaluate()
                    last_eval = time.monotonic()
        finally:
            self.state_name = "stopped"
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            try:
                await transport.put_status(
                    status_kv, subjects.outer_status_key(self.settings.job), self.status_record()
                )
                await asyncio.wait_for(nc.close(), timeout=5)
            except (TimeoutError, nats.errors.Error) as err:
                log.warning("closing NATS: %s", err)
        return self.status_record()

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
                await self._reject(js, [msg], Rejected("bad_chunk_header", str(err)))
                continue
            if info.upload in self.applied_uploads:
                self.ledger.deduplicated += 1
                await msg.ack()
                continue
            if info.upload in self.accepted_uploads:
                continue  # a redelivery of an upload still buffered: acked when it is merged
            if info.upload in self.rejected_uploads:
                await msg.term()
                continue
            chunk_msgs[info.upload].append(msg)
            try:
                blob = reassembler.add(info, msg.data)
            except wire.WireError as err:
                reassembler.discard(info.upload)
                self.rejected_uploads.add(info.upload)
                await self._reject(js, chunk_msgs.pop(info.upload), Rejected("bad_chunk", str(err)))
                continue
            for evicted in self._drain_evicted(reassembler):
                await self._reject(
                    js,
                    chunk_msgs.pop(evicted, []),
                    Rejected("incomplete_upload", f"{evicted} evicted before completion"),
                )
            if blob is None:
                continue
            upload_msgs = chunk_msgs.pop(info.upload)
            try:
                self._accept(info.upload, msg.subject, blob, upload_msgs)
            except Rejected as rejected:
                self.rejected_uploads.add(info.upload)
                await self._reject(js, upload_msgs, rejected)

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

    async def merge_due(self, js: Any, now: float) -> list[MergeResult]:
        """Merge every fragment whose policy says so, publish, then ack what went in."""
        results = []
        while due := self.core.due(now):
            results += [self.core.merge(fragment) for fragment in due]
        for result in results:
            self._record(result)
            if not await self._publish_until_done(js, result.fragment):
                return results  # stopping: not acked, so JetStream redelivers to the next outer
            for arrival in result.arrivals:
                for msg in arrival.context[0]:
                    await msg.ack()
        return results

    def _record(self, result: MergeResult) -> None:
        self.ledger.merges += 1
        for arrival, staleness in zip(result.arrivals, result.staleness, strict=True):
            self.applied_uploads.add(arrival.upload)
            self.accepted_uploads.discard(arrival.upload)
            self.ledger.applied += 1
            self.ledger.tokens_applied += arrival.tokens
            self.ledger.staleness[staleness] += 1
            unit = self.ledger.units.setdefault(arrival.unit, UnitLedger())
            unit.applied += 1
            unit.last_round = arrival.round
            unit.last_staleness = staleness
            unit.tokens += arrival.tokens
            unit.last_train_loss = arrival.context[1]

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
        )

    async def _reject(self, js: Any, msgs: list[Any], rejected: Rejected) -> None:
        """Terminate a bad upload's messages, record the reason, keep going."""
        self.ledger.rejected[rejected.reason] += 1
        log.warning("rejected upload: %s", rejected)
        headers = dict(msgs[0].headers or {}) if msgs else {}
        await transport.dead_letter(
            js, self.settings.job, str(rejected), headers, sum(len(m.data) for m in msgs)
        )
        for msg in msgs:
            with contextlib.suppress(nats.errors.Error):
                await msg.term()

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
        return {
            "state": self.state_name,
            "model": self.settings.model,
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
            "eval_init": self.eval_init,
            "eval": self.eval_last,
            "eval_history": self.eval_history[-50:],
        }

    async def _heartbeat(self, status_kv: Any) -> None:
        key = subjects.outer_status_key(self.settings.job)
        while True:
            try:
                await transport.put_status(status_kv, key, self.status_record())
            except (TimeoutError, nats.errors.Error) as err:
                log.info("heartbeat: %r", err)
            await asyncio.sleep(self.settings.status_interval_s)
