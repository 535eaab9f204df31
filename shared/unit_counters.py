"""The names of a learner unit's counters (no JAX).

A learner process counts what happened to its uploads, global params and checkpoints
(``services/learner/counters.py``); its status record carries them (``UnitStatus.counters``,
this process's) and, for the three that describe an upload's fate, its state file keeps them
across restarts (``UnitStateFile.lifetime``). The gateway, ``diloco up``'s progress line, the
benchmarks and the tests read them with ``UnitStatus.counter``. Both the counting and the
reading APIs take a :data:`CounterName`, so a type checker catches a misspelt name on either
side; ``tests/test_vocabularies.py`` checks every name the code counts or reads against it.

The records keep ``dict[str, int]``: a reader must accept a counter that a newer learner
counts and this version does not know, rather than reject the whole record.
"""

from __future__ import annotations

from typing import Literal, get_args

#: The fate of each upload handed to the link, counted for the unit's life as well.
LifetimeCounter = Literal[
    "published",  # accepted by JetStream
    "dropped_unsent",  # dropped, oldest first, from a full queue of unsent uploads
    "rejected_local",  # never sent: the codec refused it (NaN or Inf)
]

CounterName = Literal[
    LifetimeCounter,
    "queued",  # uploads handed to the link
    "bytes_sent",  # envelope bytes JetStream accepted
    "fp32_bytes_encoded",  # what the encoded uploads would have been as float32
    "payload_bytes_encoded",  # what they were, encoded and compressed
    "params_received",  # global params versions fetched and decoded
    "params_rejected",  # global params that do not fit this unit (names, shapes, values)
    "params_read_failed",  # fetches of global params that failed
    "params_bytes_received",  # envelope bytes of the global params read (copies and deltas)
    "params_deltas_received",  # global params received as a delta (--params-downlink delta)
    "params_delta_rejected",  # deltas whose base or result checksum did not match (then a copy)
    "checkpoints_written",
    "checkpoint_errors",  # checkpoint writes that failed
    "checkpoints_superseded",  # snapshots replaced by a newer one before they were written
    "sync_waits_abandoned",  # --mode sync: waits for a merged global given up
    "records_rejected",  # records this process could not parse (shared.records.rejections)
]

#: Every lifetime counter, in the order the state file lists them.
LIFETIME_COUNTERS: tuple[LifetimeCounter, ...] = get_args(LifetimeCounter)
#: Every counter name.
COUNTER_NAMES: tuple[CounterName, ...] = get_args(CounterName)
