"""Every stream and KV bucket the system uses, with its limits, and who may create them."""

from __future__ import annotations

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from shared import nats_auth, records, subjects
from shared.settings.nats import NatsSettings
from shared.transport.blobs import MAX_MESSAGE_BYTES
from shared.transport.params import PARAMS_VERSIONS_KEPT

GRADS_DUPLICATE_WINDOW_S = 3600.0  # longer than any learner retry window

GRADS_MAX_BYTES = 8 << 30  # a full grads stream refuses new uploads instead of losing old ones

# Chunks one unit may have waiting in the grads stream (1 GiB of 1 MiB chunks): a unit whose
# backlog is full is refused (it keeps its uploads and retries), so no one unit fills the stream.
GRADS_MAX_CHUNKS_PER_UNIT = 1024

SMALL_RECORD_BYTES = 64 << 10  # a desired state, a job's record, the outer's lease

SMALL_BUCKET_BYTES = 64 << 20

STATUS_BUCKET_BYTES = 1 << 30

PARAMS_MAX_BYTES = 4 << 30  # every job's kept params versions

CKPT_MAX_BYTES = 4 << 30  # every job's outer checkpoints

DOWNLINK_MAX_BYTES = 2 << 30  # the last params delta sent to each unit, of every job

DEAD_MAX_BYTES = 1 << 30

DEAD_MAX_PER_JOB = 1000  # dead letters kept per job: one job's junk cannot evict another's

DEAD_MAX_AGE_S = 7 * 24 * 3600.0

#: What the limits above reserve of JetStream's file store in all (nats-server refuses a stream
#: whose limit does not fit its store; ``services.orchestration.nats_server`` sizes the store from
#: this).
STORE_BYTES = (
    GRADS_MAX_BYTES
    + PARAMS_MAX_BYTES
    + CKPT_MAX_BYTES
    + DOWNLINK_MAX_BYTES
    + DEAD_MAX_BYTES
    + STATUS_BUCKET_BYTES
    + 3 * SMALL_BUCKET_BYTES
)

STATUS_TTL_S = 24 * 3600.0  # status keys of long-gone units eventually disappear


async def prepare_streams(js: JetStreamContext, settings: NatsSettings) -> None:
    """Make sure the streams and buckets exist: create them (:func:`ensure_streams`) as the
    admin or without a user; as any other role, only check the ones it uses
    (``nats_auth.ROLE_STREAMS``; only the admin may create streams).

    Raises:
        nats.js.errors.NotFoundError: a stream is not created yet (retry later).
        TimeoutError, nats.errors.Error: NATS unreachable.
    """
    credentials = settings.credentials()
    if credentials is None or credentials.role == "admin":
        await ensure_streams(js, settings.nats_replicas)
        return
    for stream in nats_auth.ROLE_STREAMS[credentials.role]:
        await js.stream_info(stream)


async def ensure_streams(js: JetStreamContext, replicas: int = 1) -> None:
    """Create (or update) every stream and KV bucket the system uses. Idempotent.

    Args:
        js: JetStream context.
        replicas: copies of each stream and bucket it creates (at most the cluster's nodes);
            a stream that exists keeps its number (a service started without it must not
            shrink a replicated stream).
    """
    configs = [
        StreamConfig(
            name=subjects.GRADS_STREAM,
            subjects=[subjects.GRADS_ALL],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=GRADS_DUPLICATE_WINDOW_S,
            max_bytes=GRADS_MAX_BYTES,
            max_msgs_per_subject=GRADS_MAX_CHUNKS_PER_UNIT,
            discard=DiscardPolicy.NEW,
            discard_new_per_subject=True,
            max_msg_size=MAX_MESSAGE_BYTES,
        ),
        StreamConfig(
            name=subjects.PARAMS_STREAM,
            subjects=[subjects.PARAMS_ALL],
            storage=StorageType.FILE,
            max_msgs_per_subject=PARAMS_VERSIONS_KEPT,
            max_bytes=PARAMS_MAX_BYTES,
            max_msg_size=MAX_MESSAGE_BYTES,
            allow_direct=True,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=subjects.CKPT_STREAM,
            subjects=[subjects.CKPT_ALL],
            storage=StorageType.FILE,
            max_msgs_per_subject=1,
            max_bytes=CKPT_MAX_BYTES,
            max_msg_size=MAX_MESSAGE_BYTES,
            allow_direct=True,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=subjects.DOWNLINK_STREAM,
            subjects=[subjects.DOWNLINK_ALL],
            storage=StorageType.FILE,
            max_msgs_per_subject=1,
            max_bytes=DOWNLINK_MAX_BYTES,
            max_msg_size=MAX_MESSAGE_BYTES,
            allow_direct=True,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=subjects.DEAD_STREAM,
            subjects=[subjects.DEAD_ALL],
            storage=StorageType.FILE,
            max_age=DEAD_MAX_AGE_S,
            max_bytes=DEAD_MAX_BYTES,
            max_msgs_per_subject=DEAD_MAX_PER_JOB,
            max_msg_size=MAX_MESSAGE_BYTES,
            discard=DiscardPolicy.OLD,
        ),
    ]
    for config in configs:
        # Added only when missing: nats-server counts an add's limits against the store before
        # it sees that the stream exists.
        try:
            info = await js.stream_info(config.name)
        except nats.js.errors.NotFoundError:
            config.num_replicas = replicas
            await js.add_stream(config)
        else:
            config.num_replicas = info.config.num_replicas
            await js.update_stream(config)
    small = {
        "max_value_size": SMALL_RECORD_BYTES,
        "max_bytes": SMALL_BUCKET_BYTES,
        "direct": True,
        "replicas": replicas,
    }
    buckets = [
        KeyValueConfig(bucket=subjects.DESIRED_BUCKET, history=5, **small),
        KeyValueConfig(
            bucket=subjects.STATUS_BUCKET,
            history=1,
            ttl=STATUS_TTL_S,
            max_value_size=records.MAX_RECORD_BYTES,
            max_bytes=STATUS_BUCKET_BYTES,
            direct=True,
            replicas=replicas,
        ),
        KeyValueConfig(bucket=subjects.OUTER_BUCKET, history=1, **small),
        KeyValueConfig(bucket=subjects.JOBS_BUCKET, history=5, **small),
    ]
    for bucket in buckets:
        try:
            await js.stream_info(f"KV_{bucket.bucket}")
        except nats.js.errors.NotFoundError:
            await js.create_key_value(bucket)
