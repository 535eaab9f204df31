"""One typed model for every record one process writes and another reads.

* :class:`UnitStatus` — KV ``diloco_status`` key ``J.unit.<u>``: learner u's heartbeat, read
  by the gateway, ``diloco up`` and the other learners (their speeds).
* :class:`OuterStatus` — same bucket, ``J.outer``: the leading outer's heartbeat and ledger,
  read by the gateway, ``diloco up`` and learners (the rounds applied).
* :class:`StandbyStatus` — same bucket, ``J.outer_standby.<holder>``: a standby outer.
* :class:`LinkStatus` — same bucket, ``J.link.<u>`` or ``J.link.outer``: what has crossed a
  shaped link (``diloco link``), read by the gateway and ``diloco up``.
* :class:`DesiredRecord` — KV ``diloco_desired``, ``J.<u>``: written by the gateway and
  ``diloco up``, polled by learner u.
* :class:`JobRecord` (with :class:`JobSpec`) — KV ``diloco_jobs``, ``J``: the registry,
  written by the gateway, read by the gateway and ``diloco up``.
* :class:`LeaseRecord` (with :class:`CheckpointPointer`) — KV ``diloco_outer``, ``J``: the
  outers' leader lease, changed by compare-and-set only.
* :class:`ParamsHead` — stream ``DILOCO_PARAMS``, ``diloco.J.params.<p>.head``: written by
  the outer, read by learners and a restarted outer.
* :class:`LedgerRecord` — the outer's books, inside its status record and checkpoints.
* :class:`UnitStateFile`, :class:`LearnerCheckpointMeta` — a learner's files under
  ``<checkpoint-dir>/J/unit-<u>/``, read by the same unit after a restart.
* :class:`PidsFile`, :class:`RunSummary` — ``diloco up``'s ``pids.json`` and
  ``summary.json``, read by ``bench/chaos.py`` and tests.
* :class:`NatsCredentials` — a NATS user's credentials file (``shared.nats_auth``), written by
  ``diloco up``, read by the service that connects as that user.

Binary stream messages have their own parsers: the wire envelope and chunk headers
(``shared/wire.py``) and the outer's checkpoint blob (``services/outer/checkpoint.py``, whose
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
from typing import Annotated, Generic, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    ValidationError,
    model_validator,
)

from shared.codec.config import CodecName
from shared.link_spec import LinkSpec, OutageMode
from shared.model_config import ModelSize
from shared.outer_choices import MergePolicyName, OuterOptimizerName, StalenessRuleName

log = logging.getLogger(__name__)

# ---- vocabularies ---------------------------------------------------------------------------

#: What the gateway may ask of a unit. ``idle``: created, not training yet; ``paused``: stopped
#: training until resumed; ``stopped``: upload what is left and exit (final).
DesiredState = Literal["idle", "running", "paused", "stopped"]
DESIRED_STATES: tuple[str, ...] = get_args(DesiredState)
#: What a unit reports about itself.
UnitState = Literal["starting", "idle", "running", "paused", "finishing", "finished", "stopped"]
UNIT_STATES: tuple[str, ...] = get_args(UnitState)
#: Unit states in which a silent unit is not lost: it ended on purpose.
ENDED_STATES = ("finished", "stopped")
#: What an outer reports about itself (``deposed``: it lost its lease and stops).
OuterState = Literal["starting", "standby", "restoring", "running", "stopped", "deposed"]
JobState = Literal["created", "running", "paused", "stopped"]
JOB_STATES: tuple[str, ...] = get_args(JobState)
MAX_UNITS = 64  # units of a job in the registry (REST, `diloco up`)
MAX_OUTER_UNITS = 1024  # units one outer serves (`diloco outer --num-units`)
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


# ---- encoding, decoding and rejections ------------------------------------------------------


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


# ---- liveness -------------------------------------------------------------------------------


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


def unit_liveness(entry: Stamped[UnitStatus] | None, timeout_s: float) -> str:
    """A unit's shown state: ``absent`` (never reported), ``lost``, or what it reports."""
    if entry is None:
        return "absent"
    return liveness(entry.record.state, entry.age_s, timeout_s, ENDED_STATES)


