"""One typed model for every record one process writes and another reads.

Records shared by several processes live here, one module per writer:

* ``unit`` — a learner unit's heartbeat (:class:`~shared.records.unit.UnitStatus`);
* ``outer`` — the outer's heartbeat and books, its lease, the heads of the global params;
* ``jobs`` — the registry and the units' desired states (written by the gateway);
* ``link`` — what a shaped link has carried (``diloco link``);
* ``credentials`` — a NATS user's credentials file.

Records that only one service reads live in that service (a learner's files,
``services/learner/records.py``; ``diloco up``'s files, ``services/orchestration/local/records.py``;
the load test's report, ``services/loadtest/records.py``); the ledger's balance and goodput sit
with the code that computes them (``shared/ledger.py``, ``shared/goodput.py``).

This module holds what they all share: the :class:`Record` base, :func:`encode` and
:func:`decode`, the limits on fields, and :func:`liveness`.

Binary stream messages have their own parsers: the wire envelope and chunk headers
(``shared/wire/``) and the outer's checkpoint blob (``services/outer/checkpoint.py``, whose
ledger and evaluation parts are the models here).

Writers build a model and store :func:`encode` of it. Readers call :func:`decode`, which never
raises: a record that does not fit its model is *rejected* — logged, counted in
:data:`rejections` by record and reason, and read as missing — so no reader crashes on what
another process (or an attacker on the network) wrote.

Liveness is judged without comparing two machines' clocks: a status record carries no writer
time; its age is the NATS server's clock at the read minus the server's stamp on the KV entry
(both from the server, see ``shared/kv.py``), and :func:`liveness` turns that age into the
state a reader shows.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Annotated, Generic, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
)

log = logging.getLogger(__name__)

MAX_UNITS = 64  # units of a job in the registry (REST, `diloco up`)

MAX_OUTER_UNITS = 1024  # units one outer serves (`diloco outer --num-units`)

MAX_OUTER_SHARDS = 8  # shards of a job's outer (`diloco outer --shards`)

MAX_BATCH_SIZE = 4096  # sequences per inner step (`diloco learner --batch-size`)

MAX_STEPS_PER_UPLOAD = 1_000_000  # inner steps one upload may stand for

# Global versions a job can reach (one per merge: a merge a millisecond for 30 years); a head
# above it is rejected, so a forged huge version cannot make learners wait for it.
MAX_VERSION = 1 << 40

MAX_RECORD_BYTES = 8 << 20  # larger than any record a writer makes; bounds a hostile one

MAX_ERROR_CHARS = 1000

Count = NonNegativeInt

#: Rounds as sorted, merged inclusive ranges ``[[first, last], ...]`` (``shared.ledger.RoundSet``).
RoundRanges = list[tuple[NonNegativeInt, NonNegativeInt]]

JOB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")

JobName = Annotated[str, Field(pattern=JOB_NAME_PATTERN.pattern)]


class Record(BaseModel):
    """Base of every record: unknown keys are ignored, NaN and Inf refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


R = TypeVar("R", bound=Record)


def encode(record: Record) -> bytes:
    """The bytes a writer stores (JSON)."""
    return record.model_dump_json().encode()


class Rejections:
    """Process-wide counts of records that did not fit their model, by record and reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def add(self, record: str, reason: str, source: str) -> None:
        """Count one rejection; the first of each (record, reason) is logged as a warning."""
        with self._lock:
            self._counts[record, reason] += 1
            first = self._counts[record, reason] == 1
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "rejected %s record %s: %s", record, source or "", reason)

    def counts(self) -> dict[tuple[str, str], int]:
        """``{(record, reason): count}`` so far."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        """Rejections so far, of every record."""
        with self._lock:
            return sum(self._counts.values())


rejections = Rejections()


def _reason(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "record"
    return f"{where}: {first['msg']}"[:200]


def decode(model: type[R], data: bytes | str | None, source: str = "") -> R | None:
    """Parse a stored record; ``None`` when it is missing, or malformed (then rejected).

    Args:
        model: the record's model.
        data: the stored bytes (JSON); ``None`` or empty for a missing or deleted key.
        source: where it was read (a KV key or a path), for the log.
    """
    if not data:
        return None
    if len(data) > MAX_RECORD_BYTES:
        rejections.add(model.__name__, f"larger than {MAX_RECORD_BYTES} bytes", source)
        return None
    try:
        return model.model_validate_json(data)
    except ValidationError as err:
        rejections.add(model.__name__, _reason(err), source)
        return None


@dataclass(frozen=True)
class Stamped(Generic[R]):
    """A record read from KV, with its age on the NATS server's clock.

    Attributes:
        record: the parsed record.
        age_s: server time of the read minus the server's stamp on the entry (never negative).
        stamp: the server's stamp on the entry (unix seconds; shown, never compared with
            another machine's clock).
        revision: the entry's revision (its stream sequence).
    """

    record: R
    age_s: float
    stamp: float
    revision: int


def liveness(state: str, age_s: float, timeout_s: float, ended: Collection[str] = ()) -> str:
    """The state a reader shows: ``lost`` for a record older than ``timeout_s`` whose writer
    had not ended on purpose (``state`` in ``ended``), else the reported ``state``."""
    return "lost" if age_s > timeout_s and state not in ended else state
