"""Read-only observability routes: job metrics as JSON, Prometheus text, per-unit health.

Like the rest of the gateway these keep no state: every answer is built at request time from
the status records in the ``diloco_status`` KV bucket (the outer's and each unit's heartbeat)
and the desired states in ``diloco_desired``. Longer series (eval loss and train loss per
merge) come from the bounded histories the outer keeps in its own status record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Annotated, Any

import nats.errors
import nats.js.errors
from fastapi import APIRouter, HTTPException, Path, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field

from services.gateway.link import KV_TIMEOUT_S, Link, NatsLink, read_status
from shared import subjects, transport
from shared.settings import JOB_NAME_PATTERN

router = APIRouter(tags=["observability"])

JobName = Annotated[
    str, Path(pattern=JOB_NAME_PATTERN.pattern, description="job name", examples=["demo"])
]
UnitIndex = Annotated[int, Path(ge=0, le=1_000_000, description="unit index", examples=[0])]

#: Unit states the ``diloco_unit_state`` gauge always reports (1 for the current one).
UNIT_STATES = ("starting", "idle", "running", "paused", "finished", "stopped", "lost")
#: States in which a silent unit is not considered lost (it ended on purpose).
ENDED_STATES = ("finished", "stopped")


# ---- derived values shared by every route ---------------------------------------------------


def heartbeat_age(status: dict[str, Any], now: float) -> float | None:
    """Seconds since the record's writer stamped it (``None`` without a timestamp)."""
    stamp = status.get("time")
    return round(max(0.0, now - float(stamp)), 3) if isinstance(stamp, int | float) else None


def unit_state(status: dict[str, Any], now: float, timeout_s: float) -> str:
    """The unit's reported state, or ``lost`` when its heartbeat is older than ``timeout_s``."""
    state = str(status.get("state", "unknown"))
    age = heartbeat_age(status, now)
    if state not in ENDED_STATES and (age is None or age > timeout_s):
        return "lost"
    return state


def version_lag(outer: dict[str, Any] | None, status: dict[str, Any]) -> int | None:
    """Global version minus the version the unit's current params are based on."""
    version = (outer or {}).get("version")
    base = status.get("base_version")
    if isinstance(version, int) and isinstance(base, int):
        return max(0, version - base)
    return None


def _counter(status: dict[str, Any], name: str) -> int:
    value = (status.get("counters") or {}).get(name, 0)
    return int(value) if isinstance(value, int | float) else 0


async def desired_state(link: NatsLink, job: str, unit: int) -> str:
    """The desired state written for a unit (``running`` when nothing was written)."""
    record = await asyncio.wait_for(
        transport.get_json(link.desired_kv, subjects.desired_key(job, unit)), KV_TIMEOUT_S
    )
    return str((record or {}).get("state", "running"))


async def known_jobs(link: NatsLink) -> list[str]:
    """The gateway's own job plus every job that has a key in the status bucket."""
    jobs = {link.settings.job}
    keys = await asyncio.wait_for(transport.kv_keys(link.status_kv), KV_TIMEOUT_S)
    for key in keys:
        job = key.split(".", 1)[0]
        if JOB_NAME_PATTERN.match(job):
            jobs.add(job)
    return sorted(jobs)


# ---- GET /jobs/{job}/metrics -----------------------------------------------------------------


class EvalPoint(BaseModel):
    """One evaluation of the global model on held-out data."""

    version: int = Field(description="global version evaluated")
    tokens: int = Field(description="tokens applied by the outer when it was evaluated")
    nats_per_byte: float = Field(description="held-out loss in nats per byte")


class TrainPoint(BaseModel):
    """The mean train loss of the uploads applied by one merge."""

    tokens: int = Field(description="tokens applied by the outer after the merge")
    train_loss: float = Field(description="mean train loss reported by the merged uploads")


class UnitMetrics(BaseModel):
    """Current numbers of one unit (from its heartbeat and the outer's ledger)."""

    unit: int
    state: str = Field(description="reported state, or 'lost' when its heartbeat is too old")
    desired: str = Field(description="desired state written through the gateway")
    step: int | None = None
    tokens: int | None = Field(None, description="tokens trained by the unit's process")
    tokens_per_s: float | None = None
    train_loss: float | None = None
    base_version: int | None = None
    version_lag: int | None = Field(None, description="global version minus base_version")
    heartbeat_age_s: float | None = None
    last_staleness: int | None = Field(None, description="staleness of its last applied upload")
    applied: int = Field(0, description="uploads of this unit the outer has applied")
    published: int = Field(0, description="uploads published by the unit's process")
    bytes_sent: int = Field(0, description="bytes published to NATS (all chunks)")
    payload_bytes_encoded: int = Field(0, description="encoded pseudo-gradient bytes")
    fp32_bytes_encoded: int = Field(0, description="the same tensors' size in fp32")


