"""The one way a model multiplies activations by a weight.

Every projection goes through `linear`, so how a weight is stored is decided here and
nowhere else: a plain [in, out] array (in the serving dtype, or another float dtype cast
on the fly), or a `QuantizedWeight` (int8 or fp8 values with one scale per output column,
dequantized on the fly), or a `PackedWeight` (bf16 packed for a CPU kernel, AMX or
AVX512-BF16, which reads it in place). Another storage format (grouped int4) is another
case here; model code does not change. LoRA adapters' terms (`lora_terms`) are computed
here too, so every projection an adapter may target gets them the same way. A layer scan goes
through `scan_layers`, which hands a packed stack to the kernel whole, with the layer's
index.
"""

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.cpu_kernels.linear import packed_linear, slot_linear

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
    passes: int = field(metadata={"static": True})  # 1: x in bf16; 2: f32; 0: int8 (Q4_1)
    layer: jax.Array | None = None  # i32[]
    live: jax.Array | None = None  # i32[]: the step's real tokens, x's first rows (the
    # rest are its bucket's padding, which the kernel leaves uncomputed); None: all rows
    # several projections of one input side by side (`fuse`): each one's output columns
    splits: tuple[int, ...] = field(default=(), metadata={"static": True})


@dataclass(frozen=True, slots=True)
class Norm:
    """An RMSNorm that a projection applies to its input first (`linear`)."""

    weight: jax.Array  # [in]
    eps: float


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = row_sum(x32 * x32) / x32.shape[-1]
    normed = x32 * jax.lax.rsqrt(mean + eps)
    return (normed * weight).astype(x.dtype)


def row_sum(x: jax.Array) -> jax.Array:
    """x's sum over its last axis (kept, size 1), added in one order whatever the rows.

    XLA:CPU reduces a row in an order that depends on how many rows there are (a norm's
    mean of 1 or 4 rows differed in its last bit from that of 8 or 16 on an Intel Xeon),
    so a decode row's outputs depended on its step's bucket. Halving the row (zero-padded
    to a power of two) and adding the halves elementwise fixes the order."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


Input = jax.Array | tuple[jax.Array, jax.Array]  # a projection's x, or (gate, up) if gated


def prologue(x: Input, norm: Norm | None = None, gated: bool = False) -> jax.Array:
    """What a projection's input goes through first (`linear`), in XLA."""
    if gated:
        return swiglu(*x)
    return x if norm is None else rms_norm(x, norm.weight, norm.eps)


def linear(x: Input, w: jax.Array | QuantizedWeight | PackedWeight, norm: Norm | None = None,
           gated: bool = False, residual: jax.Array | None = None) -> jax.Array:
    """x @ w for x [..., in] and a weight [in, out] in any storage, in x's dtype; x
    RMS-normalized first by `norm` if given, or, `gated`, x the pair (gate, up) taken as
    `swiglu(gate, up)`; `residual + x @ w` where a residual is given. A packed weight's
    kernel does these itself, with the bits XLA gives them (in XLA the norm and swiglu
    were fusions of ~5 % and ~6 % of a 256-token prefill on an Intel Xeon: the norm's sum
    ran a scalar add at a time); gate and up reach it side by side, which on one CPU
    device XLA lays out without a copy (on a mesh, where they are split over the devices'
    columns, the pair is never joined)."""
    if isinstance(w, PackedWeight):
        joined = jnp.concatenate(x, axis=-1) if gated else x
        return packed_linear(joined.astype(jnp.float32), w.values, w.layer, w.backend,
                             w.passes, *((norm.weight, norm.eps) if norm else ()), gated=gated,
                             residual=residual, live=w.live).astype(joined.dtype)
    y = _product(prologue(x, norm, gated), w)
    return y if residual is None else residual + y


