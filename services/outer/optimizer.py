"""Outer optimizers over pytrees, optax-style ``(init, update)`` pairs.

The outer step treats a (merged) pseudo-gradient Δ = θ_base − θ_local as a gradient (DiLoCo,
arXiv 2311.08105, Alg. 1):

* ``sgd``              θ ← θ − lr·Δ   (lr 1 is FedAvg)
* ``nesterov``         m ← βm + Δ;  θ ← θ − lr·(Δ + βm)   (PyTorch convention, DiLoCo's choice)
* ``delayed_nesterov`` Algorithm 3 of arXiv 2401.09135 with c = 0: accumulate N arrivals; between
  milestones plain SGD on g/N; every N-th arrival m ← βm + mean(buffer) and θ ← θ − lr(βm + g/N).
  Over N equal arrivals this equals one Nesterov step on their mean, which is what keeps
  sequentially applied asynchronous updates from over-amplifying momentum (§4.2 of that paper).
  A merge of the mean g of k arrivals (a quorum merge, a synchronous round) counts as k of them:
  k·g enters the buffer, the step is lr·k·g/N, and a milestone reached within it takes the whole
  merge; so a round of N units is one Nesterov step on their mean, as in synchronous DiLoCo.

All state lives in NamedTuples and every update is jit-compatible (no Python branching on traced
values).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shared.outer_choices import OPTIMIZERS


class DelayedNesterovState(NamedTuple):
    """State of Delayed Nesterov: momentum, the sum of buffered arrivals, arrivals so far, and
    the sum of the buffered arrivals' freshness."""

    momentum: Any
    accumulated: Any
    count: jax.Array
    freshness: jax.Array


def delayed_nesterov(
    lr: float, momentum: float, period: int
) -> optax.GradientTransformationExtraArgs:
    """Delayed Nesterov (arXiv 2401.09135, Alg. 3, c = 0) as an optax transform, whose momentum
    follows the freshness of what it merges.

    Each update is the mean of ``arrivals`` arrivals (``update(..., arrivals=k)``; 1 when not
    given) with their mean freshness f in [0, 1] (``update(..., freshness=f)``; 1 when not
    given). At a milestone the momentum is ``β·f̄`` instead of β, f̄ the period's freshness sum
    over N (at most 1): fresh arrivals give Delayed Nesterov, stale ones plain SGD on the mean,
    with nothing of the old momentum kept. Momentum applied to updates computed against old
    params keeps pushing where the outer has already gone (the units have not seen its moves
    yet); over slow links that made training diverge (docs/ALGORITHMS.md, "Staleness").

    Args:
        lr: outer learning rate ε.
        momentum: β.
        period: N, arrivals per momentum update (≥ 1; N = 1 is plain Nesterov).
    """
    if period < 1:
        raise ValueError(f"delayed Nesterov period must be >= 1, got {period}")

    def init(params: Any) -> DelayedNesterovState:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return DelayedNesterovState(
            zeros, zeros, jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32)
        )

    def update(grads: Any, state: DelayedNesterovState, params: Any = None, **extra: Any):
        del params
        arrivals = jnp.asarray(extra.get("arrivals", 1), jnp.int32)
        weight = arrivals.astype(jnp.float32)
        freshness = state.freshness + weight * jnp.asarray(extra.get("freshness", 1.0), jnp.float32)
        # β·f̄, used at a milestone: the period's freshness sum over N, at most 1 (a merge that
        # reaches the milestone may bring it more than N arrivals).
        beta = momentum * jnp.minimum(freshness / period, 1.0)
        accumulated = jax.tree_util.tree_map(
            lambda acc, g: acc + weight * g, state.accumulated, grads
        )
        count = state.count + arrivals
        milestone = count // period > state.count // period
        new_momentum = jax.tree_util.tree_map(
            lambda m, acc: jnp.where(milestone, beta * m + acc / period, m),
            state.momentum,
            accumulated,
        )
        updates = jax.tree_util.tree_map(
            lambda m, g: -lr * (jnp.where(milestone, beta * m, 0.0) + weight * g / period),
            new_momentum,
            grads,
        )
        accumulated = jax.tree_util.tree_map(
            lambda acc: jnp.where(milestone, jnp.zeros_like(acc), acc), accumulated
        )
        freshness = jnp.where(milestone, 0.0, freshness)
        return updates, DelayedNesterovState(new_momentum, accumulated, count, freshness)

    return optax.GradientTransformationExtraArgs(init, update)


