"""The learner's sync protocol: uploads, fragments, overlap τ and mixing α, DyLU."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from services.learner.core import (
    STEPS_IN_FLIGHT,
    Adoption,
    LearnerCore,
    SyncSchedule,
    dynamic_h,
)
from services.learner.stagger_rule import stagger_if_slow
from services.learner.trainer import InnerTrainer, inner_optimizer
from shared import model, pytree
from shared.codec import api as codec
from shared.codec.config import CodecConfig
from shared.settings.algorithm import InnerAlgorithmSettings

CFG = model.get_config("tiny")
TOKENS = 4 * CFG.seq_len


def make_core(schedule: SyncSchedule, seed: int = 0) -> LearnerCore:
    trainer = InnerTrainer(CFG, inner_optimizer(3e-3, 2, 50, 0.0))
    return LearnerCore(trainer, model.init_params(CFG, jax.random.PRNGKey(seed)), schedule, TOKENS)


def batch(step: int):
    return jax.random.randint(jax.random.PRNGKey(100 + step), (4, CFG.seq_len + 1), 0, 256)


def named(tree):
    return pytree.flatten_named(tree)


def test_upload_every_h_steps_carries_anchor_minus_local_and_counters():
    core = make_core(InnerAlgorithmSettings(h_steps=3).sync_schedule(1))
    start = named(core.state.params)
    uploads = []
    for _ in range(3):
        core.train_step(batch(core.step))
        uploads += core.due_uploads()
    assert len(uploads) == 1
    upload = uploads[0]
    assert (upload.fragment, upload.round, upload.base_version) == (0, 0, 0)
    assert (upload.inner_steps, upload.tokens) == (3, 3 * TOKENS)
    local = named(core.state.params)
    for name, delta in upload.tensors.items():
        np.testing.assert_array_equal(delta, start[name] - local[name])
    # The anchor moved to the local params: nothing more to send right now.
    assert core.flush() == []


def test_adopting_a_global_keeps_exactly_the_unsent_progress():
    core = make_core(InnerAlgorithmSettings(h_steps=2).sync_schedule(1))
    for _ in range(2):
        core.train_step(batch(core.step))
    core.due_uploads()
    core.train_step(batch(core.step))  # progress not yet uploaded
    unsent = {
        k: named(core.state.params)[k] - named(core.state.anchor)[k]
        for k in named(core.state.params)
    }
    new_global = {
        k: v + 0.25 for k, v in named(model.init_params(CFG, jax.random.PRNGKey(7))).items()
    }
    assert core.offer_global(0, 5, new_global)
    assert core.adopt_globals() == [0]
    assert core.base_versions() == [5]
    assert list(core.adoptions) == [Adoption(core.step, 0, 5, 0)]
    params, anchor = named(core.state.params), named(core.state.anchor)
    for key in params:
        np.testing.assert_allclose(anchor[key], new_global[key], atol=1e-6)
        np.testing.assert_allclose(params[key], new_global[key] + unsent[key], atol=1e-6)
    # Older or equal versions are ignored.
    assert not core.offer_global(0, 5, new_global)


def test_a_global_that_does_not_fit_is_refused_and_a_rewind_replaces_a_higher_version():
    core = make_core(InnerAlgorithmSettings(h_steps=2).sync_schedule(1))
    good = named(model.init_params(CFG, jax.random.PRNGKey(3)))
    name = sorted(good)[0]
    before = named(core.state.params)
    for bad, reason in (
        ({k: v for k, v in good.items() if k != name}, "pieces differ"),
        ({**good, name: good[name][..., :1]}, "shape"),
        ({**good, name: np.full_like(good[name], np.nan)}, "not finite"),
    ):
        with pytest.raises(ValueError, match=reason):
            core.offer_global(0, 9, bad)
    assert core.adopt_globals() == [] and core.newest_version(0) == 0
    for key, value in named(core.state.params).items():
        np.testing.assert_array_equal(value, before[key])
    # A version that is too high is held; a lower one replaces it only as a rewind.
    assert core.offer_global(0, 10**9, good)
    assert not core.offer_global(0, 6, good)
    assert core.offer_global(0, 6, good, rewind=True)
    assert core.adopt_globals() == [0] and core.base_versions() == [6]


def test_mixing_alpha_keeps_a_share_of_the_local_params():
    core = make_core(InnerAlgorithmSettings(h_steps=1, mix_alpha=0.25).sync_schedule(1))
    core.train_step(batch(0))
    core.due_uploads()  # right after an upload: params == anchor
    before = named(core.state.params)
    target = {k: np.zeros_like(v) for k, v in before.items()}
    core.offer_global(0, 1, target)
    core.adopt_globals()
    after = named(core.state.params)
    for key in before:  # θ ← α θ_local + (1 − α) Θ
        np.testing.assert_allclose(after[key], 0.25 * before[key], atol=1e-6)


def test_overlap_tau_holds_a_global_until_tau_steps_after_the_upload():
    core = make_core(InnerAlgorithmSettings(h_steps=2, overlap_tau=2).sync_schedule(1))
    for _ in range(2):
        core.train_step(batch(core.step))
    assert len(core.due_uploads()) == 1
    core.offer_global(0, 1, named(core.state.params))
    assert core.adopt_globals() == []  # 0 steps since the upload
    core.train_step(batch(core.step))
    assert core.adopt_globals() == []  # 1 step
    core.train_step(batch(core.step))
    assert core.adopt_globals() == [0]  # τ = 2 steps


def upload_steps(core: LearnerCore, steps: int) -> list[tuple[int, int]]:
    """(step, fragment) of every upload over the next ``steps`` steps."""
    due = []
    for _ in range(steps):
        core.train_step(batch(core.step))
        due += [(core.step, upload.fragment) for upload in core.due_uploads()]
    return due


def test_fragments_are_staggered_and_partition_the_params():
    core = make_core(InnerAlgorithmSettings(h_steps=4, stagger="always").sync_schedule(2))
    assert core.staggered
    # Fragment 1 syncs H/P = 2 steps early, then every H.
    assert upload_steps(core, 8) == [(2, 1), (4, 0), (6, 1), (8, 0)]
    keys = [set(core.plan.keys(p)) for p in range(2)]
    assert not keys[0] & keys[1]
    sizes = core.plan.sizes()
    assert sum(sizes) == model.param_count(core.template)


@pytest.mark.parametrize("stagger", ["auto", "never"])
def test_fragments_start_aligned_and_stagger_when_told(stagger):
    """Aligned, the P uploads go out together every H steps, the whole model at once, even
    after globals were adopted in between; once staggered they spread over the period."""
    core = make_core(InnerAlgorithmSettings(h_steps=4, stagger=stagger).sync_schedule(3))
    assert not core.staggered
    assert upload_steps(core, 4) == [(4, 0), (4, 1), (4, 2)]
    pieces = core.plan.extract(named(core.state.params), 1)
    assert core.offer_global(1, 1, pieces)
    assert core.adopt_globals() == [1]
    assert upload_steps(core, 4) == [(8, 0), (8, 1), (8, 2)]
    assert not core.staggered
    core.stagger(4)
    assert core.staggered
    # Adoptions before the early uploads do not undo the staggering.
    for p in range(3):
        assert core.offer_global(p, 2, core.plan.extract(named(core.state.params), p))
    assert core.adopt_globals() == [0, 1, 2]
    # offset(p) = round(p·H/P): fragment 2 is 3 steps early, fragment 1 one; then every H.
    assert upload_steps(core, 8) == [(9, 2), (11, 1), (12, 0), (13, 2), (15, 1), (16, 0)]
    assert core.staggered


def test_upload_tensors_are_views_of_one_flat_buffer_the_codec_encodes_whole():
    core = make_core(InnerAlgorithmSettings(h_steps=2).sync_schedule(2))
    uploads = []
    while len(uploads) < 2:
        core.train_step(batch(core.step))
        uploads += core.due_uploads()
    config = CodecConfig("int8")
    for upload in uploads:
        layout = upload.layout
        assert layout == core.layouts[upload.fragment]
        assert list(layout.names) == core.plan.keys(upload.fragment) == sorted(upload.tensors)
        assert upload.values.dtype == np.float32 and upload.values.size == layout.size
        for name, view in layout.views(upload.values).items():
            assert np.shares_memory(upload.tensors[name], upload.values)
            np.testing.assert_array_equal(upload.tensors[name], view)
        flat, flat_description, _ = codec.encode_flat(upload.values, layout, config)
        whole, description, _ = codec.encode(upload.tensors, config)
        assert bytes(flat) == bytes(whole) and flat_description == description


def test_one_fragment_no_overlap_no_mixing_is_the_plain_update():
    """P = 1, τ = 0, α = 0: upload Δ = θ_global − θ_local, then the global replaces local."""
    core = make_core(
        InnerAlgorithmSettings(h_steps=3, overlap_tau=0, mix_alpha=0.0).sync_schedule(1)
    )
    start = named(core.state.params)
    for _ in range(3):
        core.train_step(batch(core.step))
    (upload,) = core.due_uploads()
    local = named(core.state.params)
    assert sorted(upload.tensors) == sorted(start)  # whole tensors, no pieces
    for key in start:
        np.testing.assert_array_equal(upload.tensors[key], start[key] - local[key])
    new_global = {k: v * 0.5 for k, v in start.items()}
    core.offer_global(0, 1, new_global)
    core.adopt_globals()
    for key, value in named(core.state.params).items():
        np.testing.assert_array_equal(value, new_global[key])


@pytest.mark.parametrize(
    ("own", "rates", "expected"),
    [
        (10.0, {0: 10.0, 1: 40.0}, 7),
        (40.0, {0: 10.0, 1: 40.0}, 30),
        (None, {0: 5.0}, 30),
        (1.0, {}, 30),
        (0.1, {0: 1000.0}, 1),
    ],
)
def test_dynamic_h_scales_h_by_relative_speed(own, rates, expected):
    assert dynamic_h(30, own, rates) == expected


class CountedLoss:
    """A loss whose reads on the host are counted."""

    reads = 0

    def __init__(self, value: jax.Array) -> None:
        self.value = value

    def __float__(self) -> float:
        CountedLoss.reads += 1
        return float(self.value)


class CountingTrainer:
    """The real trainer, with every step's loss wrapped in a :class:`CountedLoss`."""

    def __init__(self, trainer: InnerTrainer) -> None:
        self.trainer = trainer

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def step(self, state, batch_):
        state, loss = self.trainer.step(state, batch_)
        return state, CountedLoss(loss)


