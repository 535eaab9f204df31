"""The claims of ``bench/chaos.py`` hold for a run that meets them and fail for one that does
not: books that do not balance, a round applied twice or lost, a kind of service never killed, a
kill not restarted, a loss that did not fall, a run that did not finish. Runs are built by hand:
no cluster runs here."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from services.orchestration.local.records import RunSummary
from shared.ledger import balance
from shared.records.outer import EvalRecord, EvaluationRecord, OuterStatus
from shared.records.unit import UnitStatus
from tests.helpers import REPO

VICTIMS = ["outer", "gateway", "nats-server", "learner-0", "learner-1", "learner-2"]


@pytest.fixture
def chaos(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(
        "chaos_claims_under_test", REPO / "bench" / "chaos.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def failures(claims, quick: bool = False):
    from evidence import failures as of  # bench/ is on sys.path in these tests

    return of(claims, quick)


def summary(applied=((0, 9),), published=((0, 9),), final: float = 2.1, reason: str = "finished"):
    """A finished run of one unit: rounds ``published``, the outer ``applied``."""
    units = {
        0: UnitStatus(unit=0, state="stopped", published_rounds=list(published), next_round=10)
    }
    outer = OuterStatus(
        state="running",
        model="tiny",
        holder="h",
        version=10,
        applied=sum(last - first + 1 for first, last in applied),
        applied_rounds={0: list(applied)},
        evaluation=EvaluationRecord(
            init=EvalRecord(version=0, tokens=0, nats_per_byte=5.5, bits_per_byte=7.9),
            last=EvalRecord(version=10, tokens=800, nats_per_byte=final, bits_per_byte=3.0),
        ),
    )
    restarts = {victim: 2 for victim in VICTIMS}
    return RunSummary(
        reason=reason,
        elapsed_s=360,
        outer=outer,
        units=units,
        restarts=restarts,
        ledger=balance(outer, units),
    )


def results(chaos: ModuleType, minutes: float = 5.0, victims=VICTIMS, **kw):
    """A stored run: every victim killed twice, ``diloco up`` exited 0, ``summary(**kw)``."""
    from evidence import Provenance

    args = {"minutes": minutes, "seed": 0, "learners": 3, "min_gap_s": 5.0, "max_gap_s": 15.0}
    kills = [chaos.Kill(10.0 * i, v) for i, v in enumerate([*victims, *victims])]
    return chaos.ChaosResults(
        provenance=Provenance(
            commit="abc1234",
            command=".venv/bin/python bench/chaos.py",
            machine="test",
            started="2026-01-01T00:00:00+00:00",
            seconds=360.0,
            configuration={**args, "heal_s": 20.0},
        ),
        kills=kills,
        returncode=kw.pop("returncode", 0),
        summary=summary(**kw),
    )


def failing(claims, quick: bool = False) -> list[str]:
    return [claim.text.split(" (")[0] for claim in failures(claims, quick)]


def test_a_good_run_meets_every_claim_and_renders_from_the_stored_json(chaos, tmp_path):
    stored = chaos.ChaosResults.model_validate_json(results(chaos).model_dump_json())
    claims = chaos.claims(stored)
    assert len(claims) == 7 and all(claim.holds for claim in claims), claims
    assert failures(claims) == []
    text = chaos.section(stored, claims, tmp_path / "chaos.json")
    assert text.startswith(chaos.SECTION + "\n\n`.venv/bin/python bench/chaos.py` at commit")
    assert "| ledger | **balanced** |" in text and "- holds: the books balance" in text


@pytest.mark.parametrize(
    ("kw", "fails"),
    [
        ({"minutes": 1.0}, ["minutes of chaos ≥ the documented 5"]),
        ({"victims": ["outer", "nats-server", "learner-0"]}, ["every kind of service"]),
        ({"returncode": 1}, ["the run finished by itself"]),
        ({"reason": "max duration"}, ["the run finished by itself"]),
        ({"final": 5.6}, ["the held-out loss fell through the chaos"]),
        (
            {"applied": ((0, 8),)},  # round 9 published, never applied
            [
                "the books balance",
                "every round JetStream accepted was applied exactly once or rejected with a reason",
            ],
        ),
        ({"applied": (), "published": ()}, ["every round JetStream accepted"]),
        (
            {"applied": ((0, 10),)},  # round 10: the unit never handed it out (next round 10)
            [
                "the books balance",
                "every round JetStream accepted was applied exactly once or rejected with a reason",
            ],
        ),
    ],
)
def test_a_run_that_misses_a_claim_fails_it_but_not_a_quick_run(chaos, kw, fails):
    claims = chaos.claims(results(chaos, **kw))
    assert [name for name in failing(claims) if not any(name.startswith(f) for f in fails)] == []
    assert all(any(name.startswith(f) for name in failing(claims)) for f in fails)
    assert failures(claims, quick=True) == []


def test_a_round_acked_to_a_unit_killed_before_its_record_is_accounted_for(chaos, tmp_path):
    # Round 9 was applied; the unit, killed after the broker's ack, never recorded it.
    run = results(chaos, published=((0, 8),))
    claims = chaos.claims(run)
    assert all(claim.holds for claim in claims), claims
    exactly_once = next(c for c in claims if c.text.startswith("every round JetStream"))
    assert exactly_once.measured == "10 + 0 of 9 + 1"
    text = chaos.section(run, claims, tmp_path / "chaos.json")
    assert "| rounds published, acked to a unit killed before it recorded the ack | 1 |" in text


def test_a_service_killed_more_often_than_restarted_fails(chaos):
    run = results(chaos)
    assert run.summary is not None
    run.summary.restarts["gateway"] = 1
    claims = chaos.claims(run)
    assert failing(claims) == ["every killed service was restarted by `diloco up`"]
    assert "gateway 1 < 2" in failures(claims)[0].measured


def test_a_run_without_a_summary_did_not_finish_and_fails_even_a_quick_run(chaos):
    run = results(chaos)
    run.summary = None
    claims = chaos.claims(run)
    assert {c.text.split(" (")[0]: c.holds for c in claims}["the run finished by itself"] is False
    assert len(failures(claims, quick=True)) == 4  # what only the summary shows
