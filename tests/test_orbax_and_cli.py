"""`jaxserve convert` writes an Orbax checkpoint that restores to the same model; the CLI runs."""

import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from hf_models import save_random_model

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint.loader import load
from jaxserve.cli import main


@pytest.mark.slow
def test_convert_then_restore_gives_identical_params_and_tokens(smollm2_gguf, tmp_path):
    src = tmp_path / "hf"
    save_random_model("qwen2-bias", src)
    # a random model has no tokenizer of its own: borrow the default model's
    _, tokenizer = load(smollm2_gguf)
    tokenizer.save(src)
    assert main(["convert", str(src), "--out", str(tmp_path / "converted")]) == 0

    original, _ = load(src)
    restored, restored_tokenizer = load(tmp_path / "converted")
    assert restored.config == original.config
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(original)), nnx.to_flat_state(nnx.state(restored))
    ):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), path)
    assert restored_tokenizer.encode("héllo wörld 👋") == tokenizer.encode("héllo wörld 👋")

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(src, num_pages=16).generate([[5, 6, 7]], params)[0].token_ids
    restored_llm = LLM(tmp_path / "converted", num_pages=16)
    assert restored_llm.generate([[5, 6, 7]], params)[0].token_ids == want


@pytest.mark.slow
def test_cli_generate_answers_the_capital_of_france(smollm2_gguf):
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "What is the capital of France?",
         "--model", str(smollm2_gguf), "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "Paris" in out.stdout
