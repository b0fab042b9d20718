"""Paged decode attention as a Pallas kernel: one query token per sequence.

Layout: one layer's pool is head-major, `k_pages, v_pages: [num_kv_heads, num_pages,
page_size, head_dim]`, page 0 being the reserved null page; sequence s owns the pages
`page_table[s, :cdiv(kv_lens[s], page_size)]`, in order, and its query sits at position
`kv_lens[s] - 1`, so it sees all `kv_lens[s]` keys. The whole cache, `[num_layers,
num_kv_heads, ...]`, may be passed instead with the `layer` to read: the kernel then indexes
the layer itself. A model should pass it so: slicing one layer out of the cache before the
call is a copy of that layer's whole pool (a Pallas call takes whole buffers), which on an
H200 cost ~1 ms a layer at Llama-3-8B shapes with a 69 GB pool, more than the step's own work.

Design: the grid is (sequences, KV heads, KV splits). One program takes every query head
of one KV-head group as the rows of a single `[group, head_dim]` tile, so each K/V page is
read once per group and never copied per query head. It walks its share of the sequence's
pages `pages_per_block` at a time (a block of `pages_per_block * page_size` keys gathered
through the page table) with an online softmax accumulated in f32. With
`num_kv_splits > 1` the page blocks are shared out between programs (flash-decoding, for
small batches that would leave most of the GPU idle) and a few jnp ops merge the partial
softmaxes.

Backend: Pallas' Triton backend on NVIDIA GPUs, chosen explicitly by passing
`pallas.triton.CompilerParams`. Without compiler params jax 0.10.2 lowers a GPU `pallas_call`
to Mosaic GPU (`jax_pallas_use_mosaic_gpu` defaults to True), and warns there that
`pallas_call` is deprecated in favour of `plgpu.kernel`. A Mosaic GPU kernel is a different
program (warpgroups, TMA copies into shared memory, explicit barriers) with no direct
counterpart of a masked load gathered through a page table, so these kernels keep to the
block-spec and masked load/store style of jax's own `ops/gpu/paged_attention.py`. The Triton
backend is being retired upstream in favour of Mosaic GPU, but 0.10.2 ships it and lowers
these kernels to Triton IR (a test does so for `cuda` on CPU). Triton wants every array in a
kernel to have a power-of-two size and dot tiles of at least 16, so `head_dim` and
`pages_per_block * page_size` must be powers of two >= 16 and the query group is padded to
one; the wrappers check this unless interpreting. On CPU only `interpret=True` runs.

Storage: pages may hold f32, bf16, f16, int8 or fp8 (e4m3) values (`--kv-dtype`, see
`jaxserve.device.kv_cache`); int8 pages come with one f32 scale per token and head, shaped
like the pages less head_dim, passed as `k_scale, v_scale`. The kernel loads a block's pages
(and their scales, gathered through the same page ids) in their storage and dequantizes
them in registers to the compute dtype (`compute_dtype`: q's, or the pages' where wider),
so a narrow pool is also a narrow read. Without scales the kernel takes no scale refs.

The pieces shared with the ragged kernel (input checks, the gathered K/V block, the online
softmax step) live here and are imported by `ragged_attention.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .storage import dequantize, value_dtype

NULL_PAGE = 0  # the reserved page (see jaxserve.device.kv_cache)
# Finite, so a row that has seen no key keeps a finite max and exp(max - new_max) is defined.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_TILE = 16  # Triton's dot needs every tile dimension >= 16


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_pool(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> int:
    """Check q against the pages (one layer's, or every layer's) and return the query heads
    per KV head."""
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim not in (4, 5):
        raise ValueError(
            f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim] (one layer) or "
            f"[num_layers, num_kv_heads, ...] (every layer), got shape {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages has shape {k_pages.shape} but v_pages has shape {v_pages.shape}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages has dtype {k_pages.dtype} but v_pages has dtype {v_pages.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    pages = value_dtype(k_pages.dtype)
    if not (jnp.issubdtype(pages, jnp.floating) or pages == jnp.int8):
        raise ValueError(
            f"k_pages must be floating point, int8, or bf16/fp8 bits (uint16/uint8), got "
            f"{k_pages.dtype}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pages.shape[-4]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_heads} heads but k_pages has {num_kv_heads} KV heads: "
            f"{num_heads} is not a multiple of {num_kv_heads}"
        )
    if head_dim != k_pages.shape[-1]:
        raise ValueError(
            f"q has head_dim {head_dim} (shape {q.shape}) but k_pages has head_dim "
            f"{k_pages.shape[-1]} (shape {k_pages.shape})"
        )
    return num_heads // num_kv_heads


def check_scales(
    k_pages: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None
) -> None:
    """int8 pages come with one f32 scale per token and head (kv_cache.py), shaped like the
    pages less head_dim; other storages with none."""
    if k_pages.dtype != jnp.int8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{k_pages.dtype} pages take no scales")
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"int8 pages need {name}, one per token and head")
        if s.shape != k_pages.shape[:-1] or s.dtype != jnp.float32:
            raise ValueError(
                f"{name} must be f32{list(k_pages.shape[:-1])} (the pages less head_dim), "
                f"got {s.dtype}{list(s.shape)}"
            )


def compute_dtype(q_dtype: jnp.dtype, pages_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the pages are dequantized to and the dots run in: q's, or the pages' where
    a wider float (bf16 q over an f32 pool computes in f32). One-byte storages (int8, fp8)
    never set it: q is never cast down to them."""
    q_dtype, pages_dtype = jnp.dtype(q_dtype), value_dtype(pages_dtype)
    if pages_dtype.itemsize == 1:
        return q_dtype
    return jnp.promote_types(q_dtype, pages_dtype)


