"""The delta downlink end to end (in-memory NATS server, the outer service in-process): a unit
fetches deltas over several versions and holds bit for bit what the outer recorded; after the
outer restarts from its checkpoint, or a standby takes over, the unit gets a keyframe and then
deltas again, still bit-identical."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import numpy as np
import pytest

from services.learner import params_fetcher
from services.learner.counters import Counters
from services.learner.params_fetcher import ParamsFetcher
from services.learner.settings import LearnerSettings
from services.outer.downlink import DownlinkServer
from services.outer.publishing import params_envelope
from services.outer.service import OuterService
from services.outer.settings import OuterSettings
from shared import records, subjects
from shared.codec import api as codec
from shared.downlink import params_checksum
from shared.records.outer import DownlinkReply, DownlinkWant
from shared.settings.nats import NatsSettings
from shared.transport.blobs import chunk_size_for, publish_blob
from shared.transport.connection import connect
from shared.transport.params import publish_params
from shared.transport.streams import ensure_streams
from shared.wire.chunks import upload_id
from tests.helpers import upload_blob, wait_for_async

JOB = "delta"


class Outer:
    """An outer service running in this event loop."""

    def __init__(self, settings: OuterSettings) -> None:
        self.service = OuterService(settings, asyncio.Event())
        self.task = asyncio.create_task(self.service.run())

    async def running(self) -> None:
        def running() -> bool:
            assert not self.task.done(), self.task.exception()
            return self.service.state == "running"

        await wait_for_async(running, 240, "the outer to run")

    async def stop(self) -> None:
        self.service.stop.set()
        await asyncio.wait_for(self.task, 60)

    def version(self) -> int:
        return self.service.core.version(0)

    def records(self, unit: int):
        assert self.service.downlink is not None
        return self.service.downlink.senders[0].records(unit)


async def stop_fetching(fetching: asyncio.Task, fetcher: ParamsFetcher, *connections) -> None:
    """Cancel the fetcher's loop, unsubscribe it, and close ``connections``."""
    fetching.cancel()
    await asyncio.gather(fetching, return_exceptions=True)
    await fetcher.close()
    for connection in connections:
        await connection.close()


async def upload(js, chunk_size: int, round_: int, base: int) -> None:
    blob = upload_blob(JOB, 0, round_, base=base, seed=round_, scale=1e-2)
    await publish_blob(
        js, subjects.grads_subject(JOB, 0, 0), blob, upload_id(JOB, 0, round_, 0), chunk_size
    )


