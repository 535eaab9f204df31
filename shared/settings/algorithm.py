"""How a job trains: the sync mode and fragments, each unit's inner optimizer and sync schedule,
and the outer's optimizer and merge rules (docs/ALGORITHMS.md explains every choice).

The models here hold the settings and their defaults; the objects the cores run are built from
them (:meth:`InnerAlgorithmSettings.sync_schedule`, :meth:`InnerAlgorithmSettings.optimizer`,
:meth:`OuterAlgorithmSettings.algorithm`), importing the JAX code only when called.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.outer_choices import (
    CombineName,
    MergePolicyName,
    NormGuardName,
    OuterOptimizerName,
    StalenessRuleName,
    TokenWeightingName,
)

if TYPE_CHECKING:
    import optax

    from services.learner.core import SyncSchedule
    from services.outer.core import OuterAlgorithm
    from services.outer.norm_guard import InnerBound

#: How the units of a job sync (``--mode``).
SyncMode = Literal["decoupled", "sync"]
#: Which global params a unit fetches (``services/learner/params_fetcher.py``).
ParamsFetchName = Literal["newest", "after_upload"]
#: When a unit spreads its fragments' uploads over the period (``learner/stagger_rule.py``).
StaggerName = Literal["auto", "always", "never"]
MAX_FRAGMENTS = 64
# AdamW's moment decay rates in the inner optimizer (services/learner/trainer.py); the outer's
# norm guard derives its bound from them (services/outer/norm_guard.py).
INNER_B1, INNER_B2 = 0.9, 0.95
#: The inner learning rate's cosine decay ends at this share of its peak.
END_LR = 0.1
MAX_DN_PERIOD = 1024


class SyncSettings(BaseModel):
    """How the units of a job sync: decoupled or synchronous, in how many fragments. Every
    learner and the outer of a job must agree."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: SyncMode = Field(
        "decoupled",
        description="decoupled: units never wait; sync: synchronous DiLoCo, a unit waits at "
        "its sync point until the global params include its upload, and the outer merges a "
        "round once every active unit is in, or --sync-timeout-s after its first upload",
    )
    sync_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="with --mode sync: seconds the outer waits for a round's missing units "
        "before it merges without them",
    )
    fragments: int = Field(
        5,
        ge=1,
        le=MAX_FRAGMENTS,
        description="parameter fragments, each uploaded and merged on its own (P); a unit "
        "uploads them together, or staggered over the period once its link is slow (--stagger)",
    )


