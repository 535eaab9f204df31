"""The outer's whole state as one blob, and its durable home in JetStream.

**What is saved** (:class:`OuterSnapshot`): per fragment the global params, the outer
optimizer's state (every leaf of its pytree: momentum, Delayed Nesterov's accumulator and
counter) and the version; the ledger (counters, per-unit applied and rejected rounds, which is
also the deduplication set); the evaluation record; the norms the norm guard judges by
(``norm_guard.py``); what peer review judges by (``peers.py``); and the payload fingerprints of
recently merged uploads (``order.py``).
Uploads waiting in a merge buffer are
*not* copied: their chunk messages stay unacknowledged in the work-queue stream until the merge
that uses them is checkpointed, so JetStream holds them, and a restarted outer gets them again.

An outer shard (``--shards``) saves its own fragments' params and optimizer state, and its own
books, in a checkpoint of its own.

**Where** (see :class:`CheckpointStore`): the blob is split into chunks on
``diloco.J.ckpt.<shard>.e<epoch>.<slot>.chunk.<i>`` in the ``DILOCO_CKPT`` stream (file storage, one
message per subject), alternating between two slots so that the slot being written is never
the one the pointer names. The *pointer* (``shared.records.CheckpointPointer``: which slot, how
many chunks, the XXH3-64 checksum, the versions) lives in the outer's lease record
(``services/outer/lease.py``; one per shard) and is replaced with a compare-and-set on that record's
revision. Writing the pointer is the commit: a crash at any moment leaves either the old
pointer with its intact slot or the new one. A deposed leader's compare-and-set fails
(fencing), and every leadership epoch writes its own subjects, so a deposed leader still
writing chunks cannot tear its successor's checkpoint.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import nats.errors
import nats.js.errors
import numpy as np
import xxhash
from pydantic import ValidationError

from services.outer.peers import Latest
from shared import subjects
from shared.records import R
from shared.records.outer import CheckpointPointer, EvaluationRecord, LedgerRecord
from shared.transport import TransportError
from shared.transport.blobs import publish_blob
from shared.wire.chunks import Reassembler, WireError, parse_chunk_headers

FORMAT = 5
_HEADER_LENGTH = struct.Struct("<Q")  # the header's length, at the start of a checkpoint


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (torn, corrupt, another model or format)."""


@dataclass
class OuterSnapshot:
    """Everything a restarted outer needs to continue exactly where the last one committed.

    Attributes:
        job, model: What the state belongs to; a mismatch refuses the checkpoint.
        versions: Version of each fragment.
        params: Per fragment, piece name -> float32 array (empty for a fragment the outer
            shard does not own).
        opt_leaves: Per fragment, the leaves of the outer optimizer state pytree, in
            ``jax.tree_util`` order (the tree structure comes from the optimizer itself;
            empty for a fragment the shard does not own).
        ledger: The outer's books (``services/outer/ledger.py``).
        evaluation: Its held-out evaluations.
        norms: Per fragment and unit, the norms of merged uploads the norm guard judges by.
        peers: Per fragment and unit, what peer review keeps of its latest upload (empty
            without peer review).
        fingerprints: The payload fingerprints of recently merged uploads (``order.py``).
        fragments: The fragments whose params and optimizer state it holds (its outer
            shard's); None: every fragment.
    """

    job: str
    model: str
    versions: list[int]
    params: list[dict[str, np.ndarray]]
    opt_leaves: list[list[np.ndarray]]
    ledger: LedgerRecord = field(default_factory=LedgerRecord)
    evaluation: EvaluationRecord = field(default_factory=EvaluationRecord)
    norms: list[dict[int, list[float]]] = field(default_factory=list)
    peers: list[dict[int, Latest]] = field(default_factory=list)
    fingerprints: list[int] = field(default_factory=list)
    fragments: list[int] | None = None


