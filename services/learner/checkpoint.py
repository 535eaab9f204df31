"""Checkpoints of a learner unit's inner state, written off the training thread.

A checkpoint (``<checkpoint_dir>/<job>/unit-<u>/checkpoint.npz``, replaced atomically) holds
everything a restarted unit needs to continue as if it had not stopped:

* ``meta`` (a JSON string, ``shared.records.LearnerCheckpointMeta``): identity (job, unit,
  model, fragments), step, round counter, current H, each fragment's sync state (base version,
  steps, tokens, loss sum, target), the unit's ``tokens_total``, the names of the stored
  tensors and the time of the snapshot;
* ``params_<i>`` and ``anchor_<i>``: θ_local and the anchor, tensor i of ``meta.param_names``;
* ``opt_<i>``: leaf i of the inner optimizer state (``jax.tree_util`` order); restored with the
  tree structure of a freshly initialised state, after checking every shape and dtype;
* ``residual_<i>``: the codec's error-feedback residual of piece ``meta.residual_names[i]``
  (only with ``--error-feedback``).

The training thread takes a :class:`Snapshot` right after it took uploads (so anchor and
uploads agree) and, within a sync period, every ``--checkpoint-every-s`` (the fragments'
partial steps, tokens and loss sums are part of it). A snapshot only keeps references: JAX
arrays are immutable, and the link hands out a private copy of its residual.
:class:`CheckpointWriter` converts and writes snapshots on its own thread; while one write is
in progress only the newest pending snapshot is kept (latest wins).

The residual stored is the link's as of its last finished encoding: uploads still queued at
snapshot time are not in it (it may be an upload or so behind), and after a crash the restored
residual may repeat some quantisation error that was already sent. Both are bounded by the
quantisation error of a few uploads. Likewise, steps taken after the newest checkpoint written
are trained again after a crash (the data position is the step, so on the same batches).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from services.learner.core import FragmentSync, LearnerCore
from services.learner.records import FragmentSyncRecord, LearnerCheckpointMeta, UnitIdentity
from services.learner.trainer import InnerState
from shared import pytree, records
from shared.atomic import atomic_write
from shared.unit_counters import CounterName

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.npz"


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit this unit's model, optimizer or fragments."""


@dataclass(frozen=True)
class Snapshot:
    """References to a unit's state at one moment (cheap to take; converted when written)."""

    step: int
    round: int
    current_h: int
    syncs: tuple[FragmentSync, ...]  # copies, without the global fragments held for adoption
    staggered: bool
    state: InnerState
    tokens_total: int
    residual: Mapping[str, np.ndarray] | None
    taken_at: float


@dataclass
class Restored:
    """What :func:`load_checkpoint` put back into the core, and what the caller restores."""

    step: int
    round: int
    tokens_total: int
    residual: dict[str, np.ndarray] | None
    written_at: float


def take_snapshot(
    core: LearnerCore, tokens_total: int, residual: Mapping[str, np.ndarray] | None = None
) -> Snapshot:
    """Snapshot ``core`` (references only; waits for the device only for losses not read yet,
    which right after taking uploads there are none of).

    Args:
        core: the unit's core, right after it took uploads or between two steps.
        tokens_total: tokens the unit has trained on so far.
        residual: the link's error-feedback residual copy (:meth:`LearnerLink.residual_copy`).
    """
    core.read_losses()
    syncs = tuple(dataclasses.replace(sync, pending=None) for sync in core.syncs)
    return Snapshot(
        core.step,
        core.round,
        core.current_h,
        syncs,
        core.staggered,
        core.state,
        tokens_total,
        residual,
        time.time(),
    )


