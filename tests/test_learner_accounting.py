"""The training thread's books (``services/learner/accounting.py``) on a fake clock: tokens and
speed, time training and waiting, the loss average and the lifetime figures in the state file.
No JAX, no NATS: losses are plain numbers."""

from __future__ import annotations

import math

import pytest

from services.learner.accounting import LIFETIME_WRITE_S, RATE_WINDOW_TALLIES, TrainingAccount
from services.learner.unit_state import STATE_FILE, UnitState
from shared import records
from shared.records.unit import UnitStateFile


class FakeClock:
    """A clock that moves only when told."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


@pytest.fixture
def wall() -> FakeClock:
    return FakeClock(1_700_000_000.0)


def account_for(
    unit_state: UnitState, clock: FakeClock, wall: FakeClock, tokens: int = 0
) -> TrainingAccount:
    return TrainingAccount(unit_state, tokens, clock=clock, wall_clock=wall)


def test_tokens_and_speed_over_the_last_tallies(clock, wall):
    account = account_for(UnitState(), clock, wall, tokens=1000)
    account.start_running()
    assert account.tokens_per_s() == 0.0  # no time has passed
    for _ in range(4):
        clock.advance(1.0)
        account.trained(100, 2.0)
    assert account.tokens == 1400
    assert account.tokens_per_s() == pytest.approx(100.0)
    tally = account.tally()
    assert (tally.tokens, tally.tokens_per_s) == (1400, pytest.approx(100.0))
    # The speed is measured from the oldest of the last RATE_WINDOW_TALLIES tallies: a slow
    # stretch long ago stops counting.
    clock.advance(100.0)
    account.tally()
    for _ in range(RATE_WINDOW_TALLIES):
        clock.advance(1.0)
        account.trained(50, 2.0)
        account.tally()
    assert account.tokens_per_s() == pytest.approx(50.0)


def test_time_training_counts_running_stretches_only(clock, wall):
    unit_state = UnitState()
    account = account_for(unit_state, clock, wall)
    clock.advance(5.0)  # starting up: not training
    assert account.tally().training_s == 0.0
    assert unit_state.first_trained_at is None
    account.start_running()
    assert unit_state.first_trained_at == wall.now
    clock.advance(3.0)
    account.start_running()  # already running: the stretch goes on
    clock.advance(1.0)
    assert account.tally().training_s == pytest.approx(4.0)
    account.stop_running()
    clock.advance(10.0)  # paused
    account.stop_running()
    assert account.tally().training_s == pytest.approx(4.0)
    wall.advance(60.0)
    account.start_running()
    clock.advance(2.0)
    tally = account.tally()
    assert tally.training_s == pytest.approx(6.0)
    assert unit_state.first_trained_at == wall.now - 60.0  # the first time is kept
    assert tally.lifetime_s == pytest.approx(60.0)


def test_speed_restarts_on_resume(clock, wall):
    account = account_for(UnitState(), clock, wall)
    account.start_running()
    clock.advance(1.0)
    account.trained(100, 1.0)
    account.stop_running()
    clock.advance(99.0)  # paused: a measurement across it would say 1 token/s
    account.restart_speed()
    account.start_running()
    clock.advance(1.0)
    account.trained(100, 1.0)
    assert account.tokens_per_s() == pytest.approx(100.0)


def test_healthy_speed_is_over_the_units_life_without_sync_waits(clock, wall):
    unit_state = UnitState()
    unit_state.set_lifetime(trained_s=50.0, computing_s=40.0, computed_tokens=4000)
    account = account_for(unit_state, clock, wall, tokens=4000)  # restored from a checkpoint
    account.start_running()
    clock.advance(10.0)
    account.trained(1000, 1.0)
    account.waited_at_sync(5.0)
    tally = account.tally()
    assert tally.sync_wait_s == 5.0
    assert tally.lifetime_training_s == pytest.approx(60.0)
    # (4000 earlier + 1000 now) tokens over (40 earlier + 10 − 5 waiting) seconds computing.
    assert tally.compute_tokens_per_s == pytest.approx(5000 / 45)


def test_lifetime_figures_are_written_every_few_seconds_and_when_forced(tmp_path, clock, wall):
    path = tmp_path / STATE_FILE
    unit_state = UnitState(path, "t", 0)

    def written() -> tuple[float, float, int]:
        record = records.decode(UnitStateFile, path.read_bytes())
        assert record is not None
        return record.trained_s, record.computing_s, record.computed_tokens

    account = account_for(unit_state, clock, wall)
    account.tally(write_lifetime=True)
    assert not path.exists()  # nothing trained yet: nothing to write
    account.start_running()
    clock.advance(1.0)
    account.trained(10, 1.0)
    account.tally()
    assert written() == (1.0, 1.0, 10)  # the first tally that has something writes
    clock.advance(LIFETIME_WRITE_S / 2)
    account.trained(10, 1.0)
    account.tally()
    assert written() == (1.0, 1.0, 10)  # too soon
    account.tally(write_lifetime=True)
    assert written() == (2.0, 2.0, 20)
    clock.advance(LIFETIME_WRITE_S)
    account.tally()
    assert written() == (4.0, 4.0, 20)
    # A restarted process goes on from what the file says.
    again = account_for(UnitState(path, "t", 0), clock, wall)
    again.start_running()
    clock.advance(1.0)
    assert again.tally().lifetime_training_s == pytest.approx(5.0)


def test_the_loss_average_reads_each_loss_once_in_step_order(clock, wall):
    fetched: list[list[float]] = []

    def to_host(losses):
        fetched.append(list(losses))
        return list(losses)

    account = TrainingAccount(UnitState(), to_host=to_host, clock=clock, wall_clock=wall)
    assert math.isnan(account.tally().train_loss)
    account.trained(1, 4.0)
    account.trained(1, 2.0)
    assert account.tally().train_loss == pytest.approx(0.9 * 4.0 + 0.1 * 2.0)
    assert account.tally().train_loss == account.loss_ema  # nothing new: unchanged
    assert fetched == [[], [4.0, 2.0], []]
    account.trained(1, float("nan"))  # a diverged step: the average starts again after it
    account.trained(1, 3.0)
    assert account.tally().train_loss == 3.0
