"""Ragged paged attention as a Pallas kernel: prefill chunks and decodes in one call.

The batch is flat: row r's query tokens are `q[cu_q_lens[r]:cu_q_lens[r + 1]]`, the last
`q_len` of its `kv_lens[r]` tokens, so token t of row r sits at position
`kv_lens[r] - (cu_q_lens[r + 1] - t)` and attends causally to the row's cached keys up to
it. A decode is a row with q_len 1; a full prefill has q_len = kv_len; a chunk continuing a
prefix has q_len < kv_len. Padding reads nothing: a row with q_len 0 computes nothing, and
tokens from `cu_q_lens[-1]` on get zeros.

Design: a q-block is up to `block_q` consecutive tokens of one row. A few jnp ops before the
call lay the rows' q-blocks end to end (row r has cdiv(q_len, block_q) of them) and give
each its row and first token, so the grid, (q-blocks, KV heads), has no empty programs
except a tail of at most `num_rows` (its size must not depend on the data). A program loads
its tokens' query heads of one KV-head group as one `[block_q * group, head_dim]` tile, so
each K/V page it reads serves every query head of the group (K/V are never copied per query
head; a long prefill chunk re-reads its row's pages once per q-block), and walks the row's
page blocks up to the block's causal limit with the online softmax of `paged_attention`,
masking keys past each token's position. Loads and stores at the q-block's token offset are
masked to the row's tokens.

Backend: Pallas' Triton backend on NVIDIA GPUs, selected by explicit Triton compiler params,
for the reasons given in `paged_attention.py`; there, `block_q * group` (the group padded to a
power of two) must be a power of two >= 16. On CPU only `interpret=True` runs.

Storage: as in `paged_attention.py`, pages in any `--kv-dtype` storage (int8 with its
scales) are read as stored and dequantized after the gather, inside the kernel.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# the sibling kernel module holds the checks, the K/V block and the softmax step
from . import paged_attention as paged


def schedule_q_blocks(
    cu_q_lens: jax.Array,  # i32[num_rows + 1]
    num_tokens: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array]:  # i32[num_programs] row, i32[num_programs] first token
    """Lay every row's q-blocks end to end; the tail programs get an empty block."""
    num_rows = cu_q_lens.shape[0] - 1
    # sum_r cdiv(q_len_r, block_q) <= cdiv(num_tokens, block_q) + num_rows
    num_programs = pl.cdiv(num_tokens, block_q) + num_rows
    q_lens = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    program = jnp.arange(num_programs, dtype=jnp.int32)
    rows = jnp.searchsorted(ends, program, side="right")
    live = rows < num_rows
    rows = jnp.minimum(rows, num_rows - 1)
    first = cu_q_lens[rows] + (program - ends[rows] + blocks[rows]) * block_q
    # a tail program starts at the last row's end, so it holds no token
    first = jnp.where(live, first, cu_q_lens[num_rows])
    return rows.astype(jnp.int32), first.astype(jnp.int32)


