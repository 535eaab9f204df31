"""Intake: fetched chunk messages in, validated arrivals offered to the core out.

For each chunk message, in order:

1. its headers are parsed (``bad_chunk_header`` if they cannot be);
2. an upload the books already hold is not taken again: a chunk of an applied upload (a
   redelivery after a crash, or a retry) is acknowledged and counted as ``deduplicated``; one
   of a rejected upload is dead-lettered and terminated; one of an upload buffered in the core
   waits for that upload's merge;
3. the chunk joins its upload (``inconsistent_ids`` if its id names another unit than its
   subject, ``bad_chunk`` if it does not fit). Incomplete uploads are held up to
   ``--max-pending-uploads`` and ``--max-pending-bytes``; beyond either, the least recently
   active one of the unit holding the most is evicted and rejected as ``incomplete_upload``;
4. a complete upload is validated (``validation.py``), checked against the unit's order of
   rounds and recent payloads (``order.py``: ``round_replayed``, ``payload_replayed``) and
   offered to the core (which may still reject it as too stale or from the future).

A rejected upload is counted in the books at once; its messages are dead-lettered and
terminated only after the rejection is committed (``publishing.DeadLetters``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import nats.errors

from services.outer.core import OuterCore
from services.outer.errors import Rejected
from services.outer.ledger import OuterLedger
from services.outer.norm_guard import update_norm
from services.outer.order import UploadOrder
from services.outer.policy import Arrival
from services.outer.publishing import DeadLetters
from services.outer.validation import UploadRules, validate
from shared import subjects
from shared.wire.chunks import Reassembler, WireError, parse_chunk_headers, parse_upload_id

log = logging.getLogger(__name__)


class Intake:
    """Reassembles, deduplicates and validates one job's uploads and offers them to the core.

    Attributes:
        buffered: Ids of the uploads accepted and waiting in the core for a merge.
    """

    def __init__(
        self,
        rules: UploadRules,
        core: OuterCore,
        ledger: OuterLedger,
        dead_letters: DeadLetters,
        max_pending_uploads: int,
        max_pending_bytes: int,
    ) -> None:
        self.rules = rules
        self.core = core
        self.ledger = ledger
        self.dead_letters = dead_letters
        self.reassembler = Reassembler(
            max_upload_bytes=rules.max_upload_bytes,
            max_pending_uploads=max_pending_uploads,
            max_pending_bytes=max_pending_bytes,
        )
        self.order = UploadOrder(ledger)
        self.quarantined: set[int] = set()  # units whose uploads are refused (the service's)
        self.buffered: set[str] = set()
        self._rejected_uploads: set[str] = set()
        self._chunks: dict[str, list[Any]] = collections.defaultdict(list)
        self._rejections = 0

    async def take(self, messages: Iterable[Any]) -> int:
        """Take a fetched batch of chunk messages (see the module docstring).

        Returns:
            How many uploads (or chunks) it rejected: the books changed and need a commit
            before their messages are dead-lettered.
        """
        rejections = self._rejections
        for msg in messages:
            try:
                info = parse_chunk_headers(msg.headers)
            except WireError as err:
                self._reject([msg], Rejected("bad_chunk_header", str(err)), None)
                continue
            own = self._unit_round(info.upload)
            done = self.ledger.is_done(*own) if own is not None else None
            if done == "applied":
                self.ledger.deduplicated += 1
                with contextlib.suppress(nats.errors.Error):
                    await msg.ack()
                continue
            if done == "rejected" or info.upload in self._rejected_uploads:
                # Deduplicated on the dead-letter subject by message id.
                self.dead_letters.add([msg], "chunk of an upload rejected earlier")
                continue
            if info.upload in self.buffered:
                continue  # acknowledged with the rest of its upload once merged
            # Another unit's chunk must not join (or evict) the upload its id names.
            if own is not None and _sender(msg.subject) != _sender(
                subjects.grads_subject(self.rules.job, own[0], 0)
            ):
                detail = f"a chunk of {info.upload} came on {msg.subject}"
                self._reject([msg], Rejected("inconsistent_ids", detail), None)
                continue
            self._chunks[info.upload].append(msg)
            try:
                blob = self.reassembler.add(info, msg.data, _sender(msg.subject))
            except WireError as err:
                self.reassembler.discard(info.upload)
                upload_msgs = self._chunks.pop(info.upload)
                self._reject(upload_msgs, Rejected("bad_chunk", str(err)), info.upload)
                continue
            for evicted in self.reassembler.take_evicted():
                detail = (
                    f"{evicted} evicted before completion: more incomplete uploads than "
                    "--max-pending-uploads, or more of their bytes than --max-pending-bytes; "
                    "its unit held the most of them"
                )
                upload_msgs = self._chunks.pop(evicted, [])
                self._reject(upload_msgs, Rejected("incomplete_upload", detail), evicted)
            if blob is not None:
                self._offer(info.upload, msg.subject, blob, self._chunks.pop(info.upload))
        return self._rejections - rejections

    def merged(self, arrivals: Iterable[Arrival]) -> None:
        """Forget the uploads a merge used (their messages are acknowledged after the commit)."""
        arrivals = list(arrivals)
        for arrival in arrivals:
            self.buffered.discard(arrival.upload)
        self.order.merged(arrival.upload for arrival in arrivals)

    def reject_held(self, arrival: Arrival, rejected: Rejected) -> None:
        """Reject an upload the core held for peers and judged later (``OuterCore.settle``);
        its messages are dead-lettered after the next commit."""
        self.buffered.discard(arrival.upload)
        self._reject(list(arrival.messages), rejected, arrival.upload)

    def withdraw_quarantined(self) -> bool:
        """Reject the uploads of quarantined units that the core holds for peers (they came
        before the outer knew of the quarantine); whether there were any."""
        withdrawn = False
        for unit in sorted(self.quarantined):
            for arrival in self.core.withdraw(unit):
                self.reject_held(arrival, Rejected("quarantined", f"unit {unit} is quarantined"))
                withdrawn = True
        return withdrawn

    def _reject(self, messages: list[Any], rejected: Rejected, upload: str | None) -> None:
        """Count a bad upload (or chunk) by reason and queue its messages for dead-lettering."""
        log.warning("rejected upload: %s", rejected)
        self._rejections += 1
        unit_round = None
        if upload is not None:
            self._rejected_uploads.add(upload)
            with contextlib.suppress(WireError):
                job, unit, round_, _ = parse_upload_id(upload)
                if job == self.rules.job and unit >= 0:
                    unit_round = (unit, round_)
        self.ledger.reject(rejected.reason, unit_round)
        self.dead_letters.add(messages, str(rejected))

    def _offer(self, upload: str, subject: str, blob: memoryview, messages: list[Any]) -> None:
        try:
            valid = validate(
                upload, subject, blob, self.rules, arrived_at=time.monotonic(), messages=messages
            )
            # The norm once, here: a zero update is no work to replay (``order.py``), and the
            # core's norm guard reads it from the arrival.
            arrival = dataclasses.replace(
                valid.arrival, norm=update_norm(valid.arrival.pseudo_grad)
            )
            if arrival.unit in self.quarantined:
                raise Rejected("quarantined", f"unit {arrival.unit} is quarantined")
            fingerprint = valid.fingerprint if arrival.norm else None
            self.order.check(arrival.unit, arrival.round, fingerprint)
            self.core.offer(valid.fragment, arrival)
        except Rejected as rejected:
            self._reject(messages, rejected, upload)
            return
        self.order.accepted(arrival.unit, arrival.round, fingerprint, upload)
        self.ledger.accept(valid.codec, valid.payload_bytes)
        self.buffered.add(upload)

    def _unit_round(self, upload: str) -> tuple[int, int] | None:
        """The unit and round an upload id of this job names; None for another job's id or
        one that does not parse (validation rejects such uploads whole)."""
        try:
            job, unit, round_, _ = parse_upload_id(upload)
        except WireError:
            return None
        return (unit, round_) if job == self.rules.job else None


def _sender(subject: str) -> str:
    """Who sent a chunk: the unit part of its subject (``diloco.<job>.grads.<unit>``), which
    the unit's credentials alone may publish to."""
    return subject.rpartition(".")[0]
