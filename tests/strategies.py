"""Hypothesis strategies for what a hostile or broken peer can leave where a record belongs."""

from __future__ import annotations

import json

from hypothesis import strategies as st
from pydantic import BaseModel

#: Any JSON value: scalars (integers past 64 bits, no NaN) nested in lists and objects.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=20,
)


def near_objects(*models: type[BaseModel]) -> st.SearchStrategy[bytes]:
    """JSON objects whose keys are mostly the models' own field names, holding any values."""
    names = sorted({name for model in models for name in model.model_fields})
    keys = st.sampled_from(names) | st.text(max_size=8)
    return st.dictionaries(keys, json_values, max_size=len(names) + 2).map(
        lambda body: json.dumps(body).encode()
    )


def record_bytes(*models: type[BaseModel]) -> st.SearchStrategy[bytes]:
    """Bytes found where one of the models' records belongs: near-miss objects, any JSON value,
    and arbitrary bytes."""
    return (
        near_objects(*models)
        | json_values.map(lambda value: json.dumps(value).encode())
        | st.binary(max_size=200)
    )
