"""Settings of the outer optimizer service (flags ``diloco outer --help``, env ``DILOCO_*``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.outer_choices import (
    CombineName,
    MergePolicyName,
    NormGuardName,
    OuterOptimizerName,
    ParamsCodecName,
    StalenessRuleName,
    TokenWeightingName,
)
from shared.records import MAX_OUTER_UNITS
from shared.settings import ENV_PREFIX, JobSettings

if TYPE_CHECKING:
    from services.outer.core import OuterAlgorithm


class OuterAlgorithmSettings(BaseSettings):
    """How the outer merges pseudo-gradients (docs/ALGORITHMS.md explains each choice)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    outer_optimizer: OuterOptimizerName = Field(
        "delayed_nesterov", description="outer optimizer: sgd, nesterov or delayed_nesterov"
    )
    outer_lr: float = Field(0.7, gt=0, le=10, description="outer learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer (Nesterov) momentum")
    dn_period: int = Field(
        0,
        ge=0,
        le=1024,
        description="Delayed Nesterov: arrivals per momentum update (N; 0 = number of units)",
    )
    merge_policy: MergePolicyName = Field(
        "each", description="each (apply every arrival alone) or quorum (quorum + grace window)"
    )
    min_quorum: int = Field(1, ge=1, le=1024, description="arrivals needed before a merge (K)")
    grace_factor: float = Field(
        0.5, ge=0, le=10, description="grace window as a share of the median upload interval"
    )
    grace_min_s: float = Field(0.0, ge=0, description="shortest grace window, seconds")
    grace_max_s: float = Field(30.0, ge=0, description="longest grace window, seconds")
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
        None, ge=0, description="drop updates staler than this (default: keep all)"
    )
    params_codec: ParamsCodecName = Field(
        "int8",
        description="codec of the global params sent to learners: int8 (blockwise, each "
        "version encoded afresh; a quarter of fp32's bytes), bf16 or fp32 (exact); "
        "BENCHMARKS.md, 'Quality: downlink', measures them",
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

    def algorithm(self, num_units: int = 1, fragments: int = 1) -> OuterAlgorithm:
        """The algorithm these settings describe (imports the outer's JAX code)."""
        from services.outer.core import OuterAlgorithm
        from services.outer.staleness import StalenessRule

        return OuterAlgorithm(
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
            fragments=fragments,
            norm_guard=self.norm_guard,
            norm_guard_factor=self.norm_guard_factor,
        )

    @model_validator(mode="after")
    def _check_grace(self) -> OuterAlgorithmSettings:
        if self.grace_min_s > self.grace_max_s:
            raise ValueError(f"grace-min-s {self.grace_min_s} > grace-max-s {self.grace_max_s}")
        return self


class OuterSettings(JobSettings, OuterAlgorithmSettings):
    """The outer optimizer of one job: how it merges pseudo-gradients and reports progress."""

    num_units: int = Field(
        1,
        ge=1,
        le=MAX_OUTER_UNITS,
        description="units in the job (K: participation share, quorum checks)",
    )
    eval_every_s: float = Field(
        5.0, gt=0, description="seconds between held-out evaluations of the global params"
    )
    eval_when_idle: bool = Field(
        True,
        description="also evaluate a new version whenever no upload came for a second (the "
        "last version of a run is evaluated at once)",
    )
    eval_batches: int = Field(8, ge=1, le=1000, description="held-out batches per evaluation")
    eval_batch_size: int = Field(16, ge=1, le=4096, description="sequences per eval batch")
    fetch_batch: int = Field(32, ge=1, le=1024, description="messages fetched per pull")
    max_upload_bytes: int = Field(
        1 << 30, gt=0, description="largest pseudo-gradient message accepted"
    )
    max_pending_uploads: int = Field(
        64, ge=1, description="incomplete uploads kept in memory before the oldest is dropped"
    )
    status_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    lease_s: float = Field(
        10.0,
        ge=0.5,
        le=600,
        description="seconds without a lease renewal after which a standby outer takes over",
    )
    decode_threads: int = Field(
        -1, ge=-1, le=256, description="threads decoding uploads of 8 MiB or more (-1: one per CPU)"
    )

    def algorithm(self, num_units: int = 1, fragments: int = 1) -> OuterAlgorithm:
        """The algorithm of these settings; with ``--mode sync`` a round is merged once every
        active unit is in (every unit of the job in the first round), or ``--sync-timeout-s``
        after its first upload without the rest (the quorum policy with a fixed grace
        window, rounds of uploads based on the current version)."""
        algorithm = super().algorithm(num_units, fragments)
        if self.mode != "sync":
            return algorithm
        return dataclasses.replace(
            algorithm,
            policy="quorum",
            min_quorum=1,
            grace_factor=0.0,
            grace_min_s=self.sync_timeout_s,
            grace_max_s=self.sync_timeout_s,
            sync_rounds=True,
        )

    @model_validator(mode="after")
    def _check_quorum(self) -> OuterSettings:
        if self.min_quorum > self.num_units:
            raise ValueError(f"min-quorum {self.min_quorum} > num-units {self.num_units}")
        return self
