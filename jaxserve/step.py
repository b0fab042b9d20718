"""The jitted device computations: a forward pass over a flat batch, and forward + sample.

Model weights enter as an NNX (graphdef, state) pair split once, so each call is a
plain `jax.jit` of a pure function. The KV cache is donated and updated in place.
"""

from dataclasses import dataclass
from functools import partial

import jax
from flax import nnx

from jaxserve.attention import AttentionMetadata
from jaxserve.kv_cache import KVCache
from jaxserve.sampling import SamplingTensors, sample


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepInputs:
    """Everything one step needs from the host, in one pytree."""

    token_ids: jax.Array  # i32[num_tokens]
    positions: jax.Array  # i32[num_tokens]
    metadata: AttentionMetadata
    sampling: SamplingTensors  # rows = metadata.logits_indices


@partial(jax.jit, static_argnums=0, donate_argnums=2)
def forward(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    token_ids: jax.Array,  # i32[num_tokens]
    positions: jax.Array,  # i32[num_tokens]
    metadata: AttentionMetadata,
) -> tuple[jax.Array, KVCache]:  # f32[num_logits, vocab], cache
    """Logits at `metadata.logits_indices`, writing every token's K/V into the cache."""
    model = nnx.merge(graphdef, state)
    return model(token_ids, positions, kv_cache, metadata)


@partial(jax.jit, static_argnums=0, donate_argnums=2)
def step(
    graphdef: nnx.GraphDef, state: nnx.State, kv_cache: KVCache, inputs: StepInputs
) -> tuple[jax.Array, KVCache]:  # i32[num_logits] next tokens, cache
    """One forward pass and the next token of every row that asked for logits."""
    model = nnx.merge(graphdef, state)
    logits, kv_cache = model(inputs.token_ids, inputs.positions, kv_cache, inputs.metadata)
    return sample(logits, inputs.sampling), kv_cache
