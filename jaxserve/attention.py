"""The one entry point through which models call paged attention, and its backend choice.

Backends: "pallas" (the Pallas ragged kernel; GPU), "pallas-interpret" (the same
kernel in interpret mode, to test it on CPU), "xla" (blocked jnp over pages; what
serves on CPU, where Pallas runs only in slow interpret mode) and "reference"
(dense, for tests). `select_backend` picks by platform unless told;
the choice travels as a static field of the metadata, so model code never changes.
"""

from dataclasses import dataclass, field

import jax

from jaxserve.config import ATTENTION_BACKENDS
from jaxserve.kv_cache import KVCache
from jaxserve.pallas_kernels.blocked_jnp import blocked_paged_attention
from jaxserve.pallas_kernels.ragged_attention import ragged_paged_attention
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference


def select_backend(requested: str | None = None) -> str:
    """`requested` if given (validated), else Pallas on accelerators and XLA on CPU."""
    if requested is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend must be one of {ATTENTION_BACKENDS}, got {requested!r}"
        )
    return requested


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each token of the flat batch reads and writes the paged KV cache.

    A row's tokens are the last of its kv_len tokens, so the flat batch mixes prefill
    chunks and decodes. Padding tokens (from cu_q_lens[-1] on) belong to the last
    row, whose pages are all the reserved null page 0, and write their K/V there.
    """

    seq_ids: jax.Array  # i32[num_tokens] row of each token; padding -> the last, null row
    slot_mapping: jax.Array  # i32[num_tokens] page * page_size + offset to write each token's K/V
    page_table: jax.Array  # i32[num_rows, max_pages_per_seq] pages of each row, in order
    cu_q_lens: jax.Array  # i32[num_rows + 1] row r's tokens are [cu_q_lens[r], cu_q_lens[r+1])
    kv_lens: jax.Array  # i32[num_rows] tokens in each row's cache after this step
    logits_indices: jax.Array  # i32[num_logits] tokens whose logits the model returns
    backend: str = field(default="xla", metadata={"static": True})


def paged_attention(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    kv_cache: KVCache,
    layer: jax.Array,  # i32[] layer index
    positions: jax.Array,  # i32[num_tokens]
    metadata: AttentionMetadata,
    scale: float,
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]
    """Attention of each token over its own sequence's pages, this token included."""
    if metadata.backend == "xla":
        return blocked_paged_attention(
            q, kv_cache.k, kv_cache.v, layer, metadata.seq_ids, positions, metadata.page_table,
            scale,
        )
    k_pages, v_pages = kv_cache.k[layer], kv_cache.v[layer]
    if metadata.backend.startswith("pallas"):
        return ragged_paged_attention(
            q,
            k_pages,
            v_pages,
            metadata.cu_q_lens,
            metadata.kv_lens,
            metadata.page_table,
            scale=scale,
            interpret=metadata.backend == "pallas-interpret",
        )
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, metadata.seq_ids, positions, metadata.page_table, scale
    )
