"""The inputs of a cluster simulation and what it measures (pure data, ``engine.py`` runs it).

Time is in seconds from the units' start. A unit is a failure domain that trains on its own:
one learner process in ``diloco up``, or a slice of many chips at chip scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat

from services.orchestration.local.records import ChaosEvent
from shared.records import Count, Record
from shared.settings.algorithm import SyncSettings

FailureKind = Literal["kill", "pause", "cut"]
Mode = Literal["decoupled", "sync"]


@dataclass(frozen=True)
class Failure:
    """One failure of one unit.

    ``kill``: the unit's process dies; it computes nothing for ``down_s`` plus its restart time,
    loses the steps since its newest checkpoint and the uploads it had not sent yet.
    ``pause``: it computes nothing for ``down_s`` and loses nothing (also the model of an elastic
    slice that stalls while it downscales or upscales). ``cut``: its link carries nothing for
    ``down_s``; it keeps computing.
    """

    at_s: float
    unit: int
    kind: FailureKind
    down_s: float


@dataclass(frozen=True)
class Link:
    """A unit's link to the outer (each direction on its own)."""

    rate_bps: float | None = None  # None: not a bottleneck
    latency_s: float = 0.0

    def transfer_s(self, nbytes: float) -> float:
        """Seconds from the first byte sent to the last one received."""
        serialise = nbytes * 8 / self.rate_bps if self.rate_bps else 0.0
        return serialise + self.latency_s


@dataclass(frozen=True)
class Unit:
    """One unit's compute."""

    step_s: float  # one healthy inner step
    tokens_per_step: int
    restart_s: float = 0.0  # after a kill's repair: start, restore and compile before training

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


@dataclass(frozen=True)
class Method:
    """How units and outer work together.

    ``decoupled``: a unit never waits; every H steps it hands an upload to its link and goes on;
    the outer applies uploads one at a time. ``sync``: after each upload a unit waits for the
    global that includes it; the outer merges a round once every active unit is in, or
    ``sync_timeout_s`` after the round's first upload (``services/outer/policy.py``).
    """

    mode: Mode
    h_steps: int
    upload_bytes: float
    params_bytes: float  # one global, as a unit downloads it
    merge_s: float  # the outer's seconds per merge (apply, checkpoint, publish)
    sync_timeout_s: float = SyncSettings.model_fields["sync_timeout_s"].default
    checkpoint_every_s: float = 0.0  # also within a sync period (0: at sync points only)


@dataclass(frozen=True)
class Cluster:
    """A whole simulated job: units with their links, a method, failures and a budget."""

    units: tuple[Unit, ...]
    link: Link
    method: Method
    steps: int | None = None  # inner steps each unit trains (None: until horizon_s)
    horizon_s: float | None = None  # stop the clock here (None: when every unit is done)
    failures: tuple[Failure, ...] = ()


@dataclass
class Outcome:
    """What a simulation measured.

    Goodput is defined as in the real system (``shared/goodput.py``): per unit, tokens applied
    over its healthy speed × its window (from 0 to when it finished, or the horizon); the job's
    weighs the units by what they could have trained. ``up`` is the share of the windows the
    units were not dead, restarting or paused.
    """

    goodput: float
    up: float
    unit_goodput: list[float]
    unit_up: list[float]
    windows_s: list[float]
    applied_tokens: int
    versions: int
    end_s: float
    lost_steps: int = 0
    dropped_uploads: int = 0
    merges: list[float] = field(default_factory=list)  # the time of each published global


GoodputMethod = Literal["decoupled", "sync", "dp-like"]


class GoodputRun(Record):
    """One run of ``bench/goodput.py`` (``bench/results/goodput.json``), which
    ``bench/scaling.py`` calibrates and checks its simulator against. Times are seconds from
    the units' start; unit indexes are strings (JSON keys)."""

    key: str = Field(max_length=200, description="method / failure rate / link / seed")
    commit: str = Field(max_length=40, description="the code the run ran (git HEAD)")
    seed: Count = Field(description="seed of the data and of the failures")
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
