"""The Pallas attention kernels, in interpret mode on CPU, against float64 jnp references.

Pools are tiny (interpret mode costs grow with the whole pool) and each test keeps its
shapes fixed across its cases, so a kernel compiles once per test and the cases change only
data: lengths, page ids and queries.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device import kv_cache
from jaxserve.pallas_kernels.blocked_jnp import blocked_paged_attention, tile_shape
from jaxserve.pallas_kernels.paged_attention import fit_pages_per_block, paged_attention
from jaxserve.pallas_kernels.ragged_attention import ragged_paged_attention
from jaxserve.pallas_kernels.reference import (
    paged_attention_reference,
    ragged_paged_attention_reference,
    ragged_paged_attention_reference_lens,
)
from jaxserve.pallas_kernels.storage import dequantize, value_dtype

PAGE_SIZE = 4
HEAD_DIM = 16
NUM_PAGES = 64
MAX_PAGES = 16  # 64 tokens per sequence at most
PAGES_PER_BLOCK = 2  # 8 keys per block
BLOCK_Q = 4
LONG = 37  # 10 pages, 5 page blocks
SCALE = HEAD_DIM**-0.5
RTOL, ATOL = 1e-5, 1e-6
# (query heads per KV head, KV heads)
GQA = [(1, 2), (3, 2), (4, 2), (8, 1)]
gqa_ids = [f"group{g}" for g, _ in GQA]


def make_pool(rng: np.random.Generator, num_kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (num_kv_heads, NUM_PAGES, PAGE_SIZE, HEAD_DIM)
    return rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)


def assign_pages(rng: np.random.Generator, kv_lens: np.ndarray) -> np.ndarray:
    """Shuffled, non-contiguous real pages (never the null page 0) for each row."""
    needed = -(-kv_lens // PAGE_SIZE)
    assert needed.sum() <= NUM_PAGES - 1, "the test's rows do not fit the pool"
    free = iter(rng.permutation(np.arange(1, NUM_PAGES, dtype=np.int32)))
    table = np.zeros((len(kv_lens), MAX_PAGES), np.int32)
    for row, n in enumerate(needed):
        table[row, :n] = [next(free) for _ in range(n)]
    return table


def in_f64(reference, q, k, v, *index) -> np.ndarray:
    with jax.enable_x64(True):
        args = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        return np.asarray(reference(*args, *index, SCALE))


def cu_lens(q_lens: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


# -- decode: one query per sequence -------------------------------------------------------

EDGE_KV_LENS = [0, 1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, LONG, MAX_PAGES * PAGE_SIZE, 2]


def decode_cases(rng: np.random.Generator, num_random: int) -> list[np.ndarray]:
    """The edge lengths, then seeded random batches of the same size."""
    cases = [np.array(EDGE_KV_LENS, np.int32)]
    while len(cases) < 1 + num_random:
        lens = rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 29, LONG, 45], len(EDGE_KV_LENS))
        if (-(-lens // PAGE_SIZE)).sum() < NUM_PAGES:
            cases.append(lens.astype(np.int32))
    return cases


@pytest.mark.parametrize(("group", "num_kv_heads"), GQA, ids=gqa_ids)
def test_decode_matches_reference(group, num_kv_heads):
    rng = np.random.default_rng(group)
    k, v = make_pool(rng, num_kv_heads)
    for kv_lens in decode_cases(rng, num_random=2):
        page_table = assign_pages(rng, kv_lens)
        q = rng.standard_normal((len(kv_lens), group * num_kv_heads, HEAD_DIM), np.float32)
        got = paged_attention(
            q, k, v, kv_lens, page_table,
            scale=SCALE, pages_per_block=PAGES_PER_BLOCK, interpret=True,
        )
        want = in_f64(paged_attention_reference, q, k, v, kv_lens, page_table)
        np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL, err_msg=kv_lens)
        assert not np.asarray(got)[kv_lens == 0].any(), "padding rows must output zeros"


@pytest.mark.parametrize("num_kv_splits", [3, 8])
def test_decode_kv_splits_match_reference(num_kv_splits):
    """Split sequences' pages between programs; 8 splits leave most of them empty."""
    rng = np.random.default_rng(num_kv_splits)
    k, v = make_pool(rng, 2)
    kv_lens = np.array(EDGE_KV_LENS, np.int32)
    page_table = assign_pages(rng, kv_lens)
    q = rng.standard_normal((len(kv_lens), 8, HEAD_DIM), np.float32)
    got = paged_attention(
        q, k, v, kv_lens, page_table, scale=SCALE, pages_per_block=PAGES_PER_BLOCK,
        num_kv_splits=num_kv_splits, interpret=True,
    )
    want = in_f64(paged_attention_reference, q, k, v, kv_lens, page_table)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)