class JobMetrics(BaseModel):
    """Time series and current numbers of a job, built from the status records."""

    job: str
    time: float = Field(description="gateway wall-clock time of this answer")
    outer_state: str
    version: int | None
    merges: int
    applied: int
    rejected: dict[str, int]
    tokens_applied: int
    payload_bytes: int = Field(description="compressed upload bytes the outer accepted")
    bytes_sent: int = Field(description="bytes the units' processes published, summed")
    staleness: dict[int, int] = Field(description="applied uploads by staleness")
    eval_init_nats_per_byte: float | None
    eval_nats_per_byte: float | None
    eval_history: list[EvalPoint]
    train_history: list[TrainPoint]
    units: list[UnitMetrics]

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "job": "demo",
                    "time": 1764490000.0,
                    "outer_state": "running",
                    "version": 42,
                    "merges": 42,
                    "applied": 84,
                    "rejected": {"too_stale": 1},
                    "tokens_applied": 172032,
                    "payload_bytes": 1048576,
                    "bytes_sent": 1100000,
                    "staleness": {"0": 40, "1": 44},
                    "eval_init_nats_per_byte": 5.61,
                    "eval_nats_per_byte": 2.9,
                    "eval_history": [
                        {"version": 0, "tokens": 0, "nats_per_byte": 5.61},
                        {"version": 40, "tokens": 163840, "nats_per_byte": 2.9},
                    ],
                    "train_history": [{"tokens": 4096, "train_loss": 5.4}],
                    "units": [
                        {
                            "unit": 0,
                            "state": "running",
                            "desired": "running",
                            "step": 210,
                            "tokens": 86016,
                            "tokens_per_s": 1530.5,
                            "train_loss": 2.95,
                            "base_version": 41,
                            "version_lag": 1,
                            "heartbeat_age_s": 0.4,
                            "last_staleness": 1,
                            "applied": 42,
                            "published": 42,
                            "bytes_sent": 550000,
                            "payload_bytes_encoded": 524288,
                            "fp32_bytes_encoded": 2097152,
                        }
                    ],
                }
            ]
        }
    }


def _points(rows: Any, width: int) -> Iterator[list[Any]]:
    for row in rows or []:
        if isinstance(row, list | tuple) and len(row) >= width and None not in row[:width]:
            yield list(row[:width])


def job_metrics(
    job: str,
    outer: dict[str, Any] | None,
    units: dict[int, dict[str, Any]],
    desired: dict[int, str],
    now: float,
    timeout_s: float,
) -> JobMetrics:
    """Assemble :class:`JobMetrics` from one read of a job's status records."""
    outer = outer or {}
    ledger_units = outer.get("units") or {}
    views = []
    for unit, status in sorted(units.items()):
        ledger = ledger_units.get(str(unit)) or {}
        views.append(
            UnitMetrics(
                unit=unit,
                state=unit_state(status, now, timeout_s),
                desired=desired.get(unit, "running"),
                step=status.get("step"),
                tokens=status.get("tokens"),
                tokens_per_s=status.get("tokens_per_s"),
                train_loss=status.get("train_loss"),
                base_version=status.get("base_version"),
                version_lag=version_lag(outer, status),
                heartbeat_age_s=heartbeat_age(status, now),
                last_staleness=ledger.get("last_staleness") if ledger else None,
                applied=int(ledger.get("applied", 0)),
                published=_counter(status, "published"),
                bytes_sent=_counter(status, "bytes_sent"),
                payload_bytes_encoded=_counter(status, "payload_bytes_encoded"),
                fp32_bytes_encoded=_counter(status, "fp32_bytes_encoded"),
            )
        )
    outer_age = heartbeat_age(outer, now)
    outer_state = "absent"
    if outer:
        outer_state = str(outer.get("state", "unknown"))
        if outer_age is None or outer_age > timeout_s:
            outer_state = "lost"
    return JobMetrics(
        job=job,
        time=now,
        outer_state=outer_state,
        version=outer.get("version"),
        merges=int(outer.get("merges", 0)),
        applied=int(outer.get("applied", 0)),
        rejected={str(k): int(v) for k, v in (outer.get("rejected") or {}).items()},
        tokens_applied=int(outer.get("tokens_applied", 0)),
        payload_bytes=int(outer.get("payload_bytes", 0)),
        bytes_sent=sum(v.bytes_sent for v in views),
        staleness={int(k): int(v) for k, v in (outer.get("staleness") or {}).items()},
        eval_init_nats_per_byte=(outer.get("eval_init") or {}).get("nats_per_byte"),
        eval_nats_per_byte=(outer.get("eval") or {}).get("nats_per_byte"),
        eval_history=[
            EvalPoint(version=v, tokens=t, nats_per_byte=loss)
            for v, t, loss in _points(outer.get("eval_history"), 3)
        ],
        train_history=[
            TrainPoint(tokens=t, train_loss=loss)
            for t, loss in _points(outer.get("train_history"), 2)
        ],
        units=views,
    )


