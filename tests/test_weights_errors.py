"""Loading checkpoints: tiny GGUF files (float and quantized) against the same weights from a
Hugging Face directory, and one clear `WeightsError` for each way a checkpoint can be bad."""

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from flax import nnx
from gguf import GGMLQuantizationType as QType
from hf_models import save_random_model

from jaxserve.checkpoint.weights import GGUF_TYPES, WeightsError, load_model, open_checkpoint
from jaxserve.config import ModelConfig
from jaxserve.device.batch import pack_step
from jaxserve.device.kv_cache import init_kv_cache
from jaxserve.device.step import forward
from jaxserve.host.plan import Chunk

PAGE_SIZE = 4

# llama.cpp's tensor names, written out here (not taken from weights.py) so the test checks them
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# ---------------------------------------------------------------- writing GGUF files


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to Llama's Q/K rows (interleaves the RoPE halves)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """The float32 tensors of a Hugging Face directory under GGUF names, Q/K permuted for llama."""
    config = open_checkpoint(hf_dir).config
    tensors = {}
    for file in hf_dir.glob("*.safetensors"):
        for name, w in safetensors.numpy.load_file(file).items():
            if config.architecture == "llama" and ".q_proj." in name:
                w = llama_cpp_permute(w, config.num_heads)
            elif config.architecture == "llama" and ".k_proj." in name:
                w = llama_cpp_permute(w, config.num_kv_heads)
            tensors[gguf_name(name)] = w.astype(np.float32)
    return tensors


def gguf_metadata(config: ModelConfig) -> dict[str, int | float]:
    arch = config.architecture
    return {
        f"{arch}.block_count": config.num_layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_heads,
        f"{arch}.attention.head_count_kv": config.num_kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        f"{arch}.rope.freq_base": config.rope_theta,
        f"{arch}.vocab_size": config.vocab_size,
    }


def write_gguf(
    path: Path,
    arch: str,
    metadata: dict[str, int | float],
    tensors: dict[str, np.ndarray],
    quantized: dict[str, tuple[np.ndarray, QType]] | None = None,
    drop_architecture: bool = False,
) -> Path:
    """A GGUF file; `quantized` maps names to (raw uint8 blocks, type)."""
    writer = gguf.GGUFWriter(path, arch)
    if drop_architecture:  # the writer always adds it; only its pending key table can drop it
        writer.kv_data[0].pop("general.architecture")
    for key, value in metadata.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for name, (raw, qtype) in (quantized or {}).items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load(path: Path) -> nnx.Module:
    return load_model(open_checkpoint(path))


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {
        "/".join(str(p) for p in path): np.asarray(v.get_value())
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def last_logits(model: nnx.Module, prompts: list[list[int]]) -> np.ndarray:
    """f32[len(prompts), vocab] logits of each prompt's last token, one prefill step."""
    cfg = model.config
    graphdef, state = nnx.split(model)
    kv = init_kv_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, PAGE_SIZE)
    pages = [[3, 1], [5, 2], [9, 4, 7]]
    chunks = [Chunk(p, 0, pg) for p, pg in zip(prompts, pages)]
    inputs = pack_step(chunks, PAGE_SIZE, num_tokens=16, num_rows=4, max_pages=4, spare_row=4)
    logits, _ = forward(graphdef, state, kv, inputs.token_ids, inputs.positions, inputs.metadata)
    return np.asarray(logits)[: len(prompts)]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """Random Hugging Face directories, written once; tests copy before corrupting them."""
    root = tmp_path_factory.mktemp("hf")
    for kind in ("llama-gqa-tied", "qwen2-bias"):
        save_random_model(kind, root / kind)
    return {kind: root / kind for kind in ("llama-gqa-tied", "qwen2-bias")}


@pytest.fixture
def hf_dir(hf_models, tmp_path) -> Path:
    """A fresh copy of the tiny Llama directory, free to corrupt."""
    return Path(shutil.copytree(hf_models["llama-gqa-tied"], tmp_path / "model"))


@pytest.fixture
def good_gguf(hf_models, tmp_path):
    """A writer of the tiny Llama as GGUF with `tensors` and `metadata` edited by the caller."""
    hf = hf_models["llama-gqa-tied"]
    config = open_checkpoint(hf).config

    def write(edit_tensors=None, edit_metadata=None, arch="llama", **kwargs) -> Path:
        tensors, metadata = gguf_tensors(hf), gguf_metadata(config)
        if edit_tensors:
            edit_tensors(tensors)
        if edit_metadata:
            edit_metadata(metadata)
        return write_gguf(tmp_path / "model.gguf", arch, metadata, tensors, **kwargs)

    return write


def safetensors_file(hf_dir: Path) -> Path:
    (file,) = hf_dir.glob("*.safetensors")
    return file


