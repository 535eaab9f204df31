"""Tests for shared.wire: envelope validation (both kinds), chunk headers and reassembly."""

from __future__ import annotations

import dataclasses
import math
import random
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.codec.api import decode_tensors, encode_tensors
from shared.wire.chunks import (
    ChunkInfo,
    Reassembler,
    WireError,
    chunk_headers,
    parse_chunk_headers,
    split_chunks,
    upload_id,
    validate_job_name,
)
from shared.wire.envelope import (
    WIRE_VERSION,
    Envelope,
    ParamsEnvelope,
    PseudoGradEnvelope,
    pack_envelope,
    payload_checksum,
    unpack_envelope,
)

SETTINGS = settings(max_examples=100, deadline=None)


def make_envelope(**changes: object) -> PseudoGradEnvelope:
    payload, description = encode_tensors({"w": np.linspace(-1, 1, 600).reshape(20, 30)}, "int8")
    fields = {
        "job": "job-1",
        "unit": 3,
        "round": 17,
        "fragment": 0,
        "base_version": 12,
        "inner_steps": 50,
        "tokens": 204_800,
        "train_loss": 3.25,
        "codec": description,
        "sent_at": 1_700_000_000.5,
        "payload": payload,
        "model": "tiny",
    }
    fields.update(changes)
    return PseudoGradEnvelope(**fields)  # type: ignore[arg-type]


def make_params(**changes: object) -> ParamsEnvelope:
    payload, description = encode_tensors({"w": np.linspace(-1, 1, 600).reshape(20, 30)}, "fp32")
    fields = {
        "job": "job-1",
        "model": "tiny",
        "fragment": 1,
        "version": 9,
        "tokens": 204_800,
        "codec": description,
        "sent_at": 1_700_000_000.5,
        "payload": payload,
    }
    fields.update(changes)
    return ParamsEnvelope(**fields)  # type: ignore[arg-type]


def packed_map(envelope: Envelope | None = None, **changes: object) -> dict:
    """The msgpack map of a valid envelope (by default ``make_envelope()``), with fields
    replaced (or removed via ...)."""
    body = msgpack.unpackb(pack_envelope(envelope or make_envelope()), raw=False)
    for key, value in changes.items():
        if value is ...:
            del body[key]
        else:
            body[key] = value
    return body


def repack(envelope: Envelope | None = None, **changes: object) -> bytes:
    return msgpack.packb(packed_map(envelope, **changes), use_bin_type=True)


# --------------------------------------------------------------------------- envelope


def test_round_trip_and_payload_decodes() -> None:
    env = make_envelope()
    data = pack_envelope(env)
    out = unpack_envelope(data)
    assert out == env
    body = msgpack.unpackb(data, raw=False)
    assert body["v"] == WIRE_VERSION and body["checksum"] == payload_checksum(env.payload)
    assert body["kind"] == "pseudo_grad" and body["codec"] == env.codec.to_wire()
    decoded = decode_tensors(out.payload, out.codec)
    assert decoded["w"].shape == (20, 30)


def test_memoryview_payload_packs_like_bytes() -> None:
    """The codec hands over a read-only memoryview; it goes on the wire as the same bin."""
    view = make_envelope()
    assert isinstance(view.payload, memoryview)
    env = dataclasses.replace(view, payload=bytes(view.payload))
    assert pack_envelope(view) == pack_envelope(env)
    assert unpack_envelope(pack_envelope(view)).payload == env.payload
    with pytest.raises(WireError, match="contiguous"):
        pack_envelope(dataclasses.replace(env, payload=memoryview(env.payload * 2)[::2]))
    with pytest.raises(WireError, match="contiguous"):
        pack_envelope(dataclasses.replace(env, payload=memoryview(np.zeros(4, np.float32))))


def test_params_envelope_round_trip_and_model_is_required() -> None:
    env = make_params(model="")
    out = unpack_envelope(pack_envelope(env))
    assert out == env and isinstance(out, ParamsEnvelope)
    assert msgpack.unpackb(pack_envelope(env), raw=False)["kind"] == "params"
    assert decode_tensors(out.payload, out.codec)["w"].shape == (20, 30)
    for envelope in (make_params(), make_envelope()):
        with pytest.raises(WireError, match=r"missing \['model'\]"):
            unpack_envelope(repack(envelope, model=...))


