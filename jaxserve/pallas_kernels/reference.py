"""Pure-jnp references for paged attention, written for clarity rather than speed.

Each query token gathers the pages of its own sequence and attends densely to
every key at a position up to its own (causal). Padding tokens point at the null
page and still see key 0, so they never produce NaN.

The references in the kernels' own signatures (`paged_attention_reference`,
`ragged_paged_attention_reference_lens`) turn lengths into per-token rows and
positions and call the per-token reference; a token that sees no key (a padding
row or padding token) gets zeros there, as in the kernels. Scores accumulate in
f32, or in f64 for f64 inputs, so a test can compute them in double precision.

Pages may be in any `--kv-dtype` storage (jaxserve.device.kv_cache): int8 pages come with
`k_scale, v_scale`, shaped like the pages less head_dim. The reference dequantizes the
layer's whole pool first (the kernels dequantize only the blocks they gather), to q's dtype
or the pages' where that is a wider float.
"""

import jax
import jax.numpy as jnp

from .paged_attention import check_scales, compute_dtype
from .storage import dequantize


def ragged_paged_attention_reference(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim] (one layer)
    v_pages: jax.Array,  # f32[num_kv_heads, num_pages, page_size, head_dim]
    seq_ids: jax.Array,  # i32[num_tokens] row of each token in page_table
    positions: jax.Array,  # i32[num_tokens] position of each token in its sequence
    page_table: jax.Array,  # i32[num_seqs, max_pages_per_seq]
    scale: float,
    *,
    k_scale: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size] int8 only
    v_scale: jax.Array | None = None,
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]
    """Causal attention of each token over its sequence's cached keys and values."""
    check_scales(k_pages, k_scale, v_scale)
    dtype = compute_dtype(q.dtype, k_pages.dtype)
    k_pages = dequantize(k_pages, k_scale, dtype)
    v_pages = dequantize(v_pages, v_scale, dtype)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    pages = page_table[seq_ids]  # [T, max_pages]
    context = pages.shape[1] * page_size
    k = k_pages[:, pages].reshape(num_kv_heads, num_tokens, context, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, num_tokens, context, head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    # HIGHEST: on a GPU the default would round f32 operands to TF32
    scores = jnp.einsum(
        "tkgd,ktcd->tkgc", qg, k, preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST
    ) * scale
    visible = jnp.arange(context)[None, :] <= positions[:, None]  # [T, C]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "tkgc,ktcd->tkgd", probs.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST
    )
    return out.reshape(num_tokens, num_heads, head_dim)


def paged_attention_reference(
    q: jax.Array,  # f32[num_seqs, num_heads, head_dim] the token at position kv_lens - 1
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim] (one layer)
    v_pages: jax.Array,  # f32[num_kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # i32[num_seqs] keys in each sequence's cache; 0 -> output zeros
    page_table: jax.Array,  # i32[num_seqs, max_pages]
    scale: float,
    *,
    k_scale: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size] int8 only
    v_scale: jax.Array | None = None,
) -> jax.Array:  # f32[num_seqs, num_heads, head_dim]
    """Decode attention: each sequence's single query sees all of its kv_len keys."""
    seq_ids = jnp.arange(q.shape[0], dtype=jnp.int32)
    out = ragged_paged_attention_reference(
        q, k_pages, v_pages, seq_ids, kv_lens - 1, page_table, scale,
        k_scale=k_scale, v_scale=v_scale,
    )
    return jnp.where((kv_lens > 0)[:, None, None], out, 0)


def ragged_paged_attention_reference_lens(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim] (one layer)
    v_pages: jax.Array,  # f32[num_kv_heads, num_pages, page_size, head_dim]
    cu_q_lens: jax.Array,  # i32[num_rows + 1] row r's tokens are q[cu_q_lens[r]:cu_q_lens[r+1]]
    kv_lens: jax.Array,  # i32[num_rows] keys in each row's cache, its tokens included
    page_table: jax.Array,  # i32[num_rows, max_pages]
    scale: float,
    *,
    k_scale: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size] int8 only
    v_scale: jax.Array | None = None,
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]
    """Mixed prefill chunks and decodes: row r's tokens are the last of its kv_len tokens.

    Token t of row r sits at position kv_lens[r] - (cu_q_lens[r + 1] - t) and attends
    causally to the row's keys up to it. Tokens from cu_q_lens[-1] on are padding and get
    zeros.
    """
    tokens = jnp.arange(q.shape[0], dtype=jnp.int32)
    num_rows = kv_lens.shape[0]
    seq_ids = jnp.searchsorted(cu_q_lens, tokens, side="right").astype(jnp.int32) - 1
    live = (seq_ids >= 0) & (seq_ids < num_rows)
    seq_ids = jnp.clip(seq_ids, 0, num_rows - 1)
    positions = kv_lens[seq_ids] - (cu_q_lens[seq_ids + 1] - tokens)
    out = ragged_paged_attention_reference(
        q, k_pages, v_pages, seq_ids, positions, page_table, scale,
        k_scale=k_scale, v_scale=v_scale,
    )
    return jnp.where((live & (positions >= 0))[:, None, None], out, 0)