def edit_safetensors(hf_dir: Path, edit) -> None:
    file = safetensors_file(hf_dir)
    tensors = safetensors.numpy.load_file(file)
    edit(tensors)
    safetensors.numpy.save_file(tensors, file)


# ---------------------------------------------------------------- GGUF files that load


@pytest.mark.parametrize("kind", ["llama-gqa-tied", "qwen2-bias"])
def test_gguf_logits_match_hf_dir(kind, hf_models, tmp_path):
    """Same weights, two formats: llama.cpp's Q/K permutation (llama) is undone, biases and
    an untied output.weight (qwen2) are found."""
    hf = hf_models[kind]
    config = open_checkpoint(hf).config
    path = write_gguf(
        tmp_path / "model.gguf", config.architecture, gguf_metadata(config), gguf_tensors(hf)
    )
    from_gguf, from_hf = load(path), load(hf)
    assert from_gguf.config.tie_word_embeddings == config.tie_word_embeddings
    assert from_gguf.config.attention_bias == config.attention_bias
    prompts = [[5], [17, 250, 3], [3, 99, 42, 7, 1, 200, 13, 64, 8]]
    got, want = last_logits(from_gguf, prompts), last_logits(from_hf, prompts)
    assert np.abs(want).max() > 1  # random weights give logits far from zero
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# A dequantized value is within this fraction of its tensor's largest magnitude of the original:
# half a step of 2 * amax / 255 (Q8_0), a full step of amax / 8 where clipping (Q4_0),
# half a step of 2 * amax / 15 (Q4_1), the float16 and bfloat16 roundings.
QUANT_TOLERANCE = {"Q8_0": 1 / 250, "Q4_0": 1 / 7.9, "Q4_1": 1 / 14.9, "F16": 1e-3, "BF16": 4e-3}


@pytest.mark.parametrize("kind", sorted(QUANT_TOLERANCE))
def test_quantized_gguf_dequantizes_close_to_float_weights(kind, hf_models, tmp_path):
    hf = hf_models["llama-gqa-tied"]
    config = open_checkpoint(hf).config
    qtype = QType[kind]
    tensors = gguf_tensors(hf)
    matrices = [name for name, w in tensors.items() if w.ndim == 2]
    quantized = {name: (gguf.quants.quantize(tensors.pop(name), qtype), qtype) for name in matrices}
    path = write_gguf(tmp_path / "q.gguf", "llama", gguf_metadata(config), tensors, quantized)

    checkpoint = open_checkpoint(path)
    assert checkpoint.tensors["model.layers.0.mlp.up_proj.weight"]().dtype == np.float32
    got, want = flat_params(load_model(checkpoint)), flat_params(load(hf))
    assert got.keys() == want.keys()
    for name, w in want.items():
        if name.endswith("norm"):  # vectors stay float32, as llama.cpp keeps them
            np.testing.assert_array_equal(got[name], w, err_msg=name)
            continue
        atol = QUANT_TOLERANCE[kind] * np.abs(w).max()
        np.testing.assert_allclose(got[name], w, atol=atol, rtol=0, err_msg=name)
        assert not np.array_equal(got[name], w), f"{name} was not quantized"


