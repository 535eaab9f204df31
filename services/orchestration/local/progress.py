"""What ``diloco up`` tells the user about a run: the live progress line, the training
throughput, and the summary at the end, all from the status records."""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping, Sequence
from typing import Any

from services.orchestration.local.records import RunSummary
from shared.bandwidth import link_usage
from shared.records.link import LinkStatus
from shared.records.outer import EvaluationRecord, LedgerRecord, MergePoint, OuterStatus
from shared.records.unit import LatencySummary, UnitStatus

SMALL_HISTOGRAM = 6  # a staleness histogram with at most this many values is shown whole


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def progress_line(
    elapsed_s: float, outer: OuterStatus | None, units: Mapping[int, UnitStatus]
) -> str:
    """One line of live progress: global version, eval loss, per-unit step/loss/tokens/s."""
    last = outer.evaluation.last if outer is not None else None
    parts = [
        f"[{elapsed_s:6.1f}s] v{outer.version if outer is not None else '-'}",
        f"eval {_fmt(last.nats_per_byte if last else None, '.3f')} nats/B",
    ]
    for unit in sorted(units):
        status = units[unit]
        parts.append(
            f"u{unit} {status.state[:4]} {status.step}"
            f" loss {_fmt(status.train_loss, '.2f')}"
            f" {_fmt(status.tokens_per_s, '.0f')} tok/s"
        )
    return " | ".join(parts)


class Throughput:
    """Training throughput of all units together, from the first inner step seen to the last
    token counted, so that start-up (imports, JIT compilation) and shutdown do not dilute it."""

    def __init__(self) -> None:
        self._first_at: float | None = None
        self._tokens_at_first = 0
        self._tokens = 0
        self._changed_at = 0.0

    def observe(self, units: Mapping[int, UnitStatus], now: float | None = None) -> None:
        """Count the tokens that fresh status records report."""
        now = time.monotonic() if now is None else now
        tokens = sum(status.tokens for status in units.values())
        if tokens > self._tokens:
            if self._first_at is None:
                self._first_at, self._tokens_at_first = now, tokens
            self._tokens, self._changed_at = tokens, now

    def tokens_per_s(self) -> float | None:
        """Tokens per second so far (None until tokens were counted twice)."""
        if self._first_at is None or self._changed_at <= self._first_at:
            return None
        return (self._tokens - self._tokens_at_first) / (self._changed_at - self._first_at)


def staleness_summary(histogram: Mapping[int, int]) -> str:
    """A staleness histogram in one short phrase: the whole of it when it has few values,
    else its median, 90th percentile and maximum."""
    counts = sorted(histogram.items())
    if len(counts) <= SMALL_HISTOGRAM:
        return str({str(k): v for k, v in counts})
    total, running, marks = sum(v for _, v in counts), 0, {}
    for value, count in counts:
        running += count
        for name, share in (("median", 0.5), ("p90", 0.9)):
            if name not in marks and running >= share * total:
                marks[name] = value
    return f"median {marks['median']}, p90 {marks['p90']}, max {counts[-1][0]}"


def norm_lines(merges: Sequence[MergePoint]) -> list[str]:
    """The sizes of the outer's steps over its newest merges: of the change each made to the
    params and of the momentum it left (a momentum that keeps growing is a diverging run)."""
    if not merges:
        return []
    update = [m.update_norm for m in merges]
    momentum = [m.momentum_norm for m in merges]
    return [
        f"outer step norms    update max {max(update):.3g} (last {update[-1]:.3g}), momentum "
        f"max {max(momentum):.3g} (last {momentum[-1]:.3g}) over the last {len(merges)} merges"
    ]