def outer_liveness(entry: Stamped[OuterStatus] | None, timeout_s: float) -> str:
    """The outer's shown state: ``absent``, ``lost`` or what it reports."""
    if entry is None:
        return "absent"
    return liveness(entry.record.state, entry.age_s, timeout_s)


# ---- unit status ----------------------------------------------------------------------------


class LatencySummary(Record):
    """Percentiles of a unit's recent durations of one kind, on its own monotonic clock."""

    count: Count = Field(description="durations measured in all")
    p50_s: NonNegativeFloat
    p95_s: NonNegativeFloat
    p99_s: NonNegativeFloat
    max_s: NonNegativeFloat


class UnitStatus(Record):
    """A learner unit's heartbeat (every ``--status-interval-s``)."""

    unit: Count
    state: UnitState = "starting"
    desired: DesiredState = "running"
    step: Count = 0
    max_steps: Count | None = None
    round: Count = Field(0, description="the next round number this unit hands out")
    base_version: Count = Field(0, description="sum of the fragments' base versions")
    base_versions: list[Count] = []
    train_loss: float | None = None
    tokens: Count = Field(0, description="tokens trained, across restarts (with checkpoints)")
    tokens_per_s: NonNegativeFloat = Field(0.0, description="recent training speed")
    training_s: NonNegativeFloat = Field(
        0.0, description="seconds this process has spent training (not paused or idle)"
    )
    compute_tokens_per_s: NonNegativeFloat = Field(
        0.0,
        description="the unit's healthy speed over its life: tokens it computed (steps trained "
        "again after a crash included) over the seconds it spent computing (waits at sync "
        "points excluded), across restarts (goodput's yardstick)",
    )
    slowdown: float = Field(1.0, ge=1.0)
    model: ModelSize | None = Field(None, description="the model the unit trains")
    num_units: Count = Field(0, description="units of the job, as the unit was started")
    tokens_per_step: Count = Field(0, description="tokens one inner step trains (batch × seq)")
    upload_latency: LatencySummary | None = Field(
        None, description="an upload's time from the training loop to JetStream's acceptance"
    )
    params_latency: LatencySummary | None = Field(
        None,
        description="a global's time from its head's notification to the training loop taking it",
    )
    sync_latency: LatencySummary | None = Field(
        None,
        description="an upload's time from its sync point to the first params head that "
        "includes it (the outer applied it and published the result)",
    )
    network_wait_s: NonNegativeFloat = Field(
        0.0, description="seconds the training loop spent in calls to the NATS link"
    )
    lifetime_s: NonNegativeFloat | None = Field(
        None,
        description="seconds since the unit first trained, on its own clock and across its "
        "restarts (time dead, paused or waiting included): goodput's window",
    )
    lifetime_training_s: NonNegativeFloat = Field(
        0.0,
        description="seconds the unit's processes spent training (not dead, paused or idle), "
        "across restarts: its up time within goodput's window",
    )
    sync_wait_s: NonNegativeFloat = Field(
        0.0,
        description="seconds the training loop waited at sync points for the merged global "
        "(--mode sync; 0 in the decoupled mode)",
    )
    unsent: Count = Field(0, description="uploads queued, not yet accepted by JetStream")
    counters: dict[str, Count] = Field({}, description="this process's counters")
    lifetime: dict[str, Count] = Field({}, description="upload counters across restarts")
    published_rounds: RoundRanges = Field([], description="rounds JetStream accepted (lifetime)")
    next_round: Count = 0
    last_published_round: Count | None = None
    restored_from_step: Count | None = None
    last_error: str = Field("", max_length=MAX_ERROR_CHARS)

    def counter(self, name: str) -> int:
        """One of this process's counters (0 when it was never counted)."""
        return self.counters.get(name, 0)


# ---- outer status and ledger ----------------------------------------------------------------


class UnitLedger(Record):
    """What the outer has applied from one unit."""

    applied: Count = 0
    last_round: int = Field(-1, ge=-1)
    last_staleness: Count = 0
    tokens: Count = 0
    last_train_loss: float | None = None


