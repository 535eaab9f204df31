"""The in-memory broker (``tests/memory_nats``) behaves as nats-server does, for everything
this project relies on: each test runs the same assertions against both (the nats-server runs
are marked ``nats``).

Covered: the system's streams and buckets created twice (``ensure_streams``) with the limits
they report; ``Nats-Msg-Id`` deduplication; work-queue deletion on ack and redelivery of what a
deleted consumer had not acked; redelivery after a nak, a delayed nak and a lapsed ack wait,
progress holding it; term; per-subject, byte and size limits with discard old and new; last-value
and by-sequence reads, direct and not; KV compare-and-set, delete and re-create; the stream-info
key listing and the server's time; purges by subject; wildcard subscriptions and publishes to
stream subjects reaching them; no responders; a fetch returning what is there without waiting
out its timeout; a kill and a restart keeping the store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StreamConfig,
)

from shared import kv, subjects
from shared.transport import streams
from tests.helpers import wait_for_async


@pytest.fixture(params=["memory_nats", pytest.param("nats_server", marks=pytest.mark.nats)])
def broker(request: pytest.FixtureRequest) -> Any:
    """The in-memory broker, then a real nats-server (``url``, ``kill()``, ``restart()``)."""
    return request.getfixturevalue(request.param)


@pytest.fixture
async def nc(broker) -> AsyncIterator[Any]:
    client = await nats.connect(broker.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    yield client
    await client.close()


WORK = StreamConfig(
    name="WORK",
    subjects=["work.>"],
    retention=RetentionPolicy.WORK_QUEUE,
    duplicate_window=3600,
)


async def consumer(js, ack_wait: float = 30, max_deliver: int = -1) -> Any:
    config = ConsumerConfig(
        durable_name="c",
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        filter_subject="work.>",
    )
    await js.add_consumer("WORK", config)
    return await js.pull_subscribe_bind(durable="c", stream="WORK")


async def fetch_seqs(sub, batch: int = 10, timeout: float = 0.5) -> list[int]:
    try:
        return [m.metadata.sequence.stream for m in await sub.fetch(batch, timeout=timeout)]
    except TimeoutError:
        return []


async def test_the_systems_streams_are_created_once_and_report_their_limits(nc) -> None:
    js = nc.jetstream()
    await streams.ensure_streams(js)
    await streams.ensure_streams(js)  # idempotent: found, then updated in place
    grads = (await js.stream_info(subjects.GRADS_STREAM)).config
    assert (grads.retention, grads.discard) == (RetentionPolicy.WORK_QUEUE, DiscardPolicy.NEW)
    assert grads.discard_new_per_subject and grads.subjects == [subjects.GRADS_ALL]
    assert grads.max_msgs_per_subject == streams.GRADS_MAX_CHUNKS_PER_UNIT
    assert grads.duplicate_window == streams.GRADS_DUPLICATE_WINDOW_S
    params = (await js.stream_info(subjects.PARAMS_STREAM)).config
    assert params.allow_direct and params.discard == DiscardPolicy.OLD
    status = (await js.stream_info(kv.stream_of(subjects.STATUS_BUCKET))).config
    assert status.max_age == streams.STATUS_TTL_S and status.max_msgs_per_subject == 1
    assert status.allow_direct


async def test_a_message_id_is_stored_once_within_the_duplicate_window(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(WORK)
    first = await js.publish("work.a", b"1", headers={"Nats-Msg-Id": "job:r1:u0:0"})
    again = await js.publish("work.a", b"other", headers={"Nats-Msg-Id": "job:r1:u0:0"})
    other = await js.publish("work.a", b"2", headers={"Nats-Msg-Id": "job:r1:u0:1"})
    assert (first.seq, first.duplicate) == (1, None)
    assert (again.seq, again.duplicate) == (1, True)
    assert (other.seq, other.duplicate) == (2, None)
    assert (await js.stream_info("WORK")).state.messages == 2
    # Acked and deleted from the work queue, the id still counts as seen.
    sub = await consumer(js)
    for msg in await sub.fetch(2, timeout=2):
        await msg.ack_sync()
    assert (await js.stream_info("WORK")).state.messages == 0
    late = await js.publish("work.a", b"1", headers={"Nats-Msg-Id": "job:r1:u0:0"})
    assert (late.seq, late.duplicate) == (1, True)


async def test_work_queue_ack_deletes_and_a_new_consumer_gets_the_unacked(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(WORK)
    for unit in range(3):
        await js.publish(f"work.{unit}", b"x", headers={"Chunk": f"{unit}/3"})
    sub = await consumer(js)
    # What is there comes at once: waiting out this timeout would fail the test (pytest-timeout).
    msgs = await sub.fetch(10, timeout=3600)
    assert [m.metadata.sequence.stream for m in msgs] == [1, 2, 3]
    assert [m.metadata.num_delivered for m in msgs] == [1, 1, 1]
    assert [m.subject for m in msgs] == ["work.0", "work.1", "work.2"]
    assert [m.headers["Chunk"] for m in msgs] == ["0/3", "1/3", "2/3"]
    await msgs[1].ack_sync()
    state = (await js.stream_info("WORK")).state
    assert (state.messages, state.first_seq, state.last_seq) == (2, 1, 3)
    # Deleted and created again, the consumer delivers what was not acked at once.
    await js.delete_consumer("WORK", "c")
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.consumer_info("WORK", "c")
    sub = await consumer(js)
    assert await fetch_seqs(sub) == [1, 3]


async def test_nak_lapsed_ack_wait_and_term(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(WORK)
    for n in range(3):
        await js.publish(f"work.{n}", b"x")
    sub = await consumer(js, ack_wait=1.0)
    first, second, third = await sub.fetch(3, timeout=2)
    await first.nak()  # at once
    await second.term()  # never again
    (again,) = await sub.fetch(1, timeout=2)
    assert (again.metadata.sequence.stream, again.metadata.num_delivered) == (1, 2)
    await again.ack()
    # The third is not acked: delivered again once its ack wait is over, not before.
    assert await fetch_seqs(sub, timeout=0.4) == []
    redelivered = await sub.fetch(5, timeout=3)
    assert [(m.metadata.sequence.stream, m.metadata.num_delivered) for m in redelivered] == [(3, 2)]
    await redelivered[0].nak(delay=0.8)
    assert await fetch_seqs(sub, timeout=0.4) == []
    assert await fetch_seqs(sub, batch=1, timeout=3) == [3]
    info = await js.consumer_info("WORK", "c")
    assert info.num_ack_pending == 1 and info.num_pending == 0
    # Term and ack both deleted from the work queue; the third is still there.
    assert (await js.stream_info("WORK")).state.messages == 1


async def test_progress_holds_a_message_past_its_ack_wait(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(WORK)
    await js.publish("work.0", b"x")
    sub = await consumer(js, ack_wait=1.0)
    (msg,) = await sub.fetch(1, timeout=2)
    for _ in range(4):
        await asyncio.sleep(0.4)
        await msg.in_progress()
    assert await fetch_seqs(sub, timeout=0.3) == []
    await msg.ack_sync()
    assert await fetch_seqs(sub, timeout=1.5) == []


async def test_full_subjects_and_streams_refuse_with_discard_new(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name="LIMITED",
            subjects=["lim.>"],
            discard=DiscardPolicy.NEW,
            discard_new_per_subject=True,
            max_msgs_per_subject=2,
            max_bytes=4000,
            max_msg_size=1000,
        )
    )
    await js.publish("lim.a", b"1")
    await js.publish("lim.a", b"2")
    with pytest.raises(nats.js.errors.APIError) as refused:
        await js.publish("lim.a", b"3")
    assert (refused.value.code, refused.value.err_code) == (503, 10077)
    assert "maximum messages per subject exceeded" in refused.value.description
    await js.publish("lim.b", b"other units still publish")
    with pytest.raises(nats.js.errors.APIError) as too_big:
        await js.publish("lim.c", b"x" * 1001)
    assert (too_big.value.code, too_big.value.err_code) == (400, 10054)
    for n in range(4):
        await js.publish(f"lim.d{n}", b"x" * 800)
    with pytest.raises(nats.js.errors.APIError) as full:
        await js.publish("lim.e", b"x" * 800)
    assert full.value.err_code == 10077 and "maximum bytes exceeded" in full.value.description
    assert (await js.stream_info("LIMITED")).state.messages == 7


async def test_discard_old_keeps_the_newest_per_subject_readable_by_sequence(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(name="LAST", subjects=["last.>"], max_msgs_per_subject=2, allow_direct=True)
    )
    for n in range(4):
        await js.publish("last.head", str(n).encode(), headers={"Version": str(n)})
    await js.publish("last.other", b"o")
    for direct in (True, False):
        newest = await js.get_last_msg("LAST", "last.head", direct=direct)
        assert (newest.data, newest.seq, newest.subject) == (b"3", 4, "last.head")
        assert newest.headers["Version"] == "3"
        assert abs(newest.time.timestamp() - time.time()) < 60
        kept = await js.get_msg("LAST", seq=3, direct=direct)
        assert (kept.data, kept.subject) == (b"2", "last.head")
        for missing in (dict(seq=1), dict(seq=99), dict(subject="last.none")):
            with pytest.raises(nats.js.errors.NotFoundError):
                await js.get_msg("LAST", direct=direct, **missing)
    assert (await js.stream_info("LAST")).state.messages == 3


async def test_kv_compare_and_set_delete_and_recreate(nc) -> None:
    js = nc.jetstream()
    bucket = await js.create_key_value(KeyValueConfig(bucket="cas", history=5, direct=True))
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await bucket.get("k")
    first = await bucket.create("k", b"1")
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await bucket.create("k", b"again")
    second = await bucket.update("k", b"2", last=first)
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await bucket.update("k", b"stale", last=first)
    entry = await bucket.get("k")
    assert (entry.value, entry.revision) == (b"2", second)
    # nats-py's delete() does not turn a wrong revision into KeyWrongLastSequenceError.
    with pytest.raises(nats.js.errors.APIError) as stale_delete:
        await bucket.delete("k", last=first)
    assert (stale_delete.value.code, stale_delete.value.err_code) == (400, 10071)
    await bucket.delete("k", last=second)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await bucket.get("k")
    again = await bucket.create("k", b"3")
    assert again > second and (await bucket.get("k")).value == b"3"
    await bucket.put("k", b"4")
    assert (await bucket.get("k")).value == b"4"
    with pytest.raises(nats.js.errors.BucketNotFoundError):
        await js.key_value("nobucket")


async def test_stream_info_lists_keys_with_the_server_time(nc) -> None:
    js = nc.jetstream()
    things = await js.create_key_value(KeyValueConfig(bucket="things", direct=True))
    for key in ("j.unit.0", "j.unit.1", "j.outer", "k.unit.0"):
        await things.put(key, b"x")
    await things.delete("j.unit.1")
    view = await kv.snapshot(nc, "things", prefix="j.")
    assert view.keys == ["j.outer", "j.unit.0", "j.unit.1"]
    assert abs(view.server_time - time.time()) < 60
    info = await js.stream_info("KV_things", subjects_filter="$KV.things.k.>")
    assert info.state.subjects == {"$KV.things.k.unit.0": 1}
    assert (await kv.snapshot(nc, "things", prefix="none.")).keys == []
    with pytest.raises(kv.KvError):
        await kv.snapshot(nc, "missing")
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.stream_info("MISSING")


async def test_purge_by_subject_leaves_the_rest(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="CK", subjects=["ck.>"], allow_direct=True))
    for epoch in (1, 2):
        for chunk in range(3):
            await js.publish(f"ck.e{epoch}.0.chunk.{chunk}", b"x")
    await js.purge_stream("CK", subject="ck.e1.>")
    info = await js.stream_info("CK", subjects_filter="ck.>")
    assert sorted(info.state.subjects) == [f"ck.e2.0.chunk.{c}" for c in range(3)]


async def test_wildcard_subscriptions_see_core_and_stream_publishes(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="P", subjects=["p.*.params.>"]))
    heads: list[str] = []
    everything: list[str] = []
    got = asyncio.Event()

    async def on_head(msg) -> None:
        heads.append(msg.subject)

    async def on_any(msg) -> None:
        everything.append(msg.subject)
        if len(everything) == 3:
            got.set()

    await nc.subscribe("p.j.params.*.head", cb=on_head)
    await nc.subscribe("p.j.>", cb=on_any)
    await js.publish("p.j.params.0.head", b"h")  # stored, and seen by subscribers
    await nc.publish("p.j.params.1.chunk.0", b"c")
    await nc.publish("p.j.params.1.head", b"h")
    await nc.publish("q.j.params.1.head", b"elsewhere")
    await asyncio.wait_for(got.wait(), 5)
    await nc.flush()
    assert sorted(heads) == ["p.j.params.0.head", "p.j.params.1.head"]
    assert sorted(everything) == ["p.j.params.0.head", "p.j.params.1.chunk.0", *heads[1:]]


async def test_requests_nobody_answers(nc) -> None:
    with pytest.raises(nats.errors.NoRespondersError):
        await nc.request("nobody.home", b"?", timeout=2)
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await nc.jetstream().publish("no.stream", b"x", timeout=2)
    assert nc.max_payload == 1 << 20


async def test_a_killed_broker_is_unreachable_and_keeps_its_store_when_restarted(
    broker, nc
) -> None:
    js = nc.jetstream(timeout=1)
    bucket = await js.create_key_value(KeyValueConfig(bucket="keep", direct=True))
    await bucket.put("k", b"v")
    broker.kill()
    await wait_for_async(lambda: not nc.is_connected, 10, "the client to see the broker gone")
    with pytest.raises((TimeoutError, nats.errors.Error)):
        await bucket.get("k")
    broker.restart()
    await wait_for_async(lambda: nc.is_connected, 20, "a reconnect", interval_s=0.05)
    await nc.flush(timeout=5)
    assert (await bucket.get("k")).value == b"v"
