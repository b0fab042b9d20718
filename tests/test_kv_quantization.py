"""--kv-dtype: KV pages stored as int8 (a scale per token and head), fp8 (e4m3, calibrated
per channel) or bf16;
the bytes a token takes, as the engine holds them, equal the planner's; a pool sized by
bytes holds the pages that fit; and quantized KV or weights keep the engine's invariants
(batch invariance, chunked prefill = unchunked, prefix cache on = off)."""

import json
import subprocess
import sys
import urllib.request

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from serving import running_server

from jaxserve import LLM, SamplingParams
from jaxserve.device.attention import AttentionMetadata, paged_attention
from jaxserve.device.kv_cache import (
    FP8_MAX,
    KV_STORAGE,
    KVCache,
    calibration_text,
    init_kv_cache,
    quantize,
    write_kv,
)
from jaxserve.pallas_kernels.storage import dequantize, value_dtype
from jaxserve.planner import kv_bytes_per_token

ENGINE = {"max_batch": 4, "token_budget": 64, "num_pages": 64, "page_size": 4}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 9, 30)]


def test_round_trips_stay_within_each_formats_bound():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3, 32)).astype(np.float32) * rng.uniform(0.01, 20, (64, 3, 1))
    x = x.astype(np.float32)
    values, scale = quantize(jnp.asarray(x), jnp.int8)
    assert values.dtype == jnp.int8 and scale.shape == (64, 3)
    back = np.asarray(dequantize(values, scale, jnp.float32))
    absmax = np.abs(x).max(-1, keepdims=True)
    assert (np.abs(back - x) <= absmax / 254 * (1 + 1e-5)).all()  # half a step of absmax/127

    values, scale = quantize(jnp.asarray(x), jnp.float8_e4m3fn)
    assert values.dtype == jnp.uint8 and scale is None  # e4m3 values, kept as their bits
    back = np.asarray(dequantize(values, None, jnp.float32))
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 relative); subnormals step by 2^-9
    assert (np.abs(back - x) <= np.abs(x) * 2**-4 + 2**-10).all()
    big = np.asarray(dequantize(*quantize(jnp.asarray([[1e4, -1e4]]), jnp.float8_e4m3fn),
                                jnp.float32))
    np.testing.assert_array_equal(big, [[FP8_MAX, -FP8_MAX]])  # clipped, never NaN

    values, scale = quantize(jnp.zeros((2, 8)), jnp.int8)
    np.testing.assert_array_equal(np.asarray(scale), 0)
    np.testing.assert_array_equal(np.asarray(dequantize(values, scale, jnp.float32)), 0)


def test_write_kv_stores_each_tokens_values_and_scale_in_its_slot():
    shape = (2, 3, 5, 4, 8)  # layers, kv heads, pages, page size, head dim
    cache = KVCache(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8),
                    jnp.zeros(shape[:-1]), jnp.zeros(shape[:-1]))
    rng = np.random.default_rng(1)
    k = rng.normal(size=(2, 3, 8)).astype(np.float32)
    v = rng.normal(size=(2, 3, 8)).astype(np.float32) * 5
    slots = jnp.asarray([2 * 4 + 1, 4 * 4 + 3])  # page 2 offset 1, page 4 offset 3
    cache = write_kv(cache, jnp.int32(1), slots, jnp.asarray(k), jnp.asarray(v))
    for t, (page, offset) in enumerate([(2, 1), (4, 3)]):
        got_k = dequantize(cache.k[1, :, page, offset], cache.k_scale[1, :, page, offset],
                           jnp.float32)
        got_v = dequantize(cache.v[1, :, page, offset], cache.v_scale[1, :, page, offset],
                           jnp.float32)
        np.testing.assert_allclose(got_k, k[t], atol=np.abs(k[t]).max() / 200)
        np.testing.assert_allclose(got_v, v[t], atol=np.abs(v[t]).max() / 200)
    assert int((np.asarray(cache.k_scale) != 0).sum()) == 2 * 3  # nothing else written
    # K kept transposed (the CPU kernel's pages, [head_dim, page_size]): the same writes
    kept = init_kv_cache(2, 3, 8, 5, 4, jnp.int8, k_transposed=True)
    assert kept.k.shape == (2, 3, 5, 8, 4) and kept.page_size == 4
    kept = write_kv(kept, jnp.int32(1), slots, jnp.asarray(k), jnp.asarray(v))
    assert kept.k_transposed
    np.testing.assert_array_equal(np.asarray(kept.k), np.swapaxes(np.asarray(cache.k), -1, -2))
    for name in ("v", "k_scale", "v_scale"):
        np.testing.assert_array_equal(np.asarray(getattr(kept, name)),
                                      np.asarray(getattr(cache, name)))


def fp8_cache(shape, k_center, v_center, k_channel_scale, v_channel_scale) -> KVCache:
    pool = jnp.zeros(shape, jnp.uint8)  # fp8 bits
    return KVCache(pool, pool, None, None, *(jnp.asarray(x, jnp.float32) for x in (
        k_center, v_center, k_channel_scale, v_channel_scale)))


