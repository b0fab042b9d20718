"""The C++ CPU attention kernel against the float64 jnp reference, and its build cache.

Page size 16 with head size 64 or 128 runs the kernel's specialized loops; the other
shapes run its generic ones. Rows mix decodes, whole prefills and chunks with ragged
lengths, with padding rows and tokens, as the engine packs them. Quantized pools (bf16,
int8 with scales, fp8) are checked against the reference on the same pool dequantized
by storage.dequantize: both see identical values, so they agree to f32 rounding.
"""

import ctypes
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cpu_kernels import build, linear
from jaxserve.cpu_kernels.paged_attention import (
    TARGET,
    available,
    cpu_paged_attention,
    prefetch_job,
)
from jaxserve.device import kv_cache
from jaxserve.device.kv_cache import KV_STORAGE
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference_lens
from jaxserve.pallas_kernels.storage import dequantize, value_dtype

# only a missing compiler skips: a kernel that no longer compiles fails here (it used to
# skip every test below as if there were no compiler)
pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here")

NUM_PAGES = 96
MAX_PAGES = 12
NUM_TOKENS = 96
RTOL, ATOL = 1e-5, 1e-6
# (page size, head size, query heads per KV head, KV heads)
SHAPES = [(16, 64, 3, 3), (16, 128, 4, 2), (16, 64, 1, 2), (4, 16, 8, 1), (8, 32, 2, 3)]
QUANTIZED = ("bf16", "int8", "fp8")


def rows_cases(rng: np.random.Generator, page_size: int) -> list[list[tuple[int, int]]]:
    """(q_len, kv_len) rows: the edges (empty rows, a first token, page boundaries, a
    prefill longer than a tile, a chunk), then seeded random mixes."""
    longest = MAX_PAGES * page_size
    edges = [(1, longest), (0, 0), (1, 1), (page_size, page_size), (3, page_size + 1),
             (0, 7), (40, 40), (17, longest - 3), (2, page_size - 1)]
    cases = [edges]
    while len(cases) < 4:
        rows = []
        for _ in range(8):
            kv_len = int(rng.integers(0, longest + 1))
            q_len = [min(1, kv_len), kv_len, int(rng.integers(0, kv_len + 1))][rng.integers(3)]
            rows.append((q_len, kv_len))
        if sum(q for q, _ in rows) <= NUM_TOKENS:
            cases.append(rows)
    return cases


def assign_pages(rng, kv_lens: np.ndarray, page_size: int) -> np.ndarray:
    """Shuffled pages (never the null page 0), reused across rows when the pool runs out:
    the kernel only reads them."""
    table = np.zeros((len(kv_lens), MAX_PAGES), np.int32)
    for row, kv_len in enumerate(kv_lens):
        n = -(-kv_len // page_size)
        table[row, :n] = rng.choice(np.arange(1, NUM_PAGES), n, replace=False)
    return table


def reference(q, k, v, cu_q_lens, kv_lens, page_table, scale) -> np.ndarray:
    with jax.enable_x64(True):
        f64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        return np.asarray(ragged_paged_attention_reference_lens(
            *f64, cu_q_lens, kv_lens, page_table, scale))


def store(x: np.ndarray, storage: str) -> tuple[jax.Array, jax.Array | None, np.ndarray]:
    """x (f32, [..., head_dim]) as `storage` keeps it: the values, their scales (int8) or
    None, and what they dequantize to in f32."""
    values, scale = kv_cache.quantize(jnp.asarray(x), KV_STORAGE[storage])
    return values, scale, np.asarray(dequantize(values, scale, jnp.float32))


def scales(k_scale, v_scale) -> dict:
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


@pytest.mark.parametrize(("page_size", "head_dim", "group", "num_kv_heads"), SHAPES)
def test_matches_the_reference_on_every_layer(page_size, head_dim, group, num_kv_heads):
    rng = np.random.default_rng(page_size * head_dim + group)
    num_layers = 2
    shape = (num_layers, num_kv_heads, NUM_PAGES, page_size, head_dim)
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    scale = head_dim**-0.5
    run = jax.jit(lambda *a: cpu_paged_attention(*a, scale=scale))
    for rows in rows_cases(rng, page_size):
        q_lens = [q for q, _ in rows]
        cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        kv_lens = np.array([kv for _, kv in rows], np.int32)
        table = assign_pages(rng, kv_lens, page_size)
        q = rng.standard_normal((NUM_TOKENS, group * num_kv_heads, head_dim), np.float32)
        for layer in range(num_layers):
            got = np.asarray(run(q, k, v, cu_q_lens, kv_lens, table, layer))
            want = reference(q, k[layer], v[layer], cu_q_lens, kv_lens, table, scale)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=str(rows))
            assert not got[cu_q_lens[-1]:].any(), "padding tokens must output zeros"


