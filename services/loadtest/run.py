"""``diloco loadtest``: the stages one after the other, the report printed and written."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TextIO

from services.loadtest.payloads import PayloadPool
from services.loadtest.records import LoadtestReport
from services.loadtest.report import saturation_units, table, verdict
from services.loadtest.settings import LoadtestSettings
from services.loadtest.stage import Stage
from shared import records
from shared.atomic import atomic_write_bytes
from shared.fragments import plan_fragments
from shared.model_config import get_config

POOL_SIZE = 4  # different synthetic pseudo-gradients, sent in turn
REPORT_FILE = "loadtest.json"


def report_path(settings: LoadtestSettings) -> Path:
    """Where the report is written."""
    return Path(settings.data_dir) / REPORT_FILE


def payload_pools(settings: LoadtestSettings) -> list[PayloadPool]:
    """The pre-encoded pseudo-gradients of each fragment of the model (the whole model with
    one fragment), each with seeds of its own."""
    model = get_config(settings.model)
    shapes = model.param_shapes()
    plan = plan_fragments(shapes, settings.fragments)
    return [
        PayloadPool(
            model,
            settings.codec_config(),
            POOL_SIZE,
            settings.seed + fragment,
            plan.piece_shapes(shapes, fragment),
        )
        for fragment in range(plan.count)
    ]


def run_loadtest(settings: LoadtestSettings, out: TextIO = sys.stdout) -> LoadtestReport:
    """Run every stage, print each as it ends and the table at the end; write the report
    (``<data-dir>/loadtest.json``, rewritten after each stage)."""

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    model = get_config(settings.model)
    say(f"encoding {POOL_SIZE} synthetic {settings.codec} pseudo-gradients of {model.name}")
    pools = payload_pools(settings)
    upload_bytes = sum(pool.payload_bytes for pool in pools) // len(pools)
    fp32_bytes = sum(pool.fp32_bytes for pool in pools)
    report = LoadtestReport(
        model=settings.model,
        param_count=model.param_count,
        codec=settings.codec,
        params_codec=settings.params_codec,
        params_fetch=settings.params_fetch,
        link=settings.link_spec(),
        upload_every_s=settings.upload_every_s,
        upload_payload_bytes=upload_bytes,
        commit_every_s=settings.commit_every_s,
        fragments=settings.fragments,
        outer_shards=settings.outer_shards,
    )
    fragments = f" in {settings.fragments} fragments" if settings.fragments > 1 else ""
    shards = f", {settings.outer_shards} outer shards" if settings.outer_shards > 1 else ""
    say(
        f"{model.param_count:,} parameters; one upload {upload_bytes / 1e6:.2f} MB "
        f"({fp32_bytes / len(pools) / upload_bytes:.2f}x less than fp32); a unit uploads the "
        f"model{fragments} every {settings.upload_every_s:g} s over {report.link.text()}{shards}"
    )
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    for count in settings.unit_counts():
        say(
            f"stage: {count} units (warm-up {settings.warmup():g} s, window {settings.stage_s:g} s)"
        )
        stage = asyncio.run(Stage(settings, count, pools, say).run())
        report.stages.append(stage)
        report.saturation_units = saturation_units(report.stages)
        atomic_write_bytes(report_path(settings), records.encode(report))
        sync = stage.sync_latency
        say(
            f"  {count} units: applied {stage.ingest_uploads_per_s:.2f} of "
            f"{stage.offered_uploads_per_s:.2f} offered uploads/s "
            f"({stage.ingest_mb_per_s:.1f} MB/s), sync p50 "
            f"{sync.p50_s if sync else float('nan'):.2f} s, backlog {stage.backlog_start} → "
            f"{stage.backlog_end}, books {'balanced' if stage.books.balanced else 'NOT balanced'}"
            + (f"; saturated: {stage.reason}" if stage.saturated else "")
        )
    for line in table(report):
        say(line)
    say(verdict(report))
    say(f"report: {report_path(settings)}")
    return report
