"""The outer's norm guard (``services/outer/norm_guard.py``), alone and inside ``OuterCore``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.outer.core import OuterCore
from services.outer.errors import Rejected
from services.outer.ledger import OuterLedger
from services.outer.norm_guard import MIN_HISTORY, WINDOW, NormGuard, update_norm
from services.outer.policy import Arrival
from tests.helpers import outer_algorithm


def test_the_norm_is_the_l2_norm_over_all_pieces():
    pieces = {"a": np.full((2, 2), 3.0, np.float32), "b": np.array([4.0], np.float32)}
    assert update_norm(pieces) == pytest.approx(np.sqrt(4 * 9 + 16))


def test_nothing_is_judged_before_the_fragment_has_history():
    guard = NormGuard(1, "reject", factor=10.0)
    guard.merged(0, [(0, 1.0)] * (MIN_HISTORY - 1))
    assert guard.bound(0) is None
    assert guard.judge(0, 1e9) == 1.0


def test_reject_refuses_an_update_above_factor_times_the_median_with_its_reason():
    guard = NormGuard(2, "reject", factor=10.0)
    guard.merged(0, [(u, norm) for u, norm in enumerate([1.0, 2.0, 3.0] * 4)])  # median 2
    assert guard.bound(0) == pytest.approx(20.0)
    assert guard.judge(0, 19.9) == 1.0
    with pytest.raises(Rejected) as info:
        guard.judge(0, 2000.0)
    assert info.value.reason == "norm_outlier" and "2000" in info.value.detail
    assert guard.bound(1) is None  # fragments are judged by their own history


def test_clip_scales_an_outlier_down_to_the_bound():
    guard = NormGuard(1, "clip", factor=10.0)
    guard.merged(0, [(0, 2.0)] * MIN_HISTORY)
    assert guard.judge(0, 400.0) == pytest.approx(20.0 / 400.0)
    assert guard.judge(0, 5.0) == 1.0


def test_off_never_judges():
    guard = NormGuard(1, "off")
    guard.merged(0, [(0, 1.0)] * WINDOW)
    assert guard.bound(0) is None and guard.judge(0, 1e12) == 1.0


def test_the_history_is_a_bounded_window_per_unit_and_round_trips():
    guard = NormGuard(2, "reject", factor=4.0)
    guard.merged(0, [(3, float(i)) for i in range(WINDOW + 10)] + [(1, 5.0)])
    history = guard.history()
    assert history[0] == {1: [5.0], 3: [float(i) for i in range(10, WINDOW + 10)]}
    assert history[1] == {}
    again = NormGuard(2, "reject", factor=4.0)
    again.restore(history)
    assert again.history() == history and again.bound(0) == guard.bound(0)


@pytest.mark.parametrize(
    ("history", "message"),
    [
        ([{0: [1.0]}], "fragments"),
        ([{0: [1.0]}, {2: [float("nan")]}], "finite"),
        ([{0: [-1.0]}, {}], "finite"),
    ],
)
def test_a_bad_history_is_refused(history, message):
    with pytest.raises(ValueError, match=message):
        NormGuard(2).restore(history)


def test_each_unit_has_one_voice_however_often_it_uploads():
    """A unit sending many small uploads (a few steps each, claiming a whole period) fills its
    own window, not the others': the reference stays the median of the units' medians, and
    an honest upload 5x the honest size still passes."""
    guard = NormGuard(1, "reject", factor=10.0)
    for _ in range(4):
        guard.merged(0, [(1, 1.0), (2, 1.2), (3, 0.9)])
        guard.merged(0, [(0, 0.01)] * 20)
    assert guard.reference(0) == pytest.approx(0.95)  # median of 0.01, 0.9, 1.0, 1.2
    assert guard.judge(0, 5.0) == 1.0
    with pytest.raises(Rejected):
        guard.judge(0, 10.0)


@pytest.mark.parametrize(
    ("mode", "factor"), [("nope", 10.0), ("reject", 1.0), ("clip", 0.5), ("off", float("nan"))]
)
def test_bad_settings_are_refused(mode, factor):
    with pytest.raises(ValueError):
        NormGuard(1, mode, factor)
    with pytest.raises(ValueError):
        dataclasses.replace(outer_algorithm(), norm_guard=mode, norm_guard_factor=factor)


# ---------------------------------------------------------------------------- inside the core

SHAPES = {"w": (64, 8), "b": (8,)}


def _core(mode: str) -> OuterCore:
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    return OuterCore(params, outer_algorithm(outer_optimizer="sgd", outer_lr=1.0, norm_guard=mode))


def _arrival(core: OuterCore, round_: int, scale: float) -> Arrival:
    rng = np.random.default_rng(round_)
    grad = {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in SHAPES.items()}
    return Arrival(
        unit=0,
        round=round_,
        base_version=core.version(0),
        inner_steps=10,
        tokens=100,
        pseudo_grad=grad,
        arrived_at=float(round_),
    )


def _honest_history(core: OuterCore) -> None:
    for round_ in range(MIN_HISTORY):
        core.offer(0, _arrival(core, round_, 1e-3))
        core.merge(0)


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a[k] - b[k]) ** 2) for k in a)))


def test_the_core_rejects_a_1000x_upload_and_the_params_do_not_move():
    core = _core("reject")
    _honest_history(core)
    before, version = core.fragment_params(0), core.version(0)
    with pytest.raises(Rejected, match="norm_outlier"):
        core.offer(0, _arrival(core, 99, 1.0))
    assert core.due(100.0) == [] and core.version(0) == version
    assert _distance(core.fragment_params(0), before) == 0.0
    core.offer(0, _arrival(core, 100, 1e-3))  # honest uploads after it are applied
    assert core.merge(0).version == version + 1


def test_without_the_guard_the_same_upload_moves_the_params_over_500_times_further():
    honest, hostile = _core("off"), _core("off")
    for core in (honest, hostile):
        _honest_history(core)
    before = honest.fragment_params(0)
    honest.offer(0, _arrival(honest, 99, 1e-3))
    hostile.offer(0, _arrival(hostile, 99, 1.0))
    honest.merge(0)
    hostile.merge(0)
    step = _distance(honest.fragment_params(0), before)
    wreck = _distance(hostile.fragment_params(0), before)
    assert wreck > 500 * step


def test_clip_applies_an_outlier_at_the_bound_and_the_books_count_it():
    core = _core("clip")
    _honest_history(core)
    bound = core.guard.bound(0)
    assert bound is not None
    before = core.fragment_params(0)
    core.offer(0, _arrival(core, 99, 1.0))
    result = core.merge(0)
    (arrival,) = result.arrivals
    assert arrival.clipped and arrival.norm == pytest.approx(bound, rel=1e-5)
    # Outer SGD with learning rate 1: the params moved by exactly the clipped update.
    assert _distance(core.fragment_params(0), before) == pytest.approx(bound, rel=1e-4)
    assert core.guard.history()[0][0][-1] == pytest.approx(bound, rel=1e-5)
    ledger = OuterLedger()
    ledger.merged(result.arrivals, result.staleness)
    assert ledger.to_record().clipped == 1


def test_adam_never_moves_a_coordinate_further_than_the_step_bound():
    """``adam_step_bound`` bounds AdamW's step per coordinate over adversarial gradients:
    constant, alternating, a spike after silence, growing and random ones."""
    import optax

    from services.outer.norm_guard import ADAM_STEP, adam_step_bound
    from shared.settings.algorithm import INNER_B1, INNER_B2

    assert pytest.approx(1.165, abs=1e-3) == ADAM_STEP
    # No momentum: a gradient after a long silence, |g| / √((1 − β2) g²) = √2 for β2 = 0.5.
    assert adam_step_bound(0.0, 0.5) == pytest.approx(np.sqrt(2))
    rng = np.random.default_rng(0)
    steps = 400
    spike = np.zeros(steps)
    spike[200] = 1.0
    sequences = {
        "constant": np.ones(steps),
        "alternating": np.where(np.arange(steps) % 2, 1.0, -1.0),
        "spike after silence": spike + 1e-12,
        "growing": 1.05 ** np.arange(steps),
        "decaying then flipped": np.concatenate([-(0.9 ** np.arange(50)), np.ones(steps - 50)]),
        "random": rng.standard_normal(steps),
        "heavy-tailed": rng.standard_cauchy(steps),
    }
    optimizer = optax.adamw(1.0, b1=INNER_B1, b2=INNER_B2, eps=0.0, weight_decay=0.0)
    for name, grads in sequences.items():
        params = np.zeros(1, np.float32)
        state = optimizer.init(params)
        largest = 0.0
        for g in grads:
            update, state = optimizer.update(np.array([g], np.float32), state, params)
            largest = max(largest, float(np.abs(update).max()))
        assert largest <= ADAM_STEP * (1 + 1e-5), (name, largest)


def test_the_prior_bound_judges_from_the_first_merge_and_holds_real_training():
    """With the learners' inner optimizer known, the guard has a bound before any history: what
    H AdamW steps can do. Real uploads of a tiny model trained for H steps are far inside it;
    one 1000x their size is rejected at the very first merge."""
    import jax

    from services.learner.core import LearnerCore
    from services.learner.trainer import InnerTrainer
    from shared import data, model, pytree
    from shared.settings.algorithm import InnerAlgorithmSettings

    inner = InnerAlgorithmSettings(h_steps=10, warmup_steps=0)
    cfg = model.get_config("tiny")
    corpus = data.split_corpus(data.load_corpus(None), 0.02)
    sampler = data.BatchSampler(corpus.train, cfg.seq_len, 8, 0, 0)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    trainer = InnerTrainer(cfg, inner.optimizer(100))
    learner = LearnerCore(trainer, params, inner.sync_schedule(1), 0)
    uploads = []
    for step in range(20):
        learner.train_step(sampler.batch(step))
        uploads += learner.due_uploads()
    assert len(uploads) == 2
    named = {k: np.asarray(v) for k, v in pytree.flatten_named(params).items()}
    core = OuterCore(named, outer_algorithm(inner_lr=inner.inner_lr, h_steps=10))
    bound = core.guard.bound(0, 10, core.params_norm(0))
    assert bound is not None and core.guard.median_bound(0) is None
    for upload in uploads:
        norm = update_norm(upload.tensors)
        assert norm < bound / 2, (norm, bound)  # within the bound before its slack
    honest = {k: np.asarray(v) for k, v in uploads[0].tensors.items()}
    huge = {k: v * 1000 for k, v in honest.items()}
    with pytest.raises(Rejected, match="norm_outlier: .* the most 10 inner steps"):
        core.offer(0, Arrival(1, 0, 0, 10, 1000, huge, 0.0, "u1r0"))
    core.offer(0, Arrival(0, 0, 0, 10, 1000, honest, 0.0, "u0r0"))
    assert core.merge(0).version == 1