@pytest.mark.parametrize("storage", QUANTIZED)
@pytest.mark.parametrize(("page_size", "head_dim", "group", "num_kv_heads"),
                         [(16, 64, 3, 2), (8, 32, 2, 3)])
def test_quantized_pools_match_the_reference_on_their_dequantized_values(
        storage, page_size, head_dim, group, num_kv_heads):
    """Every layer of a whole cache with a layer index, and one layer's pool alone."""
    rng = np.random.default_rng(page_size * head_dim + group + len(storage))
    num_layers = 2
    shape = (num_layers, num_kv_heads, NUM_PAGES, page_size, head_dim)
    k, k_scale, k_f32 = store(rng.standard_normal(shape, np.float32), storage)
    v, v_scale, v_f32 = store(rng.standard_normal(shape, np.float32), storage)
    assert value_dtype(k.dtype) == KV_STORAGE[storage]
    assert (k_scale is None) == (storage != "int8")
    scale = head_dim**-0.5
    run = jax.jit(lambda *a, **s: cpu_paged_attention(*a, scale=scale, **s))
    run_kept = jax.jit(lambda *a, **s: cpu_paged_attention(*a, scale=scale, k_transposed=True,
                                                           **s))
    for rows in rows_cases(rng, page_size)[:3]:
        q_lens = [q for q, _ in rows]
        cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        kv_lens = np.array([kv for _, kv in rows], np.int32)
        table = assign_pages(rng, kv_lens, page_size)
        q = rng.standard_normal((NUM_TOKENS, group * num_kv_heads, head_dim), np.float32)
        for layer in range(num_layers):
            got = np.asarray(run(q, k, v, cu_q_lens, kv_lens, table, layer,
                                 **scales(k_scale, v_scale)))
            want = reference(q, k_f32[layer], v_f32[layer], cu_q_lens, kv_lens, table, scale)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=str(rows))
            assert not got[cu_q_lens[-1]:].any(), "padding tokens must output zeros"
        one_layer = scales(*(None if s is None else s[1] for s in (k_scale, v_scale)))
        alone = np.asarray(run(q, k[1], v[1], cu_q_lens, kv_lens, table, **one_layer))
        np.testing.assert_array_equal(alone, got)
        # K kept transposed, as the engine keeps it for this kernel: the same bits
        kept = np.asarray(run_kept(q, jnp.swapaxes(k, -1, -2), v, cu_q_lens, kv_lens, table,
                                   1, **scales(k_scale, v_scale)))
        np.testing.assert_array_equal(kept, got)


