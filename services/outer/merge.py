"""Combining several pseudo-gradients into one: token weights, weighted and radial averaging.

Decoupled DiLoCo (arXiv 2604.21428, §3.2; docs/ALGORITHMS.md, "Outer") weights a
learner's update by w = tokens · (tokens / steps) = tokens² / steps ("quantity × quality") and
merges with **radial-directional averaging** (RDA): norms and directions are averaged
separately, so the merged update does not shrink like 1/√M when updates are nearly orthogonal:

    RDA({v_m, w_m}) = (Σ w_m ‖v_m‖ / Σ w_m) · φ(Σ w_m φ(v_m) / Σ w_m),   φ(x) = x / ‖x‖

applied per tensor, falling back to the plain weighted average where the mean direction
vanishes. Staleness weights s_m multiply each update but are *not* normalised away:
merged = Σ_m s_m w_m Δ_m / Σ_m w_m (FedBuff-style), so a batch of stale updates moves the
params less than a batch of fresh ones.

Two robust combines bound what a few hostile or broken updates of one merge can do (docs/
SECURITY.md): the **coordinate-wise median** of the s_m Δ_m, and the **trimmed mean**, which
drops the ⌊M/4⌋ largest and ⌊M/4⌋ smallest values of each coordinate and averages the rest.
Both ignore the token weights: an upload's token count is its own claim.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from shared.outer_choices import COMBINES, TOKEN_WEIGHTINGS

_EPS = 1e-12
TRIM_FRACTION = 0.25  # the trimmed mean drops this share of the values at each end


def token_weight(kind: str, tokens: int, steps: int) -> float:
    """Weight of one update by the work behind it.

    Args:
        kind: ``uniform`` (1), ``tokens`` (token count) or ``tokens2_per_step`` (tokens²/steps).
        tokens: tokens processed since the unit's last upload of this fragment.
        steps: inner steps since then (≥ 1).

    Raises:
        ValueError: on an unknown kind or non-positive steps.
    """
    if kind not in TOKEN_WEIGHTINGS:
        raise ValueError(f"token weighting must be one of {TOKEN_WEIGHTINGS}, got {kind!r}")
    if steps < 1 or tokens < 0:
        raise ValueError(f"need steps >= 1 and tokens >= 0, got steps={steps}, tokens={tokens}")
    if kind == "uniform":
        return 1.0
    if kind == "tokens":
        return float(tokens)
    return float(tokens) * float(tokens) / float(steps)


def _stack(updates: Sequence[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *updates)


@jax.jit
def weighted_average(stacked: Any, weights: jax.Array, scales: jax.Array) -> Any:
    """Σ_m scale_m w_m Δ_m / Σ_m w_m over a pytree whose leaves are stacked on axis 0."""
    norm = jnp.sum(weights)

    def leaf(x: jax.Array) -> jax.Array:
        coef = (weights * scales / norm).reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.sum(coef * x, axis=0)

    return jax.tree_util.tree_map(leaf, stacked)


@jax.jit
def radial_directional_average(stacked: Any, weights: jax.Array, scales: jax.Array) -> Any:
    """RDA per tensor: mean norm (weighted, with staleness scales) times the mean direction."""
    norm_w = jnp.sum(weights)

    def leaf(x: jax.Array) -> jax.Array:
        shape = (-1,) + (1,) * (x.ndim - 1)
        flat_norms = jnp.sqrt(jnp.sum(x.reshape(x.shape[0], -1) ** 2, axis=1))  # (M,)
        directions = x / jnp.maximum(flat_norms, _EPS).reshape(shape)
        mean_dir = jnp.sum((weights / norm_w).reshape(shape) * directions, axis=0)
        mean_dir_norm = jnp.sqrt(jnp.sum(mean_dir**2))
        radius = jnp.sum(weights * scales * flat_norms) / norm_w
        rda = radius * mean_dir / jnp.maximum(mean_dir_norm, _EPS)
        plain = jnp.sum(((weights * scales) / norm_w).reshape(shape) * x, axis=0)
        return jnp.where(mean_dir_norm > 1e-6, rda, plain)

    return jax.tree_util.tree_map(leaf, stacked)


@jax.jit
def coordinate_median(stacked: Any, scales: jax.Array) -> Any:
    """The median of the scaled updates s_m Δ_m, coordinate by coordinate."""

    def leaf(x: jax.Array) -> jax.Array:
        return jnp.median(scales.reshape((-1,) + (1,) * (x.ndim - 1)) * x, axis=0)

    return jax.tree_util.tree_map(leaf, stacked)


@functools.partial(jax.jit, static_argnames="trim")
def trimmed_mean(stacked: Any, scales: jax.Array, trim: int) -> Any:
    """The mean of the scaled updates s_m Δ_m, coordinate by coordinate, without the ``trim``
    largest and ``trim`` smallest values."""

    def leaf(x: jax.Array) -> jax.Array:
        ordered = jnp.sort(scales.reshape((-1,) + (1,) * (x.ndim - 1)) * x, axis=0)
        return jnp.mean(ordered[trim : x.shape[0] - trim], axis=0)

    return jax.tree_util.tree_map(leaf, stacked)


def combine(
    kind: str, updates: Sequence[Any], weights: Sequence[float], scales: Sequence[float]
) -> Any:
    """Merge pseudo-gradients (pytrees of one structure) into one.

    Args:
        kind: ``weighted``, ``rda``, ``median`` or ``trimmed_mean``.
        updates: the pseudo-gradients.
        weights: token weights w_m (normalised here).
        scales: staleness weights s_m (not normalised).

    Raises:
        ValueError: on an unknown kind, no updates, or non-positive total weight.
    """
    if kind not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {kind!r}")
    if not updates or len(updates) != len(weights) or len(weights) != len(scales):
        raise ValueError("need one weight and one scale per update, and at least one update")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"total token weight must be > 0, got {total}")
    # Normalise in double precision first: tokens²/steps weights can be ~1e10.
    w = jnp.asarray([weight / total for weight in weights], dtype=jnp.float32)
    s = jnp.asarray(scales, dtype=jnp.float32)
    if len(updates) == 1:
        return jax.tree_util.tree_map(lambda x: x * s[0], updates[0])
    stacked = _stack(updates)
    if kind == "weighted":
        return weighted_average(stacked, w, s)
    if kind == "median":
        return coordinate_median(stacked, s)
    if kind == "trimmed_mean":
        return trimmed_mean(stacked, s, trim=int(len(updates) * TRIM_FRACTION))
    return radial_directional_average(stacked, w, s)