class _DataSection:
    """The arrays of a checkpoint, laid end to end after its header; the header names each by
    dtype, shape and offset."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.size = 0

    def add(self, array: Any) -> dict[str, Any]:
        """Place ``array`` at the end of the section; returns its entry for the header."""
        a = np.asarray(array)
        if not a.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
            a = a.copy(order="C")
        entry = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": self.size}
        self.arrays.append(a)
        self.size += a.nbytes
        return entry


def _unpack_array(item: Any, data: memoryview) -> np.ndarray:
    try:
        dtype = np.dtype(item["dtype"])
        shape = tuple(int(d) for d in item["shape"])
        offset = int(item["offset"])
        if dtype.hasobject or offset < 0 or any(d < 0 for d in shape):
            raise ValueError(f"{dtype} array of shape {shape} at offset {offset}")
        count = int(np.prod(shape, dtype=np.int64))
        if offset + count * dtype.itemsize > len(data):
            raise ValueError(f"{dtype} array of shape {shape} at {offset} ends past the data")
        array = np.frombuffer(data, dtype, count=count, offset=offset).reshape(shape)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"checkpoint holds a malformed array: {exc}") from exc
    return array.copy()  # writable, owned


def _pack_latest(kept: Latest, data: _DataSection) -> dict[str, Any]:
    return {
        "upload": kept.upload,
        "sketch": data.add(np.asarray(kept.sketch, np.float32)),
        "norm": float(kept.norm),
        "steps": int(kept.steps),
        "version": int(kept.version),
        "count": int(kept.count),
        "claimed": int(kept.claimed),
        "refused": bool(kept.refused),
    }


def _unpack_latest(item: Any, data: memoryview) -> Latest:
    return Latest(
        upload=str(item["upload"]),
        sketch=_unpack_array(item["sketch"], data).astype(np.float32).reshape(-1),
        norm=float(item["norm"]),
        steps=int(item["steps"]),
        version=int(item["version"]),
        count=int(item["count"]),
        claimed=int(item["claimed"]),
        refused=bool(item["refused"]),
    )


def dumps(snapshot: OuterSnapshot) -> memoryview:
    """Serialise a snapshot: the length of its header (8 bytes, little-endian), the header (a
    msgpack map; each array in it as dtype, shape and offset) and the arrays' bytes."""
    data = _DataSection()
    body = {
        "format": FORMAT,
        "job": snapshot.job,
        "model": snapshot.model,
        "versions": [int(v) for v in snapshot.versions],
        "fragments": (
            list(range(len(snapshot.versions)))
            if snapshot.fragments is None
            else [int(p) for p in snapshot.fragments]
        ),
        "params": [{k: data.add(v) for k, v in p.items()} for p in snapshot.params],
        "opt_leaves": [[data.add(leaf) for leaf in leaves] for leaves in snapshot.opt_leaves],
        "ledger": snapshot.ledger.model_dump(mode="json"),
        "evaluation": snapshot.evaluation.model_dump(mode="json"),
        # msgpack maps keyed by integers are refused when read: (unit, value) pairs instead.
        "norms": [
            [[int(unit), [float(n) for n in norms]] for unit, norms in per_unit.items()]
            for per_unit in snapshot.norms
        ],
        "peers": [
            [[int(unit), _pack_latest(kept, data)] for unit, kept in per_unit.items()]
            for per_unit in snapshot.peers
        ],
        "fingerprints": data.add(np.asarray(snapshot.fingerprints, np.uint64)),
    }
    header = msgpack.packb(body, use_bin_type=True)
    start = _HEADER_LENGTH.size + len(header)
    # One buffer of the final size, filled once. numpy asks the kernel for huge pages for a
    # buffer this large, so filling it costs a few page faults where a growing bytes object
    # (msgpack's own buffer) faulted in every 4 KiB page twice: for a 130 MB state that was
    # most of the commit's CPU.
    blob = np.empty(start + data.size, np.uint8)
    _HEADER_LENGTH.pack_into(blob, 0, len(header))
    blob[_HEADER_LENGTH.size : start] = np.frombuffer(header, np.uint8)
    for array in data.arrays:
        blob[start : start + array.nbytes] = array.reshape(-1).view(np.uint8)
        start += array.nbytes
    return memoryview(blob)