@pytest.mark.parametrize("backend", ["reference", "xla", "cpu", "pallas-interpret"])
def test_fp8_calibration_is_exact_around_attention(backend):
    """fp8 pages hold (x − center) ÷ channel scale, and attention undoes it: K's scales
    multiply q, V's multiply the output and V's center is added to it, K's center changes
    nothing (a constant on every score). On keys with large near-constant channels, as
    post-RoPE keys have, calibrated fp8 attention is many times closer to f32's than
    uncalibrated fp8 (stored as it comes, 3 mantissa bits on 40 ± 1). On every attention
    backend, since the calibration is applied around them."""
    layers, heads, group, dim, page = 2, 2, 3, 16, 4
    rng = np.random.default_rng(2)
    n = 12  # one sequence of 12 tokens in pages 1-3, every token a query
    k = rng.normal(size=(n, heads, dim)).astype(np.float32) * 0.05
    v = rng.normal(size=(n, heads, dim)).astype(np.float32) * 0.01
    k[:, :, :2] += (40.0, -25.0)  # two large near-constant channels
    v += 0.3  # values off zero
    q = rng.normal(size=(n, heads * group, dim)).astype(np.float32)
    k_center, v_center = k.mean(0), v.mean(0)
    k_dev, v_dev = (np.abs(x - x.mean(0)).max(0) for x in (k, v))
    calibrated = [np.broadcast_to(x, (layers, heads, dim)) for x in (
        k_center, v_center, 4 * k_dev / FP8_MAX, 4 * v_dev / FP8_MAX)]
    none = [np.zeros((layers, heads, dim))] * 2 + [np.ones((layers, heads, dim))] * 2
    metadata = AttentionMetadata(
        seq_ids=jnp.zeros(n, jnp.int32), slot_mapping=jnp.arange(page, page + n),
        page_table=jnp.array([[1, 2, 3], [0, 0, 0]], jnp.int32),
        cu_q_lens=jnp.array([0, n, n], jnp.int32), kv_lens=jnp.array([n, 0], jnp.int32),
        logits_indices=jnp.array([n - 1], jnp.int32), backend=backend)
    positions = jnp.arange(n, dtype=jnp.int32)
    f32 = KVCache(*(jnp.zeros((layers, heads, 5, page, dim)) for _ in "kv"))
    args = (jnp.int32(1), metadata.slot_mapping, jnp.asarray(k), jnp.asarray(v))
    want = paged_attention(jnp.asarray(q), write_kv(f32, *args), jnp.int32(1), positions,
                           metadata, dim**-0.5)
    errors = {}
    for name, calibration in (("calibrated", calibrated), ("uncalibrated", none)):
        cache = write_kv(fp8_cache((layers, heads, 5, page, dim), *calibration), *args)
        assert cache.k_channel_scale is not None  # carried through the write
        got = paged_attention(jnp.asarray(q), cache, jnp.int32(1), positions, metadata,
                              dim**-0.5)
        errors[name] = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert errors["calibrated"] < 2e-3 < errors["uncalibrated"] / 5, errors


@pytest.mark.parametrize(("kv_dtype", "itemsize", "scale"), [
    ("f32", 4, 0), ("bf16", 2, 0), ("int8", 1, 4), ("fp8", 1, 0)])
def test_the_engines_kv_bytes_per_token_are_the_planners(tiny_model, kv_dtype, itemsize, scale):
    llm = LLM(tiny_model, kv_dtype=kv_dtype, **ENGINE)
    c = llm.config
    want = 2 * c.num_layers * c.num_kv_heads * (c.head_dim * itemsize + scale)
    assert llm.kv_bytes_per_token == want  # from the arrays on the device
    assert kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype) == want
    assert llm.kv_dtype == kv_dtype
    assert value_dtype(llm.runner.kv_cache.k.dtype) == KV_STORAGE[kv_dtype]


def test_a_pool_sized_by_bytes_holds_more_of_the_smaller_pages(tiny_model):
    budget = 2**20
    pages = {}
    for kv_dtype in ("f32", "int8", "fp8"):
        llm = LLM(tiny_model, kv_dtype=kv_dtype, kv_cache_bytes=budget,
                  **{**ENGINE, "num_pages": 2})
        page_bytes = ENGINE["page_size"] * llm.kv_bytes_per_token
        pages[kv_dtype] = llm.num_pages
        assert llm.num_pages == budget // page_bytes
        assert llm.scheduler.num_pages_usable == llm.num_pages - 1  # the null page aside
        assert llm.runner.kv_cache.num_pages == llm.num_pages
    assert pages["fp8"] == 4 * pages["f32"]
    # head_dim 16: 64 B a head-token in f32 against 16 + a 4-byte scale in int8
    assert 3.1 * pages["f32"] < pages["int8"] < 3.3 * pages["f32"]
    with pytest.raises(ValueError, match="need 2"):
        LLM(tiny_model, kv_dtype="f32", kv_cache_bytes=1000, **ENGINE)