def every_layer(
    k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array | int | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pools as [num_layers, num_kv_heads, ...] and the layer to read as i32[1]."""
    if k_pages.ndim == 4:
        if layer is not None:
            raise ValueError(
                f"layer is given but k_pages holds one layer (shape {k_pages.shape}): pass "
                "the whole [num_layers, ...] cache with a layer, or one layer without"
            )
        return k_pages[None], v_pages[None], jnp.zeros((1,), jnp.int32)
    if layer is None:
        raise ValueError(
            f"k_pages holds every layer (shape {k_pages.shape}): give the layer to read"
        )
    layer = jnp.asarray(layer)
    if layer.shape not in ((), (1,)) or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {layer.dtype}{list(layer.shape)}")
    return k_pages, v_pages, layer.astype(jnp.int32).reshape(1)


def check_index(name: str, x: jax.Array, expected: tuple[int | None, ...], why: str) -> None:
    """Check an int32 index array's shape; None in `expected` matches any size."""
    ok = x.ndim == len(expected) and all(e is None or e == n for e, n in zip(expected, x.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} has shape {x.shape} but {why}: expected {want}")
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype} (shape {x.shape})")


def check_positive(**sizes: int) -> None:
    for name, n in sizes.items():
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")


def check_gpu_tiles(head_dim: int, page_size: int, pages_per_block: int, rows: int) -> None:
    """Raise unless the tiles fit the Triton backend (powers of two, dots >= 16)."""
    tiles = {
        "head_dim": head_dim,
        f"pages_per_block * page_size ({pages_per_block} * {page_size})": (
            pages_per_block * page_size
        ),
        "query rows per tile": rows,
    }
    for what, n in tiles.items():
        if n < MIN_TILE or n & (n - 1):
            raise ValueError(
                f"{what} is {n}: the Triton backend needs a power of two >= {MIN_TILE} "
                "(interpret=True runs any size)"
            )
    if pages_per_block & (pages_per_block - 1):
        raise ValueError(f"pages_per_block is {pages_per_block}: Triton needs a power of two")


# Shared memory a program may plan on: H100/H200 give a block 227 KiB, less a margin for
# Triton's own scratch (A100: 163 KiB; this budget assumes a Hopper).
SHARED_MEMORY_BUDGET = 200 * 1024


def _shared_bytes(rows: int, block_k: int, head_dim: int, itemsize: int, stages: int) -> int:
    """A pipeline stage holds a K and a V block; the query tile stays resident."""
    return stages * 2 * block_k * head_dim * itemsize + rows * head_dim * itemsize


def fit_pages_per_block(
    pages_per_block: int, rows: int, page_size: int, head_dim: int, itemsize: int
) -> int:
    """`pages_per_block`, halved until one stage of K/V blocks and the query tile fit the
    shared memory budget (f32 pools at page_size 32 asked 264-320 KiB on an H200 and failed
    to launch), never below a 16-key block."""
    while (
        pages_per_block > 1
        and (pages_per_block // 2) * page_size >= MIN_TILE
        and _shared_bytes(rows, pages_per_block * page_size, head_dim, itemsize, 1)
        > SHARED_MEMORY_BUDGET
    ):
        pages_per_block //= 2
    return pages_per_block


def triton_params(rows: int, block_k: int, head_dim: int, itemsize: int) -> pltriton.CompilerParams:
    """Warps and pipeline depth for one program's tiles (a shape rule, not a tuned one)."""
    # a [rows, head_dim] f32 accumulator and a [rows, block_k] score tile live in registers
    num_warps = 4 if rows <= 64 else 8
    fits_two = _shared_bytes(rows, block_k, head_dim, itemsize, 2) <= SHARED_MEMORY_BUDGET
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=2 if fits_two else 1)


def pad_page_table(page_table: jax.Array, pages_per_block: int) -> jax.Array:
    """Pad each row with null pages to whole page blocks, so no block reads past the row."""
    pad = -page_table.shape[1] % pages_per_block
    return jnp.pad(page_table, ((0, 0), (0, pad)), constant_values=NULL_PAGE)


def load_kv_block(
    k_ref: jax.Array,  # [num_layers, num_pages, page_size, head_dim] one KV head's pools
    v_ref: jax.Array,  # [num_layers, num_pages, page_size, head_dim]
    layer: jax.Array,  # i32[] the layer to read
    page_table_ref: jax.Array,  # i32[num_seqs, max_pages]
    seq: jax.Array,  # i32[] the sequence's row of the page table
    block: jax.Array,  # i32[] page block index
    kv_len: jax.Array,  # i32[] tokens in the sequence's cache
    pages_per_block: int,
    dtype: jnp.dtype,  # the compute dtype the block is dequantized to
    k_scale_ref: jax.Array | None = None,  # f32[num_layers, num_pages, page_size] (int8)
    v_scale_ref: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gather one block of keys and values, [block_k, head_dim] each in `dtype`, and their
    positions. The pages are read in their storage (and their scales, where given, through
    the same page ids) and dequantized here, after the gather."""
    _, _, page_size, head_dim = k_ref.shape
    block_k = pages_per_block * page_size
    first_page = block * pages_per_block
    # one indexer per load: Triton lowers no chained ref views (`ref.at[seq][...]`)
    pages = page_table_ref[seq, pl.ds(first_page, pages_per_block)]
    # table entries past the sequence's last page may hold anything: read the null page
    live = first_page + jnp.arange(pages_per_block) < pl.cdiv(kv_len, page_size)
    pages = jnp.where(live, pages, NULL_PAGE)
    k = k_ref[layer, pages].reshape(block_k, head_dim)
    v = v_ref[layer, pages].reshape(block_k, head_dim)
    k_scale = v_scale = None
    if k_scale_ref is not None:
        k_scale = k_scale_ref[layer, pages].reshape(block_k)
        v_scale = v_scale_ref[layer, pages].reshape(block_k)
    k, v = dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype)
    key_pos = block * block_k + jnp.arange(block_k)
    # slots past kv_len are stale or padding; masked scores drop K there, but a NaN in V
    # (or in its scale) would survive its zero weight
    v = jnp.where((key_pos < kv_len)[:, None], v, 0)
    return k, v, key_pos


def online_softmax_step(
    q: jax.Array,  # [rows, head_dim] in the compute dtype (see compute_dtype)
    k: jax.Array,  # [block_k, head_dim] dequantized to the compute dtype
    v: jax.Array,  # [block_k, head_dim] dequantized to the compute dtype
    visible: jax.Array,  # bool[rows or 1, block_k]
    carry: tuple[jax.Array, jax.Array, jax.Array],  # acc f32[rows, head_dim]; max, sum f32[rows]
    scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one block of keys into the running (unnormalised output, row max, row sum)."""
    acc, row_max, row_sum = carry
    # HIGHEST keeps f32 dots in IEEE f32 on Triton (the default would be TF32)
    s = pltriton.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST) * scale
    s = jnp.where(visible, s, MASK_VALUE)
    new_max = jnp.maximum(row_max, s.max(axis=1))
    alpha = jnp.exp(row_max - new_max)
    p = jnp.exp(s - new_max[:, None])
    new_sum = alpha * row_sum + p.sum(axis=1)
    pv = pltriton.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST)
    return alpha[:, None] * acc + pv, new_max, new_sum


