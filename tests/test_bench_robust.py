"""The claims of ``bench/robust.py`` hold for figures within their bounds and fail outside
them, and a row the run did not make fails even a quick run. Results are built by hand:
nothing is trained here."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest

from tests.helpers import load_bench_script


@pytest.fixture
def robust(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("robust", monkeypatch)


def failures(claims, quick: bool = False):
    from evidence import failures as of  # bench/ is on sys.path in these tests

    return of(claims, quick)


def args(robust: ModuleType) -> argparse.Namespace:
    out = robust.parser().parse_args([])
    out.attacks = out.attacks.split(",")
    return out


def figures(robust: ModuleType, key: str, final: float, **changes):
    hostile = changes.pop("hostile", [])
    fields = {
        "key": key,
        "commit": "abc1234",
        "flags": [],
        "elapsed_s": 120.0,
        "final_eval": final,
        "balanced": True,
        "applied": 180,
        "hostile_units": hostile,
        "hostile_published": 45 if hostile else 0,
        "hostile_rejected": {},
        "hostile_clipped": 0,
        "hostile_applied": 0,
        "honest_rejected": {},
        "honest_clipped": 0,
    }
    return robust.RunFigures(**{**fields, **changes})


def results(robust: ModuleType, **finals: float):
    """A full run's results that meet every claim, but for ``finals`` (row name with spaces
    and '+' as '_': final eval)."""
    from evidence import Provenance

    provenance = Provenance(
        commit="abc1234",
        command=".venv/bin/python bench/robust.py",
        machine="test",
        started="2026-01-01T00:00:00+00:00",
        seconds=60.0,
    )
    out = robust.RobustResults(provenance=provenance)
    a = args(robust)
    for row in robust.rows(a):
        name = row.name.replace(" + ", "_").replace(", ", "_").replace(" ", "_")
        final = finals.get(name, 3.0 if "alone" not in row.name else 2.98)
        hostile = robust.hostile_units(row)
        changes = {}
        kind = next((k for k in robust.ATTACKS if row.name.startswith(k)), None)
        reasons = robust.REASONS.get(kind) if kind else None
        if reasons is not None and reasons[0] == "clipped":
            changes["hostile_clipped"] = 45
        elif reasons is not None:
            changes["hostile_rejected"] = {reasons[0]: 45}
        out.runs[row.key] = figures(robust, row.key, final, hostile=hostile, **changes)
    for seed in a.seeds:
        key = f"twin / seed {seed}"
        with_review = finals.get(f"twin_{seed}", 2.80)
        out.twins[key] = robust.TwinCost(
            key=key,
            commit="abc1234",
            with_review=with_review,
            without_review=2.80,
            rejected={},
            seconds=60.0,
        )
    return out


def test_every_claim_holds_for_figures_within_bounds(robust: ModuleType) -> None:
    checked = robust.claims(results(robust), args(robust))
    assert failures(checked) == [] and len(checked) == 3 + 6 + 4 + 1 + 1


@pytest.mark.parametrize(
    ("row", "final"),
    [
        ("twin_1", 2.845),  # honest cost in the simulator: 1.6% / 3 seeds = 0.5%+
        ("clean", 3.08),  # honest cost on the real system 2.7%, beyond its noise
        ("sign_flip", 3.05),  # 2.3% above the honest units alone
        ("2_alie_of_8", 3.15),  # 5.7% above the 6 honest alone
    ],
)
def test_a_claim_fails_outside_its_bound(robust: ModuleType, row: str, final: float) -> None:
    checked = robust.claims(results(robust, **{row: final}), args(robust))
    assert len(failures(checked)) == 1


def test_an_attack_the_outer_did_not_count_fails(robust: ModuleType) -> None:
    stored = results(robust)
    key = next(k for k in stored.runs if k.startswith("replay / "))
    stored.runs[key].hostile_rejected = {"round_replayed": 10}
    failed = failures(robust.claims(stored, args(robust)))
    assert [c.text for c in failed] == [
        "at least 90% of the replay unit's uploads are counted as payload_replayed"
    ]


def test_a_too_frequent_unit_applied_beyond_its_pace_fails(robust: ModuleType) -> None:
    stored = results(robust)
    key = next(k for k in stored.runs if k.startswith("too_frequent / "))
    stored.runs[key].hostile_applied = 130  # honest: (310 - 130) / 3 = 60 each; allowed 130
    stored.runs[key].applied = 310
    assert failures(robust.claims(stored, args(robust))) == []
    stored.runs[key].hostile_applied = 140
    stored.runs[key].applied = 320
    assert len(failures(robust.claims(stored, args(robust)))) == 1


def test_unbalanced_books_fail(robust: ModuleType) -> None:
    stored = results(robust)
    next(iter(stored.runs.values())).balanced = False
    assert [c.text for c in failures(robust.claims(stored, args(robust)))] == [
        "every run's books balance"
    ]


def test_a_real_cost_within_the_noise_holds_and_the_twins_decide(robust: ModuleType) -> None:
    """A real run's cost of 2% (within its run-to-run spread) passes; 0.5% in the twins
    does not."""
    assert failures(robust.claims(results(robust, clean=3.06), args(robust))) == []
    failed = failures(robust.claims(results(robust, twin_1=2.83, twin_2=2.83), args(robust)))
    assert [c.text.split(" of final eval")[0] for c in failed] == [
        "peer review costs honest runs at most 0.5%"
    ]


def test_a_missing_row_fails_a_quick_run(robust: ModuleType) -> None:
    stored = results(robust)
    del stored.runs[next(k for k in stored.runs if k.startswith("honest units alone"))]
    assert len(failures(robust.claims(stored, args(robust)), quick=True)) == len(robust.ATTACKS)


def test_the_stored_runs_render_and_every_claim_holds(
    robust: ModuleType,
) -> None:
    from tests.helpers import REPO

    path = REPO / "bench" / "results" / "robust.json"
    stored = robust.RobustResults.model_validate_json(path.read_text())
    a = args(robust)
    for key, value in stored.provenance.configuration.items():
        setattr(a, key, value.split(",") if key == "attacks" else value)
    checked = robust.claims(stored, a)
    assert failures(checked, quick=True) == []  # every claim measured
    assert failures(checked) == []
    assert "| too_frequent / seed 1 |" in robust.render(stored, checked, path, a)
