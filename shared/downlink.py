"""The delta downlink: global params sent to a unit as a quantized delta against the copy the
unit holds, with the sender keeping the error feedback (docs/CODEC.md, "Delta downlink").

The outer keeps, per unit and fragment, the exact float32 copy that unit reconstructed
(:class:`Held`: version, checksum, pieces). To bring the unit from its copy ``X`` to version
``v`` it sends ``Q(θ_v − X)`` and records ``X' = X + D(Q(θ_v − X))``, computed by
:func:`reconstruct`, the same numpy float32 operations the unit runs, so both hold the same
bits (checked by :func:`params_checksum`). The quantization error ``θ_v − X'`` is not lost: the
next delta is taken against ``X'``, so it carries it (error feedback on the sender's side, as
CocktailSGD's server residual, arXiv 2306.16251). A unit that skipped versions gets one
cumulative delta from what it holds, never the chain.

A *keyframe* is the fragment's ordinary global copy (in ``--params-codec``): a unit with no
record at the outer (it joined, rejoined, or the outer restarted or failed over) or whose
delta would be larger than the keyframe (by more than :data:`KEYFRAME_MARGIN`) reads that
copy, and holds ``D(keyframe)``; the outer records that reconstruction for the last
:data:`KEYFRAMES_KEPT` versions, so a unit that read one gets deltas from then on (and per
unit the one it was last told to read, however many versions later it asks again).

This module is pure (numpy and the codec; no I/O): the outer's transport
(``services/outer/downlink.py``) and the learner's fetcher run it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from shared.codec import api as codec
from shared.codec.config import CodecError
from shared.codec.description import Description

Pieces = dict[str, np.ndarray]

#: Keyframe reconstructions the sender keeps per fragment (the newest versions): a unit that
#: read one of them may ask for a delta against it.
KEYFRAMES_KEPT = 2

#: zstd level of delta payloads (as the params copies').
DELTA_ZSTD_LEVEL = 1

#: A delta is sent unless it is larger than the keyframe by more than this factor. An int8
#: delta and an int8 keyframe differ in size only by what zstd finds (about 0.5%, either way);
#: a keyframe throws away the error feedback, a delta keeps it (bench/downlink.py: an int8
#: delta stream holds the params about four times more exactly than int8 copies), so a tie
#: goes to the delta.
KEYFRAME_MARGIN = 1.02


def params_checksum(pieces: Mapping[str, Any]) -> int:
    """XXH3-64 over the pieces' names, shapes and float32 bytes, in name order: two holders
    of a fragment have the same checksum exactly when they hold the same bits."""
    digest = xxhash.xxh3_64()
    for name in sorted(pieces):
        value = np.ascontiguousarray(pieces[name], dtype=np.float32)
        digest.update(f"{name}:{value.shape};".encode())
        digest.update(value.reshape(-1).view(np.uint8))  # the bytes in place, not a copy
    return digest.intdigest()


def reconstruct(
    base: Mapping[str, np.ndarray], payload: bytes | memoryview, description: Description
) -> Pieces:
    """``base + D(delta)``, piece by piece in float32: what a unit holding ``base`` holds
    after applying the delta ``(payload, description)``; the sender runs this too.

    Raises:
        CodecError: the delta is malformed or does not name exactly the pieces of ``base``
            with their shapes.
    """
    delta = codec.decode_tensors(payload, description)
    if set(delta) != set(base):
        raise CodecError(f"delta names {sorted(delta)}, the base holds {sorted(base)}")
    out: Pieces = {}
    for name, step in delta.items():
        held = base[name]
        if step.shape != held.shape:
            raise CodecError(
                f"delta of {name!r} has shape {list(step.shape)}, the base {list(held.shape)}"
            )
        out[name] = np.add(held, step, dtype=np.float32)
        if not np.isfinite(out[name]).all():
            raise CodecError(f"delta makes {name!r} non-finite")
    return out


@dataclass(frozen=True)
class Held:
    """One copy of a fragment's params as a unit holds it (never changed in place)."""

    version: int
    checksum: int
    pieces: Pieces = field(repr=False)

    @classmethod
    def of(cls, version: int, pieces: Pieces) -> Held:
        return cls(version, params_checksum(pieces), pieces)


@dataclass(frozen=True)
class Delta:
    """A delta from ``(base_version, base_checksum)`` to ``version``, whose result has
    ``checksum``; ``payload`` / ``description`` are its encoding."""

    base_version: int
    base_checksum: int
    version: int
    checksum: int
    payload: bytes | memoryview = field(repr=False)
    description: Description = field(repr=False)


