"""--weight-dtype: the projections stored as int8, fp8 or bf16 (the rest in --dtype), as
the engine reports them; `jaxserve convert` stores them quantized, and a restart restores
them as stored instead of quantizing again."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams, planner
from jaxserve.checkpoint.loader import load
from jaxserve.checkpoint.weights import WeightsError
from jaxserve.cli import main
from jaxserve.models.layers import QuantizedWeight

ENGINE = {"max_batch": 2, "token_budget": 8, "num_pages": 16}
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def projection_sizes(config) -> tuple[int, int]:
    """(weights, output columns) of a Llama's projections, over all layers."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    n = config.num_layers
    return n * (d * q + 2 * d * kv + q * d + 3 * d * f), n * (q + 2 * kv + d + 2 * f + d)


@pytest.mark.parametrize(("weight_dtype", "stored", "nbytes"), [
    ("int8", "int8", 1), ("fp8", "float8_e4m3fn", 1), ("bf16", "bfloat16", 2)])
def test_projections_are_stored_as_asked_and_counted(tiny_model, weight_dtype, stored, nbytes):
    full = LLM(tiny_model, weight_dtype="f32", **ENGINE)
    assert full.weight_dtype == "float32"
    # XLA's path: AMX adds a packed copy of the head (tests/test_cpu_linear.py)
    llm = LLM(tiny_model, weight_dtype=weight_dtype, linear_backend="xla", **ENGINE)
    assert llm.weight_dtype == stored
    weights, columns = projection_sizes(llm.config)
    scales = 4 * columns if nbytes == 1 else 0  # one f32 scale per output column
    assert llm.weight_bytes == full.weight_bytes - weights * (4 - nbytes) + scales
    assert llm.runner.state["embed"][...].dtype == np.float32  # only projections change
    [out] = llm.generate([[5, 6, 7]], GREEDY)
    assert len(out.token_ids) == 5


@pytest.mark.parametrize("weight_dtype", ["auto", "bf16", "int8", "fp8"])
def test_the_engines_weight_bytes_are_the_planners(tiny_model, weight_dtype):
    llm = LLM(tiny_model, weight_dtype=weight_dtype, linear_backend="xla", **ENGINE)
    shape = planner.model_shape(str(tiny_model))
    stored = "f32" if weight_dtype == "auto" else weight_dtype
    # on a CPU, XLA's path holds a tied head's own copy (weights.untie_head); a chip not
    assert llm.weight_bytes == planner.stored_weight_bytes(shape, stored, "f32", head_copy=True)
    assert planner.plan(planner.PlanInputs(
        shape, planner.CHIPS["h100"], weight_dtype=stored, dtype="f32")
    ).stored_weight_bytes == llm.weight_bytes - shape.hidden_size * shape.vocab_size * 4


def test_an_unknown_weight_dtype_is_refused(tiny_model):
    with pytest.raises(ValueError, match="weight_dtype must be one of auto, f32, bf16"):
        LLM(tiny_model, weight_dtype="int4", **ENGINE)


def test_convert_stores_quantized_weights_that_restore_as_stored(tiny_model, tmp_path):
    out = tmp_path / "int8"
    assert main(["convert", str(tiny_model), "--out", str(out), "--weight-dtype", "int8"]) == 0
    assert (out / "jaxserve_weights.json").exists()
    quantized, _ = load(tiny_model, weight_dtype="int8")
    restored, _ = load(out)  # auto: as stored
    assert isinstance(restored.layers.q_proj.get_value(), QuantizedWeight)
    want, got = (jax.tree.leaves_with_path(nnx.state(m)) for m in (quantized, restored))
    assert [path for path, _ in want] == [path for path, _ in got]
    for (path, a), (_, b) in zip(want, got):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    [want] = LLM(tiny_model, weight_dtype="int8", **ENGINE).generate([[5, 6, 7]], GREEDY)
    [got] = LLM(out, weight_dtype="int8", **ENGINE).generate([[5, 6, 7]], GREEDY)
    assert got.token_ids == want.token_ids
    with pytest.raises(WeightsError, match="stores its weights as int8"):
        load(out, weight_dtype="fp8")


def test_a_float_checkpoint_is_quantized_at_load(tiny_model, tmp_path):
    out = tmp_path / "f32"
    assert main(["convert", str(tiny_model), "--out", str(out)]) == 0
    from_source, _ = load(tiny_model, weight_dtype="fp8")
    from_checkpoint, _ = load(out, weight_dtype="fp8")
    a, b = (m.layers.down_proj.get_value() for m in (from_source, from_checkpoint))
    np.testing.assert_array_equal(np.asarray(a.values, np.float32),
                                  np.asarray(b.values, np.float32))
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
