"""The training thread's status report: which ``UnitStatus`` fields it sets, from the core, the
account and the settings, and how often (on a fake clock; the link is real but not started)."""

from __future__ import annotations

import types

import pytest

from services.learner.accounting import TrainingAccount
from services.learner.core import Adoption
from services.learner.link import LearnerLink
from services.learner.settings import LearnerSettings
from services.learner.status_report import StatusReport
from services.learner.unit_state import UnitState
from tests.test_learner_accounting import FakeClock

SETTINGS = LearnerSettings(
    job="t", model="tiny", unit=1, num_units=3, max_steps=50, slowdown=2.0, status_interval_s=1.0
)


@pytest.fixture
def parts():
    clock = FakeClock(10.0)
    wall = FakeClock(1_700_000_000.0)
    unit_state = UnitState()
    account = TrainingAccount(unit_state, 640, clock=clock, wall_clock=wall)
    # Fragment 1 adopted version 5 at step 6, after version 2: versions 3 and 4 were skipped.
    adoptions = [Adoption(step=3, fragment=0, version=2, previous=1), Adoption(6, 1, 5, 2)]
    core = types.SimpleNamespace(
        step=7,
        round=3,
        tokens_per_step=64,
        base_versions=lambda: [2, 5],
        adoptions=adoptions,
        staggered=True,
    )
    link = LearnerLink(SETTINGS, 1 << 20, unit_state)  # not started
    return StatusReport(SETTINGS, core, account, link, clock=clock), account, clock, link


def test_the_report_joins_core_account_and_settings(parts):
    report, account, clock, link = parts
    account.start_running()
    clock.advance(3.0)
    account.trained(64, 2.123456)
    report.report()
    status = link.heartbeat.record()
    assert (status.unit, status.state, status.step, status.max_steps) == (1, "running", 7, 50)
    assert (status.round, status.base_version, status.base_versions) == (3, 7, [2, 5])
    assert status.staggered
    assert [(a.step, a.fragment, a.version, a.skipped) for a in status.adoptions] == [
        (3, 0, 2, 0),
        (6, 1, 5, 2),
    ]
    assert (status.tokens, status.tokens_per_s, status.tokens_per_step) == (704, 21.3, 64)
    assert (status.train_loss, status.training_s, status.lifetime_s) == (2.1235, 3.0, 0.0)
    assert (status.model, status.num_units, status.slowdown) == ("tiny", 3, 2.0)
    assert status.compute_tokens_per_s == 21.3 and status.lifetime_training_s == 3.0


def test_reports_at_most_twice_an_interval_unless_forced(parts):
    report, account, clock, link = parts
    account.start_running()
    report.report()
    clock.advance(SETTINGS.status_interval_s / 4)
    account.trained(64, 1.0)
    report.report()
    assert link.heartbeat.record().tokens == 640  # too soon
    report.state = "paused"
    report.report(force=True)
    status = link.heartbeat.record()
    assert (status.state, status.tokens) == ("paused", 704)
    clock.advance(SETTINGS.status_interval_s / 2)
    account.trained(64, 1.0)
    report.report()
    assert link.heartbeat.record().tokens == 768
