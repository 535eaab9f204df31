"""Two learners and the outer, as separate processes over a real nats-server, really train."""

from __future__ import annotations

import collections

import pytest

from tests.helpers import read_status, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("fragments", "codecs", "steps"),
    [
        (1, ("int8", "int8"), 150),
        # Two fragments, and units of different codecs: the outer decodes what each message's
        # description says (the protocol, not the quality: fewer steps).
        (2, ("int4", "int2"), 60),
    ],
    ids=["P1", "P2-int4-int2"],
)
def test_two_learners_and_outer_advance_version_and_lower_eval_loss(
    nats_server, services, fragments, codecs, steps
):
    job = f"e2e{fragments}{codecs[0]}{codecs[1]}"
    job_flags = [
        "--nats-url",
        nats_server.url,
        "--job",
        job,
        "--model",
        "tiny",
        "--seed",
        "1",
        "--fragments",
        str(fragments),
    ]
    services.start("outer", "outer", *job_flags, "--num-units", "2", "--eval-every-s", "2")

    # Start the units once the outer serves, and pace them (--slowdown 3): an unpaced tiny unit
    # runs several rounds while one params version reaches it, so its uploads arrive stale (up
    # to 9 versions), are weighted down, and the eval barely moves on a loaded machine.
    def outer_runs() -> bool:
        outer = read_status(nats_server.url, job)[0]
        return outer is not None and outer.state == "running"

    wait_for(outer_runs, 120, "the outer to run")
    learners = [
        services.start(
            f"learner-{unit}",
            "learner",
            *job_flags,
            "--unit",
            str(unit),
            "--num-units",
            "2",
            "--max-steps",
            str(steps),
            "--h-steps",
            "10",
            "--batch-size",
            "16",
            "--no-dynamic-h",
            *("--slowdown", "3"),
            "--codec",
            codecs[unit],
            # The 2-bit unit also carries its quantization error forward (error feedback).
            *(["--error-feedback"] if codecs[unit] == "int2" else []),
        )
        for unit in range(2)
    ]
    for learner in learners:
        try:
            assert learner.wait(timeout=300) == 0
        except Exception:
            print(services.logs())
            raise

    def outer_caught_up():
        outer, units = read_status(nats_server.url, job)
        if outer is None or outer.evaluation.last is None:
            return None
        published = sum(u.counter("published") for u in units.values())
        if outer.applied >= published and outer.evaluation.last.version == outer.version:
            return outer, units
        return None

    outer, units = wait_for(outer_caught_up, 120, "the outer to apply and evaluate every upload")
    assert set(units) == {0, 1}
    # Every upload is applied exactly once and none is rejected; together a unit's uploads carry
    # every one of its steps once per fragment (rounds restart when a unit adopts a new
    # version, so the number of uploads depends on timing, the work they carry does not), and
    # the books count each at its fragment's share of the parameters: every token once (each
    # upload's count rounded to a whole token).
    tokens = steps * 16 * 64  # steps x batch x seq_len of the tiny model
    for unit in (0, 1):
        published = units[unit].counter("published")
        assert published >= fragments * steps // 20  # about one upload per H = 10 steps
        assert outer.units[unit].applied == published
        # Nothing dropped: a full unsent queue drops its oldest uploads and the steps they carry.
        assert units[unit].counter("dropped_unsent") == 0, units[unit].counters
        assert abs(outer.units[unit].tokens - tokens) <= (published if fragments > 1 else 0)
        assert units[unit].counter("records_rejected") == 0, units[unit].counters
    assert outer.applied == sum(units[u].counter("published") for u in (0, 1))
    assert outer.rejected == {}
    expected_codecs: collections.Counter[str] = collections.Counter()
    for unit in (0, 1):
        expected_codecs[codecs[unit]] += units[unit].counter("published")
    assert outer.codecs == dict(expected_codecs)
    for unit in (0, 1):  # int8 ~4x smaller than fp32, int4 ~8x, int2 ~15x (zstd adds more)
        status = units[unit]
        ratio = status.counter("fp32_bytes_encoded") / status.counter("payload_bytes_encoded")
        assert ratio > {"int8": 3.9, "int4": 7.5, "int2": 14}[codecs[unit]], ratio
    assert len(outer.versions) == fragments and outer.version == sum(outer.versions)
    assert outer.merges >= fragments  # each merge: one outer step on one fragment
    assert outer.evaluation.init is not None
    init_loss = outer.evaluation.init.nats_per_byte
    final_loss = outer.evaluation.last.nats_per_byte
    assert init_loss == pytest.approx(5.55, abs=0.15)
    if fragments == 1:
        # Typically 3.1-3.2 nats/byte alone or beside two CPU hogs; on two cores loaded by the
        # rest of the suite it has been as high as 4.56. A model that does not learn stays at
        # 5.5; the staleness and versions in the message say how the merges went.
        assert final_loss < init_loss - 0.5, (init_loss, final_loss, outer.staleness, outer.version)
    else:
        # P = 2 is here to prove the per-fragment protocol (uploads, versions, publishing) over
        # NATS; its quality on this tiny, very fast setup is not stable from run to run (final
        # eval seen between 3.06 and 4.64 nats/byte), which is an open algorithmic question.
        assert final_loss < init_loss, (init_loss, final_loss)
