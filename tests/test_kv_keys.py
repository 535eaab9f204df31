"""shared.transport.kv_keys: a bucket's keys from its stream, against a real nats-server."""

from __future__ import annotations

import asyncio

import nats
import nats.js.errors
import pytest

from shared import transport


def test_kv_keys_lists_every_key_including_deleted_ones_and_none_of_other_buckets(
    nats_server,
) -> None:
    async def scenario() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            kv = await js.create_key_value(bucket="things")
            other = await js.create_key_value(bucket="things2")
            assert await transport.kv_keys(kv) == []
            await other.put("elsewhere", b"1")
            for key in ("b", "a.1", "a.2", "c"):
                await kv.put(key, b"x")
            await kv.put("b", b"rewritten")  # one message per key (history 1)
            await kv.delete("c")
            assert sorted(await transport.kv_keys(kv)) == ["a.1", "a.2", "b", "c"]
            with pytest.raises(nats.js.errors.KeyNotFoundError):  # a listed deleted key
                await kv.get("c")
            # Many listings in a row see every key every time (kv.keys() could see none).
            for _ in range(50):
                assert len(await transport.kv_keys(kv)) == 4
        finally:
            await nc.close()

    asyncio.run(scenario())
