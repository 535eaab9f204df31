"""The outer's checkpoint and leader lease, against the in-memory NATS server (no service
processes)."""

from __future__ import annotations

import asyncio
import time

import jax
import msgpack
import numpy as np
import pytest

from services.outer import checkpoint
from services.outer.core import OuterCore
from services.outer.lease import Lease, LeaseLost
from services.outer.policy import Arrival
from services.outer.service import OuterService
from services.outer.settings import OuterSettings
from shared import model, pytree, subjects
from shared.records.outer import (
    CheckpointPointer,
    EvalPoint,
    EvaluationRecord,
    LedgerRecord,
    UnitLedger,
)
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams
from tests.helpers import outer_algorithm, wait_for_async


def _core(seed: int = 0, fragments: int = 1) -> OuterCore:
    named = pytree.flatten_named(
        model.init_params(model.get_config("tiny"), jax.random.PRNGKey(seed))
    )
    algorithm = outer_algorithm(2, token_weighting="uniform", fragments=fragments)
    return OuterCore(named, algorithm)


def _step(core: OuterCore, unit: int, round_: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for fragment in range(core.plan.count):
        grad = {
            k: rng.standard_normal(v.shape).astype(np.float32) * 1e-3
            for k, v in core.fragment_params(fragment).items()
        }
        core.offer(
            fragment,
            Arrival(
                unit,
                round_,
                core.version(fragment),
                10,
                100,
                grad,
                time.monotonic(),
                f"u{unit}r{round_}",
            ),
        )
        core.merge(fragment)


@pytest.mark.parametrize("fragments", [1, 2])
def test_snapshot_round_trip_continues_bit_identically(fragments: int) -> None:
    """Restore into a fresh core, apply the same updates to both: identical params."""
    original = _core(fragments=fragments)
    for i in range(5):  # past a Delayed Nesterov momentum step (every 2 arrivals)
        _step(original, i % 2, i, seed=i)
    versions, params, leaves = original.export_state()
    ledger = LedgerRecord(
        applied=5,
        units={0: UnitLedger(applied=3, last_round=4), 1: UnitLedger(applied=2, last_round=3)},
        staleness={0: 5},
        applied_rounds={0: [(0, 0), (2, 2), (4, 4)], 1: [(1, 1), (3, 3)]},
    )
    evaluation = EvaluationRecord(history=[EvalPoint(version=0, tokens=0, nats_per_byte=5.5)])
    blob = checkpoint.dumps(
        checkpoint.OuterSnapshot("j", "tiny", versions, params, leaves, ledger, evaluation)
    )
    snapshot = checkpoint.loads(blob)
    restored = _core(
        seed=7, fragments=fragments
    )  # different init: everything must come from the blob
    restored.import_state(snapshot.versions, snapshot.params, snapshot.opt_leaves)
    assert snapshot.ledger == ledger and snapshot.evaluation == evaluation
    for i in range(5, 8):
        _step(original, i % 2, i, seed=i)
        _step(restored, i % 2, i, seed=i)
    a, b = original.export_state(), restored.export_state()
    assert a[0] == b[0]
    for pa, pb in zip(a[1], b[1], strict=True):
        for name in pa:
            np.testing.assert_array_equal(pa[name], pb[name])
    for la, lb in zip(a[2], b[2], strict=True):
        for x, y in zip(la, lb, strict=True):
            np.testing.assert_array_equal(x, y)


def test_bad_checkpoints_are_refused() -> None:
    core = _core()
    blob = checkpoint.dumps(checkpoint.OuterSnapshot("j", "tiny", *core.export_state()))
    for bad in (b"", b"junk", blob[: len(blob) // 2]):
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.loads(bad)
    other = _core(fragments=2)
    snapshot = checkpoint.loads(blob)
    with pytest.raises(ValueError, match="fragments"):
        other.import_state(snapshot.versions, snapshot.params, snapshot.opt_leaves)
    snapshot.opt_leaves[0] = snapshot.opt_leaves[0][:-1]
    with pytest.raises(ValueError, match="optimizer state"):
        core.import_state(snapshot.versions, snapshot.params, snapshot.opt_leaves)


def _header_and_data(blob: memoryview) -> tuple[dict, bytes]:
    length = int.from_bytes(blob[:8], "little")
    return msgpack.unpackb(blob[8 : 8 + length], raw=False), bytes(blob[8 + length :])


def _rebuilt(header: dict, data: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return len(packed).to_bytes(8, "little") + packed + data


def test_a_checkpoint_with_malformed_books_is_refused() -> None:
    """The ledger and evaluation parts are validated on load, like every other record."""
    core = _core()
    body, data = _header_and_data(
        checkpoint.dumps(checkpoint.OuterSnapshot("j", "tiny", *core.export_state()))
    )
    checkpoint.loads(_rebuilt(body, data))
    for part, bad in (
        ("ledger", {"applied": -1}),
        ("ledger", {"applied_rounds": {"0": [[3, "x"]]}}),
        ("evaluation", {"history": [[0, 0, 5.5]]}),
        ("evaluation", "not a record"),
    ):
        with pytest.raises(checkpoint.CheckpointError, match=part):
            checkpoint.loads(_rebuilt({**body, part: bad}, data))


def test_an_array_the_header_places_outside_the_data_is_refused() -> None:
    """The header is read as hostile: an array must lie inside the data, with a plain dtype."""
    core = _core()
    body, data = _header_and_data(
        checkpoint.dumps(checkpoint.OuterSnapshot("j", "tiny", *core.export_state()))
    )
    name, entry = next(iter(body["params"][0].items()))
    for bad in (
        {**entry, "offset": len(data)},
        {**entry, "offset": -4},
        {**entry, "shape": [len(data)]},
        {**entry, "shape": [-1]},
        {**entry, "dtype": "|O"},
        {**entry, "dtype": "no such dtype"},
    ):
        params = [{**body["params"][0], name: bad}, *body["params"][1:]]
        with pytest.raises(checkpoint.CheckpointError, match="malformed array"):
            checkpoint.loads(_rebuilt({**body, "params": params}, data))
    with pytest.raises(checkpoint.CheckpointError, match="header"):
        checkpoint.loads((1 << 40).to_bytes(8, "little") + data)


async def _connect(url: str):
    nc = await connect(NatsSettings(nats_url=url), "test")
    js = nc.jetstream()
    await ensure_streams(js)
    return nc, js


def test_store_reads_what_it_wrote_and_detects_torn_or_corrupt(memory_nats) -> None:
    async def scenario() -> None:
        nc, js = await _connect(memory_nats.url)
        try:
            store = checkpoint.CheckpointStore(js, "job1", 0, chunk_size=4096, max_bytes=1 << 20)
            blob = np.random.default_rng(0).bytes(10_000)
            pointer = await store.write(blob, epoch=1, seq=1, slot=0, versions=[3])
            assert pointer.chunks == 3
            assert await store.read(pointer) == blob
            again = CheckpointPointer.model_validate_json(pointer.model_dump_json())
            assert await store.read(again) == blob
            # Another checkpoint overwrote the slot: the old pointer sees chunks of another id.
            await store.write(blob[::-1], epoch=1, seq=2, slot=0, versions=[4])
            with pytest.raises(checkpoint.CheckpointError, match="belongs to"):
                await store.read(pointer)
            newer = await store.write(blob, epoch=1, seq=3, slot=1, versions=[5])
            bad_checksum = newer.model_copy(update={"checksum": newer.checksum ^ 1})
            with pytest.raises(checkpoint.CheckpointError, match="checksum"):
                await store.read(bad_checksum)
            with pytest.raises(checkpoint.CheckpointError, match="missing"):
                await store.read(newer.model_copy(update={"epoch": 9}))
            await store.write(blob, epoch=2, seq=1, slot=0, versions=[6])
            await store.purge_epochs_before(2)
            with pytest.raises(checkpoint.CheckpointError, match="missing"):
                await store.read(newer)
        finally:
            await nc.close()

    asyncio.run(scenario())


def _pointer(name: str) -> CheckpointPointer:
    return CheckpointPointer(id=name, epoch=1, slot=0, chunks=1, size=0, checksum=0, versions=[0])


def test_lease_one_holder_takeover_and_fencing(memory_nats) -> None:
    async def scenario() -> None:
        nc, js = await _connect(memory_nats.url)
        try:
            kv = await js.key_value(subjects.OUTER_BUCKET)
            p1, p2 = _pointer("p1"), _pointer("p2")
            a = Lease(kv, "jobL", "a", lease_s=1.0)
            b = Lease(kv, "jobL", "b", lease_s=1.0)
            assert await a.acquire(lambda: False, lambda holder: None)
            assert a.epoch == 1 and a.pointer is None
            await a.commit(p1)
            # While a renews, b only waits (and learns who leads).
            seen: list[str] = []
            stop_b = asyncio.Event()
            waiter = asyncio.create_task(b.acquire(stop_b.is_set, seen.append))
            for _ in range(8):  # a renews every lease_s / 4 for 2 lease_s
                await asyncio.sleep(0.25)
                await a.renew()
            assert not waiter.done() and seen and seen[-1] == "a"
            # a goes silent: b takes over after lease_s, keeping the committed pointer.
            assert await asyncio.wait_for(waiter, timeout=5)
            assert b.epoch == 2 and b.pointer == p1
            with pytest.raises(LeaseLost):
                await a.commit(_pointer("zombie"))
            with pytest.raises(LeaseLost):
                await a.renew()
            await b.commit(p2)
            # A clean release is taken over at once: at c's first look, not after lease_s.
            await b.release()
            c = Lease(kv, "jobL", "c", lease_s=60.0)
            looks = iter([False])  # acquire looks once, then stops: it must take it then
            assert await c.acquire(lambda: next(looks, True), lambda holder: None)
            assert c.epoch == 3 and c.pointer == p2
            stop_b.set()
        finally:
            await nc.close()

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_a_leader_that_never_committed_keeps_the_checkpoint_it_restored(memory_nats, tmp_path):
    """Leader 1 commits a checkpoint; leader 2 restores it and stops before it has anything
    new to commit; leader 3 must still find that checkpoint (leader 2 must not delete the
    older epoch's chunks that the committed pointer names)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    settings = OuterSettings(
        nats_url=memory_nats.url, job="keep", model="tiny", corpus=str(corpus), num_units=1
    )

    async def lead_then_stop() -> OuterService:
        service = OuterService(settings, asyncio.Event())
        run = asyncio.create_task(service.run())

        def running() -> bool:
            assert not run.done(), run.exception()
            return service.state == "running"

        await wait_for_async(running, 240, "the outer to run")
        service.stop.set()
        await run
        return service

    first = asyncio.run(lead_then_stop())
    second = asyncio.run(lead_then_stop())
    assert first.progress.checkpoints == 1  # a new job's state is committed right away
    assert second.progress.restored_from.kind == "checkpoint"
    assert second.progress.checkpoints == 0
    third = asyncio.run(lead_then_stop())
    # The same checkpoint, still there.
    assert third.progress.restored_from == second.progress.restored_from
    assert third.lease.epoch == 3
