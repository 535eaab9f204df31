"""Peer review (services/outer/peers.py): an upload's pace, direction and size judged against
the other units' latest uploads, and the core holding an upload until it has peers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from services.outer import peers as peer_rules
from services.outer.core import OuterCore
from services.outer.errors import Rejected
from services.outer.peers import PeerReview
from services.outer.service import OuterService
from services.outer.settings import OuterSettings
from shared import subjects
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.nats import NatsSettings
from shared.transport.blobs import chunk_size_for, publish_blob
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams
from shared.wire.chunks import upload_id
from tests.helpers import outer_algorithm, upload_blob, wait_for_async
from tests.test_outer_core import arrival, tiny_named

JOB = "peers"
SIZE = 50_000  # above SKETCH_SIZE: the cosine is read on sampled coordinates
RNG = np.random.default_rng(0)
DESCENT = RNG.standard_normal(SIZE).astype(np.float32)


def honest(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    """An honest-looking upload: the shared descent direction plus its own noise (cosine
    about 0.5 with another one)."""
    noise = np.random.default_rng(seed).standard_normal(SIZE).astype(np.float32)
    return {"w": scale * (DESCENT + noise)}


def norm(update: dict[str, np.ndarray]) -> float:
    return float(np.linalg.norm(update["w"]))


def reviewed(units: int = 4) -> PeerReview:
    """A review in which units 1 to ``units - 1`` have sent one honest upload each."""
    review = PeerReview([SIZE], units)
    for unit in range(1, units):
        update = honest(unit)
        review.record(0, unit, f"u{unit}", review.sketch(0, update), norm(update), 10, 0)
    return review


def judge(review: PeerReview, update: dict[str, np.ndarray], steps: int = 10):
    return review.judge(0, 0, review.sketch(0, update), norm(update), steps, 0)


def test_an_honest_upload_passes_whole() -> None:
    assert judge(reviewed(), honest(10)) == peer_rules.Review(scale=1.0)


@pytest.mark.parametrize(
    "attack",
    [
        lambda: {"w": -honest(10)["w"]},  # sign flip
        lambda: {"w": 3 * RNG.standard_normal(SIZE).astype(np.float32)},  # a random direction
        lambda: {"w": 0.1 * honest(10)["w"] - 2 * DESCENT},  # mostly reversing progress
    ],
    ids=["sign_flip", "random_direction", "reversal"],
)
def test_an_upload_against_its_peers_direction_is_rejected(attack) -> None:
    with pytest.raises(Rejected) as rejected:
        judge(reviewed(), attack())
    assert rejected.value.reason == "direction_outlier"
    assert "median cosine" in rejected.value.detail


def test_an_honest_direction_scaled_up_is_clipped_to_its_peers_size() -> None:
    update = honest(10, scale=9.0)
    verdict = judge(reviewed(), update)
    peer_norm = float(np.median([norm(honest(unit)) for unit in (1, 2, 3)]))
    assert verdict.scale * norm(update) == pytest.approx(peer_rules.NORM_CLIP * peer_norm, 1e-3)
    # Claiming fewer steps lowers the size allowed, by their square root.
    fewer = judge(reviewed(), update, steps=1)
    assert fewer.scale == pytest.approx(verdict.scale / np.sqrt(10), 1e-3)


def test_an_upload_far_smaller_than_its_peers_for_the_steps_it_claims_is_implausible_work():
    """A few steps' update claiming a whole period would dilute the merges it takes part in."""
    small = honest(10, scale=0.2)  # below WORK_FLOOR (0.25) x its peers' size for 10 steps
    with pytest.raises(Rejected) as rejected:
        judge(reviewed(), small)
    assert rejected.value.reason == "implausible_work" and "10 inner steps" in rejected.value.detail
    assert judge(reviewed(), small, steps=1).scale == 1.0  # what 1 step does: it passes
    assert judge(reviewed(), honest(10, scale=0.3)).scale == 1.0