def _product(x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    if isinstance(w, QuantizedWeight):
        return (x @ w.values.astype(x.dtype)) * w.scale.astype(x.dtype)
    return x @ w.astype(x.dtype)


def fuse(weights: list[PackedWeight]) -> PackedWeight | None:
    """Projections of one input packed side by side, for one kernel call instead of one
    each (`linear_group`); None unless all are packed alike. On a Zen 5, q/k/v as one call
    took 0.6x the time of three at a 16-row decode (k and v alone were too few columns to
    keep both cores busy), gate/up 0.95x."""
    first = weights[0]
    if len(weights) < 2 or not all(
            isinstance(w, PackedWeight) and not w.splits and w.backend == first.backend
            and w.passes == first.passes and w.values.shape[:-4] == first.values.shape[:-4]
            and w.values.shape[-3:] == first.values.shape[-3:] for w in weights):
        return None
    values = jnp.concatenate([w.values for w in weights], axis=-4)
    return PackedWeight(values, first.backend, first.passes,
                        splits=tuple(w.values.shape[-4] * 16 for w in weights))


def linear_group(x: Input, weights: dict, group: str, members: tuple[str, ...],
                 norm: Norm | None = None, gated: bool = False,
                 residual: jax.Array | None = None) -> list[jax.Array]:
    """x (through `norm` or `gated` first, as `linear` takes them) @ each member projection
    of `weights` (which all read x): by one call where the group's projections were fused
    (weights[group], `fuse`), else one each. A residual is added to a group of one."""
    fused = weights.get(group)
    if residual is not None and (fused is not None or len(members) != 1):
        raise ValueError(f"a residual is added to one projection, not to {group}'s")
    if fused is not None:
        y = linear(x, fused, norm, gated)
        return jnp.split(y, np.cumsum(fused.splits)[:-1].tolist(), axis=-1)
    if len(members) == 1:
        return [linear(x, weights[members[0]], norm, gated, residual)]
    x = prologue(x, norm, gated)  # once, not in each member's call
    return [linear(x, weights[name]) for name in members]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class LoraGroup:
    """One layer's LoRA adapter slots for projections that read the same input (their A's
    side by side in one, each one's B), and each token's weight on the slots' rank
    columns (device/adapters.py)."""

    a: jax.Array | PackedWeight  # f32[in, members × width] (or packed)
    b: tuple[jax.Array | PackedWeight, ...]  # each f32[width, out] (or packed)
    mix: jax.Array  # f32[num_tokens, width]
    active: jax.Array  # bool[]: some token of the step has an adapter
    token_slots: jax.Array  # i32[num_tokens]: each token's slot, 0: none
    rank: int = field(metadata={"static": True})  # the columns of one slot


def lora_terms(x: jax.Array, group: LoraGroup) -> list[jax.Array]:
    """Each projection's adapter term (x @ A × mix) @ B, in x's dtype: one matmul by the
    group's A, one by each B; zeros, without computing them, in a step where no token
    has an adapter. A packed stack multiplies each token by its own slot's part only
    (`slot_linear`), an f32 one by every slot's (the mix zeroes the others')."""
    def outputs(b):
        return b.values.shape[-4] * 16 if isinstance(b, PackedWeight) else b.shape[-1]

    def by_slots(x, w, by_inputs):
        if not isinstance(w, PackedWeight):
            return linear(x, w)
        return slot_linear(x, w.values, w.layer, group.token_slots, group.rank, by_inputs,
                           1 if by_inputs else len(group.b), w.backend, w.passes)

    def terms(x):
        xa = by_slots(x.astype(jnp.float32), group.a, by_inputs=False)
        return [by_slots(part * group.mix, b, by_inputs=True).astype(x.dtype)
                for part, b in zip(jnp.split(xa, len(group.b), axis=-1), group.b)]

    def zeros(x):
        return [jnp.zeros((*x.shape[:-1], outputs(b)), x.dtype) for b in group.b]

    return jax.lax.cond(group.active, terms, zeros, x)


def scan_layers(body, carry, weights: dict, live: jax.Array | None = None):
    """jax.lax.scan of body(carry, one layer's weights) over weights stacked on a leading
    [num_layers] axis (a nested dict too); a PackedWeight is passed whole, with the layer's
    index and the step's `live` tokens (PackedWeight's)."""
    sliced = jax.tree.map(lambda w: None if isinstance(w, PackedWeight) else w, weights,
                          is_leaf=is_packed)
    num_layers = jax.tree.leaves(sliced)[0].shape[0]

    def step(carry, xs):
        i, layer = xs

        def at_layer(whole, sliced):
            return dataclasses.replace(whole, layer=i, live=live) if (
                isinstance(whole, PackedWeight)) else sliced

        return body(carry, jax.tree.map(at_layer, weights, layer, is_leaf=is_packed))

    return jax.lax.scan(step, carry, (jnp.arange(num_layers, dtype=jnp.int32), sliced))


def is_packed(x: object) -> bool:
    """A PackedWeight (for jax.tree functions' is_leaf: one is not walked into)."""
    return isinstance(x, PackedWeight)


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
