"""The outer core: fragments, merge policies (quorum + adaptive grace), participation."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import jax
import numpy as np
import pytest

from services.outer.core import OuterCore
from services.outer.errors import Rejected
from services.outer.ledger import OuterLedger
from services.outer.optimizer import make_outer_optimizer, make_outer_step
from services.outer.policy import Arrival, MergePolicy
from services.outer.service import OuterService
from services.outer.settings import OuterSettings
from shared import fragments, model, pytree
from tests.helpers import outer_algorithm, wait_for_async

# The plain Nesterov step with uniform weights, the algorithm these tests check by hand.
NESTEROV = {"outer_optimizer": "nesterov", "token_weighting": "uniform"}


def tiny_named(seed=0):
    return pytree.flatten_named(
        model.init_params(model.get_config("tiny"), jax.random.PRNGKey(seed))
    )


def arrival(unit, pseudo_grad, base_version=0, at=0.0, tokens=100, steps=10, round_=0):
    return Arrival(unit, round_, base_version, steps, tokens, pseudo_grad, at, f"u{unit}r{round_}")


def test_fragment_sizes_of_the_small_model_are_balanced_within_10_percent():
    abstract = jax.eval_shape(
        lambda: model.init_params(model.get_config("small"), jax.random.PRNGKey(0))
    )
    shapes = {
        jax.tree_util.keystr(path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    for count in (2, 3, 4):
        sizes = fragments.plan_fragments(shapes, count).sizes()
        assert len(sizes) == count and sum(sizes) == sum(int(np.prod(s)) for s in shapes.values())
        assert max(sizes) <= 1.10 * min(sizes), (count, sizes)


def test_one_fragment_reproduces_the_non_fragmented_outer_step_exactly():
    named = tiny_named()
    # Each coordinate within what 10 AdamW steps can move it (the norm guard's prior bound).
    delta = {k: np.full_like(v, 1e-4) * (i + 1) for i, (k, v) in enumerate(named.items())}
    algorithm = outer_algorithm(
        outer_optimizer="nesterov", staleness_rule="constant", token_weighting="uniform"
    )
    core = OuterCore(named, algorithm)
    core.offer(0, arrival(0, delta))
    core.merge(0)
    optimizer = make_outer_optimizer("nesterov", 0.7, 0.9)
    # As a merge calls it: the freshness and count of one arrival, its weight (1) as the scale.
    step = make_outer_step(optimizer)
    expected = step(named, optimizer.init(named), delta, 1.0, 1, 1.0).params
    for key, value in core.full_params().items():
        np.testing.assert_array_equal(value, np.asarray(expected[key]))


def test_a_quorum_merge_under_delayed_nesterov_is_one_round_of_synchronous_diloco():
    """K units' uploads merged together (``--merge-policy quorum``, ``--mode sync``) under the
    default outer, Delayed Nesterov with N = K: one Nesterov step on their mean, the step
    synchronous DiLoCo takes, and not a K-th of it."""
    named = tiny_named()
    rng = np.random.default_rng(5)
    deltas = [
        {k: rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in named.items()}
        for _ in range(4)
    ]
    # The merge's arithmetic, not peer review (these deltas are independent noise).
    algorithm = outer_algorithm(
        4,
        merge_policy="quorum",
        min_quorum=4,
        staleness_rule="constant",
        token_weighting="uniform",
        peer_review=False,
    )
    assert algorithm.optimizer == "delayed_nesterov" and algorithm.dn_period == 4
    core = OuterCore(named, algorithm)
    for unit, delta in enumerate(deltas):
        core.offer(0, arrival(unit, delta))
    assert core.due(1e9) == [0]
    core.merge(0)
    mean = {k: np.mean([d[k] for d in deltas], axis=0) for k in named}
    optimizer = make_outer_optimizer("nesterov", 0.7, 0.9)
    expected = make_outer_step(optimizer)(named, optimizer.init(named), mean).params
    for key, value in core.full_params().items():
        np.testing.assert_allclose(value, np.asarray(expected[key]), rtol=1e-5, atol=1e-7)


def test_fragmented_updates_add_up_to_the_whole_update():
    named = tiny_named()
    delta = {
        k: np.random.default_rng(1).standard_normal(v.shape).astype(np.float32) * 1e-2
        for k, v in named.items()
    }
    whole = OuterCore(named, outer_algorithm(**NESTEROV, fragments=1, staleness_rule="constant"))
    whole.offer(0, arrival(0, delta))
    whole.merge(0)
    split = OuterCore(named, outer_algorithm(**NESTEROV, fragments=3, staleness_rule="constant"))
    for p in range(3):
        split.offer(p, arrival(0, split.plan.extract(delta, p)))
        split.merge(p)
    assert [split.version(p) for p in range(3)] == [1, 1, 1]
    for key, value in split.full_params().items():
        np.testing.assert_allclose(value, whole.full_params()[key], atol=1e-7)


def test_the_books_count_a_units_tokens_once_however_many_fragments_carry_them():
    # With 3 fragments a unit's 1,000 tokens of training reach the model as 3 uploads, each
    # of one fragment and each saying 1,000 tokens: the books apply each at its share.
    named = tiny_named()
    zero = {k: np.zeros_like(v) for k, v in named.items()}
    split = OuterCore(named, outer_algorithm(**NESTEROV, fragments=3))
    ledger = OuterLedger()
    shares = []
    for p in range(3):
        split.offer(p, arrival(0, split.plan.extract(zero, p), tokens=1000))
        result = split.merge(p)
        ledger.merged(result.arrivals, result.staleness, result.share)
        shares.append(result.share)
    sizes = split.plan.sizes()
    assert shares == [size / sum(sizes) for size in sizes] and len(set(shares)) > 1
    assert (
        abs(ledger.tokens_applied - 1000) <= 1 and ledger.units[0].tokens == ledger.tokens_applied
    )
    assert ledger.applied == 3


def test_staleness_cut_off_and_future_versions_are_rejected_with_reasons():
    named = tiny_named()
    zero = {k: np.zeros_like(v) for k, v in named.items()}
    core = OuterCore(named, outer_algorithm(**NESTEROV, max_staleness=1))
    for version in range(3):
        core.offer(0, arrival(0, zero, base_version=version))
        core.merge(0)
    with pytest.raises(Rejected) as err:
        core.offer(0, arrival(1, zero, base_version=1))  # staleness 2 > 1
    assert err.value.reason == "too_stale"
    with pytest.raises(Rejected) as err:
        core.offer(0, arrival(1, zero, base_version=9))
    assert err.value.reason == "future_base_version"
    core.offer(0, arrival(1, zero, base_version=2))  # staleness 1 is accepted


def test_participation_scale_makes_one_of_k_arrivals_a_1_over_k_step():
    named = {"w": np.zeros(3, np.float32)}
    core = OuterCore(
        named,
        outer_algorithm(
            4,
            outer_optimizer="sgd",
            outer_lr=1.0,
            staleness_rule="constant",
            token_weighting="uniform",
            peer_review=False,  # one arrival alone: peer review would hold it for peers
        ),
    )
    core.offer(0, arrival(0, {"w": np.full(3, 4e-3, np.float32)}))
    core.merge(0)
    np.testing.assert_allclose(core.full_params()["w"], -1e-3)


def test_each_policy_merges_arrivals_one_at_a_time():
    policy = MergePolicy("each", 1, 0.5, 0.0, 30.0)
    assert policy.deadline() is None
    for unit in range(3):
        policy.add(arrival(unit, {}, at=1.0))
    assert policy.ready(1.0)
    assert [a.unit for a in policy.take()] == [0]
    assert [a.unit for a in policy.take(4)] == [1, 2]
    assert not policy.ready(2.0)


def test_a_backlog_under_each_is_applied_in_turn_as_the_arrivals_would_be_alone():
    """Three arrivals waiting under ``each``: one program applies the oldest two, each in its
    own outer step with its own staleness, then the third; the params, the versions and the
    staleness are those of merging each as it came (up to float rounding)."""
    named = tiny_named()
    rng = np.random.default_rng(7)
    deltas = [
        {k: rng.normal(0, 1e-4, v.shape).astype(np.float32) for k, v in named.items()}
        for _ in range(3)
    ]
    algorithm = outer_algorithm(4, peer_review=False)
    alone, backlog = OuterCore(named, algorithm), OuterCore(named, algorithm)
    merged_alone = []
    for unit, delta in enumerate(deltas):
        alone.offer(0, arrival(unit, delta))
        merged_alone.append(alone.merge(0))
    for unit, delta in enumerate(deltas):
        backlog.offer(0, arrival(unit, delta))
    first, second = backlog.merge(0), backlog.merge(0)
    assert [a.unit for a in first.arrivals] == [0, 1] and first.staleness == [0, 1]
    assert [a.unit for a in second.arrivals] == [2] and second.staleness == [2]
    assert [r.staleness for r in merged_alone] == [[0], [1], [2]]
    assert (first.version, second.version) == (2, 3) and backlog.version(0) == 3
    assert (first.steps, second.steps) == (2, 1)  # the books count outer steps: the version
    ledger = OuterLedger()
    for result in (first, second):
        ledger.merged(result.arrivals, result.staleness, result.share, result.steps)
    assert (ledger.merges, ledger.applied) == (3, 3)
    assert not backlog.due(time.monotonic())
    want = alone.full_params()
    for key, value in backlog.full_params().items():
        np.testing.assert_allclose(value, want[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_warm_up_compiles_the_programs_of_a_backlog_beside_the_first_step(caplog):
    """The one-arrival program compiles before ``warm_up`` returns; those of a backlog (2 and
    4 arrivals) on its thread, so that no merge of a backlog waits for a compilation."""
    named = tiny_named()
    core = OuterCore(named, outer_algorithm(4, peer_review=False))
    thread = core.warm_up()
    assert thread is not None
    thread.join(120)
    zero = {k: np.zeros_like(v) for k, v in named.items()}
    for round_ in range(2):
        for unit in range(4 - round_):
            core.offer(0, arrival(unit, zero, round_=round_))
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            merged = [len(core.merge(0).arrivals) for _ in range(3)]
    finally:
        jax.config.update("jax_log_compiles", False)
    assert merged == [4, 2, 1]
    assert not [r.message for r in caplog.records if "Compiling jit(steps)" in r.message]
    quorum = OuterCore(named, outer_algorithm(4, peer_review=False, merge_policy="quorum"))
    assert quorum.warm_up() is None


def test_quorum_waits_for_k_then_for_active_units_inside_the_grace_window():
    policy = MergePolicy("quorum", min_quorum=2, grace_factor=0.5, grace_min_s=0.0, grace_max_s=100)
    for t in (0.0, 10.0):  # units 0, 1, 2 upload every 10 s
        for unit in (0, 1, 2):
            policy.add(arrival(unit, {}, at=t))
        policy.take()
    policy.add(arrival(0, {}, at=20.0))
    assert policy.deadline() is None  # quorum 2 not reached
    policy.add(arrival(1, {}, at=21.0))
    # Unit 2 is active: wait for it, at most 0.5 * median interval 10 = 5 s after the quorum.
    assert policy.deadline() == pytest.approx(26.0)
    assert not policy.ready(25.9)
    policy.add(arrival(2, {}, at=22.0))
    assert policy.ready(22.0)  # every active unit is in: merge at once
    assert sorted(a.unit for a in policy.take()) == [0, 1, 2]


def test_a_silent_unit_stops_being_waited_for():
    policy = MergePolicy("quorum", min_quorum=1, grace_factor=0.5, grace_min_s=0.0, grace_max_s=100)
    for t in (0.0, 10.0):
        for unit in (0, 1):
            policy.add(arrival(unit, {}, at=t))
        policy.take()
    deadlines = []
    for t in (20.0, 30.0, 40.0, 50.0):  # unit 1 went silent after t = 10
        policy.add(arrival(0, {}, at=t))
        deadlines.append(policy.deadline())
        policy.take()
    # Waited for (5 s) while recently active; not once silent for > 3 intervals (30 s).
    assert deadlines == [pytest.approx(25.0), pytest.approx(35.0), pytest.approx(45.0), 50.0]


def test_sync_mode_waits_for_every_unit_in_the_first_round_then_drops_a_silent_one():
    settings = OuterSettings(mode="sync", sync_timeout_s=8.0, num_units=3)
    algorithm = settings.outer_algorithm()
    assert (algorithm.policy, algorithm.min_quorum, algorithm.sync_rounds) == (
        "quorum",
        1,
        True,
    )
    policy = MergePolicy(
        algorithm.policy,
        algorithm.min_quorum,
        algorithm.grace_factor,
        algorithm.grace_min_s,
        algorithm.grace_max_s,
        expected_units=algorithm.num_units,
        sync_rounds=algorithm.sync_rounds,
    )
    policy.add(arrival(0, {}, at=1.0))
    assert policy.deadline() == pytest.approx(9.0)  # units 1 and 2 never uploaded: wait 8 s
    policy.add(arrival(1, {}, at=2.0))
    policy.add(arrival(2, {}, at=3.0))
    assert policy.ready(3.0)  # the whole job is in: merge at once
    assert sorted(a.unit for a in policy.take()) == [0, 1, 2]
    for unit in (0, 1, 2):  # round 2: every unit is in
        policy.add(arrival(unit, {}, at=10.0 + unit))
    assert policy.ready(12.0) and len(policy.take()) == 3
    policy.add(arrival(0, {}, at=20.0))  # unit 2 died: the round waits the timeout, no longer
    policy.add(arrival(1, {}, at=20.5))
    assert policy.deadline() == pytest.approx(28.0) and not policy.ready(27.9)
    assert sorted(a.unit for a in policy.take()) == [0, 1]
    # The decoupled default merges every arrival alone, at once.
    assert OuterSettings(num_units=3).outer_algorithm().policy == "each"


def test_a_stale_upload_rides_along_a_sync_round_without_starting_or_completing_it():
    policy = MergePolicy("quorum", 1, 0.0, 8.0, 8.0, expected_units=2, sync_rounds=True)
    policy.add(arrival(1, {}, at=1.0), fresh=False)  # unit 1 was dropped from the last round
    assert policy.quorum_at is None  # a stale upload starts no round ...
    assert policy.deadline() == pytest.approx(25.0)  # ... and alone waits 3 timeouts for one
    policy.add(arrival(0, {}, at=2.0))
    assert policy.deadline() == pytest.approx(10.0)  # unit 1's fresh upload is awaited
    policy.add(arrival(1, {}, at=3.0))
    assert policy.ready(3.0) and sorted(a.unit for a in policy.take()) == [0, 1, 1]
    # Without sync rounds every arrival counts.
    loose = MergePolicy("quorum", 1, 0.0, 8.0, 8.0, expected_units=2)
    loose.add(arrival(1, {}, at=1.0), fresh=False)
    assert loose.deadline() == pytest.approx(9.0)


def test_grace_window_is_bounded():
    policy = MergePolicy("quorum", min_quorum=1, grace_factor=2.0, grace_min_s=1.0, grace_max_s=3.0)
    for t in (0.0, 10.0):
        for unit in (0, 1):
            policy.add(arrival(unit, {}, at=t))
        policy.take()
    policy.add(arrival(0, {}, at=20.0))
    assert policy.deadline() == pytest.approx(23.0)  # 2 x 10 s capped at 3 s


def test_invalid_algorithm_choices_are_refused():
    for kwargs in (
        {"optimizer": "adam"},
        {"policy": "sometimes"},
        {"combine": "mean"},
        {"token_weighting": "bytes"},
        {"min_quorum": 0},
        {"fragments": 0},
        {"lr": -1.0},
    ):
        with pytest.raises(ValueError):
            dataclasses.replace(outer_algorithm(), **kwargs)


def test_the_outer_event_loop_keeps_running_while_a_merge_is_slow(tmp_path, monkeypatch):
    """A merge that takes seconds (a compile, a large step) runs off the event loop, which
    meanwhile renews the lease and sends heartbeats; the ledger is updated once it is done."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    # One arrival alone: without peer review, which would hold it for peers.
    settings = OuterSettings(job="slow", model="tiny", corpus=str(corpus), peer_review=False)
    service = OuterService(settings, asyncio.Event())
    service.build_math()
    merge = service.core.merge
    merging = threading.Event()
    loop_ran = threading.Event()
    merge_saw_the_loop_run: list[bool] = []

    def merge_held_until_the_loop_runs(fragment):
        # The merge does not finish before the event loop has run other work: on the loop
        # itself it would wait out its 10 s and see none.
        merging.set()
        merge_saw_the_loop_run.append(loop_ran.wait(timeout=10))
        return merge(fragment)

    monkeypatch.setattr(service.core, "merge", merge_held_until_the_loop_runs)
    zeros = {k: np.zeros(v.shape, np.float32) for k, v in service.core.fragments[0].params.items()}
    service.core.offer(0, dataclasses.replace(arrival(0, zeros), messages=[], train_loss=3.0))
    service.intake.buffered.add("u0r0")

    async def scenario():
        async def other_work():
            await wait_for_async(merging.is_set, 30, "the merge to start", interval_s=0.01)
            loop_ran.set()  # on the event loop, while the merge is in progress

        other = asyncio.create_task(other_work())
        results = await service.merge_due(time.monotonic())
        await other
        return results

    results = asyncio.run(scenario())
    assert [r.version for r in results] == [1]
    assert merge_saw_the_loop_run == [True]
    assert service.ledger.applied == 1 and service.ledger.merges == 1
    assert service.ledger.units[0].last_train_loss == 3.0
    assert service.intake.buffered == set()


@pytest.mark.parametrize(
    ("every", "settle_s", "interval"),
    [(2.0, 0.0, 2.0), (2.0, 0.1, 2.0), (2.0, 0.3, 2.7), (2.0, 3.0, 4.0), (0.0, 0.5, 0.0)],
)
def test_commits_take_at_most_their_share_of_the_outer_s_time(
    tmp_path, every: float, settle_s: float, interval: float
) -> None:
    """While uploads keep coming, the next commit waits for ``--commit-every-s``, or for nine
    times as long as the last commit took where that is longer (``COMMIT_SHARE``), but not
    more than twice ``--commit-every-s`` (``COMMIT_STRETCH``: what was merged is held until
    the commit); 0 still commits after every fetch."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    settings = OuterSettings(job="share", model="tiny", corpus=str(corpus), commit_every_s=every)
    service = OuterService(settings, asyncio.Event())
    service._settle_s = settle_s
    assert service._commit_interval() == pytest.approx(interval)
