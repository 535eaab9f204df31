"""The claims of ``bench/goodput.py``, ``bench/quality.py``, ``bench/scaling.py`` and
``bench/summary.py`` hold for figures that meet them and fail for figures that do not; a claim
without its figures is "not measured" and fails a full run and a quick one alike. Runs are built
by hand: no benchmark runs here."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from types import ModuleType

import pytest

from services.orchestration.local.records import ChaosEvent
from sim.cluster.model import GoodputRun
from tests.helpers import load_bench_script


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Loads ``bench/<name>.py``."""
    return lambda name: load_bench_script(name, monkeypatch)


def run(
    method: str = "decoupled",
    mtbf_s: float | None = None,
    link: str | None = None,
    seed: int = 1,
    curve: list[tuple[float, float]] | None = None,
    goodput: float = 0.9,
    seconds_per_version: float = 1.0,
    chaos: list[ChaosEvent] | None = None,
) -> GoodputRun:
    curve = curve or [(0.0, 5.0), (100.0, 3.0)]
    rate = "none" if mtbf_s is None else f"mtbf {mtbf_s:g}s"
    return GoodputRun(
        key=f"{method} / {rate} / {link or 'unshaped'} / seed {seed}",
        commit="abc1234",
        seed=seed,
        method=method,  # type: ignore[arg-type]
        mtbf_s=mtbf_s,
        link=link,
        reason="finished",
        elapsed_s=curve[-1][0],
        goodput=goodput,
        up=1.0,
        unit_goodput={},
        unit_up={},
        speeds={"0": 2048.0, "1": 2048.0},  # tokens per step 1024: 0.5 s of compute per step
        unit_applied={"0": 100 * 1024, "1": 100 * 1024},  # 100 steps of each unit applied
        windows={},
        restarts={},
        tokens_per_step=1024,
        h_steps=30,
        steps=240,
        applied=10,
        versions=10,
        upload_bytes=1.0,
        end_s=curve[-1][0],
        seconds_per_version=seconds_per_version,
        final_eval=curve[-1][1],
        curve=curve,
        chaos=chaos or [],
    )


def kill(unit: int = 0) -> ChaosEvent:
    return ChaosEvent(at_s=10.0, target=f"learner-{unit}", kind="kill", repair_s=5.0)


def goodput_args(goodput: ModuleType, **changes: object) -> argparse.Namespace:
    args = goodput.parser().parse_args([])
    vars(args).update(
        {"seeds": [], "rates": "30", "extra_seeds": [], "throttled": "4mbit/25ms", **changes}
    )
    return args


def goodput_results(goodput: ModuleType, args, runs: list[GoodputRun], defined_before=None):
    keys = [row.key for row in goodput.rows(args)]
    target = goodput.Target(
        nats_per_byte=3.06,
        source="decoupled / none / unshaped / seed 1: final eval 3.0 × 1.02",
        commit="abc1234",
        defined_before=keys[1:] if defined_before is None else defined_before,
    )
    return goodput.GoodputResults(target=target, runs={r.key: r for r in runs})


def good_goodput_runs() -> list[GoodputRun]:
    fast = [(0.0, 5.0), (60.0, 3.0)]
    slow = [(0.0, 5.0), (600.0, 3.05)]
    return [
        run("decoupled", curve=[(0.0, 5.0), (90.0, 3.0)]),
        run("sync", goodput=0.8, curve=[(0.0, 5.0), (100.0, 2.98)]),
        run("dp-like", goodput=0.7, curve=fast, seconds_per_version=1.0),
        run("decoupled", link="4mbit/25ms", curve=[(0.0, 5.0), (120.0, 3.0)]),
        run("sync", link="4mbit/25ms", curve=[(0.0, 5.0), (200.0, 3.0)]),
        run("dp-like", link="4mbit/25ms", curve=slow, seconds_per_version=9.0),
        run("decoupled", 30.0, goodput=0.8, chaos=[kill()]),
        run("sync", 30.0, goodput=0.5, chaos=[kill()]),
        run("dp-like", 30.0, goodput=0.3, chaos=[kill()]),
    ]


def verdicts(checked) -> dict[str, bool | None]:
    return {claim.text: claim.holds for claim in checked}


