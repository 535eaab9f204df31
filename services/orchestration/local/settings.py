"""The options of ``diloco up``: the job, every learner and outer option (passed on to the
services) and the local cluster's own.

Only settings and choice vocabularies are imported here, never an implementation (JAX, Optax,
Numba), so that ``diloco --help`` and ``diloco up`` start quickly.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.learner.settings import AdversaryName, CheckpointSettings
from services.orchestration.local.chaos import plan_chaos, service_targets
from services.orchestration.local.records import CHAOS_KINDS, ChaosEvent, ChaosKind
from services.orchestration.supervisor import DEFAULT_MAX_RESTARTS
from services.outer.settings import EvaluationSettings
from shared.fragments import check_shards
from shared.link_spec import LinkSpec, parse_link, parse_links, parse_outages
from shared.records import MAX_BATCH_SIZE, MAX_OUTER_SHARDS, MAX_UNITS
from shared.settings import ENV_PREFIX, SECRET
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.codec import CodecSettings
from shared.settings.link import ShapedLinkSettings
from shared.settings.nats import JobNameSettings
from shared.settings.resources import ResourceSettings
from shared.settings.workload import DEFAULT_UNITS, WorkloadSettings

NATS_CLUSTER_SIZES = (1, 3, 5)


class UpSettings(
    JobNameSettings,
    WorkloadSettings,
    AlgorithmSettings,
    CodecSettings,
    ResourceSettings,
    ShapedLinkSettings,
    EvaluationSettings,
    CheckpointSettings,
):
    """Options of ``diloco up``: the job, every learner and outer option (passed on to the
    services), and the local cluster's own (each also settable as ``DILOCO_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    learners: int = Field(
        DEFAULT_UNITS, ge=1, le=MAX_UNITS, description="number of learner units to start"
    )
    slowdowns: str = Field(
        "",
        description="comma-separated slowdown factor per unit, e.g. 1,1,2,4 (emulates "
        "heterogeneous hardware; the token budget is shared in proportion to speed)",
    )
    data_dir: str = Field(
        "data",
        description="folder for logs, the NATS store (emptied at start) and the JAX "
        "compilation cache (unless $DILOCO_JAX_CACHE names another)",
    )
    gateway_port: int = Field(8000, ge=0, le=65535, description="gateway HTTP port (0 = free)")
    token: str = Field(
        "",
        description="the gateway's API token, from the environment only (DILOCO_TOKEN; "
        "default: a new random one, printed at start and written to <data-dir>/token)",
        json_schema_extra=SECRET,
    )
    nats_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="nats-server port (0 = free); with --nats-cluster, node i's is this + i",
    )
    nats_cluster: int = Field(
        1,
        description="nats-server nodes: 1, or 3 or 5 for a JetStream cluster (routed nodes, a "
        "store each) whose streams and buckets keep a copy on every node, so that the run "
        "goes on through the death of any one node (two of five); every service gets every "
        "node's URL",
    )
    outer_shards: int = Field(
        1,
        ge=1,
        le=MAX_OUTER_SHARDS,
        description="outer processes the fragments are split over (fragment p to shard p mod "
        "outer-shards), each with its own consumer, lease, checkpoint and status: at most "
        "--fragments",
    )
    data_root: str | None = Field(
        None,
        description="folder jobs created through the gateway may take their corpus from "
        "(default: they train on the built-in corpus)",
    )
    tls: bool = Field(
        False,
        description="NATS over TLS only: make a CA and a server certificate in "
        "<data-dir>/tls; every service verifies the server against the CA",
    )
    progress_every_s: float = Field(5.0, gt=0, description="seconds between progress lines")
    max_duration_s: float = Field(
        1800.0, gt=0, description="stop the run after this many seconds even if not finished"
    )
    stop_at_eval: float | None = Field(
        None,
        gt=0,
        description="end the run once the outer's held-out eval reaches this many nats/byte "
        "(time to a quality target)",
    )
    start_together: bool = Field(
        True,
        description="create the units paused and start them together once all are ready "
        "(data loaded, step compiled), so that their speeds compare fairly",
    )
    max_restarts: int = Field(
        DEFAULT_MAX_RESTARTS,
        ge=0,
        description="restarts of each crashed child before it is left dead (the run then ends "
        "if it is the outer or nats-server); restarts back off from 1 s to 10 s",
    )

    links: str = Field(
        "",
        description="one shaped link per learner, comma-separated, e.g. "
        "100mbit/25ms,20mbit/50ms (instead of --link)",
    )
    outer_link: str = Field(
        "", description="the outer reaches NATS through a shaped link of this shape too"
    )
    link_outages: str = Field(
        "",
        description="outages of every learner's link, START+DURATION[:stall|cut] from the "
        "link's start, comma-separated, e.g. 30s+5s (needs --link or --links)",
    )
    chaos_mtbf_s: float = Field(
        0.0,
        ge=0,
        description="inject failures: mean seconds between two failures of each unit (and "
        "each of --chaos-services); 0: none (services/orchestration/local/chaos.py)",
    )
    chaos_mttr_s: float = Field(10.0, gt=0, description="mean seconds a failure lasts")
    chaos_kinds: str = Field(
        "kill,pause",
        description="what a unit's failure may be, comma-separated: kill (SIGKILL, restarted "
        "after the repair), pause, cut (its link; needs --link or --links)",
    )
    chaos_services: str = Field(
        "",
        description="services killed by the chaos too, comma-separated: outer, nats-server "
        "(with --nats-cluster: nats-0, nats-1, ...)",
    )
    chaos_seed: int | None = Field(None, ge=0, description="seed of the failures (default: --seed)")
    adversaries: int = Field(
        0,
        ge=0,
        le=MAX_UNITS,
        description="fault injection: units 0..N-1 send --adversary's attack instead of honest "
        "uploads, with their own credentials (docs/SECURITY.md)",
    )
    adversary: AdversaryName = Field(
        "none",
        description="the attack of the --adversaries units: sign_flip, random, scaled, alie, "
        "replay or too_frequent (services/learner/adversary.py)",
    )

    def chaos_schedule(self) -> list[ChaosEvent]:
        """The failures to inject (none without --chaos-mtbf-s)."""
        if not self.chaos_mtbf_s:
            return []
        return plan_chaos(
            self.learners,
            self._chaos_services(),
            self._chaos_kinds(),
            self.chaos_mtbf_s,
            self.chaos_mttr_s,
            self.max_duration_s,
            self.seed if self.chaos_seed is None else self.chaos_seed,
        )

    def _chaos_kinds(self) -> list[ChaosKind]:
        kinds = [k.strip() for k in self.chaos_kinds.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in CHAOS_KINDS]
        if not kinds or unknown:
            raise ValueError(
                f"chaos-kinds: expected some of {', '.join(CHAOS_KINDS)}, got {self.chaos_kinds!r}"
            )
        return kinds  # type: ignore[return-value]

    def _chaos_services(self) -> list[str]:
        services = [s.strip() for s in self.chaos_services.split(",") if s.strip()]
        targets = service_targets(self.nats_cluster, self.outer_shards)
        unknown = [s for s in services if s not in targets]
        if unknown:
            raise ValueError(
                f"chaos-services: expected some of {', '.join(targets)}, got {unknown}"
            )
        return services

    def unit_links(self) -> list[LinkSpec] | None:
        """The shaped link of each unit (None: the learners reach NATS directly)."""
        text = self.links or self.link
        return parse_links(text, self.learners) if text else None

    def outer_link_spec(self) -> LinkSpec | None:
        """The outer's shaped link (None: it reaches NATS directly)."""
        return parse_link(self.outer_link) if self.outer_link else None

    def unit_steps(self) -> list[int]:
        """Inner steps of each unit: the job's budget (learners × max-steps) shared in proportion
        to speed, so that slow units do less of it and every unit finishes at about the same
        time (with equal speeds: max-steps each)."""
        speeds = [1.0 / f for f in self.unit_slowdowns()]
        total = self.learners * self.max_steps
        return [max(1, round(total * v / sum(speeds))) for v in speeds]

    def unit_slowdowns(self) -> list[float]:
        """The slowdown factor of each unit."""
        if not self.slowdowns.strip():
            return [1.0] * self.learners
        return [float(x) for x in self.slowdowns.split(",")]

    @model_validator(mode="after")
    def _check_nats_cluster(self) -> UpSettings:
        if self.nats_cluster not in NATS_CLUSTER_SIZES:
            raise ValueError(
                f"nats-cluster: expected one of {', '.join(map(str, NATS_CLUSTER_SIZES))} nodes "
                f"(a JetStream cluster needs an odd number to elect leaders), got "
                f"{self.nats_cluster}"
            )
        return self

    @model_validator(mode="after")
    def _check_outer_shards(self) -> UpSettings:
        check_shards(self.outer_shards, self.fragments)
        return self

    @model_validator(mode="after")
    def _check_adversaries(self) -> UpSettings:
        if self.adversaries > self.learners:
            raise ValueError(f"adversaries {self.adversaries} > learners {self.learners}")
        if (self.adversaries > 0) != (self.adversary != "none"):
            raise ValueError("--adversaries N and --adversary KIND go together")
        return self

    @model_validator(mode="after")
    def _check_up(self) -> UpSettings:
        try:
            factors = self.unit_slowdowns()
        except ValueError:
            raise ValueError(
                f"slowdowns must be numbers like 1,1,2,4, got {self.slowdowns!r}"
            ) from None
        if len(factors) != self.learners or any(not 1 <= f <= 100 for f in factors):
            raise ValueError(
                f"slowdowns needs {self.learners} factors in [1, 100], got {self.slowdowns!r}"
            )
        if self.batch_size * self.devices_per_unit > MAX_BATCH_SIZE:
            raise ValueError(
                f"batch-size {self.batch_size} on each of devices-per-unit "
                f"{self.devices_per_unit} is more than {MAX_BATCH_SIZE} sequences per step"
            )
        if self.link and self.links:
            raise ValueError("give --link (every unit the same) or --links (per unit), not both")
        self.unit_links()
        self.outer_link_spec()
        parse_outages(self.link_outages)
        if self.link_outages and not (self.link or self.links):
            raise ValueError("link-outages needs learners' links: add --link or --links")
        if self.min_quorum > self.learners:
            raise ValueError(f"min-quorum {self.min_quorum} > learners {self.learners}")
        self._chaos_services()
        if "cut" in self._chaos_kinds() and self.chaos_mtbf_s and not (self.link or self.links):
            raise ValueError("chaos-kinds cut needs learners' links: add --link or --links")
        return self
