"""Upload order: a unit's rounds arrive in the order it numbered them, and no payload is
accepted twice.

A learner numbers its uploads 0, 1, 2, ... and publishes them first in, first out
(``services/learner/sender.py``); JetStream keeps that order on the unit's subject, and after a
crash the outer is redelivered its uploads in the same order. So an upload whose round is below
one of the same unit the outer has already accepted, applied or rejected is not the unit's
training going on: it is an old round sent again under a new message id (a replay), and it is
rejected as ``round_replayed``. (A redelivery of the same upload is recognised earlier, by its
round in the books, and deduplicated.)

Rounds may skip ahead: a unit drops rounds from a full queue, loses the ones in memory when it
is killed, and skips to the outer's record of it when it restarts. The rounds skipped are
counted per unit (``UnitLedger.skipped_rounds``), not rejected.

A payload byte for byte equal to one accepted recently (of any unit, under any round) is no new
work either: copying an honest upload and sending it again under the next round number is the
other way to replay. The XXH3-64 fingerprints of the last ``WINDOW`` accepted payloads are kept
and such an upload is rejected as ``payload_replayed``. Two honest pseudo-gradients are never
equal (each is a difference of parameters after different data) unless both are zero: an inner
step at learning rate 0 (the first of a warm-up, a whole period with ``--h-steps 1``) moves
nothing, so units send zero updates alike. A zero update is not judged by its payload: no
replay of it can change the model. The fingerprints of the
uploads merged go into the outer's checkpoint (:meth:`UploadOrder.history`), so that a
restarted outer remembers them; those only buffered are left out, since their uploads are
delivered again after a restart and must not be taken for their own replays.

Pure: the caller passes the books (for the rounds applied and rejected before a restart) and
the fingerprint; nothing here does I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import xxhash

from services.outer.errors import Rejected
from services.outer.ledger import OuterLedger

WINDOW = 4096  # accepted payloads whose fingerprints are remembered


def fingerprint(payload: bytes | memoryview) -> int:
    """The XXH3-64 of an upload's encoded payload."""
    return xxhash.xxh3_64_intdigest(payload)


class UploadOrder:
    """Per unit, the newest round accepted; and the fingerprints of recently accepted payloads.

    The newest round of a unit is also read from the books (``ledger``): after a restart the
    outer knows the rounds it applied and rejected, and the redelivered uploads it had only
    buffered come again in order.
    """

    def __init__(self, ledger: OuterLedger, window: int = WINDOW) -> None:
        self.ledger = ledger
        self._newest: dict[int, int] = {}
        self._recent: collections.deque[int] = collections.deque(maxlen=window)
        self._seen: collections.Counter[int] = collections.Counter()
        self._buffered: dict[str, int] = {}  # upload id: fingerprint, accepted and not merged

    def newest(self, unit: int) -> int:
        """The unit's highest round accepted, applied or rejected so far (-1: none)."""
        return max(
            self._newest.get(unit, -1),
            self.ledger.applied_rounds[unit].max() if unit in self.ledger.applied_rounds else -1,
            self.ledger.rejected_rounds[unit].max() if unit in self.ledger.rejected_rounds else -1,
        )

    def check(self, unit: int, round_: int, payload_fingerprint: int | None) -> None:
        """Judge an upload before it is offered to the core (``payload_fingerprint``: None for
        an update of norm 0, which no replay can make worse, and which units do send alike:
        an inner step at learning rate 0, the first of a warm-up, moves nothing).

        Raises:
            Rejected: ``round_replayed`` (its round is below the unit's newest) or
                ``payload_replayed`` (its payload equals one accepted recently).
        """
        newest = self.newest(unit)
        if round_ < newest:
            raise Rejected("round_replayed", f"unit {unit} round {round_} after its round {newest}")
        if payload_fingerprint is not None and self._seen[payload_fingerprint]:
            raise Rejected(
                "payload_replayed",
                f"unit {unit} round {round_}: its payload equals one accepted before",
            )

    def accepted(
        self, unit: int, round_: int, payload_fingerprint: int | None, upload: str = ""
    ) -> None:
        """Record an upload the core took (``upload``: its id): its round is the unit's newest,
        the rounds it skipped are counted in the books, its fingerprint is remembered."""
        newest = self.newest(unit)
        if newest >= 0 and round_ > newest + 1:
            self.ledger.skipped(unit, round_ - newest - 1)
        self._newest[unit] = round_
        if payload_fingerprint is not None:
            self._remember(payload_fingerprint)
            self._buffered[upload] = payload_fingerprint

    def _remember(self, value: int) -> None:
        """Add a fingerprint to the window, forgetting the oldest when it is full."""
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            self._seen[old] -= 1
            if not self._seen[old]:
                del self._seen[old]
        self._recent.append(value)
        self._seen[value] += 1

    def merged(self, uploads: Iterable[str]) -> None:
        """Forget that these uploads were only buffered: a merge applied them."""
        for upload in uploads:
            self._buffered.pop(upload, None)

    def history(self) -> list[int]:
        """The fingerprints of the merged uploads remembered, oldest first (for a checkpoint)."""
        buffered = collections.Counter(self._buffered.values())
        out = []
        for value in self._recent:
            if buffered[value]:
                buffered[value] -= 1
            else:
                out.append(value)
        return out

    def restore(self, fingerprints: Iterable[int]) -> None:
        """Continue from :meth:`history` output (a restored checkpoint's)."""
        self._recent.clear()
        self._seen.clear()
        self._buffered.clear()
        for value in fingerprints:
            self._remember(int(value))