def k_quant_blocks(qtype: QType, rows: int, cols: int) -> np.ndarray:
    """Random K-quant blocks whose float16 super-block scales are small and finite."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block_size, type_size))
    raw = raw.astype(np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == QType.Q4_K:  # d, dmin, scales[12], qs[128]
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_tensor_loads_in_its_shape(kind, tmp_path):
    """gguf cannot quantize K-quants, so random blocks: the loader returns gguf's dequantization
    in the [rows, cols] layout (cols along the blocks)."""
    qtype = QType[kind]
    raw = k_quant_blocks(qtype, rows=3, cols=512)
    config = ModelConfig(
        "llama",
        vocab_size=3,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=128,
    )
    path = write_gguf(
        tmp_path / "k.gguf", "llama", gguf_metadata(config), {}, {"token_embd.weight": (raw, qtype)}
    )
    got = open_checkpoint(path).tensors["model.embed_tokens.weight"]()
    want = gguf.quants.dequantize(raw, qtype)
    assert got.shape == want.shape == (3, 512)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all() and np.abs(got).max() > 0


# ---------------------------------------------------------------- bad GGUF files


def test_gguf_missing_tensor(good_gguf):
    path = good_gguf(edit_tensors=lambda t: t.pop("blk.1.attn_k.weight"))
    with pytest.raises(WeightsError, match=r"model\.gguf: missing tensor 'blk\.1\.attn_k\.weight'"):
        load(path)


def test_gguf_wrong_shape(good_gguf):
    def edit(tensors):
        tensors["blk.2.ffn_up.weight"] = tensors["blk.2.ffn_up.weight"][:, :32].copy()

    path = good_gguf(edit_tensors=edit)
    with pytest.raises(
        WeightsError,
        match=r"model\.gguf: tensor 'blk\.2\.ffn_up\.weight' has shape \(96, 32\), "
        r"expected \(96, 64\)",
    ):
        load(path)


def test_gguf_wrong_shape_of_permuted_query(good_gguf):
    """Rows that cannot be split into heads are reported as a shape, not a reshape crash."""

    def edit(tensors):
        tensors["blk.0.attn_q.weight"] = tensors["blk.0.attn_q.weight"][:60].copy()

    path = good_gguf(edit_tensors=edit)
    with pytest.raises(
        WeightsError, match=r"model\.gguf: tensor 'blk\.0\.attn_q\.weight' has shape \(60, 64\)"
    ):
        load(path)


def test_gguf_unknown_architecture(good_gguf):
    path = good_gguf(arch="mamba")
    with pytest.raises(
        WeightsError, match=r"model\.gguf: unknown model architecture 'mamba'; registered: .*llama"
    ):
        open_checkpoint(path)


@pytest.mark.parametrize("kind", ["Q5_0", "IQ4_NL", "Q5_K"])
def test_gguf_unsupported_quantization_type(kind, good_gguf):
    qtype = QType[kind]
    assert kind not in GGUF_TYPES
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 64, 96  # blk.0.ffn_down.weight, [hidden, intermediate]
    cols = max(cols, block_size)  # a K-quant row is one 256-wide block: the shape check is later
    raw = np.zeros((rows, cols // block_size * type_size), np.uint8)

    def edit(tensors):
        del tensors["blk.0.ffn_down.weight"]

    path = good_gguf(edit_tensors=edit, quantized={"blk.0.ffn_down.weight": (raw, qtype)})
    with pytest.raises(
        WeightsError,
        match=rf"model\.gguf: tensor 'blk\.0\.ffn_down\.weight' has unsupported quantization "
        rf"type {kind}; supported: F32, F16",
    ):
        load(path)


@pytest.mark.parametrize(
    "contents", [b"", b"not a gguf file at all" * 10, b"GGUF" + bytes(range(200))]
)
def test_not_a_gguf_file(contents, tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(contents)
    with pytest.raises(WeightsError, match=r"garbage\.gguf: not a readable GGUF file"):
        open_checkpoint(path)


def test_truncated_gguf(good_gguf):
    path = good_gguf()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(WeightsError, match=r"model\.gguf: not a readable GGUF file"):
        load(path)


@pytest.mark.parametrize(
    "key",
    [
        "llama.block_count",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.layer_norm_rms_epsilon",
    ],
)
def test_gguf_missing_metadata_key(key, good_gguf):
    path = good_gguf(edit_metadata=lambda m: m.pop(key))
    with pytest.raises(WeightsError, match=rf"model\.gguf: missing key '{key}'"):
        open_checkpoint(path)


def test_gguf_missing_architecture_key(good_gguf):
    path = good_gguf(drop_architecture=True)
    with pytest.raises(WeightsError, match=r"model\.gguf: missing key 'general\.architecture'"):
        open_checkpoint(path)


def test_gguf_without_vocabulary_size(good_gguf):
    """Neither `llama.vocab_size` nor `tokenizer.ggml.tokens`: say so, not a shape of 0 rows."""
    path = good_gguf(edit_metadata=lambda m: m.pop("llama.vocab_size"))
    with pytest.raises(
        WeightsError,
        match=r"model\.gguf: missing key 'llama\.vocab_size' \(or 'tokenizer\.ggml\.tokens'\)",
    ):
        open_checkpoint(path)


def test_gguf_metadata_of_wrong_type(good_gguf):
    def edit(metadata):
        metadata["llama.block_count"] = 2.5  # written as float32, not an integer

    path = good_gguf(edit_metadata=edit)
    with pytest.raises(WeightsError, match=r"model\.gguf: key 'llama\.block_count' is 2\.5"):
        open_checkpoint(path)


def test_gguf_inconsistent_head_counts(good_gguf):
    path = good_gguf(edit_metadata=lambda m: m.update({"llama.attention.head_count_kv": 3}))
    with pytest.raises(
        WeightsError, match=r"model\.gguf: num_heads \(8\) must be a multiple of num_kv_heads \(3\)"
    ):
        open_checkpoint(path)


# ---------------------------------------------------------------- bad Hugging Face directories


def write_config(hf_dir: Path, edit) -> None:
    file = hf_dir / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def test_hf_dir_loads_and_bf16_loads_too(hf_dir):
    want = flat_params(load(hf_dir))
    file = safetensors_file(hf_dir)
    bf16 = {
        k: torch.from_numpy(v).to(torch.bfloat16)
        for k, v in safetensors.numpy.load_file(file).items()
    }
    safetensors.torch.save_file(bf16, file)
    got = flat_params(load(hf_dir))
    for name, w in want.items():
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], w, rtol=2**-8, atol=0, err_msg=name)


def test_hf_missing_config(hf_dir):
    (hf_dir / "config.json").unlink()
    with pytest.raises(WeightsError, match=r"model: no config\.json"):
        open_checkpoint(hf_dir)


def test_hf_invalid_json(hf_dir):
    (hf_dir / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(WeightsError, match=r"model/config\.json: invalid JSON"):
        open_checkpoint(hf_dir)


def test_hf_config_not_an_object(hf_dir):
    (hf_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(WeightsError, match=r"model/config\.json: expected a JSON object"):
        open_checkpoint(hf_dir)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size", "model_type"])
def test_hf_config_missing_key(key, hf_dir):
    write_config(hf_dir, lambda c: c.pop(key))
    with pytest.raises(WeightsError, match=rf"model/config\.json: missing key '{key}'"):
        open_checkpoint(hf_dir)


def test_hf_config_inconsistent_head_counts(hf_dir):
    write_config(hf_dir, lambda c: c.update(num_key_value_heads=3))
    with pytest.raises(
        WeightsError,
        match=r"model/config\.json: num_heads \(8\) must be a multiple of num_kv_heads \(3\)",
    ):
        open_checkpoint(hf_dir)


def test_hf_config_wrong_type(hf_dir):
    write_config(hf_dir, lambda c: c.update(num_hidden_layers="three"))
    with pytest.raises(
        WeightsError, match=r"model/config\.json: key 'num_hidden_layers' is 'three'"
    ):
        open_checkpoint(hf_dir)


def test_hf_unknown_model_type(hf_dir):
    write_config(hf_dir, lambda c: c.update(model_type="mamba"))
    with pytest.raises(
        WeightsError,
        match=r"model/config\.json: unknown model architecture 'mamba'; registered: .*llama",
    ):
        load(hf_dir)


def test_hf_unsupported_rope_scaling(hf_dir):
    write_config(hf_dir, lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(
        WeightsError, match=r"model/config\.json: unsupported rope_scaling type 'yarn'"
    ):
        open_checkpoint(hf_dir)


def test_hf_no_safetensors(hf_dir):
    safetensors_file(hf_dir).unlink()
    with pytest.raises(WeightsError, match=r"model: no \*\.safetensors files"):
        open_checkpoint(hf_dir)


def test_hf_missing_tensor(hf_dir):
    edit_safetensors(hf_dir, lambda t: t.pop("model.layers.2.mlp.down_proj.weight"))
    with pytest.raises(
        WeightsError,
        match=r"model: missing tensor 'model\.layers\.2\.mlp\.down_proj\.weight' "
        r"\(for layers/down_proj\)",
    ):
        load(hf_dir)


def test_hf_wrong_shape(hf_dir):
    def edit(tensors):
        tensors["model.norm.weight"] = np.ones(63, np.float32)

    edit_safetensors(hf_dir, edit)
    with pytest.raises(
        WeightsError,
        match=r"model: tensor 'model\.norm\.weight' has shape \(63,\), expected \(64,\)",
    ):
        load(hf_dir)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_hf_corrupt_safetensors(damage, hf_dir):
    file = safetensors_file(hf_dir)
    data = file.read_bytes()
    file.write_bytes(
        {"garbage": b"\x07" * 100, "truncated": data[: len(data) // 2], "empty": b""}[damage]
    )
    with pytest.raises(WeightsError, match=rf"{file.name}: unreadable safetensors file"):
        load(hf_dir)


def test_hf_unsupported_tensor_dtype(hf_dir):
    """A tensor numpy cannot represent (an 8-bit float) is named, not a numpy TypeError."""
    file = safetensors_file(hf_dir)
    tensors = {k: torch.from_numpy(v) for k, v in safetensors.numpy.load_file(file).items()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    safetensors.torch.save_file(tensors, file)
    with pytest.raises(
        WeightsError, match=r"tensor 'model\.norm\.weight' has unsupported dtype F8_E4M3"
    ):
        load(hf_dir)


def test_path_does_not_exist(tmp_path):
    with pytest.raises(WeightsError, match=r"nowhere: no such file or directory"):
        open_checkpoint(tmp_path / "nowhere")
    with pytest.raises(WeightsError, match=r"nowhere\.gguf: no such file or directory"):
        open_checkpoint(tmp_path / "nowhere.gguf")


def test_neither_gguf_nor_directory(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 8)
    with pytest.raises(WeightsError, match=r"model\.bin: expected a \.gguf file"):
        open_checkpoint(path)