class LedgerRecord(Record):
    """The outer's books, in its status record and every checkpoint: every upload it received
    is applied exactly once (``applied_rounds``) or rejected with a reason (``rejected``,
    ``rejected_rounds``)."""

    applied: Count = 0
    merges: Count = 0
    deduplicated: Count = Field(0, description="redelivered chunks of uploads applied before")
    tokens_applied: Count = 0
    clipped: Count = Field(0, description="applied uploads the norm guard scaled down")
    rejected: dict[str, Count] = Field({}, description="rejected uploads by reason")
    units: dict[Count, UnitLedger] = {}
    staleness: dict[Count, Count] = Field({}, description="applied uploads by staleness")
    codecs: dict[str, Count] = Field({}, description="accepted uploads by codec")
    payload_bytes: Count = Field(0, description="compressed bytes of accepted uploads")
    applied_rounds: dict[Count, RoundRanges] = {}
    rejected_rounds: dict[Count, RoundRanges] = {}


class EvalRecord(Record):
    """One held-out evaluation of the global params (a loss is None when it is not finite:
    the model diverged)."""

    version: Count
    tokens: Count
    nats_per_byte: float | None
    bits_per_byte: float | None
    at: NonNegativeFloat | None = Field(
        None, description="when the evaluated params were taken (unix seconds, outer's clock)"
    )


class EvalPoint(Record):
    """One evaluation of the global model on held-out data."""

    version: Count = Field(description="global version evaluated")
    tokens: Count = Field(description="tokens applied by the outer when it was evaluated")
    nats_per_byte: float | None = Field(
        description="held-out loss in nats per byte (null when not finite: the model diverged)"
    )
    at: NonNegativeFloat | None = Field(
        None, description="when the evaluated params were taken (unix seconds, outer's clock)"
    )


class TrainPoint(Record):
    """The mean train loss of the uploads applied by one merge."""

    tokens: Count = Field(description="tokens applied by the outer after the merge")
    train_loss: float = Field(description="mean train loss reported by the merged uploads")


class EvaluationRecord(Record):
    """The outer's evaluations: the first, the last, and a bounded history."""

    init: EvalRecord | None = None
    last: EvalRecord | None = None
    history: list[EvalPoint] = []


class CheckpointInfo(Record):
    """The outer's last committed checkpoint."""

    id: str
    bytes: Count
    versions: list[Count]
    seconds: NonNegativeFloat


class RestoredFrom(Record):
    """What the leading outer started from."""

    kind: Literal["new", "checkpoint", "params"] = "new"
    id: str | None = None
    versions: list[Count] = []


class OuterStatus(LedgerRecord):
    """The leading outer's heartbeat: its ledger, versions, evaluations and checkpoints."""

    state: OuterState
    model: str
    holder: str
    epoch: Count | None = None
    version: Count = Field(0, description="sum of the fragments' versions")
    versions: list[Count] = []
    buffered: Count = Field(0, description="uploads accepted, waiting for a merge")
    checkpoints: Count = 0
    last_checkpoint: CheckpointInfo | None = None
    restored_from: RestoredFrom = RestoredFrom()
    evaluation: EvaluationRecord = EvaluationRecord()
    train_history: list[TrainPoint] = []

    def unit_ledger(self, unit: int) -> UnitLedger | None:
        """The outer's ledger of one unit (None before it applied anything of it)."""
        return self.units.get(unit)

    def next_round(self, unit: int) -> int:
        """1 + the last round of ``unit`` the outer applied (0 when none)."""
        ledger = self.units.get(unit)
        return ledger.last_round + 1 if ledger is not None else 0


class StandbyStatus(Record):
    """A standby outer's heartbeat: who it is and who leads."""

    state: Literal["standby"] = "standby"
    model: str
    holder: str
    leader: str = ""


# ---- shaped links ----------------------------------------------------------------------------

#: A link's name: the index of the unit it carries, or ``outer``.
LINK_NAME_PATTERN = re.compile(r"^(outer|[0-9]{1,2})$")


