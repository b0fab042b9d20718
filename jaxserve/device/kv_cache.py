"""The paged KV cache on the device: one pool of fixed-size pages for every layer.

Head-major layout, [layer, kv_head, page, slot, head_dim]: one head's page is a
contiguous [page_size, head_dim] tile, which is what an attention kernel loads,
and KV heads are the axis that tensor parallelism shards (where tp divides them;
the pool is replicated otherwise, see sharding.py).

Page 0 is a reserved null page: padding rows point at it and write into it, so
no real page is ever touched by padding.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class KVCache:
    """Keys and values of every layer, paged. Donated to the step and updated in place."""

    k: jax.Array  # f32[num_layers, num_kv_heads, num_pages, page_size, head_dim]
    v: jax.Array  # f32[num_layers, num_kv_heads, num_pages, page_size, head_dim]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]


def init_kv_cache(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype = jnp.float32,
    sharding: jax.sharding.Sharding | None = None,
) -> KVCache:
    """Allocate a zeroed pool; `num_pages` counts the null page.

    With a `sharding`, each device allocates only its own shard.
    """
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype, device=sharding), v=jnp.zeros(shape, dtype, device=sharding)
    )


def write_kv(
    cache: KVCache,
    layer: jax.Array,  # i32[] layer index
    slot_mapping: jax.Array,  # i32[num_tokens] page * page_size + offset
    k: jax.Array,  # f32[num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # f32[num_tokens, num_kv_heads, head_dim]
) -> KVCache:
    """Scatter this step's new keys and values into their pages (in place under donation)."""
    pages = slot_mapping // cache.page_size
    offsets = slot_mapping % cache.page_size
    # the advanced indices (layer, pages, offsets) around the head slice put tokens first
    return KVCache(
        k=cache.k.at[layer, :, pages, offsets].set(k.astype(cache.k.dtype)),
        v=cache.v.at[layer, :, pages, offsets].set(v.astype(cache.v.dtype)),
    )