def _ragged_kernel(
    layer_ref,  # i32[1] the layer to read
    block_rows_ref,  # i32[num_programs] row of each q-block
    block_starts_ref,  # i32[num_programs] first token of each q-block
    cu_q_lens_ref,  # i32[num_rows + 1]
    kv_lens_ref,  # i32[num_rows]
    page_table_ref,  # i32[num_rows, max_pages]
    q_ref,  # [num_tokens, group, head_dim] this KV head's query heads
    k_ref,  # [num_layers, num_pages, page_size, head_dim] this KV head's pools
    v_ref,  # [num_layers, num_pages, page_size, head_dim]
    *refs,  # where scaled, k_scale_ref and v_scale_ref (f32[num_layers, num_pages,
    # page_size]); then o_ref [num_tokens, group, head_dim]
    scale: float,
    block_q: int,
    pages_per_block: int,
    scaled: bool,
):
    scale_refs, (o_ref,) = paged.split_scale_refs(refs, scaled)
    program = pl.program_id(0)
    row = block_rows_ref[program]
    q_start = block_starts_ref[program]
    q_end = cu_q_lens_ref[row + 1]
    kv_len = kv_lens_ref[row]
    _, group, head_dim = q_ref.shape
    rows = block_q * group
    block_k = pages_per_block * k_ref.shape[2]
    layer = layer_ref[0]

    num_q = q_end - q_start  # the row's tokens from q_start on; > block_q but in its last block
    token_live = jnp.arange(block_q) < num_q
    tile_live = jnp.broadcast_to(token_live[:, None, None], (block_q, group, head_dim))
    tokens = pl.ds(q_start, block_q)
    q = pltriton.load(q_ref.at[tokens], mask=tile_live, other=0)
    dtype = paged.compute_dtype(q_ref.dtype, k_ref.dtype)
    q = q.reshape(rows, head_dim).astype(dtype)
    # token q_start + i sits at position kv_len - num_q + i; tile row j holds token j // group
    first_pos = kv_len - num_q
    query_pos = first_pos + jnp.arange(rows) // group
    causal_end = first_pos + jnp.minimum(num_q, block_q)  # keys [0, causal_end) can be seen
    num_blocks = jnp.where(num_q > 0, pl.cdiv(causal_end, block_k), 0)

    def body(block, carry):
        k, v, key_pos = paged.load_kv_block(
            k_ref, v_ref, layer, page_table_ref, row, block, kv_len, pages_per_block, dtype,
            *scale_refs,
        )
        visible = key_pos[None, :] <= query_pos[:, None]
        return paged.online_softmax_step(q, k, v, visible, carry, scale)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), paged.MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, _, row_sum = lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
    out = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)
    pltriton.store(o_ref.at[tokens], out, mask=tile_live)


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    """The whole array in every program (the kernel indexes it with data-dependent rows)."""
    return pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_q", "pages_per_block", "interpret"),
)
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    scale: float,
    block_q: int = 16,
    pages_per_block: int = 8,
    interpret: bool = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of a flat batch of prefill chunks and decodes over paged K/V.

    Args:
      q: f32[num_tokens, num_heads, head_dim] (or bf16/f16); num_heads is a multiple of
        num_kv_heads and query head h reads KV head h // (num_heads // num_kv_heads).
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim], one layer's pool,
        f32, bf16, f16, int8 or fp8 (e4m3); page 0 is the null page. Or every layer's,
        [num_layers, ...], with `layer` (what a model should pass: see paged_attention.py).
      cu_q_lens: i32[num_rows + 1] non-decreasing, cu_q_lens[0] = 0: row r's tokens are
        q[cu_q_lens[r]:cu_q_lens[r + 1]]; tokens from cu_q_lens[-1] on are padding.
      kv_lens: i32[num_rows] keys in each row's cache after this step, its tokens included
        (so kv_lens[r] >= its q_len); lengths past max_pages * page_size are clamped.
      page_table: i32[num_rows, max_pages] each row's pages, in order; entries past its
        last page are never read.
      layer: i32[] the layer of a whole cache to read (None for one layer's pool).
      scale: multiplies q.k, usually head_dim ** -0.5.
      block_q: tokens of one row per program.
      pages_per_block: pages gathered per step of the softmax loop (fewer where the blocks
        would not fit a GPU's shared memory).
      interpret: run the kernel in Pallas' interpreter (any backend, CPU included).
      k_scale, v_scale: int8 pages only (and needed there): f32 scales shaped like the
        pages less head_dim, dequantized = value * scale.

    Returns:
      [num_tokens, num_heads, head_dim] in q's dtype, accumulated in f32; zeros for padding
      tokens.
    """
    group = paged.check_pool(q, k_pages, v_pages)
    scales = paged.scale_operands(k_pages, k_scale, v_scale)
    k_pages, v_pages, layer = paged.every_layer(k_pages, v_pages, layer)
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_pages, page_size, _ = k_pages.shape
    paged.check_index("kv_lens", kv_lens, (None,), "it must be one length per row")
    num_rows = kv_lens.shape[0]
    if num_rows == 0:
        raise ValueError(f"kv_lens has shape {kv_lens.shape}: the batch needs at least one row")
    why = f"kv_lens has shape {kv_lens.shape}"
    paged.check_index("cu_q_lens", cu_q_lens, (num_rows + 1,), why)
    paged.check_index("page_table", page_table, (num_rows, None), why)
    paged.check_positive(block_q=block_q, pages_per_block=pages_per_block)
    group_rows = paged.next_power_of_2(group)
    itemsize = paged.pool_itemsize(q.dtype, k_pages.dtype)
    pages_per_block = paged.fit_pages_per_block(
        pages_per_block, block_q * group_rows, page_size, head_dim, itemsize
    )
    if not interpret:
        paged.check_gpu_tiles(head_dim, page_size, pages_per_block, block_q * group_rows)
    if num_tokens == 0:
        return jnp.zeros_like(q)

    cu_q_lens = jnp.clip(cu_q_lens, 0, num_tokens)
    kv_lens = jnp.clip(kv_lens, 0, page_table.shape[1] * page_size)
    page_table = paged.pad_page_table(page_table, pages_per_block)
    block_rows, block_starts = schedule_q_blocks(cu_q_lens, num_tokens, block_q)
    # [num_tokens, num_kv_heads, group_rows, head_dim]: a group's heads are adjacent in q;
    # padding them to a power of two copies q only, never K or V
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_rows != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_rows - group), (0, 0)))

    kernel = functools.partial(
        _ragged_kernel, scale=scale, block_q=block_q, pages_per_block=pages_per_block,
        scaled=bool(scales),
    )
    pool_spec = pl.BlockSpec(
        (num_layers, None, num_pages, page_size, head_dim), lambda i, h: (0, h, 0, 0, 0)
    )
    scale_spec = pl.BlockSpec((num_layers, None, num_pages, page_size), lambda i, h: (0, h, 0, 0))
    head_spec = pl.BlockSpec((num_tokens, None, group_rows, head_dim), lambda i, h: (0, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(block_rows.shape[0], num_kv_heads),
        in_specs=[
            *(_whole(x.shape)
              for x in (layer, block_rows, block_starts, cu_q_lens, kv_lens, page_table)),
            head_spec,
            pool_spec,
            pool_spec,
            *(scale_spec for _ in scales),
        ],
        out_specs=head_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=paged.triton_params(
            block_q * group_rows, pages_per_block * page_size, head_dim, itemsize
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )(layer, block_rows, block_starts, cu_q_lens, kv_lens, page_table, qg, k_pages, v_pages,
      *scales)

    out = out[:, :, :group].reshape(num_tokens, num_heads, head_dim)
    # padding tokens belong to no q-block, so the kernel never wrote them
    live = jnp.arange(num_tokens) < cu_q_lens[num_rows]
    return jnp.where(live[:, None, None], out, 0)
