"""Load Hugging Face safetensors directories and GGUF files into model parameters.

Both formats are read as Hugging Face tensor names ([out, in] layout), so one
weight map per architecture serves both. GGUF tensors are dequantized with the
`gguf` package and llama.cpp's Q/K row permutation is undone. Every failure is a
`WeightsError` that names the file and the tensor or key at fault.
"""

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.models import ModelSpec, WeightRule, get_model_spec


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the culprit."""


# GGUF quantization types dequantized here (the ones real Llama-family files use).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class Checkpoint:
    """A model's config and lazy loaders of its tensors, keyed by Hugging Face name."""

    path: Path
    config: ModelConfig
    tensors: Mapping[str, Callable[[], np.ndarray]]


# ---------------------------------------------------------------- Hugging Face


def config_from_hf(raw: dict, source: str = "config.json") -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict."""
    try:
        model_type = raw["model_type"]
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        # transformers 5 writes `rope_parameters` (theta inside); older files `rope_scaling`
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = None
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "llama3":
            rope_scaling = RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
            )
        elif kind != "default":
            raise WeightsError(f"{source}: unsupported rope_scaling type {kind!r}")
        eos = raw.get("eos_token_id")
        return ModelConfig(
            architecture=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
    except KeyError as e:
        raise WeightsError(f"{source}: missing key {e.args[0]!r}") from None


def open_hf_dir(path: Path) -> Checkpoint:
    """A Hugging Face directory: config.json and one or many *.safetensors files."""
    from safetensors import safe_open

    config_file = path / "config.json"
    if not config_file.exists():
        raise WeightsError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        config = config_from_hf(json.loads(config_file.read_text()), str(config_file))
    except json.JSONDecodeError as e:
        raise WeightsError(f"{config_file}: invalid JSON ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                names = list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise WeightsError(f"{file}: unreadable safetensors file ({e})") from None
        for name in names:
            loaders[name] = _safetensors_loader(file, name)
    return Checkpoint(path, config, loaders)


def _safetensors_loader(file: Path, name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from safetensors import safe_open

        with safe_open(file, framework="numpy") as f:
            return f.get_tensor(name)

    return load


# ---------------------------------------------------------------- GGUF


def config_from_gguf(
    fields: Mapping[str, object], tensor_names: set[str], vocab_size: int, source: str
) -> ModelConfig:
    """A ModelConfig from GGUF metadata (`{arch}.block_count` and friends)."""
    arch = fields.get("general.architecture")
    if arch is None:
        raise WeightsError(f"{source}: missing key 'general.architecture'")
    get_model_spec_or_raise(str(arch), source)

    def key(name: str, default: object = None) -> object:
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise WeightsError(f"{source}: missing key '{arch}.{name}'")
        return value

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=str(arch),
        vocab_size=int(fields.get(f"{arch}.vocab_size") or vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def get_model_spec_or_raise(arch: str, source: str) -> ModelSpec:
    try:
        return get_model_spec(arch)
    except ValueError as e:
        raise WeightsError(f"{source}: {e}") from None


_GGUF_VOCAB_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


def gguf_fields(reader) -> dict[str, object]:
    """GGUF metadata as plain Python values, without the (large) vocabulary arrays."""
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if name not in _GGUF_VOCAB_FIELDS
    }


def open_gguf(path: Path) -> Checkpoint:
    """A GGUF file: metadata → config; tensors dequantized on demand, renamed to HF names."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors on bad files
        raise WeightsError(f"{path}: not a readable GGUF file ({e})") from None
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else 0
    config = config_from_gguf(gguf_fields(reader), tensor_names, vocab_size, str(path))
    if "rope_freqs.weight" in tensor_names:
        raise WeightsError(
            f"{path}: tensor 'rope_freqs.weight' (Llama-3 RoPE frequency factors) is not "
            "supported from GGUF; load the Hugging Face safetensors directory instead"
        )
    permute = config.architecture == "llama"  # llama.cpp permutes Q/K for llama only
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    for tensor in reader.tensors:
        hf_name = _gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        heads = None
        if permute and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif permute and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        loaders[hf_name] = _gguf_loader(path, tensor, heads)
    return Checkpoint(path, config, loaders)


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def _gguf_loader(path: Path, tensor, heads: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from gguf import quants

        kind = tensor.tensor_type.name
        if kind not in GGUF_TYPES:
            raise WeightsError(
                f"{path}: tensor {tensor.name!r} has unsupported quantization type {kind}; "
                f"supported: {', '.join(GGUF_TYPES)}"
            )
        array = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        expected = tuple(int(n) for n in reversed(tensor.shape))
        array = array.reshape(expected)
        return _unpermute_rows(array, heads) if heads else array

    return load


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of RoPE halves in Q/K rows (weights or biases)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- parameters


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a GGUF file or a Hugging Face directory, by what the path is."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return open_gguf(path)
    if path.is_dir():
        return open_hf_dir(path)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or directory")
    raise WeightsError(f"{path}: expected a .gguf file or a Hugging Face model directory")


def load_model(checkpoint: Checkpoint, dtype: jnp.dtype = jnp.float32) -> nnx.Module:
    """Build the registered architecture and fill every parameter from the checkpoint."""
    config = checkpoint.config
    spec = get_model_spec_or_raise(config.architecture, str(checkpoint.path))
    abstract = nnx.eval_shape(lambda: spec.build(config, nnx.Rngs(0), dtype))
    graphdef, state = nnx.split(abstract)
    rules = spec.weight_map(config)
    flat = []
    for path, variable in nnx.to_flat_state(state):
        name = "/".join(str(p) for p in path)
        if name not in rules:
            raise WeightsError(f"{checkpoint.path}: weight map has no rule for parameter {name!r}")
        target = variable.get_value()
        array = _assemble(checkpoint, rules[name], config.num_layers, target.shape, name)
        flat.append((path, variable.replace(jnp.asarray(array, dtype=target.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _assemble(
    checkpoint: Checkpoint, rule: WeightRule, num_layers: int, shape: tuple, param: str
) -> np.ndarray:
    """One parameter: a tensor, or per-layer tensors stacked, transposed as the rule says."""
    stacked = "{layer}" in rule.source
    names = [rule.source.format(layer=i) for i in range(num_layers)] if stacked else [rule.source]
    want = tuple(shape[1:]) if stacked else tuple(shape)
    if rule.transpose:
        want = want[::-1]  # as stored in the checkpoint
    arrays = []
    for name in names:
        if name not in checkpoint.tensors:
            raise WeightsError(f"{checkpoint.path}: missing tensor {name!r} (for {param})")
        array = checkpoint.tensors[name]()
        if tuple(array.shape) != want:
            raise WeightsError(
                f"{checkpoint.path}: tensor {name!r} has shape {tuple(array.shape)}, "
                f"expected {want} (for {param})"
            )
        arrays.append(array.T if rule.transpose else array)
    return np.stack(arrays) if stacked else arrays[0]
