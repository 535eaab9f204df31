"""A learner unit of several processes (hosts): process 0 decides, the others follow.

A unit may span the devices of several processes (``--num-processes``, ``--process-id``,
``--coordinator``; ``jax.distributed``), as a pod slice or a multi-node GPU island does. Every
computation on the unit's state is then one program that all of its processes run together, in
the same order: the inner step, taking pseudo-gradients, adopting a global. Only process 0
speaks for the unit on NATS (uploads, status, desired state, the params it fetches); the others
never connect to it. Before each inner step process 0 tells the others, through the unit's own
collective (``broadcast_one_to_all``), what the step is (:class:`StepPlan`): train, wait
(paused) or end; the H the uploads are due at; whether to stagger the fragments; and the global
fragments to adopt, with their values. A follower applies the same plan to its own
:class:`~services.learner.core.LearnerCore`, so the two stay in step and every collective
program is entered by all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.experimental import multihost_utils

from services.learner.core import LearnerCore
from shared import pytree
from shared.data import BatchSampler
from shared.downlink import params_checksum

log = logging.getLogger(__name__)

TRAIN, WAIT, END = 0, 1, 2

#: Global fragments adopted in one step, at most (a unit has at most this many fragments).
MAX_ADOPTED = 64
# The plan's header: action, H, stagger H, the number adopted, then per adopted fragment its
# index and version.
_FIXED = 4
_HEADER = _FIXED + 2 * MAX_ADOPTED


@dataclass
class StepPlan:
    """What every process of a unit does next.

    Attributes:
        action: ``TRAIN`` (an inner step, then the uploads due), ``WAIT`` (paused) or ``END``.
        h_steps: the H the uploads are due at after this step.
        stagger_h: spread the fragments over this many steps first (0: no change).
        adopted: ``(fragment, version, pieces)`` of each global fragment to adopt before the
            step.
    """

    action: int
    h_steps: int = 1
    stagger_h: int = 0
    adopted: list[tuple[int, int, dict[str, np.ndarray]]] = field(default_factory=list)


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the unit's processes (``jax.distributed``); CPU devices talk through Gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    log.info(
        "process %d of %d of the unit (coordinator %s): %d of the unit's %d devices here",
        process_id,
        num_processes,
        coordinator,
        jax.local_device_count(),
        jax.device_count(),
    )


class UnitCollective:
    """The unit's processes agreeing on each step (process 0 leads)."""

    def __init__(self, core: LearnerCore) -> None:
        self.core = core
        self.leads = jax.process_index() == 0

    def share(self, plan: StepPlan | None) -> StepPlan:
        """Process 0: send ``plan`` to the others and return it. Another process: ``None`` in,
        process 0's plan out."""
        header = np.zeros(_HEADER, np.int64)
        if self.leads:
            assert plan is not None
            if len(plan.adopted) > MAX_ADOPTED:
                raise ValueError(
                    f"{len(plan.adopted)} fragments adopted at once: {MAX_ADOPTED} at most"
                )
            header[:_FIXED] = (plan.action, plan.h_steps, plan.stagger_h, len(plan.adopted))
            for i, (fragment, version, _) in enumerate(plan.adopted):
                header[_FIXED + 2 * i : _FIXED + 2 * i + 2] = (fragment, version)
        header = np.asarray(multihost_utils.broadcast_one_to_all(header))
        action, h_steps, stagger_h, count = (int(x) for x in header[:_FIXED])
        adopted = []
        for i in range(count):
            fragment, version = (int(x) for x in header[_FIXED + 2 * i : _FIXED + 2 * i + 2])
            if self.leads:
                assert plan is not None
                pieces = plan.adopted[i][2]
            else:  # zeros of the pieces' shapes, to receive into
                layout = self.core.layouts[fragment]
                pieces = {
                    name: np.zeros(shape, np.float32)
                    for name, shape in zip(layout.names, layout.shapes, strict=True)
                }
            received = multihost_utils.broadcast_one_to_all(pieces)
            adopted.append((fragment, version, {k: np.asarray(v) for k, v in received.items()}))
        return StepPlan(action, h_steps, stagger_h, adopted)

    def share_start(self) -> None:
        """Every process starts from process 0's state: the params, anchor and optimizer state
        it restored (or built), and where each fragment stands."""
        core = self.core
        counts = np.array(
            [core.step, core.round, core.staggered]
            + [x for s in core.syncs for x in (s.steps, s.target, s.base_version)],
            np.int64,
        )
        counts = np.asarray(multihost_utils.broadcast_one_to_all(counts))
        state = multihost_utils.broadcast_one_to_all(jax.device_get(core.state))
        core.state = core.trainer.place(state)
        core.step, core.round, core.staggered = int(counts[0]), int(counts[1]), bool(counts[2])
        for p, sync in enumerate(core.syncs):
            sync.steps, sync.target, sync.base_version = (
                int(x) for x in counts[3 + 3 * p : 6 + 3 * p]
            )


def follow(core: LearnerCore, sampler: BatchSampler, collective: UnitCollective) -> int:
    """A follower's loop: apply process 0's plans until it ends, then take the last uploads
    with it (their values stay with process 0). Returns the global fragments adopted."""
    adopted = 0
    while True:
        plan = collective.share(None)
        if plan.stagger_h:  # as process 0 did after the last step
            core.stagger(plan.stagger_h)
        for fragment, version, pieces in plan.adopted:
            core.offer_global(fragment, version, pieces, rewind=True)
        if plan.adopted:
            adopted += len(core.adopt_globals())
        if plan.action == END:
            core.flush()
            return adopted
        if plan.action == TRAIN:
            core.train_step(sampler.batch(core.step))
            core.due_uploads(plan.h_steps)


def state_checksum(core: LearnerCore) -> int:
    """XXH3-64 of the unit's local params: every process of a unit that stayed in step ends
    with the same."""
    return params_checksum(pytree.flatten_named(core.state.params))
