"""Ragged paged attention on the CPU: the C++ kernel of paged_attention.cc, through XLA's FFI.

The same arguments and results as the Pallas `ragged_paged_attention`, so the attention
entry point swaps one for the other by platform; `ragged_paged_attention_reference_lens`
is its reference in the tests. K and V are read page by page with an online softmax, so
each byte of the pool that a row can see is read once a step. The kernel reads K
transposed, each page [head_dim, page_size] (kv_cache.py's `k_transposed`, as the engine
keeps it on this backend); a K pool in the Pallas layout is transposed here first, a copy
of the whole pool (tests, one-off calls). q and the output are f32;
the pool is f32 (read in place), or bf16, int8 (with its f32 scales) or fp8 e4m3fn
(kv_cache.py's storages), which the kernel dequantizes a page at a time into f32 scratch
so that one body of attention loops serves every storage.
"""

import ctypes
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cpu_kernels.build import KernelUnavailable, build
from jaxserve.pallas_kernels import paged_attention as paged

log = logging.getLogger(__name__)

TARGET = "jaxserve_paged_attention"
MAX_PAGE_SIZE = 256  # kMaxPageSize in paged_attention.cc
# pool dtypes the kernel reads (F32, BF16, S8, F8E4M3FN in paged_attention.cc), and the
# bits the engine keeps bf16 and fp8 in (U16, U8: kv_cache.BITS)
STORAGES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn,
                                        jnp.uint16, jnp.uint8))


def fits(page_size: int, head_dim: int) -> bool:
    """Whether the kernel takes these shapes (its loops step by 4)."""
    return page_size % 4 == 0 and 0 < page_size <= MAX_PAGE_SIZE and head_dim % 4 == 0


@functools.cache
def _library() -> ctypes.CDLL:
    return ctypes.cdll.LoadLibrary(str(build("paged_attention")))


@functools.cache
def available() -> bool:
    """Build (or find) the kernel library and register it with XLA; False, with the reason
    logged once, where it cannot be built."""
    try:
        library = _library()
    except (KernelUnavailable, OSError) as e:
        log.warning("the C++ CPU attention kernel is unavailable, serving with XLA's: %s", e)
        return False
    capsule = jax.ffi.pycapsule(library.JaxservePagedAttention)
    jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
    return True


def prefetch_job() -> int | None:
    """The address of the kernel's list of the KV pages its next call will read
    (prefetch_job.h), for linear.cc's decode loop to fetch; None without the kernel."""
    if not available():
        return None
    job = _library().JaxservePrefetchJob
    job.restype = ctypes.c_void_p
    return job()


def cpu_paged_attention(
    q: jax.Array,  # f32[num_tokens, num_heads, head_dim]
    k_pages: jax.Array,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim] in
    v_pages: jax.Array,  # STORAGES (or one layer's pool, [num_kv_heads, ...], layer None)
    cu_q_lens: jax.Array,  # i32[num_rows + 1] row r's tokens are q[cu_q_lens[r]:cu_q_lens[r+1]]
    kv_lens: jax.Array,  # i32[num_rows] keys in each row's cache after this step
    page_table: jax.Array,  # i32[num_rows, max_pages]
    layer: jax.Array | int | None = None,  # i32[] the layer of a whole cache to read
    *,
    scale: float,
    k_scale: jax.Array | None = None,  # int8 pools only: f32, the pool's shape less head_dim
    v_scale: jax.Array | None = None,
    k_transposed: bool = False,  # k_pages' pages are [head_dim, page_size]
    is_prompt: jax.Array | None = None,  # i32[num_rows]: 1 where a row's tokens are a prompt's
) -> jax.Array:  # f32[num_tokens, num_heads, head_dim]; zeros for padding tokens
    """Causal attention of a flat batch of prefill chunks and decodes over paged K/V.

    With `is_prompt`, on a CPU with AMX and bf16 pages of 16 keys, a prompt's tokens
    multiply on AMX (q and the softmax weights each as two bf16 parts: f32-close, not the
    f32 loop's bits), a generated token's in f32 as without it: a token's output depends
    on neither its step's other rows nor how its prompt was chunked."""
    if k_transposed:
        if k_pages.ndim < 2:
            raise ValueError(f"k_pages must be 4-D or 5-D, got shape {k_pages.shape}")
        as_pallas = (*k_pages.shape[:-2], k_pages.shape[-1], k_pages.shape[-2])
        paged.check_pool(q, jax.ShapeDtypeStruct(as_pallas, k_pages.dtype), v_pages)
    else:
        paged.check_pool(q, k_pages, v_pages)
        k_pages = jnp.swapaxes(k_pages, -1, -2)
    scales = paged.scale_operands(v_pages, k_scale, v_scale)  # V: the Pallas layout
    if q.dtype != jnp.float32:
        raise ValueError(f"the CPU kernel takes f32 q only, got {q.dtype}")
    if k_pages.dtype not in STORAGES:
        raise ValueError(
            f"the CPU kernel reads pools of {', '.join(map(str, STORAGES))}, got {k_pages.dtype}"
        )
    k_pages, v_pages, layer = paged.every_layer(k_pages, v_pages, layer)
    # the kernel always takes scales; it reads them for int8 only
    k_scale, v_scale = scales or [jnp.zeros((1,), jnp.float32)] * 2
    num_tokens = q.shape[0]
    page_size, head_dim = v_pages.shape[3:]
    if not fits(page_size, head_dim):
        raise ValueError(
            f"the CPU kernel takes page sizes of 4 to {MAX_PAGE_SIZE} and head sizes that are "
            f"multiples of 4; got page size {page_size}, head size {head_dim}"
        )
    paged.check_index("kv_lens", kv_lens, (None,), "it must be one length per row")
    num_rows = kv_lens.shape[0]
    why = f"kv_lens has shape {kv_lens.shape}"
    paged.check_index("cu_q_lens", cu_q_lens, (num_rows + 1,), why)
    paged.check_index("page_table", page_table, (num_rows, None), why)
    if is_prompt is None:
        is_prompt = jnp.zeros((0,), jnp.int32)
    elif is_prompt.shape != (0,):  # empty: none, as None
        paged.check_index("is_prompt", is_prompt, (num_rows,), why)
    if not available():
        raise RuntimeError("the C++ CPU attention kernel could not be built (see the log)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q, k_pages, v_pages, k_scale, v_scale,
        jnp.clip(cu_q_lens, 0, num_tokens).astype(jnp.int32),
        jnp.clip(kv_lens, 0, page_table.shape[1] * page_size).astype(jnp.int32),
        page_table.astype(jnp.int32), is_prompt.astype(jnp.int32), layer,
        scale=np.float32(scale),
    )