def summary_lines(summary: RunSummary) -> list[str]:
    """The end-of-run summary: initial vs final held-out loss, versions, tokens, the ledger,
    restarts and each unit's last state."""
    outer = summary.outer
    version = outer.version if outer is not None else "-"
    ledger: LedgerRecord = outer if outer is not None else LedgerRecord()
    evaluation = outer.evaluation if outer is not None else EvaluationRecord()
    init, final = evaluation.init, evaluation.last
    books = summary.ledger
    lines = [
        f"run {summary.reason} after {summary.elapsed_s:.0f}s",
        f"global version      {version}  ({ledger.applied} pseudo-gradients applied,"
        f" rejected {ledger.rejected})",
        f"outer merges        {ledger.merges}  (staleness of applied updates: "
        f"{staleness_summary(ledger.staleness)})",
        f"tokens applied      {ledger.tokens_applied:,}",
        *norm_lines(outer.merge_history if outer is not None else []),
        f"training throughput {_fmt(summary.tokens_per_s, ',.0f')} tokens/s (all units)",
        f"held-out eval loss  {_fmt(init.nats_per_byte if init else None, '.4f')} -> "
        f"{_fmt(final.nats_per_byte if final else None, '.4f')} nats/byte "
        f"({_fmt(final.bits_per_byte if final else None, '.4f')} bits/byte) at version "
        f"{final.version if final else None}",
        f"ledger              {'balanced' if books.balanced else 'NOT balanced'}: "
        f"{books.published} rounds published, {books.applied} applied once, "
        f"{books.rejected} rejected"
        + (
            f", {books.unrecorded} published without the unit's record of it (killed after "
            "the broker's ack)"
            if books.unrecorded
            else ""
        )
        + ("" if books.balanced else f"; {'; '.join(books.problems[:3])}"),
    ]
    if summary.restarts:
        lines.append(
            "restarts            "
            + ", ".join(f"{name} {n}" for name, n in summary.restarts.items())
        )
    goodput = summary.goodput
    if goodput is not None and goodput.job is not None:
        units = ", ".join(f"unit {u} {g:.2f}" for u, g in sorted(goodput.units.items()))
        up = f"up {goodput.job_up:.2f}; " if goodput.job_up is not None else ""
        lines.append(f"goodput             {goodput.job:.2f}  ({up}{units})")
    if summary.chaos:
        kinds = collections.Counter(event.kind for event in summary.chaos)
        shown = ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))
        lines.append(f"chaos               {len(summary.chaos)} failures injected ({shown})")
    for unit, status in sorted(summary.units.items()):
        lines.append(
            f"unit {unit}: {status.state} at step {status.step},"
            f" {status.counter('published')} uploads"
            f"{', fragments staggered' if status.staggered else ''}, train loss {status.train_loss}"
        )
        latencies = (status.upload_latency, status.sync_latency, status.params_latency)
        if any(latency is not None for latency in latencies) or status.sync_wait_s:
            lines.append("  " + latency_line(status))
        link = summary.links.get(str(unit))
        if link is not None:
            lines.append("  " + link_line(link, status))
    outer_link = summary.links.get("outer")
    if outer_link is not None:
        lines.append("outer " + link_line(outer_link, None))
    return lines


def latency_line(status: UnitStatus) -> str:
    """A unit's upload, sync and params latencies, the time its training loop spent in calls
    to the NATS link, and (``--mode sync``) waiting at sync points."""

    def shown(name: str, latency: LatencySummary | None) -> str:
        if latency is None:
            return f"{name} -"
        return f"{name} p50 {latency.p50_s:.2f} s, p95 {latency.p95_s:.2f} s"

    waited = f", waiting at sync points {status.sync_wait_s:.1f} s" if status.sync_wait_s else ""
    return (
        f"{shown('upload', status.upload_latency)}; {shown('sync', status.sync_latency)}; "
        f"{shown('params', status.params_latency)};"
        f" training loop in network calls {status.network_wait_s:.3f} s{waited}"
    )


def link_line(link: LinkStatus, unit: UnitStatus | None) -> str:
    """What crossed a shaped link: bytes each way, per token of its unit (against
    data-parallel training), and how busy it was."""
    parts = [
        f"link {link.spec.text()}: {_megabytes(link.bytes_up)} up,"
        f" {_megabytes(link.bytes_down)} down"
    ]
    usage = link_usage(link, unit)
    if usage.bytes_per_token is not None:
        saving = usage.times_less
        against = "" if saving is None else f" ({saving:,.0f}x less than data-parallel)"
        parts.append(f"{usage.bytes_per_token:,.1f} B/token{against}")
    busy = link.utilisation()
    if busy is not None:
        parts.append(f"busy {busy[0]:.1%} up, {busy[1]:.1%} down")
    if link.outages:
        parts.append(f"{link.outages} outage(s)")
    return ", ".join(parts)


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.2f} MB"
