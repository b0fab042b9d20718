"""The C++ CPU attention kernel against the float64 jnp reference, and its build cache.

Page size 16 with head size 64 or 128 runs the kernel's specialized loops; the other
shapes run its generic ones. Rows mix decodes, whole prefills and chunks with ragged
lengths, with padding rows and tokens, as the engine packs them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cpu_kernels import build
from jaxserve.cpu_kernels.paged_attention import available, cpu_paged_attention
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference_lens

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler here")

NUM_PAGES = 96
MAX_PAGES = 12
NUM_TOKENS = 96
RTOL, ATOL = 1e-5, 1e-6
# (page size, head size, query heads per KV head, KV heads)
SHAPES = [(16, 64, 3, 3), (16, 128, 4, 2), (16, 64, 1, 2), (4, 16, 8, 1), (8, 32, 2, 3)]


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


def test_stale_slots_junk_pages_and_padding_do_not_leak():
    """NaN in the null page, in the slots past each row's length and in padding queries,
    out-of-range ids past each row's pages: the output is finite and unchanged."""
    rng = np.random.default_rng(7)
    page_size, rows = 16, [(1, 37), (5, 23), (0, 0), (16, 16), (2, 15)]
    shape = (1, 2, NUM_PAGES, page_size, 64)
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    cu_q_lens = np.concatenate([[0], np.cumsum([q for q, _ in rows])]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in rows], np.int32)
    table = assign_pages(rng, kv_lens, page_size)
    q = rng.standard_normal((32, 6, 64), np.float32)
    clean = np.asarray(cpu_paged_attention(q, k, v, cu_q_lens, kv_lens, table, 0, scale=0.1))
    k_bad, v_bad, q_bad, table_bad = k.copy(), v.copy(), q.copy(), table.copy()
    q_bad[cu_q_lens[-1]:] = np.nan
    for x in (k_bad, v_bad):
        x[:, :, 0] = np.nan
        for row, n in enumerate(kv_lens):
            if n % page_size:
                x[:, :, table[row, n // page_size], n % page_size:] = np.nan
    for row, n in enumerate(-(-kv_lens // page_size)):
        table_bad[row, n:] = rng.integers(-NUM_PAGES, 100 * NUM_PAGES, MAX_PAGES - n)
    dirty = np.asarray(cpu_paged_attention(q_bad, k_bad, v_bad, cu_q_lens, kv_lens, table_bad,
                                           0, scale=0.1))
    assert np.isfinite(dirty).all()
    np.testing.assert_array_equal(dirty, clean)


def test_only_f32_is_taken():
    q = jnp.zeros((4, 2, 16), jnp.bfloat16)
    pool = jnp.zeros((1, 2, 8, 4, 16), jnp.bfloat16)
    lens = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="f32 only"):
        cpu_paged_attention(q, pool, pool, jnp.zeros((3,), jnp.int32), lens,
                            jnp.zeros((2, 2), jnp.int32), 0, scale=1.0)


def test_the_library_is_built_once_and_keyed_by_its_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    first = build.build("paged_attention")
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build.build("paged_attention") == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name], "no temporary file is left"


def test_without_a_compiler_the_build_says_so(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(build.KernelUnavailable, match="no C\\+\\+ compiler"):
        build.build("paged_attention")