async def _read_job(link: NatsLink, job: str) -> tuple[dict | None, dict[int, dict], dict]:
    outer, units = await read_status(link, job)
    desired = {unit: await desired_state(link, job, unit) for unit in units}
    return outer, units, desired


@router.get(
    "/jobs/{job}/metrics",
    response_model=JobMetrics,
    summary="Loss, throughput, staleness and bytes of a job (JSON time series)",
)
async def get_job_metrics(job: JobName, link: Link) -> JobMetrics:
    """Eval loss vs tokens, train loss per merge, and every unit's current numbers."""
    outer, units, desired = await _read_job(link, job)
    if outer is None and not units:
        raise HTTPException(status_code=404, detail=f"job {job!r} not found")
    return job_metrics(job, outer, units, desired, time.time(), link.settings.heartbeat_timeout_s)


# ---- GET /jobs/{job}/units/{unit} ------------------------------------------------------------


class UnitHealth(BaseModel):
    """Health of one unit: liveness, progress, lag behind the global version, counters."""

    job: str
    unit: int
    state: str = Field(description="reported state, or 'lost' when its heartbeat is too old")
    reported_state: str = Field(description="the state in the unit's last heartbeat")
    desired: str
    lost: bool
    heartbeat_age_s: float | None
    last_heartbeat: float | None = Field(description="wall-clock time of the last heartbeat")
    step: int | None = None
    max_steps: int | None = None
    round: int | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    train_loss: float | None = None
    base_version: int | None = None
    outer_version: int | None = None
    version_lag: int | None = Field(None, description="outer version minus base_version")
    applied: int = Field(0, description="uploads of this unit the outer has applied")
    last_staleness: int | None = None
    unsent: int | None = Field(None, description="uploads queued but not yet published")
    last_error: str | None = None
    counters: dict[str, int] = Field(description="this process's counters")
    lifetime: dict[str, Any] | None = Field(None, description="counters across restarts")

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "job": "demo",
                    "unit": 1,
                    "state": "running",
                    "reported_state": "running",
                    "desired": "running",
                    "lost": False,
                    "heartbeat_age_s": 0.7,
                    "last_heartbeat": 1764490000.0,
                    "step": 120,
                    "max_steps": 1000,
                    "round": 24,
                    "tokens": 49152,
                    "tokens_per_s": 1498.2,
                    "train_loss": 3.1,
                    "base_version": 40,
                    "outer_version": 42,
                    "version_lag": 2,
                    "applied": 23,
                    "last_staleness": 1,
                    "unsent": 0,
                    "last_error": None,
                    "counters": {"published": 24, "bytes_sent": 300000},
                    "lifetime": {"published": 24},
                }
            ]
        }
    }