class LinkStatus(Record):
    """What has crossed one shaped link since its ``diloco link`` process started (every
    ``--report-every-s``). "Up" is towards nats-server, "down" towards the client."""

    name: Annotated[str, Field(pattern=LINK_NAME_PATTERN.pattern)]
    spec: LinkSpec
    bytes_up: Count = 0
    bytes_down: Count = 0
    busy_up_s: NonNegativeFloat = Field(0.0, description="seconds the up line was busy")
    busy_down_s: NonNegativeFloat = Field(0.0, description="seconds the down line was busy")
    uptime_s: NonNegativeFloat = 0.0
    connections: Count = Field(0, description="connections open now")
    connects: Count = Field(0, description="connections accepted in all")
    outage: OutageMode | None = Field(None, description="the outage in progress")
    outages: Count = Field(0, description="outages begun so far")

    @property
    def unit(self) -> int | None:
        """The unit the link carries (None: the outer's link)."""
        return None if self.name == "outer" else int(self.name)

    def utilisation(self) -> tuple[float, float] | None:
        """Share of its lifetime each direction (up, down) was busy (None: no rate cap)."""
        if self.spec.rate_bps is None or self.uptime_s <= 0:
            return None
        return self.busy_up_s / self.uptime_s, self.busy_down_s / self.uptime_s


# ---- control: desired states and the job registry -------------------------------------------


class DesiredRecord(Record):
    """A unit's desired state, written by the gateway (or ``diloco up``), polled by the unit."""

    state: DesiredState


class JobSpec(Record):
    """Everything that defines a job. Field names are those of the services' options
    (``diloco learner/outer --help``), so a spec maps one to one onto their flags."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "examples": [
                {
                    "job": "demo",
                    "model": "tiny",
                    "units": 4,
                    "h_steps": 30,
                    "codec": "int8",
                    "outer_optimizer": "delayed_nesterov",
                    "outer_lr": 0.7,
                    "outer_momentum": 0.9,
                    "merge_policy": "each",
                    "staleness_rule": "polynomial",
                    "seed": 0,
                    "max_steps": 300,
                }
            ]
        },
    )

    job: JobName = Field(
        description="job name: 1-64 letters, digits, '_' or '-', starting alphanumeric",
        examples=["demo"],
    )
    model: ModelSize = Field("small", description="model size")
    corpus: str | None = Field(
        None,
        max_length=4096,
        description="text file or folder to train on (default: the Python standard library)",
    )
    units: int = Field(4, ge=1, le=MAX_UNITS, description="number of learner units")
    h_steps: int = Field(
        30, ge=1, le=1_000_000, description="inner steps between uploads of a fragment (H)"
    )
    codec: CodecName = Field("int8", description="pseudo-gradient codec")
    outer_optimizer: OuterOptimizerName = Field("delayed_nesterov", description="outer optimizer")
    outer_lr: float = Field(0.7, gt=0, le=10, description="outer learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer (Nesterov) momentum")
    merge_policy: MergePolicyName = Field(
        "each", description="each (apply every arrival alone) or quorum (quorum + grace window)"
    )
    min_quorum: int = Field(1, ge=1, le=MAX_UNITS, description="arrivals needed for a merge (K)")
    staleness_rule: StalenessRuleName = Field(
        "polynomial", description="how an update's weight falls with its staleness"
    )
    max_staleness: int | None = Field(
        None, ge=0, le=1_000_000, description="drop updates staler than this (default: keep all)"
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of initial params and data order")
    max_steps: int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description="inner steps each unit trains (default 300 unless token_budget is given)",
    )
    token_budget: int | None = Field(
        None,
        ge=1,
        le=10**15,
        description="tokens the whole job trains on, shared by the units (instead of max_steps)",
    )

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.max_steps is not None and self.token_budget is not None:
            raise ValueError("give max_steps or token_budget, not both")
        if self.max_steps is None and self.token_budget is None:
            self.max_steps = 300
        if self.min_quorum > self.units:
            raise ValueError(f"min_quorum {self.min_quorum} > units {self.units}")
        return self


class JobRecord(Record):
    """A job as the registry (KV ``diloco_jobs``, key ``<job>``) stores it."""

    spec: JobSpec = Field(description="the job's definition")
    state: JobState = Field(description="created, running, paused or stopped")
    units: int = Field(ge=1, le=MAX_UNITS, description="current number of units (after scaling)")
    created: float = Field(description="creation time, seconds since the epoch")
    updated: float = Field(description="time of the last change, seconds since the epoch")


# ---- the outer's lease and its params ---------------------------------------------------------


class CheckpointPointer(Record):
    """Where the committed checkpoint of the outer lies (inside the lease record)."""

    id: str = Field(max_length=200)
    epoch: Count
    slot: Literal[0, 1]
    chunks: int = Field(ge=1, le=1 << 24)
    size: Count
    crc: int = Field(ge=0, lt=1 << 32, description="zlib CRC-32 of the checkpoint blob")
    versions: list[Count]


class LeaseRecord(Record):
    """The leader lease of one job's outer (changed by compare-and-set only)."""

    holder: str = Field(max_length=300)
    epoch: Count
    beat: Count
    released: bool = False
    pointer: CheckpointPointer | None = None