def loads(blob: bytes | memoryview) -> OuterSnapshot:
    """Parse :func:`dumps` output.

    Raises:
        CheckpointError: for anything but a well-formed checkpoint of this format.
    """
    view = memoryview(blob).cast("B")
    if len(view) < _HEADER_LENGTH.size:
        raise CheckpointError(f"checkpoint of {len(view)} bytes has no header")
    (length,) = _HEADER_LENGTH.unpack_from(view)
    start = _HEADER_LENGTH.size + length
    if start > len(view):
        raise CheckpointError(f"checkpoint header of {length} bytes ends past the checkpoint")
    try:
        body = msgpack.unpackb(view[_HEADER_LENGTH.size : start], raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise CheckpointError(f"checkpoint header is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format is not {FORMAT}")
    data = view[start:]
    ledger = _part(LedgerRecord, body, "ledger")
    evaluation = _part(EvaluationRecord, body, "evaluation")
    try:
        return OuterSnapshot(
            job=str(body["job"]),
            model=str(body["model"]),
            versions=[int(v) for v in body["versions"]],
            fragments=[int(p) for p in body["fragments"]],
            params=[{k: _unpack_array(v, data) for k, v in p.items()} for p in body["params"]],
            opt_leaves=[
                [_unpack_array(leaf, data) for leaf in leaves] for leaves in body["opt_leaves"]
            ],
            ledger=ledger,
            evaluation=evaluation,
            norms=[
                {int(unit): [float(n) for n in norms] for unit, norms in per_unit}
                for per_unit in body["norms"]
            ],
            peers=[
                {int(unit): _unpack_latest(kept, data) for unit, kept in per_unit}
                for per_unit in body["peers"]
            ],
            fingerprints=[int(v) for v in _unpack_array(body["fingerprints"], data).reshape(-1)],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint is missing or has a malformed field: {exc}") from exc


def _part(model: type[R], body: dict[str, Any], key: str) -> R:
    """The record under ``key`` of a checkpoint body, validated."""
    try:
        return model.model_validate(body[key])
    except (KeyError, ValidationError) as exc:
        raise CheckpointError(f"checkpoint {key} does not fit {model.__name__}: {exc}") from exc


def checkpoint_id(job: str, shard: int, epoch: int, seq: int) -> str:
    """The id of outer shard ``shard``'s ``seq``-th checkpoint of its leadership ``epoch``
    (its chunks' upload id, by which JetStream deduplicates them).

    Every leadership of a shard has an epoch of its own, so numbering each one's checkpoints
    from 1 keeps the ids unique.
    """
    return f"{job}.ckpt.{shard}.e{epoch}.s{seq}"


class CheckpointStore:
    """Writes one outer shard's checkpoint chunks to a slot and reads a committed one back."""

    def __init__(self, js: Any, job: str, shard: int, chunk_size: int, max_bytes: int) -> None:
        self.js = js
        self.job = job
        self.shard = shard
        self.chunk_size = chunk_size
        self.max_bytes = max_bytes

    async def write(
        self, blob: bytes | memoryview, epoch: int, seq: int, slot: int, versions: list[int]
    ) -> CheckpointPointer:
        """Store ``blob`` in ``slot`` of ``epoch``; returns the pointer that would commit it.

        Raises:
            TransportError: when the chunks cannot be stored.
        """
        name = checkpoint_id(self.job, self.shard, epoch, seq)
        sequences = await publish_blob(
            self.js,
            lambda i: subjects.checkpoint_chunk_subject(self.job, self.shard, epoch, slot, i),
            blob,
            name,
            self.chunk_size,
        )
        return CheckpointPointer(
            id=name,
            epoch=epoch,
            slot=slot,
            chunks=len(sequences),
            size=len(blob),
            checksum=xxhash.xxh3_64_intdigest(blob),
            versions=versions,
        )

    async def read(self, pointer: CheckpointPointer) -> memoryview:
        """The blob a pointer names, checked against its id, size and checksum.

        Raises:
            CheckpointError: torn (a chunk of another checkpoint), missing or corrupt.
            TransportError: NATS errors.
        """
        if pointer.size > self.max_bytes:
            raise CheckpointError(f"checkpoint of {pointer.size} bytes exceeds {self.max_bytes}")
        reassembler = Reassembler(max_upload_bytes=max(1, pointer.size), max_pending_uploads=1)
        blob: memoryview | None = memoryview(b"") if pointer.size == 0 else None
        for index in range(pointer.chunks):
            subject = subjects.checkpoint_chunk_subject(
                self.job, self.shard, pointer.epoch, pointer.slot, index
            )
            try:
                msg = await self.js.get_last_msg(subjects.CKPT_STREAM, subject, direct=True)
            except nats.js.errors.NotFoundError as exc:
                raise CheckpointError(f"checkpoint chunk {subject} is missing") from exc
            try:
                info = parse_chunk_headers(msg.headers)
                if info.upload != pointer.id:
                    raise CheckpointError(
                        f"checkpoint chunk {index} belongs to {info.upload}, not {pointer.id}"
                    )
                blob = reassembler.add(info, msg.data)
            except WireError as exc:
                raise CheckpointError(f"checkpoint chunk {index}: {exc}") from exc
        if (
            blob is None
            or len(blob) != pointer.size
            or xxhash.xxh3_64_intdigest(blob) != pointer.checksum
        ):
            raise CheckpointError(f"checkpoint {pointer.id} is incomplete or fails its checksum")
        return blob

    async def purge_epochs_before(self, epoch: int) -> None:
        """Delete the chunks of older leadership epochs (best effort)."""
        info = await self.js.stream_info(
            subjects.CKPT_STREAM, subjects_filter=subjects.checkpoint_filter(self.job, self.shard)
        )
        stale = {
            name
            for name in (getattr(info.state, "subjects", None) or {})
            if subjects.checkpoint_epoch(name) is not None
            and subjects.checkpoint_epoch(name) < epoch
        }
        for prefix in {
            subjects.checkpoint_epoch_filter(self.job, self.shard, subjects.checkpoint_epoch(n))
            for n in stale
        }:
            try:
                await self.js.purge_stream(subjects.CKPT_STREAM, subject=prefix)
            except (TimeoutError, nats.errors.Error):
                return


__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "OuterSnapshot",
    "TransportError",
    "checkpoint_id",
    "dumps",
    "loads",
]
