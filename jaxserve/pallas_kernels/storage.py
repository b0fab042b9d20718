"""How a KV page holds its values, as every attention kernel reads them.

bf16 and fp8 values live in the pool as their bits. XLA:CPU computes those types in f32,
so a scatter into a bf16 or fp8 pool converted all of it, there and back, every layer of
every step (SmolLM2: a 1.9 s decode step against 80 ms with f32 or int8 pages); unsigned
integers of the same width scatter in place, and readers reinterpret only the pages they
gather (`dequantize`). int8 values come with one f32 scale per token and head. The write
side (quantize, the pool itself) is jaxserve.device.kv_cache.
"""

import jax
import jax.numpy as jnp

BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
        jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8)}
VALUES = {bits: value for value, bits in BITS.items()}


def value_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The values a pool (or a block of it) of `dtype` holds: bf16 or fp8 for their bits."""
    return VALUES.get(jnp.dtype(dtype), jnp.dtype(dtype))


def dequantize(values: jax.Array, scale: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """Stored values (bf16 and fp8 as their bits; with their scale, [...] for values
    [..., head_dim]) in `dtype`."""
    if values.dtype in VALUES:
        values = jax.lax.bitcast_convert_type(values, VALUES[values.dtype])
    out = values.astype(dtype)
    return out if scale is None else out * scale[..., None].astype(dtype)