@router.get(
    "/jobs/{job}/units/{unit}",
    response_model=UnitHealth,
    summary="Health of one unit: state (incl. lost), step, tokens/s, version lag, counters",
)
async def get_unit_health(job: JobName, unit: UnitIndex, link: Link) -> UnitHealth:
    """One unit's heartbeat, judged against ``heartbeat_timeout_s`` and the outer's version."""
    status = await asyncio.wait_for(
        transport.get_json(link.status_kv, subjects.unit_status_key(job, unit)), KV_TIMEOUT_S
    )
    if status is None:
        raise HTTPException(
            status_code=404, detail=f"unit {unit} of job {job!r} has never reported"
        )
    outer = await asyncio.wait_for(
        transport.get_json(link.status_kv, subjects.outer_status_key(job)), KV_TIMEOUT_S
    )
    now = time.time()
    state = unit_state(status, now, link.settings.heartbeat_timeout_s)
    ledger = ((outer or {}).get("units") or {}).get(str(unit)) or {}
    counters = {
        str(k): int(v)
        for k, v in (status.get("counters") or {}).items()
        if isinstance(v, int | float)
    }
    return UnitHealth(
        job=job,
        unit=unit,
        state=state,
        reported_state=str(status.get("state", "unknown")),
        desired=await desired_state(link, job, unit),
        lost=state == "lost",
        heartbeat_age_s=heartbeat_age(status, now),
        last_heartbeat=status.get("time"),
        step=status.get("step"),
        max_steps=status.get("max_steps"),
        round=status.get("round"),
        tokens=status.get("tokens"),
        tokens_per_s=status.get("tokens_per_s"),
        train_loss=status.get("train_loss"),
        base_version=status.get("base_version"),
        outer_version=(outer or {}).get("version"),
        version_lag=version_lag(outer, status),
        applied=int(ledger.get("applied", 0)),
        last_staleness=ledger.get("last_staleness") if ledger else None,
        unsent=status.get("unsent"),
        last_error=status.get("last_error") or None,
        counters=counters,
        lifetime=status.get("lifetime"),
    )


# ---- GET /metrics (Prometheus) ---------------------------------------------------------------


