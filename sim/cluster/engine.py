"""The cluster simulation: units step through time, fail, upload over their links; the outer
applies uploads (decoupled) or merges rounds (sync). Pure Python, deterministic.

A unit trains step by step. A ``pause`` that starts during a step delays it; a ``kill`` sends
the unit back to its newest checkpoint (taken at every sync point and, with
``checkpoint_every_s``, within a period), keeps it from computing for the repair and its restart
time, and drops the uploads its link had not finished sending. A ``cut`` stops the unit's link:
a transfer waits for the link to come back.

Decoupled: a unit never waits; its uploads queue on its link; the outer applies them one at a
time (``merge_s`` each). Sync: after an upload the unit waits for the round's global (published
``merge_s`` after the merge, then downloaded over its link); the outer merges once every active
unit's fresh upload (based on the current version) is in, or ``sync_timeout_s`` after the
round's first one, and a late unit's stale upload rides along with the next round, like
``services/outer/policy.py``'s quorum policy under ``--mode sync``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass

from services.outer.policy import ACTIVE_INTERVALS, UploadIntervals
from sim.cluster.model import Cluster, Failure, Outcome


class _UnitRun:
    """One unit's progress through simulated time."""

    def __init__(self, index: int, cluster: Cluster, failures: list[Failure]) -> None:
        self.index = index
        self.cluster = cluster
        self.unit = cluster.units[index]
        self.compute_failures = deque(
            sorted((f for f in failures if f.kind != "cut"), key=lambda f: f.at_s)
        )
        self.cuts = sorted((f.at_s, f.at_s + f.down_s) for f in failures if f.kind == "cut")
        self.kills = sorted(f.at_s for f in failures if f.kind == "kill")
        self.step = 0
        self.since_sync = 0
        self.ckpt_step = 0
        self.ckpt_since = 0
        self.ckpt_t = 0.0
        self.down_s = 0.0
        self.lost_steps = 0
        self.dropped = 0
        self.down_until = 0.0  # the end of the newest outage
        self.up_free = 0.0
        self.down_free = 0.0
        self.finished_at: float | None = None

    # ---- compute ---------------------------------------------------------------------------

    def _fail(self, failure: Failure, at: float) -> float:
        """Apply a compute failure that starts at ``at``; returns when the unit trains again.
        One that starts while the unit is down already is part of that outage (a restart or a
        reconfiguration in progress takes it in)."""
        if failure.at_s < self.down_until:
            return max(at, self.down_until)
        back = self._outage(failure, at)
        self.down_until = back
        return back

    def _outage(self, failure: Failure, at: float) -> float:
        if failure.kind == "pause":
            self.down_s += failure.down_s
            return at + failure.down_s
        self.lost_steps += self.step - self.ckpt_step
        self.step, self.since_sync = self.ckpt_step, self.ckpt_since
        back = at + failure.down_s + self.unit.restart_s
        self.down_s += back - at
        self.ckpt_t = back  # a new process starts its checkpoint clock afresh
        return back

    def train_until(self, t: float, target_step: int, horizon: float) -> float:
        """Train from ``t`` until the unit's step count is ``target_step`` (or the horizon);
        returns the time."""
        every = self.cluster.method.checkpoint_every_s
        while self.step < target_step:
            end = t + self.unit.step_s
            if self.compute_failures and self.compute_failures[0].at_s < end:
                failure = self.compute_failures.popleft()
                t = self._fail(failure, max(t, failure.at_s))
                continue
            if end > horizon:
                return horizon
            t = end
            self.step += 1
            self.since_sync += 1
            if every > 0 and t - self.ckpt_t >= every:
                self.ckpt_step, self.ckpt_since, self.ckpt_t = self.step, self.since_sync, t
        return t

    def synced(self, t: float) -> int:
        """A sync point at ``t``: the period's steps become an upload; returns their count."""
        steps, self.since_sync = self.since_sync, 0
        self.ckpt_step, self.ckpt_since, self.ckpt_t = self.step, 0, t
        return steps

    def idle_until(self, t_from: float, ready: float) -> float:
        """The unit idles from ``t_from`` until ``ready``; failures meanwhile can delay it."""
        while self.compute_failures and self.compute_failures[0].at_s < ready:
            failure = self.compute_failures.popleft()
            at = max(t_from, failure.at_s)
            ready = max(ready, self._fail(failure, at))
        return ready

    # ---- the link --------------------------------------------------------------------------

    def _through_cuts(self, start: float, busy_s: float) -> float:
        """When ``busy_s`` seconds of sending that start at ``start`` end, around the cuts."""
        t, remaining = start, busy_s
        for c0, c1 in self.cuts:
            if c1 <= t:
                continue
            if c0 <= t:
                t = c1
            elif c0 < t + remaining:
                remaining -= c0 - t
                t = c1
            else:
                break
        return t + remaining

    def send_up(self, ready: float, nbytes: float) -> tuple[float, bool]:
        """An upload handed to the link at ``ready``: when it arrives, and whether a kill of the
        unit dropped it first."""
        link = self.cluster.link
        start = max(ready, self.up_free)
        done = self._through_cuts(start, link.transfer_s(nbytes) - link.latency_s)
        self.up_free = done
        arrival = done + link.latency_s
        dropped = any(ready <= k < done for k in self.kills)
        return arrival, dropped

    def receive(self, published: float, nbytes: float) -> float:
        """When a global published at ``published`` has reached the unit."""
        link = self.cluster.link
        start = max(published + link.latency_s, self.down_free)
        done = self._through_cuts(start, link.transfer_s(nbytes) - link.latency_s)
        self.down_free = done
        return done


