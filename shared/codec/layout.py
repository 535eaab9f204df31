"""Which tensors a payload holds: their names and shapes (:class:`TensorSpec`, :class:`Layout`).

A :class:`Layout` also says where each tensor sits in one flat float32 buffer that holds them
all back to back, which is how a learner hands its pseudo-gradient to
:func:`shared.codec.api.encode_flat`, and it is the key under which the codec caches the
segment plan of a set of tensors (:mod:`shared.codec.segments`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from shared.codec.config import CodecError, is_int

__all__ = ["DTYPE", "Layout", "TensorSpec", "sorted_names"]

#: The dtype of every decoded tensor.
DTYPE = "float32"


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor in a payload.

    Attributes:
        name: Tensor name (the key in the mapping given to :func:`encode`).
        shape: Array shape; every dimension is a non-negative int.
        dtype: Decoded dtype name; always ``"float32"``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = DTYPE

    @property
    def size(self) -> int:
        """Number of elements (``math.prod(shape)``; 1 for a scalar)."""
        return math.prod(self.shape)


class Layout:
    """Names and shapes of a payload's tensors, in sorted-name order, and where each one
    sits in a flat float32 buffer that holds them back to back (see :func:`encode_flat`).

    Immutable and hashable, with the hash computed once: a sender makes one per set of
    tensors it sends (a learner: one per fragment) and passes it with every payload.

    Attributes:
        names: Tensor names, sorted.
        shapes: Shape of each tensor.
        sizes: Number of values of each tensor.
        offsets: Index of each tensor's first value in the flat buffer.
        size: Number of values in all (the flat buffer's length).
    """

    __slots__ = ("_hash", "names", "offsets", "shapes", "size", "sizes")

    def __init__(self, shapes: Mapping[str, Iterable[int]]) -> None:
        """Args:
            shapes: Name -> shape (a sequence of non-negative ints).

        Raises:
            CodecError: a name that is not a str, or a shape that is not non-negative ints.
        """
        names = sorted_names(shapes, "shapes must be a mapping of name -> shape")
        checked = []
        for name in names:
            shape = shapes[name]
            if not isinstance(shape, Iterable) or not all(is_int(d) and d >= 0 for d in shape):
                raise CodecError(
                    f"tensor {name!r}: shape must be non-negative ints, got {shape!r:.100}"
                )
            checked.append(tuple(int(d) for d in shape))
        self._set(tuple(names), tuple(checked))

    @classmethod
    def from_checked(cls, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> Layout:
        """A layout of names and shapes that are already checked: sorted, unique str names and
        shapes of non-negative ints (what the description parser and the encoder hold)."""
        layout = cls.__new__(cls)
        layout._set(names, shapes)
        return layout

    def _set(self, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> None:
        sizes = tuple(map(math.prod, shapes))
        offsets = tuple(accumulate(sizes, initial=0))
        for attribute, value in (
            ("names", names),
            ("shapes", shapes),
            ("sizes", sizes),
            ("offsets", offsets[:-1]),
            ("size", offsets[-1]),
            ("_hash", hash((names, shapes))),
        ):
            object.__setattr__(self, attribute, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Layout is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self is other or (
            self._hash == other._hash and self.names == other.names and self.shapes == other.shapes
        )

    def __repr__(self) -> str:
        return f"Layout({len(self.names)} tensors, {self.size} values)"

    def views(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """Name -> the tensor's view of the flat buffer ``values`` (``size`` values)."""
        return {
            name: values[offset : offset + size].reshape(shape)
            for name, shape, size, offset in zip(
                self.names, self.shapes, self.sizes, self.offsets, strict=True
            )
        }


def sorted_names(mapping: Any, not_a_mapping: str) -> list[str]:
    """The keys of ``mapping``, which must all be str, sorted."""
    if not isinstance(mapping, Mapping):
        raise CodecError(f"{not_a_mapping}, got {type(mapping)}")
    for name in mapping:
        if not isinstance(name, str):
            raise CodecError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    return sorted(mapping)
