"""The one entry point through which models call paged attention, and its backend choice.

Backends: "pallas" (the Pallas ragged kernel; GPU), "pallas-interpret" (the same
kernel in interpret mode, to test it on CPU), "cpu" (a C++ kernel through XLA's FFI,
reading pages in place; what serves on CPU, where Pallas runs only in slow interpret
mode), "xla" (blocked jnp over pages: the CPU's fallback where the C++ kernel cannot be
built or does not take the shapes) and "reference" (dense, for tests). `select_backend`
picks by platform unless told; the choice travels as a static field of the metadata,
so model code never changes.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxserve.config import ATTENTION_BACKENDS
from jaxserve.cpu_kernels.paged_attention import STORAGES as CPU_POOLS
from jaxserve.cpu_kernels.paged_attention import available as cpu_kernel_available
from jaxserve.cpu_kernels.paged_attention import cpu_paged_attention
from jaxserve.cpu_kernels.paged_attention import fits as cpu_kernel_fits
from jaxserve.device.kv_cache import KV_STORAGE, KVCache
from jaxserve.device.sharding import MODEL
from jaxserve.pallas_kernels.blocked_jnp import blocked_paged_attention
from jaxserve.pallas_kernels.ragged_attention import ragged_paged_attention
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference

# the --kv-dtype storages the C++ kernel reads
CPU_KERNEL_STORAGE = tuple(n for n, d in KV_STORAGE.items() if jnp.dtype(d) in CPU_POOLS)


def select_backend(
    requested: str | None = None,
    dtype: jnp.dtype = jnp.float32,
    kv_dtype: str = "f32",
    page_size: int = 16,
    head_dim: int = 64,
) -> str:
    """`requested` if given (validated), else Pallas on accelerators and, on CPU, the C++
    kernel where it builds and takes the activations' `dtype`, the KV storage and the
    shapes (else blocked XLA, which takes them all)."""
    fits = (
        jnp.dtype(dtype) == jnp.float32 and kv_dtype in CPU_KERNEL_STORAGE
        and cpu_kernel_fits(page_size, head_dim)
    )
    if requested is None:
        if jax.default_backend() == "gpu":
            return "pallas"
        return "cpu" if fits and cpu_kernel_available() else "xla"
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend must be one of {ATTENTION_BACKENDS}, got {requested!r}"
        )
    if requested == "cpu":
        if not fits:
            raise ValueError(
                f"the cpu attention backend takes f32 activations, KV stored as "
                f"{', '.join(CPU_KERNEL_STORAGE)}, page sizes that are multiples of 4 and "
                f"head sizes that are multiples of 4; got {jnp.dtype(dtype).name}, KV "
                f"{kv_dtype}, page size {page_size}, head size {head_dim}"
            )
        if not cpu_kernel_available():
            raise ValueError("the cpu attention backend could not be built here (see the log)")
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
    # i32[num_rows]: 1 where a row's tokens are prompt tokens (Chunk.is_prompt; the CPU
    # kernel takes those on AMX, see cpu_paged_attention); None: every row as generated
    is_prompt: jax.Array | None = None
    # i32[1], where the step has draft logits (speculative decoding): logits_indices'
    # first entries that matter, the rows' and then the real drafts'; a packed head leaves
    # the padding drafts' after them uncomputed, zeros (16 decodes in a
    # (64, 16) step took 58-63 ms computing 48 padding drafts' logits, 51-52 without, on a
    # Zen 4; 30 in a (16, 16) one). None: all.
    num_logits: jax.Array | None = None


def paged_attention(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    kv_cache: KVCache,
    layer: jax.Array,  # i32[] layer index
    positions: jax.Array,  # i32[num_tokens]
    metadata: AttentionMetadata,
    scale: float,
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]
    """Attention of each token over its own sequence's pages, this token included; pages
    in any storage are dequantized inside the backend. An fp8 pool's calibration
    (kv_cache.py) is applied here, around the backend: K's channel scales multiply q; V's
    multiply the output, and V's center is added to it (each output is a convex mix of the
    values, so their common center comes out whole); K's center needs nothing."""
    if kv_cache.k_center is None:
        return _attend(q, kv_cache, layer, positions, metadata, scale)
    group = q.shape[1] // kv_cache.k_center.shape[1]  # query head h reads KV head h // group

    def per_query_head(x: jax.Array) -> jax.Array:  # [kv_heads, head_dim] of this layer
        return jnp.repeat(x[layer], group, axis=0).astype(q.dtype)

    # q.k = (q * k_scale).stored + q.k_center, the last the same for every key
    out = _attend(q * per_query_head(kv_cache.k_channel_scale), kv_cache, layer, positions,
                  metadata, scale)
    return out * per_query_head(kv_cache.v_channel_scale) + per_query_head(kv_cache.v_center)