AMX = "amx_bf16" in build.cpu_flags().split()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prompt_rows_take_amx_and_stay_f32_close(head_dim):
    """Rows flagged as a prompt's (bf16 pages of 16 keys) run on AMX where the CPU has it,
    q and the weights each in two bf16 parts: within 2e-5 of the float64 reference (the
    f32 loop: 1e-6), and not the f32 loop's bits (where they attend to more than one
    key), so the flag is seen; the other rows of the same call give the f32 loop's bits,
    as a call without flags gives them."""
    rng = np.random.default_rng(head_dim)
    group, num_kv_heads = (3, 3) if head_dim == 64 else (4, 2)
    shape = (2, num_kv_heads, NUM_PAGES, 16, head_dim)
    (k, _, k_f32), (v, _, v_f32) = (store(rng.standard_normal(shape, np.float32), "bf16")
                                    for _ in range(2))
    scale = head_dim**-0.5
    run = jax.jit(lambda *a, **kw: cpu_paged_attention(*a, scale=scale, **kw))
    amx_rows = 0  # flagged rows whose output is not the f32 loop's
    for rows in rows_cases(rng, 16):
        q_lens = [q for q, _ in rows]
        cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        kv_lens = np.array([kv for _, kv in rows], np.int32)
        table = assign_pages(rng, kv_lens, 16)
        prompt = rng.integers(0, 2, len(rows)).astype(np.int32)
        q = rng.standard_normal((NUM_TOKENS, group * num_kv_heads, head_dim), np.float32)
        for layer in range(2):
            got = np.asarray(run(q, k, v, cu_q_lens, kv_lens, table, layer, is_prompt=prompt))
            f32 = np.asarray(run(q, k, v, cu_q_lens, kv_lens, table, layer))
            want = reference(q, k_f32[layer], v_f32[layer], cu_q_lens, kv_lens, table, scale)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=str(rows))
            assert not got[cu_q_lens[-1]:].any(), "padding tokens must output zeros"
            for r, (a, b) in enumerate(itertools.pairwise(cu_q_lens)):
                if not prompt[r]:
                    np.testing.assert_array_equal(got[a:b], f32[a:b])
                elif not np.array_equal(got[a:b], f32[a:b]):
                    amx_rows += 1
    assert (amx_rows > 4) == AMX, amx_rows


def test_prompt_rows_need_one_flag_a_row():
    with pytest.raises(ValueError, match="is_prompt has shape"):
        cpu_paged_attention(
            jnp.zeros((4, 2, 16)), jnp.zeros((1, 2, 8, 4, 16)), jnp.zeros((1, 2, 8, 4, 16)),
            jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32),
            0, scale=1.0, is_prompt=jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize("storage", QUANTIZED)
def test_every_stored_value_is_dequantized_exactly(storage):
    """One query over one key: the output is that key's value row, bit for bit. The row
    holds every bf16 and fp8 bit pattern (NaNs, infinities, subnormals) and every
    int8 value, -128 included, times a scale."""
    codes = {
        "bf16": np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.bfloat16),
        "fp8": np.arange(256, dtype=np.uint32).astype(np.uint8).view(jnp.float8_e4m3fn),
        "int8": np.arange(-128, 128, dtype=np.int8),
    }[storage]
    head_dim = codes.size
    v = np.zeros((1, 1, 2, 4, head_dim), codes.dtype)
    v[0, 0, 1, 0] = codes
    k = np.zeros_like(v)
    scaled = {}
    v_scale = None
    if storage == "int8":
        v_scale = np.zeros((1, 1, 2, 4), np.float32)
        v_scale[0, 0, 1, 0] = 0.3712
        scaled = {"k_scale": jnp.asarray(np.ones_like(v_scale)), "v_scale": jnp.asarray(v_scale)}
    got = cpu_paged_attention(
        jnp.zeros((1, 1, head_dim), jnp.float32), jnp.asarray(k), jnp.asarray(v),
        jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32), jnp.array([[1]], jnp.int32),
        0, scale=1.0, **scaled)
    want = dequantize(jnp.asarray(codes), None if v_scale is None else
                               jnp.asarray(v_scale[0, 0, 1, 0]), jnp.float32)
    got, want = np.asarray(got)[0, 0], np.asarray(want)
    # XLA runs the kernel with denormals flushed: bf16's f32-subnormal values read as 0,
    # as they would in an f32 pool (and -0 comes out as 0, the accumulator's zero plus it)
    want = np.where(np.abs(want) < np.finfo(np.float32).tiny, 0, want)
    if storage == "fp8":  # e4m3fn: S.1111.111 is NaN, and nothing is infinite
        assert np.isnan(got).sum() == 2 and np.isinf(got).sum() == 0
    np.testing.assert_array_equal(got, want)


