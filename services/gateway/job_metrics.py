"""``GET /jobs/{job}/metrics``: a job's time series and current numbers, built from one read of
its status records (the units in it are :func:`~services.gateway.views.unit_view`'s). Pure."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, Field

from services.gateway.views import (
    ShownOuterState,
    UnitView,
    books,
    eval_losses,
    job_goodput_value,
    unit_views,
)
from shared.job_status import JobStatus
from shared.records.jobs import DesiredState
from shared.records.outer import EvalPoint, MergePoint, TrainPoint, outer_liveness


class JobMetrics(BaseModel):
    """Time series and current numbers of a job, built from its status records."""

    job: str
    time: float = Field(description="gateway wall-clock time of this answer")
    outer_state: ShownOuterState
    version: int | None
    merges: int
    applied: int
    rejected: dict[str, int]
    tokens_applied: int
    payload_bytes: int = Field(description="compressed upload bytes the outer accepted")
    bytes_sent: int = Field(description="bytes the units' processes published, summed")
    staleness: dict[int, int] = Field(description="applied uploads by staleness")
    goodput: float | None = Field(None, description="the job's goodput (as in JobView)")
    eval_init_nats_per_byte: float | None
    eval_nats_per_byte: float | None
    eval_history: list[EvalPoint]
    train_history: list[TrainPoint]
    merge_history: list[MergePoint] = Field(
        description="the outer's newest merges: each upload's unit and staleness, and the "
        "norms of the update and of the outer momentum"
    )
    units: list[UnitView] = Field(description="the units that reported")

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
                            "job": "demo",
                            "unit": 0,
                            "state": "running",
                            "reported_state": "running",
                            "desired": "running",
                            "step": 210,
                            "tokens": 86016,
                            "tokens_per_s": 1530.5,
                            "train_loss": 2.95,
                            "base_version": 41,
                            "outer_version": 42,
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


def job_metrics(
    status: JobStatus,
    desired: Mapping[int, DesiredState],
    timeout_s: float,
    now: float,
) -> JobMetrics:
    """A job's metrics from one read of its status records.

    Args:
        status: the job's status records.
        desired: the desired states written for its units.
        timeout_s: heartbeat age past which a writer is lost.
        now: the gateway's time of the answer.
    """
    outer = status.outer_record()
    merges = outer.merge_history if outer is not None else []
    units = unit_views(status, set(status.units), desired, timeout_s)
    initial, last = eval_losses(outer)
    ledger = books(outer)
    return JobMetrics(
        job=status.job,
        time=now,
        outer_state=outer_liveness(status.outer, timeout_s),
        version=outer.version if outer is not None else None,
        merges=ledger.merges,
        applied=ledger.applied,
        rejected=ledger.rejected,
        tokens_applied=ledger.tokens_applied,
        payload_bytes=ledger.payload_bytes,
        bytes_sent=sum(unit.bytes_sent for unit in units),
        staleness=ledger.staleness,
        goodput=job_goodput_value(status),
        eval_init_nats_per_byte=initial,
        eval_nats_per_byte=last,
        eval_history=outer.evaluation.history if outer is not None else [],
        train_history=[point for merge in merges if (point := merge.train_point()) is not None],
        merge_history=merges,
        units=units,
    )