def test_goodput_claims_hold_for_runs_that_meet_them(bench):
    goodput = bench("goodput")
    args = goodput_args(goodput)
    results = goodput_results(goodput, args, good_goodput_runs())
    checked = goodput.claims(goodput.Stored(results, args))
    assert all(verdicts(checked).values()), checked
    # The parameter server's link time per step, 600 s / 100 steps less 60 s / 100 steps without
    # a cap, over 0.5 s of compute per step: 10.8×.
    comm = next(c for c in checked if "communication" in c.text)
    assert comm.measured == "10.8"


def test_goodput_claims_fail_for_runs_that_do_not(bench):
    goodput = bench("goodput")
    evidence = bench("evidence")
    args = goodput_args(goodput)
    runs = good_goodput_runs()
    bad = {
        # the parameter server on the link: too little communication, and never at the target
        "dp-like / none / 4mbit/25ms / seed 1": run(
            "dp-like", link="4mbit/25ms", curve=[(0.0, 5.0), (50.0, 3.5)], seconds_per_version=3.0
        ),
        # sync without a kill, and with more goodput than decoupled
        "sync / mtbf 30s / unshaped / seed 1": run("sync", 30.0, goodput=0.95),
    }
    runs = [bad.get(r.key, r) for r in runs]
    # a run measured after the target was set, that the target did not know of
    results = goodput_results(goodput, args, runs, defined_before=[])
    seen = verdicts(goodput.claims(goodput.Stored(results, args)))
    assert seen["the target was set from the first run before any run it judges"] is False
    assert seen["4mbit/25ms: the parameter server's communication ≥ 10× its compute"] is False
    ran = "4mbit/25ms: the parameter server ran to the target (measured, not extrapolated)"
    assert seen[ran] is False
    # the parameter server never reached the target, decoupled did: decoupled was sooner
    assert seen["4mbit/25ms: decoupled reaches the target sooner than the parameter server"]
    assert seen["1 per 30 s: sync saw at least one kill"] is False
    assert seen["1 per 30 s: decoupled goodput ≥ sync's"] is False
    assert seen["1 per 30 s: decoupled goodput ≥ dp-like's"] is True
    checked = goodput.claims(goodput.Stored(results, args))
    assert len(evidence.failures(checked)) == 5
    # A quick run fails only on what it could not measure: a run missing.
    assert evidence.failures(checked, quick=True) == []
    del results.runs["decoupled / none / 4mbit/25ms / seed 1"]
    checked = goodput.claims(goodput.Stored(results, args))
    assert [c.text for c in evidence.failures(checked, quick=True)] == [
        "4mbit/25ms: decoupled reaches the target sooner than the parameter server"
    ]
    # decoupled on the link never at the target: measured, and false
    slow = run("decoupled", link="4mbit/25ms", curve=[(0.0, 5.0), (90.0, 3.2)])
    results.runs[slow.key] = slow
    seen = verdicts(goodput.claims(goodput.Stored(results, args)))
    assert (
        seen["4mbit/25ms: decoupled reaches the target sooner than the parameter server"] is False
    )


def test_goodput_rows_start_with_the_run_that_defines_the_target(bench):
    goodput = bench("goodput")
    args = goodput.parser().parse_args([])
    planned = goodput.rows(args)
    assert planned[0] == goodput.Row("decoupled", None, None, args.seed)
    assert len({row.key for row in planned}) == len(planned)
    first = run("decoupled", curve=[(0.0, 5.0), (90.0, 2.8)])
    target = goodput.define_target(first, [row.key for row in planned[1:]])
    assert target.nats_per_byte == pytest.approx(2.856)


