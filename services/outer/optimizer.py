"""Outer-optimizer math: staleness weighting and SGD with Nesterov momentum over pytrees.

The outer step treats a pseudo-gradient Δ = θ_base − θ_local as a gradient (DiLoCo, arXiv
2311.08105, Alg. 1) and applies Nesterov momentum in the PyTorch convention used there:
m ← βm + Δ;  θ ← θ − lr·(Δ + βm)  — which is ``optax.sgd(lr, β, nesterov=True)``.

A stale update (computed against version ``base_version`` while the global params are at
``version``) is scaled by w(s) = (1 + s)^−a with s = version − base_version (FedAsync /
FedBuff's polynomial rule, a = 0.5 by default; arXiv 1903.03934, 2106.06639).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class OuterState(NamedTuple):
    """Global params, the outer optimizer's state and the global version."""

    params: Any
    opt_state: Any
    version: int


def staleness_weight(staleness: int, exponent: float) -> float:
    """Polynomial staleness weight (1 + s)^−a.

    Raises:
        ValueError: for a negative staleness (an update from the future is a bug upstream).
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return float((1.0 + staleness) ** -exponent)


def nesterov_outer(lr: float, momentum: float) -> optax.GradientTransformation:
    """SGD with Nesterov momentum, as DiLoCo's outer optimizer (lr 0.7, β 0.9 by default)."""
    return optax.sgd(
        learning_rate=lr, momentum=momentum if momentum > 0 else None, nesterov=momentum > 0
    )


def make_outer_step(optimizer: optax.GradientTransformation):
    """Return a jitted ``step(params, opt_state, pseudo_grad, weight) -> (params, opt_state)``."""

    @jax.jit
    def step(params: Any, opt_state: Any, pseudo_grad: Any, weight: jax.Array):
        scaled = jax.tree_util.tree_map(lambda d: d * weight, pseudo_grad)
        updates, opt_state = optimizer.update(scaled, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def init_outer(
    optimizer: optax.GradientTransformation, params: Any, version: int = 0
) -> OuterState:
    """Outer state at ``version`` with zero momentum."""
    params = jax.tree_util.tree_map(jnp.asarray, params)
    return OuterState(params, optimizer.init(params), version)
