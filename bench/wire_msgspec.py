"""msgspec against the hand-written envelope parser: decode speed, and hostile input.

One pseudo-gradient upload of the ``small`` and ``medium`` model (one fragment, int8, block
256, zstd 1, Gaussian values: the envelope's shape does not depend on them), packed by
``shared.wire.envelope.pack_envelope``, is decoded

* by the project: ``unpack_envelope`` (fields measured before they are built, each checked,
  the description parsed, the payload a view of the input and checked against its checksum);
* by msgspec: one ``msgspec.msgpack.Decoder`` of typed ``Struct`` s with ``Meta`` bounds on
  every field (the same envelope map), plus the payload checksum. The semantic checks of
  ``Description.parse`` (sorted names, raw size, frame count) are not in it, so it does less.

Best of 7 × 200 calls each, in µs. Then the hostile case that decides safety: a map whose
``job`` is a string of 64 MiB (inside ``max_size``) with one 4-byte UTF-8 character, and the
memory each decoder allocates before it rejects it (``tracemalloc`` peak).

    .venv/bin/pip install msgspec   # the `bench` extra
    .venv/bin/python bench/wire_msgspec.py
"""

from __future__ import annotations

import sys
import timeit
import tracemalloc
from typing import Annotated, Literal

import msgpack
import msgspec
import numpy as np
from codec_routes import model_layout  # bench/codec_routes.py
from msgspec import Meta, Struct

from shared.codec import api as codec
from shared.codec.config import CodecConfig
from shared.wire.chunks import WireError
from shared.wire.envelope import (
    PseudoGradEnvelope,
    pack_envelope,
    payload_checksum,
    unpack_envelope,
)

Counter = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, Meta(max_length=1024)]
Shape = Annotated[tuple[Annotated[int, Meta(ge=0)], ...], Meta(max_length=32)]
Bounded = Meta(max_length=1 << 16)


class DescriptionStruct(Struct, frozen=True, forbid_unknown_fields=True):
    version: Literal[1]
    codec: Literal["fp32", "bf16", "int8", "int4", "int2"]
    bits: Literal[32, 16, 8, 4, 2]
    block_size: Annotated[int, Meta(ge=16, le=1 << 20, multiple_of=16)]
    segment: Annotated[int, Meta(ge=1, le=1 << 26)]
    zstd_level: Annotated[int, Meta(ge=-(1 << 17), le=22)]
    raw_size: Annotated[int, Meta(ge=0, le=1 << 62)]
    frames: Annotated[list[Annotated[int, Meta(gt=0)]], Bounded]
    checksums: Annotated[list[Annotated[int, Meta(ge=0)]], Bounded]
    tensors: Annotated[list[tuple[Name, Shape, Literal["float32"]]], Bounded]


class PseudoGradStruct(Struct, frozen=True, forbid_unknown_fields=True):
    v: Literal[2]
    kind: Literal["pseudo_grad"]
    job: Annotated[str, Meta(max_length=64, pattern="^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")]
    model: Annotated[str, Meta(max_length=128)]
    unit: Counter
    round: Counter
    fragment: Counter
    base_version: Counter
    inner_steps: Counter
    tokens: Counter
    train_loss: float
    codec: DescriptionStruct
    sent_at: Annotated[float, Meta(ge=0)]
    checksum: Annotated[int, Meta(ge=0)]
    payload: memoryview


DECODER = msgspec.msgpack.Decoder(PseudoGradStruct)


def msgspec_unpack(blob: bytes) -> PseudoGradStruct:
    env = DECODER.decode(blob)
    if payload_checksum(env.payload) != env.checksum:
        raise ValueError("checksum")
    return env


def envelope_of(model: str) -> bytes:
    layout = model_layout(model)
    values = np.random.default_rng(0).standard_normal(layout.size).astype(np.float32) * 1e-3
    payload, description, _ = codec.encode_flat(values, layout, CodecConfig("int8"))
    return pack_envelope(
        PseudoGradEnvelope(
            job="job",
            model=model,
            unit=1,
            round=2,
            fragment=0,
            base_version=3,
            inner_steps=10,
            tokens=640,
            train_loss=2.5,
            codec=description,
            sent_at=1.7e9,
            payload=payload,
        )  # fmt: skip
    )


def best_us(function, blob: bytes) -> float:
    return min(timeit.repeat(lambda: function(blob), number=200, repeat=7)) / 200 * 1e6


def peak_bytes(function, blob: bytes) -> tuple[int, str]:
    tracemalloc.start()
    try:
        function(blob)
        outcome = "accepted"
    except (WireError, msgspec.ValidationError, ValueError) as err:
        outcome = f"rejected ({type(err).__name__})"
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, outcome


def main() -> None:
    print("| upload | envelope bytes | `unpack_envelope` µs | msgspec + checksum µs | ratio |")
    print("|---|---|---|---|---|")
    for model in ("small", "medium"):
        blob = envelope_of(model)
        assert msgspec_unpack(blob).tokens == unpack_envelope(blob).tokens
        ours, theirs = best_us(unpack_envelope, blob), best_us(msgspec_unpack, blob)
        print(
            f"| {model} int8 | {len(blob):,} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.1f}× |"
        )
    body = msgpack.unpackb(envelope_of("small"), raw=False)
    body["job"] = "j" * (64 << 20) + "\U0001f600"
    hostile = msgpack.packb(body, use_bin_type=True)
    print(f"\nhostile: a {len(hostile) >> 20} MiB envelope whose job is 64 MiB + one emoji")
    for name, function in (("unpack_envelope", unpack_envelope), ("msgspec", msgspec_unpack)):
        peak, outcome = peak_bytes(function, hostile)
        print(f"- {name}: {outcome}, peak allocation {peak / (1 << 20):.1f} MiB")


if __name__ == "__main__":
    sys.exit(main())
