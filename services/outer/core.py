"""The outer optimizer's protocol core, free of I/O: per-fragment global params, buffering,
merging and outer steps. The NATS service (``service.py``) and the quality benchmark's
simulator (``sim/training.py``) both drive this class, one on the wall clock and one on
a simulated clock, so what the benchmark measures is what the service does.

For each fragment p it keeps the global pieces Θ_p, the outer optimizer state and a version
v_p that counts outer steps. An arrival for p computed against base version b has staleness
s = v_p − b. At merge time each buffered arrival gets a staleness weight s(·) and a token
weight w (``merge.token_weight``); they are combined (weighted or radial-directional average),
optionally scaled by the share of units that took part, and applied with the outer optimizer:
v_p += 1. Under the ``each`` policy every arrival is a merge and an outer step of its own; when
several wait, up to ``EACH_BATCH`` of them are applied in turn by one program (v_p += each).
Before an arrival is buffered, the norm guard (``norm_guard.py``) rejects or clips one
whose norm is far above what the fragment's merges have seen, and peer review (``peers.py``)
judges its pace, direction and size against the other units' latest uploads; one without
enough peers yet is held (not merged) until :meth:`OuterCore.settle` can judge it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from services.outer import merge
from services.outer.errors import Rejected
from services.outer.norm_guard import InnerBound, NormGuard, update_norm
from services.outer.optimizer import (
    OuterStep,
    make_outer_optimizer,
    make_outer_step,
    make_outer_steps,
)
from services.outer.peers import MIN_PEERS, PeerReview
from services.outer.policy import Arrival, MergePolicy
from services.outer.staleness import StalenessRule
from shared.fragments import FragmentPlan, plan_fragments

#: Most waiting arrivals the ``each`` policy applies in one program (a power of two: a
#: backlog runs programs of 4, 2 and 1 arrivals, each compiled once).
EACH_BATCH = 4


@dataclass(frozen=True)
class OuterAlgorithm:
    """Every choice the outer makes; see docs/ALGORITHMS.md for each one's source. Built from
    the settings (``shared.settings.algorithm.OuterAlgorithmSettings.algorithm``), which hold
    the defaults."""

    optimizer: str
    lr: float
    momentum: float
    dn_period: int
    policy: str
    min_quorum: int
    grace_factor: float
    grace_min_s: float
    grace_max_s: float
    combine: str
    token_weighting: str
    staleness: StalenessRule
    num_units: int
    participation_scale: bool
    fragments: int
    sync_rounds: bool  # synchronous DiLoCo's rounds (MergePolicy.sync_rounds)
    norm_guard: str  # reject, clip or off (norm_guard.py)
    norm_guard_factor: float
    momentum_max_age: float  # momentum periods after which an arrival brings no momentum
    inner: InnerBound | None  # the learners' inner optimizer: the norm guard's prior bound
    peer_review: bool  # judge each upload by the other units' latest (peers.py)
    peer_hold_s: float  # most seconds an upload waits for peers before it is merged

    def __post_init__(self) -> None:
        # Fail at start-up, not at the first merge: build everything once to validate.
        make_outer_optimizer(self.optimizer, self.lr, self.momentum, self.dn_period)
        MergePolicy(
            self.policy, self.min_quorum, self.grace_factor, self.grace_min_s, self.grace_max_s
        )
        if self.combine not in merge.COMBINES:
            raise ValueError(f"combine must be one of {merge.COMBINES}, got {self.combine!r}")
        if self.token_weighting not in merge.TOKEN_WEIGHTINGS:
            raise ValueError(
                f"token weighting must be one of {merge.TOKEN_WEIGHTINGS}, "
                f"got {self.token_weighting!r}"
            )
        if self.num_units < 1 or self.fragments < 1:
            raise ValueError("num_units and fragments must be >= 1")
        NormGuard(self.fragments, self.norm_guard, self.norm_guard_factor)  # checks both


@dataclass
class MergeResult:
    """One merge: which fragment, its new version, what went into it, and the L2 norms of the
    change it made to the fragment's params and of the momentum it leaves. A merge is one outer
    step, or under ``each`` the ``steps`` steps of a backlog run together, one per arrival
    (``version`` is then the last step's, ``update_norm`` the norm of their change together).
    ``share`` is the fragment's share of the model's parameters: an upload of it carries that
    share of the training its tokens stand for (the books count its tokens × share)."""

    fragment: int
    version: int
    arrivals: list[Arrival]
    staleness: list[int]
    update_norm: float
    momentum_norm: float
    share: float = 1.0
    steps: int = 1


@dataclass
class _UnitSum:
    """One unit's arrivals in a merge: their pseudo-gradients with staleness weights, tokens
    and inner steps."""

    parts: list[tuple[Any, float]] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0

    def summed(self) -> tuple[Any, float]:
        """The unit's update and the scale still to apply to it: a lone arrival unscaled with
        its weight (the merge scales it), several as their weighted sum with scale 1."""
        if len(self.parts) == 1:
            return self.parts[0]
        total = None
        for update, weight in self.parts:
            scaled = jax.tree_util.tree_map(lambda x, c=weight: x * c, update)
            total = scaled if total is None else jax.tree_util.tree_map(jnp.add, total, scaled)
        return total, 1.0


@dataclass
class _Held:
    """An arrival peer review has not decided on: waiting for peers (``doubt`` None), or
    doubted (``doubt``: its direction disagreed with its peers') until those in ``seen``
    (unit: uploads counted then) send newer ones; either until ``deadline``."""

    arrival: Arrival
    sketch: np.ndarray
    deadline: float
    doubt: Rejected | None = None
    seen: dict[int, int] | None = None
    start: int = 0  # the inner step its steps began at (PeerReview.start)


# One compiled program per fragment's structure: op by op, the norm compiled a program per leaf
# and operation at every start of the outer (0.5 of its 0.6 CPU-s building its state, tiny model).
_tree_norm = jax.jit(optax.tree.norm)


@dataclass
class _Fragment:
    params: dict[str, jax.Array]
    opt_state: Any
    version: int
    policy: MergePolicy
    params_norm: float  # the norm guard's prior bound reads it (set by each outer step)

    @classmethod
    def of(cls, params: dict[str, jax.Array], opt_state: Any, version: int, policy: MergePolicy):
        """A fragment continuing from ``params`` (their norm computed once here)."""
        return cls(params, opt_state, version, policy, float(_tree_norm(params)))


class OuterCore:
    """Global params and outer state of one job, fragment by fragment."""

    def __init__(self, named_params: Mapping[str, np.ndarray], algorithm: OuterAlgorithm) -> None:
        self.algorithm = algorithm
        self.plan: FragmentPlan = plan_fragments(
            {name: array.shape for name, array in named_params.items()}, algorithm.fragments
        )
        self._names = {name: np.asarray(array).shape for name, array in named_params.items()}
        self.optimizer = make_outer_optimizer(
            algorithm.optimizer, algorithm.lr, algorithm.momentum, algorithm.dn_period
        )
        self._step = make_outer_step(self.optimizer)
        self._steps = make_outer_steps(self.optimizer)
        self.guard = NormGuard(
            self.plan.count,
            algorithm.norm_guard,
            algorithm.norm_guard_factor,
            inner=algorithm.inner,
            sizes=self.plan.sizes(),
        )
        init_opt_state = jax.jit(self.optimizer.init)  # one program, not one per leaf and op
        sizes = self.plan.sizes()
        # A job of fewer than MIN_PEERS + 1 units has no majority to judge an upload by.
        reviewed = algorithm.peer_review and algorithm.num_units > MIN_PEERS
        inner = algorithm.inner
        self.peers = (
            PeerReview(
                sizes,
                algorithm.num_units,
                warmup_steps=inner.warmup_steps if inner is not None else 0,
                horizons=inner.horizons if inner is not None else (),
            )
            if reviewed
            else None
        )
        # Per fragment, the arrivals peer review has not decided on yet (settle).
        self._held: list[list[_Held]] = [[] for _ in sizes]
        self._shares = [size / sum(sizes) for size in sizes]
        self.fragments: list[_Fragment] = []
        for index in range(self.plan.count):
            pieces = {k: jnp.asarray(v) for k, v in self.plan.extract(named_params, index).items()}
            self.fragments.append(
                _Fragment.of(pieces, init_opt_state(pieces), 0, self._new_policy())
            )

    def warm_up(self) -> threading.Thread | None:
        """Compile the outer step of every fragment now (state unchanged), so that the first
        merge is as fast as the others and no backlog builds up behind a compilation. Under
        ``each``, the programs of a backlog (2 .. ``EACH_BATCH`` arrivals at once; seconds each
        at ``medium``) compile meanwhile on a thread of its own, returned (None under ``quorum``);
        it is not a daemon: a process that exits mid-compilation waits for it (XLA aborts the
        process when the interpreter shuts down under a compiling thread)."""
        zeros_like = jax.jit(lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree))
        backlogs = []
        for fragment in self.fragments:
            zeros = zeros_like(fragment.params)
            # The arguments of a merge's call (a default left out compiles another program).
            if fragment.policy.kind == "each":
                jax.block_until_ready(self._each_steps(fragment, (zeros,)))
                backlogs.append((fragment, zeros))
            else:
                step = self._step(fragment.params, fragment.opt_state, zeros, 1.0, 1, 1.0)
                jax.block_until_ready(step)
        if not backlogs:
            return None

        def compile_backlogs() -> None:
            for count in (1 << i for i in range(1, EACH_BATCH.bit_length())):
                for fragment, zeros in backlogs:
                    jax.block_until_ready(self._each_steps(fragment, (zeros,) * count))

        thread = threading.Thread(target=compile_backlogs, name="outer-step-warm-up")
        thread.start()
        return thread

    def _each_steps(self, fragment: _Fragment, pseudo_grads: tuple[Any, ...]) -> Any:
        """The steps of a warm-up: ``pseudo_grads`` applied to ``fragment`` as arrivals of
        the current version, the result dropped."""
        count = len(pseudo_grads)
        return self._steps(
            fragment.params,
            fragment.opt_state,
            pseudo_grads,
            (1.0,) * count,
            (1,) * count,
            (1.0,) * count,
        )

    def _new_policy(self) -> MergePolicy:
        a = self.algorithm
        return MergePolicy(
            a.policy,
            a.min_quorum,
            a.grace_factor,
            a.grace_min_s,
            a.grace_max_s,
            expected_units=a.num_units if a.sync_rounds else 0,
            sync_rounds=a.sync_rounds,
        )

    # ---- state -------------------------------------------------------------------------------

    def version(self, fragment: int) -> int:
        """Outer steps applied to ``fragment`` so far."""
        return self.fragments[fragment].version

    @property
    def total_version(self) -> int:
        """Outer steps over all fragments (the job's global version for P = 1)."""
        return sum(f.version for f in self.fragments)

    def fragment_params(self, fragment: int) -> dict[str, np.ndarray]:
        """The global pieces of one fragment as numpy arrays."""
        return {
            k: np.asarray(v) for k, v in jax.device_get(self.fragments[fragment].params).items()
        }

    def full_params(self) -> dict[str, np.ndarray]:
        """All global params as ``{tensor name: array}``."""
        named = {name: np.zeros(shape, np.float32) for name, shape in self._names.items()}
        for index in range(self.plan.count):
            self.plan.insert(named, index, self.fragment_params(index))
        return named

    def restore(self, fragment: int, version: int, pieces: Mapping[str, np.ndarray]) -> None:
        """Continue a fragment from published params (momentum starts from zero)."""
        expected = self.plan.keys(fragment)
        if sorted(pieces) != expected:
            raise ValueError(f"fragment {fragment} pieces differ from the plan")
        params = {k: jnp.asarray(pieces[k]) for k in expected}
        self.fragments[fragment] = _Fragment.of(
            params, self.optimizer.init(params), version, self._new_policy()
        )

    def export_state(
        self, owned: Collection[int] | None = None
    ) -> tuple[list[int], list[dict[str, np.ndarray]], list[list[np.ndarray]]]:
        """Versions, params and outer-optimizer state leaves of every fragment, as numpy; of a
        fragment not ``owned`` (another outer shard's), its version only (empty params and
        leaves). ``owned`` None: every fragment.

        With :meth:`import_state` this round-trips the core's owned fragments bit for bit
        (merge buffers aside: the service keeps buffered uploads unacknowledged in JetStream
        instead).
        """
        mine = range(self.plan.count) if owned is None else owned
        versions = [f.version for f in self.fragments]
        params = [self.fragment_params(i) if i in mine else {} for i in range(self.plan.count)]
        leaves = [
            [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(jax.device_get(f.opt_state))]
            if i in mine
            else []
            for i, f in enumerate(self.fragments)
        ]
        return versions, params, leaves

    def import_state(
        self,
        versions: list[int],
        params: list[Mapping[str, np.ndarray]],
        opt_leaves: list[list[np.ndarray]],
        owned: Collection[int] | None = None,
    ) -> None:
        """Continue the ``owned`` fragments (None: every one) from :meth:`export_state` output
        (buffers are emptied); the others stay as they are.

        Raises:
            ValueError: the state does not fit this job's fragments, pieces or optimizer.
        """
        if not len(versions) == len(params) == len(opt_leaves) == self.plan.count:
            raise ValueError(f"state has {len(versions)} fragments, the job {self.plan.count}")
        fragments = list(self.fragments)
        for index in range(self.plan.count) if owned is None else sorted(owned):
            expected = self.plan.keys(index)
            if sorted(params[index]) != expected:
                raise ValueError(f"fragment {index} pieces differ from the plan")
            current = self.fragments[index].params
            pieces = {}
            for name in expected:
                array = np.asarray(params[index][name])
                if array.shape != current[name].shape or array.dtype != current[name].dtype:
                    raise ValueError(f"fragment {index} piece {name}: shape or dtype differs")
                pieces[name] = jnp.asarray(array)
            template = self.optimizer.init(pieces)
            template_leaves, treedef = jax.tree_util.tree_flatten(template)
            leaves = opt_leaves[index]
            if len(leaves) != len(template_leaves) or any(
                np.shape(a) != np.shape(b) or np.asarray(a).dtype != np.asarray(b).dtype
                for a, b in zip(leaves, template_leaves, strict=True)
            ):
                raise ValueError(f"fragment {index}: outer optimizer state does not fit")
            opt_state = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in leaves])
            fragments[index] = _Fragment.of(
                pieces, opt_state, int(versions[index]), self._new_policy()
            )
        self.fragments = fragments

    # ---- arrivals and merges -----------------------------------------------------------------

    def _freshness(self, staleness: list[int]) -> float:
        """How much of a merge the outer momentum may build on (``delayed_nesterov``): per
        arrival clip(L − s/N, 0, 1), its age s/N counted in momentum periods (N arrivals) and
        L = ``momentum_max_age``; the mean over the merge's arrivals."""
        a = self.algorithm
        limit, period = a.momentum_max_age, max(1, a.dn_period)
        return float(np.mean([min(1.0, max(0.0, limit - s / period)) for s in staleness]))

    def offer(self, fragment: int, arrival: Arrival) -> None:
        """Buffer a validated arrival for ``fragment``, or hold it until it has peers.

        Raises:
            Rejected: ``future_base_version``, ``too_stale``, ``norm_outlier`` (the norm guard),
                ``too_frequent`` or ``direction_outlier`` (peer review) or ``wrong_fragment``.
        """
        if not 0 <= fragment < self.plan.count:
            raise Rejected("wrong_fragment", f"fragment {fragment} of {self.plan.count}")
        state = self.fragments[fragment]
        staleness = state.version - arrival.base_version
        if staleness < 0:
            raise Rejected(
                "future_base_version",
                f"base_version {arrival.base_version} > current {state.version}",
            )
        if not self.algorithm.staleness.accepts(staleness):
            raise Rejected(
                "too_stale", f"staleness {staleness} > max {self.algorithm.staleness.max_staleness}"
            )
        norm = arrival.norm if arrival.norm is not None else update_norm(arrival.pseudo_grad)
        steps = max(1, arrival.inner_steps)
        arrival = _scaled(
            dataclasses.replace(arrival, norm=norm),
            self.guard.judge(fragment, norm, steps, state.params_norm),
        )
        peers = self.peers
        if peers is not None:
            sketch = peers.sketch(fragment, arrival.pseudo_grad)
            if not peers.recorded(fragment, arrival.unit, arrival.upload):
                peers.check_pace(fragment, arrival.unit, state.version)
                peers.record(
                    fragment,
                    arrival.unit,
                    arrival.upload,
                    sketch,
                    arrival.norm,
                    steps,
                    state.version,
                )
            deadline = arrival.arrived_at + self.algorithm.peer_hold_s
            start = peers.start(fragment, arrival.unit)
            try:
                review = peers.judge(
                    fragment, arrival.unit, sketch, arrival.norm, steps, state.version, start=start
                )
            except Rejected as why:
                if why.reason != "direction_outlier" or self._doubted(fragment, arrival.unit):
                    peers.refuse(fragment, arrival.unit, arrival.upload)
                    raise
                # A second opinion from the peers' next uploads (one doubted upload per unit).
                doubted = _Held(arrival, sketch, deadline, why, peers.counts(fragment), start)
                self._held[fragment].append(doubted)
                return
            if review.held or self._waiting(fragment):
                # Behind earlier arrivals that wait for peers, so that the policy takes them
                # all in the order they came (``settle`` judges it again).
                self._held[fragment].append(_Held(arrival, sketch, deadline, start=start))
                return
            arrival = _scaled(arrival, review.scale)
        state.policy.add(arrival, fresh=staleness == 0)

    def settle(self, now: float) -> list[tuple[Arrival, Rejected]]:
        """Judge the held arrivals that have (newer) peers now; returns those rejected (with
        why), which the caller dead-letters.

        An arrival held for want of peers (at the job's start) is merged unjudged once it has
        waited ``peer_hold_s``, or at once when the start is over without them
        (:meth:`PeerReview.quorate`). One whose direction disagreed with its peers' is
        doubted: it is judged again against the uploads its peers send next (an honest unit's
        update can reverse its peers' older ones where the params moved past a minimum; a
        hostile one keeps disagreeing), and rejected if they still disagree, or if none come
        within ``peer_hold_s``, or once too few other units may still send one (they have
        trained to the end: a run's last doubted uploads do not hold its end ``peer_hold_s``).
        """
        rejected: list[tuple[Arrival, Rejected]] = []
        peers = self.peers
        for fragment, held in enumerate(self._held):
            state, waiting = self.fragments[fragment], []
            for entry in held:
                arrival = entry.arrival
                assert peers is not None and arrival.norm is not None
                steps = max(1, arrival.inner_steps)
                try:
                    review = peers.judge(
                        fragment,
                        arrival.unit,
                        entry.sketch,
                        arrival.norm,
                        steps,
                        state.version,
                        newer_than=entry.seen,
                        start=entry.start,
                    )
                except Rejected as why:
                    if entry.doubt is None and why.reason == "direction_outlier":
                        deadline = now + self.algorithm.peer_hold_s
                        counts = peers.counts(fragment)
                        waiting.append(
                            _Held(arrival, entry.sketch, deadline, why, counts, entry.start)
                        )
                    else:
                        rejected.append((arrival, why))
                        peers.refuse(fragment, arrival.unit, arrival.upload)
                    continue
                if review.held and now < entry.deadline and not self._unanswered(fragment, entry):
                    waiting.append(entry)
                    continue
                if review.held and entry.doubt is not None:
                    rejected.append((arrival, entry.doubt))
                    peers.refuse(fragment, arrival.unit, arrival.upload)
                    continue
                fresh = arrival.base_version == state.version
                state.policy.add(_scaled(arrival, review.scale), fresh=fresh)
            self._held[fragment] = waiting
        return rejected

    def withdraw(self, unit: int) -> list[Arrival]:
        """Take ``unit``'s held arrivals out, unmerged (the operator quarantined it: an upload
        that came before the outer knew of it must not be merged after); the caller rejects
        them."""
        taken: list[Arrival] = []
        for fragment, held in enumerate(self._held):
            taken += [entry.arrival for entry in held if entry.arrival.unit == unit]
            self._held[fragment] = [entry for entry in held if entry.arrival.unit != unit]
        return taken

    def reviewed_units(self) -> set[int]:
        """The units peer review has an upload of (none without peer review)."""
        return self.peers.units() if self.peers is not None else set()

    def set_aside(self, unit: int) -> None:
        """Judge no upload by ``unit``'s until it sends one again (:meth:`PeerReview.set_aside`):
        the operator paused, stopped or quarantined it."""
        if self.peers is not None:
            self.peers.set_aside(unit)

    def _waiting(self, fragment: int) -> bool:
        """Whether arrivals of ``fragment`` are held for want of peers."""
        return any(h.doubt is None for h in self._held[fragment])

    def _unanswered(self, fragment: int, entry: _Held) -> bool:
        """Whether ``entry`` is doubted and fewer than ``MIN_PEERS`` other units may yet send
        the uploads its second opinion needs (the others have sent every step they train,
        :meth:`PeerReview.finished`): it waits for none that can come."""
        peers = self.peers
        if peers is None or entry.doubt is None or entry.seen is None:
            return False
        version = self.fragments[fragment].version
        return peers.second_opinions(fragment, entry.arrival.unit, version, entry.seen) < MIN_PEERS

    def _doubted(self, fragment: int, unit: int) -> bool:
        """Whether an upload of ``unit`` waits for a second opinion on ``fragment``."""
        return any(h.doubt is not None and h.arrival.unit == unit for h in self._held[fragment])

    def held(self) -> int:
        """Arrivals waiting for peers."""
        return sum(len(held) for held in self._held)

    def params_norm(self, fragment: int) -> float:
        """The L2 norm of the fragment's global params."""
        return self.fragments[fragment].params_norm

    def due(self, now: float) -> list[int]:
        """Fragments whose buffers should be merged now."""
        return [i for i, f in enumerate(self.fragments) if f.policy.ready(now)]

    def next_deadline(self) -> float | None:
        """The earliest time a buffered fragment must be merged (None: nothing pending)."""
        deadlines = [f.policy.deadline() for f in self.fragments]
        deadlines += [entry.deadline for held in self._held for entry in held]
        pending = [d for d in deadlines if d is not None]
        return min(pending) if pending else None

    def merge(self, fragment: int) -> MergeResult:
        """Merge the buffered arrivals of ``fragment``: under ``quorum`` all of them in one
        outer step, under ``each`` the oldest ones each in a step of its own
        (:meth:`_merge_in_turn`)."""
        state = self.fragments[fragment]
        if state.policy.kind == "each":
            waiting = min(len(state.policy.buffer), EACH_BATCH)
            return self._merge_in_turn(fragment, state.policy.take(1 << (waiting.bit_length() - 1)))
        arrivals = state.policy.take()
        a = self.algorithm
        staleness = [state.version - arr.base_version for arr in arrivals]
        # Consecutive uploads of one unit compose (each is measured from where the previous one
        # ended), so they are summed per unit first — each with its own staleness weight — and
        # only then averaged across units. Averaging them instead would shrink a unit's progress
        # whenever a backlog of its uploads is merged at once.
        per_unit: dict[int, _UnitSum] = {}
        for arr, s in zip(arrivals, staleness, strict=True):
            entry = per_unit.setdefault(arr.unit, _UnitSum())
            entry.parts.append((arr.pseudo_grad, float(a.staleness.weight(s))))
            entry.tokens += arr.tokens
            entry.steps += max(1, arr.inner_steps)
        updates, scales = zip(*(entry.summed() for entry in per_unit.values()), strict=True)
        weights = [
            merge.token_weight(a.token_weighting, entry.tokens, entry.steps)
            for entry in per_unit.values()
        ]
        # One update (the usual asynchronous merge) is scaled inside the outer step, fused
        # with it, rather than in passes of its own over the fragment.
        if len(updates) == 1:
            merged, factor = updates[0], scales[0]
        else:
            merged, factor = merge.combine(a.combine, updates, weights, scales), 1.0
        if a.participation_scale and a.optimizer != "delayed_nesterov":
            # An update from m of K units counts as m/K of a synchronous round (each unit's
            # work enters the global params with the same total weight however it is batched).
            factor *= len(per_unit) / a.num_units
        # Delayed Nesterov counts the merge as m of its N arrivals (m/N of a round) instead.
        step = self._step(
            state.params,
            state.opt_state,
            merged,
            self._freshness(staleness),
            len(per_unit),
            factor,
        )
        return self._merged(fragment, arrivals, staleness, step, steps=1)

    def _merge_in_turn(self, fragment: int, arrivals: list[Arrival]) -> MergeResult:
        """Apply ``arrivals`` (oldest first) to ``fragment``, each in an outer step of its own
        as if it had come alone, the steps run as one program (``make_outer_steps``: the
        state is read and written once for all of them). A backlog of uploads costs the outer
        less per upload this way, and the steps are the ones each upload would have had;
        each arrival's staleness counts the arrivals applied before it."""
        state = self.fragments[fragment]
        a = self.algorithm
        staleness = [state.version + i - arr.base_version for i, arr in enumerate(arrivals)]
        freshness, scales = [], []
        for s in staleness:
            factor = float(a.staleness.weight(s))
            if a.participation_scale and a.optimizer != "delayed_nesterov":
                factor *= 1 / a.num_units  # one unit's update: 1/K of a synchronous round
            freshness.append(self._freshness([s]))
            scales.append(factor)
        step = self._steps(
            state.params,
            state.opt_state,
            tuple(arr.pseudo_grad for arr in arrivals),
            tuple(freshness),
            (1,) * len(arrivals),
            tuple(scales),
        )
        return self._merged(fragment, arrivals, staleness, step, steps=len(arrivals))

    def _merged(
        self,
        fragment: int,
        arrivals: list[Arrival],
        staleness: list[int],
        step: OuterStep,
        steps: int,
    ) -> MergeResult:
        """Take the result of a merge's ``steps`` outer steps into ``fragment`` and the norm
        guard's history; returns the merge's record."""
        state = self.fragments[fragment]
        state.params, state.opt_state = step.params, step.opt_state
        state.params_norm = float(step.params_norm)
        state.version += steps
        self.guard.merged(
            fragment, [(arr.unit, arr.norm) for arr in arrivals if arr.norm is not None]
        )
        return MergeResult(
            fragment,
            state.version,
            arrivals,
            staleness,
            float(step.update_norm),
            float(step.momentum_norm),
            self._shares[fragment],
            steps,
        )


def _scaled(arrival: Arrival, scale: float) -> Arrival:
    """``arrival`` with its pseudo-gradient and norm scaled by ``scale`` (< 1: clipped)."""
    if scale >= 1.0:
        return arrival
    assert arrival.norm is not None
    pseudo_grad = {
        k: np.asarray(v, np.float32) * np.float32(scale) for k, v in arrival.pseudo_grad.items()
    }
    return dataclasses.replace(
        arrival, pseudo_grad=pseudo_grad, norm=arrival.norm * scale, clipped=True
    )
