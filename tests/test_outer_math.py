"""Outer optimizer math: Nesterov as in DiLoCo, polynomial staleness weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from services.outer.optimizer import init_outer, make_outer_step, nesterov_outer, staleness_weight


def test_nesterov_matches_the_diloco_formula():
    lr, beta = 0.7, 0.9
    optimizer = nesterov_outer(lr, beta)
    state = init_outer(optimizer, {"w": jnp.ones(3)})
    step = make_outer_step(optimizer)
    theta, m = np.ones(3), np.zeros(3)
    params, opt_state = state.params, state.opt_state
    for delta in (np.array([1.0, -2.0, 0.5]), np.array([0.1, 0.2, -0.3])):
        params, opt_state = step(params, opt_state, {"w": jnp.asarray(delta)}, np.float32(1.0))
        m = beta * m + delta
        theta = theta - lr * (delta + beta * m)
        np.testing.assert_allclose(params["w"], theta, rtol=1e-6)


def test_weight_scales_the_pseudo_gradient():
    optimizer = nesterov_outer(1.0, 0.0)
    state = init_outer(optimizer, {"w": jnp.zeros(2)})
    params, _ = make_outer_step(optimizer)(
        state.params, state.opt_state, {"w": jnp.array([2.0, 4.0])}, np.float32(0.5)
    )
    np.testing.assert_allclose(params["w"], [-1.0, -2.0])


def test_staleness_weight():
    assert staleness_weight(0, 0.5) == 1.0
    assert staleness_weight(3, 0.5) == pytest.approx(0.5)
    assert staleness_weight(10, 0.0) == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1, 0.5)
