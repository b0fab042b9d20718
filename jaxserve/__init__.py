"""jaxserve: an LLM serving engine on JAX/XLA."""

from jaxserve.config import SamplingParams
from jaxserve.llm import LLM, CompletionOutput

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