@pytest.mark.parametrize("takeover", ["restart", "failover"])
def test_a_unit_holds_what_the_outer_recorded_across_versions_and_a_new_leader(
    memory_nats, tmp_path: Path, takeover: str
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    outer_settings = OuterSettings(
        nats_url=memory_nats.url,
        job=JOB,
        model="tiny",
        corpus=str(corpus),
        num_units=1,
        fragments=1,  # the uploads below carry the whole model
        params_downlink="delta",
        params_delta_codec="int4",
        eval_every_s=3600,
    )
    learner_settings = LearnerSettings(
        job=JOB, model="tiny", unit=0, num_units=1, fragments=1, params_downlink="delta"
    )

    async def scenario() -> None:
        nc = await connect(NatsSettings(nats_url=memory_nats.url), "test")
        js = nc.jetstream()
        await ensure_streams(js)
        chunk_size = chunk_size_for(nc)
        counters = Counters()
        fetcher = ParamsFetcher(learner_settings, 64 << 20, counters)
        params_nc = await connect(NatsSettings(nats_url=memory_nats.url), "params")
        await fetcher.subscribe(params_nc)
        fetching = asyncio.create_task(fetcher.run(params_nc.jetstream(), params_nc))
        outer = Outer(outer_settings)
        round_ = 0

        async def next_version() -> int:
            """Upload once; wait until the unit holds the merged version; check it is what
            the outer recorded."""
            nonlocal round_
            before = outer.version()
            await upload(js, chunk_size, round_, base=before)
            round_ += 1
            await wait_for_async(lambda: outer.version() > before, 120, "a merge")
            version = outer.version()

            def holds() -> bool:
                assert not fetching.done(), fetching.exception()
                held = fetcher.held[0]
                return held is not None and held.version == version

            await wait_for_async(holds, 60, f"the unit to hold version {version}")
            held = fetcher.held[0]
            assert held is not None
            assert params_checksum(held.pieces) == held.checksum
            assert (held.version, held.checksum) in {
                (r.version, r.checksum) for r in outer.records(0)
            }
            exact = outer.service.core.fragment_params(0)
            for name, value in held.pieces.items():
                np.testing.assert_allclose(value, np.asarray(exact[name]), atol=2e-2)
            return version

        try:
            await outer.running()
            await wait_for_async(lambda: fetcher.held[0] is not None, 60, "the first keyframe")
            assert counters["params_deltas_received"] == 0  # it joined: a keyframe
            for _ in range(4):
                await next_version()
            assert counters["params_deltas_received"] == 4
            bytes_before = counters["params_bytes_received"]

            # A new leader restores the checkpoint, with no records of what the unit holds.
            if takeover == "restart":
                await outer.stop()
                outer = Outer(outer_settings)
            else:
                standby = Outer(outer_settings)
                await wait_for_async(
                    lambda: standby.service.state == "standby", 60, "the standby to wait"
                )
                await outer.stop()  # releases the lease: the standby takes over
                outer = standby
            await outer.running()
            assert outer.service.progress.restored_from.kind == "checkpoint"
            await next_version()
            assert counters["params_deltas_received"] == 4  # a keyframe, not a delta
            assert counters["params_bytes_received"] > bytes_before
            for _ in range(2):
                await next_version()
            assert counters["params_deltas_received"] == 6
            assert counters["params_delta_rejected"] == 0
            downlink = outer.service.downlink
            assert downlink is not None
            assert downlink.answered["keyframe"] >= 1 and downlink.answered["delta"] == 2
            status = outer.service.status_record()
            assert status.downlink is not None and status.downlink.delta == 2
            assert status.downlink.delta_bytes == downlink.delta_bytes > 0
        finally:
            await outer.stop()
            await stop_fetching(fetching, fetcher, params_nc, nc)

    asyncio.run(scenario())


async def publish_version(
    js, server: DownlinkServer, version: int, fragment: int = 0
) -> dict[str, np.ndarray]:
    """Publish ``version`` of ``fragment`` as the outer does: the downlink learns it first."""
    rng = np.random.default_rng([version, fragment])
    params = {f"w{fragment}": rng.standard_normal(5000 + fragment).astype(np.float32)}
    blob, checksum = params_envelope(JOB, "tiny", fragment, version, 0, params, "int8")
    await server.published(fragment, version, params, blob)
    await publish_params(js, JOB, fragment, version, blob, 4096, params_checksum=checksum)
    return params


@pytest.mark.parametrize("tamper", ["checksum", "base_checksum", "base_version"])
def test_a_delta_that_does_not_match_is_rejected_and_the_keyframe_read(
    memory_nats, monkeypatch: pytest.MonkeyPatch, tamper: str
) -> None:
    """A delta whose base is not what the unit holds, or whose result is not what the outer
    recorded, is counted, named in the unit's last error, and replaced by the global copy."""
    monkeypatch.setattr(params_fetcher, "PARAMS_POLL_S", 0.1)
    settings = LearnerSettings(job=JOB, model="tiny", unit=0, num_units=1, params_downlink="delta")

    async def scenario() -> None:
        nc = await connect(NatsSettings(nats_url=memory_nats.url), "outer")
        js = nc.jetstream()
        await ensure_streams(js)
        server = DownlinkServer(JOB, "tiny", 1, "int8", 4096, 1 << 20)
        honest = server._reply

        async def tampered(*args):
            reply = await honest(*args)
            if reply.kind != "delta":
                return reply
            return reply.model_copy(update={tamper: getattr(reply, tamper) ^ 1})

        monkeypatch.setattr(server, "_reply", tampered)
        await server.subscribe(nc, js, [0])
        counters = Counters()
        fetcher = ParamsFetcher(settings, 1 << 20, counters)
        await fetcher.subscribe(nc)
        fetching = asyncio.create_task(fetcher.run(js, nc))

        async def held_version(version: int) -> None:
            def holds() -> bool:
                assert not fetching.done(), fetching.exception()
                held = fetcher.held[0]
                return held is not None and held.version == version

            await wait_for_async(holds, 20, f"the unit to hold version {version}")

        try:
            await publish_version(js, server, 0)
            await held_version(0)  # joined: a keyframe
            params = await publish_version(js, server, 1)
            await held_version(1)
            assert counters["params_delta_rejected"] == 1
            assert counters["params_deltas_received"] == 0
            reason = "result mismatch" if tamper == "checksum" else "base mismatch"
            assert reason in counters.last_error
            # What it holds is the global copy of version 1, decoded.
            payload, description = codec.encode_tensors(params, "int8", zstd_level=1)
            keyframe = codec.decode_tensors(payload, description)
            held = fetcher.held[0]
            assert held is not None and held.checksum == params_checksum(keyframe)
            assert [f.version for f in fetcher.take_new()] == [1]
        finally:
            await stop_fetching(fetching, fetcher, nc)

    asyncio.run(scenario())


def test_each_fragment_has_its_own_deltas(memory_nats, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(params_fetcher, "PARAMS_POLL_S", 0.1)
    settings = LearnerSettings(
        job=JOB, model="tiny", unit=1, num_units=2, fragments=2, params_downlink="delta"
    )

    async def scenario() -> None:
        nc = await connect(NatsSettings(nats_url=memory_nats.url), "outer")
        js = nc.jetstream()
        await ensure_streams(js)
        server = DownlinkServer(JOB, "tiny", 2, "int4", 4096, 1 << 20)
        await server.subscribe(nc, js, [0, 1])
        counters = Counters()
        fetcher = ParamsFetcher(settings, 1 << 20, counters)
        await fetcher.subscribe(nc)
        fetching = asyncio.create_task(fetcher.run(js, nc))

        def holds(version: int) -> bool:
            assert not fetching.done(), fetching.exception()
            return all(h is not None and h.version == version for h in fetcher.held)

        try:
            for version in range(4):
                for fragment in (0, 1):
                    await publish_version(js, server, version, fragment)
                await wait_for_async(lambda v=version: holds(v), 20, f"version {version}")
                for fragment, held in enumerate(fetcher.held):
                    assert held is not None and set(held.pieces) == {f"w{fragment}"}
                    records = server.senders[fragment].records(1)
                    assert (held.version, held.checksum) in {
                        (r.version, r.checksum) for r in records
                    }
            assert counters["params_deltas_received"] == 6  # two keyframes, then deltas
            assert counters["params_delta_rejected"] == 0
        finally:
            await stop_fetching(fetching, fetcher, nc)

    asyncio.run(scenario())


def test_a_want_that_came_before_a_reconnect_is_not_answered(
    memory_nats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-server lets the outer send one reply to a request it delivered; a restarted server
    does not know the requests the old one delivered, and a reply to one is a publish
    violation (seen in tests/test_up.py's restart of nats-server). A want whose answer was
    prepared across a reconnect goes unanswered (the unit asks again); one that was not is
    answered."""

    async def scenario() -> None:
        nc = await connect(NatsSettings(nats_url=memory_nats.url), "outer")
        unit_nc = await connect(NatsSettings(nats_url=memory_nats.url), "unit")
        js = nc.jetstream()
        await ensure_streams(js)
        server = DownlinkServer(JOB, "tiny", 1, "int8", 4096, 1 << 20)
        honest = server._reply
        reconnect = {"now": False}

        async def across_a_reconnect(*args):
            reply = await honest(*args)
            if reconnect["now"]:
                nc.stats["reconnects"] += 1  # the connection came back while it was prepared
            return reply

        monkeypatch.setattr(server, "_reply", across_a_reconnect)
        await server.subscribe(nc, js, [0])
        want = records.encode(DownlinkWant(fragment=0, held_version=-1, held_checksum=0))
        try:
            await publish_version(js, server, 0)
            reply = await unit_nc.request(subjects.want_subject(JOB, 0, 0), want, timeout=5)
            assert records.decode(DownlinkReply, reply.data, "reply").version == 0
            answered = sum(server.answered.values())
            reconnect["now"] = True
            with pytest.raises(nats.errors.TimeoutError):
                await unit_nc.request(subjects.want_subject(JOB, 0, 0), want, timeout=1)
            assert sum(server.answered.values()) == answered
        finally:
            await unit_nc.close()
            await nc.close()

    asyncio.run(scenario())
