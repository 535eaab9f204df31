"""The outer optimizer service: consume pseudo-gradients durably, apply them, publish versions.

Protocol per fetched batch of chunk messages (docs/ARCHITECTURE.md, "life of a pseudo-gradient"):

1. reassemble chunks into uploads (``shared.wire.Reassembler``);
2. validate each complete upload (envelope, job, model, codec, shapes, finiteness, staleness);
   a bad one is terminated (never redelivered), copied to the dead-letter subject and counted;
3. apply each good one with its staleness weight through outer Nesterov — version += 1 each;
4. publish the new global params (the durable commit point), and only then ack the chunks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import nats.errors
import nats.js.errors
import numpy as np
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.outer.optimizer import (
    OuterState,
    init_outer,
    make_outer_step,
    nesterov_outer,
    staleness_weight,
)
from services.outer.settings import OuterSettings
from shared import codec, data, evaluation, model, pytree, subjects, transport, wire
from shared.runtime import configure_jax
from shared.transport import TransportError

log = logging.getLogger(__name__)

ACK_WAIT_S = 300.0
EVAL_HISTORY = 200


class Rejected(Exception):
    """An upload that is not applied; ``reason`` is the counter it is recorded under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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
    """Counters for the status record (and, later, for balancing the books)."""

    applied: int = 0
    deduplicated: int = 0
    tokens_applied: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    units: dict[int, UnitLedger] = field(default_factory=dict)


