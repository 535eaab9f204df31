"""Staleness weights: how much an update computed against an old global version still counts.

Staleness s = version_now − base_version (in outer steps). Every rule maps s ≥ 0 to a weight in
(0, 1], written with ``jnp`` so it works on Python ints and under ``jax.jit`` alike:

* constant      w = 1
* polynomial    w = (1 + s)^−a                       (FedAsync, arXiv 1903.03934; FedBuff a = 0.5)
* hinge         w = 1 if s ≤ b else 1 / (a(s − b) + 1)   (FedAsync)
* exponential   w = e^(−a·s)

A max-staleness cut-off (``max_staleness``) drops updates that are older still; the caller
records each drop with the reason ``too_stale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from shared.outer_choices import STALENESS_RULES


@dataclass(frozen=True)
class StalenessRule:
    """A staleness weighting rule and its cut-off.

    Attributes:
        rule: one of ``STALENESS_RULES``.
        a: exponent (polynomial), slope (hinge) or rate (exponential).
        b: hinge point: updates at most this stale keep full weight.
        max_staleness: drop updates staler than this; None keeps every update.
    """

    rule: str
    a: float
    b: float
    max_staleness: int | None

    def __post_init__(self) -> None:
        if self.rule not in STALENESS_RULES:
            raise ValueError(f"staleness rule must be one of {STALENESS_RULES}, got {self.rule!r}")
        if self.a < 0 or self.b < 0:
            raise ValueError(f"staleness a and b must be >= 0, got a={self.a}, b={self.b}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def weight(self, staleness):
        """Weight of an update with the given staleness (scalar or array, jit-friendly)."""
        s = jnp.asarray(staleness, dtype=jnp.float32)
        if self.rule == "constant":
            return jnp.ones_like(s)
        if self.rule == "polynomial":
            return (1.0 + s) ** (-self.a)
        if self.rule == "hinge":
            return jnp.where(s <= self.b, 1.0, 1.0 / (self.a * (s - self.b) + 1.0))
        return jnp.exp(-self.a * s)

    def accepts(self, staleness: int) -> bool:
        """False when the update is past the cut-off and must be dropped."""
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        return self.max_staleness is None or staleness <= self.max_staleness
