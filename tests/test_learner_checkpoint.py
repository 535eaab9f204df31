"""Self-healing learner units: the state file, round reservation, checkpoints and their writer,
and the link the training thread hands its uploads to."""

from __future__ import annotations

import asyncio
import logging
import threading
import types

import jax
import numpy as np
import pytest

from services.learner.checkpoint import (
    CheckpointWriter,
    load_checkpoint,
    save_checkpoint,
    take_snapshot,
)
from services.learner.core import LearnerCore, Upload
from services.learner.handoff import hand_off
from services.learner.link import LearnerLink
from services.learner.records import UnitIdentity
from services.learner.settings import LearnerSettings
from services.learner.trainer import InnerTrainer, inner_optimizer
from services.learner.unit_state import STATE_FILE, UnitState, read_state_file, state_file
from services.link.proxy import LinkProxy
from shared import model, pytree, records
from shared.atomic import temp_file
from shared.link_spec import LinkSpec
from shared.records.outer import OuterStatus, UnitLedger
from shared.records.unit import UnitStateFile
from shared.settings.algorithm import InnerAlgorithmSettings
from tests.helpers import read_status, wait_for

CFG = model.get_config("tiny")
TOKENS = 4 * CFG.seq_len
IDENTITY = UnitIdentity(job="t", unit=0, model="tiny", fragments=2)


@pytest.fixture(scope="module")
def trainer() -> InnerTrainer:
    """One trainer (one compilation) shared by every core of this module."""
    return InnerTrainer(CFG, inner_optimizer(3e-3, 2, 50, 0.0))


def make_core(trainer: InnerTrainer, params=None) -> LearnerCore:
    params = params if params is not None else model.init_params(CFG, jax.random.PRNGKey(0))
    return LearnerCore(trainer, params, InnerAlgorithmSettings(h_steps=3).sync_schedule(2), TOKENS)


def batch(step: int):
    return jax.random.randint(jax.random.PRNGKey(100 + step), (4, CFG.seq_len + 1), 0, 256)


def test_state_file_round_trips_and_a_crash_mid_write_leaves_it_intact(tmp_path):
    path = tmp_path / "t" / "unit-0" / STATE_FILE
    state = UnitState(path, "t", 0)
    state.reserve(5)
    for round_number in (0, 1, 2, 4):
        state.record("published", round_number)
    state.record("dropped_unsent")
    state.set_desired("paused")
    state.mark_trained(1000.0)
    state.mark_trained(2000.0)  # a restarted process keeps the first time
    state.set_lifetime(12.5, 10.0, 4096)
    # A crash in the middle of the next write leaves a torn temporary file behind.
    temp_file(path).write_bytes(b'{"job": "t", "unit": 0, "next_round": 99, "publ')

    again = UnitState(path, "t", 0)
    assert again.loaded
    assert (again.next_round, again.desired) == (5, "paused")
    assert again.published.ranges() == [[0, 2], [4, 4]]
    assert again.lifetime == {"published": 4, "dropped_unsent": 1, "rejected_local": 0}
    assert (again.first_trained_at, again.trained_s) == (1000.0, 12.5)
    assert (again.computing_s, again.computed_tokens) == (10.0, 4096)
    again.reserve(7)  # the next write goes through despite the leftover
    assert records.decode(UnitStateFile, path.read_bytes()).next_round == 7
    assert not temp_file(path).exists()
    # Read by anyone else (``diloco up``), it is the same record, and only as the unit it names.
    assert state_file(tmp_path, "t", 0) == path
    assert read_state_file(path, "t", 0) == again.as_record()
    assert read_state_file(path, "t", 1) is None and not UnitState(path, "t", 1).loaded


def test_unreadable_state_file_is_ignored(tmp_path, caplog):
    path = tmp_path / STATE_FILE
    path.write_text("not json")
    with caplog.at_level(logging.WARNING):
        state = UnitState(path)
    assert not state.loaded and state.next_round == 0
    assert "ignoring unreadable unit state" in caplog.text


