"""Model sizes: the hyper-parameters of each size, without the model's JAX code.

Settings, the job spec and the gateway validate a size name and read a context length from
here without importing JAX; ``shared/model.py`` builds and runs the model of a size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ModelSize = Literal["tiny", "small", "medium", "large"]


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one model size. Frozen, so it is hashable and can be a static jit arg.

    Attributes:
        name: Size name, a key of `SIZES`.
        d_model: Width of the residual stream (C).
        n_layers: Number of transformer blocks.
        n_heads: Number of attention heads; must divide d_model.
        d_ff: Hidden width of the MLP.
        seq_len: Context length used for training/eval windows; also the number of learned
            position embeddings, so it is the longest sequence `forward` accepts.
        vocab_size: 256, one token per byte value.
    """

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int
    vocab_size: int = 256

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"{self.name}: d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )

    @property
    def param_count(self) -> int:
        """Parameters of the model ``shared/model.py`` builds: per block the attention's
        qkv and output projections with biases (4C² + 4C), two layer norms (4C) and the MLP
        (2CF + F + C); then token and position embeddings, the final norm and the head."""
        c, f, v = self.d_model, self.d_ff, self.vocab_size
        block = 4 * c * c + 2 * c * f + 9 * c + f
        return self.n_layers * block + 2 * v * c + self.seq_len * c + 2 * c

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of every tensor ``shared/model.py`` builds, named as on the wire
        (``shared.pytree.flatten_named``: JAX key paths, sorted), without importing JAX."""
        c, f, v, n = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        shapes = {
            "['blocks']['attn']['b_out']": (n, c),
            "['blocks']['attn']['b_qkv']": (n, 3 * c),
            "['blocks']['attn']['w_out']": (n, c, c),
            "['blocks']['attn']['w_qkv']": (n, c, 3 * c),
            "['blocks']['ln1']['bias']": (n, c),
            "['blocks']['ln1']['scale']": (n, c),
            "['blocks']['ln2']['bias']": (n, c),
            "['blocks']['ln2']['scale']": (n, c),
            "['blocks']['mlp']['b_in']": (n, f),
            "['blocks']['mlp']['b_out']": (n, c),
            "['blocks']['mlp']['w_in']": (n, c, f),
            "['blocks']['mlp']['w_out']": (n, f, c),
            "['head']": (c, v),
            "['ln_f']['bias']": (c,),
            "['ln_f']['scale']": (c,),
            "['wpe']": (self.seq_len, c),
            "['wte']": (v, c),
        }
        return shapes


SIZES: dict[ModelSize, ModelConfig] = {
    # For unit tests: compiles and runs in well under a second on a laptop CPU.
    "tiny": ModelConfig(name="tiny", d_model=48, n_layers=2, n_heads=4, d_ff=192, seq_len=64),
    # The 2-core CPU demo.
    "small": ModelConfig(name="small", d_model=128, n_layers=3, n_heads=4, d_ff=512, seq_len=128),
    # For a single accelerator.
    "medium": ModelConfig(
        name="medium", d_model=384, n_layers=6, n_heads=6, d_ff=1536, seq_len=512
    ),
    # GPT-2-small-like width, a little deeper, for real accelerators.
    "large": ModelConfig(
        name="large", d_model=768, n_layers=14, n_heads=12, d_ff=3072, seq_len=1024
    ),
}
if tuple(SIZES) != get_args(ModelSize):
    raise ImportError("SIZES and ModelSize must name the same sizes, in the same order")


def get_config(name: str) -> ModelConfig:
    """Look up a model size by name.

    Args:
        name: One of the keys of `SIZES` ("tiny", "small", "medium", "large").

    Returns:
        The matching `ModelConfig`.

    Raises:
        ValueError: If `name` is not a known size; the message lists the valid sizes.
    """
    try:
        return SIZES[name]  # type: ignore[index]
    except KeyError:
        valid = ", ".join(SIZES)
        raise ValueError(f"unknown model size {name!r}; valid sizes are: {valid}") from None