def test_int8_scales_are_applied_per_token():
    """The kernel's int8 output is the reference's on values × scales, not on the raw
    values, and scaling V's scales by 2 scales the output by exactly 2."""
    rng = np.random.default_rng(11)
    page_size, head_dim, rows = 16, 64, [(1, 37), (20, 20), (3, 50)]
    shape = (1, 2, NUM_PAGES, page_size, head_dim)
    k, k_scale, k_f32 = store(rng.standard_normal(shape, np.float32) * 3, "int8")
    v, v_scale, v_f32 = store(rng.standard_normal(shape, np.float32) * 3, "int8")
    cu_q_lens = np.concatenate([[0], np.cumsum([q for q, _ in rows])]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in rows], np.int32)
    table = assign_pages(rng, kv_lens, page_size)
    q = rng.standard_normal((32, 4, head_dim), np.float32)
    run = functools.partial(cpu_paged_attention, q, k, v, cu_q_lens, kv_lens, table, 0,
                            scale=0.1)
    got = np.asarray(run(k_scale=k_scale, v_scale=v_scale))
    want = reference(q, k_f32[0], v_f32[0], cu_q_lens, kv_lens, table, 0.1)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    raw = reference(q, np.asarray(k[0], np.float32), np.asarray(v[0], np.float32), cu_q_lens,
                    kv_lens, table, 0.1)
    assert not np.allclose(got, raw, rtol=0.1, atol=0.1), "the scales must be applied"
    swapped = np.asarray(run(k_scale=v_scale, v_scale=k_scale))
    assert not np.allclose(got, swapped, rtol=1e-3, atol=1e-3), "K's scales are not V's"
    doubled = np.asarray(run(k_scale=k_scale, v_scale=v_scale * 2))
    np.testing.assert_array_equal(doubled, got * 2)


