"""What a model must provide to be served, and the registry that finds it by architecture.

A served model is a Flax NNX module built from a `ModelConfig`. It is called on a
flat, ragged batch of tokens (several sequences' prefill chunks and decode tokens
side by side) and knows nothing of requests or scheduling:

    logits, kv_cache = model(token_ids, positions, kv_cache, metadata)

A research team serves its own model by writing such a module and calling
`register_model` with its architecture name (the `model_type` of its config.json,
or `general.architecture` of a GGUF file) and a weight map from checkpoint tensor
names to the module's parameters.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.checkpoint import model_config
from jaxserve.config import ModelConfig
from jaxserve.device.attention import AttentionMetadata
from jaxserve.device.kv_cache import KVCache


class ServableModel(Protocol):
    """The call every served model implements."""

    config: ModelConfig

    def __call__(
        self,
        token_ids: jax.Array,  # i32[num_tokens]
        positions: jax.Array,  # i32[num_tokens] position of each token in its sequence
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # f32[num_logits, vocab_size], updated cache
        ...


@dataclass(frozen=True, slots=True)
class WeightRule:
    """Where one parameter comes from in a Hugging Face style checkpoint, and how it is
    laid out over a device mesh.

    `source` names the tensor; a `{layer}` in it marks a per-layer tensor that is
    stacked over layers on a new leading axis (for `jax.lax.scan`). `transpose`
    turns torch's Linear layout [out, in] into the [in, out] kernels used here.
    `axes` gives each dimension of the parameter a logical axis name, which
    `sharding.RULES` maps onto the mesh ("vocab", "heads", "kv_heads", "mlp" split
    over tensor parallelism; None or any other name: replicated). Every parameter
    needs them: a parameter the rules forgot is an error at load, not a silent copy
    on every device. `projection` marks a weight that the model multiplies through
    `layers.linear`: the one kind `--weight-dtype` stores otherwise (quantized, or in
    another float dtype); embeddings, norms and biases stay in the serving dtype.
    """

    source: str
    transpose: bool = False
    axes: tuple[str | None, ...] | None = None
    projection: bool = False


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything that is particular to one architecture: how to read its shape from a
    checkpoint, how to build it, where each parameter's tensor is and how it is sharded.
    The loader, the sharding rules and the runner ask the spec and know no architecture."""

    build: Callable[[ModelConfig, nnx.Rngs, jnp.dtype], nnx.Module]  # (config, rngs, dtype)
    # parameter path ("layers/q_proj") -> its tensor and sharding axes, for a given config
    weight_map: Callable[[ModelConfig], dict[str, WeightRule]]
    # config.json (a dict, and its path for messages) -> ModelConfig
    config_from_hf: Callable[[dict, str], ModelConfig] = model_config.config_from_hf
    # GGUF metadata, tensor names, vocabulary size, path -> ModelConfig
    config_from_gguf: Callable[[Mapping[str, Any], set[str], int, str], ModelConfig] = (
        model_config.config_from_gguf
    )
    # GGUF tensor name -> Hugging Face name, "{layer}" standing for each layer's index;
    # empty: the architecture is not read from GGUF files
    gguf_names: Mapping[str, str] = field(default_factory=dict)
    gguf_qk_permuted: bool = False  # llama.cpp permuted Q/K rows for its RoPE layout


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(architecture: str, spec: ModelSpec) -> None:
    """Make `architecture` (a config.json `model_type` or GGUF architecture) servable."""
    _REGISTRY[architecture] = spec


def param_axes(config: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """Each parameter's logical axes, from its architecture's weight map."""
    rules = get_model_spec(config.architecture).weight_map(config)
    missing = sorted(name for name, rule in rules.items() if rule.axes is None)
    if missing:
        raise ValueError(
            f"the {config.architecture!r} weight map gives no sharding axes for {missing}: "
            "set WeightRule.axes (a logical name or None per dimension)"
        )
    return {name: rule.axes for name, rule in rules.items()}


def get_model_spec(architecture: str) -> ModelSpec:
    """The registered spec, or a ValueError that lists what is known."""
    try:
        return _REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(
            f"unknown model architecture {architecture!r}; registered: {known}"
        ) from None
