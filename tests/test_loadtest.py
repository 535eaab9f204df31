"""`diloco loadtest`: synthetic units against the real outer and nats-server, and how a stage
is judged."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.loadtest.records import LoadtestReport, LoadtestStage
from services.loadtest.report import StageNumbers, judge, saturation_units, table, verdict
from services.loadtest.settings import LoadtestSettings
from shared import records
from shared.ledger import Books
from shared.records.unit import LatencySummary


def numbers(**changes) -> StageNumbers:
    base = {
        "units": 8,
        "offered": 0.8,
        "ingest": 0.8,
        "backlog_start": 3,
        "backlog_end": 5,
        "dropped": 0,
    }
    return StageNumbers(**{**base, **changes})


def test_a_stage_that_keeps_up_is_not_saturated():
    assert judge(numbers(), 0.9) == (False, "")
    assert judge(numbers(ingest=0.73, backlog_end=11), 0.9) == (False, "")  # 0.73 >= 0.72


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"ingest": 0.5}, "the outer applied 0.50 of 0.80 offered uploads/s"),
        ({"backlog_end": 12}, "the backlog grew by 9 uploads over the window"),
        ({"dropped": 2}, "units dropped 2 uploads from full queues"),
    ],
)
def test_a_stage_is_saturated_when_the_outer_or_the_links_fall_behind(changes, reason):
    assert judge(numbers(**changes), 0.9) == (True, reason)


def stage(units: int, saturated: bool) -> LoadtestStage:
    return LoadtestStage(
        units=units,
        window_s=60,
        offered_uploads_per_s=units / 10,
        published_per_s=units / 10,
        ingest_uploads_per_s=units / 10 * (0.5 if saturated else 1),
        ingest_mb_per_s=1.0,
        merges_per_s=0.5,
        uploads_per_merge=1.0,
        uploads_per_commit=1.0,
        sync_latency=LatencySummary(count=10, p50_s=1, p95_s=2, p99_s=3, max_s=4),
        backlog_start=0,
        backlog_end=0,
        dropped_unsent=0,
        params_mb_per_s=2.0,
        outer_cpu=0.5,
        broker_cpu=0.3,
        generator_cpu=0.1,
        drain_s=1.0,
        books=Books(balanced=True),
        saturated=saturated,
        reason="the outer applied 1.60 of 3.20 offered uploads/s" if saturated else "",
    )


def test_the_saturation_point_is_the_first_saturated_stage():
    stages = [stage(4, False), stage(8, False), stage(16, True), stage(32, True)]
    report = LoadtestReport(
        model="medium",
        param_count=1,
        codec="int8",
        params_codec="int8",
        params_fetch="newest",
        link=LoadtestSettings().link_spec(),
        upload_every_s=10,
        upload_payload_bytes=1,
        stages=stages,
        saturation_units=saturation_units(stages),
    )
    assert report.saturation_units == 16
    assert verdict(report) == (
        "saturation point: 16 units (8 units kept up): "
        "the outer applied 1.60 of 3.20 offered uploads/s"
    )
    lines = table(report)
    assert len(lines) == 2 + 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    report.stages, report.saturation_units = stages[:2], None
    assert verdict(report) == "saturation point: not reached up to 8 units"


@pytest.mark.parametrize("units", ["8,4", "4,4", "0,4", "4,x", "2000"])
def test_unit_counts_must_increase_within_bounds(units):
    with pytest.raises(ValueError, match="units"):
        LoadtestSettings(units=units)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("shards", [1, 2])
def test_loadtest_runs_a_stage_against_the_real_outer_and_the_books_balance(
    tmp_path, jax_cache, shards
):
    """One outer and the whole model per upload; or two outer shards and two fragments, each
    unit uploading them in turn: every upload applied once by the shard that owns it."""
    data_dir = tmp_path / "loadtest"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "services.cli", "loadtest", "--model", "tiny"),
            *("--units", "2", "--upload-every-s", "1", "--warmup-s", "2", "--stage-s", "4"),
            *("--link", "20mbit/5ms", "--data-dir", str(data_dir)),
            *("--fragments", str(shards), "--outer-shards", str(shards)),
        ],
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "saturation point:" in result.stdout
    report = records.decode(LoadtestReport, (data_dir / "loadtest.json").read_bytes())
    assert report is not None and [s.units for s in report.stages] == [2]
    assert report.fragments == report.outer_shards == shards
    for shard in range(shards):  # each shard's own log, when there are several
        assert (
            data_dir / "2-units" / ("outer.log" if shards == 1 else f"outer-{shard}.log")
        ).exists()
    assert report.link.rate_bps == 20e6 and report.link.delay_s == 0.005
    for s in report.stages:
        books = s.books
        # Every upload the units published was applied once; nothing was rejected or lost.
        assert books.balanced and books.published > 0, books
        assert books.applied == books.published and books.rejected == 0
        assert set(books.per_unit) == set(range(s.units))
        # Each upload's sync latency ended when a params head named its round as applied.
        assert s.sync_latency is not None and s.sync_latency.count == books.published
        assert s.offered_uploads_per_s == s.units * shards / 1.0
        assert s.published_per_s > 0 and s.ingest_uploads_per_s > 0 and s.uploads_per_merge >= 1
        assert s.params_mb_per_s > 0  # the units fetched the params they would adopt
        assert s.dropped_unsent == 0 and s.heads_rejected == 0


def test_every_synthetic_payload_differs_and_decodes(monkeypatch):
    """The outer refuses a payload it accepted before (services/outer/order.py), so the load
    generator's uploads must all differ: frames mixed from the pool, then fresh encodes."""
    from services.loadtest.payloads import PayloadPool
    from shared.codec import api as codec
    from shared.codec import segments
    from shared.codec.config import CodecConfig
    from shared.model_config import get_config

    segments.segment_plan.cache_clear()
    monkeypatch.setattr(segments, "SEGMENT_ELEMENTS", 1 << 14)  # tiny in several frames
    try:
        pool = PayloadPool(get_config("tiny"), CodecConfig("int8"), count=2, seed=0)
        frames = len(pool.payload(0)[1].frames)
        assert frames >= 2
        taken = [pool.take() for _ in range(2**frames + 2)]  # mixed, then freshly encoded
        assert len({payload for payload, _ in taken}) == len(taken)
        for payload, description in (taken[1], taken[2**frames - 2], taken[-1]):
            decoded = codec.decode_tensors(payload, description)
            assert set(decoded) == set(get_config("tiny").param_shapes())
    finally:
        segments.segment_plan.cache_clear()


def test_synthetic_pseudo_gradients_agree_as_honest_units_do_at_the_measured_size() -> None:
    """Peer review refuses an upload that does not point where its peers' do: the pool's
    pseudo-gradients share a direction (cosine about AGREEMENT) at the measured RMS."""
    import numpy as np

    from services.loadtest.payloads import AGREEMENT, RMS, PayloadPool
    from shared.codec import api as codec
    from shared.codec.config import CodecConfig
    from shared.model_config import get_config

    pool = PayloadPool(get_config("tiny"), CodecConfig("int8"), count=3, seed=0)
    flat = []
    for _ in range(3):
        decoded = codec.decode_tensors(*pool.take())
        flat.append(np.concatenate([np.ravel(decoded[k]) for k in sorted(decoded)]))
    for x in flat:
        assert np.sqrt(np.mean(x**2)) == pytest.approx(RMS, rel=0.05)
    for i, j in ((0, 1), (0, 2), (1, 2)):
        cosine = flat[i] @ flat[j] / (np.linalg.norm(flat[i]) * np.linalg.norm(flat[j]))
        assert cosine == pytest.approx(AGREEMENT, abs=0.05)