def _attend(
    q: jax.Array, kv_cache: KVCache, layer: jax.Array, positions: jax.Array,
    metadata: AttentionMetadata, scale: float,
) -> jax.Array:
    """`paged_attention` over the stored (calibrated) values, on the metadata's backend."""
    scales = {"k_scale": kv_cache.k_scale, "v_scale": kv_cache.v_scale}
    if kv_cache.k_transposed and metadata.backend != "cpu":
        raise ValueError(f"a transposed K pool is the cpu backend's, not {metadata.backend}'s")
    if metadata.backend == "xla":
        return blocked_paged_attention(
            q, kv_cache.k, kv_cache.v, layer, metadata.seq_ids, positions, metadata.page_table,
            scale, **scales,
        )
    if metadata.backend == "cpu" or metadata.backend.startswith("pallas"):
        if metadata.backend == "cpu":
            kernel = functools.partial(cpu_paged_attention, scale=scale,
                                       k_transposed=kv_cache.k_transposed)
        else:
            kernel = _pallas(scale, interpret=metadata.backend == "pallas-interpret")
        # shard_map takes arrays only: no flags as an empty one (cpu_paged_attention's none)
        is_prompt = metadata.is_prompt
        if is_prompt is None:
            is_prompt = jnp.zeros((0,), jnp.int32)
        # the whole cache and the layer: slicing the layer out here would copy its pool
        return _head_local(kernel, kv_cache.k.shape[1], kv_cache.k_scale is not None)(
            q, kv_cache.k, kv_cache.v, metadata.cu_q_lens, metadata.kv_lens,
            metadata.page_table, is_prompt, layer, *(() if kv_cache.k_scale is None else
                                                     (kv_cache.k_scale, kv_cache.v_scale)),
        )
    if kv_cache.k_scale is not None:
        scales = {name: x[layer] for name, x in scales.items()}
    return ragged_paged_attention_reference(
        q, kv_cache.k[layer], kv_cache.v[layer], metadata.seq_ids, positions,
        metadata.page_table, scale, **scales,
    )


def _pallas(scale: float, interpret: bool = False) -> Callable:
    """`ragged_paged_attention` in the form `_head_local` calls a kernel, which passes the
    rows' `is_prompt` flags: the Pallas kernel takes every token alike, so it drops them."""

    def kernel(*args, is_prompt, **scales):
        return ragged_paged_attention(*args, scale=scale, interpret=interpret, **scales)

    return kernel


def _head_local(kernel: Callable, num_kv_heads: int, scaled: bool = False) -> Callable:
    """`kernel` run by each device of the "model" axis on its own heads, where the KV
    heads divide that axis; else `kernel` itself. It takes the K and V scales as two more
    positional arguments where `scaled`.

    A Pallas (or FFI) call has no partitioning rule: under the automatic "model" axis the
    compiler would gather its operands, the whole KV cache among them, to
    every device at every step. Split by KV head, each device's query heads read
    only its own KV heads' pages (the cache is sharded the same way, see
    sharding.py), so the pool never moves.
    """

    def call(q, k, v, cu_q_lens, kv_lens, page_table, is_prompt, layer, k_scale=None,
             v_scale=None):
        return kernel(q, k, v, cu_q_lens, kv_lens, page_table, layer,
                      k_scale=k_scale, v_scale=v_scale, is_prompt=is_prompt)

    mesh = jax.sharding.get_abstract_mesh()
    if MODEL not in mesh.axis_names or MODEL in mesh.manual_axes:
        return call
    tp = mesh.shape[MODEL]
    if tp == 1 or num_kv_heads % tp:
        return call
    heads = PartitionSpec(None, MODEL)  # q and the output: [tokens, heads, head_dim]
    pool = PartitionSpec(None, MODEL)  # [layers, kv_heads, pages, page_size, head_dim]
    replicated = PartitionSpec()
    return jax.shard_map(
        call,
        mesh=mesh,
        in_specs=(heads, pool, pool, replicated, replicated, replicated, replicated, replicated)
        + (pool, pool) * scaled,  # the scales: [layers, kv_heads, pages, page_size]
        out_specs=heads,
        axis_names={MODEL},
        check_vma=False,
    )