def test_an_honest_upload_of_few_steps_is_not_implausible() -> None:
    """At the end of a run or after a pause a unit uploads what fewer steps did: a drift grows
    with the steps, so 1 step of an honest 10-step direction is a tenth of its size."""
    assert judge(reviewed(), honest(10, scale=0.1), steps=1).scale == 1.0


def test_the_learning_rate_sum_follows_the_learners_warm_up() -> None:
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1.0, 50, 10**9, 0.1)
    for start, steps in [(0, 1), (0, 5), (10, 10), (45, 10), (50, 7), (200, 30)]:
        expected = sum(float(schedule(t)) for t in range(start, start + steps))
        assert peer_rules.learning_rate_sum(start, steps, 50) == pytest.approx(expected, 1e-5)
    assert peer_rules.learning_rate_sum(7, 10, 0) == 10.0  # no warm-up: the steps


@pytest.mark.parametrize("warmup, horizon", [(50, 300), (50, 40), (0, 120), (10, 11), (5, 1)])
def test_the_learning_rate_sum_follows_the_learners_schedule(warmup: int, horizon: int) -> None:
    """Warm-up and cosine decay over the steps a unit trains in all, summed as the learners'
    own optimizer runs them: with a constant gradient of 1 (under its clip), each AdamW step
    moves a parameter by the learning rate of that step."""
    import jax.numpy as jnp

    from services.learner.trainer import inner_optimizer

    optimizer = inner_optimizer(1.0, warmup, horizon, 0.0)
    params, grads = {"w": jnp.zeros(())}, {"w": jnp.ones(())}
    state, rates = optimizer.init(params), []
    for _ in range(horizon + 20):  # and past the end, where the rate stays at its least
        updates, state = optimizer.update(grads, state, params)
        rates.append(-float(updates["w"]))
    windows = [(0, 1), (0, horizon), (horizon // 2, 7), (max(0, horizon - 3), 3), (horizon, 10)]
    for start, steps in windows:
        expected = sum(rates[start : start + steps])
        got = peer_rules.learning_rate_sum(start, steps, warmup, horizon)
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6), (start, steps)


def test_at_a_runs_end_an_upload_at_the_decayed_rate_is_not_implausible() -> None:
    """The last uploads of a run are made at the cosine decay's lowest learning rates; judged
    against their peers' earlier ones by the warm-up alone they fell under the floor."""
    horizon, warmup = 300, 50

    def rate(start: int, steps: int) -> float:
        return peer_rules.learning_rate_sum(start, steps, warmup, horizon)

    def review(horizons: tuple[int, ...]) -> PeerReview:
        """Units 1-3 at steps [240, 270) (norms as their learning rate), unit 0 at 295."""
        review = PeerReview([SIZE], 4, warmup_steps=warmup, horizons=horizons)
        for unit in (1, 2, 3):
            for k in range(9):
                update = honest(unit, scale=rate(30 * k, 30))
                review.record(
                    0, unit, f"u{unit}-{k}", review.sketch(0, update), norm(update), 30, 0
                )
        review.record(0, 0, "u0-a", review.sketch(0, honest(10)), 1.0, 295, 0)
        return review

    knowing, not_knowing = review((horizon,)), review(())
    last = honest(10, scale=0.35 * rate(295, 5) / norm(honest(10)) * norm(honest(1)))
    sketch = knowing.sketch(0, last)
    assert knowing.judge(0, 0, sketch, norm(last), 5, 0, start=295).scale == 1.0
    with pytest.raises(Rejected, match="implausible_work"):
        not_knowing.judge(0, 0, sketch, norm(last), 5, 0, start=295)
    lazy = {"w": last["w"] / 4}  # a quarter of it: less work than it claims
    with pytest.raises(Rejected, match="implausible_work"):
        knowing.judge(0, 0, sketch, norm(lazy), 5, 0, start=295)


def test_claiming_more_steps_than_its_peers_does_not_move_a_unit_down_the_decay() -> None:
    """A unit that claims a whole period every eighth of one (the too_frequent attack) is
    placed no further along than its peers have trained, where more is expected of it than at
    the decay's end it claims to have reached."""
    review = PeerReview([SIZE], 4, warmup_steps=5, horizons=(100,))
    for unit in (1, 2, 3):
        for k in range(3):  # [0, 30): the peers' latest [20, 30)
            update = honest(unit)
            review.record(0, unit, f"u{unit}-{k}", review.sketch(0, update), norm(update), 10, 0)
    small = honest(10, scale=0.2 * 10 / 30)  # an eighth of a period's work, claiming 10 steps
    sketch = review.sketch(0, small)
    with pytest.raises(Rejected, match="from step 30"):
        review.judge(0, 0, sketch, norm(small), 10, 0, start=200)


def test_learner_steps_are_one_for_all_or_one_per_unit() -> None:
    from services.outer.settings import OuterSettings

    assert OuterSettings(num_units=3).outer_algorithm().inner.horizons == ()
    assert OuterSettings(num_units=3, learner_steps="300").learner_horizons() == (300,)
    assert OuterSettings(num_units=3, learner_steps="90,60,30").learner_horizons() == (90, 60, 30)
    for bad in ("90,60", "0", "x", "300,"):
        with pytest.raises(ValueError, match="learner-steps"):
            OuterSettings(num_units=3, learner_steps=bad)
    review = PeerReview([SIZE], 3, horizons=(90, 60, 30))
    assert [review.horizon(u) for u in range(4)] == [90, 60, 30, None]
    assert PeerReview([SIZE], 3, horizons=(50,)).horizon(7) == 50


def test_in_warm_up_a_unit_behind_its_peers_is_judged_by_the_learning_rate_it_had() -> None:
    """Early in the learning rate's warm-up, a unit behind its peers (slower, or with a smaller
    H) makes smaller updates for its steps than they do: judged by the steps alone, an honest
    unit of a tiny run had 13 uploads refused as implausible_work. Placed in the warm-up by
    the steps its uploads claimed, it passes, and an upload that claims more steps than its
    size shows is still refused."""
    review = PeerReview([SIZE], 4, warmup_steps=50)
    for unit in (1, 2, 3):
        for k in range(2):  # steps [0, 10) and [10, 20): the latest at learning rates 0.2-0.38
            update = honest(unit)
            review.record(0, unit, f"u{unit}-{k}", review.sketch(0, update), norm(update), 10, 0)
    behind = honest(10, scale=0.05)  # its first 5 steps, at learning rates 0-0.08 of the peak
    sketch = review.sketch(0, behind)
    review.record(0, 0, "u0", sketch, norm(behind), 5, 0)
    assert review.start(0, 0) == 0
    assert review.judge(0, 0, sketch, norm(behind), 5, 0, start=0).scale == 1.0
    # By the steps alone (no warm-up), the same upload is below the floor.
    with pytest.raises(Rejected, match="implausible_work"):
        PeerReview.judge(reviewed(), 0, 0, sketch, norm(behind), 5, 0, start=0)
    # Claiming 10 steps where its peers were, it did far less than they did.
    with pytest.raises(Rejected) as rejected:
        review.judge(0, 0, sketch, norm(behind), 10, 0, start=10)
    assert rejected.value.reason == "implausible_work" and "from step 10" in rejected.value.detail


@pytest.mark.parametrize("hostile_scale", [9.0, 0.01])
def test_one_hostile_peer_of_two_moves_neither_the_floor_nor_the_clip(hostile_scale) -> None:
    """With 2 peers, one honest and one hostile (huge or tiny, in the honest direction), an
    honest upload is neither refused as implausible_work nor clipped."""
    review = PeerReview([SIZE], 4)
    hostile = honest(3, scale=hostile_scale)
    review.record(0, 1, "u1", review.sketch(0, honest(1)), norm(honest(1)), 10, 0)
    review.record(0, 3, "u3", review.sketch(0, hostile), norm(hostile), 10, 0)
    assert judge(review, honest(10)) == peer_rules.Review(scale=1.0)


def test_a_unit_whose_upload_was_refused_is_no_peer_until_one_passes() -> None:
    review = reviewed()  # units 1, 2 and 3
    flipped = {"w": -honest(3)["w"]}
    review.record(0, 3, "u3b", review.sketch(0, flipped), norm(flipped), 10, 0)
    assert len(review.peers(0, 0, 0)) == 3
    review.refuse(0, 3, "u3a")  # not its latest: nothing changes
    assert len(review.peers(0, 0, 0)) == 3
    review.refuse(0, 3, "u3b")
    assert len(review.peers(0, 0, 0)) == 2
    review.record(0, 3, "u3c", review.sketch(0, honest(3)), norm(honest(3)), 10, 0)
    assert len(review.peers(0, 0, 0)) == 3


def test_a_unit_set_aside_judges_no_pace_until_it_sends_again() -> None:
    """With units 0 and 2 of 3 stopped by the operator, unit 1's uploads are not held to the
    pace of the two counts that stopped growing (they were refused as too_frequent)."""

    def send(review: PeerReview, unit: int) -> None:
        review.check_pace(0, unit, 0)
        review.record(0, unit, f"u{unit}", review.sketch(0, honest(unit)), 1.0, 10, 0)

    stalled, set_aside = PeerReview([SIZE], 3), PeerReview([SIZE], 3)
    for review in (stalled, set_aside):
        for unit in (0, 1, 2, 0, 1):
            send(review, unit)
    with pytest.raises(Rejected, match="too_frequent|median of 1.5"):
        for _ in range(4):
            send(stalled, 1)
    set_aside.set_aside(0)
    set_aside.set_aside(2)
    set_aside.set_aside(3)  # a unit without uploads: nothing to set aside
    for _ in range(10):
        send(set_aside, 1)
    assert not set_aside.peers(0, 1, 0)
    send(set_aside, 2)  # it sends again: a peer again
    assert [p.upload for p in set_aside.peers(0, 1, 0)] == ["u2"]


def test_a_unit_is_set_aside_when_it_turns_idle_after_uploading_not_at_the_jobs_start() -> None:
    from services.outer.service import units_set_aside

    # The start: every unit paused, none has uploaded; then they run, and the outer's last read
    # still says paused while their first uploads are recorded: none is set aside.
    assert units_set_aside({0, 1, 2}, set(), set(), set()) == set()
    assert units_set_aside({0, 1, 2}, {0, 1, 2}, set(), {0, 1, 2}) == set()
    # Unit 2 paused after uploading: set aside while it stays paused, not after.
    aside = units_set_aside({2}, set(), set(), {0, 1, 2})
    assert aside == {2} and units_set_aside({2}, {2}, aside, {0, 1, 2}) == {2}
    assert units_set_aside(set(), {2}, aside, {0, 1, 2}) == set()


def test_a_minority_of_hostile_peers_does_not_move_an_honest_units_verdict() -> None:
    review = reviewed()
    flipped = {"w": -honest(3)["w"]}
    review.record(0, 3, "u3b", review.sketch(0, flipped), norm(flipped), 10, 0)  # unit 3 turned
    assert judge(review, honest(10)).scale == 1.0


def test_an_upload_without_enough_peers_is_held() -> None:
    review = PeerReview([SIZE], 4)
    update = honest(1)
    review.record(0, 1, "u1b", review.sketch(0, update), norm(update), 10, 0)
    assert judge(review, honest(10)).held  # one peer of the two needed


def test_peers_too_old_do_not_count() -> None:
    """An upload whose peers' latest uploads are too old is not judged by them: held at the
    job's start, passed on the norm guard's word after it (a sign flip included)."""
    too_new = peer_rules.MAX_AGE * 4 + 1  # versions since the peers' uploads
    flipped = {"w": -honest(10)["w"]}
    starting = reviewed(units=3)  # 2 units have sent: the start is not over
    assert not starting.quorate(0)
    assert starting.judge(0, 0, starting.sketch(0, flipped), 1.0, 10, too_new).held
    review = reviewed()
    assert review.quorate(0)
    verdict = review.judge(0, 0, review.sketch(0, flipped), 1.0, 10, too_new)
    assert not verdict.held and verdict.scale == 1.0
    with pytest.raises(Rejected, match="median cosine"):  # by recent peers, it is refused
        review.judge(0, 0, review.sketch(0, flipped), 1.0, 10, 0)


def test_a_unit_uploading_far_more_often_than_its_peers_is_too_frequent() -> None:
    review = PeerReview([SIZE], 4)

    def send(unit: int) -> None:
        review.check_pace(0, unit, 0)
        review.record(0, unit, f"u{unit}", review.sketch(0, honest(unit)), 1.0, 10, 0)

    for unit in (1, 2, 3):
        send(unit)
    # From the first upload on: 2 x the peers' median of 1, + 2.
    for _ in range(4):
        send(0)
    with pytest.raises(Rejected) as rejected:
        send(0)
    assert rejected.value.reason == "too_frequent" and "median of 1" in rejected.value.detail
    for _ in range(2):  # its peers send twice more: 2 x 3 + 2 = 8
        for unit in (1, 2, 3):
            send(unit)
    for _ in range(4):
        send(0)
    with pytest.raises(Rejected):
        send(0)


def test_units_at_their_peers_pace_are_never_too_frequent() -> None:
    review = PeerReview([SIZE], 4)
    order = np.random.default_rng(3)
    for _ in range(100):  # every unit once a round, in any order within it
        for unit in order.permutation(4):
            review.check_pace(0, int(unit), 0)
            review.record(0, int(unit), f"u{unit}", review.sketch(0, honest(int(unit))), 1.0, 10, 0)


# ---- the core holds, judges later, or merges after peer_hold_s --------------------------------


def core(units: int = 4) -> OuterCore:
    return OuterCore(tiny_named(), outer_algorithm(units, peer_review=True, peer_hold_s=30.0))


def correlated(named, seed: int, sign: float = 1.0) -> dict[str, np.ndarray]:
    """Uploads of the tiny model that agree (a shared direction plus their own noise)."""
    shared, own = np.random.default_rng(99), np.random.default_rng(seed)
    return {
        k: (sign * 1e-4 * (shared.standard_normal(v.shape) + own.standard_normal(v.shape))).astype(
            np.float32
        )
        for k, v in named.items()
    }


def merged_units(outer: OuterCore, now: float) -> list[int]:
    units = []
    while outer.due(now):
        units += [a.unit for a in outer.merge(0).arrivals]
    return sorted(units)


def test_the_first_uploads_wait_for_peers_then_a_hostile_one_is_rejected() -> None:
    outer, named = core(), tiny_named()
    outer.offer(0, arrival(0, correlated(named, 0, sign=-1.0), at=0.0))  # hostile, first in
    outer.offer(0, arrival(1, correlated(named, 1), at=1.0))
    assert outer.held() == 2 and outer.due(1.0) == [] and outer.settle(1.0) == []
    assert outer.next_deadline() == 30.0
    outer.offer(0, arrival(2, correlated(named, 2), at=2.0))
    assert outer.settle(2.0) == []  # unit 0 disagrees: it waits for its peers' next uploads
    assert outer.held() == 1 and merged_units(outer, 2.0) == [1, 2]
    outer.offer(0, arrival(1, correlated(named, 11), base_version=2, at=3.0, round_=1))
    assert outer.settle(3.0) == []  # one newer peer of the two it needs
    outer.offer(0, arrival(2, correlated(named, 12), base_version=2, at=4.0, round_=1))
    rejected = outer.settle(4.0)
    assert [(a.unit, why.reason) for a, why in rejected] == [(0, "direction_outlier")]
    assert outer.held() == 0 and merged_units(outer, 4.0) == [1, 2]


def test_the_upload_that_brings_peers_is_merged_after_those_that_waited_for_them() -> None:
    """The outer step is applied to arrivals in the order they came, with review as without."""
    outer, named = core(), tiny_named()
    for unit in (2, 0, 1):
        outer.offer(0, arrival(unit, correlated(named, unit), at=float(unit)))
    assert outer.held() == 3  # unit 1 had peers, and waits behind them
    assert outer.settle(2.0) == [] and outer.held() == 0
    order = []
    while outer.due(2.0):
        order += [a.unit for a in outer.merge(0).arrivals]
    assert order == [2, 0, 1]


def test_a_doubted_units_next_disagreeing_upload_is_rejected_at_once() -> None:
    outer, named = core(), tiny_named()
    for unit in (1, 2):
        outer.offer(0, arrival(unit, correlated(named, unit), at=0.0))
    hostile = correlated(named, 3, sign=-1.0)
    outer.offer(0, arrival(3, hostile, at=1.0))  # doubted
    with pytest.raises(Rejected, match="median cosine"):
        outer.offer(0, arrival(3, correlated(named, 4, sign=-1.0), at=2.0, round_=1))
    rejected = outer.settle(31.0)  # no newer peer within peer_hold_s
    assert [(a.unit, why.reason) for a, why in rejected] == [(3, "direction_outlier")]


def test_an_honest_upload_against_older_peers_passes_when_their_next_ones_agree() -> None:
    # Where the params moved past a minimum, a fresh update reverses the older ones.
    outer, named = core(), tiny_named()
    for unit in (1, 2, 3):
        outer.offer(0, arrival(unit, correlated(named, unit), at=0.0))
    assert outer.settle(0.0) == [] and merged_units(outer, 0.0) == [1, 2, 3]
    outer.offer(0, arrival(0, correlated(named, 0, sign=-1.0), base_version=3, at=1.0))
    assert outer.held() == 1
    for unit in (1, 2, 3):  # unit 1, first to turn, is doubted too until 2 and 3 follow
        update = correlated(named, 10 + unit, sign=-1.0)
        outer.offer(0, arrival(unit, update, base_version=3, at=2.0, round_=1))
    assert outer.settle(2.0) == [] and outer.held() == 0
    assert merged_units(outer, 2.0) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("finished", "horizons", "rejected_at"),
    [
        ((1, 2, 3), (20,), 1.0),  # every other unit has trained its 20 steps
        ((1, 2), (20,), 1.0),  # one may still send: a second opinion needs two
        ((1,), (20,), 31.0),  # two may still send: it waits for them
        ((1, 2, 3), (), 31.0),  # the units' steps not known (no --learner-steps)
    ],
)
def test_a_doubted_upload_waits_only_for_second_opinions_that_can_come(
    finished: tuple[int, ...], horizons: tuple[int, ...], rejected_at: float
) -> None:
    """A run's last doubted upload does not hold the run's end ``peer_hold_s``: once fewer
    than 2 other units may still send an upload (the others' uploads have claimed every step
    they train), it is rejected at once; while they may, it waits for them."""
    settings = AlgorithmSettings(fragments=1, peer_review=True, peer_hold_s=30.0)
    outer, named = OuterCore(tiny_named(), settings.outer_algorithm(4, horizons)), tiny_named()
    for unit in (1, 2, 3):
        steps = 20 if unit in finished else 10
        outer.offer(0, arrival(unit, correlated(named, unit), steps=steps, at=0.0))
    assert outer.settle(0.0) == [] and merged_units(outer, 0.0) == [1, 2, 3]
    outer.offer(0, arrival(0, correlated(named, 0, sign=-1.0), base_version=3, at=1.0))
    if rejected_at > 1.0:
        assert outer.settle(1.0) == [] and outer.held() == 1
    rejected = outer.settle(rejected_at)
    assert [(a.unit, why.reason) for a, why in rejected] == [(0, "direction_outlier")]
    assert outer.held() == 0 and outer.due(rejected_at) == []


