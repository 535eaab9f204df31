"""Synthetic pseudo-gradients with the statistics of real ones, encoded once per load test.

A real pseudo-gradient of the ``small`` model (θ before − θ after 30 AdamW steps, steps 90–120
of a run with the learner's defaults) has a root mean square of 3e-3 to 1e-2 per tensor
(7e-3 for most weight matrices) and a kurtosis of 3 to 9 (4.5–6.3 for the weight matrices):
heavier-tailed than a Gaussian (3), close to a Laplace distribution (6). Its int8 upload is
4.38× smaller than fp32; a Laplace tensor of the same RMS gives 4.55×, a Gaussian 4.21×.
So a synthetic pseudo-gradient is Laplace noise of RMS ``RMS`` on every tensor of the model
(``ModelConfig.param_shapes``), and its payload is what the learner's codec makes of it.
Honest units descend the same loss, and the outer's peer review (``services/outer/peers.py``)
refuses an upload that does not point where its peers' do: so ``AGREEMENT`` of each one's
variance is a direction all of the pool's pseudo-gradients share (their cosines are about
``AGREEMENT``), the rest its own noise. The sum of two Laplace tensors has a kurtosis of 4.5,
still in the measured range.
A few different ones are encoded up front, so that sending costs the load generator no
encoding. The outer refuses a payload equal to one it accepted recently (a replay,
``services/outer/order.py``), so every upload must differ: upload k is put together frame by
frame (each zstd frame of a payload is independent), frame j taken from pool member number
digit j of k in base ``count``. That gives ``count`` ** frames different payloads (4 ** 11 for
``medium``) for the price of a copy; a model with fewer frames than uploads needs (``tiny``,
``small``: one frame) gets a freshly encoded one past that, cheap at those sizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from shared.codec import api as codec
from shared.codec.config import CodecConfig
from shared.codec.description import Description
from shared.model_config import ModelConfig

RMS = 7e-3  # measured, see the module docstring
AGREEMENT = 0.5  # share of a synthetic pseudo-gradient's variance along the common direction


class PayloadPool:
    """``count`` encoded synthetic pseudo-gradients of one model, used in turn."""

    def __init__(
        self,
        model: ModelConfig,
        config: CodecConfig,
        count: int,
        seed: int,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        """Args:
        model: the model size whose tensors they cover.
        config: the upload codec (error feedback is not used: each is encoded once).
        count: how many different ones.
        seed: seed of the noise.
        shapes: the tensors they cover, by name (default: every tensor of the model; one
            fragment's pieces for a unit that uploads fragments).
        """
        self._rng = np.random.default_rng(seed)
        self._shapes = dict(model.param_shapes() if shapes is None else shapes)
        self._config = config
        self._common = {name: self._laplace(shape) for name, shape in self._shapes.items()}
        self._payloads = [self._encode() for _ in range(count)]
        self._frames = [
            split_frames(payload, description) for payload, description in self._payloads
        ]
        self._taken = 0
        self.fp32_bytes = 4 * sum(int(np.prod(shape)) for shape in self._shapes.values())
        self.seq_len = model.seq_len

    def _laplace(self, shape: tuple[int, ...]) -> np.ndarray:
        scale = RMS / math.sqrt(2)  # a Laplace distribution of scale b has RMS b·√2
        return self._rng.laplace(0.0, scale, shape).astype(np.float32)

    def _encode(self) -> tuple[bytes, Description]:
        common, own = math.sqrt(AGREEMENT), math.sqrt(1 - AGREEMENT)
        tensors = {
            name: common * self._common[name] + own * self._laplace(shape)
            for name, shape in self._shapes.items()
        }
        payload, description, _ = codec.encode(tensors, self._config, codec.CodecState())
        return bytes(payload), description

    def payload(self, index: int) -> tuple[bytes, Description]:
        """The ``index``-th payload and its codec description: different for every index (see
        the module docstring)."""
        count, frames = len(self._payloads), len(self._frames[0])
        if index >= count**frames:
            return self._encode()
        chosen = [(index // count**j) % count for j in range(frames)]
        parts = [self._frames[member][j] for j, member in enumerate(chosen)]
        first = self._payloads[0][1]
        description = dataclasses.replace(
            first,
            frames=tuple(len(part) for part in parts),
            checksums=tuple(self._payloads[m][1].checksums[j] for j, m in enumerate(chosen)),
        )
        return b"".join(parts), description

    def take(self) -> tuple[bytes, Description]:
        """The next payload, never one taken before from this pool."""
        self._taken += 1
        return self.payload(self._taken - 1)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the first payload."""
        return len(self._payloads[0][0])


def split_frames(payload: bytes, description: Description) -> list[bytes]:
    """A payload's zstd frames, in order."""
    frames, end = [], 0
    for size in description.frames:
        frames.append(payload[end : end + size])
        end += size
    return frames
