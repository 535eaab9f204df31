"""The claims of ``bench/outer_shards.py`` hold for figures that meet them and fail for figures
that do not: two shards apply ≥ 1.6× one outer's uploads, or the cores are what saturates.
Runs are built by hand: no load test runs here."""

from __future__ import annotations

from types import ModuleType

import pytest

from services.loadtest.records import LoadtestReport
from shared.link_spec import parse_link
from tests.helpers import load_bench_script
from tests.test_bench_loadtest import failures, stage


@pytest.fixture
def shards(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("outer_shards", monkeypatch)


def results(module: ModuleType, one: float, two: float, two_cpu: float, balanced: bool = True):
    """A pair at 64 units: one outer applying ``one`` uploads/s, two shards ``two`` with
    ``two_cpu`` cores of outers (nats-server and the generator add 1.11)."""

    def run(shards: int, applied: float, cpu: float):
        report = LoadtestReport(
            model="medium",
            param_count=1,
            codec="int8",
            params_codec="int8",
            params_fetch="newest",
            link=parse_link("100mbit/25ms"),
            upload_every_s=10,
            upload_payload_bytes=1,
            fragments=2,
            outer_shards=shards,
            stages=[stage(64, applied, balanced=balanced, outer_cpu=cpu)],
        )
        return module.ShardsRun(shards=shards, seed=0, returncode=0, report=report)

    provenance = module.Provenance(
        commit="x",
        command="bench/outer_shards.py",
        configuration={"repeats": 1, "cores": 2, "units": 64},
        machine="m",
        started="now",
    )
    return module.ShardsResults(
        provenance=provenance, runs=[run(1, one, 0.76), run(2, two, two_cpu)]
    )


def test_two_shards_that_double_the_ingest_pass(shards: ModuleType) -> None:
    assert failures(shards.claims(results(shards, 2.5, 4.5, 0.8))) == []


def test_no_speed_up_passes_only_where_the_cores_are_what_saturates(shards: ModuleType) -> None:
    # 0.8 + 1.11 = 1.91 of 2 cores: the machine saturates; the section states the cost.
    assert failures(shards.claims(results(shards, 2.5, 2.9, 0.8))) == []
    # 0.3 + 1.11 = 1.41 of 2 cores: idle cores and no speed-up fails.
    failed = failures(shards.claims(results(shards, 2.5, 2.9, 0.3)))
    assert [c.text for c in failed] == [shards.speedup_text()]


def test_unbalanced_books_fail(shards: ModuleType) -> None:
    failed = failures(shards.claims(results(shards, 2.5, 4.5, 0.8, balanced=False)))
    assert len(failed) == 1 and "books balance" in failed[0].text


def test_shards_that_cost_much_more_cpu_per_mb_fail(shards: ModuleType) -> None:
    # 2.0 cores for 2.9 uploads/s against 0.76 for 2.5: 2.3x one outer's CPU per MB.
    failed = failures(shards.claims(results(shards, 2.5, 2.9, 2.0)))
    assert len(failed) == 1 and "a shard costs little" in failed[0].text
