"""Synthetic pseudo-gradients with the statistics of real ones, encoded once per load test.

A real pseudo-gradient of the ``small`` model (θ before − θ after 30 AdamW steps, steps 90–120
of a run with the learner's defaults) has a root mean square of 3e-3 to 1e-2 per tensor
(7e-3 for most weight matrices) and a kurtosis of 3 to 9 (4.5–6.3 for the weight matrices):
heavier-tailed than a Gaussian (3), close to a Laplace distribution (6). Its int8 upload is
4.38× smaller than fp32; a Laplace tensor of the same RMS gives 4.55×, a Gaussian 4.21×.
So a synthetic pseudo-gradient is Laplace noise of RMS ``RMS`` on every tensor of the model
(``ModelConfig.param_shapes``), and its payload is what the learner's codec makes of it.
A few different ones are encoded up front, so that sending costs the load generator no
encoding.
"""

from __future__ import annotations

import math

import numpy as np

from shared.codec import api as codec
from shared.codec.config import CodecConfig
from shared.model_config import ModelConfig

RMS = 7e-3  # measured, see the module docstring


class PayloadPool:
    """``count`` encoded synthetic pseudo-gradients of one model, used in turn."""

    def __init__(self, model: ModelConfig, config: CodecConfig, count: int, seed: int) -> None:
        """Args:
        model: the model size whose tensors they cover.
        config: the upload codec (error feedback is not used: each is encoded once).
        count: how many different ones.
        seed: seed of the noise.
        """
        rng = np.random.default_rng(seed)
        scale = RMS / math.sqrt(2)  # a Laplace distribution of scale b has RMS b·√2
        self._payloads: list[tuple[bytes, dict]] = []
        shapes = model.param_shapes()
        for _ in range(count):
            tensors = {
                name: rng.laplace(0.0, scale, shape).astype(np.float32)
                for name, shape in shapes.items()
            }
            payload, description, _ = codec.encode(tensors, config, codec.CodecState())
            self._payloads.append((bytes(payload), description))
        self.fp32_bytes = 4 * model.param_count
        self.seq_len = model.seq_len

    def payload(self, index: int) -> tuple[bytes, dict]:
        """The ``index``-th payload (modulo the pool) and its codec description."""
        return self._payloads[index % len(self._payloads)]

    @property
    def payload_bytes(self) -> int:
        """Bytes of the first payload."""
        return len(self._payloads[0][0])