@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize("storage", ["f32", *QUANTIZED])
def test_stale_slots_junk_pages_and_padding_do_not_leak(storage, prompt):
    """NaN in the null page, in the slots past each row's length and in padding queries,
    out-of-range ids past each row's pages: the output is finite and unchanged. (In an
    int8 pool a NaN vector stores a NaN scale.) `prompt`: every row a prompt's (on AMX
    for bf16 where the CPU has it)."""
    rng = np.random.default_rng(7)
    page_size, rows = 16, [(1, 37), (5, 23), (0, 0), (16, 16), (2, 15)]
    shape = (1, 2, NUM_PAGES, page_size, 64)
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    cu_q_lens = np.concatenate([[0], np.cumsum([q for q, _ in rows])]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in rows], np.int32)
    table = assign_pages(rng, kv_lens, page_size)
    q = rng.standard_normal((32, 6, 64), np.float32)

    def run(q, k, v, table):
        (k, k_scale, _), (v, v_scale, _) = store(k, storage), store(v, storage)
        flags = {"is_prompt": np.ones(len(rows), np.int32)} if prompt else {}
        return np.asarray(cpu_paged_attention(q, k, v, cu_q_lens, kv_lens, table, 0,
                                               scale=0.1, **scales(k_scale, v_scale), **flags))

    clean = run(q, k, v, table)
    k_bad, v_bad, q_bad, table_bad = k.copy(), v.copy(), q.copy(), table.copy()
    q_bad[cu_q_lens[-1]:] = np.nan
    for x in (k_bad, v_bad):
        x[:, :, 0] = np.nan
        for row, n in enumerate(kv_lens):
            if n % page_size:
                x[:, :, table[row, n // page_size], n % page_size:] = np.nan
    for row, n in enumerate(-(-kv_lens // page_size)):
        table_bad[row, n:] = rng.integers(-NUM_PAGES, 100 * NUM_PAGES, MAX_PAGES - n)
    dirty = run(q_bad, k_bad, v_bad, table_bad)
    assert np.isfinite(dirty).all()
    np.testing.assert_array_equal(dirty, clean)



@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize("storage", ["f32", *QUANTIZED])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_tokens_output_is_the_same_however_its_prompt_is_chunked(storage, head_dim, prompt):
    """Bitwise, on the specialized shapes: a prompt attended whole, in ragged chunks (one
    call each, or all as rows of one call) and a token at a time. The kernel takes a tile
    of many queries and a decode's few in different loops; were their sums rounded
    differently, a token's output would depend on how the scheduler chunked its prompt,
    and sampled tokens on what else shared the step. `prompt`: the rows flagged as a
    prompt's, as the engine flags them (AMX's loop for bf16 where the CPU has it)."""
    rng = np.random.default_rng(head_dim + len(storage))
    page_size, group, num_kv_heads, length = 16, 3, 2, 70
    shape = (1, num_kv_heads, NUM_PAGES, page_size, head_dim)
    (k, k_scale, _), (v, v_scale, _) = (store(rng.standard_normal(shape, np.float32), storage)
                                        for _ in range(2))
    table = assign_pages(rng, np.array([length]), page_size)
    q = rng.standard_normal((length, group * num_kv_heads, head_dim), np.float32)

    def attend(starts: list[int], ends: list[int]) -> np.ndarray:
        """Rows of tokens [start, end) of the prompt, each with the keys up to its end."""
        rows = np.concatenate([q[a:b] for a, b in zip(starts, ends)])
        cu_q_lens = np.concatenate([[0], np.cumsum(np.subtract(ends, starts))]).astype(np.int32)
        flags = {"is_prompt": np.ones(len(ends), np.int32)} if prompt else {}
        return np.asarray(cpu_paged_attention(
            rows, k, v, cu_q_lens, np.array(ends, np.int32), np.repeat(table, len(ends), 0),
            0, scale=head_dim**-0.5, **scales(k_scale, v_scale), **flags))

    whole = attend([0], [length])
    cuts = [0, 5, 6, 22, 40, length]
    for got in (np.concatenate([attend([a], [b]) for a, b in itertools.pairwise(cuts)]),
                attend(cuts[:-1], cuts[1:]),
                attend(list(range(length)), list(range(1, length + 1)))):
        np.testing.assert_array_equal(got, whole)

def call(q_dtype=jnp.float32, pool_dtype=jnp.float32, **scales):
    q = jnp.zeros((4, 2, 16), q_dtype)
    pool = jnp.zeros((1, 2, 8, 4, 16), pool_dtype)
    return cpu_paged_attention(q, pool, pool, jnp.zeros((3,), jnp.int32),
                               jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32), 0,
                               scale=1.0, **scales)


def test_q_is_f32_only_and_the_pool_a_storage_it_reads():
    with pytest.raises(ValueError, match="f32 q only"):
        call(q_dtype=jnp.bfloat16, pool_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="reads pools of"):
        call(pool_dtype=jnp.float16)


def test_int8_pools_need_their_scales_and_no_other_takes_any():
    scale = jnp.zeros((1, 2, 8, 4), jnp.float32)
    with pytest.raises(ValueError, match="int8 pages need k_scale"):
        call(pool_dtype=jnp.int8)
    with pytest.raises(ValueError, match="v_scale must be f32"):
        call(pool_dtype=jnp.int8, k_scale=scale, v_scale=scale[..., :2])
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn):
        with pytest.raises(ValueError, match="take no scales"):
            call(pool_dtype=dtype, k_scale=scale, v_scale=scale)
    assert call(pool_dtype=jnp.int8, k_scale=scale, v_scale=scale).shape == (4, 2, 16)


def test_the_kernel_itself_refuses_other_dtypes_and_misshapen_scales():
    """The C++ checks, past the wrapper's: an f16 pool, int8 scales not shaped like it,
    prompt flags not one a row."""
    ffi = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4, 2, 16), jnp.float32))
    # cu_q_lens, kv_lens, page_table, the prompt flags (none) and the layer
    ints = (jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32),
            jnp.zeros((2, 2), jnp.int32), jnp.zeros((0,), jnp.int32), jnp.zeros((1,), jnp.int32))
    q, dummy = jnp.zeros((4, 2, 16), jnp.float32), jnp.zeros((1,), jnp.float32)
    f16 = jnp.zeros((1, 2, 8, 4, 16), jnp.float16)
    with pytest.raises(Exception, match=r"must be f32, bf16 \(or its u16 bits\), s8 or f8e4m3fn"):
        jax.block_until_ready(ffi(q, f16.swapaxes(-1, -2), f16, dummy, dummy, *ints,
                                  scale=np.float32(1)))
    s8 = jnp.zeros((1, 2, 8, 4, 16), jnp.int8)
    with pytest.raises(Exception, match="s8 k/v need scales"):
        jax.block_until_ready(ffi(q, s8.swapaxes(-1, -2), s8, dummy, dummy, *ints,
                                  scale=np.float32(1)))
    f32 = jnp.zeros((1, 2, 8, 4, 16), jnp.float32)  # K not transposed
    with pytest.raises(Exception, match=r"k must be v's dtype, shaped \[L, H, P, head_dim"):
        jax.block_until_ready(ffi(q, f32, f32, dummy, dummy, *ints, scale=np.float32(1)))
    flags = (*ints[:3], jnp.zeros((3,), jnp.int32), ints[4])
    with pytest.raises(Exception, match="is_prompt must have one flag a row"):
        jax.block_until_ready(ffi(q, f32.swapaxes(-1, -2), f32, dummy, dummy, *flags,
                                  scale=np.float32(1)))


