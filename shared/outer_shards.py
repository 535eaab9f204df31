"""The job's outer status from its shards' records.

An outer runs as M shards (``diloco outer --shard k --shards M``), each owning the fragments
p with p mod M = k and writing its own :class:`~shared.records.outer.OuterStatus` under
``J.outer.<k>``. Every reader (the gateway, ``diloco up``, the learners, the load test) sees the
job through :func:`combine_shards`: one record as one outer applying every upload would have
written. With one shard it is that shard's record, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared import kv, subjects
from shared.fragments import shard_of_fragment
from shared.ledger import RoundSet
from shared.records import Stamped
from shared.records.outer import DownlinkCounts, OuterState, OuterStatus, UnitLedger

MERGE_HISTORY = 120  # merges the combined record shows, the newest of every shard's

#: A combined state is the first of these any shard is in (a missing shard: ``starting``).
_STATE_ORDER: tuple[OuterState, ...] = (
    "deposed",
    "stopped",
    "starting",
    "restoring",
    "standby",
    "running",
)


def combine_shards(shards: Sequence[OuterStatus]) -> OuterStatus:
    """One record for the job from its shards' (any order; shard 0's must be there).

    Counts and books add up (each upload is applied or rejected by exactly one shard), round
    sets unite, each fragment's version is its owner's; the evaluations, epoch and restore
    are shard 0's (it evaluates the whole model). A shard that has not reported makes the
    state ``starting``, and its fragments read version 0.

    Raises:
        ValueError: no record of shard 0 among ``shards``.
    """
    by_shard = {record.shard: record for record in shards}
    first = by_shard.get(0)
    if first is None:
        raise ValueError("the outer's status needs shard 0's record")
    if first.shards == 1:
        return first
    count = first.shards
    present = [by_shard[k] for k in range(count) if k in by_shard]
    states = {record.state for record in present} | (
        {"starting"} if len(present) < count else set()
    )
    state = next(s for s in _STATE_ORDER if s in states)
    versions = [
        _version(by_shard.get(shard_of_fragment(p, count)), p) for p in range(len(first.versions))
    ]
    merges = sorted(
        (merge for record in present for merge in record.merge_history), key=lambda m: m.at
    )
    downlinks = [record.downlink for record in present if record.downlink is not None]
    units = sorted({unit for record in present for unit in record.units})
    counted = {u for r in present for u in (*r.units, *r.applied_rounds, *r.rejected_rounds)}
    applied_rounds = {u: _union(r.applied_rounds.get(u, []) for r in present) for u in counted}
    rejected_rounds = {u: _union(r.rejected_rounds.get(u, []) for r in present) for u in counted}
    return OuterStatus.model_validate(
        first.model_dump()
        | dict(
            state=state,
            applied=sum(r.applied for r in present),
            merges=sum(r.merges for r in present),
            deduplicated=sum(r.deduplicated for r in present),
            tokens_applied=sum(r.tokens_applied for r in present),
            clipped=sum(r.clipped for r in present),
            rejected=_add(r.rejected for r in present),
            staleness=_add(r.staleness for r in present),
            codecs=_add(r.codecs for r in present),
            payload_bytes=sum(r.payload_bytes for r in present),
            units={
                u: _unit(
                    [r.units[u] for r in present if u in r.units],
                    applied_rounds[u],
                    rejected_rounds[u],
                )
                for u in units
            },
            applied_rounds={u: rounds for u, rounds in sorted(applied_rounds.items()) if rounds},
            rejected_rounds={u: rounds for u, rounds in sorted(rejected_rounds.items()) if rounds},
            version=sum(versions),
            versions=versions,
            buffered=sum(r.buffered for r in present),
            checkpoints=sum(r.checkpoints for r in present),
            downlink=DownlinkCounts(
                delta=sum(d.delta for d in downlinks),
                keyframe=sum(d.keyframe for d in downlinks),
                current=sum(d.current for d in downlinks),
                delta_bytes=sum(d.delta_bytes for d in downlinks),
            )
            if downlinks
            else None,
            merge_history=merges[-MERGE_HISTORY:],
        )
    )


def combine_stamped(shards: Sequence[Stamped[OuterStatus]]) -> Stamped[OuterStatus] | None:
    """:func:`combine_shards` of stamped records: as old as its oldest shard's (None without
    shard 0's)."""
    if not any(entry.record.shard == 0 for entry in shards):
        return None
    oldest = max(shards, key=lambda entry: entry.age_s)
    record = combine_shards([entry.record for entry in shards])
    return Stamped(record, oldest.age_s, oldest.stamp, max(e.revision for e in shards))


async def read_outer_status(status_kv: Any, job: str) -> OuterStatus | None:
    """The job's outer status from the status bucket ``status_kv``: shard 0's record, which
    names the number of shards, combined with the others' (None: shard 0 never reported,
    or its record is malformed).

    Raises:
        nats.errors.Error, TimeoutError: the bucket cannot be read.
    """
    first = await kv.get(status_kv, subjects.outer_status_key(job, 0), OuterStatus)
    if first is None or first.shards == 1:
        return first
    records = [first]
    for shard in range(1, first.shards):
        record = await kv.get(status_kv, subjects.outer_status_key(job, shard), OuterStatus)
        if record is not None and record.shard == shard:
            records.append(record)
    return combine_shards(records)


def _version(owner: OuterStatus | None, fragment: int) -> int:
    """A fragment's version as its owning shard reports it (0 before the shard reported)."""
    return owner.versions[fragment] if owner is not None and fragment < len(owner.versions) else 0


def _union(ranges: Any) -> list[tuple[int, int]]:
    rounds = RoundSet()
    for pairs in ranges:
        for first, last in pairs:
            rounds.add_range(first, last)
    return [(first, last) for first, last in rounds.ranges()]


def _add(counts: Any) -> dict[Any, int]:
    total: dict[Any, int] = {}
    for mapping in counts:
        for key, value in mapping.items():
            total[key] = total.get(key, 0) + value
    return total


def _unit(
    ledgers: list[UnitLedger],
    applied: list[tuple[int, int]],
    rejected: list[tuple[int, int]],
) -> UnitLedger:
    """One unit's books across shards. Its skipped rounds are the round numbers below its
    newest that no shard applied or rejected (a shard alone sees the other shards' rounds as
    skipped)."""
    newest = max(ledgers, key=lambda ledger: ledger.last_round)
    seen = RoundSet(applied)
    for first, last in rejected:
        seen.add_range(first, last)
    return UnitLedger(
        applied=sum(ledger.applied for ledger in ledgers),
        rejected=_add(ledger.rejected for ledger in ledgers),
        clipped=sum(ledger.clipped for ledger in ledgers),
        skipped_rounds=max(0, newest.last_round + 1 - len(seen)),
        last_round=newest.last_round,
        last_staleness=newest.last_staleness,
        tokens=sum(ledger.tokens for ledger in ledgers),
        last_train_loss=newest.last_train_loss,
    )