class StatusCollector(Collector):
    """A Prometheus collector over one snapshot of the status records of several jobs.

    A fresh one is made for every scrape, so nothing global or mutable is kept between
    scrapes: the metrics are exactly what the KV bucket held when the scrape came in.
    """

    def __init__(
        self,
        snapshot: dict[str, tuple[dict | None, dict[int, dict]]],
        nats_connected: bool,
        now: float,
        timeout_s: float,
    ) -> None:
        self.snapshot = snapshot
        self.nats_connected = nats_connected
        self.now = now
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family of the snapshot."""
        yield GaugeMetricFamily(
            "diloco_gateway_nats_connected",
            "1 when the gateway is connected to NATS",
            value=1.0 if self.nats_connected else 0.0,
        )
        yield from self._outer_families()
        yield from self._unit_families()

    def _outer_families(self) -> Iterator[Metric]:
        job_label = ["job"]
        up = GaugeMetricFamily(
            "diloco_outer_up", "1 when the outer's heartbeat is fresh", labels=job_label
        )
        age = GaugeMetricFamily(
            "diloco_outer_heartbeat_age_seconds", "age of the outer's heartbeat", labels=job_label
        )
        version = GaugeMetricFamily(
            "diloco_outer_version", "global model version", labels=job_label
        )
        applied = CounterMetricFamily(
            "diloco_outer_applied", "uploads applied by the outer", labels=job_label
        )
        merges = CounterMetricFamily("diloco_outer_merges", "outer merges", labels=job_label)
        rejected = CounterMetricFamily(
            "diloco_outer_rejected", "uploads rejected, by reason", labels=["job", "reason"]
        )
        tokens = CounterMetricFamily(
            "diloco_outer_tokens_applied", "tokens of applied uploads", labels=job_label
        )
        payload = CounterMetricFamily(
            "diloco_outer_payload_bytes", "compressed upload bytes accepted", labels=job_label
        )
        eval_loss = GaugeMetricFamily(
            "diloco_outer_eval_nats_per_byte", "last held-out loss (nats/byte)", labels=job_label
        )
        staleness = HistogramMetricFamily(
            "diloco_outer_staleness",
            "staleness (versions) of applied uploads",
            labels=job_label,
        )
        unit_applied = CounterMetricFamily(
            "diloco_outer_unit_applied",
            "uploads of a unit applied by the outer",
            labels=["job", "unit"],
        )
        for job, (outer, _) in sorted(self.snapshot.items()):
            if not outer:
                continue
            outer_age = heartbeat_age(outer, self.now)
            fresh = outer_age is not None and outer_age <= self.timeout_s
            up.add_metric([job], 1.0 if fresh and outer.get("state") == "running" else 0.0)
            if outer_age is not None:
                age.add_metric([job], outer_age)
            version.add_metric([job], float(outer.get("version", 0)))
            applied.add_metric([job], float(outer.get("applied", 0)))
            merges.add_metric([job], float(outer.get("merges", 0)))
            for reason, count in sorted((outer.get("rejected") or {}).items()):
                rejected.add_metric([job, str(reason)], float(count))
            tokens.add_metric([job], float(outer.get("tokens_applied", 0)))
            payload.add_metric([job], float(outer.get("payload_bytes", 0)))
            loss = (outer.get("eval") or outer.get("eval_init") or {}).get("nats_per_byte")
            if isinstance(loss, int | float):
                eval_loss.add_metric([job], float(loss))
            counts = sorted((int(k), int(v)) for k, v in (outer.get("staleness") or {}).items())
            buckets, cumulative = [], 0
            for value, count in counts:
                cumulative += count
                buckets.append((str(float(value)), float(cumulative)))
            buckets.append(("+Inf", float(cumulative)))
            staleness.add_metric([job], buckets, float(sum(k * v for k, v in counts)))
            for unit, ledger in sorted((outer.get("units") or {}).items()):
                unit_applied.add_metric([job, str(unit)], float(ledger.get("applied", 0)))
        yield from (up, age, version, applied, merges, rejected, tokens, payload, eval_loss)
        yield from (staleness, unit_applied)

    def _unit_families(self) -> Iterator[Metric]:
        labels = ["job", "unit"]
        gauges = {
            "step": GaugeMetricFamily("diloco_unit_step", "inner steps done", labels=labels),
            "tokens_per_s": GaugeMetricFamily(
                "diloco_unit_tokens_per_second", "training throughput", labels=labels
            ),
            "tokens": GaugeMetricFamily(
                "diloco_unit_tokens", "tokens trained by the unit's process", labels=labels
            ),
            "train_loss": GaugeMetricFamily(
                "diloco_unit_train_loss", "smoothed train loss", labels=labels
            ),
            "base_version": GaugeMetricFamily(
                "diloco_unit_base_version", "global version the params are based on", labels=labels
            ),
        }
        lag = GaugeMetricFamily(
            "diloco_unit_version_lag", "outer version minus base version", labels=labels
        )
        age = GaugeMetricFamily(
            "diloco_unit_heartbeat_age_seconds", "age of the unit's heartbeat", labels=labels
        )
        state = GaugeMetricFamily(
            "diloco_unit_state", "1 for the unit's current state", labels=["job", "unit", "state"]
        )
        counters = {
            "bytes_sent": CounterMetricFamily(
                "diloco_unit_bytes_sent", "bytes published to NATS", labels=labels
            ),
            "payload_bytes_encoded": CounterMetricFamily(
                "diloco_unit_payload_bytes_encoded", "encoded pseudo-gradient bytes", labels=labels
            ),
            "published": CounterMetricFamily(
                "diloco_unit_published", "uploads published", labels=labels
            ),
        }
        for job, (outer, units) in sorted(self.snapshot.items()):
            for unit, status in sorted(units.items()):
                key = [job, str(unit)]
                for field_name, family in gauges.items():
                    value = status.get(field_name)
                    if isinstance(value, int | float):
                        family.add_metric(key, float(value))
                lag_value = version_lag(outer, status)
                if lag_value is not None:
                    lag.add_metric(key, float(lag_value))
                unit_age = heartbeat_age(status, self.now)
                if unit_age is not None:
                    age.add_metric(key, unit_age)
                current = unit_state(status, self.now, self.timeout_s)
                for name in dict.fromkeys((*UNIT_STATES, current)):
                    state.add_metric([*key, name], 1.0 if name == current else 0.0)
                for field_name, family in counters.items():
                    family.add_metric(key, float(_counter(status, field_name)))
        yield from gauges.values()
        yield from (lag, age, state)
        yield from counters.values()


@router.get(
    "/metrics",
    summary="Prometheus metrics of every job with status records",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def prometheus_metrics(request: Request) -> Response:
    """Prometheus text exposition, built from the status records at scrape time.

    Covers the gateway's ``--job`` and every job with a key in the status bucket. Without
    NATS it still answers, with ``diloco_gateway_nats_connected 0`` only.
    """
    link: NatsLink = request.app.state.link
    snapshot: dict[str, tuple[dict | None, dict[int, dict]]] = {}
    connected = link.connected
    if connected:
        try:
            for job in await known_jobs(link):
                snapshot[job] = await read_status(link, job)
        except (TimeoutError, nats.errors.Error) as err:
            raise HTTPException(status_code=503, detail=f"status bucket unreadable: {err}") from err
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        StatusCollector(snapshot, connected, time.time(), link.settings.heartbeat_timeout_s)
    )
    return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
