"""`diloco up --chaos-mtbf-s`: the seeded failure schedule (pure) and a run that survives it."""

from __future__ import annotations

import statistics

import pytest

from services.orchestration.local.chaos import ChaosClock, link_outages, plan_chaos
from services.orchestration.local.records import ChaosEvent
from services.orchestration.local.settings import UpSettings
from services.orchestration.supervisor import RestartPolicy, State, Supervisor
from shared.link_spec import parse_outages
from tests.helpers import run_up_to_end


def test_the_schedule_is_seeded_and_has_the_asked_rates():
    events = plan_chaos(4, ["outer"], ["kill", "pause"], 20.0, 5.0, 20_000.0, seed=7)
    assert events == plan_chaos(4, ["outer"], ["kill", "pause"], 20.0, 5.0, 20_000.0, seed=7)
    assert events != plan_chaos(4, ["outer"], ["kill", "pause"], 20.0, 5.0, 20_000.0, seed=8)
    assert [e.at_s for e in events] == sorted(e.at_s for e in events)
    assert {e.target for e in events} == {
        "learner-0",
        "learner-1",
        "learner-2",
        "learner-3",
        "outer",
    }
    assert {e.kind for e in events if e.target == "outer"} == {"kill"}  # services are killed
    assert {e.kind for e in events if e.target != "outer"} == {"kill", "pause"}
    assert statistics.mean(e.repair_s for e in events) == pytest.approx(5.0, rel=0.1)
    unit0 = [e for e in events if e.target == "learner-0"]
    assert len(unit0) == pytest.approx(20_000 / 25, rel=0.1)  # one failure per MTBF + MTTR
    for first, second in zip(unit0[:-1], unit0[1:], strict=True):
        assert second.at_s > first.at_s + first.repair_s  # a target fails again once repaired


def test_cuts_become_the_units_link_outages():
    events = [
        ChaosEvent(at_s=3.0, target="learner-1", kind="cut", repair_s=2.5),
        ChaosEvent(at_s=4.0, target="learner-0", kind="cut", repair_s=1.0),
        ChaosEvent(at_s=9.0, target="learner-1", kind="pause", repair_s=1.0),
    ]
    outages = parse_outages(link_outages(events, 1))
    assert [(o.start_s, o.duration_s, o.mode) for o in outages] == [(3.0, 2.5, "cut")]
    assert link_outages(events, 2) == ""


def test_the_clock_starts_each_failure_once_and_ends_pauses_after_their_repair():
    events = [
        ChaosEvent(at_s=1.0, target="learner-0", kind="pause", repair_s=2.0),
        ChaosEvent(at_s=2.0, target="learner-1", kind="kill", repair_s=5.0),
    ]
    clock = ChaosClock(events)
    assert clock.starting(0.5) == [] and clock.pauses_ending(0.5) == []
    assert clock.starting(2.5) == events
    assert clock.starting(10.0) == []
    assert clock.pauses_ending(2.9) == []
    assert clock.pauses_ending(3.0) == [events[0]] and clock.pauses_ending(9.0) == []


def test_a_failed_child_is_restarted_only_after_its_repair():
    supervisor = Supervisor(RestartPolicy())
    supervisor.add("learner-0", 0.0)
    supervisor.hold("learner-0", 100.0 + 7.5)
    decision = supervisor.exited("learner-0", -9, 100.0)
    assert decision.state is State.WAITING and decision.delay_s == pytest.approx(7.5)
    assert supervisor.due(107.0) == [] and supervisor.due(107.5) == ["learner-0"]
    supervisor.hold("learner-0", 107.5 + 4.0)  # failed again while it was down
    assert supervisor.due(111.0) == [] and supervisor.due(111.5) == ["learner-0"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"chaos_mtbf_s": 10, "chaos_kinds": "kill,explode"}, "chaos-kinds"),
        ({"chaos_mtbf_s": 10, "chaos_kinds": "cut"}, "needs learners' links"),
        ({"chaos_services": "gateway"}, "chaos-services"),
    ],
)
def test_chaos_options_are_checked(flags, message):
    with pytest.raises(ValueError, match=message):
        UpSettings(**flags)
    assert UpSettings(chaos_mtbf_s=10, chaos_kinds="cut", link="20mbit").chaos_schedule()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_run_under_chaos_logs_every_failure_and_its_books_balance(tmp_path, jax_cache):
    summary, output = run_up_to_end(
        tmp_path,
        jax_cache,
        *("--max-steps", "100", "--h-steps", "10", "--slowdowns", "3,3", "--link", "50mbit"),
        *("--chaos-mtbf-s", "12", "--chaos-mttr-s", "3", "--chaos-kinds", "kill,pause,cut"),
        *("--chaos-seed", "3"),
    )
    kinds = {event.kind for event in summary.chaos}
    assert kinds == {"kill", "pause", "cut"}, summary.chaos
    for event in summary.chaos:  # each injected failure is shown with its time
        assert f"{event.kind} {event.target} for {event.repair_s:.1f} s" in output
    # A killed unit came back (a kill that finds its unit already down or finished restarts
    # nothing).
    assert sum(summary.restarts[f"learner-{u}"] for u in (0, 1)) >= 1, summary.restarts
    assert "failures injected" in output
    # Goodput: every unit lost time to its failures, none did more than it could.
    assert summary.goodput is not None and summary.goodput.job is not None
    assert set(summary.goodput.units) == {0, 1}
    # How much it kept depends on the machine's load (bench/goodput.py measures that); here it
    # must be measured, and below 1.
    assert 0.0 < summary.goodput.job < 1.0, summary.goodput
    assert "goodput " in output
