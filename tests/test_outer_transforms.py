"""Outer-side pure math: staleness rules, token weights, merging, outer optimizers.

Every check compares against an independent NumPy (float64) reference on tiny float32 pytrees
with fixed tolerances; the optimizer steps run under ``jax.jit`` through ``make_outer_step``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from services.outer.merge import combine, token_weight
from services.outer.optimizer import (
    DelayedNesterovState,
    make_outer_optimizer,
    make_outer_step,
    make_outer_steps,
    momentum_of,
)
from services.outer.staleness import StalenessRule

SHAPES = {"a": (3,), "b": (2, 2)}
RTOL = 1e-5
ATOL = 1e-6
STALENESS = np.arange(21)


def rand_tree(rng: np.random.Generator, scale: float = 1.0) -> dict[str, jax.Array]:
    return {
        k: jnp.asarray(scale * rng.standard_normal(shape), dtype=jnp.float32)
        for k, shape in SHAPES.items()
    }


def to_np(tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in tree.items()}


def assert_tree_close(actual, expected, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert set(actual) == set(expected)
    for k in expected:
        np.testing.assert_allclose(
            np.asarray(actual[k], dtype=np.float64),
            np.asarray(expected[k], dtype=np.float64),
            rtol=rtol,
            atol=atol,
            err_msg=f"leaf {k!r}",
        )


# --------------------------------------------------------------------------- staleness


def _ref_weight(rule: str, a: float, b: float, s: np.ndarray) -> np.ndarray:
    s = s.astype(np.float64)
    if rule == "constant":
        return np.ones_like(s)
    if rule == "polynomial":
        return (1.0 + s) ** (-a)
    if rule == "hinge":
        return np.where(s <= b, 1.0, 1.0 / (a * np.maximum(s - b, 0.0) + 1.0))
    return np.exp(-a * s)


@pytest.mark.parametrize(
    ("rule", "a", "b"),
    [
        ("constant", 0.5, 0.0),
        ("polynomial", 0.5, 0.0),
        ("polynomial", 1.7, 0.0),
        ("hinge", 0.5, 4.0),
        ("hinge", 10.0, 0.0),
        ("hinge", 2.0, 2.5),
        ("exponential", 0.3, 0.0),
        ("exponential", 1.0, 0.0),
    ],
)
def test_staleness_rule_matches_its_formula(rule, a, b):
    sr = StalenessRule(rule, a, b, None)
    expected = _ref_weight(rule, a, b, STALENESS)
    scalar = np.array([float(sr.weight(int(s))) for s in STALENESS])
    np.testing.assert_allclose(scalar, expected, rtol=RTOL, atol=0)
    vector = np.asarray(sr.weight(STALENESS))
    np.testing.assert_allclose(vector, expected, rtol=RTOL, atol=0)
    assert np.all(vector > 0) and np.all(vector <= 1.0)
    assert np.all(np.diff(vector) <= 0), "weights must not grow with staleness"


def test_hinge_boundary():
    sr = StalenessRule("hinge", 2.0, 3.0, None)
    assert float(sr.weight(0)) == 1.0
    assert float(sr.weight(3)) == 1.0  # s == b keeps full weight
    assert float(sr.weight(4)) == pytest.approx(1.0 / 3.0, rel=1e-6)  # 1 / (2·1 + 1)
    assert float(sr.weight(5)) == pytest.approx(1.0 / 5.0, rel=1e-6)


@pytest.mark.parametrize("rule", ["polynomial", "exponential", "hinge"])
def test_zero_exponent_gives_weight_one(rule):
    sr = StalenessRule(rule, 0.0, 0.0, None)
    np.testing.assert_array_equal(np.asarray(sr.weight(STALENESS)), np.ones(len(STALENESS)))


def test_accepts_cutoff_boundary():
    sr = StalenessRule("polynomial", 0.5, 0.0, 5)
    assert sr.accepts(0)
    assert sr.accepts(5)
    assert not sr.accepts(6)
    assert not sr.accepts(100)
    zero = StalenessRule("polynomial", 0.5, 0.0, 0)
    assert zero.accepts(0)
    assert not zero.accepts(1)
    assert StalenessRule("polynomial", 0.5, 0.0, None).accepts(10**9)


def test_negative_staleness_raises():
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        StalenessRule("polynomial", 0.5, 0.0, None).accepts(-1)
    with pytest.raises(ValueError):
        StalenessRule("polynomial", 0.5, 0.0, 3).accepts(-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rule": "linear"},
        {"rule": ""},
        {"a": -0.1},
        {"rule": "hinge", "b": -1.0},
        {"max_staleness": -1},
    ],
)
def test_invalid_staleness_rule_raises(kwargs):
    with pytest.raises(ValueError):
        StalenessRule(**{"rule": "polynomial", "a": 0.5, "b": 0.0, "max_staleness": None, **kwargs})


@pytest.mark.parametrize("rule", ["constant", "polynomial", "hinge", "exponential"])
def test_weight_under_jit_on_int32(rule):
    sr = StalenessRule(rule, 0.7, 2.0, None)
    s = jnp.arange(21, dtype=jnp.int32)
    out = jax.jit(sr.weight)(s)
    assert out.dtype == jnp.float32
    assert out.shape == (21,)
    np.testing.assert_allclose(
        np.asarray(out), _ref_weight(rule, 0.7, 2.0, STALENESS), rtol=RTOL, atol=0
    )


# --------------------------------------------------------------------------- token weights


def test_token_weight_formulas():
    assert token_weight("uniform", 12345, 7) == 1.0
    assert token_weight("uniform", 0, 1) == 1.0
    assert token_weight("tokens", 12345, 7) == 12345.0
    assert token_weight("tokens2_per_step", 1000, 10) == pytest.approx(1e5, rel=1e-12)
    tokens, steps = 4096 * 512 * 50, 50
    assert token_weight("tokens2_per_step", tokens, steps) == pytest.approx(
        tokens * tokens / steps, rel=1e-12
    )
    # Same tokens in fewer steps (larger batches) weighs more: "quantity x quality".
    assert token_weight("tokens2_per_step", 1000, 5) > token_weight("tokens2_per_step", 1000, 10)


@pytest.mark.parametrize(("tokens", "steps"), [(100, 0), (100, -1), (-1, 1)])
def test_token_weight_bad_counts_raise(tokens, steps):
    for kind in ("uniform", "tokens", "tokens2_per_step"):
        with pytest.raises(ValueError):
            token_weight(kind, tokens, steps)


def test_token_weight_unknown_kind_raises():
    with pytest.raises(ValueError, match="token weighting"):
        token_weight("tokens_squared", 100, 1)


# --------------------------------------------------------------------------- combine


def _ref_weighted(updates, weights, scales):
    w = np.asarray(weights, dtype=np.float64)
    s = np.asarray(scales, dtype=np.float64)
    out = {}
    for k in SHAPES:
        xs = np.stack([to_np(u)[k] for u in updates])
        out[k] = np.tensordot(s * w, xs, axes=1) / w.sum()
    return out


def _ref_rda(updates, weights, scales):
    w = np.asarray(weights, dtype=np.float64)
    s = np.asarray(scales, dtype=np.float64)
    out = {}
    for k in SHAPES:
        xs = np.stack([to_np(u)[k] for u in updates])
        norms = np.sqrt((xs.reshape(len(xs), -1) ** 2).sum(axis=1))
        dirs = xs / norms.reshape((-1,) + (1,) * (xs.ndim - 1))
        mean_dir = np.tensordot(w, dirs, axes=1) / w.sum()
        radius = (w * s * norms).sum() / w.sum()
        out[k] = radius * mean_dir / np.linalg.norm(mean_dir)
    return out


def test_weighted_matches_numpy_reference():
    rng = np.random.default_rng(0)
    for m in (2, 3, 5):
        updates = [rand_tree(rng) for _ in range(m)]
        weights = list(rng.uniform(0.1, 5.0, m))
        scales = list(rng.uniform(0.2, 1.0, m))
        assert_tree_close(
            combine("weighted", updates, weights, scales), _ref_weighted(updates, weights, scales)
        )


def test_weighted_scales_are_not_normalised_away():
    rng = np.random.default_rng(1)
    u = rand_tree(rng)
    merged = combine("weighted", [u, u], [1.0, 3.0], [0.5, 0.5])
    assert_tree_close(merged, {k: 0.5 * v for k, v in to_np(u).items()})


@pytest.mark.parametrize("kind", ["weighted", "rda"])
def test_single_update_returns_scaled_update(kind):
    rng = np.random.default_rng(2)
    u = rand_tree(rng)
    merged = combine(kind, [u], [123.0], [0.37])
    assert_tree_close(merged, {k: 0.37 * v for k, v in to_np(u).items()})


@pytest.mark.parametrize("kind", ["weighted", "rda"])
def test_common_weight_rescaling_is_invariant(kind):
    rng = np.random.default_rng(3)
    updates = [rand_tree(rng) for _ in range(3)]
    scales = [1.0, 0.6, 0.3]
    # tokens²/steps weights are ~1e10; multiplying by 1e9 on top must change nothing.
    counts = ((2**20, 8), (3**12, 5), (7**7, 3))
    weights = [token_weight("tokens2_per_step", t, st) for t, st in counts]
    base = combine(kind, updates, weights, scales)
    huge = combine(kind, updates, [w * 1e9 for w in weights], scales)
    tiny = combine(kind, updates, [w / weights[0] for w in weights], scales)
    assert_tree_close(huge, base)
    assert_tree_close(tiny, base)
    for v in huge.values():
        assert np.all(np.isfinite(np.asarray(v)))


def test_rda_equals_weighted_when_all_updates_point_the_same_way():
    rng = np.random.default_rng(4)
    direction = rand_tree(rng)
    coefs = [{"a": 0.5, "b": 3.0}, {"a": 2.0, "b": 0.1}, {"a": 7.0, "b": 1.0}]
    updates = [{k: c[k] * direction[k] for k in SHAPES} for c in coefs]
    weights = [1.0, 2.5, 0.4]
    scales = [1.0, 0.7, 0.45]
    rda = combine("rda", updates, weights, scales)
    assert_tree_close(rda, combine("weighted", updates, weights, scales))
    assert_tree_close(rda, _ref_weighted(updates, weights, scales))


def _orthogonal_pair(rng: np.random.Generator, shape: tuple[int, ...]):
    x = rng.standard_normal(int(np.prod(shape)))
    y = rng.standard_normal(x.size)
    y -= (y @ x) / (x @ x) * x
    return x.reshape(shape), 3.0 * y.reshape(shape)


def test_rda_keeps_the_mean_norm_for_orthogonal_updates():
    rng = np.random.default_rng(5)
    pairs = {k: _orthogonal_pair(rng, shape) for k, shape in SHAPES.items()}
    updates = [{k: jnp.asarray(p[i], jnp.float32) for k, p in pairs.items()} for i in (0, 1)]
    weights = [2.0, 1.0]
    scales = [1.0, 0.8]
    rda = combine("rda", updates, weights, scales)
    avg = combine("weighted", updates, weights, scales)
    w, s = np.array(weights), np.array(scales)
    for k in SHAPES:
        norms = np.array([np.linalg.norm(to_np(u)[k]) for u in updates])
        expected_norm = (w * s * norms).sum() / w.sum()
        rda_norm = np.linalg.norm(np.asarray(rda[k], np.float64))
        avg_norm = np.linalg.norm(np.asarray(avg[k], np.float64))
        assert rda_norm == pytest.approx(expected_norm, rel=RTOL)
        assert rda_norm > avg_norm * 1.05, k
    assert_tree_close(rda, _ref_rda(updates, weights, scales))


def test_rda_matches_numpy_reference_on_random_updates():
    rng = np.random.default_rng(6)
    updates = [rand_tree(rng, scale=s) for s in (0.5, 1.0, 4.0)]
    weights = [1.0, 3.0, 0.5]
    scales = [0.9, 1.0, 0.2]
    assert_tree_close(combine("rda", updates, weights, scales), _ref_rda(updates, weights, scales))


def test_rda_falls_back_to_weighted_when_updates_cancel():
    rng = np.random.default_rng(7)
    v = rand_tree(rng)
    other = rand_tree(rng)
    # Leaf "a" cancels exactly (v and -v with equal weights); leaf "b" does not.
    updates = [
        {"a": v["a"], "b": v["b"]},
        {"a": -v["a"], "b": other["b"]},
    ]
    weights = [5.0, 5.0]
    scales = [1.0, 0.5]
    rda = combine("rda", updates, weights, scales)
    ref_w = _ref_weighted(updates, weights, scales)
    np.testing.assert_allclose(np.asarray(rda["a"]), ref_w["a"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        np.asarray(rda["a"]), 0.25 * to_np(v)["a"], rtol=RTOL, atol=ATOL
    )  # (1·v − 0.5·v) / 2
    np.testing.assert_allclose(
        np.asarray(rda["b"]), _ref_rda(updates, weights, scales)["b"], rtol=RTOL, atol=ATOL
    )
    for leaf in rda.values():
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_rda_all_zero_updates_give_zero():
    zero = {k: jnp.zeros(shape, jnp.float32) for k, shape in SHAPES.items()}
    rda = combine("rda", [zero, zero], [1.0, 2.0], [1.0, 1.0])
    for leaf in rda.values():
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)


@pytest.mark.parametrize("kind", ["median", "trimmed_mean"])
def test_a_robust_combine_keeps_one_huge_update_among_honest_ones_in_their_range(kind):
    rng = np.random.default_rng(5)
    honest = [{"w": rng.standard_normal((6, 3)).astype(np.float32)} for _ in range(4)]
    huge = {"w": np.full((6, 3), 1e6, np.float32)}
    # The huge update also claims all the tokens: the robust combines ignore the weights.
    merged = combine(kind, [*honest, huge], [1.0] * 4 + [1e9], [1.0] * 5)["w"]
    stack = np.stack([u["w"] for u in honest])
    assert np.all(merged <= stack.max(axis=0) + 1e-6) and np.all(merged >= stack.min(axis=0) - 1e-6)
    plain = combine("weighted", [*honest, huge], [1.0] * 5, [1.0] * 5)["w"]
    assert np.abs(plain).min() > 1e5  # the plain average is taken over


def test_robust_combines_match_numpy_and_apply_the_staleness_scales():
    rng = np.random.default_rng(6)
    updates = [{"w": rng.standard_normal((4, 5)).astype(np.float32)} for _ in range(8)]
    scales = [1.0, 0.5, 1.0, 0.25, 1.0, 1.0, 0.5, 1.0]
    scaled = np.stack([s * u["w"] for s, u in zip(scales, updates, strict=True)])
    np.testing.assert_allclose(
        combine("median", updates, [1.0] * 8, scales)["w"], np.median(scaled, axis=0), rtol=1e-6
    )
    expected = np.sort(scaled, axis=0)[2:6].mean(axis=0)  # 8 values: 2 dropped at each end
    np.testing.assert_allclose(
        combine("trimmed_mean", updates, [1.0] * 8, scales)["w"], expected, rtol=1e-5
    )


def test_combine_errors():
    rng = np.random.default_rng(8)
    u = [rand_tree(rng) for _ in range(3)]
    for kind in ("weighted", "rda"):
        with pytest.raises(ValueError):
            combine(kind, u, [1.0, 1.0], [1.0, 1.0, 1.0])
        with pytest.raises(ValueError):
            combine(kind, u, [1.0, 1.0, 1.0], [1.0, 1.0])
        with pytest.raises(ValueError):
            combine(kind, [], [], [])
        with pytest.raises(ValueError, match="total token weight"):
            combine(kind, u, [0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
        with pytest.raises(ValueError, match="total token weight"):
            combine(kind, u[:1], [0.0], [1.0])
    with pytest.raises(ValueError, match="combine must be one of"):
        combine("mean", u, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="combine must be one of"):
        combine("mean", u[:1], [1.0], [1.0])


# --------------------------------------------------------------------------- optimizers


def _run(name, lr, grads, momentum=0.9, period=1, params=None):
    """Apply ``grads`` one by one through the jitted outer step; return params after each."""
    opt = make_outer_optimizer(name, lr, momentum, period)
    params = params if params is not None else rand_tree(np.random.default_rng(99))
    state = opt.init(params)
    step = make_outer_step(opt)
    history = []
    for g in grads:
        params, state, *_ = step(params, state, g)
        history.append(params)
    return history, state


def test_sgd():
    rng = np.random.default_rng(10)
    theta0 = rand_tree(rng)
    grads = [rand_tree(rng) for _ in range(3)]
    lr = 0.7
    history, _ = _run("sgd", lr, grads, params=theta0)
    theta = to_np(theta0)
    for g, got in zip(grads, history, strict=True):
        theta = {k: theta[k] - lr * to_np(g)[k] for k in SHAPES}
        assert_tree_close(got, theta)


def test_nesterov_matches_formula_over_three_steps():
    rng = np.random.default_rng(11)
    theta0 = rand_tree(rng)
    grads = [rand_tree(rng) for _ in range(3)]
    lr, beta = 0.7, 0.9
    history, _ = _run("nesterov", lr, grads, momentum=beta, params=theta0)
    theta = to_np(theta0)
    m = {k: np.zeros(shape) for k, shape in SHAPES.items()}
    for g, got in zip(grads, history, strict=True):
        g = to_np(g)
        m = {k: beta * m[k] + g[k] for k in SHAPES}
        theta = {k: theta[k] - lr * (g[k] + beta * m[k]) for k in SHAPES}
        assert_tree_close(got, theta)


@pytest.mark.parametrize("period", [1, 2, 4])
def test_delayed_nesterov_over_equal_arrivals_is_one_nesterov_step(period):
    rng = np.random.default_rng(20 + period)
    theta0 = rand_tree(rng)
    g1, g2, g3 = (rand_tree(rng) for _ in range(3))
    lr, beta = 0.6, 0.8
    # Three full periods: the first from zero momentum, the later ones from the nonzero
    # momentum the earlier periods left behind.
    arrivals = [g1] * period + [g2] * period + [g3] * period
    dn, dn_state = _run("delayed_nesterov", lr, arrivals, beta, period, params=theta0)
    nest, nest_state = _run("nesterov", lr, [g1, g2, g3], beta, params=theta0)
    for i in range(3):
        assert_tree_close(dn[(i + 1) * period - 1], nest[i])
    assert isinstance(dn_state, DelayedNesterovState)
    assert int(dn_state.count) == 3 * period
    m_ref = {k: np.zeros(shape) for k, shape in SHAPES.items()}
    for g in (g1, g2, g3):
        m_ref = {k: beta * m_ref[k] + to_np(g)[k] for k in SHAPES}
    assert_tree_close(dn_state.momentum, m_ref)
    assert_tree_close(dn_state.accumulated, {k: np.zeros(s) for k, s in SHAPES.items()})


@pytest.mark.parametrize("period", [2, 3, 4])
def test_delayed_nesterov_period_net_step_is_nesterov_on_the_mean(period):
    """Unequal arrivals: the net move over a period is one Nesterov step on their mean."""
    rng = np.random.default_rng(30 + period)
    theta0 = rand_tree(rng)
    lr, beta = 0.5, 0.9
    arrivals = [rand_tree(rng) for _ in range(2 * period)]
    dn, _ = _run("delayed_nesterov", lr, arrivals, beta, period, params=theta0)
    chunks = [arrivals[i * period : (i + 1) * period] for i in range(2)]
    means = [{k: np.mean([to_np(g)[k] for g in chunk], 0) for k in SHAPES} for chunk in chunks]
    theta = to_np(theta0)
    m = {k: np.zeros(shape) for k, shape in SHAPES.items()}
    for i, mean in enumerate(means):
        m = {k: beta * m[k] + mean[k] for k in SHAPES}
        theta = {k: theta[k] - lr * (mean[k] + beta * m[k]) for k in SHAPES}
        assert_tree_close(dn[(i + 1) * period - 1], theta)


def test_delayed_nesterov_period_one_is_nesterov_step_for_step():
    rng = np.random.default_rng(40)
    theta0 = rand_tree(rng)
    grads = [rand_tree(rng) for _ in range(5)]
    dn, _ = _run("delayed_nesterov", 0.8, grads, 0.9, 1, params=theta0)
    nest, _ = _run("nesterov", 0.8, grads, 0.9, params=theta0)
    for a, b in zip(dn, nest, strict=True):
        assert_tree_close(a, b)


def test_delayed_nesterov_between_milestones_is_sgd_on_g_over_n():
    period, lr, beta = 4, 0.5, 0.9
    rng = np.random.default_rng(50)
    theta0 = rand_tree(rng)
    opt = make_outer_optimizer("delayed_nesterov", lr, beta, period)
    step = make_outer_step(opt)
    params, state = theta0, opt.init(theta0)
    # One full period first so the momentum is nonzero.
    for _ in range(period):
        params, state, *_ = step(params, state, rand_tree(rng))
    momentum = to_np(state.momentum)
    assert any(np.abs(v).max() > 0 for v in momentum.values())
    acc = {k: np.zeros(shape) for k, shape in SHAPES.items()}
    for i in range(period - 1):
        g = rand_tree(rng)
        before = to_np(params)
        params, state, *_ = step(params, state, g)
        expected = {k: before[k] - lr * to_np(g)[k] / period for k in SHAPES}
        assert_tree_close(params, expected)
        assert_tree_close(state.momentum, momentum, rtol=0, atol=0)  # untouched
        acc = {k: acc[k] + to_np(g)[k] for k in SHAPES}
        assert_tree_close(state.accumulated, acc)
        assert int(state.count) == period + i + 1


@pytest.mark.parametrize("period", [2, 4])
def test_delayed_nesterov_merges_of_n_arrivals_are_nesterov_step_for_step(period):
    """A round of N units merged as one update (their mean, ``arrivals=N``) is one Nesterov
    step on it: synchronous DiLoCo, not a N-th of one."""
    rng = np.random.default_rng(70 + period)
    theta0 = rand_tree(rng)
    means = [rand_tree(rng) for _ in range(3)]
    lr, beta = 0.7, 0.9
    opt = make_outer_optimizer("delayed_nesterov", lr, beta, period)
    step = make_outer_step(opt)
    params, state = theta0, opt.init(theta0)
    nest, _ = _run("nesterov", lr, means, beta, params=theta0)
    for mean, expected in zip(means, nest, strict=True):
        params, state, *_ = step(params, state, mean, 1.0, period)
        assert_tree_close(params, expected)
    assert int(state.count) == 3 * period


def test_delayed_nesterov_merge_of_k_arrivals_counts_k_of_them():
    """Below a milestone a merge of the mean of k arrivals moves the params by lr·k·g/N, as its
    k arrivals one by one would; a merge that reaches a milestone takes the momentum step."""
    period, lr, beta = 4, 0.5, 0.9
    rng = np.random.default_rng(80)
    theta0 = rand_tree(rng)
    g1, g2 = rand_tree(rng), rand_tree(rng)
    opt = make_outer_optimizer("delayed_nesterov", lr, beta, period)
    step = make_outer_step(opt)
    params, state, *_ = step(theta0, opt.init(theta0), g1, 1.0, 2)
    one_by_one, _ = _run("delayed_nesterov", lr, [g1, g1], beta, period, params=theta0)
    assert_tree_close(params, one_by_one[-1])
    assert int(state.count) == 2
    # Two more (count 4): the milestone, over the period's mean (g1 + g2) / 2.
    params, state, *_ = step(params, state, g2, 1.0, 2)
    reference, _ = _run("delayed_nesterov", lr, [g1, g1, g2, g2], beta, period, params=theta0)
    assert_tree_close(params, reference[-1])
    assert int(state.count) == 4
    assert_tree_close(state.accumulated, {k: np.zeros(s) for k, s in SHAPES.items()})


def test_outer_step_is_jitted_and_does_not_retrace():
    opt = make_outer_optimizer("delayed_nesterov", 0.7, 0.9, 3)
    step = make_outer_step(opt)
    rng = np.random.default_rng(60)
    params = rand_tree(rng)
    state = opt.init(params)
    for _ in range(7):
        params, state, *_ = step(params, state, rand_tree(rng))
    assert step._cache_size() == 1
    assert state.count.dtype == jnp.int32
    for leaf in jax.tree_util.tree_leaves((params, state)):
        assert np.all(np.isfinite(np.asarray(leaf)))


@pytest.mark.parametrize(
    ("name", "lr", "momentum", "period"),
    [
        ("adam", 0.7, 0.9, 1),
        ("sgd", 0.0, 0.9, 1),
        ("nesterov", -0.1, 0.9, 1),
        ("delayed_nesterov", 0.0, 0.9, 2),
        ("nesterov", 0.7, 1.0, 1),
        ("delayed_nesterov", 0.7, 1.5, 2),
        ("nesterov", 0.7, -0.1, 1),
        ("delayed_nesterov", 0.7, 0.9, 0),
        ("delayed_nesterov", 0.7, 0.9, -3),
    ],
)
def test_invalid_outer_hyperparameters_raise(name, lr, momentum, period):
    with pytest.raises(ValueError):
        make_outer_optimizer(name, lr, momentum, period)


def test_valid_edge_hyperparameters_build():
    # momentum 0 is allowed and reduces Nesterov to SGD.
    rng = np.random.default_rng(70)
    theta0 = rand_tree(rng)
    grads = [rand_tree(rng) for _ in range(2)]
    nest, _ = _run("nesterov", 0.3, grads, momentum=0.0, params=theta0)
    sgd, _ = _run("sgd", 0.3, grads, params=theta0)
    for a, b in zip(nest, sgd, strict=True):
        assert_tree_close(a, b)


@pytest.mark.parametrize("name", ["sgd", "nesterov", "delayed_nesterov"])
def test_outer_step_reports_the_size_of_its_change_of_the_momentum_and_of_the_params(name):
    opt = make_outer_optimizer(name, 0.7, 0.9, 2)
    step = make_outer_step(opt)
    rng = np.random.default_rng(70)
    params = rand_tree(rng)
    state = opt.init(params)
    for _ in range(3):
        before = to_np(params)
        params, state, update_norm, momentum_norm, params_norm = step(params, state, rand_tree(rng))
        change = np.sqrt(sum(np.sum((to_np(params)[k] - before[k]) ** 2) for k in SHAPES))
        np.testing.assert_allclose(float(update_norm), change, rtol=1e-4)
        size = np.sqrt(sum(np.sum(to_np(params)[k] ** 2) for k in SHAPES))
        np.testing.assert_allclose(float(params_norm), size, rtol=1e-5)
        momentum = momentum_of(state)
        if name == "sgd":
            assert momentum is None and float(momentum_norm) == 0.0
        else:
            expected = np.sqrt(sum(np.sum(v**2) for v in to_np(momentum).values()))
            np.testing.assert_allclose(float(momentum_norm), expected, rtol=1e-5)


@pytest.mark.parametrize("name", ["sgd", "nesterov", "delayed_nesterov"])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_steps_run_together_equal_the_steps_one_by_one(name, count):
    """``make_outer_steps`` applies updates in turn, each with its own freshness and scale, as
    the one-step program would one by one (up to float rounding: XLA fuses their arithmetic);
    it reports the norm of their change together, of the momentum left and of the params."""
    opt = make_outer_optimizer(name, 0.7, 0.9, 3)
    step, steps = make_outer_step(opt), make_outer_steps(opt)
    rng = np.random.default_rng(80 + count)
    start = rand_tree(rng)
    state = opt.init(start)
    for _ in range(2):  # a momentum to carry, and a milestone of Delayed Nesterov inside
        start, state, *_ = step(start, state, rand_tree(rng))
    grads = [rand_tree(rng) for _ in range(count)]
    freshness = tuple(float(f) for f in rng.uniform(0, 1, count))
    scales = tuple(float(f) for f in rng.uniform(0.2, 1, count))
    params, one_by_one = start, state
    for g, f, c in zip(grads, freshness, scales, strict=True):
        params, one_by_one, *_ = step(params, one_by_one, g, f, 1, c)
    out = steps(start, state, tuple(grads), freshness, (1,) * count, scales)
    assert_tree_close(out.params, params, rtol=1e-5, atol=1e-6)
    for got, want in zip(
        jax.tree_util.tree_leaves(out.opt_state), jax.tree_util.tree_leaves(one_by_one), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    change = np.sqrt(sum(np.sum((to_np(params)[k] - to_np(start)[k]) ** 2) for k in SHAPES))
    np.testing.assert_allclose(float(out.update_norm), change, rtol=1e-4)
    size = np.sqrt(sum(np.sum(to_np(params)[k] ** 2) for k in SHAPES))
    np.testing.assert_allclose(float(out.params_norm), size, rtol=1e-5)
    momentum = momentum_of(one_by_one)
    expected = (
        0.0 if momentum is None else np.sqrt(sum(np.sum(v**2) for v in to_np(momentum).values()))
    )
    np.testing.assert_allclose(float(out.momentum_norm), expected, rtol=1e-5)
