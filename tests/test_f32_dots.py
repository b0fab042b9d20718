"""The CPU step's f32 dots: compiled for Eigen rather than YNNPACK (whose one chain along K
left SmolLM2 0.6-1.6e-4 from transformers f32), and a tied head multiplied from its own
[hidden, vocab] copy, the layout Eigen multiplies fast (device/step.py, compiler_options;
checkpoint/weights.py, untie_head)."""

import numpy as np
import torch
import transformers
from hf_models import hf_greedy

from jaxserve import LLM, SamplingParams


def test_the_cpu_step_multiplies_f32_without_ynnpack_and_a_tied_head_from_its_copy(tiny_model):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert hf.config.tie_word_embeddings
    llm = LLM(tiny_model, max_batch=2, num_pages=32, page_size=4, token_budget=8,
              weight_dtype="f32", linear_backend="xla")
    state = llm.runner.state
    np.testing.assert_array_equal(np.asarray(state["lm_head"][...]),
                                  np.asarray(state["embed"][...]).T)

    ids = [5, 17, 3, 99, 42]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    [out] = llm.generate([ids], params)
    assert out.token_ids == hf_greedy(hf.eval(), ids, 4)

    texts = [executable.as_text() for executable in llm.runner._executables.values()]
    assert texts and all(" dot(" in text for text in texts)
    assert not any("__ynn_fusion" in text for text in texts)