def test_losses_are_read_on_the_host_only_when_uploads_are_taken():
    trainer = CountingTrainer(InnerTrainer(CFG, inner_optimizer(3e-3, 2, 50, 0.0)))
    params = model.init_params(CFG, jax.random.PRNGKey(0))
    schedule = InnerAlgorithmSettings(h_steps=4, stagger="always").sync_schedule(2)
    core = LearnerCore(trainer, params, schedule, TOKENS)
    CountedLoss.reads = 0
    losses, uploads, boundaries = [], [], []
    for _ in range(8):  # fragment 1 uploads at steps 2 and 6, fragment 0 at steps 4 and 8
        losses.append(core.train_step(batch(core.step)))
        due = core.due_uploads()
        if due:
            boundaries.append(core.step)
        # Every loss up to the last boundary was read there, once; none after it yet.
        assert CountedLoss.reads == (boundaries[-1] if boundaries else 0)
        uploads += [(core.step, upload) for upload in due]
    assert boundaries == [2, 4, 6, 8]
    values = [float(loss.value) for loss in losses]
    for step, upload in uploads:
        first = step - upload.inner_steps
        assert upload.train_loss == sum(values[first:step]) / upload.inner_steps


def test_a_step_returns_its_loss_on_the_device():
    core = make_core(InnerAlgorithmSettings(h_steps=3).sync_schedule(1))
    loss = core.train_step(batch(0))
    assert isinstance(loss, jax.Array) and loss.shape == ()
    core.read_losses()
    assert core.syncs[0].loss_sum == float(loss)


