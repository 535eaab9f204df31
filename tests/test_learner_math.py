"""The learner's sync math: pseudo-gradients and rebasing keep every step counted exactly once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from services.learner.trainer import InnerTrainer, inner_optimizer
from shared import model

CFG = model.get_config("tiny")


def make_trainer():
    return InnerTrainer(CFG, inner_optimizer(3e-3, 2, 20, 0.0))


def batch(seed):
    return jax.random.randint(jax.random.PRNGKey(seed), (4, CFG.seq_len + 1), 0, 256)


def close(a, b):
    return all(
        np.allclose(x, y, atol=1e-6)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def test_pseudo_gradient_is_anchor_minus_local_and_moves_the_anchor():
    trainer = make_trainer()
    params0 = model.init_params(CFG, jax.random.PRNGKey(0))
    state = trainer.init(params0)
    for i in range(3):
        state, _ = trainer.step(state, batch(i))
    local = state.params
    state, delta = trainer.take_pseudo_gradient(state)
    assert close(delta, jax.tree_util.tree_map(jnp.subtract, params0, local))
    assert close(state.anchor, local)
    # Nothing trained since: the next pseudo-gradient is zero.
    _, delta2 = trainer.take_pseudo_gradient(state)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree_util.tree_leaves(delta2))


def test_rebase_keeps_unsent_progress_on_top_of_the_new_global():
    trainer = make_trainer()
    params0 = model.init_params(CFG, jax.random.PRNGKey(0))
    state = trainer.init(params0)
    state, _ = trainer.step(state, batch(0))
    state, _ = trainer.take_pseudo_gradient(state)  # upload; anchor = local
    state, _ = trainer.step(state, batch(1))  # progress not yet uploaded
    unsent = jax.tree_util.tree_map(jnp.subtract, state.params, state.anchor)
    new_global = jax.tree_util.tree_map(lambda p: p + 0.5, params0)
    state = trainer.rebase(state, new_global)
    assert close(state.anchor, new_global)
    assert close(state.params, jax.tree_util.tree_map(jnp.add, new_global, unsent))
    # The next upload carries exactly the unsent progress (negated), nothing twice.
    _, delta = trainer.take_pseudo_gradient(state)
    assert close(delta, jax.tree_util.tree_map(jnp.negative, unsent))


def test_rebase_right_after_upload_replaces_local_by_global():
    trainer = make_trainer()
    state = trainer.init(model.init_params(CFG, jax.random.PRNGKey(0)))
    state, _ = trainer.step(state, batch(0))
    state, _ = trainer.take_pseudo_gradient(state)
    new_global = model.init_params(CFG, jax.random.PRNGKey(5))
    state = trainer.rebase(state, new_global)
    assert close(state.params, new_global)