def _budget(cluster: Cluster) -> tuple[int, float]:
    steps = cluster.steps if cluster.steps is not None else math.inf
    horizon = cluster.horizon_s if cluster.horizon_s is not None else math.inf
    if steps == math.inf and horizon == math.inf:
        raise ValueError("a cluster needs steps or a horizon")
    return steps, horizon  # type: ignore[return-value]


def simulate(cluster: Cluster) -> Outcome:
    """Run ``cluster`` and measure its goodput (see :class:`Outcome`)."""
    by_unit: dict[int, list[Failure]] = {u: [] for u in range(len(cluster.units))}
    for failure in cluster.failures:
        if failure.unit in by_unit:
            by_unit[failure.unit].append(failure)
    runs = [_UnitRun(u, cluster, by_unit[u]) for u in range(len(cluster.units))]
    if cluster.method.mode == "decoupled":
        applied, merges = _decoupled(cluster, runs)
    else:
        applied, merges = _sync(cluster, runs)
    return _outcome(cluster, runs, applied, merges)


def _decoupled(cluster: Cluster, runs: list[_UnitRun]) -> tuple[list[int], list[float]]:
    steps, horizon = _budget(cluster)
    method = cluster.method
    arrivals: list[tuple[float, int, int]] = []
    for run in runs:
        t = 0.0
        while run.step < steps and t < horizon:
            target = min(steps, run.step - run.since_sync + method.h_steps)
            t = run.train_until(t, target, horizon)
            if run.step < target:
                break  # the horizon
            tokens = run.synced(t) * run.unit.tokens_per_step
            arrival, dropped = run.send_up(t, method.upload_bytes)
            run.finished_at = arrival  # a unit ends once its last upload is accepted
            if dropped:
                run.dropped += 1
            else:
                arrivals.append((arrival, run.index, tokens))
        if math.isfinite(horizon) or run.finished_at is None:
            run.finished_at = horizon if math.isfinite(horizon) else t
    applied = [0] * len(runs)
    merges = []
    outer_free = 0.0
    for arrival, unit, tokens in sorted(arrivals):
        done = max(arrival, outer_free) + method.merge_s
        outer_free = done
        if done <= horizon:
            applied[unit] += tokens
            merges.append(done)
    return applied, merges


@dataclass
class _Upload:
    """One upload of a sync run: its unit, tokens, the version it is based on, when it was
    handed to the link, and whether its unit has gone on from it."""

    unit: int
    tokens: int
    base: int
    handoff: float
    released: bool = False
    arrived: float = 0.0


