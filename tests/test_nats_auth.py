"""NATS authentication and per-role permissions on a real nats-server (shared/nats_auth.py).

The server runs with the authorization block ``diloco up`` writes. Each refused action must
both fail (nothing reaches the stream) and be reported by the server as a permissions violation
to the client that tried it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from shared import kv, nats_auth, records, subjects, transport
from shared.nats_auth import Credentials, CredentialsError, Identity
from shared.records.credentials import NatsCredentials
from shared.records.jobs import DesiredRecord
from shared.records.outer import DownlinkReply, DownlinkWant
from shared.settings import SettingsError
from shared.settings.cli import settings_from_args
from shared.settings.nats import NatsSettings
from shared.transport.connection import connect
from shared.transport.downlink import publish_delta, read_delta, request_delta
from shared.transport.streams import prepare_streams
from shared.wire.chunks import upload_id
from tests.helpers import SecureNats, wait_for_async

pytestmark = pytest.mark.nats

JOB = "secure"
DENIED_WAIT_S = 3.0  # a refused request gets no reply; this bounds the wait for the violation


class _Client:
    """A connection that keeps the errors the server sent it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Any = None

    async def open(self, settings: NatsSettings, name: str) -> _Client:
        async def on_error(err: Exception) -> None:
            self.errors.append(str(err))

        self.nc = await connect(settings, name, error_cb=on_error)
        return self

    async def refused(self, subject: str, data: bytes = b"x") -> None:
        """Publish to ``subject`` and wait for the server's permissions violation about it."""
        before = len(self.errors)
        await self.nc.publish(subject, data)
        await self.nc.flush(timeout=DENIED_WAIT_S)
        await self._violation(f'publish to "{subject}"', before)

    async def refused_subscription(self, subject: str) -> None:
        """Subscribe to ``subject`` and wait for the server's permissions violation about it."""
        before = len(self.errors)
        await self.nc.subscribe(subject)
        await self.nc.flush(timeout=DENIED_WAIT_S)
        await self._violation(f'subscription to "{subject}"', before)

    async def _violation(self, what: str, since: int) -> None:
        # nats-py lowercases the server's message.
        wanted = f"permissions violation for {what}".lower()
        try:
            await wait_for_async(
                lambda: any(wanted in e.lower() for e in self.errors[since:]),
                DENIED_WAIT_S,
                repr(wanted),
                interval_s=0.02,
            )
        except AssertionError as err:
            raise AssertionError(f"{err}; the errors: {self.errors[since:]}") from None


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SecureNats]:
    """The users ``diloco up`` would make for job JOB's outer and two learners, and the gateway;
    the admin has created the streams."""
    users = [Identity("outer", JOB), Identity("gateway")]
    made = SecureNats(tmp_path, [*users, *(Identity("learner", JOB, unit=u) for u in (0, 1))])
    yield made
    made.server.stop()


@pytest.fixture
async def admin(cluster: SecureNats) -> AsyncIterator[_Client]:
    client = await _Client().open(cluster.settings(Identity("admin")), "admin")
    yield client
    await client.nc.close()


async def _stream_messages(admin: _Client, stream: str) -> int:
    return int((await admin.nc.jetstream().stream_info(stream)).state.messages)


async def test_an_anonymous_client_or_a_wrong_password_is_refused(cluster: SecureNats) -> None:
    with pytest.raises(transport.TransportError, match="[Aa]uthorization"):
        await connect(NatsSettings(nats_url=cluster.server.url, connect_timeout_s=2), "anonymous")
    forged = cluster.credentials.folder / "forged.json"
    nats_auth.write_credentials(
        forged, NatsCredentials(user="learner-secure-0", password="x" * 32, role="learner")
    )
    with pytest.raises(transport.TransportError, match="[Aa]uthorization"):
        await connect(
            NatsSettings(nats_url=cluster.server.url, nats_credentials=str(forged)), "forged"
        )