class ParamsHead(Record):
    """The newest global params of one fragment: which upload holds them, in which chunks."""

    version: int = Field(ge=0, le=MAX_VERSION)
    upload: str = Field(max_length=200)
    chunks: int = Field(ge=1, le=1 << 24)
    sequences: list[Annotated[int, Field(ge=1)]] = Field(
        description="the stream sequence of each chunk, in order: a read by sequence sees "
        "exactly this version however many newer ones are published meanwhile"
    )
    size: Count
    params_checksum: int | None = Field(
        None, ge=0, lt=1 << 64, description="XXH3-64 of the encoded params (shared.wire)"
    )
    applied: dict[Count, Annotated[int, Field(ge=-1)]] = Field(
        {},
        max_length=MAX_OUTER_UNITS,
        description="per unit, the newest round the outer had applied when it published this "
        "version: a unit's upload of round r is in this version if r <= applied[unit]",
    )

    @model_validator(mode="after")
    def _one_sequence_per_chunk(self) -> ParamsHead:
        if len(self.sequences) != self.chunks:
            raise ValueError(f"{len(self.sequences)} sequences for {self.chunks} chunks")
        return self


# ---- learner files ---------------------------------------------------------------------------


class UnitStateFile(Record):
    """A learner's small durable record: rounds used and published, desired state, lifetime
    counters (``services/learner/unit_state.py``)."""

    job: str
    unit: Count
    next_round: Count = Field(0, description="first round number never handed out yet")
    desired: DesiredState = "running"
    published: RoundRanges = Field([], description="rounds JetStream accepted (lifetime)")
    lifetime: dict[str, Count] = {}
    first_trained_at: NonNegativeFloat | None = Field(
        None, description="when the unit first trained (unix seconds, its own clock)"
    )
    trained_s: NonNegativeFloat = Field(
        0.0, description="seconds the unit's processes have spent training, across restarts"
    )
    computing_s: NonNegativeFloat = Field(
        0.0, description="of those, seconds computing (waits at sync points excluded)"
    )
    computed_tokens: Count = Field(
        0, description="tokens computed meanwhile (steps trained again after a crash included)"
    )


class FragmentSyncRecord(Record):
    """Where one fragment of a learner stands between two uploads."""

    base_version: Count
    steps: Count
    tokens: Count
    loss_sum: float
    target: int = Field(ge=1)


class UnitIdentity(Record):
    """Which unit a learner checkpoint belongs to."""

    job: str
    unit: Count
    model: str
    fragments: int = Field(ge=1)


class LearnerCheckpointMeta(Record):
    """The ``meta`` entry of a learner's ``checkpoint.npz`` (``services/learner/checkpoint.py``)."""

    identity: UnitIdentity
    step: Count
    round: Count
    current_h: int = Field(ge=1)
    syncs: list[FragmentSyncRecord]
    tokens_total: Count
    param_names: list[str]
    opt_leaves: Count
    residual_names: list[str] = []
    taken_at: float = Field(description="unix time of the snapshot (for humans)")


# ---- NATS identities ---------------------------------------------------------------------

