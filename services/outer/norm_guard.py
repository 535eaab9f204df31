"""The outer's norm guard: no single upload may move the global params far more than the job's
uploads usually do.

A finite pseudo-gradient passes validation whatever its size, and with staleness 0 it would be
applied in full: one buggy or hostile unit could replace the model. So each fragment keeps,
per unit, the L2 norms of the last ``WINDOW`` uploads of that unit it merged; the reference is
the median over the units of each unit's median, and an upload whose norm is above ``factor``
times the reference is

* ``reject``-ed (the default): not applied, counted and dead-lettered as ``norm_outlier``;
* ``clip``-ped: scaled down to ``factor`` × the median and applied (counted in the books as
  ``clipped``);
* or let through (``off``).

The reference is there only once a fragment has merged ``MIN_HISTORY`` uploads, and only
uploads the guard let through unclipped or clipped to the bound enter the history, so that a
burst of outliers cannot raise the bar for the next ones. Each unit has one voice, however
often it uploads: a minority of the units cannot move the median of their medians past the
honest units' norms (a unit uploading many small updates, each over a few steps, once pulled a
window shared by all units down until honest uploads were refused). The history is part of the
outer's checkpoint, so a restarted outer judges as the one before it.

From the first merge on, and below the median's bound whenever that is looser, an upload is
also held to a bound that needs no history (:func:`prior_bound`): what ``steps`` AdamW steps
can move a fragment at most. Adam moves each coordinate by at most ``ADAM_STEP`` × the
learning rate a step, whatever the gradients (:func:`adam_step_bound`), plus the weight decay's
``lr × λ × |θ|``; over ``steps`` steps at the peak learning rate that is at most
``steps × lr × (ADAM_STEP × √d + λ × (‖θ‖ + steps × lr × ADAM_STEP × √d))`` in L2 for a fragment
of ``d`` values and norm ``‖θ‖``, times ``PRIOR_SLACK`` for the codec's error, its error feedback
and the params having moved since the unit's base. An honest upload cannot exceed it. It is
loose (every coordinate at its largest step, every step at the peak learning rate), so it stops
the grossly oversized upload from the first merge, not one of honest size in a hostile
direction.

Pure: no I/O, no JAX.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.outer.errors import Rejected
from shared.codec import api as codec
from shared.outer_choices import NORM_GUARDS
from shared.settings.algorithm import INNER_B1, INNER_B2

WINDOW = 16  # merged uploads per fragment and unit whose norms make the unit's median
MIN_HISTORY = 8  # merged uploads of a fragment (all units) before the median bound applies
PRIOR_SLACK = 2.0  # the prior bound's margin over what AdamW can do (see the module docstring)


def adam_step_bound(b1: float, b2: float, horizon: int = 100_000) -> float:
    """The largest ``|m̂_t / √v̂_t|`` Adam (bias-corrected, ε = 0) can reach on one coordinate,
    over every gradient sequence and step ``t``.

    By Cauchy–Schwarz, ``|m_t| ≤ (1−β1) √(Σ_k ρ^k) √(v_t / (1−β2))`` with ``ρ = β1²/β2 < 1``
    and the sums over the ``t`` past steps, so the ratio is at most
    ``(1−β1)/(1−β1^t) · √((1−β2^t)(1−ρ^t) / ((1−β2)(1−ρ)))``: 1 at ``t = 1``, rising to its
    limit ``(1−β1)/√((1−β2)(1−ρ))`` (1.165 for 0.9 and 0.95). The maximum over ``t`` up to
    ``horizon``, where the terms have converged.
    """
    rho = b1 * b1 / b2
    if not (0 <= b1 < 1 and 0 < b2 < 1 and rho < 1):
        raise ValueError(f"need 0 <= b1 < 1, 0 < b2 < 1 and b1^2 < b2, got {b1}, {b2}")
    t = np.arange(1, horizon + 1, dtype=np.float64)
    ratio = (1 - b1) / (1 - b1**t) * np.sqrt((1 - b2**t) * (1 - rho**t) / ((1 - b2) * (1 - rho)))
    return float(ratio.max())


ADAM_STEP = adam_step_bound(INNER_B1, INNER_B2)


def prior_bound(steps: int, lr: float, weight_decay: float, size: int, params_norm: float) -> float:
    """The largest norm ``steps`` AdamW steps at peak learning rate ``lr`` can give the
    pseudo-gradient of a fragment of ``size`` values and norm ``params_norm``, with
    ``PRIOR_SLACK`` (see the module docstring)."""
    walk = steps * lr * ADAM_STEP * math.sqrt(size)
    return PRIOR_SLACK * (walk + steps * lr * weight_decay * (params_norm + walk))


@dataclass(frozen=True)
class InnerBound:
    """What the outer knows of the learners' inner optimizer: the peak learning rate, the
    weight decay, the linear warm-up and each unit's inner steps, the horizon of its learning
    rate's cosine decay (the job's ``--inner-lr``, ``--weight-decay``, ``--warmup-steps`` and
    the outer's ``--learner-steps``)."""

    lr: float
    weight_decay: float
    warmup_steps: int = 0
    horizons: tuple[int, ...] = ()  # one for every unit, or one per unit; () unknown


