"""JobSpec validation and the job/unit state machines (pure, no processes)."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from services.gateway.jobs import (
    JOB_TRANSITIONS,
    UNIT_TRANSITIONS,
    Action,
    TransitionError,
    UnitAction,
    job_transition,
    unit_transition,
)
from shared.records.jobs import JobSpec


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"units": 0}, "units"),
        ({"codec": "int3"}, "codec"),
        ({"job": "-x"}, "job"),
        ({"min_quorum": 5, "units": 4}, "min_quorum"),
        ({"max_steps": 1, "token_budget": 1}, "token_budget"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_invalid_specs_name_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec(**{"job": "ok", **changes})
    assert field in str(err.value)


def test_spec_defaults_and_budget() -> None:
    assert JobSpec(job="a").max_steps == 300
    spec = JobSpec(job="a", token_budget=10**6)
    assert spec.max_steps is None and spec.token_budget == 10**6


def test_state_machines() -> None:
    assert job_transition("j", "created", "start") == "running"
    assert job_transition("j", "paused", "resume") == "running"
    assert unit_transition("j", 0, "idle", "start") == "running"
    assert unit_transition("j", 0, "paused", "stop") == "stopped"
    with pytest.raises(TransitionError, match="allowed: pause, stop"):
        job_transition("j", "running", "start")
    with pytest.raises(TransitionError, match="allowed: quarantine"):
        unit_transition("j", 0, "stopped", "resume")
    for state in ("idle", "running", "paused", "stopped"):
        assert unit_transition("j", 0, state, "quarantine") == "quarantined"
    with pytest.raises(TransitionError, match="quarantined is final"):
        unit_transition("j", 0, "quarantined", "resume")
    assert {action for _, action in JOB_TRANSITIONS} == set(get_args(Action))
    assert {action for _, action in UNIT_TRANSITIONS} == set(get_args(UnitAction))
    assert not any(state == "stopped" for state, _ in JOB_TRANSITIONS)  # final
    assert not any(state == "quarantined" for state, _ in UNIT_TRANSITIONS)  # final