def test_an_upload_that_finds_no_peers_is_merged_after_peer_hold_s() -> None:
    outer, named = core(), tiny_named()
    outer.offer(0, arrival(0, correlated(named, 0), at=0.0))
    assert outer.settle(29.9) == [] and outer.due(29.9) == []
    assert outer.settle(30.0) == [] and outer.due(30.0) == [0]


def test_a_quarantined_units_held_uploads_are_withdrawn_unmerged() -> None:
    outer, named = core(), tiny_named()
    outer.offer(0, arrival(0, correlated(named, 0), at=0.0))
    outer.offer(0, arrival(1, correlated(named, 1), at=0.0))
    assert outer.held() == 2
    assert [a.unit for a in outer.withdraw(0)] == [0] and outer.withdraw(0) == []
    assert outer.held() == 1
    assert outer.settle(30.0) == [] and merged_units(outer, 30.0) == [1]


def test_after_the_start_an_upload_whose_peers_are_gone_is_merged_at_once() -> None:
    """Once 3 units have sent uploads of the fragment, an upload left with fewer than 2 peers
    (one unit of 3 stopped, and its latest upload aged out) is merged on the norm guard's word
    at once: waiting ``peer_hold_s`` for peers that stopped would only stall the job."""
    outer, named = core(units=3), tiny_named()
    for unit in (0, 1, 2):
        outer.offer(0, arrival(unit, correlated(named, unit), at=0.0))
    assert outer.settle(0.0) == [] and merged_units(outer, 0.0) == [0, 1, 2]
    review = outer.peers
    assert review is not None and review.quorate(0)
    now, alone = 1.0, 0
    for round_ in range(1, 12):  # unit 0 has stopped
        for unit in (1, 2):
            version = outer.fragments[0].version
            update = correlated(named, 10 * round_ + unit)
            outer.offer(0, arrival(unit, update, base_version=version, at=now, round_=round_))
            alone += len(review.peers(0, unit, version)) < peer_rules.MIN_PEERS
            assert outer.settle(now) == [] and outer.held() == 0, (round_, unit)
            assert merged_units(outer, now) == [unit]
            now += 1.0
    assert alone >= 8  # most of them had one peer left


