"""Paged attention in plain jnp, blocked over pages with an online softmax: the CPU path.

Pallas runs only in interpret mode on CPU, far too slowly to serve with, so XLA
serves there. Unlike the dense reference, this reads only as many page blocks
as the longest sequence in the batch needs (a `fori_loop` with a traced trip
count), so a step's cost follows the real context, not the page table's width.

Queries are grouped into tiles of consecutive tokens of one row, and each tile
gathers its row's pages once: a prefill chunk of 128 tokens in tiles of 16 reads
its pages 8 times a block, not 128 (reading them per token made every step that
carried a prefill chunk several times slower than a decode step).

Pages may be in any `--kv-dtype` storage (jaxserve.device.kv_cache), int8 with its scales:
each block is gathered as stored (its scales through the same page ids) and dequantized
after the gather, so only the block is ever converted, never the pool.
"""

import jax
import jax.numpy as jnp

from .paged_attention import check_scales, compute_dtype
from .storage import dequantize


def tile_shape(num_tokens: int, num_rows: int) -> tuple[int, int]:
    """(tokens a tile, tiles) for a flat batch of `num_tokens` in `num_rows` page-table
    rows (the padding row included): tiles as long as the batch's mean row, and as many
    as the worst split of the tokens into rows can need."""
    size = max(1, num_tokens // max(1, num_rows - 1))
    busy = min(num_rows, num_tokens)  # rows that can hold a token
    return size, min(num_tokens, busy + (num_tokens - busy) // size)


def blocked_paged_attention(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    v_cache: jax.Array,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    layer: jax.Array,  # i32[] the layer to read
    seq_ids: jax.Array,  # i32[num_tokens] row of each token in page_table, rows in order
    positions: jax.Array,  # i32[num_tokens] position of each token in its sequence
    page_table: jax.Array,  # i32[num_rows, max_pages_per_seq]
    scale: float,
    pages_per_block: int = 8,
    *,
    k_scale: jax.Array | None = None,  # f32[num_layers, num_kv_heads, num_pages, page_size]
    v_scale: jax.Array | None = None,  # int8 caches only: dequantized = value * scale
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]
    """Causal attention of each token over its own sequence's pages, block by block.

    A row's tokens must be consecutive in the batch (the packer lays them out so).
    The pages are gathered straight from the whole cache: slicing the layer out first
    would copy that layer's entire pool every step (a cost that grows with the pool,
    not the batch). Tile-major layouts ([tile, kv_head, ...]) measured faster here than
    head-major ones (bench/results/NOTES.md).
    """
    check_scales(k_cache, k_scale, v_scale)
    dtype = compute_dtype(q.dtype, k_cache.dtype)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_cache.shape
    num_rows = page_table.shape[0]
    group = num_heads // num_kv_heads
    block = pages_per_block * page_size
    size, num_tiles = tile_shape(num_tokens, num_rows)

    # each row's tokens, cut into tiles of `size`
    row_len = jnp.zeros(num_rows, jnp.int32).at[seq_ids].add(1)
    row_start = jnp.cumsum(row_len) - row_len
    row_tiles = (row_len + size - 1) // size
    tiles_through = jnp.cumsum(row_tiles)  # tiles of rows 0..r
    row_first_tile = tiles_through - row_tiles
    tile_row = jnp.searchsorted(tiles_through, jnp.arange(num_tiles), side="right")
    tile_row = jnp.minimum(tile_row, num_rows - 1)  # unused tiles read the padding row
    offset = (jnp.arange(num_tiles) - row_first_tile[tile_row])[:, None] * size
    offset = offset + jnp.arange(size)[None, :]  # [tiles, size] token offset in its row
    used = offset < row_len[tile_row][:, None]
    token = jnp.where(used, row_start[tile_row][:, None] + offset, 0)
    tile_pos = jnp.where(used, positions[token], 0)  # unused slots: key 0, never read

    # q as [tile, kv_head, size * group, d]
    qt = (q * scale)[token].reshape(num_tiles, size, num_kv_heads, group, head_dim)
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, size * group, head_dim)
    tile_pages = page_table[tile_row]
    pad = -tile_pages.shape[1] % pages_per_block
    tile_pages = jnp.pad(tile_pages, ((0, 0), (0, pad)))
    num_blocks = (jnp.max(positions) + block) // block  # blocks holding any visible key

    def read(cache: jax.Array, scales: jax.Array | None, pages: jax.Array) -> jax.Array:
        """[tile, kv_head, block, d]: the layer's pages of each tile, dequantized."""
        out = jnp.asarray(cache)[layer, :, pages]  # [tile, pages, kv_head, page_size, d]
        out = out.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, block, head_dim)
        if scales is not None:
            scales = jnp.asarray(scales)[layer, :, pages]  # [tile, pages, kv_head, page_size]
            scales = scales.transpose(0, 2, 1, 3).reshape(num_tiles, num_kv_heads, block)
        return dequantize(out, scales, dtype)

    def step(i, carry):
        m, denom, acc = carry  # running max, softmax denominator, numerator
        pages = jax.lax.dynamic_slice_in_dim(tile_pages, i * pages_per_block, pages_per_block, 1)
        k, v = read(k_cache, k_scale, pages), read(v_cache, v_scale, pages)
        s = jnp.einsum("nkqd,nkbd->nkqb", qt, k, preferred_element_type=jnp.float32)
        s = s.reshape(num_tiles, num_kv_heads, size, group, block)
        visible = i * block + jnp.arange(block)[None, None, :] <= tile_pos[:, :, None]
        s = jnp.where(visible[:, None, :, None, :], s, -jnp.inf)
        s = s.reshape(num_tiles, num_kv_heads, size * group, block)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        denom = denom * correction + p.sum(axis=-1)
        pv = jnp.einsum("nkqb,nkbd->nkqd", p.astype(v.dtype), v,
                        preferred_element_type=jnp.float32)
        return m_new, denom, acc * correction[..., None] + pv

    shape = (num_tiles, num_kv_heads, size * group)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, step, init)
    out = acc / denom[..., None]
    out = out.reshape(num_tiles, num_kv_heads, size, group, head_dim).transpose(0, 2, 1, 3, 4)
    # back to the flat batch: token t is slot (its row's first tile) * size + its offset
    slot = row_first_tile[seq_ids] * size + jnp.arange(num_tokens) - row_start[seq_ids]
    return out.reshape(num_tiles * size, num_heads, head_dim)[slot].astype(q.dtype)
