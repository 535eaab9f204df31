"""The learner's record readers and its heartbeat: malformed records never crash a reader, are
counted in ``shared.records.rejections`` and change nothing; the heartbeat is a valid
``UnitStatus``."""

from __future__ import annotations

import asyncio
import json
import types

import jax
import nats
import nats.js.errors
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.learner import unit_control
from services.learner.checkpoint import load_checkpoint, save_checkpoint, take_snapshot
from services.learner.core import LearnerCore
from services.learner.link import LearnerLink
from services.learner.records import LearnerCheckpointMeta, UnitIdentity
from services.learner.settings import LearnerSettings
from services.learner.trainer import InnerTrainer, inner_optimizer
from services.learner.unit_control import UnitControl
from services.learner.unit_state import STATE_FILE, UnitState
from shared import kv, model, records, subjects
from shared.records.jobs import DESIRED_STATES, DesiredRecord
from shared.records.outer import OuterStatus, UnitLedger
from shared.records.unit import UnitStateFile, UnitStatus
from shared.settings.algorithm import InnerAlgorithmSettings
from tests.helpers import wait_for_async
from tests.strategies import record_bytes

SETTINGS = LearnerSettings(job="t", model="tiny", unit=1, num_units=3)
CFG = model.get_config("tiny")


class FakeKV:
    """A KV bucket holding fixed bytes per key (a missing key raises as nats-py does)."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values
        self.puts: list[tuple[str, bytes]] = []

    async def get(self, key: str):
        if key not in self.values:
            raise nats.js.errors.KeyNotFoundError
        return types.SimpleNamespace(value=self.values[key], revision=1)

    async def put(self, key: str, value: bytes) -> int:
        self.puts.append((key, value))
        return len(self.puts)


def desired_kv(value: bytes | None) -> FakeKV:
    key = subjects.desired_key(SETTINGS.job, SETTINGS.unit)
    return FakeKV({} if value is None else {key: value})


# ---- the desired state ------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(record_bytes(DesiredRecord))
def test_a_malformed_desired_record_changes_nothing(data: bytes) -> None:
    control = UnitControl(SETTINGS, UnitState(job="t", unit=1))
    control.desired_state = "paused"
    asyncio.run(control.read_desired(desired_kv(data)))
    parsed = records.decode(DesiredRecord, data)
    expected = parsed.state if parsed is not None else "paused"  # an empty value is malformed
    assert control.desired_state == expected
    assert control.desired_known.is_set()


async def test_a_unit_hears_each_change_of_its_desired_state(nats_server, monkeypatch) -> None:
    """The desired state is read when a write of it is heard: with the fallback polls out of
    reach, a pause and a resume still arrive."""
    for poll in ("DESIRED_POLL_S", "WAITING_POLL_S"):
        monkeypatch.setattr(unit_control, poll, 3600.0)
    nc = await nats.connect(nats_server.url)
    try:
        desired = await nc.jetstream().create_key_value(bucket=subjects.DESIRED_BUCKET)
        control = UnitControl(SETTINGS, UnitState(job="t", unit=1))
        following = asyncio.create_task(control.follow_desired(desired, nc))
        await wait_for_async(control.desired_known.is_set, 10, "the first read")
        assert control.desired_state == "running"  # no record: the initial state
        key = subjects.desired_key(SETTINGS.job, SETTINGS.unit)
        for state in ("paused", "running", "stopped"):
            await kv.put(desired, key, DesiredRecord(state=state))
            await wait_for_async(lambda s=state: control.desired_state == s, 10, f"state {state}")
        following.cancel()
    finally:
        await nc.close()


class LaggingKV(FakeKV):
    """A bucket that stores a write only after the first read that follows it: JetStream's
    stream takes a message in after the subscribers of its subject have heard it."""

    def __init__(self, values: dict[str, bytes]) -> None:
        super().__init__(values)
        self.pending: dict[str, bytes] = {}
        self.reads = 0

    async def get(self, key: str):
        self.reads += 1
        found = await super().get(key)
        self.values.update(self.pending)
        self.pending.clear()
        return found


class HeardWrites:
    """A NATS connection whose subscriptions hear what ``write`` publishes."""

    def __init__(self) -> None:
        self.callbacks: list = []

    async def subscribe(self, subject: str, cb):
        self.callbacks.append(cb)

    async def write(self, bucket: LaggingKV, key: str, value: bytes) -> None:
        bucket.pending[key] = value
        for callback in self.callbacks:
            await callback(types.SimpleNamespace(subject=subject_of(key), data=value))


def subject_of(key: str) -> str:
    return f"$KV.{subjects.DESIRED_BUCKET}.{key}"


async def test_a_write_heard_before_the_bucket_stored_it_is_read_again_soon(monkeypatch) -> None:
    for poll in ("DESIRED_POLL_S", "WAITING_POLL_S"):
        monkeypatch.setattr(unit_control, poll, 3600.0)
    key = subjects.desired_key(SETTINGS.job, SETTINGS.unit)
    bucket = LaggingKV({key: records.encode(DesiredRecord(state="paused"))})
    nc = HeardWrites()
    control = UnitControl(SETTINGS, UnitState(job="t", unit=1))
    following = asyncio.create_task(control.follow_desired(bucket, nc))
    try:
        await wait_for_async(control.desired_known.is_set, 10, "the first read")
        assert control.desired_state == "paused"
        await nc.write(bucket, key, records.encode(DesiredRecord(state="running")))
        # The read the write set off found the old record; the next, DESIRED_RECHECK_S later,
        # finds the new one (not the poll, an hour away).
        await wait_for_async(lambda: control.desired_state == "running", 5, "the resume")
        reads = bucket.reads
        await asyncio.sleep(unit_control.DESIRED_RECHECK_S * (unit_control.DESIRED_RECHECKS + 2))
        assert bucket.reads == reads  # found: no more reads until the next write or poll
    finally:
        following.cancel()


async def test_a_waiting_unit_polls_its_desired_state_more_often(monkeypatch) -> None:
    """A resume whose write was never heard reaches a paused unit at its next poll, every
    ``WAITING_POLL_S``; a running unit's poll is ``DESIRED_POLL_S``."""
    monkeypatch.setattr(unit_control, "DESIRED_POLL_S", 3600.0)
    monkeypatch.setattr(unit_control, "WAITING_POLL_S", 0.1)
    key = subjects.desired_key(SETTINGS.job, SETTINGS.unit)
    bucket = FakeKV({key: records.encode(DesiredRecord(state="paused"))})
    control = UnitControl(SETTINGS, UnitState(job="t", unit=1))
    following = asyncio.create_task(control.follow_desired(bucket, HeardWrites()))
    try:
        await wait_for_async(control.desired_known.is_set, 10, "the first read")
        bucket.values[key] = records.encode(DesiredRecord(state="running"))  # not heard
        await wait_for_async(lambda: control.desired_state == "running", 5, "the resume")
        bucket.values[key] = records.encode(DesiredRecord(state="paused"))  # not heard
        await asyncio.sleep(1.0)
        assert control.desired_state == "running"  # running: the next poll is an hour away
    finally:
        following.cancel()