def test_dispatch_stays_within_steps_in_flight_of_the_device():
    """JAX would queue any number of steps; the core waits so that at most STEPS_IN_FLIGHT are
    unfinished, and the loop sees new globals, pauses and stops within a step or two."""
    core = make_core(InnerAlgorithmSettings(h_steps=1000).sync_schedule(1))
    most = 0
    for step in range(12):
        core.train_step(batch(step))
        most = max(most, core.steps_in_flight())
    assert 1 <= most <= STEPS_IN_FLIGHT
    core.read_losses()
    assert core.steps_in_flight() == 0


def test_a_slow_whole_model_upload_staggers_the_fragments_once():
    """``stagger_if_slow``: only after the aligned fragments went out together, and only when
    the rule says the upload held the link too long."""
    core = make_core(InnerAlgorithmSettings(h_steps=4).sync_schedule(3))
    for _ in range(4):
        core.train_step(batch(core.step))
    uploads = core.due_uploads()
    assert len(uploads) == 3
    assert not stagger_if_slow(core, uploads[:2], "auto", 10.0, 20.0)  # not the whole model
    assert not stagger_if_slow(core, uploads, "auto", 1.0, 20.0)  # fast enough
    assert not core.staggered
    assert stagger_if_slow(core, uploads, "auto", 10.0, 20.0)
    assert core.staggered
    assert not stagger_if_slow(core, uploads, "auto", 10.0, 20.0)  # once