def split_scale_refs(refs: tuple, scaled: bool) -> tuple[tuple, tuple]:
    """(k_scale_ref, v_scale_ref) where `scaled`, else (), and the refs after them."""
    return (refs[:2], refs[2:]) if scaled else ((), refs)


def scale_operands(
    k_pages: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None
) -> list[jax.Array]:
    """Check the scales against the pages (one layer's or every layer's) and return them
    as [num_layers, num_kv_heads, num_pages, page_size], or none for an unscaled storage."""
    check_scales(k_pages, k_scale, v_scale)
    if k_scale is None:
        return []
    if k_pages.ndim == 4:
        return [k_scale[None], v_scale[None]]
    return [k_scale, v_scale]


def pool_itemsize(q_dtype: jnp.dtype, pages_dtype: jnp.dtype) -> int:
    """Bytes a K/V element takes in a program's shared memory: a block is loaded in its
    storage but the dots take it dequantized, so a narrow storage counts as the compute
    dtype (a guess on the safe side; untested on GPUs for int8 and fp8)."""
    return max(jnp.dtype(pages_dtype).itemsize, compute_dtype(q_dtype, pages_dtype).itemsize)


def _decode_kernel(
    layer_ref,  # i32[1] the layer to read
    kv_lens_ref,  # i32[num_seqs]
    page_table_ref,  # i32[num_seqs, max_pages]
    q_ref,  # [rows, head_dim] this KV head's query heads, padded to rows
    k_ref,  # [num_layers, num_pages, page_size, head_dim] this KV head's pools
    v_ref,  # [num_layers, num_pages, page_size, head_dim]
    *refs,  # where scaled, k_scale_ref and v_scale_ref (f32[num_layers, num_pages,
    # page_size]); then acc_ref f32[rows, head_dim], max_ref f32[rows] and sum_ref
    # f32[rows]: this split's unnormalised output, score max and softmax denominator
    scale: float,
    pages_per_block: int,
    blocks_per_split: int,
    scaled: bool,
):
    scale_refs, (acc_ref, max_ref, sum_ref) = split_scale_refs(refs, scaled)
    seq, split = pl.program_id(0), pl.program_id(2)
    block_k = pages_per_block * k_ref.shape[2]
    layer = layer_ref[0]
    kv_len = kv_lens_ref[seq]
    dtype = compute_dtype(q_ref.dtype, k_ref.dtype)
    q = q_ref[...].astype(dtype)
    rows, head_dim = q.shape
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(kv_len, block_k))

    def body(block, carry):
        k, v, key_pos = load_kv_block(
            k_ref, v_ref, layer, page_table_ref, seq, block, kv_len, pages_per_block, dtype,
            *scale_refs,
        )
        return online_softmax_step(q, k, v, (key_pos < kv_len)[None, :], carry, scale)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc_ref[...], max_ref[...], sum_ref[...] = lax.fori_loop(first, last, body, init)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "pages_per_block", "num_kv_splits", "interpret"),
)
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    scale: float,
    pages_per_block: int = 8,
    num_kv_splits: int = 1,
    interpret: bool = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Decode attention of one query token per sequence over its paged K/V.

    Args:
      q: f32[num_seqs, num_heads, head_dim] (or bf16/f16), the query at position
        kv_lens[s] - 1; num_heads is a multiple of num_kv_heads and query head h reads
        KV head h // (num_heads // num_kv_heads).
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim], one layer's pool,
        f32, bf16, f16, int8 or fp8 (e4m3); page 0 is the null page. Or every layer's,
        [num_layers, ...], with `layer`.
      kv_lens: i32[num_seqs] keys in each sequence's cache, this token's included; 0 for a
        padding row, whose output is zeros. Lengths past max_pages * page_size are clamped.
      page_table: i32[num_seqs, max_pages] each sequence's pages, in order; entries past
        its last page are never read.
      layer: i32[] the layer of a whole cache to read (None for one layer's pool).
      scale: multiplies q.k, usually head_dim ** -0.5.
      pages_per_block: pages gathered per step of the softmax loop (fewer where the blocks
        would not fit a GPU's shared memory).
      num_kv_splits: programs sharing one sequence's pages (flash-decoding).
      interpret: run the kernel in Pallas' interpreter (any backend, CPU included).
      k_scale, v_scale: int8 pages only (and needed there): f32 scales shaped like the
        pages less head_dim, dequantized = value * scale.

    Returns:
      [num_seqs, num_heads, head_dim] in q's dtype, accumulated in f32.
    """
    group = check_pool(q, k_pages, v_pages)
    scales = scale_operands(k_pages, k_scale, v_scale)
    k_pages, v_pages, layer = every_layer(k_pages, v_pages, layer)
    num_seqs, num_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_pages, page_size, _ = k_pages.shape
    check_index("kv_lens", kv_lens, (num_seqs,), f"q has shape {q.shape}")
    check_index("page_table", page_table, (num_seqs, None), f"q has shape {q.shape}")
    check_positive(pages_per_block=pages_per_block, num_kv_splits=num_kv_splits)
    rows = max(MIN_TILE, next_power_of_2(group))
    itemsize = pool_itemsize(q.dtype, k_pages.dtype)
    pages_per_block = fit_pages_per_block(pages_per_block, rows, page_size, head_dim, itemsize)
    if not interpret:
        check_gpu_tiles(head_dim, page_size, pages_per_block, rows)
    if num_seqs == 0:
        return jnp.zeros_like(q)

    kv_lens = jnp.clip(kv_lens, 0, page_table.shape[1] * page_size)
    page_table = pad_page_table(page_table, pages_per_block)
    num_blocks = page_table.shape[1] // pages_per_block
    blocks_per_split = pl.cdiv(num_blocks, num_kv_splits)
    # [num_seqs, num_kv_heads, rows, head_dim]: a group's heads are adjacent in q already;
    # padding them to a power-of-two tile copies q only, never K or V
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))

    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        pages_per_block=pages_per_block,
        blocks_per_split=blocks_per_split,
        scaled=bool(scales),
    )
    pool_spec = pl.BlockSpec(
        (num_layers, None, num_pages, page_size, head_dim), lambda s, h, j: (0, h, 0, 0, 0)
    )
    scale_spec = pl.BlockSpec(
        (num_layers, None, num_pages, page_size), lambda s, h, j: (0, h, 0, 0)
    )
    split_shape = (num_kv_splits, num_seqs, num_kv_heads, rows)
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_kv_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h, j: (0,)),
            pl.BlockSpec((num_seqs,), lambda s, h, j: (0,)),
            pl.BlockSpec(page_table.shape, lambda s, h, j: (0, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, j: (s, h, 0, 0)),
            pool_spec,
            pool_spec,
            *(scale_spec for _ in scales),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, j: (j, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, j: (j, s, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, j: (j, s, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
        ],
        compiler_params=triton_params(rows, pages_per_block * page_size, head_dim, itemsize),
        interpret=interpret,
        name="paged_attention",
    )(layer, kv_lens, page_table, qg, k_pages, v_pages, *scales)

    # merge the splits' partial softmaxes; a split that saw no key has row_sum 0
    weight = jnp.exp(row_max - row_max.max(axis=0))
    total = (weight * row_sum).sum(axis=0)
    out = (weight[..., None] * acc).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:, :, :group].reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
