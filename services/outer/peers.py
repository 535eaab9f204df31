"""Peer review: an upload is judged against the other units' latest uploads of its fragment.

The norm guard (``norm_guard.py``) bounds an upload's size; it cannot see its direction, and
one unit with valid credentials could send pseudo-gradients of honest size that undo the
job's progress. Honest units descend the same loss: their pseudo-gradients point the same way
(a positive cosine between one unit's upload and another's latest). So for
each fragment the outer keeps, per unit, a sketch of its latest upload (``SKETCH_SIZE``
coordinates at fixed random positions: the cosine of two sketches estimates theirs), its norm,
the fragment's version then, and when the unit's uploads came. A new upload of unit u is
reviewed against its **peers**, the other units whose latest upload is at most ``MAX_AGE``
rounds of the job's merges old and was not refused (a unit whose upload was refused is no
peer until it sends one that passes, so that a hostile unit's latest upload does not sit among
the honest ones an honest upload is judged by):

* **pace**: unit u may have sent at most ``PACE_FACTOR`` × as many uploads of the fragment as
  the median peer, plus ``PACE_SLACK``, else ``too_frequent``: a unit cannot outrun its work.
  Counts, not rates, so that the limit holds from the first upload on (DyLU, on by default,
  gives units of any speed the same pace; a unit that joins late or was down is behind, never
  ahead; with ``--no-dynamic-h`` a unit more than ``PACE_FACTOR`` × as fast as the median has
  its extra uploads refused). The factor is 2, not less: DyLU sets a unit's H from its
  measured speed, and on a loaded machine an honest unit whose speed was misread sent 1.9×
  its peers' median count (a ``tiny`` run of 4 units, two such runs on 2 cores);
* **direction**: the (upper) median of its cosines with the peers' sketches must be at least
  ``DIRECTION_FLOOR``: at least half of its peers agree with it (a sign flip reads as negative
  as honest uploads read positive, a random direction about 0). One that disagrees gets a
  second opinion (``OuterCore.settle``): it waits, unmerged, for its peers' next uploads, as
  an honest update can reverse older ones where the params moved past a minimum, and is
  rejected as ``direction_outlier`` if those disagree too (or none come within
  ``peer_hold_s``, or fewer than ``MIN_PEERS`` other units may still send one: the others'
  uploads have claimed every step they train, :meth:`PeerReview.finished`); a unit has one
  upload waiting so at a time, its next disagreeing one is rejected at once;
* **size**: its norm is clipped to ``NORM_CLIP`` × the upper median of the peers' norms
  (counted as clipped), so one upload weighs at most that many honest ones. Norms are compared
  per √ of the inner steps behind them (noise adds up as √k, drift as k: within the factor for
  units whose H differ up to 4×, as DyLU's do), and the steps an upload may claim are bounded
  by the job's H (``validation.py``);
* **work**: its norm must be at least ``WORK_FLOOR`` × the lower median of the peers' norms, each
  scaled by r, the inner learning rate summed over the steps the upload claims over that summed over
  the peer's (:func:`learning_rate_sum`), where r < 1, and by √r where r > 1 (a drift grows as r,
  the fastest a norm grows, noise as √r, the slowest: an honest upload of few steps, at the end of a
  run or after a pause, is not below it, nor one of many steps judged by a peer's few), else
  ``implausible_work``: an upload of a few steps that claims a whole period would take a merge's
  share of an honest one (an outer step averages the arrivals of its momentum period) and dilute
  the honest units' progress (a unit uploading every H/8 steps, claiming H, left a ``tiny`` run 7%
  behind a clean one with the pace limit alone). An upload's steps are placed in the unit's
  schedule (warm-up, then cosine decay over the steps it trains in all, ``--learner-steps``) by
  the steps its uploads of the fragment claimed before it: in the warm-up a unit that is behind
  its peers (a slower one, one that joined late) makes smaller updates for its steps than they
  do, and is judged by the learning rate it had (counting steps alone refused 13 uploads of an
  honest unit behind its peers in a ``tiny`` run, all in warm-up); at a run's end its last
  uploads, at the decayed rate, are judged against its peers' earlier ones at a higher rate. An
  upload is placed no further along than the upper median of its peers' claimed steps (an
  honest unit ahead of its peers is judged at their rate, higher in the decay, by the floor's
  margin): a unit that claims more steps than it trains (the ``too_frequent`` attack claims a
  whole period every eighth of one) would otherwise move itself down the decay, where less is
  expected of it (in a ``tiny`` run of 40 steps it moved past the decay's end, where a tenth of
  the peak is expected, and its uploads passed the floor).

The size and the work are judged by the median on the side a hostile peer cannot push: the
upper median for the clip (a hostile peer's tiny upload cannot get honest ones clipped), the
lower one for the floor (its huge upload cannot get honest ones refused), so that a minority of
hostile peers moves neither past the honest peers' values, even where the peers are 2.

Medians over peers are what one unit, or any minority of the units, cannot move. Against f
hostile units of K with f ≤ (K − 1)/2, an honest unit has at least half of its K − 1 peers
honest, so its direction passes whatever the hostile ones send; a hostile upload passes only
if it agrees with at least half of its peers, so with honest ones: it must look like the
honest units' uploads, and it weighs at most ``NORM_CLIP`` of theirs. Until an upload has
``MIN_PEERS`` peers at the job's start (before ``MIN_PEERS`` + 1 units have sent uploads of
its fragment) it is **held**, unjudged and not merged; the core reviews it again as peers
arrive (the first uploads of a job come at about the same time), or merges it on the norm
guard's word alone once it has waited ``peer_hold_s``. After the start, an upload with fewer
peers is merged on the norm guard's word at once: its peers stopped, finished or were shut
out, and a job down to fewer live units than that has no majority to judge by (waiting for
them would hold every upload of a 3-unit job with one unit gone for ``peer_hold_s``, and a
run's last uploads once its other units have finished). A job of fewer than ``MIN_PEERS`` + 1
units is not reviewed at all.

A hostile unit's uploads are refused, so its work is lost to the job: an attacked job trains
like one of its honest units alone, which is the reference its final eval is held to.

What the review keeps (:meth:`PeerReview.history`) is part of the outer's checkpoint, so a
restarted outer judges as the one before it: an upload it had taken but not merged when it
stopped is delivered again and judged again, but recorded once (by its upload id). Pure: no
I/O, no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.outer.errors import Rejected
from shared.settings.algorithm import END_LR

SKETCH_SIZE = 1 << 15  # coordinates of a fragment whose cosine stands for the whole upload's
MIN_PEERS = 2  # peers an upload needs before it is judged (else held)
DIRECTION_FLOOR = 0.05  # least median cosine with the peers' latest uploads
NORM_CLIP = 2.0  # an upload's norm is clipped to this × the median of its peers' norms
WORK_FLOOR = 0.25  # an upload's norm is at least this × its peers' median for its steps
PACE_FACTOR = 2.0  # most uploads of a fragment, × the median peer's
PACE_SLACK = 2  # uploads a unit may be ahead of that (the first in, a flush after an outage)
MAX_AGE = 4  # a peer's latest upload counts while at most this many rounds of merges old


@dataclass
class Latest:
    """What the outer keeps of one unit's uploads of one fragment: its latest upload's id,
    sketch, norm and the fragment's version then, and how many it recorded with how many
    inner steps."""

    upload: str
    sketch: np.ndarray  # unit vector of SKETCH_SIZE (or fewer) coordinates, float32
    norm: float  # its L2 norm
    steps: int  # the inner steps it claims
    version: int  # the fragment's version when it came
    count: int = 0  # uploads kept to its pace
    claimed: int = 0  # the inner steps those claimed (the latest began at claimed - steps)
    refused: bool = False  # refused or set aside: no peer until its next upload passes


@dataclass(frozen=True)
class Review:
    """The verdict on an upload that passed: ``scale`` (1.0, or < 1 when clipped), or held."""

    scale: float = 1.0
    held: bool = False


class PeerReview:
    """Per fragment and unit, the latest upload's sketch, norm and pace; reviews a new one."""

    def __init__(
        self,
        sizes: Sequence[int],
        num_units: int,
        seed: int = 0,
        warmup_steps: int = 0,
        horizons: Sequence[int] = (),
    ) -> None:
        """Args:
        sizes: Values per fragment.
        num_units: Units of the job (a round of merges is that many versions).
        seed: Fixes the sampled coordinates.
        warmup_steps: The learners' linear warm-up of the inner learning rate.
        horizons: The inner steps the units train in all (their learning rate's cosine
            decay): one for every unit, or one per unit; () leaves the decay out.
        """
        self.num_units = num_units
        self.warmup_steps = warmup_steps
        self.horizons = tuple(horizons)
        self._sizes = list(sizes)
        rng = np.random.default_rng(seed)
        self._positions = [
            np.sort(rng.choice(size, SKETCH_SIZE, replace=False)) if size > SKETCH_SIZE else None
            for size in sizes
        ]
        self._latest: list[dict[int, Latest]] = [{} for _ in sizes]
        # Per fragment, its pieces' layout (name, size) and each piece's sampled positions.
        self._layouts: list[tuple[tuple[tuple[str, int], ...], list[np.ndarray]] | None] = [
            None for _ in sizes
        ]

    def sketch(self, fragment: int, pseudo_grad: Mapping[str, np.ndarray]) -> np.ndarray:
        """The unit-norm sketch of an upload (its pieces in name order, at the sampled
        positions; a zero vector for a zero upload)."""
        pieces = [np.asarray(pseudo_grad[name], np.float32).ravel() for name in sorted(pseudo_grad)]
        layout = tuple(
            (name, piece.size) for name, piece in zip(sorted(pseudo_grad), pieces, strict=True)
        )
        cached = self._layouts[fragment]
        if cached is None or cached[0] != layout:
            # The positions in the pieces laid end to end, split piece by piece (once), so that
            # a sketch reads its coordinates without copying the whole fragment.
            positions = self._positions[fragment]
            ends = np.cumsum([size for _, size in layout])
            starts = ends - [size for _, size in layout]
            cached = self._layouts[fragment] = (
                layout,
                [
                    np.arange(size)
                    if positions is None
                    else positions[(positions >= start) & (positions < end)] - start
                    for (_, size), start, end in zip(layout, starts, ends, strict=True)
                ],
            )
        sampled = np.concatenate(
            [piece[index] for piece, index in zip(pieces, cached[1], strict=True)]
        )
        norm = float(np.linalg.norm(sampled))
        return (sampled / norm if norm > 0 else sampled).astype(np.float32)

    def peers(
        self, fragment: int, unit: int, version: int, newer_than: Mapping[int, int] | None = None
    ) -> list[Latest]:
        """The other units whose latest upload of ``fragment`` is recent enough to judge by
        (with ``newer_than``, unit: uploads counted before, only those that sent since)."""
        return list(self._peers(fragment, unit, version, newer_than).values())

    def _peers(
        self, fragment: int, unit: int, version: int, newer_than: Mapping[int, int] | None
    ) -> dict[int, Latest]:
        oldest = version - MAX_AGE * self.num_units
        return {
            other: latest
            for other, latest in self._latest[fragment].items()
            if other != unit
            and latest.version >= oldest
            and not latest.refused
            and (newer_than is None or latest.count > newer_than.get(other, 0))
        }

    def horizon(self, unit: int) -> int | None:
        """The inner steps ``unit`` trains in all (None where not known)."""
        if len(self.horizons) == 1:
            return self.horizons[0]
        return self.horizons[unit] if 0 <= unit < len(self.horizons) else None

    def finished(self, fragment: int, unit: int) -> bool:
        """Whether ``unit``'s uploads of ``fragment`` have claimed every step of its horizon:
        it sends no more of them (never where its horizon is not known). A unit that claims
        more steps than it trains, or trains steps again after a restart, reads as finished
        early."""
        horizon = self.horizon(unit)
        latest = self._latest[fragment].get(unit)
        return horizon is not None and latest is not None and latest.claimed >= horizon

    def second_opinions(
        self, fragment: int, unit: int, version: int, newer_than: Mapping[int, int]
    ) -> int:
        """How many other units may yet judge ``unit``'s doubted upload of ``fragment``: the
        peers that sent a newer upload than ``newer_than`` counted, and every other unit of the
        job that has not :meth:`finished` (it may still send one)."""
        newer = self._peers(fragment, unit, version, newer_than)
        others = (set(range(self.num_units)) | set(self._latest[fragment])) - {unit} - set(newer)
        return len(newer) + sum(not self.finished(fragment, other) for other in others)

    def quorate(self, fragment: int) -> bool:
        """Whether ``fragment`` has had uploads from ``MIN_PEERS`` + 1 units: the job's start is
        over, and an upload that has too few peers now has them no more (they stopped, finished
        or were shut out) rather than not yet."""
        return len(self._latest[fragment]) > MIN_PEERS

    def units(self) -> set[int]:
        """The units with an upload recorded, of any fragment."""
        return {unit for latest in self._latest for unit in latest}

    def counts(self, fragment: int) -> dict[int, int]:
        """Per unit, the uploads of ``fragment`` recorded so far."""
        return {unit: latest.count for unit, latest in self._latest[fragment].items()}

    def recorded(self, fragment: int, unit: int, upload: str) -> bool:
        """Whether ``upload`` is the latest upload of ``unit`` recorded for ``fragment`` (one
        delivered again after a restart; never an upload without an id)."""
        latest = self._latest[fragment].get(unit)
        return bool(upload) and latest is not None and latest.upload == upload

    def record(
        self,
        fragment: int,
        unit: int,
        upload: str,
        sketch: np.ndarray,
        norm: float,
        steps: int,
        version: int,
    ) -> None:
        """Keep ``unit``'s newest upload of ``fragment`` (one that kept to its pace): its id,
        sketch, its ``norm`` over ``steps`` inner steps and the fragment's version."""
        latest = self._latest[fragment].get(unit)
        if latest is None:
            latest = Latest(upload, sketch, norm, steps, version)
            self._latest[fragment][unit] = latest
        latest.upload, latest.sketch, latest.version = upload, sketch, version
        latest.norm, latest.steps, latest.refused = norm, max(1, steps), False
        latest.count += 1
        latest.claimed += latest.steps

    def start(self, fragment: int, unit: int) -> int:
        """The inner step at which ``unit``'s latest recorded upload of ``fragment`` began (by
        the steps its uploads claimed; 0 before any)."""
        latest = self._latest[fragment].get(unit)
        return latest.claimed - latest.steps if latest is not None else 0

    def refuse(self, fragment: int, unit: int, upload: str) -> None:
        """Note that ``upload``, ``unit``'s latest recorded upload of ``fragment``, was
        refused: the unit is no peer until its next upload."""
        latest = self._latest[fragment].get(unit)
        if latest is not None and latest.upload == upload:
            latest.refused = True

    def set_aside(self, unit: int) -> None:
        """Make ``unit`` no peer of any fragment until its next upload is recorded: the
        operator paused, stopped or quarantined it. A unit that trains no more would otherwise
        judge the others by its latest upload until that aged out (``MAX_AGE``), and by its
        count their pace: with one unit of three quarantined and one paused, the third's
        uploads were refused as ``too_frequent`` against the median of the two counts that had
        stopped growing."""
        for latest in self._latest:
            kept = latest.get(unit)
            if kept is not None:
                kept.refused = True

    def history(self) -> list[dict[int, Latest]]:
        """Per fragment and unit, what the review keeps, for a checkpoint."""
        return [dict(sorted(latest.items())) for latest in self._latest]

    def restore(self, history: Sequence[Mapping[int, Latest]]) -> None:
        """Continue from :meth:`history` output.

        Raises:
            ValueError: another number of fragments, a sketch of another size than the
                fragment's, or a norm that is not finite and >= 0.
        """
        if len(history) != len(self._latest):
            raise ValueError(
                f"peer history has {len(history)} fragments, the job {len(self._latest)}"
            )
        for fragment, latest in enumerate(history):
            size = self._sketch_size(fragment)
            for unit, kept in latest.items():
                if kept.sketch.shape != (size,) or not np.isfinite(kept.sketch).all():
                    raise ValueError(f"peer history of unit {unit} holds a bad sketch")
                if not (math.isfinite(kept.norm) and kept.norm >= 0 and kept.steps >= 1):
                    raise ValueError(f"peer history of unit {unit} holds a bad norm or steps")
                if not kept.steps <= kept.claimed:
                    raise ValueError(f"peer history of unit {unit} claims fewer steps in all")
        self._latest = [
            {int(unit): dataclasses.replace(kept) for unit, kept in latest.items()}
            for latest in history
        ]

    def _least_growth(self, rate: float, unit: int, peer: Latest) -> float:
        """The least an upload's norm can be over ``peer``'s (``unit``'s latest), by the
        learning rate summed over its steps (``rate``) against the peer's: their ratio r where
        the upload did less (a drift shrinks as r, the fastest a norm does), √r where it did
        more (noise grows as √r, the slowest), so that the floor never asks more of an honest
        upload than either."""
        start = peer.claimed - peer.steps
        peer_rate = learning_rate_sum(start, peer.steps, self.warmup_steps, self.horizon(unit))
        if peer_rate <= 0:
            return 0.0
        ratio = rate / peer_rate
        return min(ratio, math.sqrt(ratio))

    def _sketch_size(self, fragment: int) -> int:
        positions = self._positions[fragment]
        return self._sizes[fragment] if positions is None else len(positions)

    def check_pace(self, fragment: int, unit: int, version: int) -> None:
        """Raises ``Rejected("too_frequent")`` if one more upload of ``unit`` would put it more
        than ``PACE_FACTOR`` × the median peer's count (+ ``PACE_SLACK``) ahead."""
        latest = self._latest[fragment].get(unit)
        counts = [peer.count for peer in self.peers(fragment, unit, version)]
        if latest is None or len(counts) < MIN_PEERS:
            return
        median = float(np.median(counts))
        if latest.count + 1 > PACE_FACTOR * median + PACE_SLACK:
            raise Rejected(
                "too_frequent",
                f"upload {latest.count + 1} of unit {unit} for fragment {fragment}: more than "
                f"{PACE_FACTOR:g} x its peers' median of {median:g} + {PACE_SLACK}",
            )

    def judge(
        self,
        fragment: int,
        unit: int,
        sketch: np.ndarray,
        norm: float,
        steps: int,
        version: int,
        newer_than: Mapping[int, int] | None = None,
        start: int = 0,
    ) -> Review:
        """The verdict on an upload of ``unit`` (its ``sketch``, and its ``norm`` over
        ``steps`` inner steps from step ``start``: see :meth:`start`) by its peers now
        (``newer_than``: see :meth:`peers`). With fewer than ``MIN_PEERS`` it is held, or, once
        the fragment is :meth:`quorate` (and not waiting for newer uploads), passed unjudged.

        Raises:
            Rejected: ``direction_outlier``, with the median cosine; ``implausible_work``, an
                upload far smaller than its peers' for the steps it claims.
        """
        by_unit = self._peers(fragment, unit, version, newer_than)
        peers = list(by_unit.values())
        if len(peers) < MIN_PEERS:
            if newer_than is None and self.quorate(fragment):
                return Review()  # merged on the norm guard's word
            return Review(held=True)
        if norm > 0:
            # The upper median: the upload passes when at least half of its peers agree.
            cosines = sorted(float(np.dot(sketch, peer.sketch)) for peer in peers)
            cosine = cosines[len(cosines) // 2]
            if cosine < DIRECTION_FLOOR:
                raise Rejected(
                    "direction_outlier",
                    f"median cosine {cosine:.3f} with the latest uploads of {len(peers)} other "
                    f"units < {DIRECTION_FLOOR:g}",
                )
        steps = max(1, steps)
        # No further along than its peers have trained (the upper median of their claims): a
        # unit that claims more steps than it trains cannot move itself down the decay.
        start = min(start, sorted(peer.claimed for peer in peers)[len(peers) // 2])
        # The lower median of the peers' norms scaled to the learning rate over these steps.
        rate = learning_rate_sum(start, steps, self.warmup_steps, self.horizon(unit))
        least = sorted(
            peer.norm * self._least_growth(rate, other, peer) for other, peer in by_unit.items()
        )[(len(peers) - 1) // 2]
        if norm < WORK_FLOOR * least:
            raise Rejected(
                "implausible_work",
                f"update norm {norm:.4g} < {WORK_FLOOR:g} x its peers' lower median "
                f"{least:.4g} for {steps} inner steps from step {start}: less work than it "
                "claims",
            )
        # The upper median of the peers' norms per √step, at these steps.
        per_step = sorted(peer.norm / math.sqrt(peer.steps) for peer in peers)[len(peers) // 2]
        bound = NORM_CLIP * per_step * math.sqrt(steps)
        return Review(scale=bound / norm if norm > bound > 0 else 1.0)


def learning_rate_sum(
    start: int, steps: int, warmup_steps: int, horizon: int | None = None
) -> float:
    """The inner learning rate summed over the steps ``[start, start + steps)``, in units of
    its peak, as the learners run it (``services/learner/trainer.py``: optax's
    ``warmup_cosine_decay_schedule`` over ``horizon`` steps, from 0 up to the peak in a linear
    warm-up, then down to ``END_LR`` of it in a cosine decay). With ``horizon`` None (the
    learners' steps not known) the decay is left out: then an honest upload of a few steps at
    a run's end, at the decayed rate, judged by a peer's earlier upload at a higher one, can
    fall under the floor."""
    if horizon is None:
        warmup, decay = warmup_steps, None
    else:  # as trainer.inner_optimizer clamps them
        warmup = min(warmup_steps, max(horizon - 1, 0))
        decay = max(horizon, warmup_steps + 1) - warmup
    t = np.arange(start, start + steps, dtype=np.float64)
    rate = np.ones_like(t)
    if warmup > 0:
        rate = np.where(t < warmup, t / warmup, rate)
    if decay is not None:
        done = np.clip(t - warmup, 0, decay) / decay
        cosine = END_LR + (1 - END_LR) * 0.5 * (1 + np.cos(np.pi * done))
        rate = np.where(t >= warmup, cosine, rate)
    return float(rate.sum())
