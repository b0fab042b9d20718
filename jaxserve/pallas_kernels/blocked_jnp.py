"""Paged attention in plain jnp, blocked over pages with an online softmax: the CPU path.

Pallas runs only in interpret mode on CPU, far too slowly to serve with, so XLA
serves there. Unlike the dense reference, this reads only as many page blocks
as the longest sequence in the batch needs (a `fori_loop` with a traced trip
count), so a step's cost follows the real context, not the page table's width.
"""

import jax
import jax.numpy as jnp


def blocked_paged_attention(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    k_cache: jax.Array,  # f32[num_layers, num_kv_heads, num_pages, page_size, head_dim]
    v_cache: jax.Array,  # f32[num_layers, num_kv_heads, num_pages, page_size, head_dim]
    layer: jax.Array,  # i32[] the layer to read
    seq_ids: jax.Array,  # i32[num_tokens] row of each token in page_table
    positions: jax.Array,  # i32[num_tokens] position of each token in its sequence
    page_table: jax.Array,  # i32[num_rows, max_pages_per_seq]
    scale: float,
    pages_per_block: int = 8,
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]
    """Causal attention of each token over its own sequence's pages, block by block.

    The pages are gathered straight from the whole cache: slicing the layer out
    first would copy that layer's entire pool every step (a cost that grows with
    the pool, not the batch).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block = pages_per_block * page_size
    token_pages = page_table[seq_ids]  # i32[T, max_pages]
    pad = -token_pages.shape[1] % pages_per_block
    token_pages = jnp.pad(token_pages, ((0, 0), (0, pad)))
    qg = (q * scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    num_blocks = (jnp.max(positions) + block) // block  # blocks holding any visible key

    def step(i, carry):
        m, denom, acc = carry  # running max, softmax denominator, numerator
        pages = jax.lax.dynamic_slice_in_dim(token_pages, i * pages_per_block, pages_per_block, 1)
        # [T, pages, kv_head, slot, d] -> [T, kv_head, block, d]
        k = k_cache[layer, :, pages].transpose(0, 2, 1, 3, 4).reshape(
            num_tokens, num_kv_heads, block, head_dim
        )
        v = v_cache[layer, :, pages].transpose(0, 2, 1, 3, 4).reshape(
            num_tokens, num_kv_heads, block, head_dim
        )
        s = jnp.einsum("tkgd,tkbd->tkgb", qg, k, preferred_element_type=jnp.float32)
        visible = i * block + jnp.arange(block)[None, :] <= positions[:, None]  # [T, block]
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        denom = denom * correction + p.sum(axis=-1)
        pv = jnp.einsum("tkgb,tkbd->tkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, denom, acc * correction[..., None] + pv

    init = (
        jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, step, init)
    return (acc / denom[..., None]).reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
