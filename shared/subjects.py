"""Names of every NATS stream, subject, consumer and KV bucket the services share.

One place, so that a reader can see the whole NATS layout at once (docs/ARCHITECTURE.md explains
it) and so that no service spells a subject by hand.

Layout for a job ``J``::

    diloco.J.grads.<unit>          stream DILOCO_GRADS   pseudo-gradient chunks (work queue)
    diloco.J.params.<p>.head       stream DILOCO_PARAMS  pointer to fragment p's newest version
    diloco.J.params.<p>.chunk.<i>  stream DILOCO_PARAMS  chunk i of fragment p's newest params
    diloco.J.want.<unit>           (core NATS request)   a unit asks the outer for a params delta
                                                         (--params-downlink delta)
    diloco.J.downlink.<unit>.<p>.chunk.<i>  stream DILOCO_DOWNLINK  chunk i of the last params
                                   delta the outer sent unit <unit> for fragment p
    diloco.J.dead                  stream DILOCO_DEAD    rejected messages with the reason
    diloco.J.ckpt.e<E>.<s>.chunk.<i>  stream DILOCO_CKPT  chunk i of the outer's checkpoint in
                                   slot s (0/1) of leadership epoch E
    KV diloco_desired  J.<unit>    desired unit state (idle|running|paused|stopped), by the gateway
    KV diloco_jobs     J           the job's registry record (spec, state, units), by the gateway
    KV diloco_status   J.unit.<u>  heartbeat + status of a learner unit
    KV diloco_status   J.outer     heartbeat + status of the outer optimizer
    KV diloco_outer    J           the outer's leader lease + committed checkpoint pointer
"""

from __future__ import annotations

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


def grads_subject(job: str, unit: int) -> str:
    """Subject a learner unit publishes its pseudo-gradient chunks to."""
    return f"diloco.{job}.grads.{unit}"


def grads_filter(job: str) -> str:
    """Subject filter covering every unit's pseudo-gradients of one job."""
    return f"diloco.{job}.grads.>"


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


def want_subject(job: str, unit: int | str) -> str:
    """Subject a unit's request for a params delta goes to (``"*"``: every unit's)."""
    return f"diloco.{job}.want.{unit}"


def unit_of_want(job: str, subject: str) -> int | None:
    """The unit of a subject made by :func:`want_subject` for ``job`` (None for any other)."""
    prefix = f"diloco.{job}.want."
    number = subject[len(prefix) :] if subject.startswith(prefix) else ""
    return int(number) if number.isdigit() and len(number) < 10 else None


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


def outer_consumer(job: str) -> str:
    """Durable consumer name of the outer optimizer of a job."""
    return f"outer-{job}"


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


def outer_status_key(job: str) -> str:
    """KV key (bucket STATUS_BUCKET) of the outer optimizer's heartbeat and status."""
    return f"{job}.outer"


def checkpoint_chunk_subject(job: str, epoch: int, slot: int, index: int) -> str:
    """Subject of chunk ``index`` of the outer checkpoint in ``slot`` of leadership ``epoch``."""
    return f"diloco.{job}.ckpt.e{epoch}.{slot}.chunk.{index}"


def checkpoint_filter(job: str) -> str:
    """Subject filter covering every checkpoint chunk of a job."""
    return f"diloco.{job}.ckpt.>"


def checkpoint_epoch_filter(job: str, epoch: int) -> str:
    """Subject filter covering the checkpoint chunks of one leadership epoch."""
    return f"diloco.{job}.ckpt.e{epoch}.>"


def checkpoint_epoch(subject: str) -> int | None:
    """The leadership epoch of a checkpoint chunk subject (None for any other subject)."""
    parts = subject.split(".")
    if len(parts) != 7 or parts[2] != "ckpt" or not parts[3].startswith("e"):
        return None
    return int(parts[3][1:]) if parts[3][1:].isdigit() else None


def outer_standby_key(job: str, holder: str) -> str:
    """KV key (bucket STATUS_BUCKET) of a standby outer's status (one per standby process)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in holder)
    return outer_standby_keys(job).replace("*", safe)


def outer_standby_keys(job: str) -> str:
    """KV key filter (bucket STATUS_BUCKET) covering every standby outer of a job."""
    return f"{job}.outer_standby.*"


def lease_key(job: str) -> str:
    """KV key (bucket OUTER_BUCKET) of a job's outer lease and checkpoint pointer."""
    return job
