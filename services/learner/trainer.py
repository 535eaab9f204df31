"""The learner's inner optimizer: jitted AdamW steps with warm-up and cosine decay.

Besides θ_local (``params``) the state carries the *anchor*, the point that the local progress
not yet uploaded is measured from (``services/learner/core.py`` moves it). The inner optimizer
state (AdamW moments) is never synchronised between units (DiLoCo, arXiv 2311.08105, §3).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from services.learner.devices import UnitDevices
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
    """Jitted inner steps of one learner, on the unit's devices (``devices.py``): the batch
    split over them, the state replicated or sharded as the unit's layout says."""

    def __init__(
        self,
        cfg: ModelConfig,
        optimizer: optax.GradientTransformation,
        devices: UnitDevices | None = None,
    ) -> None:
        self.cfg = cfg
        self.optimizer = optimizer
        self.devices = devices or UnitDevices(jax.local_devices()[:1])
        self._state_shardings: Any = None

        def train_step(params: Any, opt_state: Any, batch: jax.Array):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._train_step = train_step
        self._init_opt_state = optimizer.init

    def _compile_for(self, params: Any) -> None:
        if self._state_shardings is None:
            self._compile(params)

    def _compile(self, params: Any) -> None:
        """Jit the step and the optimizer's init for the layout of ``params``: their results
        stay in it (XLA would otherwise choose where a sharded step's outputs live)."""
        opt_shapes = jax.eval_shape(self._init_opt_state, params)
        params_sh = self.devices.shardings(params)
        opt_sh = self.devices.shardings(opt_shapes)
        self._state_shardings = (params_sh, opt_sh)
        self._step = jax.jit(
            self._train_step, out_shardings=(params_sh, opt_sh, self.devices.replicated)
        )
        # One compiled program (op by op, the optimizer's zeros were one small program each).
        self._init = jax.jit(self._init_opt_state, out_shardings=opt_sh)

    def init(self, params: Any) -> InnerState:
        """State at the start: local params = anchor = the given global params, on the unit's
        devices."""
        self._compile_for(params)
        placed = self.devices.place(params)
        return InnerState(placed, placed, self._init(placed))

    def place(self, state: InnerState) -> InnerState:
        """``state`` (host or device arrays) in the unit's layout."""
        self._compile_for(state.params)
        params_sh, opt_sh = self._state_shardings
        return InnerState(
            jax.device_put(state.params, params_sh),
            jax.device_put(state.anchor, params_sh),
            jax.device_put(state.opt_state, opt_sh),
        )

    def step(self, state: InnerState, batch: np.ndarray) -> tuple[InnerState, jax.Array]:
        """One inner AdamW step on ``batch`` (int32, (B, T+1), B a multiple of the unit's
        devices); returns the new state and the loss."""
        self._compile_for(state.params)
        params, opt_state, loss = self._step(
            state.params, state.opt_state, self.devices.place_batch(batch)
        )
        return InnerState(params, state.anchor, opt_state), loss
