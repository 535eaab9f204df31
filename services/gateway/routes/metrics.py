"""Metrics: a job's JSON time series (``/jobs/{job}/metrics``) and Prometheus text
(``/metrics``), both built from the status records at request time."""

from __future__ import annotations

import time

from fastapi import APIRouter, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.gateway.collector import StatusCollector
from services.gateway.deps import JobName, LinkDep, NatsDep, RegistryDep, SettingsDep
from services.gateway.job_metrics import JobMetrics, job_metrics
from services.gateway.views import NOT_FOUND
from shared import records
from shared.job_status import JobStatus, jobs_with_status, read_job_status

router = APIRouter(tags=["metrics"])


@router.get(
    "/jobs/{job}/metrics",
    response_model=JobMetrics,
    summary="Loss, throughput, staleness and bytes of a job (JSON time series)",
    responses={**NOT_FOUND},
)
async def get_job_metrics(
    job: JobName, registry: RegistryDep, nats: NatsDep, settings: SettingsDep
) -> JobMetrics:
    """Eval loss vs tokens, train loss per merge, and every reporting unit's numbers."""
    status = await read_job_status(nats.nc, nats.js, job)
    if not status.found:
        raise HTTPException(status_code=404, detail=f"job {job!r} not found")
    desired = await registry.desired_states(job, status.units)
    return job_metrics(status, desired, settings.heartbeat_timeout_s, time.time())


@router.get(
    "/metrics",
    summary="Prometheus metrics of every job with status records",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def prometheus_metrics(settings: SettingsDep, link: LinkDep) -> Response:
    """Prometheus text exposition, built from the status records at scrape time.

    Covers the gateway's ``--job`` and every job with a key in the status bucket. Without
    NATS it still answers, with ``diloco_gateway_nats_connected 0`` and the rejection counts.
    """
    snapshot: dict[str, JobStatus] = {}
    nats = link.handles if link.connected else None
    if nats is not None:
        for job in sorted({settings.job, *await jobs_with_status(nats.nc)} - {""}):
            snapshot[job] = await read_job_status(nats.nc, nats.js, job)
    rejected = records.rejections.counts()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        StatusCollector(snapshot, nats is not None, settings.heartbeat_timeout_s, rejected)
    )
    return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