def test_rounds_are_persisted_before_they_reach_the_link(tmp_path, trainer):
    path = tmp_path / STATE_FILE
    unit_state = UnitState(path)
    core = make_core(trainer)
    handed: list[int] = []

    def submit(upload):
        # What a restarted unit would read at this very moment.
        assert records.decode(UnitStateFile, path.read_bytes()).next_round > upload.round
        handed.append(upload.round)

    link = types.SimpleNamespace(submit=submit, residual_copy=lambda: None)
    for _ in range(7):
        core.train_step(batch(core.step))
        hand_off(core.due_uploads(), core, link, unit_state, None, 0)
    hand_off(core.flush(), core, link, unit_state, None, 0)
    assert handed == list(range(len(handed))) and len(handed) >= 4
    assert UnitState(path).next_round == core.round == handed[-1] + 1


def test_checkpoint_restores_a_core_that_continues_bit_identically(tmp_path, trainer):
    original = make_core(trainer)
    original.stagger(3)
    for _ in range(4):  # fragment 1 uploads at step 2, fragment 0 at step 3
        original.train_step(batch(original.step))
        original.due_uploads()
    anchor = pytree.flatten_named(original.state.anchor)
    original.offer_global(0, 3, {k: v + 0.01 for k, v in original.plan.extract(anchor, 0).items()})
    assert original.adopt_globals() == [0]
    piece = original.plan.keys(0)[0]
    shape = np.shape(original.plan.extract(pytree.flatten_named(original.state.params), 0)[piece])
    residual = {piece: np.full(shape, 0.25, np.float32)}
    path = tmp_path / "checkpoint.npz"
    save_checkpoint(path, take_snapshot(original, 1234, residual), IDENTITY)

    restored_core = make_core(trainer)
    restored = load_checkpoint(path, restored_core)
    assert restored is not None
    assert (restored.step, restored.round, restored.tokens_total) == (4, original.round, 1234)
    np.testing.assert_array_equal(restored.residual[piece], residual[piece])
    assert restored_core.base_versions() == original.base_versions() == [3, 0]
    assert [vars(s) for s in restored_core.syncs] == [vars(s) for s in original.syncs]
    assert restored_core.staggered and not make_core(trainer).staggered

    losses, uploads = {}, {}
    for name, core in (("original", original), ("restored", restored_core)):
        losses[name], uploads[name] = [], []
        for _ in range(5):
            losses[name].append(float(core.train_step(batch(core.step))))
            uploads[name] += core.due_uploads()
    assert losses["restored"] == losses["original"]
    assert [(u.round, u.fragment) for u in uploads["restored"]] == [
        (u.round, u.fragment) for u in uploads["original"]
    ]
    for a, b in zip(uploads["restored"], uploads["original"], strict=True):
        for key in a.tensors:
            np.testing.assert_array_equal(a.tensors[key], b.tensors[key])
    for tree in ("params", "anchor", "opt_state"):
        for a, b in zip(
            jax.tree_util.tree_leaves(getattr(restored_core.state, tree)),
            jax.tree_util.tree_leaves(getattr(original.state, tree)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_of_another_model_is_ignored_with_a_warning(tmp_path, trainer, caplog):
    core = make_core(trainer)
    core.train_step(batch(0))
    path = tmp_path / "checkpoint.npz"
    save_checkpoint(path, take_snapshot(core, 0), IDENTITY)

    params = model.init_params(CFG, jax.random.PRNGKey(0))
    params["wte"] = params["wte"][:-1]  # another vocabulary: a different model
    other = make_core(trainer, params)
    with caplog.at_level(logging.WARNING):
        assert load_checkpoint(path, other) is None
    assert "ignoring checkpoint" in caplog.text and "wte" in caplog.text
    assert other.step == 0
    # A torn or foreign file is ignored just the same.
    path.write_bytes(b"PK\x03\x04 not a zip")
    assert load_checkpoint(path, make_core(trainer)) is None
    assert load_checkpoint(tmp_path / "missing.npz", make_core(trainer)) is None


def test_writer_keeps_only_the_newest_pending_snapshot(tmp_path):
    started, release = threading.Event(), threading.Event()
    written: list[int] = []

    def slow_save(_path, snapshot, _identity):
        started.set()
        assert release.wait(5)
        if snapshot.step == 4:
            raise OSError("disk full")
        written.append(snapshot.step)

    counted: list[str] = []
    writer = CheckpointWriter(tmp_path / "c.npz", IDENTITY, counted.append, save=slow_save)
    writer.start()

    def snap(step):
        return types.SimpleNamespace(step=step)

    writer.submit(snap(1))
    assert started.wait(5)
    for step in (2, 3, 4):  # while 1 is being written: only 4 survives
        writer.submit(snap(step))
    release.set()
    assert writer.wait_idle(5)
    writer.close(final=snap(5))
    assert written == [1, 5]
    assert writer.counters == {
        "checkpoints_written": 2,
        "checkpoints_superseded": 2,
        "checkpoint_errors": 1,
    }
    assert sorted(counted) == sorted(writer.counters.elements())
    assert writer.last_written_step == 5


def test_link_starts_from_the_persisted_desired_state_and_reports_lifetime(tmp_path):
    settings = LearnerSettings(job="t", model="tiny", unit=1, num_units=2)
    path = tmp_path / STATE_FILE
    state = UnitState(path, "t", 1)
    state.set_desired("paused")
    state.reserve(3)
    state.record("published", 0)

    link = LearnerLink(settings, 1 << 20, UnitState(path, "t", 1))  # not started: NATS is down
    assert link.desired_state == "paused"
    record = link.heartbeat.record()
    assert (record.unit, record.state, record.desired) == (1, "starting", "paused")
    assert record.published_rounds == [(0, 0)]
    assert record.next_round == 3
    assert record.lifetime == {"published": 1, "dropped_unsent": 0, "rejected_local": 0}
    assert record.restored_from_step is None
    assert record.counters == {"records_rejected": records.rejections.total()}


def test_outer_next_round_comes_from_the_outers_status_record():
    settings = LearnerSettings(job="t", model="tiny", unit=1, num_units=2)
    link = LearnerLink(settings, 1 << 20)

    class FakeKV:
        def __init__(self, value: bytes):
            self.value = value

        async def get(self, _key):
            return types.SimpleNamespace(value=self.value, revision=1)

    def outer(units):
        return records.encode(OuterStatus(state="running", model="tiny", holder="h", units=units))

    read = link.control.read_outer_next_round
    assert asyncio.run(read(FakeKV(outer({1: UnitLedger(last_round=41)})))) == 42
    assert asyncio.run(read(FakeKV(outer({0: UnitLedger(last_round=41)})))) == 0
    assert asyncio.run(read(FakeKV(outer({})))) == 0


def test_full_queue_drops_the_oldest_upload_not_being_sent(tmp_path):
    settings = LearnerSettings(job="t", model="tiny", max_unsent=2)
    link = LearnerLink(settings, 1 << 20, UnitState(tmp_path / STATE_FILE))

    def upload(round_number):
        return types.SimpleNamespace(round=round_number, fragment=0)

    sender = link.sender
    link.submit(upload(0))
    link.submit(upload(1))
    sender._in_flight = sender._queue[0]  # the publisher is sending round 0
    link.submit(upload(2))
    assert [u.round for u in sender._queue] == [0, 2]
    sender._in_flight = None
    link.submit(upload(3))
    assert [u.round for u in sender._queue] == [2, 3]
    assert link.counters["dropped_unsent"] == 2
    assert UnitState(tmp_path / STATE_FILE).lifetime["dropped_unsent"] == 2


def test_the_training_threads_calls_return_while_the_link_is_stalled(memory_nats, tmp_path):
    """The training thread never waits for the network: with every byte between the link and
    NATS held, it queues an upload (which stays unsent), takes new params (none) and sets its
    status."""
    proxy_loop = asyncio.new_event_loop()
    threading.Thread(target=proxy_loop.run_forever, daemon=True).start()

    def on_proxy_loop(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, proxy_loop)

    async def outage() -> str | None:
        return proxy.counters().outage

    host, port = memory_nats.url.removeprefix("nats://").split(":")
    proxy = LinkProxy(LinkSpec(), host, int(port))
    listen_port = on_proxy_loop(proxy.start()).result(10)
    settings = LearnerSettings(
        job="t", model="tiny", nats_url=f"nats://127.0.0.1:{listen_port}", status_interval_s=0.2
    )
    link = LearnerLink(settings, 1 << 20, UnitState(tmp_path / STATE_FILE))
    link.start()
    stall = None
    try:
        wait_for(lambda: read_status(memory_nats.url, "t")[1].get(0), 60, "the link's heartbeat")
        stall = on_proxy_loop(proxy.stall(3600))
        wait_for(lambda: on_proxy_loop(outage()).result(10) == "stall", 10, "the stall")
        returned = threading.Event()

        def training_thread() -> None:
            values = np.ones(64, np.float32)
            link.submit(Upload(0, 0, 0, 1, TOKENS, 3.0, {"w": values}))
            link.take_new_params()
            link.set_status(step=1)
            returned.set()

        threading.Thread(target=training_thread, daemon=True).start()
        assert returned.wait(10), "a call of the training thread waited for the stalled link"
        assert link.unsent() == 1  # queued: it cannot have crossed
        # Told to stop at once, the link gives up the publish held by the stall and ends.
        assert link.stop(flush_timeout_s=0), "the link's thread outlived stop()"
        assert link.unsent() == 1
    finally:
        if stall is not None:
            stall.cancel()
        link.stop(flush_timeout_s=0)
        on_proxy_loop(proxy.close()).result(10)
        proxy_loop.call_soon_threadsafe(proxy_loop.stop)


@pytest.mark.parametrize("fails", [False, True], ids=["compiles", "fails"])
def test_training_can_wait_for_the_codec_kernels(monkeypatch, memory_nats, fails):
    """The codec compiles on the encoder thread from link.start(); the training thread waits
    for it (a cold Numba cache once made a fast unit drop its first uploads) and gets its
    error if compiling fails."""
    release = threading.Event()
    compiled = threading.Event()

    def slow_warm_up():
        release.wait(10)
        compiled.set()
        if fails:
            raise RuntimeError("no compiler")

    monkeypatch.setattr("services.learner.encoder.codec.warm_up", slow_warm_up)
    settings = LearnerSettings(job="t", model="tiny", nats_url=memory_nats.url)
    link = LearnerLink(settings, 1 << 20)
    link.start()
    outcome: list[BaseException | float] = []

    def wait() -> None:
        try:
            link.wait_codec_ready()
            outcome.append(compiled.is_set())
        except RuntimeError as err:
            outcome.append(err)

    try:
        waiter = threading.Thread(target=wait)
        waiter.start()
        # A window in which the waiter must not return: compiling has not finished (nothing
        # marks "blocked" to wait on instead).
        waiter.join(0.3)
        assert waiter.is_alive() and not outcome
        release.set()
        waiter.join(5)
        assert len(outcome) == 1
        if fails:
            assert isinstance(outcome[0], RuntimeError) and "no compiler" in str(outcome[0])
        else:
            assert outcome == [True]  # it returned once the kernels were compiled
            link.wait_codec_ready()  # compiled: a later wait blocks on nothing and returns
    finally:
        release.set()
        link.stop(flush_timeout_s=0)
