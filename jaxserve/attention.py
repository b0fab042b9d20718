"""The one entry point through which models call paged attention.

For now every backend runs the pure-jnp reference; the Pallas kernels plug in
here, chosen once by platform, so model code never changes.
"""

from dataclasses import dataclass

import jax

from jaxserve.kv_cache import KVCache
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each token of the flat batch reads and writes the paged KV cache.

    Padding tokens belong to a padding row whose page table points only at the
    reserved null page 0, and write their K/V there.
    """

    seq_ids: jax.Array  # i32[num_tokens] batch row (slot) of each token
    slot_mapping: jax.Array  # i32[num_tokens] page * page_size + offset to write each token's K/V
    page_table: jax.Array  # i32[num_seqs, max_pages_per_seq] pages of each row, in order
    logits_indices: jax.Array  # i32[num_logits] tokens whose logits the model returns


def paged_attention(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    kv_cache: KVCache,
    layer: jax.Array,  # i32[] layer index
    positions: jax.Array,  # i32[num_tokens]
    metadata: AttentionMetadata,
    scale: float,
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]
    """Attention of each token over its own sequence's pages, this token included."""
    return ragged_paged_attention_reference(
        q,
        kv_cache.k[layer],
        kv_cache.v[layer],
        metadata.seq_ids,
        positions,
        metadata.page_table,
        scale,
    )