def test_numpy_scalars_and_non_finite_loss_are_accepted() -> None:
    env = make_envelope(tokens=np.int64(5), train_loss=np.float32(1.5), sent_at=np.float64(2.0))
    out = unpack_envelope(pack_envelope(env))
    assert (out.tokens, out.train_loss, out.sent_at) == (5, 1.5, 2.0)
    assert type(out.tokens) is int and type(out.train_loss) is float
    # A diverged unit reports its loss; the payload check is the codec's job.
    assert math.isnan(unpack_envelope(pack_envelope(make_envelope(train_loss=math.nan))).train_loss)
    assert unpack_envelope(repack(train_loss=2)).train_loss == 2.0


DESCRIPTION = encode_tensors({"b": np.ones(3), "a": np.ones((2, 40))}, "int4")[1]


@SETTINGS
@given(
    kind_unit=st.sampled_from([("pseudo_grad", 0), ("pseudo_grad", 2**40), ("params", -1)]),
    counters=st.tuples(*[st.integers(0, 2**63 - 1)] * 5),
    loss=st.floats(allow_nan=False),
    sent_at=st.floats(0, 2e9),
    payload=st.binary(max_size=300),
    job=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", fullmatch=True),
    model=st.text(max_size=20),
)
def test_round_trip_property(kind_unit, counters, loss, sent_at, payload, job, model) -> None:
    kind, unit = kind_unit
    round_, fragment, base, steps, tokens = counters
    description = DESCRIPTION
    if kind == "params":
        env: Envelope = ParamsEnvelope(
            job=job, model=model, fragment=fragment, version=round_, tokens=tokens,
            codec=description, sent_at=sent_at, payload=payload,
        )  # fmt: skip
    else:
        env = PseudoGradEnvelope(
            job=job, model=model, unit=unit, round=round_, fragment=fragment, base_version=base,
            inner_steps=steps, tokens=tokens, train_loss=loss, codec=description,
            sent_at=sent_at, payload=payload,
        )  # fmt: skip
    assert unpack_envelope(pack_envelope(env)) == env


BAD_FIELDS = [
    ("kind", "gradient"),
    ("kind", 1),
    ("job", "bad job"),
    ("job", "-leading-dash"),
    ("job", "x" * 65),
    ("job", "job\n"),
    ("job", ""),
    ("job", b"job"),
    ("unit", -1),  # pseudo_grad needs a real unit
    ("unit", "3"),
    ("unit", 1.0),
    ("unit", True),
    ("round", -1),
    ("fragment", -5),
    ("base_version", -1),
    ("inner_steps", None),
    ("tokens", -1),
    ("tokens", 2.5),
    ("train_loss", "low"),
    ("train_loss", None),
    ("sent_at", -1.0),
    ("sent_at", math.inf),
    ("sent_at", math.nan),
    ("codec", [1, 2]),
    ("codec", "int8"),
    ("payload", "text"),
    ("payload", 5),
    ("model", 3),
    ("model", "m" * 200),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_unpack_rejects_bad_field(field: str, value: object) -> None:
    changes = {field: value}
    if field == "payload" and isinstance(value, bytes | str):
        changes["checksum"] = payload_checksum(value.encode())  # type: ignore[union-attr]
    with pytest.raises(WireError, match=field if field != "job" else "job name"):
        unpack_envelope(repack(**changes))


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, v in BAD_FIELDS if f != "kind"])
def test_pack_rejects_bad_field(field: str, value: object) -> None:
    with pytest.raises(WireError):
        pack_envelope(make_envelope(**{field: value}))


@pytest.mark.parametrize(
    ("field", "value"),
    [("version", -1), ("fragment", "1"), ("tokens", True), ("sent_at", math.nan), ("job", "a b")],
)
def test_params_unpack_and_pack_reject_bad_field(field: str, value: object) -> None:
    with pytest.raises(WireError, match=field if field != "job" else "job name"):
        unpack_envelope(repack(make_params(), **{field: value}))
    with pytest.raises(WireError):
        pack_envelope(make_params(**{field: value}))


