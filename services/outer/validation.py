"""Validation of one complete upload: its envelope in, a validated arrival or a rejection out.

An upload is accepted only if every check passes; the first that fails names the reason it is
counted under (``OuterLedger.rejected``) and copied to the dead-letter subject with:

* ``bad_envelope``: not a wire envelope (``shared.wire.envelope``; its codec description
  included), or larger than allowed;
* ``wrong_kind``: not a pseudo-gradient;
* ``wrong_job``, ``wrong_model``: meant for another job, or computed on another model size;
* ``inconsistent_ids``: the subject or the upload id names another unit, round or fragment
  than the envelope does;
* ``wrong_fragment``: a fragment this job does not have;
* ``unknown_unit``: a unit number no job has (``MAX_OUTER_UNITS`` or more), so that junk ids
  cannot grow the books without bound;
* ``implausible_work``: inner steps outside 1..the job's H (the outer's ``--h-steps``), or
  tokens outside 1..steps × the most tokens a step can have (the job's ``--batch-size`` × the
  model's context length): a unit cannot claim more work than one sync period of the job
  holds. An upload's tokens are its own
  merge weight and add up in the books;
* ``bad_payload``: tensors the codec cannot decode within the size limits (the codec also
  refuses NaN and Inf, see ``shared.codec.api.decode_tensors``);
* ``shape_mismatch``: other pieces or shapes than the fragment's.

Staleness is judged by the core when the arrival is offered (``OuterCore.offer``). Nothing
here does I/O: the caller passes the bytes, the subject they came on and the messages that
carried them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.outer.errors import Rejected
from services.outer.order import fingerprint
from services.outer.policy import Arrival
from shared import subjects
from shared.codec import api as codec
from shared.codec.config import CodecError
from shared.records import MAX_BATCH_SIZE, MAX_OUTER_UNITS, MAX_STEPS_PER_UPLOAD
from shared.wire.chunks import WireError, upload_id
from shared.wire.envelope import PseudoGradEnvelope, unpack_envelope

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class UploadRules:
    """What a valid upload of one job looks like.

    Attributes:
        job, model: The job and its model size.
        piece_shapes: Per fragment, ``{piece name: shape}``.
        max_upload_bytes: Largest envelope accepted.
        max_tensor_bytes: Largest decoded (float32) or uncompressed payload accepted.
        seq_len: The model's context length (tokens per sequence).
        decode_threads: Threads decoding a large payload (``shared.codec.api.decode_tensors``).
        max_steps: Most inner steps one upload can stand for: the job's H, or what any job
            allows.
        batch_size: Most sequences per inner step: the job's batch size, or what any job
            allows.
    """

    job: str
    model: str
    piece_shapes: Sequence[Shapes]
    max_upload_bytes: int
    max_tensor_bytes: int
    seq_len: int
    decode_threads: int = 0
    max_steps: int = MAX_STEPS_PER_UPLOAD
    batch_size: int = MAX_BATCH_SIZE

    @property
    def max_tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class Validated:
    """An upload that passed validation.

    Attributes:
        fragment: The fragment it updates.
        arrival: What the core buffers and merges.
        codec: The codec its payload was encoded with.
        payload_bytes: Its compressed size.
        fingerprint: The XXH3-64 of its payload (``order.py``).
    """

    fragment: int
    arrival: Arrival
    codec: str
    payload_bytes: int
    fingerprint: int


def validate(
    upload: str,
    subject: str,
    blob: bytes | memoryview,
    rules: UploadRules,
    *,
    arrived_at: float,
    messages: Any = None,
) -> Validated:
    """Check one reassembled upload and decode its pseudo-gradient.

    Args:
        upload: The upload id its chunks carried.
        subject: The subject its chunks came on.
        blob: The reassembled envelope.
        rules: What a valid upload of the job looks like.
        arrived_at: When it arrived (the merge policy's clock).
        messages: The transport's handles of its messages, kept in the arrival.

    Returns:
        The fragment and the arrival to offer to the core, with what the books count.

    Raises:
        Rejected: with the reason the module docstring lists.
    """
    try:
        envelope = unpack_envelope(blob, max_size=rules.max_upload_bytes)
    except WireError as err:
        raise Rejected("bad_envelope", str(err)) from err
    if not isinstance(envelope, PseudoGradEnvelope):
        raise Rejected("wrong_kind", f"expected pseudo_grad, got {envelope.kind!r}")
    if envelope.job != rules.job:
        raise Rejected("wrong_job", f"expected job {rules.job!r}, got {envelope.job!r}")
    if envelope.model != rules.model:
        raise Rejected("wrong_model", f"expected model {rules.model!r}, got {envelope.model!r}")
    named = upload_id(rules.job, envelope.unit, envelope.round, envelope.fragment)
    if subject != subjects.grads_subject(rules.job, envelope.unit, envelope.fragment) or (
        upload != named
    ):
        raise Rejected("inconsistent_ids", f"{upload} on {subject} says unit {envelope.unit}")
    count = len(rules.piece_shapes)
    if not 0 <= envelope.fragment < count:
        raise Rejected("wrong_fragment", f"fragment {envelope.fragment} of {count}")
    if envelope.unit >= MAX_OUTER_UNITS:
        raise Rejected("unknown_unit", f"unit {envelope.unit}; units are 0..{MAX_OUTER_UNITS - 1}")
    steps, tokens = envelope.inner_steps, envelope.tokens
    if not 1 <= steps <= rules.max_steps:
        raise Rejected("implausible_work", f"{steps} inner steps; 1..{rules.max_steps}")
    if not 1 <= tokens <= steps * rules.max_tokens_per_step:
        raise Rejected(
            "implausible_work",
            f"{tokens} tokens in {steps} steps of at most {rules.max_tokens_per_step} tokens",
        )
    try:
        tensors = codec.decode_tensors(
            envelope.payload,
            envelope.codec,
            max_raw_size=rules.max_tensor_bytes,
            threads=rules.decode_threads,
            max_output_bytes=rules.max_tensor_bytes,
        )
    except CodecError as err:
        raise Rejected("bad_payload", str(err)) from err
    expected = rules.piece_shapes[envelope.fragment]
    shapes = {name: tensor.shape for name, tensor in tensors.items()}
    if shapes != expected:
        raise Rejected(
            "shape_mismatch",
            f"fragment {envelope.fragment}: expected {len(expected)} pieces with the model's "
            f"shapes, got {sorted(shapes)[:3]}...",
        )
    arrival = Arrival(
        unit=envelope.unit,
        round=envelope.round,
        base_version=envelope.base_version,
        inner_steps=envelope.inner_steps,
        tokens=envelope.tokens,
        pseudo_grad=tensors,
        arrived_at=arrived_at,
        upload=upload,
        train_loss=float(envelope.train_loss),
        messages=messages,
    )
    return Validated(
        envelope.fragment,
        arrival,
        envelope.codec.codec,
        len(envelope.payload),
        fingerprint(envelope.payload),
    )
