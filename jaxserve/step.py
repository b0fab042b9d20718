"""The jitted device computations: a forward pass over a flat batch, and forward + sample.

Model weights enter as an NNX (graphdef, state) pair split once, so each call is a
plain `jax.jit` of a pure function. The KV cache and the penalty state are donated
and updated in place. The step's results leave the device as one array.

`score` is the forward pass of one prompt chunk with logits at every token, for
prompt logprobs. `step`, `score` and `forward` run on one device; the `sharded_` ones jit
the same functions for a mesh, with the shardings of a `sharding.Layout`: weights
and KV as its rules say; the step's inputs and penalty state split over the data
shards (each shard runs its own batch); results replicated, so every process of a
multi-host mesh reads the same tokens. `sharded_forward` (tests and benchmarks)
runs one replicated batch over the whole pool.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.attention import AttentionMetadata
from jaxserve.config import MAX_LOGPROBS
from jaxserve.kv_cache import KVCache
from jaxserve.sampling import (
    PenaltyState,
    SamplingTensors,
    apply_penalties,
    record_output,
    record_prompt,
    sample,
    token_logprobs,
)
from jaxserve.sharding import DATA, Layout


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepInputs:
    """Everything one step needs from the host, in one pytree."""

    token_ids: jax.Array  # i32[num_tokens]
    positions: jax.Array  # i32[num_tokens]
    metadata: AttentionMetadata
    sampling: SamplingTensors  # rows = metadata.logits_indices


def _forward(
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


def _step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    penalties: PenaltyState,
    inputs: StepInputs,
) -> tuple[jax.Array, KVCache, PenaltyState]:
    """One forward pass; sample the next token of every row and score it.

    Returns f32[num_seqs, RESULT_WIDTH] results (laid out as `StepResults` reads
    them), the cache and the penalty state.
    """
    logits, kv_cache = _forward(
        graphdef, state, kv_cache, inputs.token_ids, inputs.positions, inputs.metadata
    )
    params = inputs.sampling
    penalties = record_prompt(penalties, params, inputs.token_ids)
    tokens = sample(apply_penalties(logits, penalties, params), params)
    penalties = record_output(penalties, params, tokens)
    return _results(logits, tokens, params.logprobs), kv_cache, penalties


def _score(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    token_ids: jax.Array,  # i32[num_tokens]
    positions: jax.Array,  # i32[num_tokens]
    metadata: AttentionMetadata,  # logits_indices: every token
    targets: jax.Array,  # i32[num_tokens] the token that follows each one
) -> tuple[jax.Array, KVCache]:
    """Prompt logprobs: each target's log-probability after the tokens before it.

    Returns f32[num_tokens, RESULT_WIDTH] (the `StepResults` layout, targets as the
    tokens) and the cache, its K/V written as the step writes them.
    """
    logits, kv_cache = _forward(graphdef, state, kv_cache, token_ids, positions, metadata)
    return _results(logits, targets, jnp.full(targets.shape, MAX_LOGPROBS)), kv_cache


def _results(logits: jax.Array, tokens: jax.Array, logprobs: jax.Array) -> jax.Array:
    """One f32 array per row: token, its logprob, the top ids and their logprobs.

    `logprobs` (i32[rows]) is how many alternatives each row asks for, -1 for none.
    The logprobs (a softmax per row) are computed only when some row asks, the top
    alternatives (a top-k over the vocabulary) only when some row wants any; else zeros.
    """
    num_rows = tokens.shape[0]

    def skip(logits, tokens, alternatives):
        zeros = jnp.zeros((num_rows, MAX_LOGPROBS))
        return jnp.zeros(num_rows), zeros.astype(jnp.int32), zeros

    chosen, top_ids, top_logprobs = jax.lax.cond(
        jnp.any(logprobs >= 0), token_logprobs, skip, logits, tokens, jnp.any(logprobs > 0)
    )
    # ids < 2**24 are exact in f32, so one array carries everything back
    return jnp.concatenate(
        [tokens[:, None].astype(jnp.float32), chosen[:, None], top_ids.astype(jnp.float32),
         top_logprobs],
        axis=1,
    )


forward = jax.jit(_forward, static_argnums=0, donate_argnums=2)
step = jax.jit(_step, static_argnums=0, donate_argnums=(2, 3))
score = jax.jit(_score, static_argnums=0, donate_argnums=2)


def sharded_forward(layout: Layout) -> Callable:
    """`forward` jitted for `layout`'s mesh: the same arguments, logits replicated."""
    r = layout.replicated
    return jax.jit(
        _forward,
        static_argnums=0,
        donate_argnums=2,
        in_shardings=(layout.state, layout.kv_cache, r, r, r),
        out_shardings=(r, layout.kv_cache),
    )


def sharded_score(layout: Layout) -> Callable:
    """`score` jitted for `layout`'s mesh, each data shard on its own rows (see `sharded_step`)."""
    return jax.jit(
        _per_data_shard(_score, layout, num_sharded_inputs=4, outputs=(_DATA, _KV)),
        static_argnums=0,
        donate_argnums=2,
        in_shardings=(layout.state, layout.kv_cache, *[layout.data] * 4),
        out_shardings=(layout.replicated, layout.kv_cache),
    )


def sharded_step(layout: Layout) -> Callable:
    """`step` jitted for `layout`'s mesh.

    The inputs are the data shards' packed batches end to end and the penalty
    state the shards' rows end to end (both sharded over "data"); under
    `shard_map` each shard runs `_step` on its own batch, pages and penalty rows,
    with page ids local to its pool. Results come back replicated, shard after shard.
    """
    return jax.jit(
        _per_data_shard(_step, layout, num_sharded_inputs=2, outputs=(_DATA, _KV, _DATA)),
        static_argnums=0,
        donate_argnums=(2, 3),
        in_shardings=(layout.state, layout.kv_cache, layout.data, layout.data),
        out_shardings=(layout.replicated, layout.kv_cache, layout.data),
    )


_DATA = PartitionSpec(DATA)  # axis 0 split over the data shards
_KV = PartitionSpec(None, None, DATA)  # [layer, kv_head, page, ...]: pages per shard


def _per_data_shard(
    fn: Callable, layout: Layout, num_sharded_inputs: int, outputs: tuple
) -> Callable:
    """fn(graphdef, state, kv_cache, *inputs) run by each data shard on its own part.

    Manual over "data" only: the weights' "model" sharding stays with the compiler.
    """

    def run(graphdef, state, kv_cache, *inputs):
        local = jax.shard_map(
            functools.partial(fn, graphdef),
            mesh=layout.mesh,
            in_specs=(PartitionSpec(), _KV, *[_DATA] * num_sharded_inputs),
            out_specs=outputs,
            axis_names={DATA},
            check_vma=False,
        )
        return local(state, kv_cache, *inputs)

    return run
