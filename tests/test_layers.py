"""Every projection goes through models/layers.linear: a model whose weights are stored
as int8 or fp8 with a scale runs with no change to its code, and computes what the
dequantized weights compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.device.batch import pack_step
from jaxserve.device.kv_cache import init_kv_cache
from jaxserve.device.step import forward
from jaxserve.host.plan import Chunk
from jaxserve.models.layers import QuantizedWeight, linear, quantize
from jaxserve.models.llama import LlamaForCausalLM

CONFIG = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16, max_position_embeddings=64)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PAGE_SIZE = 4


def with_weights(model: nnx.Module, fn) -> nnx.Module:
    """`model` with fn(value) in place of each projection weight."""
    graphdef, state = nnx.split(model)
    flat = [
        (path, var.replace(fn(var.get_value()) if path[-1] in PROJECTIONS else var.get_value()))
        for path, var in nnx.to_flat_state(state)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def logits_of(model: nnx.Module) -> np.ndarray:
    """Every token's logits for two prompts, prefilled together."""
    graphdef, state = nnx.split(model)
    prompts, pages = [[5, 6, 7, 8, 9], [10, 11, 12]], [[1, 2], [3, 4]]
    inputs = pack_step([Chunk(p, 0, pg) for p, pg in zip(prompts, pages)], PAGE_SIZE, 8, 2, 2,
                       spare_row=2)
    meta = dataclasses.replace(inputs.metadata, logits_indices=np.arange(8, dtype=np.int32))
    kv = init_kv_cache(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, 8, PAGE_SIZE)
    logits, _ = forward(graphdef, state, kv, inputs.token_ids, inputs.positions, meta)
    return np.asarray(logits)


@pytest.mark.parametrize(("weight_dtype", "stored", "error"), [
    ("int8", "int8", 0.05), ("fp8", "float8_e4m3fn", 0.1)])
def test_quantized_weights_run_through_the_same_model_code(weight_dtype, stored, error):
    model = LlamaForCausalLM(CONFIG, nnx.Rngs(0))
    quantized = with_weights(model, lambda w: quantize(w, weight_dtype))
    assert isinstance(quantized.layers.q_proj.get_value(), QuantizedWeight)
    assert stored in {x.dtype.name for x in jax.tree.leaves(nnx.state(quantized.layers))}
    # what the quantized weights mean, as plain f32 arrays
    dequantized = with_weights(
        quantized, lambda w: w.values.astype(np.float32) * w.scale[..., None, :])
    got, want = logits_of(quantized), logits_of(dequantized)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # and close to the unquantized model (rounding, not a different computation)
    full = logits_of(model)
    assert np.abs(got - full).max() < error * np.abs(full).max()
    assert np.abs(got - full).max() > 0  # the weights really are rounded


def test_linear_on_a_plain_and_a_quantized_weight():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(x, w)), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(linear(x, w.astype(jnp.bfloat16))),
                               x @ w.astype(jnp.bfloat16).astype(np.float32), rtol=1e-5,
                               atol=1e-5)  # a bf16-stored weight is cast to x's dtype
    for weight_dtype in ("int8", "fp8"):
        q = quantize(w, weight_dtype)
        dequantized = np.asarray(q.values).astype(np.float32) * np.asarray(q.scale)
        np.testing.assert_allclose(np.asarray(linear(x, q)), x @ dequantized, rtol=1e-5,
                                   atol=1e-5)
        # int8: within half a step (the scale, 1/127 of the column's largest magnitude);
        # fp8 (e4m3, 3 mantissa bits): within half a unit in the last place of each
        # value, 2^-4 of it, or of the smallest subnormal step (2^-9 × the scale)
        scale = np.asarray(q.scale)
        bound = scale / 2 if weight_dtype == "int8" else np.abs(w) * 2**-4 + scale * 2**-10
        assert (np.abs(dequantized - w) <= bound + 1e-7).all(), weight_dtype


def test_an_all_zero_column_quantizes_to_zeros():
    w = np.zeros((4, 3), np.float32)
    w[:, 1] = [1, -2, 3, 0.5]
    for weight_dtype in ("int8", "fp8"):
        q = quantize(w, weight_dtype)
        assert np.isfinite(np.asarray(q.values, dtype=np.float32)).all()
        assert np.asarray(q.values, dtype=np.float32)[:, [0, 2]].max() == 0
