"""The cluster simulator: failures cost what each method's blocking makes them cost."""

from __future__ import annotations

import pytest

from sim.cluster.engine import simulate
from sim.cluster.model import Cluster, Failure, Link, Method, Unit
from sim.cluster.scenarios import ChipScale, TwelveB, chip_scale, twelve_b

UNIT = Unit(step_s=1.0, tokens_per_step=10)
LOOPBACK = Link()


def method(mode: str, **kw) -> Method:
    fields = {"h_steps": 100, "upload_bytes": 0.0, "params_bytes": 0.0, "merge_s": 0.0}
    return Method(mode=mode, **{**fields, "sync_timeout_s": 30.0, **kw})


def run(mode: str, failures=(), units=8, link=LOOPBACK, horizon_s=20_000.0, **kw):
    return simulate(
        Cluster(
            units=(UNIT,) * units,
            link=link,
            method=method(mode, **kw),
            horizon_s=horizon_s,
            failures=tuple(failures),
        )
    )


def test_without_failures_every_method_turns_all_compute_into_training():
    for mode in ("decoupled", "sync"):
        outcome = run(mode, horizon_s=1000.0)
        assert outcome.goodput == pytest.approx(1.0) and outcome.up == pytest.approx(1.0)
        assert outcome.applied_tokens == 8 * 1000 * 10


def test_a_stalled_unit_costs_decoupled_its_own_time_and_sync_everyones():
    # Unit 0 stalls 10 s every 200 s: 5% of its time.
    stalls = [Failure(50 + 200 * k, 0, "pause", 10.0) for k in range(100)]
    decoupled, sync = run("decoupled", stalls), run("sync", stalls)
    assert decoupled.up == sync.up == pytest.approx(1 - 0.05 / 8, abs=1e-3)
    assert decoupled.goodput == pytest.approx(1 - 0.05 / 8, abs=2e-3)
    assert sync.goodput == pytest.approx(0.95, abs=5e-3)  # every unit waits at the barrier


def test_sync_drops_a_unit_after_the_timeout_and_it_falls_back_in_step():
    outcome = run("sync", [Failure(50, 0, "pause", 50.0)], horizon_s=600.0)
    # The round waits the timeout (100 + 30), the late unit goes on from that global at its
    # own sync point (150), and the next round waits for it: in step again from 250 on.
    assert [round(t) for t in outcome.merges] == [130, 250, 350, 450, 550]


def test_a_kill_loses_the_steps_since_the_newest_checkpoint_and_the_restart():
    kill = [Failure(55.5, 0, "kill", 10.0)]
    cluster = dict(units=1, horizon_s=1000.0)
    at_syncs = run("decoupled", kill, checkpoint_every_s=0.0, **cluster)
    every_10s = run("decoupled", kill, checkpoint_every_s=10.0, **cluster)
    assert at_syncs.lost_steps == 55 and every_10s.lost_steps == 5
    slow = simulate(
        Cluster(
            units=(Unit(step_s=1.0, tokens_per_step=10, restart_s=5.0),),
            link=Link(),
            method=method("decoupled"),
            horizon_s=1000.0,
            failures=tuple(kill),
        )
    )
    assert slow.up == pytest.approx(1 - 15 / 1000)


def test_a_cut_link_delays_uploads_but_not_compute_in_decoupled():
    cut = [Failure(90, 0, "cut", 30.0)]
    outcome = run("decoupled", cut, units=1, horizon_s=1000.0)
    assert outcome.up == pytest.approx(1.0)
    assert outcome.merges[0] == pytest.approx(120.0)  # the first upload waited for the link
    assert outcome.applied_tokens == 1000 * 10


def test_a_slow_link_blocks_sync_every_round_and_never_decoupled():
    link = Link(rate_bps=8e6, latency_s=0.0)  # 1 MB/s each way
    kw = {"upload_bytes": 10e6, "params_bytes": 10e6, "units": 2, "horizon_s": 1100.0}
    sync, decoupled = run("sync", link=link, **kw), run("decoupled", link=link, **kw)
    assert sync.merges[:2] == pytest.approx([110.0, 230.0])  # 100 s compute + 10 s up + 10 down
    assert decoupled.up == pytest.approx(1.0) and decoupled.versions == 20


def test_chip_scale_ordering_and_the_12b_budget():
    c = ChipScale(horizon_s=3600.0)
    goodput = {
        m: chip_scale(m, 1_200_000, c).goodput
        for m in ("data-parallel", "elastic data-parallel", "decoupled M=8")
    }
    assert goodput["data-parallel"] < goodput["elastic data-parallel"] < goodput["decoupled M=8"]
    t = TwelveB(steps=300)
    assert twelve_b("data-parallel", 2.0, t).end_s > 20 * twelve_b("decoupled", 2.0, t).end_s
