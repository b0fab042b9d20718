"""The one way a model multiplies activations by a weight.

Every projection goes through `linear`, so how a weight is stored is decided here and
nowhere else: a plain [in, out] array (in the serving dtype, or another float dtype cast
on the fly), or a `QuantizedWeight` (int8 or fp8 values with one scale per output column,
dequantized on the fly), or a `PackedWeight` (bf16 packed for a CPU kernel, AMX or
AVX512-BF16, which reads it in place). Another storage format (grouped int4) is another
case here; model code does not change. A LoRA adapter's term (`LoraTerm`) is added here
too, so every projection an adapter may target gets it the same way. A layer scan goes
through `scan_layers`, which hands a packed stack to the kernel whole, with the layer's
index.
"""

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.cpu_kernels.linear import packed_linear

FLOAT_STORAGE = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
# quantized storage: its numpy dtype and the largest magnitude it holds (fp8 is e4m3)
QUANTIZED_STORAGE = {"int8": (np.int8, 127.0), "fp8": (ml_dtypes.float8_e4m3fn, 448.0)}


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight stored as int8 or fp8: w ≈ values × scale, one scale per output column.
    Leading axes (stacked layers) are kept on both, so a layer scan slices it like an
    array."""

    values: jax.Array  # i8 or f8e4m3[..., in, out]
    scale: jax.Array  # f32[..., out]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A bf16 weight packed into AMX tiles (cpu_kernels/linear.py's `pack`) for the kernel
    `backend` names, which rounds the activations to bf16 (`passes` 1) or not (2): one
    weight, or a stack of layers and, inside `scan_layers`, the layer to read. The stack is
    not sliced per layer, as a scan slices its inputs, because XLA copies such a slice
    before using it: a third more memory traffic than the matmul's own."""

    values: jax.Array  # u16[..., out/16, in/32, 16, 32]
    backend: str = field(metadata={"static": True})  # a key of cpu_kernels.linear.KERNELS
    passes: int = field(metadata={"static": True})  # 1: activations in bf16; 2: in f32
    layer: jax.Array | None = None  # i32[]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class LoraTerm:
    """One layer's adapter slots for one projection, and each token's weight on their rank
    columns (device/adapters.py): the term x @ a × mix @ b that LoRA adds."""

    a: jax.Array  # f32[in, slots × rank]
    b: jax.Array  # f32[slots × rank, out]
    mix: jax.Array  # f32[num_tokens, slots × rank]
    active: jax.Array  # bool[]: some token of the step has an adapter


def linear(x: jax.Array, w: jax.Array | QuantizedWeight | PackedWeight,
           lora: LoraTerm | None = None) -> jax.Array:
    """x @ w for x [num_tokens, in] and a weight [in, out] in any storage, in x's dtype,
    plus the tokens' adapter terms if `lora` is given (skipped in a step without one)."""
    if isinstance(w, PackedWeight):
        y = packed_linear(x.astype(jnp.float32), w.values, w.layer, w.backend, w.passes
                          ).astype(x.dtype)
    elif isinstance(w, QuantizedWeight):
        y = (x @ w.values.astype(x.dtype)) * w.scale.astype(x.dtype)
    else:
        y = x @ w.astype(x.dtype)
    if lora is None:
        return y

    def term(x):
        return (((x.astype(jnp.float32) @ lora.a) * lora.mix) @ lora.b).astype(y.dtype)

    return y + jax.lax.cond(lora.active, term, lambda x: jnp.zeros_like(y), x)


def scan_layers(body, carry, weights: dict):
    """jax.lax.scan of body(carry, one layer's weights) over weights stacked on a leading
    [num_layers] axis; a PackedWeight is passed whole, with the layer's index."""
    packed = {name: w for name, w in weights.items() if isinstance(w, PackedWeight)}
    sliced = {name: w for name, w in weights.items() if name not in packed}
    num_layers = jax.tree.leaves(weights)[0].shape[0]

    def step(carry, xs):
        i, layer = xs
        at_layer = {n: PackedWeight(w.values, w.backend, w.passes, i) for n, w in packed.items()}
        return body(carry, {**layer, **at_layer})

    return jax.lax.scan(step, carry, (jnp.arange(num_layers, dtype=jnp.int32), sliced))


def quantize(w: np.ndarray | jax.Array, weight_dtype: str) -> QuantizedWeight:
    """Symmetric per-output-column quantization (absmax ÷ the format's largest value), on
    the host: a layer stack is quantized before it reaches the device."""
    storage, largest = QUANTIZED_STORAGE[weight_dtype]
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=-2) / largest
    scaled = w / np.where(scale == 0, 1.0, scale)[..., None, :]
    if weight_dtype == "int8":
        scaled = np.round(scaled)
    return QuantizedWeight(scaled.astype(storage), scale.astype(np.float32))


def store(w: np.ndarray, weight_dtype: str) -> np.ndarray | QuantizedWeight:
    """A projection weight (host array, in the serving dtype) as `weight_dtype` stores it."""
    if weight_dtype in QUANTIZED_STORAGE:
        return quantize(w, weight_dtype)
    if weight_dtype in FLOAT_STORAGE:
        return np.asarray(w).astype(FLOAT_STORAGE[weight_dtype])
    return w


def abstract_stored(shape: tuple[int, ...], dtype: jnp.dtype, weight_dtype: str
                    ) -> jax.ShapeDtypeStruct | QuantizedWeight:
    """The shapes and dtypes `store` gives a weight of `shape`: what a checkpoint restores."""
    if weight_dtype in QUANTIZED_STORAGE:
        return QuantizedWeight(
            jax.ShapeDtypeStruct(shape, QUANTIZED_STORAGE[weight_dtype][0]),
            jax.ShapeDtypeStruct(shape[:-2] + shape[-1:], jnp.float32),
        )
    return jax.ShapeDtypeStruct(shape, FLOAT_STORAGE.get(weight_dtype, dtype))


def map_stored(fn, value, axes: tuple[str | None, ...] | None):
    """fn(array, its logical axes) over a stored weight: a plain array, or a
    QuantizedWeight's values (the weight's axes) and scale (those less the input axis).
    Placing, sharding and restoring a weight all go through here."""
    if isinstance(value, QuantizedWeight):
        return QuantizedWeight(fn(value.values, axes),
                               fn(value.scale, axes and axes[:-2] + axes[-1:]))
    return fn(value, axes)
