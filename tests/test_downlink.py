"""The delta downlink's pure core (shared/downlink.py): what a unit reconstructs is bit for bit
the outer's record of it over many versions, skipped versions cost one cumulative delta, and a
keyframe is sent when there is no record, the checksum does not match, or a delta would be
larger."""

from __future__ import annotations

import numpy as np
import pytest

from shared.codec import api as codec
from shared.codec.config import CodecError
from shared.downlink import (
    Current,
    Delta,
    DownlinkSender,
    Held,
    Keyframe,
    params_checksum,
    reconstruct,
)

SHAPES = {"emb": (64, 48), "w": (300,), "b": ()}


def params_at(version: int) -> dict[str, np.ndarray]:
    """A fragment's params at ``version``: a random walk, as training moves them."""
    rng = np.random.default_rng(0)
    start = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    for step in range(1, version + 1):
        rng = np.random.default_rng(step)
        start = {
            n: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
            for n, v in start.items()
        }
    return start


def publish(sender: DownlinkSender, version: int, params_codec: str = "int8") -> Held:
    params = params_at(version)
    payload, description = codec.encode_tensors(params, params_codec, zstd_level=1)
    return sender.published(version, params, payload, description)


class Unit:
    """A unit's side: the copy it holds, updated only from what it is sent."""

    def __init__(self) -> None:
        self.held: Held | None = None

    def ask(self, sender: DownlinkSender, unit: int = 0):
        if self.held is None:
            return sender.answer(unit, -1, 0)
        return sender.answer(unit, self.held.version, self.held.checksum)

    def read_keyframe(self, version: int, params_codec: str = "int8") -> None:
        payload, description = codec.encode_tensors(params_at(version), params_codec, zstd_level=1)
        self.held = Held.of(version, codec.decode_tensors(payload, description))

    def apply(self, delta: Delta) -> None:
        assert self.held is not None
        assert (delta.base_version, delta.base_checksum) == (self.held.version, self.held.checksum)
        # The delta crosses the wire as bytes.
        pieces = reconstruct(self.held.pieces, bytes(delta.payload), delta.description)
        self.held = Held.of(delta.version, pieces)

    def sync(self, sender: DownlinkSender) -> object:
        answer = self.ask(sender)
        if isinstance(answer, Keyframe):
            self.read_keyframe(answer.version)
        elif isinstance(answer, Delta):
            self.apply(answer)
        return answer


def relative_error(held: Held, version: int) -> float:
    exact = params_at(version)
    num = sum(float(np.sum((held.pieces[n] - exact[n]) ** 2)) for n in exact)
    den = sum(float(np.sum(exact[n] ** 2)) for n in exact)
    return (num / den) ** 0.5


@pytest.mark.parametrize("delta_codec", ["int8", "int4", "int2"])
def test_reconstruction_is_the_outers_record_over_many_versions(delta_codec: str) -> None:
    sender, unit = DownlinkSender(delta_codec), Unit()
    answers = []
    for version in range(12):
        publish(sender, version)
        answers.append(unit.sync(sender))
        assert unit.held is not None and unit.held.version == version
        # The checksum the outer recorded is the unit's, recomputed from its bits.
        assert params_checksum(unit.held.pieces) == unit.held.checksum
        if isinstance(answers[-1], Delta):
            assert answers[-1].checksum == unit.held.checksum
            again = sender.answer(0, unit.held.version, unit.held.checksum)
            assert isinstance(again, Current)
    assert isinstance(answers[0], Keyframe) and answers[0].reason == "no_record"
    assert all(isinstance(a, Delta) for a in answers[1:])
    # The sender keeps the error feedback: the error does not build up over the versions.
    one_step = {"int8": 0.01, "int4": 0.1, "int2": 0.6}[delta_codec]
    assert relative_error(unit.held, 11) < one_step


def test_skipped_versions_get_one_cumulative_delta() -> None:
    sender, unit = DownlinkSender("int4"), Unit()
    publish(sender, 0)
    unit.sync(sender)
    for version in range(1, 6):
        publish(sender, version)
    answer = unit.sync(sender)
    assert isinstance(answer, Delta)
    assert (answer.base_version, answer.version) == (0, 5)
    assert unit.held is not None and unit.held.checksum == answer.checksum


def test_asking_again_from_the_same_copy_gets_the_same_delta() -> None:
    """A unit that missed the reply (or its chunks) asks again with what it still holds."""
    sender, unit = DownlinkSender("int8"), Unit()
    publish(sender, 0)
    unit.sync(sender)
    publish(sender, 1)
    first = unit.ask(sender)
    second = unit.ask(sender)
    assert isinstance(first, Delta) and second is first
    unit.apply(second)
    publish(sender, 2)
    assert isinstance(unit.sync(sender), Delta)


def test_no_record_or_checksum_mismatch_gets_a_keyframe() -> None:
    sender, unit = DownlinkSender("int4"), Unit()
    for version in (0, 1):
        publish(sender, version)
        unit.sync(sender)
    publish(sender, 2)
    assert unit.held is not None and unit.held.version == 1
    held = unit.held
    # Another unit claiming this one's copy, or this one after the outer restarted (a fresh
    # sender), has no record of it.
    assert sender.answer(7, held.version, held.checksum) == Keyframe(2, "no_record")
    restarted = DownlinkSender("int4")
    publish(restarted, 2)
    assert restarted.answer(0, held.version, held.checksum) == Keyframe(2, "no_record")
    # A copy that is not what the outer sent (a flipped bit) gets a keyframe too.
    assert sender.answer(0, held.version, held.checksum ^ 1) == Keyframe(2, "no_record")
    unit.read_keyframe(2)
    publish(restarted, 3)
    answer = unit.sync(restarted)
    assert isinstance(answer, Delta) and unit.held.checksum == answer.checksum


def test_a_keyframe_older_than_those_kept_gets_a_keyframe() -> None:
    sender, unit = DownlinkSender("int4", keyframes_kept=2), Unit()
    publish(sender, 0)
    unit.ask(sender)  # told to read a keyframe (version 0)...
    publish(sender, 1)
    unit.read_keyframe(1)  # ... reads the newest one instead, and asks only two versions later
    for version in (2, 3):
        publish(sender, version)
    assert unit.ask(sender) == Keyframe(3, "no_record")


def test_a_delta_larger_than_the_keyframe_is_not_sent() -> None:
    sender, unit = DownlinkSender("fp32"), Unit()
    publish(sender, 0, params_codec="int8")
    unit.sync(sender)
    publish(sender, 1, params_codec="int8")
    assert unit.ask(sender) == Keyframe(1, "smaller")


def test_reconstruct_rejects_a_delta_that_does_not_fit() -> None:
    base = params_at(0)
    payload, description = codec.encode_tensors({"w": np.ones(300, np.float32)}, "int8")
    with pytest.raises(CodecError, match="names"):
        reconstruct(base, payload, description)
    other = {**base, "w": np.ones(301, np.float32)}
    payload, description = codec.encode_tensors(other, "int8")
    with pytest.raises(CodecError, match="shape"):
        reconstruct(base, payload, description)


def test_checksum_sees_every_bit_and_shape() -> None:
    params = params_at(0)
    flipped = {**params, "w": params["w"].copy()}
    flipped["w"].view(np.uint32)[3] ^= 1
    reshaped = {**params, "emb": params["emb"].reshape(48, 64)}
    checksums = {params_checksum(p) for p in (params, flipped, reshaped)}
    assert len(checksums) == 3
