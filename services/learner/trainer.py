"""The learner's math: inner AdamW steps, pseudo-gradients and adopting new global params.

Three parameter sets matter (all pytrees of the same shape):

* ``params``  θ_local, trained by the inner optimizer every step;
* ``anchor``  the point the unsent local progress is measured from: the global params last
  adopted, or θ_local at the last upload, whichever came later;
* the global params of version ``base_version``, the newest this unit has adopted.

Every H steps the unit uploads Δ = anchor − θ_local (DiLoCo's outer gradient, arXiv 2311.08105,
Alg. 1) and moves the anchor to θ_local. When a newer global version arrives it *rebases*:
θ_local ← θ_global + (θ_local − anchor), anchor ← θ_global. Right after an upload this is
exactly DiLoCo's "replace local by global"; in between, the steps taken since the upload are
kept rather than thrown away, and go out with the next upload, so no local work is lost or
counted twice. The inner optimizer state (AdamW moments) is never synchronised (DiLoCo §3).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shared.model import ModelConfig, loss_fn


class InnerState(NamedTuple):
    """Everything that evolves on a learner between uploads."""

    params: Any
    anchor: Any
    opt_state: Any


def inner_optimizer(
    peak_lr: float, warmup_steps: int, total_steps: int, weight_decay: float
) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay to 10% of the peak, plus gradient clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak_lr,
        warmup_steps=min(warmup_steps, max(total_steps - 1, 0)),
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=peak_lr * 0.1,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay),
    )


class InnerTrainer:
    """Jitted inner steps and the two sync operations (upload, rebase) of one learner."""

    def __init__(self, cfg: ModelConfig, optimizer: optax.GradientTransformation) -> None:
        self.cfg = cfg
        self.optimizer = optimizer

        def train_step(state: InnerState, batch: jax.Array) -> tuple[InnerState, jax.Array]:
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, cfg)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            return InnerState(params, state.anchor, opt_state), loss

        def take_pseudo_gradient(state: InnerState) -> tuple[InnerState, Any]:
            pseudo_grad = jax.tree_util.tree_map(jnp.subtract, state.anchor, state.params)
            return InnerState(state.params, state.params, state.opt_state), pseudo_grad

        def rebase(state: InnerState, global_params: Any) -> InnerState:
            params = jax.tree_util.tree_map(
                lambda g, p, a: g + (p - a), global_params, state.params, state.anchor
            )
            return InnerState(params, global_params, state.opt_state)

        self._train_step = jax.jit(train_step)
        self._take = jax.jit(take_pseudo_gradient)
        self._rebase = jax.jit(rebase)

    def init(self, params: Any) -> InnerState:
        """State at the start: local params = anchor = the given global params."""
        return InnerState(params, params, self.optimizer.init(params))

    def step(self, state: InnerState, batch: jax.Array) -> tuple[InnerState, jax.Array]:
        """One inner AdamW step on ``batch`` (int32, (B, T+1)); returns the new state and loss."""
        return self._train_step(state, batch)

    def take_pseudo_gradient(self, state: InnerState) -> tuple[InnerState, Any]:
        """Return Δ = anchor − θ_local and the state with the anchor moved to θ_local."""
        return self._take(state)

    def rebase(self, state: InnerState, global_params: Any) -> InnerState:
        """Adopt new global params, keeping the local progress not yet uploaded."""
        return self._rebase(state, global_params)