def test_a_restored_outer_reviews_as_the_one_before_and_records_a_redelivered_upload_once():
    """What peer review keeps is in the checkpoint: a core restored from it holds, judges and
    merges the next uploads as the original does, bit for bit; an upload taken but not merged
    when the checkpoint was written comes again (JetStream redelivers it) and is not counted
    twice."""
    from services.outer import checkpoint, restore
    from services.outer.ledger import OuterLedger
    from services.outer.status import Progress
    from shared.records.outer import CheckpointPointer

    named = tiny_named()
    original = core()
    for unit in (1, 2, 3):
        original.offer(0, arrival(unit, correlated(named, unit), at=0.0))
    assert original.settle(0.0) == [] and merged_units(original, 0.0) == [1, 2, 3]
    pending = arrival(0, correlated(named, 0), base_version=3, at=1.0, round_=1)
    original.offer(0, pending)  # taken, not yet merged when the checkpoint is written
    snapshot = checkpoint.loads(
        checkpoint.dumps(
            checkpoint.OuterSnapshot(
                "j",
                "tiny",
                *original.export_state(),
                norms=original.guard.history(),
                peers=original.peers.history(),
            )
        )
    )
    pointer = CheckpointPointer(id="c", epoch=1, slot=0, chunks=1, size=1, checksum=0, versions=[3])
    restored = core()
    restore.from_checkpoint(
        snapshot, pointer, "j", "tiny", restored, OuterLedger(), Progress(), [0]
    )
    assert restored.guard.history() == original.guard.history()
    restored.offer(0, pending)  # delivered again: judged again, recorded once
    counts = restored.peers.counts(0)
    assert counts == original.peers.counts(0) == {0: 1, 1: 1, 2: 1, 3: 1}
    for outer in (original, restored):
        for unit in (1, 2, 3):
            update = correlated(named, 10 + unit)
            outer.offer(0, arrival(unit, update, base_version=3, at=2.0, round_=1))
        assert outer.settle(2.0) == [] and merged_units(outer, 2.0) == [0, 1, 2, 3]
    for name, value in original.full_params().items():
        np.testing.assert_array_equal(value, restored.full_params()[name], err_msg=name)


