"""The claims of ``bench/links.py`` hold for figures that meet them and fail for figures that do
not; a full run makes every claim (and fails the ones without figures), a quick run only those
about the rows it ran; ``--render`` renders the stored runs. Runs are built by hand: no benchmark
runs here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.helpers import REPO

SLOW_LINK = "4 units, 1mbit, int8: final eval ≤ 1.03× no cap"
BYTES = "4 units, 1mbit, int8: ≥ 100× fewer bytes than data-parallel"
SPEED = "4 units, 1mbit, int8: tokens/s ≥ 0.9× no cap"


@pytest.fixture(scope="module")
def links() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "bench"))
        spec = importlib.util.spec_from_file_location(
            "links_under_test", REPO / "bench" / "links.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while defined
        spec.loader.exec_module(module)
        yield module
        sys.modules.pop(spec.name, None)


def run(links: ModuleType, label: str, seed: int = 0, **figures: float):
    """One run of the row ``label`` with good figures but for ``figures``."""
    good = dict(
        final_eval=2.78,
        tokens_per_s=3000.0,
        times_less=150.0,
        network_wait_share=0.001,
    )
    return links.RunFigures(
        label=label,
        seed=seed,
        commit="abc1234",
        command=["services.cli", "up"],
        elapsed_s=60.0,
        init_eval=5.5,
        tokens=1000,
        up_per_token=10.0,
        down_per_token=10.0,
        utilisation=0.5,
        staleness={0: 3},
        **{**good, **figures},
    )


def claims_of(links: ModuleType, *runs, quick: bool = False) -> dict[str, object]:
    """The claims of a full (or quick) run's table holding ``runs``, by text."""
    results = links.Results(machine="test", runs={f"{r.label} / seed {r.seed}": r for r in runs})
    rows = links.quick_rows() if quick else links.rows()
    seeds = links.QUICK_SEEDS if quick else links.SEEDS
    return {c.text: c for c in links.claims(links.Table(results, seeds, rows))}


def test_a_slow_links_final_eval_holds_within_the_bound_of_its_no_cap_twin(links):
    import evidence

    base = run(links, "4 units, no cap, int8", final_eval=2.78)
    held = claims_of(links, base, run(links, "4 units, 1mbit, int8", final_eval=2.80))[SLOW_LINK]
    assert held.holds is True and held.measured == "2.8000 / 2.7800 = 1.007"
    failed = claims_of(links, base, run(links, "4 units, 1mbit, int8", final_eval=2.90))
    assert failed[SLOW_LINK].holds is False
    assert failed[SLOW_LINK] in evidence.failures(failed.values())
    assert failed[SLOW_LINK] not in evidence.failures(failed.values(), quick=True)


def test_fewer_bytes_than_data_parallel_holds_at_the_bound_and_fails_below_it(links):
    import evidence

    held = claims_of(links, run(links, "4 units, 1mbit, int8", times_less=143.2))[BYTES]
    assert held.holds is True and held.measured == "143×"
    failed = claims_of(links, run(links, "4 units, 1mbit, int8", times_less=90.0))
    assert failed[BYTES].holds is False and failed[BYTES].measured == "90×"
    assert failed[BYTES] in evidence.failures(failed.values())
    assert claims_of(links)[BYTES].holds is None


def test_the_slowest_units_speed_at_1mbit_holds_near_no_cap_and_fails_well_below(links):
    import evidence

    base = run(links, "4 units, no cap, int8", tokens_per_s=3000.0)
    held = claims_of(links, base, run(links, "4 units, 1mbit, int8", tokens_per_s=2820.0))[SPEED]
    assert held.holds is True and held.measured == "0.94"
    failed = claims_of(links, base, run(links, "4 units, 1mbit, int8", tokens_per_s=2400.0))
    assert failed[SPEED].holds is False and failed[SPEED].measured == "0.80"
    assert failed[SPEED] in evidence.failures(failed.values())


def test_a_full_run_makes_every_claim_and_fails_those_without_runs(links):
    import evidence

    checked = claims_of(links)
    assert len(checked) == 25  # 6 slow links, 12 + 1 bytes, 2 + 1 eval bounds, 2 speeds, wait
    assert all(c.holds is None and c.measured == "not measured" for c in checked.values())
    assert len(evidence.failures(checked.values())) == 25
    assert len(evidence.failures(checked.values(), quick=True)) == 25


def test_a_quick_run_makes_only_the_claims_about_its_rows(links):
    import evidence

    no_cap, slow = links.QUICK_LABELS
    checked = claims_of(
        links, run(links, no_cap), run(links, slow, final_eval=3.5, network_wait_share=0.02),
        quick=True,
    )  # fmt: skip
    assert list(checked) == [
        f"{slow}: final eval ≤ 1.03× no cap",
        "every run: training loops ≤ 1% of their time in network calls",
    ]
    assert not any(c.holds for c in checked.values())  # measured: a quick run passes them
    assert evidence.failures(checked.values(), quick=True) == []
    assert len(evidence.failures(claims_of(links, quick=True).values(), quick=True)) == 2


def test_the_section_lists_the_claims_under_the_table(links):
    base = run(links, "4 units, no cap, int8")
    results = links.Results(machine="test", runs={"4 units, no cap, int8 / seed 0": base})
    table = links.Table(results, 1, links.rows())
    text = links.render(table, links.claims(table), results, "bench/links.py --render")
    assert text.startswith("## Throttled links\n\n`bench/links.py --render` — ")
    assert "each at the commit in its row's last column" in text.splitlines()[2]
    assert "| 4 units, no cap, int8 | 1 | 2.7800 |" in text
    assert f"- NOT MEASURED: {BYTES} (not measured)" in text
    assert "- holds: 4 units, no cap, int8: ≥ 100× fewer bytes than data-parallel (150×)" in text
    assert "![" not in text


def test_render_without_stored_results_says_so(links, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_QUICK_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["links.py", "--quick", "--render"])
    with pytest.raises(SystemExit, match="no stored results"):
        links.main()
    assert list(tmp_path.iterdir()) == []


def test_render_of_the_stored_runs_exits_0():
    stored = REPO / "bench" / "results" / "links.json"
    assert stored.exists()
    done = subprocess.run(
        ["nice", "-n", "19", sys.executable, "bench/links.py", "--render", "--seeds", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(
        "## Throttled links\n\n`.venv/bin/python bench/links.py --render --seeds 2` — "
    )
    assert "`bench/results/links.json`" in done.stdout and "FAILS" not in done.stdout
