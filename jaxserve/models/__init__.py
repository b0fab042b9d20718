"""Model definitions; importing this package registers the built-in architectures."""

from jaxserve.device.attention import AttentionMetadata
from jaxserve.models import llama  # noqa: F401  (registers llama, mistral, qwen2)
from jaxserve.models.interface import (
    ModelSpec,
    WeightRule,
    get_model_spec,
    param_axes,
    register_model,
)

__all__ = [
    "AttentionMetadata", "ModelSpec", "WeightRule", "get_model_spec", "param_axes",
    "register_model",
]
