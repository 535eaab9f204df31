"""Byte-level decoder-only transformer language model, in pure JAX.

A GPT-2 style model over raw bytes (vocabulary of 256), small enough to read in one sitting:

    tokens (B, T) -> token embedding + learned position embedding
                  -> n_layers x [x + attn(LN(x)), x + mlp(LN(x))]     (pre-LayerNorm blocks)
                  -> final LayerNorm -> output head -> logits (B, T, 256)

Parameters are a plain pytree: a nested dict of float32 arrays, no flax/haiku. The per-layer
weights are *stacked* along a leading (n_layers,) axis and the forward pass runs `jax.lax.scan`
over them, so compile time does not grow with depth and the pytree has the same handful of leaves
for every model size (convenient for the learners and the outer optimizer that ship it around).

The output head is NOT tied to the token embedding. It is a separate (d_model, vocab) matrix
initialised to zeros, so at initialisation every logit is 0, the predicted distribution is uniform
and the loss is exactly ln(256) ~= 5.545 nats/byte for every model size. (A tied head would give
logits of std ~0.02 * sqrt(d_model), pushing the initial loss above ln 256 for the larger sizes.)
The trunk still learns from the first step on: the head gets a non-zero gradient immediately and
the trunk's gradient, which flows through the head, becomes non-zero after the first update.
"""

import functools
import math

import jax
import jax.numpy as jnp

# Sizes are defined without JAX (settings and the gateway read them); the model's users find
# them here too.
from shared.model_config import SIZES, ModelConfig, ModelSize, get_config

__all__ = [
    "SIZES",
    "ModelConfig",
    "ModelSize",
    "forward",
    "get_config",
    "init_params",
    "loss_fn",
    "param_count",
]

