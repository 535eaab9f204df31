"""Parameter fragments (Streaming DiLoCo, arXiv 2501.18512; Decoupled DiLoCo's balanced
tensor fragmentation): the parameters split into P parts that are synced on staggered schedules.

The model stacks its per-layer weights on a leading ``n_layers`` axis (``shared/model.py``), so
a *piece* is either a whole tensor or one layer's slice of a stacked tensor. Pieces are packed
greedily (largest first, into the lightest fragment) into P fragments of balanced size, the
scheme Decoupled DiLoCo chose for its smooth bandwidth. With P = 1 there is a single fragment
made of whole tensors, i.e. exactly the non-fragmented model.

Fragment p first syncs ``offset(p) = round(p·H/P)`` steps early, then every H steps, so that
syncs of different fragments are spread evenly over the H steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

LAYER_PREFIX = "['blocks']"


@dataclass(frozen=True)
class Piece:
    """A whole tensor (``layer`` None) or one layer's slice of a stacked tensor."""

    name: str
    layer: int | None
    size: int

    @property
    def key(self) -> str:
        """Name of the piece on the wire."""
        return self.name if self.layer is None else f"{self.name}#{self.layer}"


@dataclass(frozen=True)
class FragmentPlan:
    """Which pieces belong to which fragment."""

    fragments: tuple[tuple[Piece, ...], ...]

    @property
    def count(self) -> int:
        return len(self.fragments)

    def sizes(self) -> list[int]:
        """Number of parameters in each fragment."""
        return [sum(piece.size for piece in fragment) for fragment in self.fragments]

    def keys(self, fragment: int) -> list[str]:
        """Sorted piece keys of one fragment."""
        return sorted(piece.key for piece in self.fragments[fragment])

    def piece_shapes(
        self, shapes: Mapping[str, tuple[int, ...]], fragment: int
    ) -> dict[str, tuple[int, ...]]:
        """``{piece key: shape}`` of one fragment, from the tensors' shapes by name."""
        return {
            piece.key: tuple(shapes[piece.name][0 if piece.layer is None else 1 :])
            for piece in self.fragments[fragment]
        }

    def extract(self, named: Mapping[str, np.ndarray], fragment: int) -> dict[str, np.ndarray]:
        """The pieces of ``fragment`` from a ``{tensor name: array}`` dict (copies)."""
        out = {}
        for piece in self.fragments[fragment]:
            array = named[piece.name]
            out[piece.key] = np.array(array if piece.layer is None else array[piece.layer])
        return out

    def insert(
        self, named: dict[str, np.ndarray], fragment: int, pieces: Mapping[str, np.ndarray]
    ) -> None:
        """Write the pieces of ``fragment`` into ``named`` in place.

        Raises:
            ValueError: if a piece is missing or has the wrong shape.
        """
        for piece in self.fragments[fragment]:
            if piece.key not in pieces:
                raise ValueError(f"fragment {fragment} misses piece {piece.key}")
            target = named[piece.name] if piece.layer is None else named[piece.name][piece.layer]
            value = pieces[piece.key]
            if value.shape != target.shape:
                raise ValueError(
                    f"piece {piece.key}: expected shape {target.shape}, got {value.shape}"
                )
            if piece.layer is None:
                named[piece.name] = np.array(value, dtype=np.float32)
            else:
                named[piece.name][piece.layer] = value


def plan_fragments(shapes: Mapping[str, tuple[int, ...]], num_fragments: int) -> FragmentPlan:
    """Split tensors (by name and shape) into ``num_fragments`` balanced fragments.

    Raises:
        ValueError: if there are fewer pieces than fragments or ``num_fragments`` < 1.
    """
    if num_fragments < 1:
        raise ValueError(f"number of fragments must be >= 1, got {num_fragments}")
    if num_fragments == 1:
        whole = tuple(
            Piece(name, None, int(np.prod(shape))) for name, shape in sorted(shapes.items())
        )
        return FragmentPlan((whole,))
    pieces = []
    for name, shape in sorted(shapes.items()):
        if name.startswith(LAYER_PREFIX) and len(shape) >= 1:
            layer_size = int(np.prod(shape[1:]))
            pieces += [Piece(name, layer, layer_size) for layer in range(shape[0])]
        else:
            pieces.append(Piece(name, None, int(np.prod(shape))))
    if len(pieces) < num_fragments:
        raise ValueError(f"{num_fragments} fragments requested but only {len(pieces)} pieces")
    bins: list[list[Piece]] = [[] for _ in range(num_fragments)]
    totals = [0] * num_fragments
    for piece in sorted(pieces, key=lambda p: (-p.size, p.key)):
        lightest = min(range(num_fragments), key=lambda i: (totals[i], i))
        bins[lightest].append(piece)
        totals[lightest] += piece.size
    return FragmentPlan(tuple(tuple(sorted(b, key=lambda p: p.key)) for b in bins))


def sync_offset(fragment: int, num_fragments: int, h_steps: int) -> int:
    """Steps by which fragment ``fragment``'s first sync comes early (staggering)."""
    return round(fragment * h_steps / num_fragments)


def shard_fragments(shard: int, shards: int, count: int) -> tuple[int, ...]:
    """The fragments outer shard ``shard`` of ``shards`` owns out of ``count``: p mod shards
    = shard (round robin, so that the shards' sizes stay balanced like the fragments')."""
    return tuple(p for p in range(count) if p % shards == shard)


def check_shards(shards: int, fragments: int) -> None:
    """Refuse more outer shards than fragments (a shard without a fragment has no work).

    Raises:
        ValueError: ``shards`` > ``fragments``.
    """
    if shards > fragments:
        raise ValueError(f"{shards} outer shards > {fragments} fragments: every shard needs one")


def shard_of_fragment(fragment: int, shards: int) -> int:
    """The outer shard that owns ``fragment``."""
    return fragment % shards
