"""Pure-jnp references for paged attention, written for clarity rather than speed.

Each query token gathers the pages of its own sequence and attends densely to
every key at a position up to its own (causal). Padding tokens point at the null
page and still see key 0, so they never produce NaN.
"""

import jax
import jax.numpy as jnp


def ragged_paged_attention_reference(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    k_pages: jax.Array,  # f32[num_kv_heads, num_pages, page_size, head_dim] (one layer)
    v_pages: jax.Array,  # f32[num_kv_heads, num_pages, page_size, head_dim]
    seq_ids: jax.Array,  # i32[num_tokens] row of each token in page_table
    positions: jax.Array,  # i32[num_tokens] position of each token in its sequence
    page_table: jax.Array,  # i32[num_seqs, max_pages_per_seq]
    scale: float,
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]
    """Causal attention of each token over its sequence's cached keys and values."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    pages = page_table[seq_ids]  # [T, max_pages]
    context = pages.shape[1] * page_size
    k = k_pages[:, pages].reshape(num_kv_heads, num_tokens, context, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, num_tokens, context, head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,ktcd->tkgc", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(context)[None, :] <= positions[:, None]  # [T, C]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgc,ktcd->tkgd", probs.astype(v.dtype), v)
    return out.reshape(num_tokens, num_heads, head_dim)