def test_desired_state_follows_the_record_and_counts_a_rejection() -> None:
    unit_state = UnitState(job="t", unit=1)
    control = UnitControl(SETTINGS, unit_state)
    asyncio.run(control.read_desired(desired_kv(records.encode(DesiredRecord(state="paused")))))
    assert control.desired_state == unit_state.desired == "paused"
    before = records.rejections.total()
    asyncio.run(control.read_desired(desired_kv(b'{"state": "sleeping"}')))
    assert control.desired_state == "paused"
    assert records.rejections.total() == before + 1
    asyncio.run(control.read_desired(desired_kv(None)))  # no record: --initial-state
    assert control.desired_state == "running"
    assert set(DESIRED_STATES) >= {control.desired_state}


# ---- the outer's status and the peers' speeds -------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(record_bytes(OuterStatus))
def test_a_malformed_outer_status_reads_as_no_round(data: bytes) -> None:
    control = UnitControl(SETTINGS, UnitState())
    status_kv = FakeKV({subjects.outer_status_key("t", 0): data})
    next_round = asyncio.run(control.read_outer_next_round(status_kv))
    parsed = records.decode(OuterStatus, data)
    assert next_round == (parsed.next_round(1) if parsed is not None else 0) >= 0


def test_outer_next_round_and_a_rejected_outer_status() -> None:
    control = UnitControl(SETTINGS, UnitState())
    good = OuterStatus(
        state="running", model="tiny", holder="h", units={1: UnitLedger(last_round=9)}
    )
    key = subjects.outer_status_key("t", 0)
    assert asyncio.run(control.read_outer_next_round(FakeKV({key: records.encode(good)}))) == 10
    before = records.rejections.total()
    bad = json.dumps({"state": "running", "model": "tiny", "holder": "h", "units": {"1": 3}})
    assert asyncio.run(control.read_outer_next_round(FakeKV({key: bad.encode()}))) == 0
    assert records.rejections.total() == before + 1


@settings(max_examples=100, deadline=None)
@given(st.lists(record_bytes(UnitStatus), min_size=3, max_size=3))
def test_malformed_peer_statuses_are_left_out_of_the_speeds(values: list[bytes]) -> None:
    control = UnitControl(SETTINGS, UnitState())
    status_kv = FakeKV({subjects.unit_status_key("t", u): v for u, v in enumerate(values)})
    rates = asyncio.run(control.read_rates(status_kv))
    for unit, data in enumerate(values):
        parsed = records.decode(UnitStatus, data)
        if parsed is not None and parsed.state == "running" and parsed.tokens_per_s > 0:
            assert rates[unit] == parsed.tokens_per_s
        else:
            assert unit not in rates


