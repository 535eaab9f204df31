"""Every record's model (shared.records and the services' own records), malformed input, the
rejection counter, the lost rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.learner import records as learner_records
from services.loadtest import records as loadtest_records
from services.orchestration.local import records as run_records
from shared import goodput, ledger, records
from shared.records import Stamped, credentials, jobs, link, outer, unit
from shared.records.jobs import DesiredRecord, JobRecord, JobSpec
from shared.records.outer import (
    CheckpointPointer,
    EvalRecord,
    EvaluationRecord,
    LeaseRecord,
    OuterStatus,
    ParamsHead,
    UnitLedger,
    outer_liveness,
)
from shared.records.unit import UnitStatus, unit_liveness
from tests.strategies import near_objects

RECORD_MODULES = [
    unit,
    outer,
    jobs,
    link,
    credentials,
    ledger,
    goodput,
    learner_records,
    run_records,
    loadtest_records,
]
MODELS = [
    model
    for module in RECORD_MODULES
    for model in vars(module).values()
    if isinstance(model, type)
    and issubclass(model, records.Record)
    and model.__module__ == module.__name__
]


@st.composite
def near_records(draw: st.DrawFn) -> tuple[type[records.Record], bytes]:
    """A model and a JSON object with some of its own field names, holding arbitrary values."""
    model = draw(st.sampled_from(MODELS))
    return model, draw(near_objects(model))


def test_every_model_is_covered() -> None:
    names = {model.__name__ for model in MODELS}
    assert {"UnitStatus", "OuterStatus", "StandbyStatus", "DesiredRecord", "JobRecord"} <= names
    assert {"LeaseRecord", "ParamsHead", "PidsFile", "RunSummary", "UnitStateFile"} <= names
    assert {"LinkStatus", "NatsCredentials", "Books", "Goodput", "LoadtestReport"} <= names


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(MODELS), st.binary(max_size=300))
def test_decode_of_arbitrary_bytes_never_raises(model, data: bytes) -> None:
    decoded = records.decode(model, data, "test")
    assert decoded is None or isinstance(decoded, model)


@settings(max_examples=200, deadline=None)
@given(near_records())
def test_decode_of_near_records_never_raises(case) -> None:
    model, data = case
    decoded = records.decode(model, data, "test")
    if decoded is not None:  # whatever parses survives a round trip unchanged
        assert records.decode(model, records.encode(decoded)) == decoded


def test_a_malformed_record_is_counted_with_its_reason() -> None:
    before = records.rejections.counts()
    assert records.decode(UnitStatus, b'{"unit": 2, "step": -5}', "J.unit.2") is None
    assert records.decode(DesiredRecord, b'{"state": "dancing"}', "J.2") is None
    assert records.decode(ParamsHead, b"not json", "head") is None
    assert records.decode(OuterStatus, b"x" * (records.MAX_RECORD_BYTES + 1)) is None
    after = records.rejections.counts()
    grew = {key for key in after if after[key] > before.get(key, 0)}
    assert ("UnitStatus", "step: Input should be greater than or equal to 0") in grew
    assert any(record == "DesiredRecord" and "state" in reason for record, reason in grew)
    assert any(record == "ParamsHead" for record, _ in grew)
    assert any(record == "OuterStatus" and "larger than" in reason for record, reason in grew)


def test_missing_values_are_not_rejections() -> None:
    total = records.rejections.total()
    assert records.decode(UnitStatus, None) is None
    assert records.decode(UnitStatus, b"") is None
    assert records.rejections.total() == total


def test_records_round_trip() -> None:
    samples = [
        UnitStatus(unit=3, state="running", step=7, published_rounds=[(0, 4), (6, 6)]),
        OuterStatus(
            state="running",
            model="tiny",
            holder="h:1:x",
            units={0: UnitLedger(applied=2, last_round=1)},
            applied_rounds={0: [(0, 1)]},
            evaluation=EvaluationRecord(
                init=EvalRecord(version=0, tokens=0, nats_per_byte=5.5, bits_per_byte=8.0)
            ),
        ),
        LeaseRecord(
            holder="h",
            epoch=2,
            beat=9,
            pointer=CheckpointPointer(
                id="J.e2.s1", epoch=2, slot=1, chunks=3, size=100, checksum=7, versions=[4]
            ),
        ),
        JobRecord(spec=JobSpec(job="demo"), state="created", units=4, created=1.0, updated=2.0),
        ParamsHead(
            version=4,
            upload="demo.u-1.r4.f0",
            chunks=2,
            sequences=[7, 9],
            size=10,
            params_checksum=2**63,
        ),
    ]
    for sample in samples:
        assert records.decode(type(sample), records.encode(sample)) == sample


def test_fields_are_bounded() -> None:
    for bad in (
        b'{"unit": 0, "train_loss": NaN}',
        b'{"unit": 0, "tokens_per_s": -1}',
        b'{"unit": 0, "state": "lost"}',
        b'{"unit": 0, "last_error": "' + b"x" * 2000 + b'"}',
        b'{"unit": 0, "published_rounds": [[-1, 2]]}',
    ):
        assert records.decode(UnitStatus, bad) is None, bad
    assert records.decode(ParamsHead, b'{"version":1,"upload":"u","chunks":0,"size":1}') is None
    assert records.decode(LeaseRecord, b'{"holder":"h","epoch":-1,"beat":0}') is None
    with pytest.raises(ValueError, match="min_quorum"):
        JobSpec(job="j", units=2, min_quorum=3)


def _stamped(record, age_s: float):
    return Stamped(record, age_s, stamp=1_000.0, revision=1)


def test_the_lost_rule() -> None:
    running = UnitStatus(unit=0, state="running")
    assert unit_liveness(None, 10) == "absent"
    assert unit_liveness(_stamped(running, 9.9), 10) == "running"
    assert unit_liveness(_stamped(running, 10.1), 10) == "lost"
    finished = UnitStatus(unit=0, state="finished")
    assert unit_liveness(_stamped(finished, 1e6), 10) == "finished"
    outer = OuterStatus(state="stopped", model="tiny", holder="h")
    assert outer_liveness(None, 10) == "absent"
    assert outer_liveness(_stamped(outer, 3), 10) == "stopped"
    assert outer_liveness(_stamped(outer, 11), 10) == "lost"


def test_outer_status_answers_for_a_unit() -> None:
    outer = OuterStatus(
        state="running", model="tiny", holder="h", units={1: UnitLedger(last_round=41)}
    )
    assert outer.next_round(1) == 42 and outer.next_round(0) == 0
    assert outer.unit_ledger(1) is not None and outer.unit_ledger(5) is None
