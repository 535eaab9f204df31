"""Held-out evaluation: mean next-byte loss of a set of parameters on fixed batches."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from shared.model import ModelConfig, loss_fn


@dataclass(frozen=True)
class EvalResult:
    """Held-out loss.

    Attributes:
        nats_per_byte: Mean cross-entropy per predicted byte, in nats.
        bits_per_byte: The same in bits (nats / ln 2); 8.0 means no better than uniform.
        num_bytes: Number of predicted bytes the mean is over.
    """

    nats_per_byte: float
    bits_per_byte: float
    num_bytes: int


def make_evaluator(cfg: ModelConfig, batches: np.ndarray) -> Callable[[dict], EvalResult]:
    """Build a function that evaluates parameters on a fixed set of batches.

    The batches are copied to the device once, and the whole evaluation (a `lax.map` over the
    batches, one at a time so memory stays at one batch's activations) is compiled once, so each
    call is a single dispatch plus one device-to-host transfer of a scalar.

    Args:
        cfg: Model size the parameters belong to.
        batches: int (num_batches, batch_size, T + 1) windows, e.g. from `data.eval_batches`,
            with T <= cfg.seq_len.

    Returns:
        `evaluate(params) -> EvalResult`. All batches have the same shape, so the mean of the
        per-batch means is the mean over every predicted byte.

    Raises:
        ValueError: If `batches` is not 3-D or its windows have fewer than 2 bytes.
    """
    if batches.ndim != 3 or batches.shape[2] < 2:
        raise ValueError(f"batches must have shape (NB, B, T + 1) with T >= 1, got {batches.shape}")
    num_batches, batch_size, window = batches.shape
    num_bytes = num_batches * batch_size * (window - 1)
    device_batches = jnp.asarray(batches, dtype=jnp.int32)  # (NB, B, T + 1)

    @jax.jit
    def mean_loss(params: dict, all_batches: jax.Array) -> jax.Array:
        per_batch = jax.lax.map(lambda b: loss_fn(params, b, cfg), all_batches)  # (NB,)
        return jnp.mean(per_batch)

    def evaluate(params: dict) -> EvalResult:
        """Mean held-out loss of `params` (a pytree shaped like `init_params(cfg, ...)`)."""
        nats = float(mean_loss(params, device_batches))
        return EvalResult(nats_per_byte=nats, bits_per_byte=nats / math.log(2), num_bytes=num_bytes)

    return evaluate
