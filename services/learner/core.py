"""The learner's protocol core, free of I/O: inner steps, per-fragment uploads and adopting
global fragments. The learner service (``service.py``) drives it on the wall clock with a NATS
link; the quality benchmark's simulator drives it on a simulated clock.

Per fragment p (``shared/fragments.py``) the core keeps a base version, the steps, tokens and
loss since p's last upload, and the *anchor* pieces the unsent local progress is measured from.
An inner step's loss stays on the device until a boundary needs it (taking uploads, a
snapshot): reading it on the host waits for the step, which would stop JAX from dispatching the
next step while this one runs. Dispatch runs at most ``STEPS_IN_FLIGHT`` steps ahead of the
device, though: JAX would otherwise queue a whole sync period in no time, and the loop would
see new globals, pauses and stops only at the next upload.

* **Upload.** When p's step counter reaches its target (H; or H − offset(p) the first time after
  the fragments were staggered), Δ_p = anchor_p − θ_p goes out and anchor_p ← θ_p. Fragments
  start *aligned* (all due at the same step, so the P uploads are the whole model at once) unless
  the schedule staggers them from the start; :meth:`LearnerCore.stagger` spreads them over the
  period later (``stagger_rule.py`` decides when: when a whole-model upload holds the unit's
  link for too much of a period, a fragment that crosses it alone arrives sooner).
* **Adopt.** A newer global Θ_p is held until at least τ steps have passed since this unit's
  last upload of p (Streaming DiLoCo's overlap, arXiv 2501.18512), then mixed in with α (p's
  upload schedule does not move):
  θ_p ← θ_p + (1 − α)(Θ_p − anchor_p) and anchor_p ← anchor_p + (1 − α)(Θ_p − anchor_p).
  With α = 0 this keeps exactly the local progress not yet uploaded on top of the new global
  (θ_p − anchor_p is unchanged), so no local work is lost or uploaded twice; right after an
  upload (τ = 0) it is DiLoCo's "replace local by global". α = 1 ignores the global.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from services.learner.trainer import InnerState, InnerTrainer
from shared import pytree
from shared.codec.layout import Layout
from shared.fragments import FragmentPlan, plan_fragments, sync_offset

#: Inner steps dispatched but not finished, at most: the step running on the device and the
#: one queued behind it, so that the host prepares the next batch while the device computes.
STEPS_IN_FLIGHT = 2


@dataclass(frozen=True)
class SyncSchedule:
    """How a unit syncs: every H steps per fragment, overlap τ, mixing α, and whether the
    fragments are staggered from the start (built from the settings,
    ``shared.settings.algorithm.InnerAlgorithmSettings.sync_schedule``)."""

    h_steps: int
    fragments: int
    overlap_tau: int
    mix_alpha: float
    staggered: bool

    def __post_init__(self) -> None:
        if self.h_steps < 1 or self.fragments < 1 or self.overlap_tau < 0:
            raise ValueError("need h_steps >= 1, fragments >= 1 and overlap_tau >= 0")
        if not 0.0 <= self.mix_alpha <= 1.0:
            raise ValueError(f"mix_alpha must be in [0, 1], got {self.mix_alpha}")


@dataclass
class Upload:
    """One pseudo-gradient of one fragment, ready to encode and send."""

    fragment: int
    round: int
    base_version: int
    inner_steps: int
    tokens: int
    train_loss: float
    tensors: dict[str, np.ndarray]
    # The tensors are views of one float32 buffer (``values``), laid out as ``layout`` says,
    # so that the codec can encode it in one piece (codec.encode_flat).
    values: np.ndarray | None = None
    layout: Layout | None = None


@dataclass
class FragmentSync:
    """Where one fragment stands since its last upload (``loss_sum`` covers the steps whose
    losses were read: see :meth:`LearnerCore.read_losses`)."""

    base_version: int = 0
    steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    target: int = 1
    pending: tuple[int, dict[str, np.ndarray]] | None = None


#: Adoptions a unit remembers for its status record (the newest): the record crosses the
#: unit's link with every heartbeat, so it stays short.
ADOPTION_HISTORY = 10


@dataclass(frozen=True)
class Adoption:
    """A global version of a fragment the unit adopted: at which step, and the version it
    replaced (the versions between them were skipped)."""

    step: int
    fragment: int
    version: int
    previous: int


def dynamic_h(h_steps: int, own_rate: float | None, rates: Mapping[int, float]) -> int:
    """Dynamic Local Updates (arXiv 2401.09135, Eq. 6): H scaled by speed relative to the
    fastest unit, so that slower units upload after fewer steps, with fresher bases.

    Unknown speeds (no measurement yet) leave H unchanged.
    """
    known = [r for r in rates.values() if r and r > 0]
    if not own_rate or own_rate <= 0 or not known:
        return h_steps
    return max(1, min(h_steps, int(h_steps * own_rate / max(known))))


class LearnerCore:
    """State and sync decisions of one learner unit."""

    def __init__(
        self,
        trainer: InnerTrainer,
        params: Any,
        schedule: SyncSchedule,
        tokens_per_step: int,
        first_round: int = 0,
    ) -> None:
        self.trainer = trainer
        self.schedule = schedule
        self.tokens_per_step = tokens_per_step
        self.template = params
        self.state: InnerState = trainer.init(params)
        named = pytree.flatten_named(params)
        shapes = {k: tuple(v.shape) for k, v in named.items()}
        self.plan: FragmentPlan = plan_fragments(shapes, schedule.fragments)
        # Per fragment, how its pseudo-gradient's pieces sit in one flat buffer.
        self.layouts = [
            Layout(
                {
                    piece.key: shapes[piece.name][0 if piece.layer is None else 1 :]
                    for piece in fragment
                }
            )
            for fragment in self.plan.fragments
        ]
        self.syncs = [FragmentSync(target=schedule.h_steps) for _ in range(self.plan.count)]
        # Whether the fragments' uploads are spread over the period (never with one fragment).
        self.staggered = False
        if schedule.staggered:
            self.stagger(schedule.h_steps)
        self.round = first_round
        self.step = 0
        self.current_h = schedule.h_steps
        # The newest adoptions, oldest first.
        self.adoptions: collections.deque[Adoption] = collections.deque(maxlen=ADOPTION_HISTORY)
        # Losses of the steps since the last read, on the device, in step order.
        self._unread_losses: list[jax.Array] = []
        self._takers: dict[tuple[int, ...], tuple[Any, dict[str, dict[int, int]]]] = {}

    def stagger(self, h_steps: int) -> None:
        """Spread the fragments' next uploads evenly over the next ``h_steps`` steps: fragment p
        is due ``offset(p)`` steps early this once (``shared.fragments.sync_offset``), then every
        H. With one fragment nothing changes."""
        for p, sync in enumerate(self.syncs):
            sync.target = max(1, h_steps - sync_offset(p, self.plan.count, h_steps))
        self.staggered = self.plan.count > 1

    def base_versions(self) -> list[int]:
        """Global version of each fragment this unit last adopted."""
        return [sync.base_version for sync in self.syncs]

    def train_step(self, batch: Any) -> jax.Array:
        """One inner step, dispatched without waiting for it to finish (but first for the step
        ``STEPS_IN_FLIGHT`` back, so that at most that many are unfinished).

        Returns:
            The step's loss as a device scalar; reading it on the host waits for the step.
        """
        if len(self._unread_losses) >= STEPS_IN_FLIGHT:
            self._unread_losses[-STEPS_IN_FLIGHT].block_until_ready()
        self.state, loss = self.trainer.step(self.state, batch)
        self._unread_losses.append(loss)
        self.step += 1
        for sync in self.syncs:
            sync.steps += 1
            sync.tokens += self.tokens_per_step
        return loss

    def steps_in_flight(self) -> int:
        """Inner steps dispatched and not finished yet."""
        return sum(not loss.is_ready() for loss in self._unread_losses)

    def read_losses(self) -> None:
        """Add the losses of the steps since the last read to every fragment's ``loss_sum``,
        in step order (waits for those steps to finish). Taking uploads reads them first."""
        if not self._unread_losses:
            return
        values = [float(loss) for loss in jax.device_get(self._unread_losses)]
        self._unread_losses.clear()
        for sync in self.syncs:
            for value in values:
                sync.loss_sum += value

    def due_uploads(self, current_h: int | None = None) -> list[Upload]:
        """Uploads whose time has come.

        Args:
            current_h: the unit's H right now (DyLU: smaller for a slower unit); a fragment is
                due when its steps reach the smaller of its target and ``current_h``, and its
                next target becomes ``current_h``. None keeps the schedule's H.
        """
        h = self.current_h = current_h or self.schedule.h_steps
        due = [p for p, sync in enumerate(self.syncs) if sync.steps >= min(sync.target, h)]
        return self._take(due, h)

    def flush(self) -> list[Upload]:
        """Uploads of every fragment with unsent steps (at the end of training)."""
        return self._take([p for p, s in enumerate(self.syncs) if s.steps > 0], 1)

    def _take(self, fragments: list[int], next_h: int) -> list[Upload]:
        if not fragments:
            return []
        self.read_losses()
        # Δ = anchor − θ of the fragments' pieces, computed where the state lives and brought
        # to the host in one transfer; their anchor pieces become θ's on the devices.
        take, rows = self._taker(tuple(fragments))
        deltas, anchor = take(self.state.params, self.state.anchor)
        deltas = jax.device_get(deltas)
        self.state = InnerState(self.state.params, anchor, self.state.opt_state)
        uploads = []
        for p in fragments:
            sync = self.syncs[p]
            layout = self.layouts[p]
            values = np.empty(layout.size, np.float32)
            delta = layout.views(values)
            for piece in self.plan.fragments[p]:
                taken = deltas[piece.name]
                delta[piece.key][...] = (
                    taken if piece.layer is None else taken[rows[piece.name][piece.layer]]
                )
            uploads.append(
                Upload(
                    p,
                    self.round,
                    sync.base_version,
                    sync.steps,
                    sync.tokens,
                    sync.loss_sum / sync.steps,
                    delta,
                    values,
                    layout,
                )
            )
            self.round += 1
            sync.steps = sync.tokens = 0
            sync.loss_sum = 0.0
            sync.target = next_h
        return uploads

    def _taker(self, fragments: tuple[int, ...]) -> tuple[Any, dict[str, dict[int, int]]]:
        """The jitted program that takes ``fragments``' pseudo-gradients, (params, anchor) →
        ({tensor name: Δ}, the new anchor), and where each layer of a stacked tensor is in its
        Δ (the fragments' layers only, in order); one per set of fragments taken together (a
        handful: one fragment, or all)."""
        if fragments not in self._takers:
            whole: set[str] = set()
            layers: dict[str, list[int]] = {}
            for p in fragments:
                for piece in self.plan.fragments[p]:
                    if piece.layer is None:
                        whole.add(piece.name)
                    else:
                        layers.setdefault(piece.name, []).append(piece.layer)
            rows = {
                name: {layer: i for i, layer in enumerate(sorted(ls))}
                for name, ls in layers.items()
            }
            paths = [
                jax.tree_util.keystr(path)
                for path, _ in jax.tree_util.tree_flatten_with_path(self.template)[0]
            ]
            treedef = jax.tree_util.tree_structure(self.template)

            def take(params: Any, anchor: Any) -> tuple[dict[str, jax.Array], Any]:
                deltas, new_anchor = {}, []
                for name, local, base in zip(
                    paths, jax.tree.leaves(params), jax.tree.leaves(anchor), strict=True
                ):
                    if name in whole:
                        deltas[name] = base - local
                        new_anchor.append(local)
                    elif name in rows:
                        index = jnp.asarray(sorted(rows[name]))
                        deltas[name] = base[index] - local[index]
                        new_anchor.append(base.at[index].set(local[index]))
                    else:
                        new_anchor.append(base)
                return deltas, jax.tree_util.tree_unflatten(treedef, new_anchor)

            shardings = self.trainer.devices.shardings(self.template)
            self._takers[fragments] = (jax.jit(take, out_shardings=(None, shardings)), rows)
        return self._takers[fragments]

    def newest_version(self, fragment: int) -> int:
        """The newest version of ``fragment`` this unit has: held (offered, not yet adopted) or
        adopted."""
        sync = self.syncs[fragment]
        return sync.pending[0] if sync.pending else sync.base_version

    def offer_global(
        self,
        fragment: int,
        version: int,
        pieces: dict[str, np.ndarray],
        rewind: bool = False,
    ) -> bool:
        """Hold a newer global fragment until it may be adopted; False if it is not newer.

        Args:
            rewind: take it even if its version is not newer: the newest version published is
                lower than the one this unit holds, so what it holds is not the job's global
                (``ParamsFetcher``).

        Raises:
            ValueError: the pieces are not this fragment's (names, shapes) or not finite; the
                unit goes on with what it has.
        """
        sync = self.syncs[fragment]
        if version <= self.newest_version(fragment) and not rewind:
            return False
        layout = self.layouts[fragment]
        if sorted(pieces) != list(layout.names):
            raise ValueError(f"global fragment {fragment} pieces differ from this unit's plan")
        for name, shape in zip(layout.names, layout.shapes, strict=True):
            piece = pieces[name]
            if tuple(piece.shape) != tuple(shape):
                raise ValueError(
                    f"global fragment {fragment} piece {name}: shape {tuple(piece.shape)}, "
                    f"expected {tuple(shape)}"
                )
            if not np.isfinite(piece).all():
                raise ValueError(f"global fragment {fragment} piece {name} is not finite")
        sync.pending = (version, pieces)
        return True

    def ready_globals(self) -> list[tuple[int, int, dict[str, np.ndarray]]]:
        """The held global fragments whose overlap τ has passed, which :meth:`adopt_globals`
        mixes in now: ``(fragment, version, pieces)`` of each."""
        return [
            (p, s.pending[0], s.pending[1])
            for p, s in enumerate(self.syncs)
            if s.pending is not None and s.steps >= self.schedule.overlap_tau
        ]

    def adopt_globals(self) -> list[int]:
        """Mix in held global fragments whose overlap τ has passed; returns their indices."""
        ready = [p for p, _, _ in self.ready_globals()]
        if not ready:
            return []
        keep = 1.0 - self.schedule.mix_alpha
        params = pytree.flatten_named(self.state.params)
        anchor = pytree.flatten_named(self.state.anchor)
        for p in ready:
            sync = self.syncs[p]
            version, global_pieces = sync.pending  # type: ignore[misc]
            local = self.plan.extract(params, p)
            base = self.plan.extract(anchor, p)
            # New anchor first, then the unsent progress (local − old anchor) on top of it, so
            # that with α = 0 the anchor is exactly the global and, right after an upload, so
            # are the params (no floating-point residue).
            new_base = (
                {k: np.asarray(global_pieces[k], np.float32) for k in local}
                if keep == 1.0
                else {k: base[k] + keep * (global_pieces[k] - base[k]) for k in local}
            )
            self.plan.insert(params, p, {k: new_base[k] + (local[k] - base[k]) for k in local})
            self.plan.insert(anchor, p, new_base)
            self.adoptions.append(Adoption(self.step, p, version, sync.base_version))
            sync.base_version = version
            sync.pending = None
        # Back on the devices, in the unit's layout.
        shardings = self.trainer.devices.shardings(self.template)
        self.state = InnerState(
            jax.device_put(pytree.unflatten_named(self.template, params), shardings),
            jax.device_put(pytree.unflatten_named(self.template, anchor), shardings),
            self.state.opt_state,
        )
        return ready
