"""jaxserve: an LLM serving engine on JAX/XLA.

`LLM` and `CompletionOutput` load lazily, so that jax-free parts (the planner,
the scheduler, the CLI's argument parsing) start without importing jax.
"""

from jaxserve.config import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "CompletionOutput"):
        from jaxserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
