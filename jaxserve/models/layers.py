"""The one way a model multiplies activations by a weight.

Every projection goes through `linear`, so how a weight is stored is decided here and
nowhere else: a plain [in, out] array, or an `Int8Weight` (int8 values with one scale per
output column, dequantized on the fly). Another storage format (fp8, grouped int4) is
another case here; model code does not change.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A weight stored as int8: w ≈ values × scale, one scale per output column. Leading
    axes (stacked layers) are kept on both, so a layer scan slices it like an array."""

    values: jax.Array  # i8[..., in, out]
    scale: jax.Array  # f32[..., out]


def linear(x: jax.Array, w: jax.Array | Int8Weight) -> jax.Array:
    """x @ w for x [..., in] and a weight [in, out] in any storage, in x's dtype."""
    if isinstance(w, Int8Weight):
        return (x @ w.values.astype(x.dtype)) * w.scale.astype(x.dtype)
    return x @ w


def quantize_int8(w: jax.Array) -> Int8Weight:
    """Symmetric int8 with one scale per output column (absmax / 127)."""
    scale = jnp.max(jnp.abs(w), axis=-2).astype(jnp.float32) / 127.0
    safe = jnp.where(scale == 0, 1.0, scale)
    values = jnp.round(w.astype(jnp.float32) / safe[..., None, :])
    return Int8Weight(values.astype(jnp.int8), scale)