class InnerAlgorithmSettings(BaseModel):
    """A unit's inner optimizer and sync schedule."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    inner_lr: float = Field(3e-3, gt=0, le=1.0, description="peak AdamW learning rate")
    warmup_steps: int = Field(50, ge=0, description="linear warm-up steps of the inner LR")
    weight_decay: float = Field(0.01, ge=0, le=1.0, description="AdamW weight decay")
    h_steps: int = Field(
        30, ge=1, le=1_000_000, description="inner steps between uploads of a fragment (H)"
    )
    overlap_tau: int = Field(
        0, ge=0, description="steps after an upload before a new global fragment is mixed in (τ)"
    )
    mix_alpha: float = Field(
        0.0, ge=0, le=1, description="share of local params kept when mixing in a global (α)"
    )
    dynamic_h: bool = Field(
        True, description="scale H by the unit's speed relative to the fastest (DyLU)"
    )
    stagger: StaggerName = Field(
        "auto",
        description="with fragments > 1, when a unit spreads its fragments' uploads evenly over "
        "the period: always; never (all due together, the whole model at once); auto: once "
        "uploading the whole model holds the unit's link for over a fifth of a period",
    )
    params_fetch: ParamsFetchName = Field(
        "newest",
        description="which global params a unit fetches: newest (the newest version whenever "
        "one is announced and the last fetch is done) or after_upload (once after each of its "
        "uploads: fewer bytes, staler params; BENCHMARKS.md, 'Quality: downlink')",
    )
    params_fetches_per_period: int = Field(
        0,
        ge=0,
        le=1000,
        description="with params_fetch newest, in decoupled mode: most global versions a unit "
        "fetches per sync period of a fragment (a fetch starts no sooner than H/F steps after the "
        "last; 0: every version the link carries)",
    )

    def sync_schedule(self, fragments: int, h_steps: int | None = None) -> SyncSchedule:
        """The core's sync schedule (``h_steps``: a unit's own H, e.g. with DyLU)."""
        from services.learner.core import SyncSchedule

        return SyncSchedule(
            h_steps or self.h_steps,
            fragments,
            self.overlap_tau,
            self.mix_alpha,
            staggered=self.stagger == "always",
        )

    def inner_bound(self, horizons: tuple[int, ...] = ()) -> InnerBound:
        """What the outer knows of this inner optimizer (the norm guard's prior bound, the
        learning rate peer review expects behind an upload), for units that train
        ``horizons`` inner steps (one for all, or one per unit; () where not known)."""
        from services.outer.norm_guard import InnerBound

        return InnerBound(self.inner_lr, self.weight_decay, self.warmup_steps, horizons)

    def optimizer(self, total_steps: int) -> optax.GradientTransformation:
        """The inner AdamW whose warm-up and cosine decay span ``total_steps``."""
        from services.learner.trainer import inner_optimizer

        return inner_optimizer(self.inner_lr, self.warmup_steps, total_steps, self.weight_decay)


class OuterAlgorithmSettings(BaseModel):
    """How the outer merges pseudo-gradients and steps the global params."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    outer_optimizer: OuterOptimizerName = Field(
        "delayed_nesterov", description="outer optimizer: sgd, nesterov or delayed_nesterov"
    )
    outer_lr: float = Field(0.7, gt=0, le=10, description="outer learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer (Nesterov) momentum")
    dn_period: int = Field(
        0,
        ge=0,
        le=MAX_DN_PERIOD,
        description="Delayed Nesterov: arrivals per momentum update (N; 0 = number of units)",
    )
    momentum_max_age: float = Field(
        1.0,
        ge=0,
        le=1000,
        description="Delayed Nesterov: an arrival as stale as this many momentum periods (N "
        "arrivals) brings no momentum, one period younger brings it in full (linear between); "
        "a period's momentum is scaled by the mean (docs/ALGORITHMS.md, 'Staleness')",
    )
    merge_policy: MergePolicyName = Field(
        "each", description="each (apply every arrival alone) or quorum (quorum + grace window)"
    )
    min_quorum: int = Field(1, ge=1, le=1024, description="arrivals needed before a merge (K)")
    grace_factor: float = Field(
        0.5, ge=0, le=10, description="grace window as a share of the median upload interval"
    )
    grace_min_s: float = Field(0.0, ge=0, le=3600, description="shortest grace window, seconds")
    grace_max_s: float = Field(30.0, ge=0, le=3600, description="longest grace window, seconds")
    combine: CombineName = Field(
        "weighted",
        description="merge: weighted (average), rda, or a robust one for quorum merges: median "
        "or trimmed_mean (coordinate-wise, token weights ignored; docs/ALGORITHMS.md)",
    )
    token_weighting: TokenWeightingName = Field(
        "tokens2_per_step", description="update weight by work: uniform, tokens or tokens2_per_step"
    )
    staleness_rule: StalenessRuleName = Field(
        "polynomial", description="staleness weight: constant, polynomial, hinge or exponential"
    )
    staleness_a: float = Field(0.5, ge=0, le=100, description="staleness exponent/slope/rate a")
    staleness_b: float = Field(0.0, ge=0, le=1e6, description="hinge point b (full weight up to b)")
    max_staleness: int | None = Field(
        None, ge=0, le=1_000_000, description="drop updates staler than this (default: keep all)"
    )
    participation_scale: bool = Field(
        True,
        description="scale a merge of m of K units by m/K (not with delayed_nesterov, which "
        "already averages N arrivals)",
    )
    norm_guard: NormGuardName = Field(
        "reject",
        description="an upload whose norm is above --norm-guard-factor x the median of the "
        "fragment's last 64 merged: reject (counted as norm_outlier), clip (scaled down to the "
        "bound) or off",
    )
    norm_guard_factor: float = Field(
        10.0, gt=1, le=1e6, description="the norm guard's bound, times the median norm"
    )
    peer_review: bool = Field(
        True,
        description="judge each upload against the other units' latest uploads of its fragment "
        "(jobs of 3 units or more): its pace (too_frequent), its direction (direction_outlier) "
        "and its size (clipped), so that a minority of hostile units cannot steer the model "
        "(docs/SECURITY.md); --no-peer-review leaves the norm guard alone",
    )
    peer_hold_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="at a job's start (before 3 units have sent uploads of a fragment), most "
        "seconds an upload with fewer than 2 recent peers waits for them before it is merged on "
        "the norm guard's word alone (after the start it is merged so at once)",
    )

    @model_validator(mode="after")
    def _check_grace(self) -> OuterAlgorithmSettings:
        if self.grace_min_s > self.grace_max_s:
            raise ValueError(f"grace-min-s {self.grace_min_s} > grace-max-s {self.grace_max_s}")
        return self

    def algorithm(
        self, num_units: int, sync: SyncSettings, inner: InnerBound | None = None
    ) -> OuterAlgorithm:
        """The algorithm the outer core runs for a job of ``num_units`` units (imports the
        outer's JAX code). ``inner``: the learners' inner optimizer, which gives the norm
        guard its bound from the first merge on (None: no such bound) and peer review the
        learning rate behind an upload's steps.

        With ``--mode sync`` a round is merged once every active unit is in (every unit of the
        job in the first round), or ``--sync-timeout-s`` after its first upload without the
        rest: the quorum policy with a fixed grace window, rounds of uploads based on the
        current version.
        """
        from services.outer.core import OuterAlgorithm
        from services.outer.staleness import StalenessRule

        algorithm = OuterAlgorithm(
            optimizer=self.outer_optimizer,
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            dn_period=self.dn_period or num_units,
            policy=self.merge_policy,
            min_quorum=self.min_quorum,
            grace_factor=self.grace_factor,
            grace_min_s=self.grace_min_s,
            grace_max_s=self.grace_max_s,
            combine=self.combine,
            token_weighting=self.token_weighting,
            staleness=StalenessRule(
                self.staleness_rule, self.staleness_a, self.staleness_b, self.max_staleness
            ),
            num_units=num_units,
            participation_scale=self.participation_scale,
            fragments=sync.fragments,
            sync_rounds=False,
            norm_guard=self.norm_guard,
            norm_guard_factor=self.norm_guard_factor,
            momentum_max_age=self.momentum_max_age,
            inner=inner,
            peer_review=self.peer_review,
            peer_hold_s=self.peer_hold_s,
        )
        if sync.mode != "sync":
            return algorithm
        return dataclasses.replace(
            algorithm,
            policy="quorum",
            min_quorum=1,
            grace_factor=0.0,
            grace_min_s=sync.sync_timeout_s,
            grace_max_s=sync.sync_timeout_s,
            sync_rounds=True,
        )


def check_sync_overlap(mode: str, overlap_tau: int) -> None:
    """Synchronous DiLoCo takes each round's global at its sync point: no overlap.

    Raises:
        ValueError: ``--mode sync`` with ``--overlap-tau`` above 0.
    """
    if mode == "sync" and overlap_tau > 0:
        raise ValueError(
            f"--mode sync waits for each round's global at its sync point: overlap-tau must be "
            f"0, got {overlap_tau}"
        )


class AlgorithmSettings(SyncSettings, InnerAlgorithmSettings, OuterAlgorithmSettings):
    """Every algorithm setting of a job: what ``diloco up``, a REST job and the simulator run."""

    @model_validator(mode="after")
    def _check_overlap(self) -> AlgorithmSettings:
        check_sync_overlap(self.mode, self.overlap_tau)
        return self

    def outer_algorithm(self, num_units: int, horizons: tuple[int, ...] = ()) -> OuterAlgorithm:
        """The outer core's algorithm for a job of ``num_units`` units that train
        ``horizons`` inner steps (one for all, or one per unit; () where not known)."""
        return self.algorithm(num_units, self, self.inner_bound(horizons))
