"""bf16 weights on the CPU's bf16 units (cpu_kernels/linear.py): the packing, each kernel
(AMX, AVX512-BF16) against x @ w in float64, the choice of backend, and the engine serving
with it.

A kernel's tests run where the CPU has its instructions (a Zen 4 or 5 runs avx512_bf16's,
a Sapphire Rapids both); the packing and the backend's refusals run anywhere.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from jaxserve import LLM, SamplingParams, planner
from jaxserve.cpu_kernels import linear
from jaxserve.models.layers import PackedWeight, rms_norm, swiglu

KERNELS = [pytest.param(b, marks=pytest.mark.skipif(
    not linear.available(b), reason=f"this CPU has no {b}")) for b in linear.KERNELS]
ENGINE = {"max_batch": 4, "token_budget": 32, "num_pages": 64, "page_size": 4}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def bf16(w: np.ndarray) -> np.ndarray:
    return w.astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("shape", [(64, 32), (100, 48), (3, 2, 576, 192), (1, 16), (33, 16)])
def test_pack_round_trips_through_bf16(shape):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    packed = linear.pack(w)
    k, n = shape[-2:]
    assert packed.dtype == np.uint16
    assert packed.shape == (*shape[:-2], n // 16, -(-k // 32), 16, 32)
    np.testing.assert_array_equal(linear.unpack(packed, k), bf16(w).astype(np.float32))


def test_a_tile_holds_input_pairs_of_sixteen_columns():
    """The layout AMX's B operand wants: row p of tile (nb, kb) is inputs 32kb+2p and
    32kb+2p+1 of columns 16nb..16nb+15, interleaved."""
    k, n = 64, 32
    inputs, columns = np.mgrid[:k, :n].astype(np.float32)  # small integers: exact in bf16
    nb, kb, p, c = 1, 1, 5, 3
    for w, want in ((inputs, 32 * kb + 2 * p), (columns, 16 * nb + c)):
        tiles = linear.pack(w).view(ml_dtypes.bfloat16).astype(np.float32)
        assert tiles[nb, kb, p, 2 * c] == w[32 * kb + 2 * p, 16 * nb + c] == want
        assert tiles[nb, kb, p, 2 * c + 1] == w[32 * kb + 2 * p + 1, 16 * nb + c]


def test_weights_that_do_not_pack_are_refused():
    assert not linear.fits(64, 40)
    with pytest.raises(ValueError, match="multiple of 16"):
        linear.pack(np.zeros((64, 40), np.float32))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize(("m", "k", "n"), [
    (1, 576, 1536),   # a decode of one row
    (16, 576, 192),   # SmolLM2's k/v projection at a full decode batch
    (32, 1536, 576),  # a decode batch of 32 rows: the streamed path's largest
    (17, 100, 48),    # a partial row block, inputs padded, an odd column block
    (40, 1536, 576),  # a prefill chunk over three row blocks
    (5, 64, 4096),    # many work items
    (6, 64, 80),      # a row block of 4 and a part one; column blocks past the last whole 4
    (0, 64, 32),      # an empty step
])
def test_the_kernel_is_x_times_the_bf16_weight(backend, m, k, n):
    """With two passes, to f32 accuracy in x: the kernel splits x into two bf16 parts, so
    it does not round the activations (one bf16 part alone is ~1e-3 off); with one pass,
    bf16(x) times the bf16 weight, summed in f32."""
    rng = np.random.default_rng(m + k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    kernel = jax.jit(linear.packed_linear, static_argnames=("backend", "passes"))
    for passes, want in ((2, x.astype(np.float64) @ bf16(w)), (1, bf16(x) @ bf16(w))):
        got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(linear.pack(w)), backend=backend,
                                passes=passes))
        assert got.shape == (m, n) and got.dtype == np.float32
        scale = max(1.0, np.abs(want).max(initial=0))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale, err_msg=f"{passes=}")
    if m:  # the passes differ by x's rounding: one pass is not two
        two_pass = x.astype(np.float64) @ bf16(w)
        assert np.abs(got - two_pass).max() > 1e-4 * np.abs(two_pass).max()


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("passes", [1, 2])
def test_a_row_gets_the_same_bits_in_any_batch(backend, passes):
    """Batch invariance inside the kernel: a row alone, in a decode batch (AVX512-BF16
    streams batches of 5 to 32 rows) and in a prefill-sized one sums the same products in
    the same order."""
    rng = np.random.default_rng(7)
    w = jnp.asarray(linear.pack(rng.standard_normal((576, 960)).astype(np.float32)))
    x = rng.standard_normal((40, 576)).astype(np.float32)
    whole = np.asarray(linear.packed_linear(jnp.asarray(x), w, backend=backend, passes=passes))
    for m in (1, 4, 5, 16, 32):
        part = np.asarray(linear.packed_linear(jnp.asarray(x[:m]), w, backend=backend,
                                               passes=passes))
        np.testing.assert_array_equal(part, whole[:m], err_msg=f"{m} rows")


def every_activation(rng: np.random.Generator, k: int, n: int = 48) -> list:
    """(weight, passes) for each way a kernel takes x: bf16 and f32 activations on a bf16
    weight [k, n], and int8 on a Q4_1 one where the CPU has it (and k is whole blocks)."""
    bf16_packed = jnp.asarray(linear.pack(rng.standard_normal((k, n)).astype(np.float32)))
    weights = [(bf16_packed, passes) for passes in (1, 2)]
    if linear.int8_available() and k % 32 == 0:
        weights.append((jnp.asarray(linear.pack_q4_1(q4_1_blocks(rng, n, k))), 0))
    return weights


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("k", [576, 100, 64, 1])
def test_the_kernels_norm_gives_the_bits_of_rms_norm_under_xla(backend, k):
    """A projection's RMSNorm in the kernel (`norm`) and XLA's `rms_norm` before it give
    the same bits, so a LoRA adapter's terms (normalized by XLA) read what the base product
    read: for bf16 and f32 activations (and int8 where the CPU has it, on Q4_1 weights), a
    row alone, a decode batch, a prefill split over the pool; the residual add fused before
    the norm, as in a layer; rows of every scale, and one of zeros (x * rsqrt(eps))."""
    rng = np.random.default_rng(11)
    weights = every_activation(rng, k)
    bf16_packed = weights[0][0]
    g = jnp.asarray(rng.standard_normal(k).astype(np.float32))
    a = rng.standard_normal((256, k)).astype(np.float32) * rng.uniform(1e-3, 30, (256, 1))
    b = rng.standard_normal((256, k)).astype(np.float32)
    a[5], b[5] = 0, 0
    for w, passes in weights:
        fused = jax.jit(lambda a, b, w=w, passes=passes: linear.packed_linear(
            a + b, w, None, backend, passes, g, 1e-5))
        before = jax.jit(lambda a, b, w=w, passes=passes: linear.packed_linear(
            rms_norm(a + b, g, 1e-5), w, None, backend, passes))
        for m in (1, 3, 16, 256):
            np.testing.assert_array_equal(np.asarray(fused(a[:m], b[:m])),
                                          np.asarray(before(a[:m], b[:m])),
                                          err_msg=f"passes {passes}, {m} rows")
    with pytest.raises(ValueError, match="norm's weight"):
        linear.packed_linear(jnp.asarray(a[:1]), bf16_packed, backend=backend, norm=g[:-1])


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("k", [1536, 100])
def test_a_gated_input_gives_the_bits_of_swiglu_under_xla(backend, k):
    """The down projection's input silu(gate) * up taken in the kernel (`gated`) and from
    XLA's `swiglu` give the same bits (a LoRA adapter's terms read XLA's): gate and up
    from a kernel's output, as in a layer, or given, with extreme and non-finite gates;
    bf16, f32 and int8 activations; a row, a decode batch, a prefill."""
    rng = np.random.default_rng(12)
    weights = every_activation(rng, k)
    bf16_packed = weights[0][0]
    gate_up = (jnp.asarray(linear.pack(rng.standard_normal((64, 2 * k)).astype(np.float32)))
               if linear.fits(64, 2 * k) else None)  # a layer's gate/up kernel, where it packs
    h = jnp.asarray(rng.standard_normal((256, 64)).astype(np.float32))
    given = rng.standard_normal((256, 2 * k)).astype(np.float32) * 4
    given[3, :12] = [np.nan, np.inf, -np.inf, 0, -0.0, 1e-40, 88.7, -87.9, 89, -89, 200, -200]
    for w, passes in weights:
        def from_kernel(h, transform, w=w, passes=passes):
            gate, up = jnp.split(linear.packed_linear(h, gate_up, None, backend, 2), 2, axis=-1)
            return transform(jnp.concatenate([gate, up], axis=-1), w, passes)

        def gated(x, w, passes):
            return linear.packed_linear(x, w, None, backend, passes, gated=True)

        def before(x, w, passes):
            return linear.packed_linear(swiglu(*jnp.split(x, 2, axis=-1)), w, None, backend,
                                        passes)

        for m in (1, 3, 16, 256):
            pairs = [(jax.jit(gated, static_argnums=2)(given[:m], w, passes),
                      jax.jit(before, static_argnums=2)(given[:m], w, passes))]
            if gate_up is not None:
                pairs.append((jax.jit(from_kernel, static_argnums=1)(h[:m], gated),
                              jax.jit(from_kernel, static_argnums=1)(h[:m], before)))
            for got, want in pairs:
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                              err_msg=f"passes {passes}, {m} rows")
    with pytest.raises(ValueError, match="gated"):
        linear.packed_linear(jnp.asarray(given[:1, :-1]), bf16_packed, backend=backend,
                             gated=True)


@pytest.mark.parametrize("backend", KERNELS)
def test_a_residual_is_added_to_the_product_as_xla_adds_it(backend):
    """`residual + x @ w` in the kernel gives XLA's add's bits, for every path's work items
    (AMX's and AVX512-BF16's, Q4_1's, int8's), a row, a decode batch and a prefill, at a
    layer of a stack; a residual of another shape is refused."""
    rng = np.random.default_rng(13)
    k, n = 1536, 592  # 37 column blocks: a last item of fewer blocks on both paths
    weights = [(jnp.asarray(linear.pack(rng.standard_normal((2, k, n)).astype(np.float32))), 1),
               (jnp.asarray(linear.pack_q4_1(q4_1_blocks(rng, 2, n, k))), 2)]
    if linear.int8_available():
        weights.append((weights[1][0], 0))
    x = jnp.asarray(rng.standard_normal((256, k)).astype(np.float32))
    residual = jnp.asarray(rng.standard_normal((256, n)).astype(np.float32) * 5)
    for w, passes in weights:
        for m in (1, 3, 16, 256):
            got = jax.jit(lambda x, r, w=w, passes=passes: linear.packed_linear(
                x, w, 1, backend, passes, residual=r))(x[:m], residual[:m])
            want = jax.jit(lambda x, r, w=w, passes=passes: r + linear.packed_linear(
                x, w, 1, backend, passes))(x[:m], residual[:m])
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                          err_msg=f"passes {passes}, {m} rows")
    with pytest.raises(ValueError, match="residual"):
        linear.packed_linear(x[:2], weights[0][0], 1, backend, residual=residual[:3])


@pytest.mark.parametrize("backend", KERNELS)
def test_passes_other_than_one_or_two_are_refused(backend):
    packed = jnp.asarray(linear.pack(np.ones((32, 16), np.float32)))
    with pytest.raises(ValueError, match="passes"):
        linear.packed_linear(jnp.ones((1, 32)), packed, backend=backend, passes=3)


@pytest.mark.parametrize("backend", KERNELS)
def test_a_stacked_weight_is_read_at_its_layer_in_a_scan(backend):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 64, 32)).astype(np.float32)
    x = rng.standard_normal((2, 7, 64)).astype(np.float32)  # leading axes are kept
    packed = jnp.asarray(linear.pack(w))
    for layer in range(3):
        got = linear.packed_linear(jnp.asarray(x), packed, layer, backend)
        np.testing.assert_allclose(got, x.astype(np.float64) @ bf16(w[layer]), atol=1e-4)
    with pytest.raises(ValueError, match="needs the layer"):
        linear.packed_linear(jnp.asarray(x), packed, backend=backend)
    with pytest.raises(ValueError, match="inputs"):
        linear.packed_linear(jnp.ones((2, 96)), packed, 0, backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_each_row_multiplies_its_own_adapter_slot_only(backend, passes, rank):
    """LoRA's products (slot_linear): a row multiplies only the part of a slots' stack
    that its slot owns (A: its columns, in each of the groups side by side; B: its
    inputs), and gets the bits that the product by the whole stack gives it (which adds
    only exact zeros where the caller zeroed the other slots' inputs), whatever the other
    rows' slots; a row of no slot is zeros."""
    rng = np.random.default_rng(rank + passes)
    num_slots, k, groups, m = 4, 100, 3, 40
    width = -(-num_slots * rank // 16) * 16
    a = jnp.asarray(linear.pack(rng.standard_normal((2, k, groups * width)).astype(np.float32)))
    b = jnp.asarray(linear.pack(rng.standard_normal((2, width, 80)).astype(np.float32)))
    slots = rng.integers(0, num_slots + 1, m).astype(np.int32)
    slots[:3] = (0, 1, num_slots)
    x = rng.standard_normal((m, k)).astype(np.float32)
    own = np.zeros((m, width), bool)  # each row's slot's columns (A) or inputs (B)
    tiles = np.zeros((m, width), bool)  # the column tiles that hold them
    for r, s in enumerate(slots):
        if s:
            own[r, (s - 1) * rank : s * rank] = True
            tiles[r, (s - 1) * rank // 16 * 16 : -(-s * rank // 16) * 16] = True
    own, tiles = np.tile(own, groups), np.tile(tiles, groups)
    xb = rng.standard_normal((m, width)).astype(np.float32) * own[:, :width]

    def by_slots(x, w, slots, by_inputs, groups=1):
        return np.asarray(linear.slot_linear(jnp.asarray(x), w, 1, jnp.asarray(slots), rank,
                                             by_inputs, groups, backend, passes))

    got_a, got_b = by_slots(x, a, slots, False, groups), by_slots(xb, b, slots, True)
    dense_a = np.asarray(linear.packed_linear(jnp.asarray(x), a, 1, backend, passes))
    dense_b = np.asarray(linear.packed_linear(jnp.asarray(xb), b, 1, backend, passes))
    np.testing.assert_array_equal(np.where(own, got_a, 0), np.where(own, dense_a, 0))
    assert not np.where(tiles, 0, got_a).any() and own.any(axis=1)[slots > 0].all()
    np.testing.assert_array_equal(got_b, dense_b)
    assert not got_b[slots == 0].any() and got_b[slots > 0].all(axis=1).all()
    for rows in ([1], [2, 5], list(range(16)), list(range(3, 40, 3))):  # fewer, other mixes
        np.testing.assert_array_equal(by_slots(x[rows], a, slots[rows], False, groups),
                                      got_a[rows], err_msg=f"A, rows {rows}")
        np.testing.assert_array_equal(by_slots(xb[rows], b, slots[rows], True), got_b[rows],
                                      err_msg=f"B, rows {rows}")
    with pytest.raises(Exception, match="slot is out of range"):
        by_slots(x[:1], a, np.int32([num_slots + 1]) * (width // rank), False, groups)


@pytest.mark.parametrize("backend", KERNELS)
def test_rows_past_the_live_ones_are_zeros_and_the_live_ones_unchanged(backend):
    """`live`: a step's padding rows, after its real ones, are not computed (zeros), and
    each real row gets the bits it gets with the padding computed, on every path (bf16 and
    Q4_1 weights, x in bf16 or not or int8; a norm, a gated input, a residual); a live
    count past the rows computes them all."""
    rng = np.random.default_rng(17)
    k, n = 576, 592
    bf16_w = jnp.asarray(linear.pack(rng.standard_normal((2, k, n)).astype(np.float32)))
    q4_w = jnp.asarray(linear.pack_q4_1(q4_1_blocks(rng, 2, n, k)))
    cases = [(bf16_w, 1), (bf16_w, 2), (q4_w, 1), (q4_w, 2)]
    if linear.int8_available():
        cases.append((q4_w, 0))
    x = jnp.asarray(rng.standard_normal((40, 2 * k)).astype(np.float32))
    residual = jnp.asarray(rng.standard_normal((40, n)).astype(np.float32))
    norm = jnp.asarray(rng.standard_normal(k).astype(np.float32))
    options = [{"residual": residual}, {"norm": norm, "eps": 1e-5}, {"gated": True}]
    for w, passes in cases:
        for extra in options:
            xs = x if extra.get("gated") else x[:, :k]

            def product(live, w=w, passes=passes, extra=extra, xs=xs):
                return np.asarray(jax.jit(lambda xs, live: linear.packed_linear(
                    xs, w, 1, backend, passes, live=live, **extra))(xs, live))

            whole = product(40)
            for live in (0, 1, 5, 16, 37, 99):
                got, real = product(live), min(live, 40)
                message = f"passes {passes}, {list(extra)}, {live} live rows"
                np.testing.assert_array_equal(got[:real], whole[:real], err_msg=message)
                assert not got[real:].any(), message


def q4_1_blocks(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Random Q4_1 blocks of a weight [..., out, in], as a GGUF file holds them."""
    *lead, n, k = shape
    w = rng.standard_normal((*lead, n, k)).astype(np.float32) * 0.05
    return gguf_quants.quantize(w, GGMLQuantizationType.Q4_1).reshape(*lead, n, k // 32, 20)


def test_a_q4_1_packing_holds_the_gguf_blocks():
    """A packed tile holds each column's Q4_1 block: dequantized, the weight gguf gives
    (transposed to [in, out]), every layer of a stack at its place."""
    blocks = q4_1_blocks(np.random.default_rng(0), 3, 48, 96)
    packed = linear.pack_q4_1(blocks)
    assert packed.shape == (3, 3, 3, 20, 16) and packed.dtype == np.uint8
    for layer in range(3):
        dequantized = gguf_quants.dequantize(blocks[layer].reshape(48, -1),
                                             GGMLQuantizationType.Q4_1)
        np.testing.assert_array_equal(linear.unpack_q4_1(packed[layer]), dequantized.T)
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        linear.pack_q4_1(blocks[:, :40])  # not whole tiles of 16 columns


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("n", [960, 80])  # whole work items; a last item of one column block
def test_a_q4_1_weight_multiplies_as_its_bf16_packing(backend, passes, n):
    """Widened tile by tile in the kernel, a Q4_1 weight gives the bits its dequantized
    weight gives packed in bf16: one row, decode batches (streamed) and a prefill (AMX:
    two row blocks at a time, then the third), at each layer of a stack."""
    rng = np.random.default_rng(3)
    blocks = q4_1_blocks(rng, 2, n, 576)
    q4_1 = jnp.asarray(linear.pack_q4_1(blocks))
    bf16_packed = jnp.asarray(linear.pack(linear.unpack_q4_1(np.asarray(q4_1))))
    x = jnp.asarray(rng.standard_normal((40, 576)).astype(np.float32))
    for m in (1, 3, 7, 16, 40):
        for layer in (0, 1):
            got, want = (np.asarray(linear.packed_linear(x[:m], w, layer, backend, passes))
                         for w in (q4_1, bf16_packed))
            np.testing.assert_array_equal(got, want, err_msg=f"{m} rows, layer {layer}")


INT8 = pytest.mark.skipif(not linear.int8_available(),
                          reason=f"this CPU lacks avx512_bf16 or {', '.join(linear.INT8_FLAGS)}")


@INT8
@pytest.mark.parametrize("backend", KERNELS)  # both run the AVX512-VNNI loop
def test_int8_activations_compute_two_term_q8_arithmetic(backend):
    """passes 0: each row's block of 32 inputs quantized to int8 in two terms (the second
    the first's remainder), the dot products with the Q4_1 nibbles exact, the blocks summed
    in f32 (linear.q8_reference, in float64): one row, register blocks and their
    remainder, a prefill, at each layer of a stack, k not a whole number of blocks of x;
    each row's bits the same in any batch; within 2e-4 of the exact product (one term,
    llama.cpp's, is 5.6e-3 off here: its rounding is max|x| / 254 a block)."""
    rng = np.random.default_rng(5)
    blocks = q4_1_blocks(rng, 2, 80, 576)
    packed = linear.pack_q4_1(blocks)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    x[7, :32] = 0  # a block of zeros: scale 0
    for m in (1, 3, 5, 16, 40):
        for layer in (0, 1):
            got = np.asarray(linear.packed_linear(jnp.asarray(x[:m]), jnp.asarray(packed),
                                                  layer, backend, 0))
            want = linear.q8_reference(x[:m], packed[layer])
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                       err_msg=f"{m} rows, layer {layer}")
            if m == 40:
                alone = [np.asarray(linear.packed_linear(jnp.asarray(x[i:i + 1]),
                                                         jnp.asarray(packed), layer,
                                                         backend, 0)) for i in (0, 7, 39)]
                np.testing.assert_array_equal(np.concatenate(alone), got[[0, 7, 39]])
    # within two terms' rounding of the exact product: max|x| / 64,516 a block
    exact = x.astype(np.float64) @ linear.unpack_q4_1(packed[0]).astype(np.float64)
    got = np.asarray(linear.packed_linear(jnp.asarray(x), jnp.asarray(packed), 0,
                                          backend, 0))
    assert np.abs(got - exact).max() < 2e-4 * np.abs(exact).max()


@INT8
def test_int8_activations_are_for_q4_1_weights_and_keep_non_finite_rows():
    with pytest.raises(ValueError, match="Q4_1 weights only"):
        linear.packed_linear(jnp.ones((1, 32)), jnp.asarray(linear.pack(np.ones((32, 16)))),
                             backend="avx512_bf16", passes=0)
    packed = jnp.asarray(linear.pack_q4_1(q4_1_blocks(np.random.default_rng(0), 16, 64)))
    x = np.ones((3, 64), np.float32)
    x[0, 3], x[1, 40] = np.nan, np.inf
    got = np.asarray(linear.packed_linear(jnp.asarray(x), packed, backend="avx512_bf16",
                                          passes=0))
    assert not np.isfinite(got[:2]).any() and np.isfinite(got[2]).all()


@pytest.mark.slow  # the real model
@INT8
def test_int8_activations_serve_a_gguf_files_q4_1_projections(smollm2_gguf):
    """--linear-activations int8: the Q4_1 projections take int8 activations, the head
    bf16 ones; each prompt's greedy tokens are the same alone as in a batch (and, alone,
    after a prefix-cache hit); a model without Q4_1 projections is refused."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160))]
    llm = LLM(smollm2_gguf, linear_activations="int8", **ENGINE)
    assert (llm.weight_dtype, llm.linear_activations, llm.kv_dtype) == ("q4_1", "int8", "bf16")
    layers = llm.runner.state["layers"]
    assert {layers[n].get_value().passes for n in ("qkv", "o_proj", "gate_up", "down_proj")
            } == {0}
    assert llm.runner.state["lm_head"].get_value().passes == 1
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert together == [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    with pytest.raises(ValueError, match="int8"):
        LLM(smollm2_gguf, linear_activations="int8", weight_dtype="bf16", **ENGINE)


@pytest.mark.slow  # the real model, loaded twice
@pytest.mark.skipif(not any(map(linear.available, linear.KERNELS)),
                    reason="this CPU has no bf16 kernel")
def test_auto_keeps_a_gguf_files_q4_1_projections(smollm2_gguf):
    """SmolLM2's GGUF file stores its projections as Q4_1: under --weight-dtype auto the
    kernel multiplies them as they are, with greedy tokens identical to bf16 projections
    (--weight-dtype bf16) and 140 MiB fewer bytes; the Q8_0 embedding's head stays bf16."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160))]
    auto = LLM(smollm2_gguf, **ENGINE)
    bf16_llm = LLM(smollm2_gguf, weight_dtype="bf16", **ENGINE)
    assert (auto.weight_dtype, bf16_llm.weight_dtype) == ("q4_1", "bfloat16")
    layers = auto.runner.state["layers"]
    for name in ("qkv", "o_proj", "gate_up", "down_proj"):
        assert layers[name].get_value().values.dtype == jnp.uint8, name
    assert auto.runner.state["lm_head"].get_value().values.dtype == jnp.uint16
    c = auto.config
    projections = c.num_layers * c.hidden_size * (
        2 * c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim + 3 * c.intermediate_size)
    assert bf16_llm.weight_bytes - auto.weight_bytes == projections * (2 - 20 / 32)
    for llm, stored in ((auto, "q4_1"), (bf16_llm, "bf16")):  # the planner counts alike
        assert planner.stored_weight_bytes(planner.shape_of(c, "served"), stored, "f32",
                                           packed=True) == llm.weight_bytes, stored
    assert [o.token_ids for o in auto.generate(prompts, GREEDY)] == [
        o.token_ids for o in bf16_llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("backend", KERNELS)
def test_non_finite_activations_stay_non_finite(backend):
    w = np.ones((32, 16), np.float32)
    x = np.zeros((2, 32), np.float32)
    x[0, 3], x[1, 5] = np.nan, np.inf
    got = np.asarray(linear.packed_linear(jnp.asarray(x), jnp.asarray(linear.pack(w)),
                                          backend=backend))
    assert np.isnan(got[0]).all() and not np.isfinite(got[1]).any()


@pytest.mark.parametrize("backend", list(linear.KERNELS))
def test_a_kernel_is_refused_with_the_reason_where_it_cannot_run(backend):
    f32 = jnp.float32
    assert linear.select("xla", "bfloat16", f32, True) == "xla"
    assert linear.select("auto", "float32", f32, True) == "xla"
    assert linear.select("auto", "bfloat16", f32, False) == "xla"
    with pytest.raises(ValueError, match="bf16 weights"):
        linear.select(backend, "int8", f32, True)
    with pytest.raises(ValueError, match="f32 activations"):
        linear.select(backend, "bfloat16", jnp.bfloat16, True)
    with pytest.raises(ValueError, match="one device"):
        linear.select(backend, "bfloat16", f32, False)
    if linear.available(backend):
        assert linear.select(backend, "bfloat16", f32, True) == backend
    else:
        with pytest.raises(ValueError, match=f"lacks it.*{backend} needs"):
            linear.select(backend, "bfloat16", f32, True)


def test_auto_takes_the_first_kernel_that_runs_here():
    """AMX where the CPU has it (a Sapphire Rapids has AVX512-BF16 too), else
    AVX512-BF16, else XLA."""
    expected = next((b for b in linear.KERNELS if linear.available(b)), "xla")
    assert linear.select("auto", "bfloat16", jnp.float32, True) == expected


@pytest.mark.parametrize("backend", KERNELS)
def test_the_engine_on_a_kernel_gives_the_tokens_of_xla_bf16(tiny_model, backend):
    """Same bf16 projections, the head also in bf16 on the kernel: greedy tokens agree with
    XLA's bf16 path, batched and chunked; the only other difference in memory is the tied
    head's copy: packed in bf16 on the kernel, [hidden, vocab] in f32 on XLA's path
    (weights.untie_head)."""
    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 17]
    xla = LLM(tiny_model, weight_dtype="bf16", linear_backend="xla", **ENGINE)
    packed = LLM(tiny_model, weight_dtype="bf16", linear_backend=backend,
                 linear_activations="f32", **ENGINE)
    assert (xla.linear_backend, packed.linear_backend) == ("xla", backend)
    layers = packed.runner.state["layers"]
    qkv, o = layers["qkv"].get_value(), layers["o_proj"].get_value()
    assert isinstance(o, PackedWeight) and (o.backend, o.passes) == (backend, 2)
    c = packed.config  # q/k/v are one kernel call, as are gate/up (layers.fuse)
    kv = c.num_kv_heads * c.head_dim
    assert qkv.splits == (c.num_heads * c.head_dim, kv, kv) and (qkv.backend, qkv.passes) == (
        backend, 2)
    assert layers["gate_up"].get_value().splits == (c.intermediate_size,) * 2
    assert not {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} & set(layers)
    assert [o.token_ids for o in packed.generate(prompts, GREEDY)] == [
        o.token_ids for o in xla.generate(prompts, GREEDY)]
    assert packed.weight_bytes == xla.weight_bytes - c.vocab_size * c.hidden_size * 2
    # the planner counts the packed head (a tied model's copy) as the engine holds it
    shape = planner.model_shape(str(tiny_model))
    assert packed.weight_bytes == planner.stored_weight_bytes(shape, "bf16", "f32", packed=True)
    assert xla.weight_bytes == planner.stored_weight_bytes(shape, "bf16", "f32", head_copy=True)


@pytest.mark.parametrize("backend", KERNELS)
def test_bf16_activations_keep_each_row_to_itself(tiny_model, backend):
    """One pass (activations rounded to bf16, the default on a kernel): a prompt's greedy
    tokens are the same alone, batched beside others and chunked (a token budget of 8),
    as the kernel computes every row on its own."""
    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 17]
    one_pass = LLM(tiny_model, weight_dtype="bf16", linear_backend=backend, **ENGINE)
    assert one_pass.linear_activations == "bf16"
    assert one_pass.runner.state["layers"]["qkv"].get_value().passes == 1
    batched = [o.token_ids for o in one_pass.generate(prompts, GREEDY)]
    assert batched == [one_pass.generate([p], GREEDY)[0].token_ids for p in prompts]
    chunked = LLM(tiny_model, weight_dtype="bf16", linear_backend=backend,
                  **{**ENGINE, "token_budget": 8})
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == batched


def test_bf16_activations_need_a_kernel(tiny_model):
    with pytest.raises(ValueError, match="needs a bf16 CPU kernel"):
        LLM(tiny_model, weight_dtype="bf16", linear_backend="xla", linear_activations="bf16",
            **ENGINE)


def test_auto_serves_bf16_on_a_kernel_and_f32_elsewhere(tiny_model):
    """--weight-dtype auto with f32 activations: bf16 projections on a kernel where the
    CPU has one (the faster exact-enough choice, README), f32 on XLA where it does not;
    an explicit f32 stays f32."""
    auto = LLM(tiny_model, **ENGINE)
    kernel = linear.select("auto", "bfloat16", jnp.float32, True)
    want = ("float32", "xla", "float32", "f32") if kernel == "xla" else (
        "bfloat16", kernel, "bf16", "bf16")  # KV pages in bf16 where activations are
    assert (auto.weight_dtype, auto.linear_backend, auto.linear_activations,
            auto.kv_dtype) == want
    f32 = LLM(tiny_model, weight_dtype="f32", **ENGINE)
    assert (f32.weight_dtype, f32.linear_backend, f32.kv_dtype) == ("float32", "xla", "f32")
