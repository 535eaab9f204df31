"""Parameter pytrees ⇄ flat dicts of named numpy arrays (the form that goes on the wire).

Names are JAX key paths such as ``['blocks'][0]['attn']['wq']``, so a receiver can check that a
message carries exactly the tensors its model has, with the right shapes, before using any of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


class PytreeMismatchError(ValueError):
    """Named tensors do not match the expected parameter structure."""


def flatten_named(tree: Any) -> dict[str, np.ndarray]:
    """Return ``{key path: float32 numpy array}`` (writable copies) for every leaf of ``tree``."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return {jax.tree_util.keystr(path): np.array(leaf, dtype=np.float32) for path, leaf in leaves}


def unflatten_named(template: Any, named: Mapping[str, np.ndarray]) -> Any:
    """Rebuild a pytree shaped like ``template`` from named arrays.

    Raises:
        PytreeMismatchError: if names are missing or extra, or a shape differs.
    """
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    expected = {jax.tree_util.keystr(path): leaf for path, leaf in paths}
    missing = sorted(set(expected) - set(named))
    extra = sorted(set(named) - set(expected))
    if missing or extra:
        raise PytreeMismatchError(
            f"tensor names differ from the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    leaves = []
    for name, leaf in expected.items():
        array = named[name]
        if tuple(array.shape) != tuple(np.shape(leaf)):
            raise PytreeMismatchError(
                f"tensor {name}: expected shape {tuple(np.shape(leaf))}, got {tuple(array.shape)}"
            )
        leaves.append(array)
    return jax.tree_util.tree_unflatten(treedef, leaves)
