"""The paged KV cache on the device: one pool of fixed-size pages for every layer.

Head-major layout, [layer, kv_head, page, slot, head_dim]: one head's page is a
contiguous [page_size, head_dim] tile, which is what an attention kernel loads,
and KV heads are the axis that tensor parallelism shards (where tp divides them;
the pool is replicated otherwise, see sharding.py). For the C++ CPU kernel K is kept
transposed (`k_transposed`): [layer, kv_head, page, head_dim, slot], so a decode's few
queries read a page's keys on a vector's lanes as it is stored, instead of transposing
every page they read (cpu_kernels/paged_attention.cc).

Page 0 is a reserved null page: padding rows point at it and write into it, so
no real page is ever touched by padding.

Storage (`--kv-dtype`, `KV_STORAGE`): f32 or bf16 as is; int8 with one f32 scale per
token and head (absmax ÷ 127, written with the values: int8 has no range of its own);
fp8 (e4m3) calibrated per (layer, KV head, channel): stored = (x − center) ÷ channel
scale, one byte an element as vLLM's fp8 KV. The center is the channel's mean and the
scale maps 4× its largest deviation onto ±448, both over a calibration text at start-up
(`ModelRunner.calibrate_kv`). Post-RoPE keys carry large near-constant channels and values
small ones that unscaled e4m3 rounds badly or into its subnormals: on SmolLM2 unscaled fp8
cost 2.46 % of the log-likelihood, calibrated 0.3-0.5 %. The calibration is applied around
the attention backends (device/attention.py), which read fp8 pages as they read any
unscaled storage: K's channel scales multiply q; V's multiply the output and V's center is
added to it; K's center shifts each query's scores by one constant, which the softmax
ignores. Every attention backend dequantizes with `dequantize`.
"""

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.storage import BITS, value_dtype

# --kv-dtype's choices past auto: how pages store K and V
KV_STORAGE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8,
              "fp8": jnp.float8_e4m3fn, "f16": jnp.float16}  # f16: only --dtype float16's auto
SCALED = ("int8",)  # storages that keep a scale per token and head
CALIBRATED = ("fp8",)  # storages calibrated per (layer, head, channel): a center and a scale
FP8_MAX = 448.0  # e4m3's largest finite value
CALIBRATION_TOKENS = 2048  # the calibration prompt, at most
CALIBRATION_HEADROOM = 4.0  # a channel's scale fits 4x the deviation seen in calibration
# bf16 and fp8 pools hold their bits (BITS; why: jaxserve.pallas_kernels.storage)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class KVCache:
    """Keys and values of every layer, paged. Donated to the step and updated in place."""

    k: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim] (see BITS)
    v: jax.Array
    # SCALED storages only: f32[num_layers, num_kv_heads, num_pages, page_size]; else None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    # CALIBRATED storages only: f32[num_layers, num_kv_heads, head_dim]; else None.
    # stored = (x - center) / channel_scale
    k_center: jax.Array | None = None
    v_center: jax.Array | None = None
    k_channel_scale: jax.Array | None = None
    v_channel_scale: jax.Array | None = None
    # k is [num_layers, num_kv_heads, num_pages, head_dim, page_size] (the CPU kernel's)
    k_transposed: bool = field(default=False, metadata={"static": True})

    @property
    def page_size(self) -> int:
        return self.v.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]


def storage_name(dtype: jnp.dtype) -> str:
    """The --kv-dtype name of a value or pool dtype."""
    dtype = value_dtype(dtype)
    return next(name for name, d in KV_STORAGE.items() if jnp.dtype(d) == dtype)


def init_kv_cache(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype = jnp.float32,
    sharding: jax.sharding.Sharding | None = None,
    scale_sharding: jax.sharding.Sharding | None = None,
    calibration_sharding: jax.sharding.Sharding | None = None,
    k_transposed: bool = False,
) -> KVCache:
    """Allocate a zeroed pool for values of `dtype` (a KV_STORAGE dtype; bf16 and fp8 as
    their bits); `num_pages` counts the null page. With a `sharding` (and `scale_sharding`
    and `calibration_sharding` for the scales and the calibration), each device allocates
    only its own shard. `k_transposed`: K's pages [head_dim, page_size] (the CPU kernel's)."""
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    k_shape = (*shape[:3], head_dim, page_size) if k_transposed else shape
    pool = BITS.get(jnp.dtype(dtype), jnp.dtype(dtype))
    name = storage_name(dtype)
    scales, calibration = [None, None], [None] * 4
    if name in SCALED:
        scales = [jnp.zeros(shape[:-1], jnp.float32, device=scale_sharding) for _ in "kv"]
    if name in CALIBRATED:  # uncalibrated: centers 0, channel scales 1
        channels = (num_layers, num_kv_heads, head_dim)
        calibration = [jnp.full(channels, fill, jnp.float32, device=calibration_sharding)
                       for fill in (0.0, 0.0, 1.0, 1.0)]
    return KVCache(
        jnp.zeros(k_shape, pool, device=sharding), jnp.zeros(shape, pool, device=sharding),
        *scales, *calibration, k_transposed=k_transposed,
    )


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array | None]:
    """x [..., head_dim] as a pool of `dtype` (a value dtype, or the bits that hold one)
    stores it: the values, bf16 and fp8 as their bits (fp8 clipped to ±448), and for int8
    one f32 scale per vector (absmax ÷ 127; a zero vector gets scale 0)."""
    value = value_dtype(dtype)
    scale = None
    if value == jnp.int8:
        x = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
        safe = jnp.where(scale == 0, 1.0, scale)[..., None]
        x = jnp.clip(jnp.round(x / safe), -127, 127)
    elif value == jnp.float8_e4m3fn:
        x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    x = x.astype(value)
    if value in BITS:
        x = jax.lax.bitcast_convert_type(x, BITS[value])
    return x, scale


def write_kv(
    cache: KVCache,
    layer: jax.Array,  # i32[] layer index
    slot_mapping: jax.Array,  # i32[num_tokens] page * page_size + offset
    k: jax.Array,  # f32[num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # f32[num_tokens, num_kv_heads, head_dim]
) -> KVCache:
    """Scatter this step's new keys and values (and scales) into their pages, in place
    under donation; less their centers, where the storage keeps them."""
    pages = slot_mapping // cache.page_size
    offsets = slot_mapping % cache.page_size
    if cache.k_center is not None:
        k = (k - cache.k_center[layer]) / cache.k_channel_scale[layer]
        v = (v - cache.v_center[layer]) / cache.v_channel_scale[layer]
    (k, k_scale), (v, v_scale) = quantize(k, cache.k.dtype), quantize(v, cache.v.dtype)

    def scatter(pool: jax.Array | None, new: jax.Array | None) -> jax.Array | None:
        # the advanced indices (layer, pages, offsets) around the head slice put tokens first
        return None if pool is None else pool.at[layer, :, pages, offsets].set(new)

    # a transposed K: the advanced indices around the head and head_dim slices, tokens first
    k_pool = (cache.k.at[layer, :, pages, :, offsets].set(k) if cache.k_transposed
              else scatter(cache.k, k))
    return KVCache(k_pool, scatter(cache.v, v),
                   scatter(cache.k_scale, k_scale), scatter(cache.v_scale, v_scale),
                   cache.k_center, cache.v_center, cache.k_channel_scale, cache.v_channel_scale,
                   cache.k_transposed)


def calibration_text() -> str:
    """The text fp8 KV is calibrated on: the opening of Python's own argparse.py, prose and
    code that every install has, so every start calibrates alike."""
    return Path(argparse.__file__).read_text()[:20_000]