def save_checkpoint(path: Path, snapshot: Snapshot, identity: UnitIdentity) -> None:
    """Write ``snapshot`` to ``path`` atomically (slow: converts device arrays to numpy).

    Args:
        path: the ``checkpoint.npz`` file.
        snapshot: what to write.
        identity: the unit's job, unit, model and fragments (recorded, for humans and checks).

    Raises:
        OSError: when the file cannot be written (the previous checkpoint is then kept).
        pydantic.ValidationError: when the snapshot does not fit the meta record (a loss sum
            that is NaN or infinite).
    """
    params = pytree.flatten_named(snapshot.state.params)
    anchor = pytree.flatten_named(snapshot.state.anchor)
    names = list(params)
    opt_leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(snapshot.state.opt_state)]
    residual = dict(snapshot.residual or {})
    meta = LearnerCheckpointMeta(
        identity=identity,
        step=snapshot.step,
        round=snapshot.round,
        current_h=snapshot.current_h,
        syncs=[
            FragmentSyncRecord(
                base_version=s.base_version,
                steps=s.steps,
                tokens=s.tokens,
                loss_sum=s.loss_sum,
                target=s.target,
            )
            for s in snapshot.syncs
        ],
        staggered=snapshot.staggered,
        tokens_total=snapshot.tokens_total,
        param_names=names,
        opt_leaves=len(opt_leaves),
        residual_names=list(residual),
        taken_at=snapshot.taken_at,
    )
    arrays: dict[str, np.ndarray] = {"meta": np.array(records.encode(meta).decode())}
    for i, name in enumerate(names):
        arrays[f"params_{i}"] = params[name]
        arrays[f"anchor_{i}"] = anchor[name]
    for i, leaf in enumerate(opt_leaves):
        arrays[f"opt_{i}"] = leaf
    for i, value in enumerate(residual.values()):
        arrays[f"residual_{i}"] = np.asarray(value, np.float32)
    atomic_write(path, lambda handle: np.savez(handle, **arrays))


def load_checkpoint(path: Path, core: LearnerCore, on_devices: bool = True) -> Restored | None:
    """Restore ``core`` (step, round, syncs, params, anchor, optimizer state) from ``path``.

    With ``on_devices`` False the restored state stays in host arrays, for the caller to place:
    a unit of several processes sends it to the others first, and all place it together
    (``collective.UnitCollective.share_start``).

    A missing checkpoint returns None; one that cannot be read or does not match the core's
    model, optimizer or fragments is ignored with a logged warning (None; the core is then
    untouched). A ``meta`` entry that does not fit its record is counted in
    ``shared.records.rejections``.
    """
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            meta = records.decode(LearnerCheckpointMeta, str(stored["meta"]), str(path))
            if meta is None:
                raise CheckpointMismatchError("its meta entry is not a learner checkpoint's")
            if len(meta.syncs) != len(core.syncs):
                raise CheckpointMismatchError(
                    f"checkpoint has {len(meta.syncs)} fragments, this unit {len(core.syncs)}"
                )
            state, residual = _read_arrays(stored, meta, core)
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        log.warning("ignoring checkpoint %s: %s", path, err)
        return None
    core.read_losses()  # losses of steps before the restore are not part of the restored sums
    core.state = core.trainer.place(state) if on_devices else state
    core.step, core.round, core.current_h = meta.step, meta.round, meta.current_h
    for sync, stored_sync in zip(core.syncs, meta.syncs, strict=True):
        sync.base_version, sync.steps = stored_sync.base_version, stored_sync.steps
        sync.tokens, sync.loss_sum = stored_sync.tokens, stored_sync.loss_sum
        sync.target, sync.pending = stored_sync.target, None
    core.staggered = meta.staggered
    log.info(
        "restored checkpoint %s: step %d, round %d, base versions %s",
        path,
        meta.step,
        meta.round,
        core.base_versions(),
    )
    return Restored(meta.step, meta.round, meta.tokens_total, residual, meta.taken_at)


