"""Names of every NATS stream, subject, consumer and KV bucket the services share.

One place, so that a reader can see the whole NATS layout at once (docs/ARCHITECTURE.md explains
it) and so that no service spells a subject by hand.

Layout for a job ``J``::

    diloco.J.grads.<unit>.<p>      stream DILOCO_GRADS   pseudo-gradient chunks of fragment p
                                                         (work queue; each outer shard consumes
                                                         its own fragments' subjects)
    diloco.J.params.<p>.head       stream DILOCO_PARAMS  pointer to fragment p's newest version
    diloco.J.params.<p>.chunk.<i>  stream DILOCO_PARAMS  chunk i of fragment p's newest params
    diloco.J.want.<unit>.<p>       (core NATS request)   a unit asks fragment p's outer shard for
                                                         a params delta (--params-downlink delta)
    diloco.J.downlink.<unit>.<p>.chunk.<i>  stream DILOCO_DOWNLINK  chunk i of the last params
                                   delta the outer sent unit <unit> for fragment p
    diloco.J.dead                  stream DILOCO_DEAD    rejected messages with the reason
    diloco.J.ckpt.<k>.e<E>.<s>.chunk.<i>  stream DILOCO_CKPT  chunk i of outer shard k's
                                   checkpoint in slot s (0/1) of its leadership epoch E
    KV diloco_desired  J.<unit>    desired unit state (idle|running|paused|stopped), by the gateway
    KV diloco_jobs     J           the job's registry record (spec, state, units), by the gateway
    KV diloco_status   J.unit.<u>  heartbeat + status of a learner unit
    KV diloco_status   J.outer.<k> heartbeat + status of outer shard k (leader)
    KV diloco_status   J.outer_standby.<holder>  heartbeat of a standby outer
    KV diloco_outer    J.<k>       outer shard k's leader lease + committed checkpoint pointer

The outer is M shards (``--shards``, 1 by default); shard k owns the fragments p with
p mod M = k (:func:`shared.fragments.shard_fragments`): their uploads, merges, params and
delta wants.
"""

from __future__ import annotations

from collections.abc import Sequence

GRADS_STREAM = "DILOCO_GRADS"
PARAMS_STREAM = "DILOCO_PARAMS"
DEAD_STREAM = "DILOCO_DEAD"
CKPT_STREAM = "DILOCO_CKPT"
DOWNLINK_STREAM = "DILOCO_DOWNLINK"
DESIRED_BUCKET = "diloco_desired"
STATUS_BUCKET = "diloco_status"
OUTER_BUCKET = "diloco_outer"
JOBS_BUCKET = "diloco_jobs"

GRADS_ALL = "diloco.*.grads.>"
PARAMS_ALL = "diloco.*.params.>"
DEAD_ALL = "diloco.*.dead"
CKPT_ALL = "diloco.*.ckpt.>"
DOWNLINK_ALL = "diloco.*.downlink.>"


def grads_subject(job: str, unit: int | str, fragment: int | str) -> str:
    """Subject a learner unit publishes its pseudo-gradient chunks of ``fragment`` to
    (``"*"`` for any unit or fragment)."""
    return f"diloco.{job}.grads.{unit}.{fragment}"


def grads_filter(job: str) -> str:
    """Subject filter covering every unit's pseudo-gradients of one job."""
    return f"diloco.{job}.grads.>"


def grads_filters(job: str, fragments: Sequence[int], count: int) -> list[str]:
    """Subject filters of the uploads of ``fragments`` out of the job's ``count``: one filter
    for all of them, else one per fragment (an outer shard's consumer)."""
    if sorted(fragments) == list(range(count)):
        return [grads_filter(job)]
    return [grads_subject(job, "*", fragment) for fragment in sorted(fragments)]


def params_head_subject(job: str, fragment: int | str) -> str:
    """Subject of the small message announcing fragment ``fragment``'s newest version
    (``"*"`` for every fragment)."""
    return f"diloco.{job}.params.{fragment}.head"


def fragment_of_params_head(job: str, subject: str) -> int | None:
    """The fragment of a subject made by :func:`params_head_subject` for ``job`` (None for
    any other subject)."""
    prefix, suffix = f"diloco.{job}.params.", ".head"
    if not (subject.startswith(prefix) and subject.endswith(suffix)):
        return None
    number = subject[len(prefix) : -len(suffix)]
    return int(number) if number.isdigit() and len(number) < 4 else None


def params_chunk_subject(job: str, fragment: int, index: int) -> str:
    """Subject holding chunk ``index`` of a fragment's newest global params (last value)."""
    return f"diloco.{job}.params.{fragment}.chunk.{index}"


def want_subject(job: str, unit: int | str, fragment: int | str) -> str:
    """Subject a unit's request for a params delta of ``fragment`` goes to (``"*"``: every
    unit's, or every fragment's)."""
    return f"diloco.{job}.want.{unit}.{fragment}"