def test_speeds_are_those_of_running_units_with_a_speed() -> None:
    control = UnitControl(SETTINGS, UnitState())
    statuses = {
        0: UnitStatus(unit=0, state="running", tokens_per_s=100.0),
        1: UnitStatus(unit=1, state="paused", tokens_per_s=50.0),
        2: UnitStatus(unit=2, state="running", tokens_per_s=0.0),
    }
    values = {subjects.unit_status_key("t", u): records.encode(s) for u, s in statuses.items()}
    assert asyncio.run(control.read_rates(FakeKV(values))) == {0: 100.0}
    values[subjects.unit_status_key("t", 0)] = (
        b'{"unit": 0, "state": "running", "tokens_per_s": -1}'
    )
    before = records.rejections.total()
    assert asyncio.run(control.read_rates(FakeKV(values))) == {}
    assert records.rejections.total() == before + 1


# ---- the state file and the checkpoint's meta -------------------------------------------------


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(record_bytes(UnitStateFile))
def test_a_malformed_state_file_is_ignored(tmp_path, data: bytes) -> None:
    path = tmp_path / STATE_FILE
    path.write_bytes(data)
    state = UnitState(path, "t", 0)
    parsed = records.decode(UnitStateFile, data)
    if not state.loaded:
        assert (state.next_round, state.desired, len(state.published)) == (0, "running", 0)
    else:
        assert parsed is not None and state.desired == parsed.desired
        assert state.next_round >= parsed.next_round


def test_a_state_file_that_does_not_fit_its_record_is_counted(tmp_path) -> None:
    path = tmp_path / STATE_FILE
    path.write_bytes(b'{"job": "t", "unit": 0, "desired": "sleeping"}')
    before = records.rejections.total()
    assert not UnitState(path, "t", 0).loaded
    assert records.rejections.total() == before + 1


@pytest.fixture(scope="module")
def checkpoint_arrays(tmp_path_factory) -> tuple[dict[str, np.ndarray], LearnerCore]:
    """The arrays of a real checkpoint of a tiny core, and a fresh core to load them into."""
    trainer = InnerTrainer(CFG, inner_optimizer(3e-3, 2, 50, 0.0))

    def core() -> LearnerCore:
        params = model.init_params(CFG, jax.random.PRNGKey(0))
        return LearnerCore(
            trainer, params, InnerAlgorithmSettings(h_steps=3).sync_schedule(1), 4 * CFG.seq_len
        )

    path = tmp_path_factory.mktemp("checkpoint") / "checkpoint.npz"
    identity = UnitIdentity(job="t", unit=0, model="tiny", fragments=1)
    save_checkpoint(path, take_snapshot(core(), 0), identity)
    with np.load(path, allow_pickle=False) as stored:
        arrays = {name: stored[name] for name in stored.files}
    return arrays, core()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(record_bytes(LearnerCheckpointMeta))
def test_a_malformed_checkpoint_meta_is_ignored(tmp_path, checkpoint_arrays, data: bytes) -> None:
    arrays, core = checkpoint_arrays
    meta = data.decode(errors="replace")
    path = tmp_path / "checkpoint.npz"
    np.savez(path, **{**arrays, "meta": np.array(meta)})
    restored = load_checkpoint(path, core)
    if records.decode(LearnerCheckpointMeta, meta) is None:
        assert restored is None
    assert core.step == 0


def test_a_checkpoint_meta_that_does_not_fit_its_record_is_counted(tmp_path, checkpoint_arrays):
    arrays, core = checkpoint_arrays
    meta = json.loads(str(arrays["meta"]))
    meta["syncs"][0]["target"] = 0
    path = tmp_path / "checkpoint.npz"
    np.savez(path, **{**arrays, "meta": np.array(json.dumps(meta))})
    before = records.rejections.total()
    assert load_checkpoint(path, core) is None
    assert records.rejections.total() == before + 1
    path.unlink()
    np.savez(path, **arrays)
    assert load_checkpoint(path, core) is not None  # the untouched one loads


# ---- the heartbeat ----------------------------------------------------------------------------


def test_the_heartbeat_is_a_unit_status_with_rejections_and_a_bounded_error() -> None:
    link = LearnerLink(SETTINGS, 1 << 20)  # not started
    link.set_status(state="running", step=5, max_steps=10, train_loss=2.5, tokens_per_s=12.5)
    link.counters.error("x" * (2 * records.MAX_ERROR_CHARS))
    link.count("published")
    records.decode(DesiredRecord, b'{"state": 1}', "test")  # one more rejection in this process
    status_kv = FakeKV({})
    asyncio.run(link.heartbeat.put(status_kv))
    ((key, value),) = status_kv.puts
    assert key == subjects.unit_status_key("t", 1)
    status = records.decode(UnitStatus, value)
    assert status is not None
    assert (status.unit, status.state, status.step, status.train_loss) == (1, "running", 5, 2.5)
    assert status.counters == {"published": 1, "records_rejected": records.rejections.total()}
    assert len(status.last_error) == records.MAX_ERROR_CHARS
    assert "time" not in json.loads(value)
    with pytest.raises(TypeError, match="not UnitStatus fields"):
        link.set_status(stepp=6)
    with pytest.raises(ValueError, match="step"):
        link.set_status(step=-1)