def test_an_unknown_kv_dtype_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, f32, bf16, int8, fp8"):
        LLM(tiny_model, kv_dtype="int4", **ENGINE)


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize(("weight_dtype", "kv_dtype", "backend"), [
    ("auto", "int8", "cpu"), ("auto", "fp8", "cpu"), ("auto", "bf16", "cpu"),
    ("auto", "int8", "xla"), ("auto", "fp8", "xla"),
    ("int8", "auto", "cpu"), ("fp8", "auto", "cpu"), ("bf16", "auto", "cpu"),
])
def test_quantized_storage_keeps_the_engines_invariants(tiny_model, weight_dtype, kv_dtype,
                                                        backend):
    """Quantized weights or KV, through the whole engine: batch invariance, chunked
    prefill = unchunked, prefix cache on = off."""
    stored = {"weight_dtype": weight_dtype, "kv_dtype": kv_dtype, "attention_backend": backend}
    llm = LLM(tiny_model, debug_checks=True, **stored, **ENGINE)
    alone = [tokens(llm, [p])[0] for p in PROMPTS]
    assert tokens(llm, PROMPTS) == alone  # batch invariance
    # a budget of 8 tokens cuts the 17- and 30-token prompts into chunks
    chunked = LLM(tiny_model, **stored, **{**ENGINE, "token_budget": 8})
    assert tokens(chunked, PROMPTS) == alone
    # the same prompts again: their full pages now come from the prefix cache
    assert tokens(llm, PROMPTS) == alone
    assert llm.scheduler.allocators[0].num_cached > 0
    uncached = LLM(tiny_model, prefix_caching=False, **stored, **ENGINE)
    assert tokens(uncached, PROMPTS) == alone
    # and the storage is really another: f32 gives other logits somewhere
    f32 = LLM(tiny_model, attention_backend=backend, weight_dtype="f32", **ENGINE)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    want = [o.prompt_logprobs for o in f32.generate(PROMPTS, scored)]
    got = [o.prompt_logprobs for o in llm.generate(PROMPTS, scored)]
    diffs = [abs(a - b) for w, g in zip(want, got) for a, b in zip(w[1:], g[1:])]
    assert 0 < max(diffs) < 0.5


def test_fp8_is_calibrated_on_the_calibration_text_at_start(tiny_model):
    """An fp8 engine starts with each channel's center at its mean K or V over the
    calibration text, as an f32 pool holds them, and its scale at 4× the largest deviation
    ÷ 448; and it scores prompts close to f32."""
    fp8 = LLM(tiny_model, kv_dtype="fp8", **ENGINE)
    f32 = LLM(tiny_model, kv_dtype="f32", **ENGINE)
    assert f32.runner.kv_cache.k_center is None  # only fp8 is calibrated
    stats = f32.runner.kv_stats(f32.tokenizer.encode(calibration_text()))[:2]
    cache = fp8.runner.kv_cache
    for (mean, dev), center, scale in ((stats[0], cache.k_center, cache.k_channel_scale),
                                       (stats[1], cache.v_center, cache.v_channel_scale)):
        mean, dev = np.asarray(mean), np.asarray(dev)
        assert np.abs(mean).max() > 0.01  # something to center
        # fp8 rounds each value by up to 1/16 of its deviation, and their mean by less
        np.testing.assert_allclose(np.asarray(center), mean, atol=np.abs(dev).max() / 16)
        np.testing.assert_allclose(np.asarray(scale), 4 * dev / FP8_MAX, rtol=0.1)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for w, g in zip(f32.generate(PROMPTS, scored), fp8.generate(PROMPTS, scored)):
        np.testing.assert_allclose(g.prompt_logprobs[1:], w.prompt_logprobs[1:], atol=0.1)


@pytest.mark.slow  # starts a server
def test_a_server_reports_its_kv_storage_and_the_pages_that_fit(tiny_model):
    flags = ["--kv-dtype", "int8", "--kv-cache-bytes", "1MiB", "--max-batch", "4",
             "--token-budget", "32", "--max-model-len", "256"]
    per_token = kv_bytes_per_token(2, 2, 16, "int8")  # the tiny model: 2 layers, 2 KV heads
    pages = 2**20 // (16 * per_token)
    with running_server(tiny_model, *flags) as (url, proc):
        with urllib.request.urlopen(url + "/v1/models") as resp:
            [card] = json.load(resp)["data"]
        assert card["kv_dtype"] == "int8"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        out = client.completions.create(model=card["id"], prompt="Hi", max_tokens=4)
        assert out.usage.completion_tokens == 4
        with urllib.request.urlopen(url + "/metrics") as resp:
            metrics = resp.read().decode()
        total = [line for line in metrics.splitlines()
                 if line.startswith("jaxserve:kv_pages_total")]
        assert total == [f"jaxserve:kv_pages_total {pages - 1:.1f}"]
    ready = [line for line in proc.log_path.read_text().splitlines() if "ready:" in line]
    assert f"KV int8, {per_token} B/token, {pages - 1} pages" in ready[0]


def test_num_pages_and_kv_cache_bytes_are_not_both_taken(tiny_model):
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(tiny_model),
           "--num-pages", "64", "--kv-cache-bytes", "1MiB"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--num-pages and --kv-cache-bytes both size the KV pool" in done.stderr
