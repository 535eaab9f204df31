"""Where a new leader continues from: the committed checkpoint, else the newest published params
of each fragment (outer momentum then restarts from zero), else version 0."""

from __future__ import annotations

import logging
from typing import Any

from services.outer import checkpoint
from services.outer.core import OuterCore
from services.outer.ledger import OuterLedger
from services.outer.status import Progress
from shared.codec import api as codec
from shared.records.outer import CheckpointPointer, RestoredFrom
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
) -> None:
    """Continue from a committed checkpoint: the core, the norm guard, peer review, the books
    and the evaluations, exactly as they were committed.

    Raises:
        WrongModel: the checkpoint is another job's or another model's.
    """
    if snapshot.job != job or snapshot.model != model:
        raise WrongModel(
            f"job {job} has a checkpoint of model {snapshot.model!r}, not {model!r}: use "
            "another --job or the same --model"
        )
    core.import_state(snapshot.versions, snapshot.params, snapshot.opt_leaves)
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
) -> None:
    """Continue each fragment from its newest published params, if any (its outer momentum
    restarts from zero); the tokens applied so far come from the params' envelope.

    Raises:
        WrongModel: the published params are another model's.
        WireError: the params stream holds something else than a params envelope.
    """
    for fragment in range(core.plan.count):
        fetched = await read_latest_params(js, job, fragment, max_params_bytes)
        if fetched is None:
            continue
        head, blob = fetched
        envelope = unpack_envelope(blob, max_size=max_params_bytes)
        if not isinstance(envelope, ParamsEnvelope):
            raise WireError(f"the params stream of fragment {fragment} holds {envelope.kind}")
        if envelope.model != model:
            raise WrongModel(
                f"job {job} already has params for model {envelope.model!r}, not {model!r}: "
                "use another --job or the same --model"
            )
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
