"""The outer's intake without NATS: every rejection reason, deduplication and dead-lettering."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.outer.core import OuterCore
from services.outer.errors import Rejected
from services.outer.intake import Intake
from services.outer.ledger import OuterLedger
from services.outer.publishing import DeadLetters
from services.outer.validation import UploadRules, Validated, validate
from shared import subjects
from shared.codec import api as codec
from shared.records import MAX_BATCH_SIZE, MAX_OUTER_UNITS, MAX_STEPS_PER_UPLOAD
from shared.transport.dead_letters import HEADER_REASON
from shared.wire.chunks import ChunkInfo, chunk_headers, split_chunks, upload_id
from shared.wire.envelope import Envelope, ParamsEnvelope, PseudoGradEnvelope, pack_envelope
from tests.helpers import outer_algorithm

JOB, MODEL = "j", "tiny"
SHAPES = {"a": (3,), "b": (2, 2)}
SEQ_LEN = 8
RULES = UploadRules(
    job=JOB,
    model=MODEL,
    piece_shapes=[SHAPES],
    max_upload_bytes=1 << 20,
    max_tensor_bytes=1 << 20,
    seq_len=SEQ_LEN,
)
MOST_PER_STEP = MAX_BATCH_SIZE * SEQ_LEN


def tensors(value: float = 0.01, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict:
    return {name: np.full(shape, value, np.float32) for name, shape in shapes.items()}


def envelope(**changes: Any) -> PseudoGradEnvelope:
    payload, description = codec.encode_tensors(changes.pop("tensors", tensors()), "int8")
    fields = {
        "job": JOB,
        "unit": 0,
        "round": 0,
        "fragment": 0,
        "base_version": 0,
        "inner_steps": 10,
        "tokens": 640,
        "train_loss": 3.0,
        "codec": description,
        "sent_at": 1.7e9,
        "payload": payload,
        "model": MODEL,
    }
    return PseudoGradEnvelope(**{**fields, **changes})


def params(**changes: Any) -> ParamsEnvelope:
    payload, description = codec.encode_tensors(tensors(), "int8")
    fields = {
        "job": JOB,
        "model": MODEL,
        "fragment": 0,
        "version": 0,
        "tokens": 640,
        "codec": description,
        "sent_at": 1.7e9,
        "payload": payload,
    }
    return ParamsEnvelope(**{**fields, **changes})


def check(env: Envelope, upload: str | None = None, subject: str | None = None) -> Validated:
    """Validate ``env`` as if it came on its own unit's and fragment's subject under its own
    upload id (a params envelope: as unit 0's round 0)."""
    unit, round_ = (env.unit, env.round) if isinstance(env, PseudoGradEnvelope) else (0, 0)
    upload = upload or upload_id(JOB, unit, round_, env.fragment)
    subject = subject or subjects.grads_subject(JOB, unit, env.fragment)
    return validate(upload, subject, pack_envelope(env), RULES, arrived_at=1.0)


def test_a_valid_upload_becomes_an_arrival_with_named_fields() -> None:
    valid = check(envelope(unit=2, round=7, base_version=1, train_loss=2.5))
    assert (valid.fragment, valid.codec, valid.payload_bytes > 0) == (0, "int8", True)
    arrival = valid.arrival
    assert (arrival.unit, arrival.round, arrival.base_version) == (2, 7, 1)
    assert (arrival.tokens, arrival.inner_steps, arrival.train_loss) == (640, 10, 2.5)
    assert arrival.upload == upload_id(JOB, 2, 7, 0) and arrival.arrived_at == 1.0
    assert {k: v.shape for k, v in arrival.pseudo_grad.items()} == SHAPES


def test_the_most_work_a_job_allows_is_accepted() -> None:
    most = check(envelope(unit=MAX_OUTER_UNITS - 1, inner_steps=3, tokens=3 * MOST_PER_STEP))
    assert (most.arrival.unit, most.arrival.tokens) == (MAX_OUTER_UNITS - 1, 3 * MOST_PER_STEP)


def test_a_job_with_its_own_h_and_batch_refuses_more_work_than_one_period_holds() -> None:
    """With the job's H (30) and batch size (16), one upload stands for at most 30 steps of 16
    sequences: a unit cannot claim the weight of 256 times its batch, or of a longer period."""
    rules = dataclasses.replace(RULES, max_steps=30, batch_size=16)

    def judged(**fields: int) -> str | None:
        blob = pack_envelope(envelope(**fields))
        try:
            validate(upload_id(JOB, 0, 0, 0), subjects.grads_subject(JOB, 0, 0), blob, rules,
                     arrived_at=0.0)  # fmt: skip
        except Rejected as err:
            return str(err)
        return None

    assert judged(inner_steps=30, tokens=30 * 16 * SEQ_LEN) is None
    assert judged(inner_steps=31, tokens=640) == "implausible_work: 31 inner steps; 1..30"
    too_many = judged(inner_steps=30, tokens=30 * 16 * SEQ_LEN + 1)
    assert too_many is not None and too_many.startswith("implausible_work: 3841 tokens")


def test_diloco_up_passes_the_jobs_h_and_batch_to_the_outer() -> None:
    from services.orchestration.commands import OUTER_OWN
    from services.outer.settings import OuterSettings
    from shared.records.jobs import JobSpec
    from shared.settings.cli import flags_for

    flags = flags_for(JobSpec(job="j", h_steps=12, batch_size=8), OuterSettings, OUTER_OWN)
    assert flags[flags.index("--h-steps") + 1] == "12"
    assert flags[flags.index("--batch-size") + 1] == "8"


def _corrupt_payload() -> PseudoGradEnvelope:
    env = envelope()
    payload = bytearray(env.payload)
    payload[-1] ^= 0xFF
    return dataclasses.replace(env, payload=bytes(payload))


@pytest.mark.parametrize(
    ("reason", "make"),
    [
        ("bad_envelope", lambda: b"\x93not an envelope"),
        ("wrong_kind", params),
        ("wrong_job", lambda: envelope(job="other")),
        ("wrong_model", lambda: envelope(model="small")),
        ("wrong_fragment", lambda: envelope(fragment=1)),
        ("bad_payload", _corrupt_payload),
        ("shape_mismatch", lambda: envelope(tensors=tensors(shapes={"a": (4,), "b": (2, 2)}))),
        ("shape_mismatch", lambda: envelope(tensors=tensors(shapes={"a": (3,)}))),
        # Junk unit ids would grow the books without bound.
        ("unknown_unit", lambda: envelope(unit=MAX_OUTER_UNITS)),
        ("unknown_unit", lambda: envelope(unit=(1 << 63) - 1)),
        # Tokens are the upload's own merge weight and add up in the books (the security review
        # found that 2^63 - 1 of them made the outer fail after each committed checkpoint).
        ("implausible_work", lambda: envelope(tokens=(1 << 63) - 1)),
        ("implausible_work", lambda: envelope(inner_steps=10, tokens=10 * MOST_PER_STEP + 1)),
        ("implausible_work", lambda: envelope(tokens=0)),
        ("implausible_work", lambda: envelope(inner_steps=0)),
        ("implausible_work", lambda: envelope(inner_steps=MAX_STEPS_PER_UPLOAD + 1)),
    ],
)
def test_every_validation_failure_is_rejected_with_its_reason(reason: str, make: Any) -> None:
    made = make()
    with pytest.raises(Rejected) as err:
        if isinstance(made, bytes):
            validate(upload_id(JOB, 0, 0, 0), "s", made, RULES, arrived_at=0.0)
        else:
            check(made)
    assert err.value.reason == reason, err.value


def test_ids_that_disagree_with_the_envelope_are_rejected() -> None:
    env = envelope(unit=1, round=3)
    for upload, subject in (
        (upload_id(JOB, 1, 3, 0), subjects.grads_subject(JOB, 2, 0)),  # another unit's subject
        (upload_id(JOB, 1, 4, 0), subjects.grads_subject(JOB, 1, 0)),  # another round's id
        (upload_id(JOB, 1, 3, 0), subjects.grads_subject(JOB, 1, 1)),  # another fragment's
    ):
        with pytest.raises(Rejected) as err:
            check(env, upload, subject)
        assert err.value.reason == "inconsistent_ids"


def test_an_upload_over_the_size_limit_is_a_bad_envelope() -> None:
    small = dataclasses.replace(RULES, max_upload_bytes=64)
    blob = pack_envelope(envelope())
    upload, subject = upload_id(JOB, 0, 0, 0), subjects.grads_subject(JOB, 0, 0)
    with pytest.raises(Rejected) as err:
        validate(upload, subject, blob, small, arrived_at=0)
    assert err.value.reason == "bad_envelope"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_damaged_upload_is_accepted_or_rejected_never_an_error(data: st.DataObject) -> None:
    blob = bytearray(pack_envelope(envelope()))
    for _ in range(data.draw(st.integers(1, 8))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    upload, subject = upload_id(JOB, 0, 0, 0), subjects.grads_subject(JOB, 0, 0)
    try:
        validate(upload, subject, bytes(blob[:cut]), RULES, arrived_at=0.0)
    except Rejected as rejected:
        assert rejected.reason in {
            "bad_envelope",
            "wrong_kind",
            "wrong_job",
            "wrong_model",
            "inconsistent_ids",
            "wrong_fragment",
            "bad_payload",
            "shape_mismatch",
        }


# ---- intake: chunks, deduplication, dead letters ---------------------------------------------


@dataclasses.dataclass
class Message:
    """What the intake uses of a NATS message."""

    subject: str
    data: bytes
    headers: dict[str, str] | None
    acked: bool = False
    terminated: bool = False

    async def ack(self) -> None:
        self.acked = True

    async def term(self) -> None:
        self.terminated = True


def chunks(
    env: PseudoGradEnvelope, chunk_size: int = 100, upload: str | None = None
) -> list[Message]:
    blob = pack_envelope(env)
    upload = upload or upload_id(JOB, env.unit, env.round, env.fragment)
    parts = split_chunks(blob, chunk_size)
    return [
        Message(
            subjects.grads_subject(JOB, env.unit, 0),
            part,
            chunk_headers(ChunkInfo(upload, i, len(parts), len(blob))),
        )
        for i, part in enumerate(parts)
    ]


@pytest.fixture(scope="module")
def core() -> OuterCore:
    named = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    algorithm = outer_algorithm(
        outer_optimizer="nesterov", staleness_rule="constant", max_staleness=0
    )
    return OuterCore(named, algorithm)


def make_intake(
    core: OuterCore, max_pending_uploads: int = 4, max_pending_bytes: int = 1 << 30
) -> Intake:
    core.import_state(*core.export_state())  # empty buffers, same versions
    return Intake(
        RULES, core, OuterLedger(), DeadLetters(JOB), max_pending_uploads, max_pending_bytes
    )


def take(intake: Intake, messages: list[Message]) -> int:
    return asyncio.run(intake.take(messages))


def test_a_complete_upload_is_offered_and_its_redelivery_acknowledged(core: OuterCore) -> None:
    intake = make_intake(core)
    first = chunks(envelope(base_version=core.version(0)))
    assert len(first) > 2
    assert take(intake, first[:-1]) == 0 and intake.buffered == set()
    assert take(intake, first[-1:]) == 0
    upload = upload_id(JOB, 0, 0, 0)
    assert intake.buffered == {upload} and dict(intake.ledger.codecs) == {"int8": 1}
    assert take(intake, first[:1]) == 0  # a redelivery while buffered waits for the merge
    assert not first[0].acked and intake.buffered == {upload}
    result = core.merge(0)
    assert [a.messages for a in result.arrivals] == [first]
    intake.ledger.merged(result.arrivals, result.staleness)
    intake.merged(result.arrivals)
    assert intake.buffered == set()
    again = chunks(envelope())
    assert take(intake, again) == 0
    assert all(m.acked for m in again) and intake.ledger.deduplicated == len(again)
    assert intake.ledger.applied == 1 and not intake.dead_letters.waiting


def test_every_intake_rejection_is_counted_and_dead_lettered(core: OuterCore) -> None:
    intake = make_intake(core, max_pending_uploads=1)
    version = core.version(0)
    no_headers = Message("s", b"x", None)
    upload = upload_id(JOB, 0, 1, 0)
    info = ChunkInfo(upload, 0, 1, 100)  # says 100 bytes, carries 50
    bad_chunk = Message(subjects.grads_subject(JOB, 0, 0), b"x" * 50, chunk_headers(info))
    evicted = chunks(envelope(unit=1, round=2, base_version=version))
    evicting = chunks(envelope(unit=2, round=3, base_version=version))
    wrong_model = chunks(envelope(unit=3, round=4, base_version=version, model="small"))
    future = chunks(envelope(unit=4, round=5, base_version=version + 1))
    # One incomplete upload is kept: the first chunk of each next one evicts the one before.
    messages = [no_headers, bad_chunk, evicted[0], evicting[0], *wrong_model, *future]
    assert take(intake, messages) == 6
    assert dict(intake.ledger.rejected) == {
        "bad_chunk_header": 1,
        "bad_chunk": 1,
        "incomplete_upload": 2,
        "wrong_model": 1,
        "future_base_version": 1,
    }
    assert intake.ledger.to_record().rejected_rounds == {
        unit: [(round_, round_)] for unit, round_ in ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))
    }
    # ... and under each unit, so that an operator sees which unit misbehaves.
    assert {u: stats.rejected for u, stats in intake.ledger.units.items()} == {
        0: {"bad_chunk": 1},
        1: {"incomplete_upload": 1},
        2: {"incomplete_upload": 1},
        3: {"wrong_model": 1},
        4: {"future_base_version": 1},
    }
    assert intake.buffered == set() and intake.ledger.codecs == {}
    queued = [m for messages, _ in intake.dead_letters.waiting for m in messages]
    assert len(queued) == 1 + 1 + 1 + 1 + len(wrong_model) + len(future)
    assert take(intake, [bad_chunk]) == 0  # a redelivered chunk of an upload rejected before
    assert intake.dead_letters.waiting[-1] == ([bad_chunk], "chunk of an upload rejected earlier")


