"""Tests for shared/model.py (and the evaluator in shared/evaluation.py). Uses the tiny size."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from shared.data import eval_batches  # noqa: E402
from shared.evaluation import make_evaluator  # noqa: E402
from shared.model import (  # noqa: E402
    SIZES,
    forward,
    get_config,
    init_params,
    loss_fn,
    param_count,
)

LN256 = math.log(256)

# Compile once and reuse across tests: op-by-op (eager) execution is what makes JAX tests slow.
init_jit = jax.jit(init_params, static_argnums=0)
forward_jit = jax.jit(forward, static_argnums=2)
loss_jit = jax.jit(loss_fn, static_argnums=2)


@pytest.fixture(scope="module")
def cfg():
    return get_config("tiny")


@pytest.fixture(scope="module")
def params(cfg):
    return init_jit(cfg, jax.random.key(0))


def random_tokens(key: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.randint(jax.random.key(key), shape, 0, 256, dtype=jnp.int32)


def count(name: str) -> int:
    """Parameter count of a size without allocating it (eval_shape only traces init)."""
    cfg = get_config(name)
    return param_count(jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0)))


def test_param_counts_in_stated_ranges(params):
    assert param_count(params) == count("tiny") <= 100_000
    assert 500_000 <= count("small") <= 1_000_000
    assert 8_000_000 <= count("medium") <= 12_000_000
    assert 80_000_000 <= count("large") <= 120_000_000


@pytest.mark.parametrize("name", ["tiny", "small", "medium", "large"])
def test_the_configs_formula_counts_the_params_the_model_builds(name):
    assert get_config(name).param_count == count(name)


@pytest.mark.parametrize("name", ["tiny", "small", "medium", "large"])
def test_the_configs_shapes_are_the_tensors_the_model_builds(name):
    cfg = get_config(name)
    traced = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    built = {
        jax.tree_util.keystr(path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(traced)[0]
    }
    assert list(cfg.param_shapes().items()) == list(built.items())  # same names, same order
    assert sum(math.prod(shape) for shape in built.values()) == cfg.param_count


def test_params_are_float32_and_deterministic(cfg, params):
    leaves = jax.tree_util.tree_leaves(params)
    assert all(leaf.dtype == jnp.float32 for leaf in leaves)
    again = init_jit(cfg, jax.random.key(0))
    assert all(
        np.array_equal(a, b) for a, b in zip(leaves, jax.tree_util.tree_leaves(again), strict=True)
    )
    other = init_jit(cfg, jax.random.key(1))
    assert not np.array_equal(params["wte"], other["wte"])


def test_forward_shapes(cfg, params):
    logits = forward_jit(params, random_tokens(1, (2, cfg.seq_len)), cfg)
    assert logits.shape == (2, cfg.seq_len, 256)
    assert logits.dtype == jnp.float32
    # Shorter sequences are fine; longer than the position table is a clear error.
    assert forward_jit(params, random_tokens(2, (2, 5)), cfg).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="seq_len"):
        forward_jit(params, random_tokens(3, (1, cfg.seq_len + 1)), cfg)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_init_loss_is_ln256(name):
    cfg = get_config(name)
    params = init_jit(cfg, jax.random.key(0))
    loss = loss_jit(params, random_tokens(4, (4, cfg.seq_len + 1)), cfg)
    assert loss.shape == ()
    assert abs(float(loss) - LN256) < 0.1


def test_causality(cfg, params):
    # The head is zero at init, which would make every logit 0 and this test vacuous.
    params = dict(params, head=0.5 * jax.random.normal(jax.random.key(5), params["head"].shape))
    tokens = random_tokens(6, (2, cfg.seq_len))
    t = cfg.seq_len // 2
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % 256)
    before, after = forward_jit(params, tokens, cfg), forward_jit(params, changed, cfg)
    np.testing.assert_allclose(before[:, :t], after[:, :t], atol=1e-6)
    # ...and the change is visible from position t on.
    assert not np.allclose(before[:, t:], after[:, t:], atol=1e-4)


def test_adamw_steps_reduce_loss(cfg, params):
    batch = random_tokens(7, (4, cfg.seq_len + 1))
    opt = optax.adamw(learning_rate=1e-2, weight_decay=0.01)

    @jax.jit
    def train_step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    p = params
    losses = []
    for _ in range(15):
        p, opt_state, loss = train_step(p, opt_state)
        losses.append(float(loss))
    final = float(loss_jit(p, batch, cfg))
    assert all(math.isfinite(x) for x in losses)
    assert final < losses[0] - 1.0, (losses, final)


def test_get_config_error_names_valid_sizes():
    with pytest.raises(ValueError) as info:
        get_config("huge")
    for name in SIZES:
        assert name in str(info.value)
    assert set(SIZES) == {"tiny", "small", "medium", "large"}
    assert all(cfg.name == name and cfg.vocab_size == 256 for name, cfg in SIZES.items())


def test_loss_under_jit(cfg, params):
    # A random head, so the loss is not exactly ln 256 for any implementation.
    params = dict(params, head=0.5 * jax.random.normal(jax.random.key(9), params["head"].shape))
    batch = random_tokens(8, (2, 9))  # short, so the eager (op-by-op) reference stays quick
    eager = loss_fn(params, batch, cfg)
    jitted = loss_jit(params, batch, cfg)
    also_jitted = jax.jit(functools.partial(loss_fn, cfg=cfg))(params, batch)
    assert jitted.shape == () and jitted.dtype == jnp.float32
    assert abs(float(eager) - LN256) > 0.01
    np.testing.assert_allclose(eager, jitted, rtol=1e-5)
    np.testing.assert_allclose(eager, also_jitted, rtol=1e-5)
    # Gradients under jit are exercised by test_adamw_steps_reduce_loss.


def test_evaluator_matches_loss(cfg, params):
    heldout = np.frombuffer(bytes(range(256)) * 8, dtype=np.uint8)
    batches = eval_batches(heldout, cfg.seq_len, batch_size=2, num_batches=3)
    result = make_evaluator(cfg, batches)(params)
    expected = np.mean([float(loss_jit(params, jnp.asarray(b), cfg)) for b in batches])
    assert result.num_bytes == 3 * 2 * cfg.seq_len
    assert result.nats_per_byte == pytest.approx(expected, rel=1e-5)
    assert result.bits_per_byte == pytest.approx(result.nats_per_byte / math.log(2))
    assert result.nats_per_byte == pytest.approx(LN256, abs=0.1)
