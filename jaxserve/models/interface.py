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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.attention import AttentionMetadata
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache


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
    """Where one parameter comes from in a Hugging Face style checkpoint.

    `source` names the tensor; a `{layer}` in it marks a per-layer tensor that is
    stacked over layers on a new leading axis (for `jax.lax.scan`). `transpose`
    turns torch's Linear layout [out, in] into the [in, out] kernels used here.
    """

    source: str
    transpose: bool = False


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How to build one architecture and where its weights come from."""

    build: Callable[[ModelConfig, nnx.Rngs, jnp.dtype], nnx.Module]  # (config, rngs, dtype)
    # parameter path ("layers/q_proj") -> rule, for a given config
    weight_map: Callable[[ModelConfig], dict[str, WeightRule]]


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(architecture: str, spec: ModelSpec) -> None:
    """Make `architecture` (a config.json `model_type` or GGUF architecture) servable."""
    _REGISTRY[architecture] = spec


def get_model_spec(architecture: str) -> ModelSpec:
    """The registered spec, or a ValueError that lists what is known."""
    try:
        return _REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(
            f"unknown model architecture {architecture!r}; registered: {known}"
        ) from None