def _sync(cluster: Cluster, runs: list[_UnitRun]) -> tuple[list[int], list[float]]:
    steps, horizon = _budget(cluster)
    method = cluster.method
    applied = [0] * len(runs)
    merges: list[float] = []
    heap: list[tuple[float, int, _Upload]] = []
    order = itertools.count()
    waiting: dict[int, _Upload] = {}  # each unit's newest upload it has not gone on from
    received = [(0, 0.0)] * len(runs)  # each unit's newest global: (version, when it arrived)

    def start_round(run: _UnitRun, t: float, base: int) -> None:
        """Train the unit's next period from ``t`` on version ``base`` and queue its upload."""
        while True:
            if run.step >= steps or t >= horizon:
                run.finished_at = min(t, horizon)
                return
            target = min(steps, run.step - run.since_sync + method.h_steps)
            t = run.train_until(t, target, horizon)
            if run.step < target:
                run.finished_at = horizon
                return
            upload = _Upload(run.index, run.synced(t) * run.unit.tokens_per_step, base, t)
            arrival, dropped = run.send_up(t, method.upload_bytes)
            if not dropped:
                waiting[run.index] = upload
                heapq.heappush(heap, (arrival, next(order), upload))
                return
            # Killed before the upload left: the restarted unit goes on from its checkpoint.
            run.dropped += 1
            t = run.idle_until(t, t)

    def go_on(upload: _Upload, got: float) -> None:
        """The unit of ``upload`` has the round's global (arrived at ``got``): it goes on."""
        upload.released = True
        del waiting[upload.unit]
        run = runs[upload.unit]
        start = run.idle_until(upload.handoff, max(upload.handoff, got))
        if run.step >= steps:
            run.finished_at = start
        else:
            start_round(run, start, received[upload.unit][0])

    for run in runs:
        start_round(run, 0.0, 0)
    buffer: list[_Upload] = []
    fresh: set[int] = set()
    quorum_at: float | None = None
    uploads = UploadIntervals()
    outer_free = 0.0
    clock = 0.0  # the time of the newest arrival the outer has seen
    version = 0

    def deadline() -> float | None:
        if quorum_at is None:
            # Stale uploads alone wait for a round until no unit is active any more.
            if not buffer:
                return None
            interval = uploads.median() or 0.0
            wait = ACTIVE_INTERVALS * max(method.sync_timeout_s, interval)
            return buffer[0].arrived + wait
        active = uploads.active(quorum_at, expected_units=len(runs))
        return quorum_at if active <= fresh else quorum_at + method.sync_timeout_s

    while heap or buffer:
        due = deadline()
        if buffer and due is not None and (not heap or due <= heap[0][0]):
            published = max(due, clock, outer_free) + method.merge_s
            outer_free = published
            if published > horizon:
                break
            merges.append(published)
            version += 1
            for upload in buffer:
                applied[upload.unit] += upload.tokens
            buffer, fresh, quorum_at = [], set(), None
            # Every unit receives the global. One waiting at its sync point goes on from it; one
            # still computing holds it until its sync point (--mode sync adopts only there).
            for run in runs:
                if run.finished_at is not None:
                    continue
                got = run.receive(published, method.params_bytes)
                received[run.index] = (version, got)
                upload = waiting.get(run.index)
                if upload is not None and upload.handoff <= got:
                    go_on(upload, got)
            continue
        arrival, _, upload = heapq.heappop(heap)
        if arrival > horizon:
            break
        clock = arrival
        unit = upload.unit
        uploads.seen(unit, arrival)
        upload.arrived = arrival
        buffer.append(upload)
        if upload.base == version:
            fresh.add(unit)
            if quorum_at is None:
                quorum_at = arrival
        newest, got = received[unit]
        if not upload.released and newest > upload.base:
            go_on(upload, got)  # dropped from the round: it goes on from the round's global
    for run in runs:
        if run.finished_at is None:
            run.finished_at = horizon if math.isfinite(horizon) else outer_free
    return applied, merges


def _outcome(
    cluster: Cluster, runs: list[_UnitRun], applied: list[int], merges: list[float]
) -> Outcome:
    windows = [run.finished_at or 0.0 for run in runs]
    possible = [run.unit.tokens_per_s * w for run, w in zip(runs, windows, strict=True)]
    unit_goodput = [a / p if p else 0.0 for a, p in zip(applied, possible, strict=True)]
    unit_up = [
        max(0.0, 1 - run.down_s / w) if w else 0.0 for run, w in zip(runs, windows, strict=True)
    ]
    total = sum(possible)
    return Outcome(
        goodput=sum(applied) / total if total else 0.0,
        up=sum(u * p for u, p in zip(unit_up, possible, strict=True)) / total if total else 0.0,
        unit_goodput=unit_goodput,
        unit_up=unit_up,
        windows_s=windows,
        applied_tokens=sum(applied),
        versions=len(merges),
        end_s=max(windows, default=0.0),
        lost_steps=sum(run.lost_steps for run in runs),
        dropped_uploads=sum(run.dropped for run in runs),
        merges=merges,
    )