@dataclass(frozen=True)
class Keyframe:
    """Read the global copy of ``version`` (or a newer one): no delta is sent."""

    version: int
    reason: str  # "no_record" or "smaller"


@dataclass(frozen=True)
class Current:
    """The unit holds the newest version already."""

    version: int


Answer = Delta | Keyframe | Current


@dataclass
class _Target:
    version: int
    params: Pieces
    keyframe_bytes: int


class DownlinkSender:
    """The sender's side for one fragment: the newest version, the keyframe reconstructions
    of the last versions, and per unit the copies it may hold.

    Per unit it keeps at most two copies: the one the unit last said it holds and the one
    last sent to it (the unit may not have received it yet); asking again from the same copy
    gets the same delta back.
    """

    def __init__(self, delta_codec: str, keyframes_kept: int = KEYFRAMES_KEPT) -> None:
        self.delta_codec = delta_codec
        self.keyframes_kept = keyframes_kept
        self._target: _Target | None = None
        self._keyframes: list[Held] = []
        self._units: dict[int, list[Held]] = {}
        self._last: dict[int, tuple[Delta, Held]] = {}  # per unit: last delta, its result

    @property
    def version(self) -> int:
        """The newest version published (-1: none yet)."""
        return -1 if self._target is None else self._target.version

    def published(
        self,
        version: int,
        params: Mapping[str, Any],
        keyframe_payload: bytes | memoryview,
        keyframe_description: Description,
    ) -> Held:
        """A new version was published as the keyframe ``(payload, description)`` (the global
        copy). Returns the keyframe's reconstruction, as a unit that reads it holds it."""
        exact = {name: np.array(value, dtype=np.float32) for name, value in params.items()}
        keyframe = Held.of(version, codec.decode_tensors(keyframe_payload, keyframe_description))
        self._target = _Target(version, exact, len(keyframe_payload))
        kept = [k for k in self._keyframes if k.version != version]
        self._keyframes = [*kept, keyframe][-self.keyframes_kept :]
        return keyframe

    def records(self, unit: int) -> tuple[Held, ...]:
        """The copies ``unit`` may hold, as the sender recorded them."""
        return tuple(self._units.get(unit, ()))

    def forget(self, unit: int) -> None:
        """Drop every record of ``unit`` (its next request gets a keyframe)."""
        self._units.pop(unit, None)
        self._last.pop(unit, None)

    def answer(self, unit: int, held_version: int, held_checksum: int) -> Answer:
        """What to send ``unit``, which holds ``(held_version, held_checksum)`` (-1: nothing),
        to bring it to the newest version; records the result it will hold.

        Raises:
            CodecError: nothing was published yet.
        """
        target = self._target
        if target is None:
            raise CodecError("no params published yet")
        base = self.find(unit, held_version, held_checksum)
        if base is None:
            self.forget(unit)
            self._units[unit] = self._keyframes[-1:]
            return Keyframe(target.version, "no_record")
        self._units[unit] = [base]
        if base.version >= target.version:
            return Current(base.version)
        last = self._last.get(unit)
        if last is not None:
            sent, result = last
            if sent.version == target.version and (sent.base_version, sent.base_checksum) == (
                base.version,
                base.checksum,
            ):
                self._units[unit].append(result)
                return sent
        delta = {name: np.subtract(target.params[name], base.pieces[name]) for name in base.pieces}
        payload, description = codec.encode_tensors(
            delta, self.delta_codec, zstd_level=DELTA_ZSTD_LEVEL
        )
        if len(payload) > KEYFRAME_MARGIN * target.keyframe_bytes:
            self._units[unit].extend(self._keyframes[-1:])
            return Keyframe(target.version, "smaller")
        result = Held.of(target.version, reconstruct(base.pieces, payload, description))
        sent = Delta(
            base.version, base.checksum, target.version, result.checksum, payload, description
        )
        self._units[unit].append(result)
        self._last[unit] = (sent, result)
        return sent

    def find(self, unit: int, version: int, checksum: int) -> Held | None:
        """The copy ``(version, checksum)`` as recorded for ``unit`` (or a kept keyframe);
        None if there is no such record."""
        for held in (*self._units.get(unit, ()), *self._keyframes):
            if (held.version, held.checksum) == (version, checksum):
                return held
        return None
