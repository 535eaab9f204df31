"""``bench/throughput.py``'s claims hold for figures that meet them and fail for those that do
not, from hand-built results (no benchmark runs here)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers import load_bench_script


@pytest.fixture
def throughput(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("throughput", monkeypatch)


def results(module: ModuleType, four_over_one: float, boundary: list[float]):
    provenance = module.Provenance(commit="c", command="x", machine="m", started="s")
    names = [name for name, _ in module.CONFIGS]
    cluster = module.ClusterPart(
        provenance=provenance,
        rows={
            names[0]: {"tokens_per_s": 1000.0, "eval": 3.0},
            names[1]: {"tokens_per_s": 1000.0 * four_over_one, "eval": 3.0},
            names[2]: {"tokens_per_s": 1000.0, "eval": 3.0},
        },
    )
    every, at_boundaries = (name for name, _ in module.STANDALONE_ROWS)
    standalone = module.StandalonePart(
        provenance=provenance,
        blocks={every: [100.0] * len(boundary), at_boundaries: [100.0 * r for r in boundary]},
    )
    return module.ThroughputResults(cluster=cluster, standalone=standalone)


def test_claims_hold_for_good_figures_and_fail_for_bad_ones(throughput):
    good = results(throughput, 1.06, [1.02, 0.99, 1.01])
    claims = throughput.cluster_claims(good) + throughput.standalone_claims(good)
    assert [c.holds for c in claims] == [True, True]
    bad = results(throughput, 0.85, [0.95, 1.0, 0.97])  # median of the pairs: 0.97
    claims = throughput.cluster_claims(bad) + throughput.standalone_claims(bad)
    assert [c.holds for c in claims] == [False, False]
    assert claims[1].measured == "0.970"


def test_a_part_not_run_is_not_measured(throughput):
    empty = throughput.ThroughputResults()
    claims = throughput.cluster_claims(empty) + throughput.standalone_claims(empty)
    assert [c.holds for c in claims] == [None, None]


def test_devices_claims_take_the_median_of_the_rounds_and_render_every_row(throughput):
    provenance = throughput.Provenance(
        commit="c",
        command="x",
        machine="m",
        started="s",
        configuration={"model": "small", "h_steps": 30, "block_steps": 30, "repeats": 8}
        | {"batch_per_device": throughput.DEVICES_BATCH},
    )
    part = throughput.DevicesPart(
        provenance=provenance,
        # Medians of the rounds' ratios: 2 devices 0.9 (0.8, 0.9, 1.0); 4 devices 0.6.
        rounds={"1": [100.0, 100.0, 100.0], "2": [80.0, 90.0, 100.0], "4": [60.0, 50.0, 70.0]},
    )
    claims = throughput.devices_claims(throughput.ThroughputResults(devices=part))
    assert [c.holds for c in claims] == [True, False]
    assert [c.measured for c in claims] == ["0.90", "0.60"]
    table = throughput.devices_table(part, throughput.results_path("throughput", False))
    assert "| 2 | 32 | 100 | 80, 90, 100 | 0.90× |" in table
    assert "30 steps per unit size" in table
    assert [c.holds for c in throughput.devices_claims(throughput.ThroughputResults())] == [
        None,
        None,
    ]