# -- ragged: prefill chunks and decodes in one flat batch ----------------------------------

NUM_TOKENS = 32
# (q_len, kv_len): a decode over a long cache, a full prefill, a chunk continuing a prefix,
# a first token, a one-page prefill, a padding row, a row with nothing to compute, a short
# prefill; 23 tokens, then 9 padding tokens
EDGE_ROWS = [(1, LONG), (9, 9), (5, 23), (1, 1), (4, 4), (0, 0), (0, 7), (3, PAGE_SIZE - 1)]


def ragged_cases(rng: np.random.Generator, num_random: int) -> list[list[tuple[int, int]]]:
    """The edge rows, then seeded random mixes of decodes, prefills and chunks."""
    cases = [EDGE_ROWS]
    while len(cases) < 1 + num_random:
        rows = []
        for _ in EDGE_ROWS:
            kv_len = int(rng.choice([0, 1, 3, 4, 5, 8, 9, 12, 17, LONG]))
            kind = rng.integers(3)  # decode, full prefill, chunk of a prefix
            q_len = [min(1, kv_len), kv_len, int(rng.integers(0, kv_len + 1))][kind]
            rows.append((q_len, kv_len))
        q_total = sum(q for q, _ in rows)
        pages = sum(-(-kv // PAGE_SIZE) for _, kv in rows)
        if q_total <= NUM_TOKENS and pages < NUM_PAGES:
            cases.append(rows)
    return cases


def run_ragged(q, k, v, cu_q_lens, kv_lens, page_table) -> np.ndarray:
    out = ragged_paged_attention(
        q, k, v, cu_q_lens, kv_lens, page_table,
        scale=SCALE, block_q=BLOCK_Q, pages_per_block=PAGES_PER_BLOCK, interpret=True,
    )
    return np.asarray(out)


@pytest.mark.parametrize(("group", "num_kv_heads"), GQA, ids=gqa_ids)
def test_ragged_matches_reference(group, num_kv_heads):
    rng = np.random.default_rng(100 + group)
    k, v = make_pool(rng, num_kv_heads)
    for rows in ragged_cases(rng, num_random=2):
        cu_q_lens = cu_lens([q for q, _ in rows])
        kv_lens = np.array([kv for _, kv in rows], np.int32)
        page_table = assign_pages(rng, kv_lens)
        q = rng.standard_normal((NUM_TOKENS, group * num_kv_heads, HEAD_DIM), np.float32)
        got = run_ragged(q, k, v, cu_q_lens, kv_lens, page_table)
        want = in_f64(ragged_paged_attention_reference_lens, q, k, v, cu_q_lens, kv_lens,
                      page_table)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=str(rows))
        assert not got[cu_q_lens[-1] :].any(), "padding tokens must output zeros"


def test_ragged_decode_rows_equal_the_decode_kernel():
    rng = np.random.default_rng(7)
    k, v = make_pool(rng, 2)
    kv_lens = np.array(EDGE_KV_LENS, np.int32)
    page_table = assign_pages(rng, kv_lens)
    q = rng.standard_normal((len(kv_lens), 6, HEAD_DIM), np.float32)
    decode = paged_attention(
        q, k, v, kv_lens, page_table, scale=SCALE, pages_per_block=PAGES_PER_BLOCK,
        interpret=True,
    )
    cu_q_lens = cu_lens([min(1, n) for n in kv_lens])
    ragged = run_ragged(q[kv_lens > 0], k, v, cu_q_lens, kv_lens, page_table)
    np.testing.assert_allclose(ragged, np.asarray(decode)[kv_lens > 0], rtol=RTOL, atol=ATOL)




# -- blocked jnp (the CPU path): the packer's layout, a padding row last -----------------


def packed(rows: list[tuple[int, int]], num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """seq_ids and positions as batch.pack_step lays them out: rows in order, then
    padding tokens at position 0 of the padding row (the page table's last)."""
    seq_ids = np.full(num_tokens, len(rows), np.int32)
    positions = np.zeros(num_tokens, np.int32)
    offset = 0
    for row, (q_len, kv_len) in enumerate(rows):
        seq_ids[offset : offset + q_len] = row
        positions[offset : offset + q_len] = np.arange(kv_len - q_len, kv_len)
        offset += q_len
    return seq_ids, positions


@pytest.mark.parametrize("num_tokens", [NUM_TOKENS, len(EDGE_ROWS) + 1, 64])
@pytest.mark.parametrize(("group", "num_kv_heads"), GQA, ids=gqa_ids)
def test_blocked_matches_reference(group, num_kv_heads, num_tokens):
    """Every token against the dense reference, whatever the split of the batch into rows
    and so into query tiles (few tokens a row, or one row holding most of them)."""
    rng = np.random.default_rng(200 + group + num_tokens)
    k, v = make_pool(rng, num_kv_heads)
    cases = [[(1, LONG)] * 4 + [(1, 9)] * 4, [(num_tokens - 7, num_tokens - 3)] + [(1, 5)] * 7]
    cases += [rows for rows in ragged_cases(rng, num_random=3)
              if sum(q for q, _ in rows) <= num_tokens]
    for rows in cases:
        seq_ids, positions = packed(rows, num_tokens)
        kv_lens = np.array([kv for _, kv in rows] + [0], np.int32)
        page_table = assign_pages(rng, kv_lens)  # the padding row: all the null page
        q = rng.standard_normal((num_tokens, group * num_kv_heads, HEAD_DIM), np.float32)
        got = blocked_paged_attention(
            q, k[None], v[None], jnp.int32(0), seq_ids, positions, page_table, SCALE,
            pages_per_block=PAGES_PER_BLOCK,
        )
        want = in_f64(ragged_paged_attention_reference, q, k, v, seq_ids, positions,
                      page_table)
        live = sum(q_len for q_len, _ in rows)
        np.testing.assert_allclose(np.asarray(got)[:live], want[:live], rtol=RTOL, atol=ATOL,
                                   err_msg=str(rows))


def test_query_tiles_cover_any_split_of_the_batch():
    """Enough tiles for the worst split: every row but one a single token, the rest one
    row, and rows of a tile's length plus one."""
    for num_tokens, num_rows in [(1, 2), (16, 17), (128, 17), (256, 17), (128, 2), (64, 9)]:
        size, tiles = tile_shape(num_tokens, num_rows)
        for lens in ([1] * (num_rows - 1) + [num_tokens - num_rows + 1],
                     [size + 1] * (num_tokens // (size + 1))):
            lens = [n for n in lens if n > 0][:num_rows]
            assert sum(-(-n // size) for n in lens) <= tiles, (num_tokens, num_rows, lens)


def test_whole_cache_with_a_layer_reads_that_layer():
    """The model passes every layer's pool and the layer (slicing one out would copy it):
    each layer read gives what that layer alone gives, for both kernels."""
    rng = np.random.default_rng(11)
    layers = [make_pool(rng, 2) for _ in range(3)]
    k = np.stack([kl for kl, _ in layers])  # [layers, kv_heads, pages, page_size, head_dim]
    v = np.stack([vl for _, vl in layers])
    kv_lens = np.array([LONG, 5, 1], np.int32)
    page_table = assign_pages(rng, kv_lens)
    q = rng.standard_normal((len(kv_lens), 6, HEAD_DIM), np.float32)
    cu_q_lens = cu_lens([1, 1, 1])
    for layer in range(3):
        decode = paged_attention(
            q, k, v, kv_lens, page_table, jnp.int32(layer), scale=SCALE,
            pages_per_block=PAGES_PER_BLOCK, interpret=True,
        )
        ragged = ragged_paged_attention(
            q, k, v, cu_q_lens, kv_lens, page_table, jnp.int32(layer), scale=SCALE,
            block_q=BLOCK_Q, pages_per_block=PAGES_PER_BLOCK, interpret=True,
        )
        want = in_f64(paged_attention_reference, q, k[layer], v[layer], kv_lens, page_table)
        np.testing.assert_allclose(np.asarray(decode), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(ragged), want, rtol=RTOL, atol=ATOL)


def test_a_layer_goes_with_a_whole_cache_only():
    q, k, v, kv_lens, page_table = decode_args()
    cache = jax.ShapeDtypeStruct((2, *k.shape), k.dtype)
    with pytest.raises(ValueError, match=r"holds every layer .* give the layer to read"):
        paged_attention.trace(q, cache, cache, kv_lens, page_table, scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="layer is given but k_pages holds one layer"):
        paged_attention.trace(q, k, v, kv_lens, page_table, 0, scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        paged_attention.trace(q, cache, cache, kv_lens, page_table, jnp.zeros(2, jnp.int32),
                              scale=SCALE, interpret=True)


def test_page_blocks_shrink_to_fit_shared_memory():
    # f32, head_dim 128: 8 pages of 32 keys ask 256 KiB of K/V a stage (seen failing to
    # launch on an H200); 4 pages fit. bf16 at page size 16 keeps its 8.
    assert fit_pages_per_block(8, 16, 32, 128, 4) == 4
    assert fit_pages_per_block(8, 128, 32, 128, 4) == 4
    assert fit_pages_per_block(8, 64, 16, 128, 2) == 8
    assert fit_pages_per_block(1, 16, 16, 1024, 4) == 1  # never below one page
    assert fit_pages_per_block(2, 16, 8, 1024, 4) == 2  # never below a 16-key block

# -- padding never leaks into real rows -----------------------------------------------------


def poison(rng, k, v, kv_lens, page_table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NaN in the null page and in every slot past a row's kv_len; junk ids past its pages.

    Interpret mode clamps an out-of-range page id, so only a GPU would fault on one; here the
    junk checks that those entries change nothing.
    """
    k, v, page_table = k.copy(), v.copy(), page_table.copy()
    for x in (k, v):
        x[:, 0] = np.nan
        for row, n in enumerate(kv_lens):
            if n % PAGE_SIZE:
                x[:, page_table[row, n // PAGE_SIZE], n % PAGE_SIZE :] = np.nan
    used = -(-kv_lens // PAGE_SIZE)
    for row, n in enumerate(used):
        page_table[row, n:] = rng.integers(-NUM_PAGES, 100 * NUM_PAGES, MAX_PAGES - n)
    return k, v, page_table


def test_decode_padding_and_stale_slots_do_not_leak():
    rng = np.random.default_rng(11)
    k, v = make_pool(rng, 2)
    kv_lens = np.array(EDGE_KV_LENS, np.int32)
    page_table = assign_pages(rng, kv_lens)
    q = rng.standard_normal((len(kv_lens), 8, HEAD_DIM), np.float32)
    clean = paged_attention(
        q, k, v, kv_lens, page_table, scale=SCALE, pages_per_block=PAGES_PER_BLOCK,
        interpret=True,
    )
    q_bad = q.copy()
    q_bad[kv_lens == 0] = np.nan
    k_bad, v_bad, table_bad = poison(rng, k, v, kv_lens, page_table)
    dirty = np.asarray(paged_attention(
        q_bad, k_bad, v_bad, kv_lens, table_bad, scale=SCALE, pages_per_block=PAGES_PER_BLOCK,
        interpret=True,
    ))
    assert np.isfinite(dirty).all()
    np.testing.assert_array_equal(dirty, np.asarray(clean))


def test_ragged_padding_and_stale_slots_do_not_leak():
    rng = np.random.default_rng(12)
    k, v = make_pool(rng, 2)
    cu_q_lens = cu_lens([q for q, _ in EDGE_ROWS])
    kv_lens = np.array([kv for _, kv in EDGE_ROWS], np.int32)
    page_table = assign_pages(rng, kv_lens)
    q = rng.standard_normal((NUM_TOKENS, 6, HEAD_DIM), np.float32)
    clean = run_ragged(q, k, v, cu_q_lens, kv_lens, page_table)
    q_bad = q.copy()
    q_bad[cu_q_lens[-1] :] = np.nan
    k_bad, v_bad, table_bad = poison(rng, k, v, kv_lens, page_table)
    dirty = run_ragged(q_bad, k_bad, v_bad, cu_q_lens, kv_lens, table_bad)
    assert np.isfinite(dirty).all()
    np.testing.assert_array_equal(dirty, clean)


# -- input checks and lowering ------------------------------------------------------------


def decode_args(num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, num_seqs=3):
    f32, i32 = jnp.float32, jnp.int32
    pool = jax.ShapeDtypeStruct((num_kv_heads, NUM_PAGES, PAGE_SIZE, head_dim), f32)
    return [
        jax.ShapeDtypeStruct((num_seqs, num_heads, HEAD_DIM), f32), pool, pool,
        jax.ShapeDtypeStruct((num_seqs,), i32), jax.ShapeDtypeStruct((num_seqs, MAX_PAGES), i32),
    ]


def with_arg(args, i, shape, dtype=jnp.int32):
    return [*args[:i], jax.ShapeDtypeStruct(shape, dtype), *args[i + 1 :]]


BAD_DECODE = {
    "heads": (decode_args(num_heads=12, num_kv_heads=5),
              "q has 12 heads but k_pages has 5 KV heads: 12 is not a multiple of 5"),
    "head_dim": (decode_args(head_dim=32), "q has head_dim 16 (shape (3, 8, 16)) but k_pages"),
    "v_pages": (with_arg(decode_args(), 2, (2, NUM_PAGES, PAGE_SIZE, 8), jnp.float32),
                "k_pages has shape (2, 64, 4, 16) but v_pages has shape (2, 64, 4, 8)"),
    "kv_lens": (with_arg(decode_args(), 3, (4,)),
                "kv_lens has shape (4,) but q has shape (3, 8, 16): expected [3]"),
    "kv_lens_dtype": (with_arg(decode_args(), 3, (3,), jnp.float32), "kv_lens must be int32"),
    "page_table": (with_arg(decode_args(), 4, (2, MAX_PAGES)),
                   "page_table has shape (2, 16) but q has shape (3, 8, 16): expected [3, *]"),
}


@pytest.mark.parametrize("case", BAD_DECODE, ids=list(BAD_DECODE))
def test_decode_rejects_bad_shapes(case):
    args, message = BAD_DECODE[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention.trace(*args, scale=SCALE, interpret=True)


def test_ragged_rejects_bad_shapes():
    q, k, v, kv_lens, page_table = decode_args()
    cu_q_lens = jax.ShapeDtypeStruct((3,), jnp.int32)
    with pytest.raises(ValueError, match=r"cu_q_lens has shape \(3,\) but kv_lens has shape"):
        ragged_paged_attention.trace(q, k, v, cu_q_lens, kv_lens, page_table, scale=SCALE)
    q12 = jax.ShapeDtypeStruct((3, 12, HEAD_DIM), jnp.float32)
    k5 = jax.ShapeDtypeStruct((5, NUM_PAGES, PAGE_SIZE, HEAD_DIM), jnp.float32)
    cu_q_lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    with pytest.raises(ValueError, match="12 is not a multiple of 5"):
        ragged_paged_attention.trace(q12, k5, k5, cu_q_lens, kv_lens, page_table, scale=SCALE)


def test_gpu_tiles_are_checked_unless_interpreting():
    # 2 pages of 4 keys make an 8-key block: too small for a Triton dot
    with pytest.raises(ValueError, match=r"pages_per_block \* page_size \(2 \* 4\) is 8"):
        paged_attention.trace(*decode_args(), scale=SCALE, pages_per_block=2)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype", "q_dtype"),
    [(32, 8, 128, jnp.bfloat16, jnp.float32), (6, 2, 64, jnp.float32, jnp.float32),
     (32, 8, 128, jnp.int8, jnp.bfloat16), (6, 2, 64, jnp.float8_e4m3fn, jnp.float32),
     # bf16 and fp8 as the engine keeps them: their bits (pallas_kernels.storage.BITS)
     (32, 8, 128, jnp.uint16, jnp.bfloat16), (32, 8, 128, jnp.uint8, jnp.bfloat16)],
    ids=["llama3-8b-bf16", "group3-f32", "llama3-8b-int8", "group3-fp8", "llama3-8b-bf16-bits",
         "llama3-8b-fp8-bits"],
)
def test_kernels_lower_to_triton_for_cuda(num_heads, num_kv_heads, head_dim, dtype, q_dtype):
    """Pallas -> Triton IR runs without a GPU: it catches what the Triton backend rejects
    (int8 pools with their scales, dequantized in the kernel, included)."""
    s = jax.ShapeDtypeStruct

    def scales(pool):
        if dtype != jnp.int8:
            return {}
        return {name: s(pool.shape[:-1], jnp.float32) for name in ("k_scale", "v_scale")}

    pool = s((num_kv_heads, 65, 16, head_dim), dtype)
    index = [s((4,), jnp.int32), s((4, 16), jnp.int32)]
    decode = paged_attention.trace(
        s((4, num_heads, head_dim), q_dtype), pool, pool, *index, scale=0.1, num_kv_splits=2,
        **scales(pool),
    ).lower(lowering_platforms=("cuda",))
    ragged = ragged_paged_attention.trace(
        s((40, num_heads, head_dim), q_dtype), pool, pool, s((5,), jnp.int32), *index,
        scale=0.1, **scales(pool),
    ).lower(lowering_platforms=("cuda",))
    cache = s((2, num_kv_heads, 65, 16, head_dim), dtype)  # every layer, read at layer 1
    layered = ragged_paged_attention.trace(
        s((40, num_heads, head_dim), q_dtype), cache, cache, s((5,), jnp.int32), *index,
        s((), jnp.int32), scale=0.1, **scales(cache),
    ).lower(lowering_platforms=("cuda",))
    for lowered in (decode, ragged, layered):
        assert "xla.gpu.triton" in lowered.as_text()


# -- KV storages (--kv-dtype): bf16, int8 with per-token scales, fp8 ----------------------

STORAGES = ["bf16", "int8", "fp8"]
STORAGE_GQA = [(3, 2), (8, 1)]  # a padded group of 3, and every query head on one KV head
storage_gqa_ids = [f"group{g}" for g, _ in STORAGE_GQA]
NUM_LAYERS = 2


def stored_cache(rng, num_kv_heads, storage, num_layers=None):
    """A random f32 cache ([num_layers, ...], or one layer's pool without num_layers) as
    `storage` stores it, {k, v, k_scale, v_scale} (scales None unless int8), and the f32
    values it dequantizes to. Token vectors' magnitudes spread over [1/4, 4], so their
    int8 scales differ from token to token."""
    layers = () if num_layers is None else (num_layers,)
    shape = (*layers, num_kv_heads, NUM_PAGES, PAGE_SIZE, HEAD_DIM)
    stored, exact = {}, []
    for name in "kv":
        x = rng.standard_normal(shape, np.float32)
        x *= np.exp2(rng.uniform(-2, 2, shape[:-1] + (1,))).astype(np.float32)
        values, scale = kv_cache.quantize(jnp.asarray(x), kv_cache.KV_STORAGE[storage])
        assert value_dtype(values.dtype) == kv_cache.KV_STORAGE[storage]
        stored[name], stored[f"{name}_scale"] = values, scale
        exact.append(np.asarray(dequantize(values, scale, jnp.float32)))
    return stored, exact


def scales_of(stored, layer=None):
    """The storage's scale keyword arguments, of one layer where given."""
    if stored["k_scale"] is None:
        return {}
    pick = (lambda x: x) if layer is None else (lambda x: x[layer])
    return {"k_scale": pick(stored["k_scale"]), "v_scale": pick(stored["v_scale"])}


@pytest.mark.parametrize("storage", STORAGES)
def test_reference_with_scales_is_the_reference_on_the_dequantized_pool(storage):
    rng = np.random.default_rng(300)
    stored, (k, v) = stored_cache(rng, 2, storage)
    kv_lens = np.array([LONG, 9, 1, 0], np.int32)
    rows = [(1, LONG), (9, 9), (1, 1), (0, 0)]
    seq_ids, positions = packed(rows[:-1], 16)
    page_table = assign_pages(rng, kv_lens)
    q = rng.standard_normal((16, 6, HEAD_DIM), np.float32)
    args = (seq_ids, positions, page_table, SCALE)
    got = ragged_paged_attention_reference(q, stored["k"], stored["v"], *args,
                                           **scales_of(stored))
    want = ragged_paged_attention_reference(q, k, v, *args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    decode = paged_attention_reference(q[:4], stored["k"], stored["v"], kv_lens, page_table,
                                       SCALE, **scales_of(stored))
    np.testing.assert_array_equal(
        np.asarray(decode), np.asarray(paged_attention_reference(q[:4], k, v, kv_lens,
                                                                 page_table, SCALE)))
    cu_q_lens = cu_lens([q_len for q_len, _ in rows])
    lens = ragged_paged_attention_reference_lens(q, stored["k"], stored["v"], cu_q_lens,
                                                 kv_lens, page_table, SCALE,
                                                 **scales_of(stored))
    np.testing.assert_array_equal(
        np.asarray(lens), np.asarray(ragged_paged_attention_reference_lens(
            q, k, v, cu_q_lens, kv_lens, page_table, SCALE)))
    if storage == "int8":  # the stored values alone are nowhere near
        unscaled = ragged_paged_attention_reference(
            q, stored["k"].astype(jnp.float32), stored["v"].astype(jnp.float32), *args)
        assert not np.allclose(np.asarray(unscaled), np.asarray(want), atol=0.1)


@pytest.mark.parametrize(("group", "num_kv_heads"), STORAGE_GQA, ids=storage_gqa_ids)
@pytest.mark.parametrize("storage", STORAGES)
def test_blocked_reads_every_storage(storage, group, num_kv_heads):
    """A whole cache in `storage` read at a layer, mixed prefill and decode rows, against
    the reference on the dequantized pool."""
    rng = np.random.default_rng(400 + group)
    stored, (k, v) = stored_cache(rng, num_kv_heads, storage, NUM_LAYERS)
    for rows in ragged_cases(rng, num_random=1):
        seq_ids, positions = packed(rows, NUM_TOKENS)
        kv_lens = np.array([kv for _, kv in rows] + [0], np.int32)
        page_table = assign_pages(rng, kv_lens)
        q = rng.standard_normal((NUM_TOKENS, group * num_kv_heads, HEAD_DIM), np.float32)
        for layer in range(NUM_LAYERS):
            got = blocked_paged_attention(
                q, stored["k"], stored["v"], jnp.int32(layer), seq_ids, positions,
                page_table, SCALE, pages_per_block=PAGES_PER_BLOCK, **scales_of(stored),
            )
            want = in_f64(ragged_paged_attention_reference, q, k[layer], v[layer], seq_ids,
                          positions, page_table)
            live = sum(q_len for q_len, _ in rows)
            np.testing.assert_allclose(np.asarray(got)[:live], want[:live], rtol=RTOL,
                                       atol=ATOL, err_msg=f"layer {layer}: {rows}")


@pytest.mark.parametrize(("group", "num_kv_heads"), STORAGE_GQA, ids=storage_gqa_ids)
@pytest.mark.parametrize("storage", STORAGES)
def test_ragged_reads_every_storage(storage, group, num_kv_heads):
    """The Pallas ragged kernel over a whole cache in `storage`, read at its last layer."""
    rng = np.random.default_rng(500 + group)
    stored, (k, v) = stored_cache(rng, num_kv_heads, storage, NUM_LAYERS)
    layer = NUM_LAYERS - 1
    for rows in ragged_cases(rng, num_random=1):
        cu_q_lens = cu_lens([q for q, _ in rows])
        kv_lens = np.array([kv for _, kv in rows], np.int32)
        page_table = assign_pages(rng, kv_lens)
        q = rng.standard_normal((NUM_TOKENS, group * num_kv_heads, HEAD_DIM), np.float32)
        got = np.asarray(ragged_paged_attention(
            q, stored["k"], stored["v"], cu_q_lens, kv_lens, page_table, jnp.int32(layer),
            scale=SCALE, block_q=BLOCK_Q, pages_per_block=PAGES_PER_BLOCK, interpret=True,
            **scales_of(stored),
        ))
        want = in_f64(ragged_paged_attention_reference_lens, q, k[layer], v[layer], cu_q_lens,
                      kv_lens, page_table)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=str(rows))
        assert got.dtype == np.float32


@pytest.mark.parametrize("storage", STORAGES)
def test_decode_reads_every_storage(storage):
    """The Pallas decode kernel over one layer's pool in `storage` (scales [H, P, S]), the
    edge lengths and a random batch, with and without KV splits."""
    rng = np.random.default_rng(600)
    stored, (k, v) = stored_cache(rng, 2, storage)
    for kv_lens in decode_cases(rng, num_random=1):
        page_table = assign_pages(rng, kv_lens)
        q = rng.standard_normal((len(kv_lens), 6, HEAD_DIM), np.float32)
        want = in_f64(paged_attention_reference, q, k, v, kv_lens, page_table)
        for splits in (1, 3):
            got = np.asarray(paged_attention(
                q, stored["k"], stored["v"], kv_lens, page_table, scale=SCALE,
                pages_per_block=PAGES_PER_BLOCK, num_kv_splits=splits, interpret=True,
                **scales_of(stored),
            ))
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{splits} splits: {kv_lens}")
            assert not got[kv_lens == 0].any(), "padding rows must output zeros"


def test_bf16_queries_over_an_int8_cache_stay_bf16():
    """q is never cast to the storage: a bf16 q reads an int8 cache dequantized to bf16."""
    rng = np.random.default_rng(700)
    stored, (k, v) = stored_cache(rng, 2, "int8", NUM_LAYERS)
    kv_lens = np.array([LONG, 5, 1], np.int32)
    page_table = assign_pages(rng, kv_lens)
    q = jnp.asarray(rng.standard_normal((3, 6, HEAD_DIM), np.float32), jnp.bfloat16)
    want = in_f64(paged_attention_reference, q, k[1], v[1], kv_lens, page_table)
    got = paged_attention(
        q, stored["k"], stored["v"], kv_lens, page_table, jnp.int32(1), scale=SCALE,
        pages_per_block=PAGES_PER_BLOCK, interpret=True, **scales_of(stored),
    )
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)


def every_implementation(stored, layer, rows, page_table, q):
    """Each implementation's output over the whole cache `stored` at `layer`, with the
    storage's scales as given in `stored`."""
    cu_q_lens = cu_lens([q_len for q_len, _ in rows])
    kv_lens = np.array([kv for _, kv in rows], np.int32)
    seq_ids, positions = packed(rows, len(q))
    scales = scales_of(stored)
    tiles = {"pages_per_block": PAGES_PER_BLOCK}
    return {
        "reference": ragged_paged_attention_reference(
            q, stored["k"][layer], stored["v"][layer], seq_ids, positions, page_table, SCALE,
            **scales_of(stored, layer),
        ),
        "blocked": blocked_paged_attention(
            q, stored["k"], stored["v"], jnp.int32(layer), seq_ids, positions, page_table,
            SCALE, **tiles, **scales,
        ),
        "ragged": ragged_paged_attention(
            q, stored["k"], stored["v"], cu_q_lens, kv_lens, page_table, jnp.int32(layer),
            scale=SCALE, block_q=BLOCK_Q, interpret=True, **tiles, **scales,
        ),
        "decode": paged_attention(
            q, stored["k"], stored["v"], kv_lens, page_table, jnp.int32(layer), scale=SCALE,
            interpret=True, **tiles, **scales,
        ),
    }


def test_int8_scales_are_applied_per_token():
    """Scales are read, and for the right tokens: doubling every V scale doubles each output
    exactly, and rescaling a few tokens' K and V changes their row's output as the
    reference on the rescaled pool says, and no other row's."""
    rng = np.random.default_rng(800)
    stored, _ = stored_cache(rng, 2, "int8", NUM_LAYERS)
    rows = [(1, LONG), (1, 9), (1, 1)]  # decodes, which every implementation takes
    page_table = assign_pages(rng, np.array([kv for _, kv in rows], np.int32))
    q = rng.standard_normal((len(rows), 6, HEAD_DIM), np.float32)
    base = every_implementation(stored, 1, rows, page_table, q)
    doubled = every_implementation({**stored, "v_scale": stored["v_scale"] * 2}, 1, rows,
                                   page_table, q)
    # a few tokens of the long row, K and V each scaled by a different factor
    page = page_table[0, 3]
    k_scale = stored["k_scale"].at[1, :, page, 1:3].multiply(jnp.float32(3.0))
    v_scale = stored["v_scale"].at[1, :, page, 2:].multiply(jnp.float32(0.25))
    rescaled = every_implementation({**stored, "k_scale": k_scale, "v_scale": v_scale}, 1,
                                    rows, page_table, q)
    want = np.asarray(rescaled["reference"])
    assert not np.allclose(want[0], np.asarray(base["reference"])[0], atol=1e-3)
    np.testing.assert_array_equal(want[1:], np.asarray(base["reference"])[1:])
    for name in base:
        np.testing.assert_array_equal(np.asarray(doubled[name]), 2 * np.asarray(base[name]),
                                      err_msg=name)
        np.testing.assert_allclose(np.asarray(rescaled[name]), want, rtol=RTOL, atol=ATOL,
                                   err_msg=name)


def test_scales_go_with_int8_pages_only():
    """int8 pages without scales, or scales of the wrong shape, or scales with another
    storage, raise in every implementation."""
    q, k, _, kv_lens, page_table = decode_args()
    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    pool, cache = s(k.shape, jnp.int8), s((2, *k.shape), jnp.int8)
    seq_ids = positions = s((3,), i32)
    calls = {  # each implementation's call on an int8 pool, and its scales' shape
        "decode": (lambda **kw: paged_attention.trace(
            q, pool, pool, kv_lens, page_table, scale=SCALE, interpret=True, **kw), pool),
        "ragged": (lambda **kw: ragged_paged_attention.trace(
            q, cache, cache, s((4,), i32), kv_lens, page_table, s((), i32), scale=SCALE,
            interpret=True, **kw), cache),
        "reference": (lambda **kw: jax.eval_shape(
            functools.partial(ragged_paged_attention_reference, scale=SCALE),
            q, pool, pool, seq_ids, positions, page_table, **kw), pool),
        "blocked": (lambda **kw: jax.eval_shape(
            functools.partial(blocked_paged_attention, scale=SCALE),
            q, cache, cache, s((), i32), seq_ids, positions, page_table, **kw), cache),
    }
    for call, pages in calls.values():
        scale = s(pages.shape[:-1], jnp.float32)
        call(k_scale=scale, v_scale=scale)  # what it takes
        with pytest.raises(ValueError, match="int8 pages need k_scale"):
            call()
        with pytest.raises(ValueError, match="int8 pages need v_scale"):
            call(k_scale=scale)
        want = f"v_scale must be f32{list(pages.shape[:-1])}"
        with pytest.raises(ValueError, match=re.escape(want)):
            call(k_scale=scale, v_scale=s(pages.shape[:-2], jnp.float32))
    k_fp8 = s(k.shape, jnp.float8_e4m3fn)
    scale = s(k.shape[:-1], jnp.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn pages take no scales"):
        ragged_paged_attention.trace(q, k_fp8, k_fp8, s((4,), i32), kv_lens, page_table,
                                     scale=SCALE, k_scale=scale, v_scale=scale)
