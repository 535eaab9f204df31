"""The outer's norm guard: no single upload may move the global params far more than the job's
uploads usually do.

A finite pseudo-gradient passes validation whatever its size, and with staleness 0 it would be
applied in full: one buggy or hostile unit could replace the model. So each fragment keeps the
L2 norms of the last ``WINDOW`` uploads it merged, and an upload whose norm is above ``factor``
times their median is

* ``reject``-ed (the default): not applied, counted and dead-lettered as ``norm_outlier``;
* ``clip``-ped: scaled down to ``factor`` × the median and applied (counted in the books as
  ``clipped``);
* or let through (``off``).

The guard judges only once a fragment has merged ``MIN_HISTORY`` uploads (before that there is
no "usual"), and only uploads it let through unclipped or clipped to the bound enter the
history, so that a burst of outliers cannot raise the bar for the next ones; a unit sending a
minority of the uploads cannot move the median. The history is part of the outer's checkpoint,
so a restarted outer judges as the one before it.

Pure: no I/O, no JAX.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence

import numpy as np

from services.outer.errors import Rejected
from shared.outer_choices import NORM_GUARDS

WINDOW = 64  # merged uploads per fragment whose norms make the reference
MIN_HISTORY = 8  # merged uploads before the guard judges


def update_norm(pseudo_grad: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of a pseudo-gradient over all its pieces (in float64)."""
    total = 0.0
    for piece in pseudo_grad.values():
        # Both operands float64: a float64·float32 dot takes numpy's slow mixed-type path.
        flat = np.asarray(piece, np.float32).ravel().astype(np.float64)
        total += float(np.dot(flat, flat))
    return math.sqrt(total)


class NormGuard:
    """Per fragment, the norms of recently merged uploads, and the verdict on a new one."""

    def __init__(
        self,
        fragments: int,
        mode: str = "reject",
        factor: float = 10.0,
        window: int = WINDOW,
        min_history: int = MIN_HISTORY,
    ) -> None:
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
        self._norms = [collections.deque[float](maxlen=window) for _ in range(fragments)]

    def bound(self, fragment: int) -> float | None:
        """The largest norm accepted unclipped for ``fragment`` now (None: no bound yet)."""
        norms = self._norms[fragment]
        if self.mode == "off" or len(norms) < self.min_history:
            return None
        return self.factor * float(np.median(norms))

    def judge(self, fragment: int, norm: float) -> float:
        """The factor to scale an upload of ``norm`` by before it is merged: 1.0 when it is
        within the bound, less when clipped.

        Raises:
            Rejected: ``norm_outlier`` (mode ``reject``), with the norm and the bound.
        """
        bound = self.bound(fragment)
        if bound is None or norm <= bound:
            return 1.0
        if self.mode == "reject":
            raise Rejected(
                "norm_outlier",
                f"update norm {norm:.4g} > {self.factor:g} x the median {bound / self.factor:.4g} "
                f"of the last {len(self._norms[fragment])} merged",
            )
        return bound / norm

    def merged(self, fragment: int, norms: Sequence[float]) -> None:
        """Enter the norms (after clipping) of the uploads one merge of ``fragment`` applied."""
        self._norms[fragment].extend(norms)

    def history(self) -> list[list[float]]:
        """Per fragment, the norms the guard judges by (oldest first), for a checkpoint."""
        return [list(norms) for norms in self._norms]

    def restore(self, history: Sequence[Sequence[float]]) -> None:
        """Continue from :meth:`history` output.

        Raises:
            ValueError: another number of fragments, or a norm that is not finite and >= 0.
        """
        if len(history) != len(self._norms):
            raise ValueError(
                f"norm history has {len(history)} fragments, the job {len(self._norms)}"
            )
        for norms in history:
            if not all(math.isfinite(n) and n >= 0 for n in norms):
                raise ValueError("norm history holds a norm that is not finite and >= 0")
        self._norms = [
            collections.deque[float]((float(n) for n in norms), maxlen=self.window)
            for norms in history
        ]
