"""LoRA adapters: logits against transformers + peft, rows of different adapters in one
step, and adapters the engine must refuse."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import save_random_model
from lora_adapters import save_random_adapter

from jaxserve.checkpoint.adapter import AdapterError, load_adapter
from jaxserve.checkpoint.weights import load_model, open_checkpoint
from jaxserve.device.adapters import AdapterBatch, SlotStore
from jaxserve.device.batch import pack_step
from jaxserve.device.kv_cache import init_kv_cache
from jaxserve.device.step import forward
from jaxserve.host.plan import Chunk

PAGE_SIZE = 4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, targets, rsLoRA): the ranks 8 and 64 on different target sets
ADAPTERS = [(8, ["q_proj", "v_proj"], False), (64, "all-linear", True),
            (16, ["o_proj", "gate_proj", "up_proj", "down_proj"], False)]


def logits_of(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("kind", ["llama-gqa-tied", "qwen2-bias"])
def test_rows_of_different_adapters_match_peft_in_one_step(kind, tmp_path):
    base_dir = tmp_path / "base"
    hf = save_random_model(kind, base_dir)
    model = load_model(open_checkpoint(base_dir))
    cfg = model.config
    references, adapters = [], []
    for i, (rank, targets, rslora) in enumerate(ADAPTERS):
        peft_model = save_random_adapter(base_dir, tmp_path / f"a{i}", rank, targets, seed=i,
                                         rslora=rslora)
        references.append(peft_model)
        adapters.append(load_adapter(f"a{i}", tmp_path / f"a{i}", cfg, max_rank=64))
    store = SlotStore(cfg, num_slots=4, rank=64)
    for slot, adapter in zip((3, 1, 4), adapters):  # slots out of order; slot 2 stays empty
        store.write(slot, adapter)
    slots = store.slots()

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 9, 3, 7)]
    row_slots = (3, 1, 4, 0)  # the last row: the base model
    want = [logits_of(m, p) for m, p in zip([*references, hf], prompts)]
    free = rng.permutation(np.arange(1, 40)).tolist()
    pages = [[free.pop() for _ in range(4)] for _ in prompts]
    kv = init_kv_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 40, PAGE_SIZE)
    chunks = [Chunk(p, 0, pg, adapter_slot=s) for p, pg, s in zip(prompts, pages, row_slots)]
    inputs = pack_step(chunks, PAGE_SIZE, 32, 4, 4, spare_row=4)
    every = np.arange(sum(map(len, prompts)), dtype=np.int32)
    meta = dataclasses.replace(inputs.metadata, logits_indices=every)
    graphdef, state = nnx.split(model)
    logits, _ = forward(graphdef, state, kv, inputs.token_ids, inputs.positions, meta,
                        AdapterBatch(slots, inputs.adapters))
    np.testing.assert_allclose(np.asarray(logits), np.concatenate(want), atol=1e-4, rtol=0)
    # the adapters change the logits (a test that cannot fail otherwise)
    base = [logits_of(hf, p) for p in prompts[:3]]
    for got, plain in zip(np.split(np.asarray(logits), np.cumsum([5, 9, 3]))[:3], base):
        assert np.abs(got - plain).max() > 1e-2


def _adapter_dir(tmp_path, config: dict, tensors: dict | None = None):
    from safetensors.numpy import save_file

    path = tmp_path / "adapter"
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **config}
    ))
    save_file(tensors or {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
            np.zeros((8, 64), np.float32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
            np.zeros((64, 8), np.float32),
    }, path / "adapter_model.safetensors")
    return path


@pytest.mark.parametrize("config, tensors, message", [
    ({"r": 32}, None, "rank 32 exceeds --max-lora-rank 16"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, None, "'embed_tokens' does not exist"),
    ({"use_dora": True}, None, "DoRA is not supported"),
    ({"bias": "all"}, None, "trained biases"),
    ({}, {"base_model.model.lm_head.lora_A.weight": np.zeros((8, 64), np.float32)},
     "is not a LoRA A or B of a decoder projection"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
          np.zeros((8, 65), np.float32)}, "has shape (8, 65), expected (8, 64)"),
    ({}, {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight":
          np.zeros((8, 64), np.float32)}, "is for layer 9; the model has 3"),
])
def test_adapters_the_engine_cannot_serve_are_refused(config, tensors, message, tmp_path):
    save_random_model("llama-gqa-tied", tmp_path / "base")
    cfg = open_checkpoint(tmp_path / "base").config
    with pytest.raises(AdapterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_adapter("x", _adapter_dir(tmp_path, config, tensors), cfg, max_rank=16)
    with pytest.raises(AdapterError, match="not a PEFT adapter directory"):
        load_adapter("x", tmp_path / "base", cfg, max_rank=16)


@pytest.mark.parametrize("rank", [8, 16, 24])
def test_a_packed_slot_write_repacks_exactly_the_tiles_it_changes(rank, tmp_path):
    """Slots packed for a bf16 kernel are repacked tile by tile when one is written: the
    result must equal packing the whole host copy, whatever the rank's alignment to the
    tiles (16 output columns of A, 32 input rows of B)."""
    from jaxserve.cpu_kernels.linear import pack

    base_dir = tmp_path / "base"
    save_random_model("llama-gqa-tied", base_dir)
    cfg = open_checkpoint(base_dir).config
    save_random_adapter(base_dir, tmp_path / "a", rank, "all-linear", seed=0)
    save_random_adapter(base_dir, tmp_path / "b", rank, ["q_proj", "down_proj"], seed=1)
    a, b = (load_adapter(n, tmp_path / n, cfg, max_rank=rank) for n in "ab")
    store = SlotStore(cfg, num_slots=3, rank=rank, backend="avx512_bf16", passes=1)
    for slot, adapter in ((2, a), (1, b), (3, a), (2, None), (1, a)):
        store.write(slot, adapter)
        for name, stack in store.host.items():
            np.testing.assert_array_equal(np.asarray(store.placed[name].values), pack(stack))
    assert store.scale.tolist() == [a.scale, 0.0, a.scale]
