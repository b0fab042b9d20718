"""SmolLM2-135M with random LoRA adapters of rank 8 and 64, against transformers + peft
(f32): the adapters' logits and greedy tokens (slow: the real model)."""

import contextlib
import copy
import dataclasses
import sys
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers
from hf_models import hf_greedy

from jaxserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import REFERENCE_PROMPTS

PROMPTS = list(REFERENCE_PROMPTS)
NEW_TOKENS = 32
# name: (rank, targets, rsLoRA)
ADAPTERS = {"r8": (8, ["q_proj", "v_proj", "down_proj"], False),
            "r64": (64, "all-linear", True)}
# The issue asks 1e-4. Measured on an Intel Xeon (the 5 reference prompts), since the
# step's f32 dots run on Eigen (device/step.py, compiler_options): the base model alone
# 0.4-0.6e-4 from transformers f32 (on YNNPACK 0.6-1.6e-4); r64 within 1e-4 of peft, r8
# 2.3e-4 on the third prompt, where jaxserve is 1.8e-4 from peft in f64 and peft f32 0.6
# (bench/results/NOTES.md, 2026-12-04). Bound: what was measured, with room for another
# CPU's summation order; the tiny models' test holds 1e-4.
ATOL = 5e-4
# peft in f32 is itself up to 5.2e-4 from the same model in f64 (r64, the fifth prompt, a
# Zen 5): no f32 implementation can be held to 1e-4 of it on every prompt. What jaxserve
# owns is its own rounding: over the 5 prompts its largest distance from f64 is at most
# this many times peft f32's (measured 0.70x base, 1.06x r8, 0.81x r64 on a Zen 5; r8
# 1.31x on an Intel Xeon; NOTES.md, 2026-12-04).
F64_RATIO = 1.5


def hf_model(gguf: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def references(smollm2_gguf, tmp_path_factory):
    """name -> (peft model, adapter directory), each adapter random (seeded)."""
    root = tmp_path_factory.mktemp("smollm2-adapters")
    models = {}
    for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=targets,
                                 use_rslora=rslora, init_lora_weights=False)
        torch.manual_seed(seed)
        model = peft.get_peft_model(hf_model(smollm2_gguf), config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn_like(param) * 0.02)
        model.eval()
        model.save_pretrained(root / name)
        models[name] = (model, root / name)
    return models


@pytest.fixture(scope="module")
def llm(smollm2_gguf, references):
    # f32: the exactness under test; slots as wide as the widest adapter
    return LLM(model=smollm2_gguf, max_batch=8, num_pages=256, weight_dtype="f32",
               max_loras=2, max_lora_rank=64,
               lora={name: path for name, (_, path) in references.items()})


def jaxserve_logits(llm, ids: list[int], slot: int) -> np.ndarray:
    """f32[len(ids), vocab]: every position's logits of one prefill, rows of adapter slot
    `slot` (0: none)."""
    from jaxserve.device.adapters import AdapterBatch
    from jaxserve.device.batch import pack_step
    from jaxserve.device.step import forward
    from jaxserve.host.plan import Chunk

    runner = llm.runner
    pages = -(-len(ids) // runner.page_size)
    tokens = -(-len(ids) // 16) * 16
    inputs = pack_step([Chunk(ids, 0, list(range(1, pages + 1)), adapter_slot=slot)],
                       runner.page_size, tokens, 1, pages, runner.spare_row)
    meta = dataclasses.replace(inputs.metadata, backend=runner.backend,  # the pool's
                               logits_indices=np.arange(len(ids), dtype=np.int32))
    logits, runner.kv_cache = forward(
        runner.graphdef, runner.state, runner.kv_cache, inputs.token_ids, inputs.positions, meta,
        AdapterBatch(runner.adapter_slots, inputs.adapters))
    return np.asarray(logits)


def torch_logits(model, ids: list[int], adapter: bool = True) -> np.ndarray:
    with torch.no_grad(), contextlib.nullcontext() if adapter else model.disable_adapter():
        return model(torch.tensor([ids])).logits[0].double().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_logits_match_peft(llm, references, name):
    peft_model = references[name][0]
    llm.runner.write_adapter(1, llm.adapter(name))
    ids = llm.tokenizer.encode(PROMPTS[2])
    got = jaxserve_logits(llm, ids, 1)
    want = torch_logits(peft_model, ids)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert np.abs(want - torch_logits(peft_model, ids, adapter=False)).max() > 0.1  # it acts


@pytest.mark.slow
@pytest.mark.parametrize("name", ["base", *ADAPTERS])
def test_rounding_no_worse_than_peft_f32(llm, references, name):
    """Against the same model in f64, over the 5 prompts, jaxserve's largest logit error is
    within F64_RATIO of peft f32's (base: the adapters' model with none applied)."""
    adapted = name != "base"
    peft_model = references[name if adapted else "r8"][0]
    exact = copy.deepcopy(peft_model).double()
    if adapted:
        llm.runner.write_adapter(1, llm.adapter(name))
    ours, theirs = [], []
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        want = torch_logits(exact, ids, adapter=adapted)
        ours.append(np.abs(jaxserve_logits(llm, ids, int(adapted)) - want).max())
        theirs.append(np.abs(torch_logits(peft_model, ids, adapter=adapted) - want).max())
    assert max(ours) <= F64_RATIO * max(theirs), (ours, theirs)


@pytest.mark.slow
def test_greedy_tokens_match_peft(llm, references):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for name, (peft_model, _) in references.items():
        outputs = llm.generate(PROMPTS, params, adapter=name)
        for prompt, out in zip(PROMPTS, outputs):
            assert out.token_ids == hf_greedy(peft_model, out.prompt_token_ids, NEW_TOKENS), (
                name, prompt)
