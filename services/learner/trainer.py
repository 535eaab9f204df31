"""The learner's inner optimizer: jitted AdamW steps with warm-up and cosine decay.

Besides θ_local (``params``) the state carries the *anchor*, the point that the local progress
not yet uploaded is measured from (``services/learner/core.py`` moves it). The inner optimizer
state (AdamW moments) is never synchronised between units (DiLoCo, arXiv 2311.08105, §3).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from shared.model import ModelConfig, loss_fn
from shared.settings.algorithm import END_LR, INNER_B1, INNER_B2


class InnerState(NamedTuple):
    """Everything that evolves on a learner between uploads."""

    params: Any
    anchor: Any
    opt_state: Any


def inner_optimizer(
    peak_lr: float, warmup_steps: int, total_steps: int, weight_decay: float
) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay to ``END_LR`` of the peak, plus gradient
    clipping (``services/outer/peers.py`` sums the same schedule)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak_lr,
        warmup_steps=min(warmup_steps, max(total_steps - 1, 0)),
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=peak_lr * END_LR,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=INNER_B1, b2=INNER_B2, weight_decay=weight_decay),
    )


class InnerTrainer:
    """Jitted inner steps of one learner."""

    def __init__(self, cfg: ModelConfig, optimizer: optax.GradientTransformation) -> None:
        self.cfg = cfg
        self.optimizer = optimizer

        def train_step(params: Any, opt_state: Any, batch: jax.Array):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._train_step = jax.jit(train_step)
        # One compiled program (op by op, the optimizer's zeros were one small program each).
        self._init_opt_state = jax.jit(optimizer.init)

    def init(self, params: Any) -> InnerState:
        """State at the start: local params = anchor = the given global params."""
        return InnerState(params, params, self._init_opt_state(params))

    def step(self, state: InnerState, batch: jax.Array) -> tuple[InnerState, jax.Array]:
        """One inner AdamW step on ``batch`` (int32, (B, T+1)); returns the new state and loss."""
        params, opt_state, loss = self._train_step(state.params, state.opt_state, batch)
        return InnerState(params, state.anchor, opt_state), loss
