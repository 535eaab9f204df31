"""Failure injection for ``diloco up --chaos-mtbf-s``: a seeded schedule of failures and when
each one is repaired (pure: no processes, no clock of its own).

Each target (every learner unit, and the services named in ``--chaos-services``) fails after a
time drawn from an exponential distribution of mean MTBF (``--chaos-mtbf-s``), stays failed for
a time of mean MTTR (``--chaos-mttr-s``), then runs until its next failure. A unit's failure is
one of ``--chaos-kinds``, drawn uniformly:

* ``kill``: SIGKILL; ``diloco up`` starts it again once the repair time has passed;
* ``pause``: its desired state is ``paused`` until the repair, then ``running`` again;
* ``cut``: its shaped link closes every connection and refuses new ones until the repair
  (the link's own outage schedule: needs ``--link`` or ``--links``).

Services (``outer``, and ``nats-server`` or, with ``--nats-cluster N``, the nodes ``nats-0`` ...
``nats-<N-1>``) are only killed. Times count from the moment the learners
start (their links start then too), and the schedule is the same for the same seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.orchestration.local.records import ChaosEvent, ChaosKind


def nats_names(nodes: int) -> list[str]:
    """The child names of a run's nats-server nodes: ``nats-server`` alone, or ``nats-<i>``
    for each node of a cluster."""
    return ["nats-server"] if nodes == 1 else [f"nats-{index}" for index in range(nodes)]


def outer_names(shards: int) -> list[str]:
    """The child names of a run's outer: ``outer`` alone, or ``outer-<k>`` for each shard."""
    return ["outer"] if shards == 1 else [f"outer-{shard}" for shard in range(shards)]


def service_targets(nats_nodes: int, outer_shards: int = 1) -> list[str]:
    """The services ``--chaos-services`` may name: each outer shard and each nats-server
    node."""
    return [*outer_names(outer_shards), *nats_names(nats_nodes)]


def learner_target(unit: int) -> str:
    """The target name of a learner unit (its child's name)."""
    return f"learner-{unit}"


def unit_of_target(target: str) -> int | None:
    """The unit of a learner target, None for a service."""
    prefix = "learner-"
    return int(target[len(prefix) :]) if target.startswith(prefix) else None


def plan_chaos(
    units: int,
    services: Sequence[str],
    kinds: Sequence[ChaosKind],
    mtbf_s: float,
    mttr_s: float,
    horizon_s: float,
    seed: int,
) -> list[ChaosEvent]:
    """The failures of every target until ``horizon_s``, in time order.

    Args:
        units: learner units (targets ``learner-0`` ...).
        services: services that fail too (killed only).
        kinds: what a unit's failure may be.
        mtbf_s: mean seconds between the end of one failure of a target and the next.
        mttr_s: mean seconds a failure lasts.
        horizon_s: no failure starts after this.
        seed: seeds every draw; each target has its own stream.
    """
    if mtbf_s <= 0 or mttr_s <= 0:
        raise ValueError(f"MTBF and MTTR must be above zero, got {mtbf_s} and {mttr_s}")
    events = []
    targets = [learner_target(u) for u in range(units)] + list(services)
    for target in targets:
        rng = random.Random(f"{seed}/{target}")
        choices: Sequence[ChaosKind] = kinds if unit_of_target(target) is not None else ("kill",)
        at = rng.expovariate(1 / mtbf_s)
        while at < horizon_s:
            repair = rng.expovariate(1 / mttr_s)
            events.append(
                ChaosEvent(at_s=at, target=target, kind=rng.choice(choices), repair_s=repair)
            )
            at += repair + rng.expovariate(1 / mtbf_s)
    return sorted(events, key=lambda e: (e.at_s, e.target))


def link_outages(events: Sequence[ChaosEvent], unit: int) -> str:
    """The ``cut`` failures of ``unit`` as its link's outage schedule (``--outages``)."""
    target = learner_target(unit)
    return ",".join(
        f"{e.at_s:.3f}s+{e.repair_s:.3f}s:cut"
        for e in events
        if e.target == target and e.kind == "cut"
    )


class ChaosClock:
    """Which failures start, and which pauses end, as time goes on."""

    def __init__(self, events: Sequence[ChaosEvent]) -> None:
        self._pending = list(events)
        self._paused: list[ChaosEvent] = []

    def starting(self, elapsed_s: float) -> list[ChaosEvent]:
        """Failures whose time has come (each returned once)."""
        due = [e for e in self._pending if e.at_s <= elapsed_s]
        self._pending = [e for e in self._pending if e.at_s > elapsed_s]
        self._paused += [e for e in due if e.kind == "pause"]
        return due

    def pauses_ending(self, elapsed_s: float) -> list[ChaosEvent]:
        """Pauses whose repair time has come (each returned once)."""
        due = [e for e in self._paused if e.at_s + e.repair_s <= elapsed_s]
        self._paused = [e for e in self._paused if e.at_s + e.repair_s > elapsed_s]
        return due
