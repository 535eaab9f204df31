"""Judging a load-test stage and showing the stages as a table (pure functions, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from services.loadtest.records import LoadtestReport, LoadtestStage


@dataclass(frozen=True)
class StageNumbers:
    """What a stage is judged on.

    Attributes:
        units: synthetic units.
        offered: uploads per second the units are due to make.
        ingest: uploads per second the outer applied.
        backlog_start, backlog_end: uploads published and not yet applied, at the start and the
            end of the window.
        dropped: uploads the units dropped from full queues (their link could not keep up).
    """

    units: int
    offered: float
    ingest: float
    backlog_start: int
    backlog_end: int
    dropped: int


def judge(numbers: StageNumbers, share: float) -> tuple[bool, str]:
    """Whether a stage is saturated, and why.

    It is when the outer applied less than ``share`` of the offered uploads, or its backlog
    grew by more than one upload per unit over the window (it falls behind), or units dropped
    uploads because their links could not carry them.
    """
    if numbers.ingest < share * numbers.offered:
        return True, (
            f"the outer applied {numbers.ingest:.2f} of {numbers.offered:.2f} offered uploads/s"
        )
    growth = numbers.backlog_end - numbers.backlog_start
    if growth > numbers.units:
        return True, f"the backlog grew by {growth} uploads over the window"
    if numbers.dropped:
        return True, f"units dropped {numbers.dropped} uploads from full queues"
    return False, ""


def saturation_units(stages: list[LoadtestStage]) -> int | None:
    """Units of the first saturated stage (None when no stage is)."""
    return next((stage.units for stage in stages if stage.saturated), None)


TABLE_HEADER = (
    "| units | offered uploads/s | applied uploads/s | applied MB/s | uploads per merge / commit "
    "| sync latency p50 / p95 / p99 s | backlog start → end | params fetched MB/s "
    "| CPU cores: outer / nats-server / generator | drain s | books | saturated |"
)


def table(report: LoadtestReport) -> list[str]:
    """The stages as Markdown table lines."""
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for s in report.stages:
        latency = s.sync_latency
        sync = (
            f"{latency.p50_s:.2f} / {latency.p95_s:.2f} / {latency.p99_s:.2f}"
            if latency is not None
            else "-"
        )
        books = "balanced" if s.books.balanced else "NOT balanced"
        saturated = f"yes: {s.reason}" if s.saturated else "no"
        lines.append(
            f"| {s.units} | {s.offered_uploads_per_s:.2f} | {s.ingest_uploads_per_s:.2f} "
            f"| {s.ingest_mb_per_s:.1f} | {s.uploads_per_merge:.1f} / {s.uploads_per_commit:.1f} "
            f"| {sync} "
            f"| {s.backlog_start} → {s.backlog_end} | {s.params_mb_per_s:.1f} "
            f"| {s.outer_cpu:.2f} / {s.broker_cpu:.2f} / {s.generator_cpu:.2f} "
            f"| {s.drain_s:.1f} | {books} "
            f"| {saturated} |"
        )
    return lines


def verdict(report: LoadtestReport) -> str:
    """One line: where the outer saturates."""
    units = report.saturation_units
    counts = [stage.units for stage in report.stages]
    if units is None:
        return f"saturation point: not reached up to {max(counts, default=0)} units"
    stage = next(s for s in report.stages if s.units == units)
    below = [c for c in counts if c < units]
    fine = f" ({max(below)} units kept up)" if below else ""
    return f"saturation point: {units} units{fine}: {stage.reason}"
