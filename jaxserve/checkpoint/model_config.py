"""A model's shape from its checkpoint's metadata: config.json or GGUF keys (no jax).

These parsers read the Llama family's keys (llama, mistral, qwen2, and any architecture
with the same config.json vocabulary); an architecture registers its own in its
`ModelSpec` when its keys differ. The planner reads config.json files with them too.
Every failure is a `WeightsError` naming the file and the key at fault.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxserve.config import ModelConfig, RopeScaling


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the culprit."""


def read_hf_config(path: Path) -> dict:
    """A config.json file's object (WeightsError if it is not JSON or not an object)."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise WeightsError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def hf_architecture(raw: Mapping[str, Any], source: str) -> str:
    """config.json's `model_type`, the key an architecture is registered by."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise WeightsError(f"{source}: missing key 'model_type'")
    return _typed(model_type, str, "model_type", source)


def gguf_architecture(fields: Mapping[str, object], source: str) -> str:
    """GGUF's `general.architecture`, the key an architecture is registered by."""
    arch = fields.get("general.architecture")
    if arch is None:
        raise WeightsError(f"{source}: missing key 'general.architecture'")
    return str(arch)


def config_from_hf(raw: dict, source: str = "config.json") -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict."""

    def key(name: str, kind: type = int, default: Any = None) -> Any:
        value = raw.get(name)
        if value is None and default is None:
            raise WeightsError(f"{source}: missing key {name!r}")
        return default if value is None else _typed(value, kind, name, source)

    try:
        model_type = key("model_type", str)
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


def config_from_gguf(
    fields: Mapping[str, object], tensor_names: set[str], vocab_size: int, source: str
) -> ModelConfig:
    """A ModelConfig from GGUF metadata (`{arch}.block_count` and friends)."""
    arch = gguf_architecture(fields, source)

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