NatsRole = Literal["admin", "outer", "gateway", "learner", "link"]
NATS_USER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"


class NatsCredentials(Record):
    """A credentials file (``shared.nats_auth``): the NATS user a service connects as.

    Written, readable by its owner only, by ``diloco up`` (or, in a compose cluster, by the
    broker and the controller); read by the service it names (``--nats-credentials`` or
    ``DILOCO_NATS_CREDENTIALS``) and by whoever builds the server's configuration, which holds
    only the password's bcrypt hash. The role, job, unit and link name the identity, so the
    user's permissions can be rebuilt from the file alone.
    """

    user: str = Field(pattern=NATS_USER_PATTERN)
    password: str = Field(min_length=16, max_length=256)
    role: NatsRole
    job: str = Field("", max_length=128, description="the job an outer, learner or link acts for")
    unit: Count | None = Field(None, description="a learner's unit")
    link: str = Field("", max_length=64, description="a link's name")


# ---- diloco up's files -----------------------------------------------------------------------


class PidsFile(Record):
    """``<data-dir>/pids.json``: the live children of ``diloco up``, for chaos tests."""

    supervisor: int
    nats_url: str | None = None
    nats_credentials: str | None = None  # the admin's credentials file
    nats_ca_file: str | None = None  # the CA of nats-server's certificate (--tls)
    pids: dict[str, int] = {}
    restarts: dict[str, Count] = {}


class UnitBooks(Record):
    """One unit's line of the ledger balance."""

    published: Count = 0
    applied: Count = 0
    rejected: Count = 0
    missing: list[Count] = Field([], description="published rounds neither applied nor rejected")


class Books(Record):
    """Whether a job's books balance (``shared.ledger.balance``)."""

    balanced: bool
    problems: list[str] = []
    per_unit: dict[Count, UnitBooks] = {}
    applied: Count = 0
    published: Count = 0
    rejected: Count = 0


class Goodput(Record):
    """Share of the units' possible work that was applied to the global model
    (``shared.goodput``)."""

    job: NonNegativeFloat | None = Field(None, description="all units together")
    units: dict[Count, NonNegativeFloat] = Field({}, description="per unit")
    job_up: NonNegativeFloat | None = Field(
        None, description="share of the units' windows they spent training (up), all units"
    )
    up: dict[Count, NonNegativeFloat] = Field({}, description="the same per unit")
    windows_s: dict[Count, NonNegativeFloat] = Field({}, description="each unit's window")


ChaosKind = Literal["kill", "pause", "cut"]
CHAOS_KINDS: tuple[str, ...] = get_args(ChaosKind)


class ChaosEvent(Record):
    """One injected failure of ``diloco up --chaos-mtbf-s``
    (``services/orchestration/local/chaos.py``)."""

    at_s: NonNegativeFloat = Field(description="when it starts, seconds after the learners")
    target: str = Field(max_length=100, description="learner-<u>, outer or nats-server")
    kind: ChaosKind
    repair_s: NonNegativeFloat = Field(description="how long it lasts")


class RunSummary(Record):
    """``<data-dir>/summary.json``: how a ``diloco up`` run ended."""

    reason: str
    elapsed_s: NonNegativeFloat
    outer: OuterStatus | None = None
    units: dict[Count, UnitStatus] = {}
    links: dict[str, LinkStatus] = Field({}, description="shaped links by name, last read")
    tokens_per_s: NonNegativeFloat | None = None
    restarts: dict[str, Count] = {}
    ledger: Books
    chaos: list[ChaosEvent] = Field([], description="failures injected, in time order")
    goodput: Goodput | None = Field(
        None, description="from each unit's first training to its end (or the last read)"
    )
    started_at: NonNegativeFloat | None = Field(
        None, description="when the units were started (together), unix seconds"
    )
    chaos_offset_s: float | None = Field(
        None, description="seconds the failure schedule (``chaos``) had run when they started"
    )


# ---- goodput benchmark -------------------------------------------------------------------------


GoodputMethod = Literal["decoupled", "sync", "dp-like"]