def make_outer_optimizer(
    name: str, lr: float, momentum: float = 0.9, period: int = 1
) -> optax.GradientTransformation:
    """Build an outer optimizer by name.

    Raises:
        ValueError: on an unknown name or invalid hyperparameters.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"outer optimizer must be one of {OPTIMIZERS}, got {name!r}")
    if lr <= 0 or not 0 <= momentum < 1:
        raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
    if name == "sgd":
        return optax.with_extra_args_support(optax.sgd(learning_rate=lr))
    if name == "nesterov":
        return optax.with_extra_args_support(
            optax.sgd(learning_rate=lr, momentum=momentum, nesterov=True)
        )
    return delayed_nesterov(lr, momentum, period)


def momentum_of(opt_state: Any) -> Any:
    """The momentum buffer inside an outer optimizer's state (None for plain SGD)."""
    if isinstance(opt_state, DelayedNesterovState):
        return opt_state.momentum
    if isinstance(opt_state, optax.TraceState):
        return opt_state.trace
    if isinstance(opt_state, tuple):
        for part in opt_state:
            found = momentum_of(part)
            if found is not None:
                return found
    return None


class OuterStep(NamedTuple):
    """What one outer step did: the new params and state, the size of the change it made to
    the params and of the momentum it leaves (0 without momentum), and the new params' norm."""

    params: Any
    opt_state: Any
    update_norm: jax.Array
    momentum_norm: jax.Array
    params_norm: jax.Array


def _apply(
    optimizer: optax.GradientTransformationExtraArgs,
    params: Any,
    opt_state: Any,
    pseudo_grad: Any,
    freshness: Any,
    arrivals: Any,
    scale: Any,
) -> tuple[Any, Any, Any]:
    """One outer step, traced: the new params, the new state and the updates applied."""
    pseudo_grad = jax.tree_util.tree_map(lambda g: g * scale, pseudo_grad)
    updates, opt_state = optimizer.update(
        pseudo_grad, opt_state, params, freshness=freshness, arrivals=arrivals
    )
    return optax.apply_updates(params, updates), opt_state, updates


def _momentum_norm(opt_state: Any) -> jax.Array:
    momentum = momentum_of(opt_state)
    return jnp.zeros([]) if momentum is None else optax.tree.norm(momentum)


def make_outer_step(optimizer: optax.GradientTransformationExtraArgs):
    """Return a jitted ``step(params, opt_state, pseudo_grad, freshness=1.0, arrivals=1,
    scale=1.0) -> OuterStep`` (``freshness`` and ``arrivals``: see :func:`delayed_nesterov`;
    the other optimizers ignore them). The step applies ``scale * pseudo_grad``: the product
    is fused into the update, with no pass of its own over the params' size."""

    @jax.jit
    def step(
        params: Any,
        opt_state: Any,
        pseudo_grad: Any,
        freshness: Any = 1.0,
        arrivals: Any = 1,
        scale: Any = 1.0,
    ) -> OuterStep:
        new_params, opt_state, updates = _apply(
            optimizer, params, opt_state, pseudo_grad, freshness, arrivals, scale
        )
        return OuterStep(
            new_params,
            opt_state,
            optax.tree.norm(updates),
            _momentum_norm(opt_state),
            optax.tree.norm(new_params),
        )

    return step


def make_outer_steps(optimizer: optax.GradientTransformationExtraArgs):
    """Return a jitted ``steps(params, opt_state, pseudo_grads, freshness, arrivals, scales)
    -> OuterStep``: the outer steps of several updates in turn, each the step of
    :func:`make_outer_step` with its own freshness, arrivals and scale, traced into one
    program. The params and optimizer state are read and written once for all of them and
    the norms taken once, at the end, where applying them one by one takes a pass over the
    state and three norms each: at ``medium``, 4 updates cost 22 ms of CPU each instead of 61.
    XLA fuses the steps' arithmetic across them, so the result equals the one-by-one steps up
    to float rounding, not bit for bit (``tests/test_outer_transforms.py`` bounds the
    difference). ``update_norm`` is the norm of the change they made together. Each number
    of updates compiles a program of its own."""

    @jax.jit
    def steps(
        params: Any,
        opt_state: Any,
        pseudo_grads: tuple[Any, ...],
        freshness: tuple[Any, ...],
        arrivals: tuple[Any, ...],
        scales: tuple[Any, ...],
    ) -> OuterStep:
        start = params
        for args in zip(pseudo_grads, freshness, arrivals, scales, strict=True):
            params, opt_state, _ = _apply(optimizer, params, opt_state, *args)
        change = jax.tree_util.tree_map(jnp.subtract, params, start)
        return OuterStep(
            params,
            opt_state,
            optax.tree.norm(change),
            _momentum_norm(opt_state),
            optax.tree.norm(params),
        )

    return steps