class PublishingJetStream:
    """Records dead-letter copies; the first ``failures`` publishes time out."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.published: list[tuple[str, bytes, dict[str, str]]] = []

    async def publish(self, subject: str, data: bytes, headers: dict, timeout: float) -> None:
        if self.failures:
            self.failures -= 1
            raise TimeoutError("no answer")
        self.published.append((subject, data, headers))


def test_dead_letters_are_copied_with_the_reason_before_they_are_terminated() -> None:
    letters = DeadLetters(JOB)
    first, second = Message("s.0", b"a", {"Nats-Msg-Id": "m0"}), Message("s.1", b"b", None)
    letters.add([first], "bad_envelope: junk")
    letters.add([second], "wrong_job: other")
    js = PublishingJetStream(failures=1)
    asyncio.run(letters.flush(js))
    assert not first.terminated and len(letters.waiting) == 2  # kept for the next flush
    asyncio.run(letters.flush(js))
    assert first.terminated and second.terminated and letters.waiting == []
    dead = subjects.dead_letter_subject(JOB)
    assert [(s, d) for s, d, _ in js.published] == [(dead, b"a"), (dead, b"b")]
    assert js.published[0][2][HEADER_REASON] == "bad_envelope: junk"
    assert js.published[0][2]["Nats-Msg-Id"] == "dead:m0"


def test_an_old_round_or_a_copied_payload_is_a_replay_and_skipped_rounds_are_counted(
    core: OuterCore,
) -> None:
    intake = make_intake(core)
    version = core.version(0)
    first = chunks(envelope(unit=0, round=3, base_version=version, tensors=tensors(0.01)))
    assert take(intake, first) == 0 and intake.ledger.codecs == {"int8": 1}
    # Rounds 4-6 skipped (dropped from a full queue, say): counted, not rejected.
    later = chunks(envelope(unit=0, round=7, base_version=version, tensors=tensors(0.02)))
    assert take(intake, later) == 0
    assert intake.ledger.units[0].skipped_rounds == 3
    # An old round of the same unit under a new message id: a replay, whatever its payload.
    old = chunks(envelope(unit=0, round=5, base_version=version, tensors=tensors(0.03)))
    # The payload of round 7 again, as unit 0's round 8 or as unit 1's round 0.
    copied = chunks(envelope(unit=0, round=8, base_version=version, tensors=tensors(0.02)))
    stolen = chunks(envelope(unit=1, round=0, base_version=version, tensors=tensors(0.02)))
    assert take(intake, [*old, *copied, *stolen]) == 3
    assert dict(intake.ledger.rejected) == {"round_replayed": 1, "payload_replayed": 2}
    assert intake.ledger.units[0].rejected == {"round_replayed": 1, "payload_replayed": 1}
    assert intake.ledger.units[1].rejected == {"payload_replayed": 1}
    # Round 8 was rejected: the unit's next upload must come after it.
    assert intake.order.newest(0) == 8
    fresh = chunks(envelope(unit=0, round=9, base_version=version, tensors=tensors(0.04)))
    assert take(intake, fresh) == 0 and intake.ledger.codecs == {"int8": 3}
    assert intake.ledger.units[0].skipped_rounds == 3


def test_after_a_restart_the_books_give_each_units_newest_round(core: OuterCore) -> None:
    core.import_state(*core.export_state())  # empty buffers, same versions
    ledger = OuterLedger()
    ledger.reject("too_stale", (0, 12))  # as restored from a checkpoint
    intake = Intake(RULES, core, ledger, DeadLetters(JOB), 4, 1 << 30)
    assert intake.order.newest(0) == 12 and intake.order.newest(1) == -1
    replay = chunks(envelope(unit=0, round=11, base_version=core.version(0)))
    assert take(intake, replay) == 1 and ledger.rejected["round_replayed"] == 1


def test_the_fingerprints_of_merged_uploads_survive_a_restart_and_buffered_ones_do_not(
    core: OuterCore,
) -> None:
    """A restarted outer remembers the payloads it merged (its checkpoint holds their
    fingerprints), so a copy is still a replay; an upload it had only buffered is delivered
    again after the restart and is taken, not mistaken for its own replay."""
    from services.outer import checkpoint

    intake = make_intake(core)
    version = core.version(0)
    merged = chunks(envelope(unit=0, round=0, base_version=version, tensors=tensors(0.01)))
    buffered = chunks(envelope(unit=1, round=0, base_version=version, tensors=tensors(0.02)))
    assert take(intake, [*merged, *buffered]) == 0
    first = next(a for a in core.fragments[0].policy.take() if a.unit == 0)
    intake.merged([first])
    snapshot = checkpoint.loads(
        checkpoint.dumps(
            checkpoint.OuterSnapshot(
                "j", "tiny", *core.export_state(), fingerprints=intake.order.history()
            )
        )
    )
    assert len(snapshot.fingerprints) == 1
    # The restarted outer: its books say unit 0's round 0 was applied.
    ledger = OuterLedger()
    ledger.merged([first], [0])
    restarted = Intake(RULES, core, ledger, DeadLetters(JOB), 4, 1 << 30)
    restarted.order.restore(snapshot.fingerprints)
    core.import_state(*core.export_state())  # empty buffers
    again = chunks(envelope(unit=1, round=0, base_version=version, tensors=tensors(0.02)))
    copy = chunks(envelope(unit=2, round=0, base_version=version, tensors=tensors(0.01)))
    assert take(restarted, [*again, *copy]) == 1
    assert dict(ledger.rejected) == {"payload_replayed": 1}
    assert ledger.units[2].rejected == {"payload_replayed": 1}


def test_zero_updates_of_several_units_are_not_taken_for_replays(core: OuterCore) -> None:
    """An inner step at learning rate 0 (the first of a warm-up; a whole period with
    ``--h-steps 1``) moves nothing: every unit sends the same zero update, and each is taken."""
    intake = make_intake(core)
    version = core.version(0)
    zeros = [
        chunks(envelope(unit=unit, round=0, base_version=version, tensors=tensors(0.0)))
        for unit in range(3)
    ]
    assert take(intake, [m for messages in zeros for m in messages]) == 0
    assert intake.ledger.codecs == {"int8": 3} and not intake.ledger.rejected


def test_uploads_of_128_units_interleaved_chunk_by_chunk_all_complete_by_default() -> None:
    """Under the outer's default limits every unit of a 128-unit job can be mid-upload at once
    (the load test's 128 units lost uploads as ``incomplete_upload`` when 64 were held)."""
    from services.outer.settings import OuterSettings

    fields = OuterSettings.model_fields
    named = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    fresh = OuterCore(named, outer_algorithm(128))
    intake = Intake(
        RULES,
        fresh,
        OuterLedger(),
        DeadLetters(JOB),
        fields["max_pending_uploads"].default,
        fields["max_pending_bytes"].default,
    )
    uploads = [
        chunks(envelope(unit=u, base_version=fresh.version(0), tensors=tensors(1e-4 * (u + 1))), 64)
        for u in range(128)
    ]
    assert min(len(parts) for parts in uploads) >= 2
    interleaved = [m for layer in itertools.zip_longest(*uploads) for m in layer if m]
    assert take(intake, interleaved) == 0
    assert len(intake.buffered) == 128 and intake.reassembler.evicted == 0


def test_a_chunk_naming_another_unit_s_upload_is_refused_alone(core: OuterCore) -> None:
    """Unit 1 sends a chunk that fits unit 0's upload, under its id: the chunk is rejected as
    ``inconsistent_ids`` before it joins (or could evict) that upload, which completes."""
    intake = make_intake(core)
    honest = chunks(envelope(unit=0, round=7, base_version=core.version(0)))
    forged = dataclasses.replace(honest[1], subject=subjects.grads_subject(JOB, 1, 0))
    forged.data = b"\xff" * len(forged.data)
    assert take(intake, [honest[0], forged, *honest[1:]]) == 1
    assert dict(intake.ledger.rejected) == {"inconsistent_ids": 1}
    assert intake.buffered == {upload_id(JOB, 0, 7, 0)}


def test_an_upload_held_for_peers_and_then_rejected_is_counted_and_dead_lettered() -> None:
    named = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    reviewing = OuterCore(named, outer_algorithm(4, peer_review=True))
    intake = Intake(RULES, reviewing, OuterLedger(), DeadLetters(JOB), 4, 1 << 30)

    def agreeing(own: float) -> dict[str, np.ndarray]:
        return {
            "a": np.array([1e-3, 2e-3, own], np.float32),
            "b": np.full((2, 2), 1e-3, np.float32),
        }

    against = {name: -value for name, value in agreeing(1e-3).items()}
    hostile = chunks(envelope(unit=0, round=0, tensors=against))
    assert take(intake, hostile) == 0  # no peers yet: held, unjudged
    assert take(intake, chunks(envelope(unit=1, round=0, tensors=agreeing(1e-3)))) == 0
    assert take(intake, chunks(envelope(unit=2, round=0, tensors=agreeing(2e-3)))) == 0
    # The third had peers, and waits behind the first two to be merged in order.
    assert len(intake.buffered) == 3 and reviewing.held() == 3
    assert reviewing.settle(time.monotonic()) == []  # unit 0 disagrees: a second opinion
    assert reviewing.held() == 1
    assert take(intake, chunks(envelope(unit=1, round=1, tensors=agreeing(3e-3)))) == 0
    assert take(intake, chunks(envelope(unit=2, round=1, tensors=agreeing(4e-3)))) == 0
    for arrival, rejected in reviewing.settle(time.monotonic()):
        intake.reject_held(arrival, rejected)
    assert dict(intake.ledger.rejected) == {"direction_outlier": 1}
    assert intake.ledger.units[0].rejected == {"direction_outlier": 1}
    assert intake.ledger.is_done(0, 0) == "rejected"
    assert upload_id(JOB, 0, 0, 0) not in intake.buffered and len(intake.buffered) == 4
    assert [messages for messages, _ in intake.dead_letters.waiting] == [hostile]
    assert reviewing.held() == 0 and reviewing.due(time.monotonic()) == [0]


def test_an_upload_of_a_quarantined_unit_is_refused_and_counted(core: OuterCore) -> None:
    intake = make_intake(core)
    intake.quarantined.add(3)
    assert take(intake, chunks(envelope(unit=3, round=7, base_version=core.version(0)))) == 1
    assert dict(intake.ledger.rejected) == {"quarantined": 1}
    assert intake.ledger.units[3].rejected == {"quarantined": 1}
    assert intake.ledger.is_done(3, 7) == "rejected" and intake.buffered == set()
