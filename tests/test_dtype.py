"""--dtype: `auto` serves float32 on CPU and bfloat16 on accelerators; vLLM's aliases are
accepted; anything else is refused before a model loads."""

import subprocess
import sys

import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig, SamplingParams, serving_dtype
from jaxserve.llm import LLM


def test_auto_is_float32_on_cpu_and_bfloat16_elsewhere():
    assert serving_dtype("auto", "cpu") == "float32"
    assert serving_dtype("auto", "gpu") == serving_dtype("auto", "tpu") == "bfloat16"
    assert serving_dtype("half", "cpu") == "float16"
    assert serving_dtype("float", "gpu") == "float32"
    assert serving_dtype("bfloat16", "cpu") == "bfloat16"


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        EngineConfig(dtype="float64")
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--dtype", "int3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "invalid choice: 'int3'" in done.stderr


@pytest.mark.parametrize(("requested", "served"), [("auto", jnp.float32),
                                                   ("bfloat16", jnp.bfloat16)])
def test_the_model_is_loaded_in_the_served_dtype(tiny_model, requested, served):
    llm = LLM(tiny_model, dtype=requested, max_batch=2, token_budget=8, num_pages=16)
    assert llm.dtype == served
    assert llm.runner.state["embed"][...].dtype == served
    [out] = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3
