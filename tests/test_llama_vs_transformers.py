"""The Llama-family model against Hugging Face transformers on the same weights."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import CONFIGS, save_random_model

from jaxserve.checkpoint.weights import load_model, open_checkpoint
from jaxserve.device.batch import pack_step
from jaxserve.device.kv_cache import init_kv_cache
from jaxserve.device.step import forward
from jaxserve.host.plan import Chunk

PAGE_SIZE = 4


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


CASES = [(kind, "xla") for kind in sorted(CONFIGS)] + [
    ("llama-gqa-tied", "reference"),
    ("qwen2-bias", "pallas-interpret"),  # the Pallas ragged kernel inside the model
    ("llama-gqa-tied", "cpu"),  # the C++ CPU kernel inside the model
    ("qwen2-bias", "cpu"),
]


@pytest.mark.parametrize("kind, backend", CASES)
def test_prefill_and_decode_logits_match(kind, backend, tmp_path):
    hf = save_random_model(kind, tmp_path)
    model = load_model(open_checkpoint(tmp_path))
    cfg = model.config
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 7, 13)]
    # pages shuffled and interleaved between sequences; page 0 stays the null page
    free = rng.permutation(np.arange(1, 40)).tolist()
    pages = [[free.pop() for _ in range(8)] for _ in prompts]
    kv = init_kv_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 40, PAGE_SIZE)

    chunks = [Chunk(p, 0, pg) for p, pg in zip(prompts, pages)]
    inputs = pack_step(chunks, PAGE_SIZE, 32, 4, 8, spare_row=4, attention_backend=backend)
    all_tokens = np.arange(sum(len(p) for p in prompts), dtype=np.int32)
    meta = dataclasses.replace(inputs.metadata, logits_indices=all_tokens)
    logits, kv = forward(graphdef, state, kv, inputs.token_ids, inputs.positions, meta)
    want = np.concatenate([hf_logits(hf, p) for p in prompts])
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=0)

    # three decode steps, every sequence one token at a time, in one flat batch
    for _ in range(3):
        nxt = [int(rng.integers(cfg.vocab_size)) for _ in prompts]
        chunks = [Chunk([t], len(p), pg) for t, p, pg in zip(nxt, prompts, pages)]
        inputs = pack_step(chunks, PAGE_SIZE, 4, 4, 8, spare_row=4, attention_backend=backend)
        logits, kv = forward(
            graphdef, state, kv, inputs.token_ids, inputs.positions, inputs.metadata
        )
        for p, t in zip(prompts, nxt):
            p.append(t)
        want = np.stack([hf_logits(hf, p)[-1] for p in prompts])
        np.testing.assert_allclose(np.asarray(logits)[: len(prompts)], want, atol=1e-4, rtol=0)
        assert np.isfinite(np.asarray(logits)).all()
    assert jnp.all(jnp.isfinite(kv.k))
