"""An outer split into shards by fragment: who owns what, the subjects each consumes, the
checkpoint each keeps, and the one status the readers see (``shared/outer_shards.py``)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from pydantic import ValidationError

from services.loadtest.settings import LoadtestSettings
from services.orchestration.local.chaos import outer_names, service_targets
from services.orchestration.local.settings import UpSettings
from services.outer.settings import OuterSettings
from shared import kv, subjects
from shared.fragments import shard_fragments, shard_of_fragment
from shared.ledger import balance
from shared.outer_shards import combine_shards
from shared.records.outer import (
    DownlinkCounts,
    EvalRecord,
    EvaluationRecord,
    LeaseRecord,
    OuterStatus,
    UnitLedger,
)
from shared.records.unit import UnitStatus
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from tests.helpers import outer_algorithm, read_status, run_up_to_end, wait_for
from tests.test_faults import (
    HeadRecorder,
    assert_no_version_published_twice,
    kill9,
    stop_units_and_balance,
)


def test_fragments_go_round_robin_and_every_one_has_one_owner() -> None:
    assert [shard_fragments(k, 2, 5) for k in range(2)] == [(0, 2, 4), (1, 3)]
    assert shard_fragments(0, 1, 3) == (0, 1, 2)
    for shards in (1, 2, 3, 5):
        owned = [p for k in range(shards) for p in shard_fragments(k, shards, 5)]
        assert sorted(owned) == list(range(5))
        assert all(
            shard_of_fragment(p, shards) == k
            for k in range(shards)
            for p in shard_fragments(k, shards, 5)
        )


def test_each_shard_consumes_only_its_fragments_subjects() -> None:
    assert subjects.grads_filters("j", [0, 1, 2], 3) == ["diloco.j.grads.>"]
    assert subjects.grads_filters("j", [2, 0], 3) == ["diloco.j.grads.*.0", "diloco.j.grads.*.2"]
    assert subjects.grads_subject("j", 4, 1) == "diloco.j.grads.4.1"
    assert subjects.outer_consumer("j", 0) != subjects.outer_consumer("j", 1)
    assert subjects.lease_key("j", 1) == "j.1" and subjects.outer_status_key("j", 1) == "j.outer.1"
    assert subjects.shard_of_outer_status_key("j", "j.outer.3") == 3
    assert subjects.shard_of_outer_status_key("j", "j.outer_standby.x") is None
    assert subjects.unit_of_want("j", subjects.want_subject("j", 7, 2)) == (7, 2)
    assert subjects.unit_of_want("j", "diloco.j.want.7") is None
    chunk = subjects.checkpoint_chunk_subject("j", 1, 12, 0, 3)
    assert subjects.checkpoint_epoch(chunk) == 12
    assert chunk.startswith(subjects.checkpoint_epoch_filter("j", 1, 12)[:-1])
    assert not chunk.startswith(subjects.checkpoint_filter("j", 0)[:-1])


def test_shards_are_checked_against_the_fragments() -> None:
    OuterSettings(shards=2, shard=1, fragments=2)
    with pytest.raises(ValidationError, match="shards are 0..1"):
        OuterSettings(shards=2, shard=2, fragments=2)
    for make in (
        lambda: OuterSettings(shards=3, fragments=2),
        lambda: UpSettings(outer_shards=3, fragments=2),
        lambda: LoadtestSettings(outer_shards=3, fragments=2),
    ):
        with pytest.raises(ValidationError, match="3 outer shards > 2 fragments"):
            make()
    assert outer_names(1) == ["outer"] and outer_names(2) == ["outer-0", "outer-1"]
    assert service_targets(1, 2) == ["outer-0", "outer-1", "nats-server"]


def test_a_shard_checkpoints_only_its_own_fragments_and_restores_them_exactly() -> None:
    from services.outer.core import OuterCore

    named = {"a": np.zeros((4,), np.float32), "b": np.zeros((3,), np.float32)}
    shard1 = OuterCore(dict(named), outer_algorithm(fragments=2))
    shard1.restore(1, 5, {k: v + 1.5 for k, v in shard1.fragment_params(1).items()})
    versions, params, leaves = shard1.export_state(owned=[1])
    assert versions == [0, 5] and params[0] == {} and leaves[0] == [] and params[1]
    other = OuterCore(dict(named), outer_algorithm(fragments=2))
    other.restore(0, 9, {k: v - 2.0 for k, v in other.fragment_params(0).items()})
    other.import_state(versions, params, leaves, owned=[1])
    assert (other.version(0), other.version(1)) == (9, 5)  # fragment 0 is left as it was
    for name, value in other.fragment_params(1).items():
        np.testing.assert_array_equal(value, shard1.fragment_params(1)[name])
    with pytest.raises(ValueError, match="pieces differ"):
        other.import_state(versions, params, leaves, owned=[0])


def _shard(shard: int, **changes: object) -> OuterStatus:
    fields: dict = dict(
        state="running",
        model="tiny",
        holder=f"host:{shard}:x",
        shard=shard,
        shards=2,
        versions=[3, 0, 4] if shard == 0 else [0, 5, 0],
    )
    return OuterStatus(**{**fields, **changes})


def test_the_shards_records_combine_into_the_job_one_outer_would_have_written() -> None:
    evaluation = EvaluationRecord(
        last=EvalRecord(version=12, tokens=90, nats_per_byte=3.1, bits_per_byte=4.5)
    )
    # Unit 0 uploads rounds 0..5; fragments alternate, so shard 0 sees 0, 2, 4 and shard 1
    # sees 1, 3, 5 (round 3 rejected): each alone would count the other's rounds as skipped.
    zero = _shard(
        0,
        applied=3,
        merges=3,
        tokens_applied=60,
        staleness={0: 2, 1: 1},
        rejected={},
        units={0: UnitLedger(applied=3, last_round=4, skipped_rounds=2, tokens=60)},
        applied_rounds={0: [(0, 0), (2, 2), (4, 4)]},
        evaluation=evaluation,
        downlink=DownlinkCounts(delta=2),
    )
    one = _shard(
        1,
        applied=2,
        merges=2,
        tokens_applied=40,
        staleness={0: 2},
        rejected={"norm_outlier": 1},
        units={
            0: UnitLedger(
                applied=2, rejected={"norm_outlier": 1}, last_round=5, skipped_rounds=3, tokens=40
            )
        },
        applied_rounds={0: [(1, 1), (5, 5)]},
        rejected_rounds={0: [(3, 3)], 9: [(0, 0)]},  # unit 9: rounds only, no books of its own
        downlink=DownlinkCounts(delta=1, keyframe=1),
    )
    job = combine_shards([one, zero])
    assert (job.applied, job.merges, job.tokens_applied) == (5, 5, 100)
    assert job.versions == [3, 5, 4] and job.version == 12
    assert job.staleness == {0: 4, 1: 1} and job.rejected == {"norm_outlier": 1}
    assert job.applied_rounds == {0: [(0, 2), (4, 5)]}
    assert job.rejected_rounds == {0: [(3, 3)], 9: [(0, 0)]} and set(job.units) == {0}
    unit = job.units[0]
    assert (unit.applied, unit.last_round, unit.tokens, unit.skipped_rounds) == (5, 5, 100, 0)
    assert job.evaluation == evaluation and job.holder == zero.holder
    assert job.downlink == DownlinkCounts(delta=3, keyframe=1)
    published = UnitStatus(unit=0, next_round=6, published_rounds=[(0, 5)])
    assert balance(job, {0: published}).balanced
    assert not balance(zero, {0: published}).balanced  # one shard's books alone do not


def test_a_missing_or_lagging_shard_shows_in_the_state() -> None:
    assert combine_shards([_shard(0)]).state == "starting"
    assert combine_shards([_shard(0), _shard(1, state="restoring")]).state == "restoring"
    single = _shard(0, shards=1)
    assert combine_shards([single]) is single
    with pytest.raises(ValueError, match="shard 0"):
        combine_shards([_shard(1)])


# --------------------------------------------------------------------------- end to end

SHARD_LEASE_S = 2.0


def _flags(url: str, job: str) -> list[str]:
    return ["--nats-url", url, "--job", job, "--model", "tiny", "--seed", "1", "--fragments", "2"]


def _start_shard(services, url: str, job: str, name: str, shard: int):
    return services.start(
        name,
        "outer",
        *_flags(url, job),
        *("--shards", "2", "--shard", str(shard), "--num-units", "2", "--eval-every-s", "3"),
        *("--lease-s", str(SHARD_LEASE_S), "--status-interval-s", "0.3"),
    )


def _lease(url: str, job: str, shard: int) -> LeaseRecord | None:
    async def read() -> LeaseRecord | None:
        nc = await connect(NatsSettings(nats_url=url), "test")
        try:
            bucket = await nc.jetstream().key_value(subjects.OUTER_BUCKET)
            return await kv.get(bucket, subjects.lease_key(job, shard), LeaseRecord)
        finally:
            await nc.close()

    return asyncio.run(read())


def _versions(url: str, job: str) -> list[int]:
    outer = read_status(url, job)[0]
    return outer.versions if outer is not None and len(outer.versions) == 2 else [0, 0]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_killed_shard_leader_hands_its_fragment_to_its_standby_and_the_other_goes_on(
    nats_server, services, tmp_path
) -> None:
    """P = 2 fragments on M = 2 outer shards, each with a warm standby: kill -9 of shard 1's
    leader hands shard 1's lease to its standby within the lease time; shard 0 keeps its
    leader and epoch throughout; training goes on on both fragments; no version is announced
    twice; and the job's books (both shards' together) balance."""
    url, job = nats_server.url, "shards"
    recorder = HeadRecorder(url, job)
    leaders = [_start_shard(services, url, job, f"outer-{k}a", k) for k in (0, 1)]
    learners = [
        services.start(
            f"learner-{unit}",
            "learner",
            *_flags(url, job),
            *("--unit", str(unit), "--num-units", "2", "--max-steps", "100000"),
            *("--h-steps", "10", "--batch-size", "8", "--no-dynamic-h", "--slowdown", "3"),
            *("--status-interval-s", "0.5", "--checkpoint-dir", str(tmp_path / "units")),
        )
        for unit in (0, 1)
    ]
    wait_for(lambda: min(_versions(url, job)) >= 2, 240, "both shards to merge")
    standbys = [_start_shard(services, url, job, f"outer-{k}b", k) for k in (0, 1)]
    for k in (0, 1):
        wait_for(lambda k=k: "standing by" in services.log(f"outer-{k}b"), 120, "standbys")
    before = [_lease(url, job, k) for k in (0, 1)]
    assert before[0] is not None and before[1] is not None
    version = _versions(url, job)[1]
    killed_at = time.monotonic()
    kill9(leaders[1])
    taken = wait_for(
        lambda: (
            (lease := _lease(url, job, 1)) is not None
            and lease.holder != before[1].holder
            and lease
        ),
        60,
        "shard 1's standby to take its lease",
        interval_s=0.05,
    )
    handover_s = time.monotonic() - killed_at
    print(f"shard 1 handed over in {handover_s:.2f} s (lease {SHARD_LEASE_S} s)")
    assert taken.holder.split(":")[1] == str(standbys[1].pid)
    assert taken.epoch == before[1].epoch + 1
    # The standby takes the lease once it has seen the record unchanged for SHARD_LEASE_S,
    # counted from the first poll (every lease_s / 4, ± 20%) that saw the leader's last
    # renewal: so within the lease time and a poll of the kill, plus 1 s for a loaded machine.
    assert handover_s <= SHARD_LEASE_S * (1 + 1.2 / 4) + 1.0, handover_s
    wait_for(lambda: _versions(url, job)[1] >= version + 2, 120, "shard 1 to merge again")
    after = _lease(url, job, 0)
    assert after is not None and (after.holder, after.epoch) == (before[0].holder, before[0].epoch)
    books = stop_units_and_balance(services, learners, url, job)
    assert books.applied >= 10 and books.rejected == 0
    assert_no_version_published_twice(recorder.stop())
    assert standbys[0].poll() is None and leaders[0].poll() is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_outer_shards_train_as_well_as_one_outer(tmp_path, jax_cache) -> None:
    """``diloco up`` with P = 2 fragments, on one outer and on two shards, on the same seed
    and budget: the same tokens applied, the final held-out eval within 1%, the books
    balanced (``run_up_to_end``).

    Synchronous DiLoCo with a fixed H and the fragments uploaded together, so that the run
    does not depend on timing: then one outer and two shards make the same merges of the
    same uploads. (Asynchronous runs of this tiny job differ by more than 1% from one run to
    the next on the same seed: the merges' order and staleness follow the processes'
    timing.)"""
    flags = (
        *("--max-steps", "150", "--h-steps", "10", "--slowdowns", "3,3", "--fragments", "2"),
        *("--mode", "sync", "--no-dynamic-h", "--stagger", "never"),
    )
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, _ = run_up_to_end(tmp_path / "one", jax_cache, *flags)
    two, output = run_up_to_end(tmp_path / "two", jax_cache, *flags, "--outer-shards", "2")
    assert set(two.restarts) >= {"outer-0", "outer-1"}, output
    finals = []
    for summary in (one, two):
        assert summary.outer is not None and summary.outer.evaluation.last is not None
        assert summary.outer.evaluation.last.version == summary.outer.version
        finals.append(summary.outer.evaluation.last.nats_per_byte)
    print(f"final eval: one outer {finals[0]}, two shards {finals[1]}")
    assert one.outer.tokens_applied == two.outer.tokens_applied  # type: ignore[union-attr]
    assert abs(finals[1] - finals[0]) <= 0.01 * finals[0], finals