def update_norm(pseudo_grad: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of a pseudo-gradient over all its pieces (summed in float64)."""
    return math.sqrt(sum(codec.sum_of_squares(piece) for piece in pseudo_grad.values()))


class NormGuard:
    """Per fragment, the norms of recently merged uploads, and the verdict on a new one."""

    def __init__(
        self,
        fragments: int,
        mode: str = "reject",
        factor: float = 10.0,
        window: int = WINDOW,
        min_history: int = MIN_HISTORY,
        inner: InnerBound | None = None,
        sizes: Sequence[int] = (),
    ) -> None:
        """Args:
        fragments: The job's fragments.
        mode: ``reject``, ``clip`` or ``off``.
        factor: The median bound, × the median norm.
        window, min_history: Norms kept per fragment and unit; how many (all units) before the
            median bound.
        inner: The learners' inner optimizer, for the prior bound (None: no prior bound).
        sizes: Values per fragment (needed with ``inner``).
        """
        if inner is not None and len(sizes) != fragments:
            raise ValueError(f"need {fragments} fragment sizes for the prior bound")
        if mode not in NORM_GUARDS:
            raise ValueError(f"norm guard must be one of {NORM_GUARDS}, got {mode!r}")
        if not factor > 1.0:
            raise ValueError(f"norm guard factor must be > 1, got {factor}")
        if not 1 <= min_history <= window:
            raise ValueError("need 1 <= min_history <= window")
        self.mode = mode
        self.factor = factor
        self.window = window
        self.min_history = min_history
        self.inner = inner
        self.sizes = list(sizes)
        self._norms: list[dict[int, collections.deque[float]]] = [{} for _ in range(fragments)]

    def reference(self, fragment: int) -> float | None:
        """The median over units of each unit's median merged norm of ``fragment`` (None: fewer
        than ``min_history`` merged yet)."""
        per_unit = self._norms[fragment]
        if sum(len(norms) for norms in per_unit.values()) < self.min_history:
            return None
        return float(np.median([np.median(norms) for norms in per_unit.values() if norms]))

    def median_bound(self, fragment: int) -> float | None:
        """``factor`` × the fragment's reference norm (None: too few yet, or ``off``)."""
        reference = self.reference(fragment)
        if self.mode == "off" or reference is None:
            return None
        return self.factor * reference

    def prior_bound(self, fragment: int, steps: int, params_norm: float) -> float | None:
        """What ``steps`` inner steps can do to the fragment at most (None: no prior bound)."""
        if self.mode == "off" or self.inner is None:
            return None
        inner = self.inner
        return prior_bound(steps, inner.lr, inner.weight_decay, self.sizes[fragment], params_norm)

    def bound(
        self, fragment: int, steps: int | None = None, params_norm: float = 0.0
    ) -> float | None:
        """The largest norm accepted unclipped for ``fragment`` now, for an upload of ``steps``
        inner steps (None: no bound)."""
        return self._bounds(fragment, steps, params_norm)[0]

    def _bounds(
        self, fragment: int, steps: int | None, params_norm: float
    ) -> tuple[float | None, float | None, float | None]:
        """The bound in force, the median's and the prior one (each None when absent)."""
        median = self.median_bound(fragment)
        prior = self.prior_bound(fragment, steps, params_norm) if steps is not None else None
        found = [b for b in (median, prior) if b is not None]
        return (min(found) if found else None), median, prior

    def judge(
        self, fragment: int, norm: float, steps: int | None = None, params_norm: float = 0.0
    ) -> float:
        """The factor to scale an upload of ``norm`` (``steps`` inner steps, on a fragment of
        norm ``params_norm``) by before it is merged: 1.0 when it is within the bound, less
        when clipped.

        Raises:
            Rejected: ``norm_outlier`` (mode ``reject``), with the norm and the bound.
        """
        bound, median, prior = self._bounds(fragment, steps, params_norm)
        if bound is None or norm <= bound:
            return 1.0
        if self.mode == "reject":
            if median is not None and median <= bound:
                why = (
                    f"{self.factor:g} x the median {median / self.factor:.4g} of "
                    f"{len(self._norms[fragment])} units' merged norms"
                )
            else:
                why = f"{prior:.4g}, the most {steps} inner steps can move the fragment"
            raise Rejected("norm_outlier", f"update norm {norm:.4g} > {why}")
        return bound / norm

    def merged(self, fragment: int, norms: Iterable[tuple[int, float]]) -> None:
        """Enter the (unit, norm after clipping) of the uploads one merge of ``fragment``
        applied."""
        per_unit = self._norms[fragment]
        for unit, norm in norms:
            per_unit.setdefault(unit, collections.deque(maxlen=self.window)).append(float(norm))

    def history(self) -> list[dict[int, list[float]]]:
        """Per fragment and unit, the norms the guard judges by (oldest first), for a
        checkpoint."""
        return [
            {unit: list(norms) for unit, norms in sorted(per_unit.items())}
            for per_unit in self._norms
        ]

    def restore(self, history: Sequence[Mapping[int, Sequence[float]]]) -> None:
        """Continue from :meth:`history` output.

        Raises:
            ValueError: another number of fragments, or a norm that is not finite and >= 0.
        """
        if len(history) != len(self._norms):
            raise ValueError(
                f"norm history has {len(history)} fragments, the job {len(self._norms)}"
            )
        for per_unit in history:
            for norms in per_unit.values():
                if not all(math.isfinite(n) and n >= 0 for n in norms):
                    raise ValueError("norm history holds a norm that is not finite and >= 0")
        self._norms = [
            {
                int(unit): collections.deque((float(n) for n in norms), maxlen=self.window)
                for unit, norms in per_unit.items()
            }
            for per_unit in history
        ]