async def test_a_learner_may_do_its_own_work_and_nothing_else(
    cluster: SecureNats, admin: _Client
) -> None:
    learner = await _Client().open(cluster.settings(Identity("learner", JOB, unit=0)), "l0")
    js = learner.nc.jetstream()
    try:
        # Its own work: the streams it uses exist, it uploads on its subject, writes its status
        # and reads its desired state.
        await prepare_streams(js, cluster.settings(Identity("learner", JOB, unit=0)))
        await js.publish(subjects.grads_subject(JOB, 0, 0), b"upload", timeout=5)
        status_kv = await js.key_value(subjects.STATUS_BUCKET)
        await status_kv.put(subjects.unit_status_key(JOB, 0), b"{}")
        admin_desired = await admin.nc.jetstream().key_value(subjects.DESIRED_BUCKET)
        await kv.put(admin_desired, subjects.desired_key(JOB, 0), DesiredRecord(state="running"))
        desired_kv = await js.key_value(subjects.DESIRED_BUCKET)
        found = await kv.get(desired_kv, subjects.desired_key(JOB, 0), DesiredRecord)
        assert found is not None and found.state == "running"
        # It hears the writes of its own desired state (and of no other unit's: below). Written
        # until one is heard: what is checked is the permission, not that no write is ever
        # missed (the learner reads the record every few seconds too).
        writes = await learner.nc.subscribe(subjects.desired_subject(JOB, 0))
        await learner.nc.flush(timeout=5)
        heard = None
        for _ in range(20):
            await kv.put(admin_desired, subjects.desired_key(JOB, 0), DesiredRecord(state="paused"))
            with contextlib.suppress(nats.errors.TimeoutError):
                heard = records.decode(DesiredRecord, (await writes.next_msg(timeout=1)).data)
                break
        assert heard is not None and heard.state == "paused"
        assert await _stream_messages(admin, subjects.GRADS_STREAM) == 1

        # Everything else is refused, and the server says so.
        api = nats_auth.JS_API
        for subject in (
            subjects.grads_subject(JOB, 1, 0),  # another unit's uploads
            subjects.grads_subject("other", 0, 0),  # another job's
            subjects.params_head_subject(JOB, 0),  # the global params
            subjects.params_chunk_subject(JOB, 0, 0),
            f"$KV.{subjects.DESIRED_BUCKET}.{subjects.desired_key(JOB, 1)}",  # desired states
            f"$KV.{subjects.DESIRED_BUCKET}.{subjects.desired_key(JOB, 0)}",
            f"$KV.{subjects.JOBS_BUCKET}.{JOB}",  # jobs
            f"$KV.{subjects.STATUS_BUCKET}.{subjects.unit_status_key(JOB, 1)}",
            f"$KV.{subjects.STATUS_BUCKET}.{subjects.outer_status_key(JOB, 0)}",
            f"$KV.{subjects.OUTER_BUCKET}.{JOB}",  # the outer's lease
            subjects.dead_letter_subject(JOB),
            f"{api}.STREAM.DELETE.{subjects.GRADS_STREAM}",  # streams and consumers
            f"{api}.STREAM.PURGE.{subjects.GRADS_STREAM}",
            f"{api}.STREAM.CREATE.EVIL",
            f"{api}.STREAM.UPDATE.{subjects.PARAMS_STREAM}",
            f"{api}.CONSUMER.DELETE.{subjects.GRADS_STREAM}.{subjects.outer_consumer(JOB, 0)}",
            f"{api}.CONSUMER.CREATE.{subjects.GRADS_STREAM}",
            f"{api}.CONSUMER.DURABLE.CREATE.{subjects.GRADS_STREAM}.thief",
            f"{api}.DIRECT.GET.KV_{subjects.DESIRED_BUCKET}.$KV.{subjects.DESIRED_BUCKET}.other.0",
        ):
            await learner.refused(subject)
        # Nor may it read the replies another user asked for, or the uploads of others.
        await learner.refused_subscription(nats_auth.inbox_prefix("learner-secure-1") + ".>")
        await learner.refused_subscription(subjects.grads_subject(JOB, 1, 0))
        await learner.refused_subscription(subjects.desired_subject(JOB, 1))
        assert await _stream_messages(admin, subjects.GRADS_STREAM) == 1
    finally:
        await learner.nc.close()


