"""When a ``diloco up`` run is complete (``services.orchestration.local.run.job_is_complete``),
when it reached its target eval (``target_reached``) and when its units are ready to start
together (``services.orchestration.local.release.all_ready``). No NATS."""

from __future__ import annotations

from services.orchestration.local.release import READY_TIMEOUT_S, all_ready
from services.orchestration.local.run import job_is_complete, target_reached
from shared.records.outer import EvalRecord, EvaluationRecord, OuterStatus
from shared.records.unit import UnitStatus

UNITS = {0: UnitStatus(unit=0, state="finished", published_rounds=[(0, 3)])}


def outer(state: str = "running", evaluated: int | None = 4, **ledger: object) -> OuterStatus:
    last = None
    if evaluated is not None:
        last = EvalRecord(version=evaluated, tokens=1, nats_per_byte=1.0, bits_per_byte=1.4)
    return OuterStatus(
        state=state,  # type: ignore[arg-type]
        model="tiny",
        holder="h",
        version=4,
        evaluation=EvaluationRecord(last=last),
        **{"applied": 4, "applied_rounds": {0: [(0, 3)]}, **ledger},  # type: ignore[arg-type]
    )


def test_a_job_is_complete_once_everything_published_is_applied_and_evaluated():
    assert job_is_complete(outer(), UNITS)


def test_a_job_is_not_complete_before():
    assert not job_is_complete(None, UNITS)
    assert not job_is_complete(outer(state="restoring"), UNITS)
    assert not job_is_complete(outer(evaluated=None), UNITS)
    assert not job_is_complete(outer(evaluated=3), UNITS)  # the last merge is not evaluated yet
    missing = outer(applied=3, applied_rounds={0: [(0, 2)]})
    assert not job_is_complete(missing, UNITS)  # round 3 neither applied nor rejected
    rejected = outer(applied=3, applied_rounds={0: [(0, 2)]}, rejected_rounds={0: [(3, 3)]})
    assert job_is_complete(rejected, UNITS)


def test_a_run_reaches_its_target_when_the_newest_eval_is_at_or_below_it():
    assert target_reached(outer(), 1.0)  # the newest eval is 1.0 nats/byte
    assert target_reached(outer(), 1.5)
    assert not target_reached(outer(), 0.99)
    assert not target_reached(outer(), None)  # no target: never
    assert not target_reached(outer(evaluated=None), 1.0)
    assert not target_reached(None, 1.0)


def test_units_start_together_once_every_live_one_waits_paused():
    paused = {u: UnitStatus(unit=u, state="paused") for u in (0, 1)}
    assert all_ready([0, 1], paused, 1.0)
    assert not all_ready([0, 1], {0: paused[0]}, 1.0)  # unit 1 has not reported yet
    assert not all_ready([0, 1], {**paused, 1: UnitStatus(unit=1, state="starting")}, 1.0)
    assert all_ready([0], {0: paused[0]}, 1.0)  # a dead learner is not waited for
    assert all_ready([0, 1], {}, READY_TIMEOUT_S + 1)  # nor a start-up that takes too long