def _read_arrays(
    stored: Any, meta: LearnerCheckpointMeta, core: LearnerCore
) -> tuple[InnerState, dict[str, np.ndarray] | None]:
    """The inner state (host arrays) and residual of a checkpoint, checked against ``core``'s
    fresh state."""
    names = meta.param_names
    params = {name: stored[f"params_{i}"] for i, name in enumerate(names)}
    anchor = {name: stored[f"anchor_{i}"] for i, name in enumerate(names)}
    # unflatten_named checks names and shapes against the model (PytreeMismatchError).
    params_tree = pytree.unflatten_named(core.template, params)
    anchor_tree = pytree.unflatten_named(core.template, anchor)
    fresh, treedef = jax.tree_util.tree_flatten(core.state.opt_state)
    if meta.opt_leaves != len(fresh):
        raise CheckpointMismatchError(
            f"optimizer state has {meta.opt_leaves} leaves, expected {len(fresh)}"
        )
    opt_leaves = []
    for i, leaf in enumerate(fresh):
        value = stored[f"opt_{i}"]
        if value.shape != np.shape(leaf) or value.dtype != leaf.dtype:
            raise CheckpointMismatchError(
                f"optimizer leaf {i}: expected {np.shape(leaf)} {leaf.dtype}, "
                f"got {value.shape} {value.dtype}"
            )
        opt_leaves.append(value)
    residual = None
    if meta.residual_names:
        residual = {name: stored[f"residual_{i}"] for i, name in enumerate(meta.residual_names)}
        expected = _piece_shapes(core)
        wrong = [n for n, v in residual.items() if expected.get(n) != v.shape]
        if wrong:
            log.warning("ignoring the checkpoint's error-feedback residual (pieces %s)", wrong[:3])
            residual = None
    state = InnerState(params_tree, anchor_tree, jax.tree_util.tree_unflatten(treedef, opt_leaves))
    return state, residual


def _piece_shapes(core: LearnerCore) -> dict[str, tuple[int, ...]]:
    """Shape of every piece the unit uploads (the names its residuals are keyed by)."""
    shapes = {name: tuple(np.shape(leaf)) for name, leaf in _named_leaves(core.template)}
    out = {}
    for fragment in core.plan.fragments:
        for piece in fragment:
            shape = shapes[piece.name]
            out[piece.key] = shape if piece.layer is None else shape[1:]
    return out


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


class CheckpointWriter:
    """Writes snapshots on a background thread; the newest pending snapshot wins.

    :meth:`submit` never blocks on a write in progress. Counters (also reported through
    ``on_count``): ``checkpoints_written``, ``checkpoint_errors`` and ``checkpoints_superseded``
    (snapshots replaced by a newer one before they were written).
    """

    def __init__(
        self,
        path: Path,
        identity: UnitIdentity,
        on_count: Callable[[CounterName], None] | None = None,
        save: Callable[[Path, Snapshot, UnitIdentity], None] = save_checkpoint,
    ) -> None:
        """Args:
        path: the ``checkpoint.npz`` file.
        identity: recorded in every checkpoint (job, unit, model, fragments).
        on_count: called with a counter's name each time it is incremented.
        save: the function that writes one snapshot (``save_checkpoint``; tests replace it).
        """
        self.path = path
        self.identity = identity
        self.counters: collections.Counter[CounterName] = collections.Counter()
        self.last_written_step: int | None = None
        self._on_count = on_count
        self._save = save
        self._cond = threading.Condition()
        self._pending: Snapshot | None = None
        self._busy = False
        self._closed = False
        self._write_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Queue ``snapshot`` for writing, replacing any snapshot still waiting; returns at once."""
        with self._cond:
            if self._closed:
                return
            if self._pending is not None:
                self._count("checkpoints_superseded")
            self._pending = snapshot
            self._cond.notify_all()

    def write(self, snapshot: Snapshot) -> bool:
        """Write ``snapshot`` now, on the calling thread; False if the write failed."""
        with self._write_lock:
            try:
                self._save(self.path, snapshot, self.identity)
            except Exception as err:  # a failed checkpoint must never stop training
                self._count("checkpoint_errors")
                log.error("checkpoint at step %d failed: %r", snapshot.step, err)
                return False
            self.last_written_step = snapshot.step
            self._count("checkpoints_written")
            return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is pending or being written; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, final: Snapshot | None = None, timeout_s: float = 60.0) -> None:
        """Stop the thread, then write ``final`` synchronously (it supersedes what is pending).

        Without ``final``, a pending snapshot is still written before the thread ends.
        """
        with self._cond:
            if final is not None and self._pending is not None:
                self._pending = None
                self._count("checkpoints_superseded")
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        if final is not None:
            self.write(final)

    def _count(self, name: CounterName) -> None:
        with self._count_lock:
            self.counters[name] += 1
        if self._on_count is not None:
            self._on_count(name)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                snapshot, self._pending = self._pending, None
                if snapshot is None:
                    return
                self._busy = True
            try:
                self.write(snapshot)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