async def test_the_outer_and_the_gateway_keep_to_their_roles(
    cluster: SecureNats, admin: _Client
) -> None:
    outer = await _Client().open(cluster.settings(Identity("outer", JOB)), "outer")
    gateway = await _Client().open(cluster.settings(Identity("gateway")), "gateway")
    try:
        # The gateway writes desired states and jobs; the outer publishes params and its lease.
        gateway_js = gateway.nc.jetstream()
        desired = await gateway_js.key_value(subjects.DESIRED_BUCKET)
        await kv.put(desired, subjects.desired_key(JOB, 1), DesiredRecord(state="paused"))
        await outer.nc.jetstream().publish(subjects.params_head_subject(JOB, 0), b"{}", timeout=5)
        lease = await outer.nc.jetstream().key_value(subjects.OUTER_BUCKET)
        await lease.put(subjects.lease_key(JOB, 0), b"{}")
        # The outer reads its units' desired states (a quarantined unit's uploads are refused).
        outer_desired = await outer.nc.jetstream().key_value(subjects.DESIRED_BUCKET)
        found = await kv.get(outer_desired, subjects.desired_key(JOB, 1), DesiredRecord)
        assert found is not None and found.state == "paused"
        for subject in (
            subjects.grads_subject(JOB, 0, 0),
            subjects.params_head_subject(JOB, 0),
            f"{nats_auth.JS_API}.STREAM.DELETE.{subjects.PARAMS_STREAM}",
        ):
            await gateway.refused(subject)
        for subject in (
            subjects.grads_subject(JOB, 0, 0),
            subjects.params_head_subject("other", 0),
            f"$KV.{subjects.DESIRED_BUCKET}.{subjects.desired_key(JOB, 0)}",
            f"$KV.{subjects.OUTER_BUCKET}.other",
            f"{nats_auth.JS_API}.STREAM.DELETE.{subjects.GRADS_STREAM}",
            f"{nats_auth.JS_API}.CONSUMER.DELETE.{subjects.GRADS_STREAM}.outer-other",
        ):
            await outer.refused(subject)
    finally:
        await outer.nc.close()
        await gateway.nc.close()


async def test_a_unit_asks_for_and_reads_only_its_own_params_deltas(cluster: SecureNats) -> None:
    """The delta downlink: a learner asks the outer (a request it answers), reads the delta
    from its own downlink subjects, and may neither ask as another unit nor read another's."""
    outer = await _Client().open(cluster.settings(Identity("outer", JOB)), "outer")
    unit0 = await _Client().open(cluster.settings(Identity("learner", JOB, unit=0)), "l0")
    unit1 = await _Client().open(cluster.settings(Identity("learner", JOB, unit=1)), "l1")
    blob = b"delta bytes " * 100
    upload = upload_id(JOB, 0, 1, 0)

    async def on_want(msg: Any) -> None:
        want = DownlinkWant.model_validate_json(msg.data)
        named = subjects.unit_of_want(JOB, msg.subject)
        assert named is not None and named[1] == want.fragment
        unit = named[0]
        chunks = await publish_delta(
            outer.nc.jetstream(), JOB, unit, want.fragment, blob, upload, 256
        )
        reply = DownlinkReply(kind="delta", version=3, upload=upload, chunks=chunks, size=len(blob))
        await msg.respond(reply.model_dump_json().encode())

    try:
        await outer.nc.subscribe(subjects.want_subject(JOB, "*", "*"), cb=on_want)
        await outer.nc.flush()
        want = DownlinkWant(fragment=0, held_version=2, held_checksum=7)

        async def ask() -> DownlinkReply | None:
            try:
                return await request_delta(unit0.nc, JOB, 0, want, timeout_s=10)
            except transport.TransportError:
                # As a learner does, ask again: once in a loaded CI run, the first want found
                # no responder although the outer's subscription had been flushed.
                return None

        reply = await wait_for_async(ask, 40, "an answer to unit 0's params want")
        assert outer.errors == [] and unit0.errors == []
        assert reply.kind == "delta" and reply.chunks == 5
        assert await read_delta(unit0.nc.jetstream(), JOB, 0, 0, reply, 1 << 20) == blob
        api, stream = nats_auth.JS_API, subjects.DOWNLINK_STREAM
        for subject in (
            subjects.want_subject(JOB, 0, 0),  # asking as another unit
            f"{api}.DIRECT.GET.{stream}.{subjects.downlink_chunk_subject(JOB, 0, 0, 0)}",
            f"{api}.DIRECT.GET.{stream}",  # by sequence: any unit's
            subjects.downlink_chunk_subject(JOB, 1, 0, 0),  # writing deltas
        ):
            await unit1.refused(subject)
        await unit1.refused_subscription(subjects.want_subject(JOB, "*", "*"))
    finally:
        for client in (outer, unit0, unit1):
            await client.nc.close()