def test_quality_claims(bench):
    quality = bench("quality")
    real = {
        "decoupled": [run("decoupled", seed=s, curve=[(0.0, 5.0), (9.0, 2.80)]) for s in (1, 2, 3)],
        "sync": [run("sync", seed=s, curve=[(0.0, 5.0), (9.0, 2.79)]) for s in (1, 2, 3)],
        "dp-like": [run("dp-like", seed=s, curve=[(0.0, 5.0), (9.0, 2.60)]) for s in (1, 2, 3)],
    }
    twins = [
        quality.TwinRun(method=m, seed=s, final_eval=v, curve=[], outer_steps=1, seconds=1.0)
        for m, v in (("decoupled", 2.85), ("sync", 2.80), ("dp-like", 2.61))
        for s in (1, 2, 3)
    ]
    assert all(verdicts(quality.real_claims(real, twins)).values())
    worse = {**real, "decoupled": [run("decoupled", seed=1, curve=[(0.0, 5.0), (9.0, 2.9)])]}
    far = [t.model_copy(update={"final_eval": 3.0}) if t.method == "sync" else t for t in twins]
    seen = verdicts(quality.real_claims(worse, far))
    assert seen["decoupled: seeds measured on the real system"] is False
    assert seen["decoupled's mean final eval ≤ 1.02× synchronous DiLoCo's (real system)"] is False
    assert (
        seen["sync: the simulator's twin within 3% of the real system (mean final eval)"] is False
    )
    assert seen["dp-like: the simulator's twin within 3% of the real system (mean final eval)"]
    no_twins = verdicts(quality.real_claims(real, []))
    assert (
        no_twins["decoupled: the simulator's twin within 3% of the real system (mean final eval)"]
        is None
    )


def test_scaling_scores_held_out_runs_only(bench):
    scaling = bench("scaling")
    runs = [
        run("decoupled"),
        run("decoupled", 30.0),
        run("decoupled", seed=2),
        run("sync", link="4mbit/25ms"),
    ]
    fit, held = scaling.split(runs, fit_seed=1)
    assert [r.key for r in fit] == [runs[0].key, runs[1].key]
    assert [r.key for r in held] == [runs[2].key, runs[3].key]
    # a held-out run is simulated with the fit set's speeds, not its own
    other = run("decoupled", seed=2).model_copy(update={"speeds": {"0": 1.0, "1": 1.0}})
    assert scaling.as_predicted(other, fit).speeds == runs[0].speeds

    def prediction(key: str, real: float, sim: float, cut_off: bool = False):
        return scaling.Prediction(
            key=key, commit="c", real=real, sim=sim, real_up=1.0, sim_up=1.0,
            real_window=1.0, sim_window=1.0, cut_off=cut_off,
        )  # fmt: skip

    def results(predictions):
        return scaling.ScalingResults.model_construct(predictions=predictions)

    seed2 = "none / unshaped / seed 2"
    ranked = [
        prediction(f"decoupled / {seed2}", 0.99, 0.90),
        prediction(f"sync / {seed2}", 0.80, 0.60),
        prediction(f"dp-like / {seed2}", 0.50, 0.55),
        prediction("dp-like / none / 4mbit/25ms / seed 1", 0.03, 0.9, cut_off=True),  # not scored
    ]
    assert all(verdicts(scaling.claims(results(ranked))).values())
    swapped = [*ranked[:2], prediction(f"dp-like / {seed2}", 0.50, 0.65)]
    assert not any(verdicts(scaling.claims(results(swapped))).values())
    assert list(verdicts(scaling.claims(results(ranked[:1]))).values()) == [None]


def test_summary_claims_every_section_names_its_raw_results(bench):
    summary = bench("summary")
    text = (
        "# Benchmarks\n\n## Running the benchmarks\n\nno file\n\n"
        "## A\n\nRaw results: `bench/results/a.json`.\n\n## B\n\nfrom memory\n"
    )
    found = summary.sections(text)
    assert list(found) == ["## A", "## B"]
    assert list(verdicts(summary.claims(found)).values()) == [False]
    assert list(verdicts(summary.claims({"## A": found["## A"]})).values()) == [True]


def test_summary_reads_one_provenance_or_one_per_section_or_per_run(bench, tmp_path):
    summary = bench("summary")
    one = {"commit": "a", "command": "x", "machine": "m", "started": "s", "seconds": 60.0}
    files = {
        "plain.json": {"provenance": one},
        "sections.json": {"cluster": {"provenance": one}, "loop": {"provenance": one}},
        "runs.json": {"runs": {"r": {"commit": "b", "command": ["y"], "elapsed_s": 30.0}}},
        "other.json": {"rows": []},
    }
    counts = {}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
        counts[name] = [p.seconds for p in summary.provenances(tmp_path / name)]
    assert counts == {
        "plain.json": [60.0],
        "sections.json": [60.0, 60.0],
        "runs.json": [30.0],
        "other.json": [],
    }