class OuterService:
    """One job's outer optimizer, run with :meth:`run` until ``stop`` is set."""

    def __init__(self, settings: OuterSettings, stop: asyncio.Event) -> None:
        self.settings = settings
        self.stop = stop
        self.ledger = OuterLedger()
        self.applied_uploads: set[str] = set()
        self.rejected_uploads: set[str] = set()
        self._evictions_seen = 0
        self.eval_init: dict[str, Any] | None = None
        self.eval_last: dict[str, Any] | None = None
        self.eval_history: list[list[float]] = []
        self.state_name = "starting"

    # ---- set-up ----------------------------------------------------------------------------

    def _build_math(self) -> None:
        configure_jax()
        cfg = model.get_config(self.settings.model)
        corpus = data.split_corpus(
            data.load_corpus(self.settings.corpus, self.settings.corpus_max_bytes),
            self.settings.heldout_fraction,
        )
        batches = data.eval_batches(
            corpus.heldout, cfg.seq_len, self.settings.eval_batch_size, self.settings.eval_batches
        )
        self.evaluate = evaluation.make_evaluator(cfg, batches)
        self.template = model.init_params(cfg, jax.random.PRNGKey(self.settings.seed))
        self.param_bytes = 4 * model.param_count(self.template)
        self.optimizer = nesterov_outer(self.settings.outer_lr, self.settings.outer_momentum)
        self.outer_step = make_outer_step(self.optimizer)
        self.state: OuterState = init_outer(self.optimizer, self.template, version=0)

    async def _connect(self) -> Any:
        backoff = 0.5
        while not self.stop.is_set():
            try:
                return await transport.connect(self.settings, f"outer-{self.settings.job}")
            except TransportError as err:
                log.warning("%s; retrying in %.1fs", err, backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
        return None

    async def _restore_or_publish_initial(self, js: Any) -> None:
        """Continue from the newest published version (versions only move forward)."""
        fetched = await transport.read_latest_params(
            js, self.settings.job, max_bytes=2 * self.param_bytes + (1 << 20)
        )
        if fetched is None:
            await self._publish(js)
            return
        version, blob = fetched
        envelope = wire.unpack_envelope(blob, max_size=2 * self.param_bytes + (1 << 20))
        if envelope.model != self.settings.model:
            raise SystemExit(
                f"job {self.settings.job} already has params for model {envelope.model!r}, "
                f"not {self.settings.model!r}: use another --job or the same --model"
            )
        params = pytree.unflatten_named(
            self.template, codec.decode_tensors(envelope.payload, envelope.codec)
        )
        self.state = init_outer(self.optimizer, params, version=version)
        self.ledger.tokens_applied = envelope.tokens
        log.info("continuing job %s from published version %d", self.settings.job, version)

    async def _subscribe(self, js: Any) -> Any:
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
        await asyncio.get_running_loop().run_in_executor(None, self._build_math)
        nc = await self._connect()
        if nc is None:
            return self.status_record()
        js = nc.jetstream()
        await transport.ensure_streams(js)
        status_kv = await js.key_value(subjects.STATUS_BUCKET)
        await self._restore_or_publish_initial(js)
        self.eval_init = await self._evaluate()
        self.eval_last = self.eval_init
        sub = await self._subscribe(js)
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
                try:
                    msgs = await sub.fetch(self.settings.fetch_batch, timeout=1.0)
                except (TimeoutError, nats.errors.TimeoutError):
                    msgs = []
                except nats.errors.Error as err:
                    log.info("fetch: %r", err)
                    await asyncio.sleep(0.5)
                    continue
                ready = await self._process(js, msgs, reassembler, chunk_msgs)
                if ready:
                    await self._commit(js, ready)
                idle = not msgs
                due = time.monotonic() - last_eval >= self.settings.eval_every_s
                if self.eval_last["version"] != self.state.version and (idle or due):
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

    async def _process(
        self,
        js: Any,
        msgs: list[Any],
        reassembler: wire.Reassembler,
        chunk_msgs: dict[str, list[Any]],
    ) -> list[list[Any]]:
        """Reassemble, validate and apply; return the chunk messages of applied uploads."""
        ready: list[list[Any]] = []
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
                self._apply(info.upload, msg.subject, blob)
            except Rejected as rejected:
                self.rejected_uploads.add(info.upload)
                await self._reject(js, upload_msgs, rejected)
                continue
            ready.append(upload_msgs)
        return ready

    def _drain_evicted(self, reassembler: wire.Reassembler) -> list[str]:
        """Uploads the reassembler evicted since the last call (to terminate their chunks)."""
        new = reassembler.evicted - self._evictions_seen
        self._evictions_seen = reassembler.evicted
        return list(reassembler.recently_evicted[-new:]) if new else []

    def _apply(self, upload: str, subject: str, blob: bytes) -> None:
        """Validate one complete upload and apply it to the global params."""
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
        staleness = self.state.version - envelope.base_version
        if staleness < 0:
            raise Rejected(
                "future_base_version",
                f"base_version {envelope.base_version} > current {self.state.version}",
            )
        try:
            tensors = codec.decode_tensors(
                envelope.payload, envelope.codec, max_raw_size=2 * self.param_bytes + (1 << 20)
            )
        except codec.CodecError as err:
            raise Rejected("bad_payload", str(err)) from err
        if not all(np.isfinite(t).all() for t in tensors.values()):
            raise Rejected("non_finite", "pseudo-gradient contains NaN or Inf")
        try:
            pseudo_grad = pytree.unflatten_named(self.template, tensors)
        except pytree.PytreeMismatchError as err:
            raise Rejected("shape_mismatch", str(err)) from err

        # Synchronous DiLoCo averages K pseudo-gradients before one outer step; applying each
        # arrival alone, the 1/K factor moves the params about as far per cycle of K arrivals.
        weight = (
            staleness_weight(staleness, self.settings.staleness_exponent) / self.settings.num_units
        )
        params, opt_state = self.outer_step(
            self.state.params, self.state.opt_state, pseudo_grad, np.float32(weight)
        )
        self.state = OuterState(params, opt_state, self.state.version + 1)
        self.applied_uploads.add(upload)
        self.ledger.applied += 1
        self.ledger.tokens_applied += envelope.tokens
        unit = self.ledger.units.setdefault(envelope.unit, UnitLedger())
        unit.applied += 1
        unit.last_round = envelope.round
        unit.last_staleness = staleness
        unit.tokens += envelope.tokens
        unit.last_train_loss = envelope.train_loss
        log.debug("applied %s (staleness %d, weight %.3f)", upload, staleness, weight)

    async def _commit(self, js: Any, ready: list[list[Any]]) -> None:
        """Publish the new version, then ack what it contains (ack only after it is durable)."""
        while True:
            try:
                await self._publish(js)
                break
            except (TimeoutError, TransportError, nats.errors.Error) as err:
                if self.stop.is_set():
                    # Not acked, so JetStream redelivers these uploads to the next outer.
                    log.warning("stopping before version %d was published", self.state.version)
                    return
                log.warning("publishing version %d failed (%s); retrying", self.state.version, err)
                await asyncio.sleep(0.5)
        for upload_msgs in ready:
            for msg in upload_msgs:
                await msg.ack()

    async def _publish(self, js: Any) -> None:
        params = jax.device_get(self.state.params)
        payload, description = codec.encode_tensors(
            pytree.flatten_named(params), codec="fp32", zstd_level=1
        )
        envelope = wire.Envelope(
            kind="params",
            job=self.settings.job,
            unit=-1,
            round=self.state.version,
            fragment=0,
            base_version=self.state.version,
            inner_steps=0,
            tokens=self.ledger.tokens_applied,
            train_loss=0.0,
            codec=description,
            sent_at=time.time(),
            payload=payload,
            model=self.settings.model,
        )
        nc = js._nc
        await transport.publish_params(
            js,
            self.settings.job,
            self.state.version,
            wire.pack_envelope(envelope),
            transport.chunk_size_for(nc),
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
            try:
                await msg.term()
            except nats.errors.Error as err:
                log.info("term: %r", err)

    async def _evaluate(self) -> dict[str, Any]:
        params, version = self.state.params, self.state.version
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
        return {
            "state": self.state_name,
            "model": self.settings.model,
            "version": self.state.version,
            "applied": self.ledger.applied,
            "deduplicated": self.ledger.deduplicated,
            "tokens_applied": self.ledger.tokens_applied,
            "rejected": dict(self.ledger.rejected),
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