async def test_new_users_are_added_by_a_reload_or_at_the_next_restart(cluster: SecureNats) -> None:
    who = Identity("learner", "later", unit=3)
    path, new = cluster.credentials.ensure(who)
    assert new
    settings = NatsSettings(nats_url=cluster.server.url, nats_credentials=str(path))
    with pytest.raises(transport.TransportError, match="[Aa]uthorization"):
        await connect(settings, "too-early")
    cluster.server.reload(cluster.credentials.authorization_block())
    nc = await connect(settings, "after-reload")
    await nc.close()
    # A server that is down when users are added finds them when it is restarted.
    late = Identity("learner", "later", unit=4)
    path, _ = cluster.credentials.ensure(late)
    cluster.server.kill()
    cluster.server.reload(cluster.credentials.authorization_block())
    cluster.server.restart()
    late_settings = NatsSettings(nats_url=cluster.server.url, nats_credentials=str(path))
    nc = await connect(late_settings, "after-restart")
    await nc.close()


async def test_a_revoked_user_is_disconnected_by_the_reload_and_refused_after(
    cluster: SecureNats,
) -> None:
    """Quarantine (docs/SECURITY.md): the unit's user leaves the server's block; nats-server
    closes its connections on the reload, and its credentials no longer connect."""
    who = Identity("learner", "revoked", unit=5)
    path, _ = cluster.credentials.ensure(who)
    kept = Path(str(path) + ".kept")
    kept.write_bytes(path.read_bytes())
    kept.chmod(0o600)
    cluster.server.reload(cluster.credentials.authorization_block())
    settings = NatsSettings(nats_url=cluster.server.url, nats_credentials=str(kept))
    nc = await connect(settings, "to-be-revoked")
    assert cluster.credentials.revoke(who) and not path.exists()
    cluster.server.reload(cluster.credentials.authorization_block())
    await wait_for_async(lambda: not nc.is_connected, 30, "the revoked user's disconnection")
    await nc.close()
    with pytest.raises(transport.TransportError, match="[Aa]uthorization"):
        await connect(settings, "revoked")
    with pytest.raises(CredentialsError, match="revoked"):
        cluster.credentials.ensure(who)
    assert who.user not in cluster.credentials.load()[0]


def test_credentials_files_are_private_and_checked(tmp_path: Path) -> None:
    credentials = Credentials(tmp_path)
    path, _ = credentials.ensure(Identity("learner", JOB, unit=2))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = nats_auth.read_credentials(path)
    assert stored.user == "learner-secure-2" and stored.role == "learner"
    # The server's block has only the password's hash.
    block = credentials.authorization_block()
    assert stored.password not in block and '"$2a$' in block
    assert json.loads(block.removeprefix("authorization: "))["users"][0]["user"] == stored.user

    os.chmod(path, 0o644)
    with pytest.raises(CredentialsError, match="chmod 600"):
        nats_auth.read_credentials(path)
    with pytest.raises(SettingsError, match="chmod 600"):
        settings_from_args(NatsSettings, {"nats_credentials": str(path)})
    os.chmod(path, 0o600)
    path.write_bytes(b"{}")
    with pytest.raises(CredentialsError, match="malformed"):
        nats_auth.read_credentials(path)
    with pytest.raises(CredentialsError, match="cannot read"):
        nats_auth.read_credentials(tmp_path / "missing.json")
    path.write_text('{"user": "learner-secure-2", "password": "short", "role": "learner"}')
    with pytest.raises(CredentialsError, match="at least 16 characters"):
        nats_auth.read_credentials(path)
    with pytest.raises(SettingsError, match="cannot use the CA file"):
        settings_from_args(NatsSettings, {"nats_ca_file": str(tmp_path / "missing.pem")})