def test_a_bad_peer_history_is_refused() -> None:
    review = PeerReview([100], 4)
    good = peer_rules.Latest("u1", np.ones(100, np.float32) / 10, 1.0, 10, 0, 1, 10)
    review.restore([{1: good}])
    for bad in (
        peer_rules.Latest("u1", np.ones(99, np.float32), 1.0, 10, 0, 1, 10),
        peer_rules.Latest("u1", np.full(100, np.nan, np.float32), 1.0, 10, 0, 1, 10),
        peer_rules.Latest("u1", np.ones(100, np.float32), -1.0, 10, 0, 1, 10),
        peer_rules.Latest("u1", np.ones(100, np.float32), 1.0, 0, 0, 1, 10),
        peer_rules.Latest("u1", np.ones(100, np.float32), 1.0, 10, 0, 1, 9),  # claimed < steps
    ):
        with pytest.raises(ValueError, match="unit 1"):
            review.restore([{1: bad}])
    with pytest.raises(ValueError, match="fragments"):
        review.restore([])


def test_a_job_of_two_units_is_not_reviewed() -> None:
    outer, named = core(units=2), tiny_named()
    assert outer.peers is None
    outer.offer(0, arrival(0, correlated(named, 0), at=0.0))
    assert outer.held() == 0 and outer.due(0.0) == [0]