# -------------------------------------------------------------------------------------------------
# Parameters


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Create freshly initialised parameters (one compiled program: every service process
    builds them at start, and op by op that compiled dozens of small programs).

    Weight matrices are normal with std 0.02 (GPT-2). The two projections that write into the
    residual stream (attention output, MLP output) are scaled down by 1/sqrt(2 * n_layers), so the
    residual stream's variance at init does not grow with depth. Biases are 0, LayerNorm scales 1,
    and the output head is 0 (see the module docstring).

    Args:
        cfg: Model size.
        key: A `jax.random` key. The result is a deterministic function of (cfg, key).

    Returns:
        A nested dict of float32 arrays. Per-layer weights under "blocks" have a leading
        (n_layers,) axis.
    """
    C, L, F, V, T = cfg.d_model, cfg.n_layers, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    std = 0.02
    resid_std = std / math.sqrt(2 * L)
    k_wte, k_wpe, k_qkv, k_attn_out, k_mlp_in, k_mlp_out = jax.random.split(key, 6)

    def normal(k: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(k, shape, dtype=jnp.float32)

    def zeros(*shape: int) -> jax.Array:
        return jnp.zeros(shape, dtype=jnp.float32)

    def layer_norm(*lead: int) -> dict:
        return {"scale": jnp.ones((*lead, C), dtype=jnp.float32), "bias": zeros(*lead, C)}

    return {
        "wte": normal(k_wte, (V, C), std),  # token embedding (V, C)
        "wpe": normal(k_wpe, (T, C), std),  # position embedding (T, C)
        "blocks": {  # every leaf has a leading (L,) axis; forward scans over it
            "ln1": layer_norm(L),
            "attn": {
                "w_qkv": normal(k_qkv, (L, C, 3 * C), std),  # q, k, v projections fused
                "b_qkv": zeros(L, 3 * C),
                "w_out": normal(k_attn_out, (L, C, C), resid_std),
                "b_out": zeros(L, C),
            },
            "ln2": layer_norm(L),
            "mlp": {
                "w_in": normal(k_mlp_in, (L, C, F), std),
                "b_in": zeros(L, F),
                "w_out": normal(k_mlp_out, (L, F, C), resid_std),
                "b_out": zeros(L, C),
            },
        },
        "ln_f": layer_norm(),
        "head": zeros(C, V),  # untied output head (C, V)
    }


def param_count(params) -> int:
    """Total number of scalars in a parameter pytree.

    Args:
        params: Any pytree of arrays (or of `jax.ShapeDtypeStruct`, e.g. from `jax.eval_shape`).

    Returns:
        The summed size of all leaves, as a Python int.
    """
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))


# -------------------------------------------------------------------------------------------------
# Forward pass


def _layer_norm(x: jax.Array, p: dict, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis with a learned scale and bias."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _attention(x: jax.Array, p: dict, n_heads: int) -> jax.Array:
    """Causal multi-head self-attention. x: (B, T, C) -> (B, T, C)."""
    B, T, C = x.shape
    head_dim = C // n_heads

    qkv = x @ p["w_qkv"] + p["b_qkv"]  # (B, T, 3C)
    q, k, v = jnp.split(qkv, 3, axis=-1)  # each (B, T, C)
    # Split channels into heads and move heads next to batch: (B, T, C) -> (B, H, T, hd).
    q, k, v = (t.reshape(B, T, n_heads, head_dim).transpose(0, 2, 1, 3) for t in (q, k, v))

    att = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(head_dim)  # (B, H, T, T)
    # Position t may only look at positions <= t. The diagonal is always allowed, so no row is
    # fully masked and -inf cannot turn into NaN in the softmax.
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))  # (T, T)
    att = jnp.where(causal, att, -jnp.inf)
    att = jax.nn.softmax(att, axis=-1)
    y = att @ v  # (B, H, T, hd)

    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # re-assemble heads: (B, T, C)
    return y @ p["w_out"] + p["b_out"]  # (B, T, C)


def _mlp(x: jax.Array, p: dict) -> jax.Array:
    """Position-wise feed-forward network. x: (B, T, C) -> (B, T, C)."""
    h = jax.nn.gelu(x @ p["w_in"] + p["b_in"], approximate=True)  # (B, T, F)
    return h @ p["w_out"] + p["b_out"]  # (B, T, C)


def _block(x: jax.Array, p: dict, cfg: ModelConfig) -> jax.Array:
    """One pre-LayerNorm transformer block. x: (B, T, C) -> (B, T, C)."""
    x = x + _attention(_layer_norm(x, p["ln1"]), p["attn"], cfg.n_heads)
    x = x + _mlp(_layer_norm(x, p["ln2"]), p["mlp"])
    return x


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Compute next-byte logits.

    Args:
        params: Parameters from `init_params(cfg, ...)` (or trained ones of the same shape).
        tokens: int32 array (B, T) of byte values in [0, 256), with 1 <= T <= cfg.seq_len.
        cfg: Model size; static (pass it via `functools.partial` or `static_argnums` under jit).

    Returns:
        float32 logits (B, T, vocab_size); position t only depends on tokens[:, :t + 1].

    Raises:
        ValueError: If `tokens` is not 2-D or is longer than `cfg.seq_len` (shapes are static,
            so this is checked at trace time).
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (B, T), got {tokens.shape}")
    B, T = tokens.shape
    if not 1 <= T <= cfg.seq_len:
        raise ValueError(f"sequence length {T} is outside [1, seq_len={cfg.seq_len}]")

    x = params["wte"][tokens] + params["wpe"][:T]  # (B, T, C)

    # Run the blocks in order; scan slices layer i's weights off the stacked (L, ...) leaves.
    def step(x: jax.Array, layer_params: dict) -> tuple[jax.Array, None]:
        return _block(x, layer_params, cfg), None

    x, _ = jax.lax.scan(step, x, params["blocks"])  # (B, T, C)

    x = _layer_norm(x, params["ln_f"])  # (B, T, C)
    logits = x @ params["head"]  # (B, T, V)
    return logits.astype(jnp.float32)


def loss_fn(params: dict, batch: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Mean next-byte cross-entropy.

    Args:
        params: Model parameters.
        batch: int32 array (B, T + 1) of byte windows; the model reads batch[:, :-1] and is scored
            on predicting batch[:, 1:]. T must be <= cfg.seq_len.
        cfg: Model size (static under jit).

    Returns:
        Scalar float32: the mean cross-entropy in nats per predicted byte (divide by ln 2 for
        bits per byte). Equals ln(256) ~= 5.545 at initialisation.

    Raises:
        ValueError: If the batch has the wrong rank or is too long for the model.
    """
    if batch.ndim != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must have shape (B, T + 1) with T >= 1, got {batch.shape}")
    inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
    logits = forward(params, inputs, cfg)  # (B, T, V)
    log_probs = jax.nn.log_softmax(logits, axis=-1)  # (B, T, V)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # (B, T)
    return jnp.mean(nll)
