"""Where a new leader continues from: the committed checkpoint, else the newest published params
of each fragment (outer momentum then restarts from zero), else version 0."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from services.outer import checkpoint
from services.outer.core import OuterCore
from services.outer.ledger import OuterLedger
from services.outer.status import Progress
from shared import fragments, kv, subjects
from shared.codec import api as codec
from shared.records.outer import CheckpointPointer, LeaseRecord, RestoredFrom
from shared.transport.params import read_latest_params
from shared.wire.chunks import WireError
from shared.wire.envelope import ParamsEnvelope, unpack_envelope

log = logging.getLogger(__name__)


class WrongModel(SystemExit):
    """The job's stored state is of another model than this outer's ``--model``."""


def from_checkpoint(
    snapshot: checkpoint.OuterSnapshot,
    pointer: CheckpointPointer,
    job: str,
    model: str,
    core: OuterCore,
    ledger: OuterLedger,
    progress: Progress,
    fragments: Sequence[int],
) -> None:
    """Continue ``fragments`` (the shard's) from a committed checkpoint: the core, the norm
    guard, peer review, the books and the evaluations, exactly as they were committed.

    Raises:
        WrongModel: the checkpoint is another job's or another model's, or another
            split into shards'.
    """
    if snapshot.job != job or snapshot.model != model:
        raise WrongModel(
            f"job {job} has a checkpoint of model {snapshot.model!r}, not {model!r}: use "
            "another --job or the same --model"
        )
    held = snapshot.fragments
    if held is not None and held != list(fragments):
        raise WrongModel(
            f"job {job}'s checkpoint of this shard holds fragments {held}, not "
            f"{list(fragments)}: use the --shards the job was started with"
        )
    core.import_state(snapshot.versions, snapshot.params, snapshot.opt_leaves, fragments)
    core.guard.restore(snapshot.norms)
    if core.peers is not None and snapshot.peers:  # else: a checkpoint without peer review
        core.peers.restore(snapshot.peers)
    ledger.load(snapshot.ledger)
    progress.evaluation = snapshot.evaluation
    progress.restored_from = RestoredFrom(
        kind="checkpoint", id=pointer.id, versions=pointer.versions
    )
    log.info("restored checkpoint %s (versions %s)", pointer.id, pointer.versions)


async def from_published_params(
    js: Any,
    job: str,
    model: str,
    max_params_bytes: int,
    core: OuterCore,
    ledger: OuterLedger,
    progress: Progress,
    fragments: Sequence[int],
) -> None:
    """Continue each of ``fragments`` (the shard's) from its newest published params, if any
    (its outer momentum restarts from zero); the tokens applied so far come from the params'
    envelope.

    Raises:
        WrongModel: the published params are another model's.
        WireError: the params stream holds something else than a params envelope.
    """
    for fragment in fragments:
        fetched = await read_latest_params(js, job, fragment, max_params_bytes)
        if fetched is None:
            continue
        head, blob = fetched
        envelope = _params_envelope(job, model, fragment, blob, max_params_bytes)
        core.restore(fragment, head.version, codec.decode_tensors(envelope.payload, envelope.codec))
        ledger.tokens_applied = max(ledger.tokens_applied, envelope.tokens)
        versions = [core.version(p) for p in range(core.plan.count)]
        progress.restored_from = RestoredFrom(kind="params", versions=versions)
        log.warning(
            "fragment %d continues from published version %d without a checkpoint "
            "(outer momentum restarts from zero)",
            fragment,
            head.version,
        )


async def follow_shards(
    js: Any,
    outer_kv: Any,
    job: str,
    model: str,
    core: OuterCore,
    shard: int,
    shards: int,
    max_checkpoint_bytes: int,
    seen: dict[int, str],
) -> dict[int, int]:
    """Bring the other shards' fragments in ``core`` to their newest committed checkpoints
    (exact float32 params: the published ones may be quantized), so that the evaluating
    shard evaluates the whole model. A checkpoint already read (its id in ``seen``, which is
    updated) is not read again.

    Returns:
        Per shard whose checkpoint was read, the tokens it had applied.

    Raises:
        WrongModel: a checkpoint of another model, or another split into shards.
        checkpoint.CheckpointError: a checkpoint that cannot be read (torn: its shard
            replaced it meanwhile; read again next time).
        TransportError, nats.errors.Error: NATS errors.
    """
    tokens = {}
    for other in range(shards):
        if other == shard:
            continue
        found = await kv.get(outer_kv, subjects.lease_key(job, other), LeaseRecord)
        pointer = found.pointer if found is not None else None
        if pointer is None or seen.get(other) == pointer.id:
            continue
        store = checkpoint.CheckpointStore(js, job, other, 1, max_checkpoint_bytes)
        snapshot = checkpoint.loads(await store.read(pointer))
        owned = list(fragments.shard_fragments(other, shards, core.plan.count))
        if snapshot.job != job or snapshot.model != model or snapshot.fragments != owned:
            raise WrongModel(
                f"shard {other} of job {job} committed a checkpoint of model "
                f"{snapshot.model!r} with fragments {snapshot.fragments}, not {model!r} with "
                f"{owned}: every shard needs the same --model and --shards"
            )
        for fragment in owned:
            core.restore(fragment, snapshot.versions[fragment], snapshot.params[fragment])
        seen[other] = pointer.id
        tokens[other] = snapshot.ledger.tokens_applied
    return tokens


def _params_envelope(
    job: str, model: str, fragment: int, blob: bytes, max_params_bytes: int
) -> ParamsEnvelope:
    envelope = unpack_envelope(blob, max_size=max_params_bytes)
    if not isinstance(envelope, ParamsEnvelope):
        raise WireError(f"the params stream of fragment {fragment} holds {envelope.kind}")
    if envelope.model != model:
        raise WrongModel(
            f"job {job} already has params for model {envelope.model!r}, not {model!r}: "
            "use another --job or the same --model"
        )
    return envelope