def test_each_kind_carries_only_its_own_fields() -> None:
    # Params come from the outer: no unit, round, base version, steps or loss.
    with pytest.raises(WireError, match=r"unknown \['unit'\]"):
        unpack_envelope(repack(make_params(), unit=-1))
    with pytest.raises(WireError, match=r"missing \['version'\], unknown \['base_version'"):
        unpack_envelope(repack(kind="params"))
    with pytest.raises(WireError, match=r"missing \['base_version', 'inner_steps', 'round', "):
        unpack_envelope(repack(make_params(), kind="pseudo_grad"))


@pytest.mark.parametrize("field", ["kind", "job", "unit", "payload", "codec", "checksum"])
def test_unpack_rejects_missing_field(field: str) -> None:
    with pytest.raises(WireError, match=rf"missing \['{field}'\]"):
        unpack_envelope(repack(**{field: ...}))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"v": ...}, "no wire version"),
        ({"v": 1}, "unsupported wire version 1; expected 2 .are all services on the same"),
        ({"v": 3}, "unsupported wire version 3"),
        ({"v": "1"}, "unsupported wire version '1'"),
        ({"v": 0}, "unsupported wire version 0"),
        ({"extra": 1}, r"unknown \['extra'\]"),
        ({"checksum": 0}, "checksum mismatch"),
        ({"checksum": "abc"}, "checksum mismatch"),
        ({"codec": {1: 2}}, "keys must be str|codec"),
        ({"codec": {"k": list(range(70_000))}}, "codec"),
        ({"job": "j" * 5000}, "job"),
    ],
)
def test_unpack_rejects_bad_envelope(changes: dict, match: str) -> None:
    body = packed_map(**changes)
    data = msgpack.packb(body, use_bin_type=True, strict_types=False)
    with pytest.raises(WireError, match=match):
        unpack_envelope(data)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not a msgpack map"),
        (b"\xc1", "not a msgpack map"),
        (msgpack.packb([1, 2, 3]), "not a msgpack map"),
        (msgpack.packb("text"), "not a msgpack map"),
        (msgpack.packb({1: 2}), "keys must be str"),
        (msgpack.packb({"v": 1}) + b"\x00", "trailing"),
        (b"\x81\xa1v", "truncated"),
        (b"\x81\xa1v\xc6\xff\xff\xff\xff", "truncated"),  # bin header claiming 4 GiB
        (b"\x81\xa1v\xc6\xff", "truncated"),
        (b"\xdf\x00", "truncated"),
        (b"\x81" + b"\x91" * 5000 + b"\x00", "key #0 is truncated or longer than 64"),
        (b"\x81\xa5codec" + b"\x91" * 5000 + b"\x00", "'codec' is not valid msgpack"),
        (msgpack.packb({str(i): i for i in range(40)}), "at most 32"),
    ],
)
def test_unpack_rejects_garbage(data: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        unpack_envelope(data)


def test_unpack_rejects_duplicate_keys() -> None:
    good = msgpack.unpackb(pack_envelope(make_envelope()), raw=False)
    # msgpack cannot write duplicate keys from a dict, so build the map by hand.
    parts = [msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in good.items()]
    parts.append(msgpack.packb("unit") + msgpack.packb(4))
    data = b"\xde" + struct.pack(">H", len(parts)) + b"".join(parts)
    with pytest.raises(WireError, match="duplicate field 'unit'"):
        unpack_envelope(data)


def test_unpack_size_limits() -> None:
    data = pack_envelope(make_envelope())
    assert unpack_envelope(data, max_size=len(data)).round == 17
    with pytest.raises(WireError, match="at most"):
        unpack_envelope(data, max_size=len(data) - 1)
    # A non-payload field stuffed with many tiny objects is refused before it is built.
    with pytest.raises(WireError, match="'codec' is .* bytes"):
        unpack_envelope(repack(codec={f"k{i}": [[]] * 60_000 for i in range(20)}))
    with pytest.raises(WireError, match="must be contiguous bytes"):
        unpack_envelope("text")  # type: ignore[arg-type]


def test_checksum_catches_flipped_payload_byte() -> None:
    env = make_envelope()
    data = bytearray(pack_envelope(env))
    start = bytes(data).index(env.payload)
    for offset in (0, len(env.payload) // 2, len(env.payload) - 1):
        flipped = bytearray(data)
        flipped[start + offset] ^= 0x40
        with pytest.raises(WireError, match="checksum mismatch"):
            unpack_envelope(bytes(flipped))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        unpack_envelope(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_envelope_raises_wire_error_or_is_valid(data: st.DataObject) -> None:
    blob = bytearray(pack_envelope(make_envelope(payload=b"p" * 40)))
    for _ in range(data.draw(st.integers(1, 3))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    try:
        env = unpack_envelope(bytes(blob))
    except WireError:
        return
    assert isinstance(env, Envelope)
    assert payload_checksum(env.payload) == msgpack.unpackb(bytes(blob), raw=False)["checksum"]


# --------------------------------------------------------------------------- names and ids


def test_validate_job_name() -> None:
    for good in ("a", "job-1", "A_b-C", "0" * 64):
        assert validate_job_name(good) == good
    for bad in ("", "-a", "_a", "a b", "a.b", "a/b", "a" * 65, "job\n", "é", None, 3):
        with pytest.raises(WireError, match="job name"):
            validate_job_name(bad)  # type: ignore[arg-type]


def test_upload_id() -> None:
    assert upload_id("job", 3, 17, 0) == "job.u3.r17.f0"
    assert upload_id("job", -1, 5, 2) == "job.u-1.r5.f2"
    for args in (("bad job", 0, 0, 0), ("j", -2, 0, 0), ("j", 0, -1, 0), ("j", 0, 0, 1.5)):
        with pytest.raises(WireError):
            upload_id(*args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- chunk headers


def test_chunk_headers_round_trip() -> None:
    info = ChunkInfo("job.u3.r17.f0", 2, 5, 4_000_000)
    headers = chunk_headers(info)
    assert headers == {
        "Nats-Msg-Id": "job.u3.r17.f0:2",
        "Diloco-Upload": "job.u3.r17.f0",
        "Diloco-Chunk": "2/5",
        "Diloco-Size": "4000000",
    }
    assert parse_chunk_headers(headers) == info
    del headers["Nats-Msg-Id"]  # optional on receipt
    assert parse_chunk_headers(headers) == info
    assert parse_chunk_headers(chunk_headers(ChunkInfo("j.params.v7", 0, 1, 0))).total_size == 0


GOOD_HEADERS = chunk_headers(ChunkInfo("job.u3.r17.f0", 2, 5, 100))


@pytest.mark.parametrize(
    "changes",
    [
        {"Diloco-Upload": None},
        {"Diloco-Chunk": None},
        {"Diloco-Size": None},
        {"Diloco-Upload": "has space"},
        {"Diloco-Upload": "a:b"},
        {"Diloco-Upload": ""},
        {"Diloco-Chunk": "5/5"},
        {"Diloco-Chunk": "0/0"},
        {"Diloco-Chunk": "-1/5"},
        {"Diloco-Chunk": "1/5/7"},
        {"Diloco-Chunk": "01/5"},
        {"Diloco-Chunk": " 1/5"},
        {"Diloco-Chunk": "1/" + "9" * 5000},
        {"Diloco-Chunk": "a/b"},
        {"Diloco-Size": "-1"},
        {"Diloco-Size": "1e6"},
        {"Diloco-Size": "4"},  # 5 chunks cannot carry 4 bytes
        {"Diloco-Size": "9" * 40},
        {"Nats-Msg-Id": "job.u3.r17.f0:3"},
    ],
)
def test_parse_chunk_headers_rejects(changes: dict) -> None:
    headers = {**GOOD_HEADERS, **changes}
    headers = {k: v for k, v in headers.items() if v is not None}
    with pytest.raises(WireError):
        parse_chunk_headers(headers)


def test_parse_chunk_headers_rejects_missing() -> None:
    with pytest.raises(WireError, match="no chunk headers"):
        parse_chunk_headers(None)
    with pytest.raises(WireError, match="missing"):
        parse_chunk_headers({})


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(sorted(GOOD_HEADERS)) | st.text(max_size=8), st.text(max_size=30)
    ),
    st.booleans(),
)
def test_parse_chunk_headers_fuzz(changes: dict[str, str], start_valid: bool) -> None:
    headers = {**GOOD_HEADERS, **changes} if start_valid else changes
    try:
        info = parse_chunk_headers(headers)
    except WireError:
        return
    assert 0 <= info.index < info.count and info.total_size >= 0


def test_chunk_headers_validate_info() -> None:
    for info in (
        ChunkInfo("u", 1, 1, 10),
        ChunkInfo("u", 0, 0, 10),
        ChunkInfo("u", 0, 2, 0),
        ChunkInfo("u", 0, 1, -1),
        ChunkInfo("bad id", 0, 1, 1),
    ):
        with pytest.raises(WireError):
            chunk_headers(info)


# --------------------------------------------------------------------------- chunking


def test_split_chunks() -> None:
    assert split_chunks(b"", 4) == [b""]
    assert split_chunks(b"abcdefgh", 4) == [b"abcd", b"efgh"]
    assert split_chunks(b"abcdefghi", 4) == [b"abcd", b"efgh", b"i"]
    assert split_chunks(bytearray(b"ab"), 10) == [b"ab"]
    for bad in (0, -1, 1.5, None):
        with pytest.raises(WireError):
            split_chunks(b"abc", bad)  # type: ignore[arg-type]


def _chunk_infos(upload: str, blob: bytes, chunk_size: int) -> list[tuple[ChunkInfo, bytes]]:
    chunks = split_chunks(blob, chunk_size)
    return [(ChunkInfo(upload, i, len(chunks), len(blob)), c) for i, c in enumerate(chunks)]


@SETTINGS
@given(
    blob=st.binary(max_size=2000),
    chunk_size=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
    duplicate_fraction=st.floats(0, 1),
)
def test_reassembly_any_order_with_duplicates(blob, chunk_size, seed, duplicate_fraction) -> None:
    rng = random.Random(seed)
    parts = _chunk_infos("job.u1.r2.f0", blob, chunk_size)
    deliveries = parts + [p for p in parts if rng.random() < duplicate_fraction]
    rng.shuffle(deliveries)
    # Through real headers, as a subscriber would see them.
    reassembler = Reassembler(max_upload_bytes=2000, max_pending_uploads=2)
    results = []
    seen: set[int] = set()
    for info, data in deliveries:
        seen.add(info.index)
        out = reassembler.add(parse_chunk_headers(chunk_headers(info)), data)
        if out is not None:
            results.append(out)
            # Completion happens exactly when the last missing chunk arrives.
            assert len(seen) == len(parts)
            seen = set()
    assert results and all(r == blob for r in results)


def test_interleaved_uploads() -> None:
    blobs = {f"job.u{u}.r0.f0": bytes([u]) * (100 + u) for u in range(3)}
    deliveries = [p for u, b in blobs.items() for p in _chunk_infos(u, b, 16)]
    random.Random(0).shuffle(deliveries)
    reassembler = Reassembler(max_upload_bytes=1000, max_pending_uploads=3)
    done = {}
    for info, data in deliveries:
        out = reassembler.add(info, data)
        if out is not None:
            done[info.upload] = out
    assert done == blobs and reassembler.pending == 0 and reassembler.evicted == 0


def test_reassembler_rejects_oversized_upload() -> None:
    reassembler = Reassembler(max_upload_bytes=100, max_pending_uploads=2)
    with pytest.raises(WireError, match="at most 100"):
        reassembler.add(ChunkInfo("u.1", 0, 2, 101), b"x" * 51)
    with pytest.raises(WireError, match="at most 100"):
        reassembler.add(ChunkInfo("u.1", 0, 1, 101), b"x" * 101)
    assert reassembler.add(ChunkInfo("u.1", 0, 1, 100), b"x" * 100) == b"x" * 100
    assert reassembler.pending == 0


@pytest.mark.parametrize(
    ("info", "data", "match"),
    [
        (ChunkInfo("u", 1, 4, 100), b"x" * 30, "disagrees"),  # count changed
        (ChunkInfo("u", 1, 3, 99), b"x" * 40, "disagrees"),  # total changed
        (ChunkInfo("u", 1, 3, 100), b"x" * 35, "disagrees"),  # other chunk size
        (ChunkInfo("u", 2, 3, 100), b"x" * 30, "disagrees"),  # last chunk of another layout
        (ChunkInfo("u", 0, 1, 100), b"x" * 100, "disagrees"),  # now claims a single chunk
        (ChunkInfo("u", 2, 3, 100), b"x" * 49, "does not fit"),  # last chunk fits no layout
        (ChunkInfo("u", 1, 3, 100), b"x" * 20, "does not fit"),  # 3 x 20 < 100
        (ChunkInfo("u", 1, 3, 100), b"x" * 50, "does not fit"),  # last chunk would be empty
        (ChunkInfo("u", 3, 3, 100), b"x" * 40, "out of range"),
        (ChunkInfo("u", -1, 3, 100), b"x" * 40, "out of range"),
        (ChunkInfo("v", 0, 1, 100), b"x" * 99, "single-chunk"),
        (ChunkInfo("u", 0, 3, 100), "x" * 40, "contiguous bytes"),
    ],
)
def test_reassembler_rejects_inconsistent_chunks(info: ChunkInfo, data: bytes, match: str) -> None:
    reassembler = Reassembler(max_upload_bytes=1000, max_pending_uploads=4)
    assert reassembler.add(ChunkInfo("u", 0, 3, 100), b"a" * 40) is None
    with pytest.raises(WireError, match=match):
        reassembler.add(info, data)
    # A rejected chunk leaves the upload untouched; it still completes.
    assert reassembler.pending == 1
    assert reassembler.add(ChunkInfo("u", 2, 3, 100), b"c" * 20) is None
    assert (
        reassembler.add(ChunkInfo("u", 1, 3, 100), b"b" * 40) == b"a" * 40 + b"b" * 40 + b"c" * 20
    )


def test_last_chunk_first_fixes_the_layout() -> None:
    reassembler = Reassembler(max_upload_bytes=1000, max_pending_uploads=4)
    assert reassembler.add(ChunkInfo("u", 2, 3, 100), b"c" * 20) is None
    with pytest.raises(WireError, match="disagrees"):
        reassembler.add(ChunkInfo("u", 0, 3, 100), b"a" * 45)
    assert reassembler.add(ChunkInfo("u", 0, 3, 100), b"a" * 40) is None
    assert reassembler.add(ChunkInfo("u", 1, 3, 100), b"b" * 40) is not None


def test_duplicates_are_ignored() -> None:
    reassembler = Reassembler(max_upload_bytes=1000, max_pending_uploads=4)
    assert reassembler.add(ChunkInfo("u", 0, 2, 10), b"a" * 5) is None
    assert reassembler.add(ChunkInfo("u", 0, 2, 10), b"z" * 5) is None
    assert reassembler.duplicates == 1
    assert reassembler.add(ChunkInfo("u", 1, 2, 10), b"b" * 5) == b"aaaaabbbbb"


def test_eviction_of_least_recently_active_upload() -> None:
    reassembler = Reassembler(max_upload_bytes=1000, max_pending_uploads=2)
    reassembler.add(ChunkInfo("a", 0, 2, 20), b"a" * 10)
    reassembler.add(ChunkInfo("b", 0, 2, 20), b"b" * 10)
    assert reassembler.pending == 2 and reassembler.evicted == 0
    reassembler.add(ChunkInfo("c", 0, 2, 20), b"c" * 10)  # evicts "a"
    assert reassembler.pending == 2 and reassembler.evicted == 1
    assert reassembler.take_evicted() == ["a"] and reassembler.take_evicted() == []
    # "b" is touched again, so "c" is now the oldest and goes when "d" arrives.
    reassembler.add(ChunkInfo("b", 0, 2, 20), b"b" * 10)
    reassembler.add(ChunkInfo("d", 0, 2, 20), b"d" * 10)
    assert reassembler.take_evicted() == ["c"] and reassembler.evicted == 2
    assert reassembler.add(ChunkInfo("b", 1, 2, 20), b"B" * 10) == b"b" * 10 + b"B" * 10
    # An evicted upload restarts from scratch: its second chunk alone does not complete it.
    assert reassembler.add(ChunkInfo("a", 1, 2, 20), b"A" * 10) is None


def test_rejected_new_upload_does_not_evict() -> None:
    reassembler = Reassembler(max_upload_bytes=1000, max_pending_uploads=1)
    reassembler.add(ChunkInfo("a", 0, 2, 20), b"a" * 10)
    with pytest.raises(WireError):
        reassembler.add(ChunkInfo("b", 0, 2, 20), b"b" * 3)
    assert reassembler.evicted == 0 and reassembler.pending == 1


def test_discard_and_constructor_validation() -> None:
    reassembler = Reassembler(max_upload_bytes=1000, max_pending_uploads=2)
    reassembler.add(ChunkInfo("a", 0, 2, 20), b"a" * 10)
    reassembler.discard("a")
    reassembler.discard("never-seen")
    assert reassembler.pending == 0 and reassembler.evicted == 0
    for args in ((-1, 1), (10, 0), (10.0, 1), (10, True), (10, 1, 9), (10, 1, 10.0)):
        with pytest.raises(WireError):
            Reassembler(*args)  # type: ignore[arg-type]


def test_a_sender_over_the_limits_evicts_its_own_uploads_not_the_others() -> None:
    """Three senders' uploads and one of "x" fit in 100 bytes; each further upload of "x"
    goes over the limit, and as "x" holds the most uploads, its own least recently active one
    is evicted. The others' uploads complete."""
    reassembler = Reassembler(max_upload_bytes=40, max_pending_uploads=100, max_pending_bytes=100)
    for sender in "abc":
        assert reassembler.add(ChunkInfo(sender, 0, 2, 20), b"1" * 10, sender) is None
    assert reassembler.add(ChunkInfo("x1", 0, 2, 40), b"x" * 20, "x") is None
    assert reassembler.pending_bytes == 100 and reassembler.evicted == 0
    assert reassembler.add(ChunkInfo("x2", 0, 2, 40), b"x" * 20, "x") is None
    assert reassembler.take_evicted() == ["x1"] and reassembler.pending_bytes == 100
    assert reassembler.add(ChunkInfo("x3", 0, 2, 40), b"x" * 20, "x") is None
    assert reassembler.take_evicted() == ["x2"]
    assert reassembler.add(ChunkInfo("x3", 1, 2, 40), b"x" * 20, "x") == b"x" * 40
    for sender in "abc":
        done = reassembler.add(ChunkInfo(sender, 1, 2, 20), b"2" * 10, sender)
        assert done == b"1" * 10 + b"2" * 10
    assert reassembler.pending == 0 and reassembler.pending_bytes == 0 and reassembler.evicted == 2


def test_the_byte_limit_evicts_the_least_recently_active_upload_of_one_per_sender() -> None:
    reassembler = Reassembler(max_upload_bytes=90, max_pending_uploads=100, max_pending_bytes=100)
    reassembler.add(ChunkInfo("small", 0, 2, 20), b"s" * 10)
    reassembler.add(ChunkInfo("huge", 0, 2, 90), b"h" * 45)
    assert reassembler.take_evicted() == ["small"] and reassembler.pending_bytes == 90


def test_empty_blob_round_trip() -> None:
    reassembler = Reassembler(max_upload_bytes=10, max_pending_uploads=1)
    [(info, data)] = _chunk_infos("e", b"", 4)
    assert reassembler.add(info, data) == b""


def test_full_path_envelope_through_chunks() -> None:
    env = make_envelope()
    blob = pack_envelope(env)
    parts = _chunk_infos(upload_id(env.job, env.unit, env.round, env.fragment), blob, 97)
    random.Random(3).shuffle(parts)
    reassembler = Reassembler(max_upload_bytes=len(blob), max_pending_uploads=1)
    outs = [reassembler.add(parse_chunk_headers(chunk_headers(i)), d) for i, d in parts]
    assert unpack_envelope(outs[-1]) == env and outs[:-1] == [None] * (len(parts) - 1)


def test_envelope_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_envelope().round = 3  # type: ignore[misc]