def unit_of_want(job: str, subject: str) -> tuple[int, int] | None:
    """The unit and fragment of a subject made by :func:`want_subject` for ``job`` (None for
    any other)."""
    prefix = f"diloco.{job}.want."
    parts = subject[len(prefix) :].split(".") if subject.startswith(prefix) else []
    if len(parts) != 2 or not all(p.isdigit() and len(p) < 10 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def downlink_filter(job: str, unit: int | str) -> str:
    """Every subject of the params deltas sent to ``unit`` (``"*"``: to every unit)."""
    return f"diloco.{job}.downlink.{unit}.>"


def downlink_chunk_subject(job: str, unit: int, fragment: int, index: int) -> str:
    """Subject holding chunk ``index`` of the last params delta of ``fragment`` sent to
    ``unit`` (last value)."""
    return f"diloco.{job}.downlink.{unit}.{fragment}.chunk.{index}"


def dead_letter_subject(job: str) -> str:
    """Subject where rejected messages of a job are copied together with the reason."""
    return f"diloco.{job}.dead"


def outer_consumer(job: str, shard: int) -> str:
    """Durable consumer name of outer shard ``shard`` of a job."""
    return f"outer-{job}-{shard}"


def desired_key(job: str, unit: int) -> str:
    """KV key (bucket DESIRED_BUCKET) of a unit's desired state."""
    return f"{job}.{unit}"


def desired_subject(job: str, unit: int) -> str:
    """The subject every write of a unit's desired-state record is published on (JetStream
    KV's own subject for the key): the unit subscribes to it to hear of a change at once."""
    return f"$KV.{DESIRED_BUCKET}.{desired_key(job, unit)}"


def job_key(job: str) -> str:
    """KV key (bucket JOBS_BUCKET) of a job's registry record."""
    return job


def unit_status_key(job: str, unit: int) -> str:
    """KV key (bucket STATUS_BUCKET) of a unit's heartbeat and status."""
    return f"{job}.unit.{unit}"


def unit_of_status_key(job: str, key: str) -> int | None:
    """The unit of a key made by :func:`unit_status_key` for ``job`` (None for other keys)."""
    prefix = f"{job}.unit."
    number = key[len(prefix) :] if key.startswith(prefix) else ""
    return int(number) if number.isdigit() and len(number) < 10 else None


def link_status_key(job: str, name: str) -> str:
    """KV key (bucket STATUS_BUCKET) of a shaped link's counters (``name``: a unit or
    ``outer``)."""
    return f"{job}.link.{name}"


def link_of_status_key(job: str, key: str) -> str | None:
    """The link name of a key made by :func:`link_status_key` for ``job`` (None for others)."""
    prefix = f"{job}.link."
    return key[len(prefix) :] if key.startswith(prefix) else None


def outer_status_key(job: str, shard: int | str) -> str:
    """KV key (bucket STATUS_BUCKET) of outer shard ``shard``'s heartbeat and status
    (``"*"``: every shard's)."""
    return f"{job}.outer.{shard}"


def shard_of_outer_status_key(job: str, key: str) -> int | None:
    """The shard of a key made by :func:`outer_status_key` for ``job`` (None for others)."""
    prefix = f"{job}.outer."
    number = key[len(prefix) :] if key.startswith(prefix) else ""
    return int(number) if number.isdigit() and len(number) < 4 else None


def checkpoint_chunk_subject(job: str, shard: int, epoch: int, slot: int, index: int) -> str:
    """Subject of chunk ``index`` of outer shard ``shard``'s checkpoint in ``slot`` of its
    leadership ``epoch``."""
    return f"diloco.{job}.ckpt.{shard}.e{epoch}.{slot}.chunk.{index}"


def checkpoint_filter(job: str, shard: int | str = ">") -> str:
    """Subject filter covering every checkpoint chunk of one outer shard (default: of every
    shard of the job)."""
    return f"diloco.{job}.ckpt.{shard}" + ("" if shard == ">" else ".>")


def checkpoint_epoch_filter(job: str, shard: int, epoch: int) -> str:
    """Subject filter covering the checkpoint chunks of one leadership epoch of a shard."""
    return f"diloco.{job}.ckpt.{shard}.e{epoch}.>"


def checkpoint_epoch(subject: str) -> int | None:
    """The leadership epoch of a checkpoint chunk subject (None for any other subject)."""
    parts = subject.split(".")
    if len(parts) != 8 or parts[2] != "ckpt" or not parts[4].startswith("e"):
        return None
    return int(parts[4][1:]) if parts[4][1:].isdigit() else None


def outer_standby_key(job: str, holder: str) -> str:
    """KV key (bucket STATUS_BUCKET) of a standby outer's status (one per standby process)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in holder)
    return outer_standby_keys(job).replace("*", safe)


def outer_standby_keys(job: str) -> str:
    """KV key filter (bucket STATUS_BUCKET) covering every standby outer of a job."""
    return f"{job}.outer_standby.*"


def lease_key(job: str, shard: int | str) -> str:
    """KV key (bucket OUTER_BUCKET) of outer shard ``shard``'s lease and checkpoint pointer
    (``"*"``: every shard's)."""
    return f"{job}.{shard}"