@pytest.mark.timeout(300)
def test_the_outer_service_holds_first_uploads_for_peers_and_refuses_a_hostile_unit(
    memory_nats, tmp_path: Path
) -> None:
    """Through NATS: a 4-unit job's first uploads wait for peers; the unit going against the
    others is dead-lettered as ``direction_outlier`` and counted under its unit, and the rest
    are applied. Each unit trains 10 steps (``--learner-steps``), all in that one upload, so
    the doubted upload is rejected as soon as its peers' are in: no second opinion can come."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    settings = OuterSettings(
        nats_url=memory_nats.url,
        job=JOB,
        model="tiny",
        corpus=str(corpus),
        num_units=4,
        fragments=1,  # the uploads carry the whole model
        peer_review=True,
        learner_steps="10",  # upload_blob's inner steps
        eval_every_s=3600,
    )

    async def scenario() -> OuterService:
        nc = await connect(NatsSettings(nats_url=memory_nats.url), "test")
        js = nc.jetstream()
        await ensure_streams(js)
        chunk_size = chunk_size_for(nc)
        service = OuterService(settings, asyncio.Event())
        running = asyncio.create_task(service.run())

        async def upload(unit: int, round_: int, shared: float) -> None:
            blob = upload_blob(JOB, unit, round_, 0, seed=10 * unit + round_, shared=shared)
            subject = subjects.grads_subject(JOB, unit, 0)
            await publish_blob(js, subject, blob, upload_id(JOB, unit, round_, 0), chunk_size)

        try:
            await wait_for_async(lambda: service.state == "running", 240, "the outer to run")
            await upload(0, 0, shared=-2.0)  # against the others, first in
            await upload(1, 0, shared=2.0)
            await wait_for_async(lambda: service.core.held() == 2, 60, "two held uploads")
            assert service.core.version(0) == 0
            await upload(2, 0, shared=2.0)
            await upload(3, 0, shared=2.0)
            await wait_for_async(lambda: service.core.version(0) == 3, 60, "three merges")
            await wait_for_async(
                lambda: service.ledger.rejected.get("direction_outlier") == 1, 30, "the rejection"
            )
        finally:
            service.stop.set()
            await asyncio.wait_for(running, 60)
            await nc.close()
        return service

    service = asyncio.run(scenario())
    assert service.ledger.units[0].rejected == {"direction_outlier": 1}
    assert service.ledger.applied == 3 and service.ledger.is_done(0, 0) == "rejected"
