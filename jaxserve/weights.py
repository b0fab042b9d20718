"""Load Hugging Face safetensors directories and GGUF files into model parameters.

Both formats are read as Hugging Face tensor names ([out, in] layout), so one
weight map per architecture serves both. GGUF tensors are dequantized with the
`gguf` package and llama.cpp's Q/K row permutation is undone. Every failure is a
`WeightsError` that names the file and the tensor or key at fault.
"""

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.models import ModelSpec, WeightRule, get_model_spec, param_axes
from jaxserve.sharding import param_sharding


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the culprit."""


# GGUF quantization types dequantized here (the ones real Llama-family files use).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# safetensors dtypes read here; numpy knows BF16 through ml_dtypes, which jax registers
SAFETENSORS_DTYPES = ("F64", "F32", "F16", "BF16")

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
    # the file's own tensor names where they differ (GGUF), so messages name what the file has
    file_names: Mapping[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- Hugging Face


def config_from_hf(raw: dict, source: str = "config.json") -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict."""

    def key(name: str, kind: type = int, default: Any = None) -> Any:
        value = raw.get(name)
        if value is None and default is None:
            raise WeightsError(f"{source}: missing key {name!r}")
        return default if value is None else _typed(value, kind, name, source)

    try:
        model_type = key("model_type", str)
        get_model_spec_or_raise(model_type, source)
        num_heads = key("num_attention_heads")
        hidden = key("hidden_size")
        # transformers 5 writes `rope_parameters` (theta inside); older files `rope_scaling`
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = key("rope_theta", float, rope.get("rope_theta", 10000.0))
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
        return _model_config(
            source,
            architecture=model_type,
            vocab_size=key("vocab_size"),
            hidden_size=hidden,
            intermediate_size=key("intermediate_size"),
            num_layers=key("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=key("num_key_value_heads", int, num_heads),
            head_dim=key("head_dim", int, hidden // num_heads),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=key("rms_norm_eps", float, 1e-6),
            max_position_embeddings=key("max_position_embeddings", int, 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
    except KeyError as e:  # inside rope_scaling
        raise WeightsError(f"{source}: missing key {e.args[0]!r}") from None


def _typed(value: object, kind: type, key: str, source: str) -> Any:
    """`value` as `kind`, or a WeightsError naming the key; a value that `kind` would change
    (2.5 as int, "64" as int) is refused rather than silently converted."""
    try:
        converted = kind(value)
    except (TypeError, ValueError):
        converted = None
    if converted is None or converted != value:
        raise WeightsError(f"{source}: key {key!r} is {value!r}, expected {kind.__name__}")
    return converted


def _model_config(source: str, **fields: Any) -> ModelConfig:
    """ModelConfig(**fields), its own checks (head counts) reported against `source`."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise WeightsError(f"{source}: {e}") from None


def open_hf_dir(path: Path) -> Checkpoint:
    """A Hugging Face directory: config.json and one or many *.safetensors files."""
    from safetensors import safe_open

    config_file = path / "config.json"
    if not config_file.exists():
        raise WeightsError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{config_file}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise WeightsError(f"{config_file}: expected a JSON object, got {type(raw).__name__}")
    config = config_from_hf(raw, str(config_file))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                names = list(f.keys())
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
            raise WeightsError(f"{file}: unreadable safetensors file ({e})") from None
        for name in names:
            loaders[name] = _safetensors_loader(file, name)
    return Checkpoint(path, config, loaders)


def _safetensors_loader(file: Path, name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from safetensors import safe_open

        with safe_open(file, framework="numpy") as f:
            dtype = f.get_slice(name).get_dtype()
            if dtype not in SAFETENSORS_DTYPES:
                raise WeightsError(
                    f"{file}: tensor {name!r} has unsupported dtype {dtype}; "
                    f"supported: {', '.join(SAFETENSORS_DTYPES)}"
                )
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

    def key(name: str, kind: type = int, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise WeightsError(f"{source}: missing key '{arch}.{name}'")
        return _typed(value, kind, f"{arch}.{name}", source)

    num_heads = key("attention.head_count")
    hidden = key("embedding_length")
    if not vocab_size and f"{arch}.vocab_size" not in fields:
        raise WeightsError(
            f"{source}: missing key '{arch}.vocab_size' (or 'tokenizer.ggml.tokens')"
        )
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return _model_config(
        source,
        architecture=str(arch),
        vocab_size=key("vocab_size", int, vocab_size),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", int, num_heads),
        head_dim=key("attention.key_length", int, hidden // num_heads),
        rope_theta=key("rope.freq_base", float, 10000.0),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", float),
        max_position_embeddings=key("context_length", int, 2048),
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
    except Exception as e:  # noqa: BLE001 (gguf raises ValueError, struct.error, ...)
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
    file_names = {hf: name for name, hf in _GGUF_GLOBAL_NAMES.items()}
    for i in range(config.num_layers):
        for name, hf in _GGUF_LAYER_NAMES.items():
            file_names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{name}"
    return Checkpoint(path, config, loaders, file_names)


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
        if heads and array.shape[0] % (2 * heads) == 0:  # else the caller reports the shape
            array = _unpermute_rows(array, heads)
        return array

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


def load_model(
    checkpoint: Checkpoint, dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None
) -> nnx.Module:
    """Build the registered architecture and fill every parameter from the checkpoint.

    With a `mesh`, each parameter is assembled on the host and each device receives
    only its own shard (as `sharding.param_sharding` lays it out): no device ever
    holds a whole copy of a sharded parameter.
    """
    config = checkpoint.config
    spec = get_model_spec_or_raise(config.architecture, str(checkpoint.path))
    abstract = nnx.eval_shape(lambda: spec.build(config, nnx.Rngs(0), dtype))
    graphdef, state = nnx.split(abstract)
    rules = spec.weight_map(config)
    try:
        axes = param_axes(config)  # every parameter's sharding, checked before any loads
    except ValueError as e:
        raise WeightsError(f"{checkpoint.path}: {e}") from None
    flat = []
    for path, variable in nnx.to_flat_state(state):
        name = "/".join(str(p) for p in path)
        if name not in rules:
            raise WeightsError(f"{checkpoint.path}: weight map has no rule for parameter {name!r}")
        target = variable.get_value()
        array = _assemble(checkpoint, rules[name], config.num_layers, target.shape, name)
        if mesh is None:
            value = jnp.asarray(array, dtype=target.dtype)
        else:
            value = _place(np.asarray(array, dtype=target.dtype), mesh, axes[name])
        flat.append((path, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _place(array: np.ndarray, mesh: Mesh, axes: tuple[str | None, ...]) -> jax.Array:
    """A host array as a global array sharded by its logical `axes`; each device gets its
    slice (in a multi-process mesh, this process's devices only)."""
    sharding = param_sharding(mesh, axes, array.shape)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


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
        label = checkpoint.file_names.get(name, name)
        if name not in checkpoint.tensors:
            raise WeightsError(f"{checkpoint.path}: missing tensor {label!r} (for {param})")
        array = checkpoint.tensors[name]()
        if tuple(array.shape) != want:
            raise WeightsError(
                f"{checkpoint.path}: tensor {label!r} has shape {tuple(array.shape)}, "
                f"expected {want} (for {param})"
            )
        arrays.append(array.T if rule.transpose else array)
    return np.stack(arrays) if stacked else arrays[0]
