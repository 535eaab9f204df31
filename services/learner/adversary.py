"""A unit that misbehaves on purpose, to test the merge's defences end to end (like the chaos
of ``diloco up --chaos-*``, this is fault injection: ``diloco up --adversaries N --adversary
KIND`` makes units 0..N−1 send hostile uploads with their own valid credentials).

It trains honestly and turns each pseudo-gradient Δ it would send into the standard attacks of
decentralised training (BTARD, ICML 2022; Templar's Gauntlet, arXiv 2505.21684):

* ``sign_flip``: −Δ, undoing its share of the progress;
* ``random``: a random direction, ``RANDOM_SCALE`` × ‖Δ‖ (as large as the norm guard's
  default bound lets through, 10× the usual norm);
* ``scaled``: ``SCALED`` × Δ, its own direction just under the norm guard's bound;
* ``alie`` ("a little is enough"): Δ − ``ALIE_Z`` · |Δ|, a shift of every coordinate by its
  own spread (|Δ| stands for the honest units' per-coordinate deviation, which a unit cannot
  see); every adversary of a job shifts the same way, so theirs add up;
* ``replay``: the payload of its first upload of each fragment, sent again as each later
  round;
* ``too_frequent``: an upload every ``FREQUENCY``-th of its period (its own H ÷ ``FREQUENCY``),
  each claiming a whole period's steps and tokens.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from services.learner.core import Upload
from services.learner.settings import ADVERSARIES

RANDOM_SCALE = 9.0  # the random direction's norm, × the honest upload's
SCALED = 9.0  # the scaled upload, × the honest one (the norm guard rejects above 10×)
ALIE_Z = 1.0  # the shift, in |Δ| per coordinate
FREQUENCY = 8  # too_frequent: uploads per honest period


def own_h(kind: str, h_steps: int) -> int:
    """The H a unit of adversary ``kind`` trains with: ``h_steps`` ÷ ``FREQUENCY`` for
    ``too_frequent``, else ``h_steps``."""
    return max(1, h_steps // FREQUENCY) if kind == "too_frequent" else h_steps


class Adversary:
    """Turns a unit's honest uploads into one attack's (``none``: leaves them alone)."""

    def __init__(self, kind: str, unit: int, h_steps: int) -> None:
        """Args:
        kind: One of ``ADVERSARIES``.
        unit: The unit (seeds the random directions).
        h_steps: The job's H: what a ``too_frequent`` upload claims.
        """
        if kind not in ADVERSARIES:
            raise ValueError(f"adversary must be one of {ADVERSARIES}, got {kind!r}")
        self.kind = kind
        self.h_steps = h_steps
        self._rng = np.random.default_rng([unit, 7])
        self._first_payloads: dict[int, tuple[bytes, Any]] = {}

    def upload(self, upload: Upload) -> Upload:
        """The upload to encode in place of ``upload``."""
        if self.kind == "too_frequent":
            factor = self.h_steps / max(1, upload.inner_steps)
            return dataclasses.replace(
                upload,
                inner_steps=self.h_steps,
                tokens=int(upload.tokens * factor),
            )
        if self.kind not in ("sign_flip", "random", "scaled", "alie"):
            return upload
        tensors = {k: np.asarray(v, np.float32) for k, v in upload.tensors.items()}
        if self.kind == "sign_flip":
            hostile = {k: -v for k, v in tensors.items()}
        elif self.kind == "scaled":
            hostile = {k: SCALED * v for k, v in tensors.items()}
        elif self.kind == "alie":
            hostile = {k: v - ALIE_Z * np.abs(v) for k, v in tensors.items()}
        else:
            norm = np.sqrt(sum(float(np.dot(v.ravel(), v.ravel())) for v in tensors.values()))
            noise = {
                k: self._rng.standard_normal(v.shape).astype(np.float32) for k, v in tensors.items()
            }
            size = np.sqrt(sum(float(np.dot(v.ravel(), v.ravel())) for v in noise.values()))
            scale = np.float32(RANDOM_SCALE * norm / size) if size > 0 else np.float32(0)
            hostile = {k: v * scale for k, v in noise.items()}
        # The codec reads the tensors, not the flat buffer they were views of.
        return dataclasses.replace(upload, tensors=hostile, values=None, layout=None)

    def payload(self, fragment: int, payload: Any, description: Any) -> tuple[Any, Any]:
        """The encoded payload (and its codec description) to send for ``fragment``
        (``replay``: the fragment's first one, every time)."""
        if self.kind != "replay":
            return payload, description
        return self._first_payloads.setdefault(fragment, (bytes(payload), description))