def test_each_call_publishes_the_next_layers_pages_for_the_projections_to_prefetch():
    """prefetch_job.h's list after a call on layer l: the K and V page of layer l + 1 (of
    layer 0 after the last) for every row, KV head and page the row reads, in that order,
    but a page that follows the row's previous one in the pool (the hardware fetches runs)."""
    layers, kv_heads, pages, page_size, head_dim = 3, 2, 9, 16, 64
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.integers(0, 2**16, (layers, kv_heads, pages, head_dim, page_size)),
                    jnp.uint16)  # bf16 bits, as the engine keeps them
    v = jnp.asarray(rng.integers(0, 2**16, (layers, kv_heads, pages, page_size, head_dim)),
                    jnp.uint16)
    kv_lens = np.array([20, 40, 0, 45])
    page_table = np.array([[3, 7, 0], [1, 5, 8], [0, 0, 0], [4, 5, 6]])
    q = jnp.zeros((4, 2 * kv_heads, head_dim), jnp.float32)
    page_bytes = page_size * head_dim * 2
    job = prefetch_job()
    # the struct: next, count, page_bytes, wanted (int64 each), then the pages' addresses
    count, wanted = (ctypes.c_int64.from_address(job + offset) for offset in (8, 24))
    was_wanted = wanted.value

    def attend(layer):
        jax.block_until_ready(cpu_paged_attention(
            q, k, v, jnp.arange(5, dtype=jnp.int32), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(page_table, jnp.int32), layer, scale=0.125, k_transposed=True))

    try:
        count.value = wanted.value = 0
        attend(0)
        assert count.value == 0, "nothing is published before a consumer wants it"
        wanted.value = 1
        for layer, following in ((0, 1), (2, 0)):
            attend(layer)
            expected = [
                pool.unsafe_buffer_pointer()
                + ((following * kv_heads + head) * pages + page_table[row, block]) * page_bytes
                for row in range(4) for head in range(kv_heads)
                for block in range(-(-kv_lens[row] // page_size)) for pool in (k, v)
                if block == 0 or page_table[row, block] != page_table[row, block - 1] + 1
            ]
            assert len(expected) == 2 * kv_heads * (2 + 3 + 0 + 1)
            assert ctypes.c_int64.from_address(job + 16).value == page_bytes
            assert list((ctypes.c_void_p * count.value).from_address(job + 32)) == expected
    finally:  # the other tests' engines prefetch as before
        wanted.value = was_wanted


def test_the_library_is_built_once_and_keyed_by_its_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    first = build.build("paged_attention")
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build.build("paged_attention") == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name], "no temporary file is left"


def test_every_kernel_compiles_and_registers():
    """Where a compiler is, a kernel that fails to build is a failure here, not a skip of
    its tests (they skip where the CPU lacks a kernel's instructions)."""
    for name in ("paged_attention", "linear"):
        build.build(name)  # raises with the compiler's errors
    assert available()
    flags = build.cpu_flags().split()
    for backend, (_, _, needs) in linear.KERNELS.items():
        assert linear.available(backend) or not all(flag in flags for flag in needs), backend


def test_a_failed_build_shows_the_compilers_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "broken.cc").write_text("int main() { return undeclared_name; }\n")
    with pytest.raises(build.KernelUnavailable, match="undeclared_name"):
        build.build("broken")


def test_without_a_compiler_the_build_says_so(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(build.KernelUnavailable, match="no C\\+\\+ compiler"):
        build.build("paged_attention")
