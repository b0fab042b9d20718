"""SmolLM2-135M-Instruct from its GGUF file, on both sides: greedy tokens must be identical."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hf_models import hf_greedy

from jaxserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import REFERENCE_PROMPTS

PROMPTS = list(REFERENCE_PROMPTS)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    # f32: the exactness under test (auto serves bf16 on a CPU with AMX)
    return LLM(model=smollm2_gguf, max_batch=8, num_pages=128, weight_dtype="f32")


def test_prompt_logits_match(llm, hf_model):
    from jaxserve.device.batch import pack_step
    from jaxserve.device.step import forward
    from jaxserve.host.plan import Chunk

    runner = llm.runner
    ids = llm.tokenizer.encode(PROMPTS[2])
    inputs = pack_step([Chunk(ids, 0, [1, 2])], runner.page_size, 16, 1, 2, runner.spare_row)
    every_token = np.arange(len(ids), dtype=np.int32)
    meta = dataclasses.replace(inputs.metadata, logits_indices=every_token,
                               backend=runner.backend)  # the pool is laid out for it
    logits, runner.kv_cache = forward(
        runner.graphdef, runner.state, runner.kv_cache, inputs.token_ids, inputs.positions, meta
    )
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    # Same dequantized weights on both sides; f32 accumulation order differs.
    np.testing.assert_allclose(np.asarray(logits), want, atol=2e-3, rtol=0)


def test_greedy_continuations_identical(llm, hf_model):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        want = hf_greedy(hf_model, out.prompt_token_ids, NEW_TOKENS)
        assert out.token_ids == want, prompt
        assert out.finish_reason == "length"