class GoodputRun(Record):
    """One run of ``bench/goodput.py`` (``bench/results/goodput.json``), which
    ``bench/scaling.py`` calibrates and checks its simulator against. Times are seconds from
    the units' start; unit indexes are strings (JSON keys)."""

    key: str = Field(max_length=200, description="method / failure rate / link")
    method: GoodputMethod
    mtbf_s: PositiveFloat | None = Field(description="mean seconds between a unit's failures")
    link: str | None = Field(None, max_length=100, description="every unit's link (None: none)")
    reason: str = Field(max_length=200, description="why the run ended")
    elapsed_s: NonNegativeFloat
    goodput: NonNegativeFloat | None
    up: NonNegativeFloat | None = Field(description="share of the windows the units were up")
    unit_goodput: dict[str, NonNegativeFloat]
    unit_up: dict[str, NonNegativeFloat]
    speeds: dict[str, NonNegativeFloat] = Field(description="each unit's healthy tokens/s")
    unit_applied: dict[str, Count] = Field(description="tokens of each unit the outer applied")
    windows: dict[str, NonNegativeFloat] = Field(description="each unit's goodput window, s")
    restarts: dict[str, Count] = Field(description="restarts of each process")
    tokens_per_step: Count
    h_steps: Count
    steps: Count = Field(description="inner steps each unit trained (the token budget)")
    applied: Count
    versions: Count
    upload_bytes: NonNegativeFloat = Field(description="mean accepted upload payload")
    end_s: NonNegativeFloat = Field(description="the last evaluation's time")
    seconds_per_version: NonNegativeFloat | None
    final_eval: float | None
    curve: list[tuple[float, float]] = Field([], description="(seconds, eval nats/byte)")
    chaos: list[ChaosEvent] = Field([], description="the failures injected")
    chaos_offset_s: float | None = Field(
        None, description="how far the failure schedule had run at the units' start"
    )


# ---- load test ---------------------------------------------------------------------------------


class LoadtestStage(Record):
    """One stage of ``diloco loadtest``: a number of synthetic units against a fresh outer,
    measured over a window after warm-up (rates are per second of that window)."""

    units: Count
    window_s: NonNegativeFloat
    offered_uploads_per_s: NonNegativeFloat = Field(
        description="uploads the units are due to make: units / upload interval"
    )
    published_per_s: NonNegativeFloat = Field(description="uploads JetStream accepted")
    ingest_uploads_per_s: NonNegativeFloat = Field(description="uploads the outer applied")
    ingest_mb_per_s: NonNegativeFloat = Field(description="payload MB (10^6) the outer applied")
    merges_per_s: NonNegativeFloat
    uploads_per_merge: NonNegativeFloat
    sync_latency: LatencySummary | None = Field(
        description="an upload's time from its sync point to the first params head that "
        "includes it, every upload of the stage"
    )
    backlog_start: int = Field(description="uploads published, not yet applied, window start")
    backlog_end: int = Field(description="the same at the window's end")
    dropped_unsent: Count = Field(description="uploads dropped from full unit queues")
    params_mb_per_s: NonNegativeFloat = Field(description="params MB all units fetched")
    heads_rejected: Count = Field(0, description="malformed params heads the units received")
    outer_cpu: NonNegativeFloat = Field(description="CPU cores the outer process used")
    broker_cpu: NonNegativeFloat = Field(description="CPU cores nats-server used")
    generator_cpu: NonNegativeFloat = Field(
        description="CPU cores the load generator (units and links) used"
    )
    drain_s: NonNegativeFloat = Field(
        description="seconds after the last upload until the outer had applied everything"
    )
    books: Books
    saturated: bool
    reason: str = Field("", description="why the stage counts as saturated")


class LoadtestReport(Record):
    """``<data-dir>/loadtest.json``: what ``diloco loadtest`` ran and measured."""

    model: ModelSize
    param_count: Count
    codec: CodecName
    params_codec: str
    params_fetch: str
    link: LinkSpec
    upload_every_s: PositiveFloat
    upload_payload_bytes: Count = Field(description="encoded bytes of one synthetic upload")
    stages: list[LoadtestStage] = []
    saturation_units: Count | None = Field(
        None, description="units of the first saturated stage (None: none saturated)"
    )
