"""The jitted device computations: a forward pass over a flat batch, and forward + sample.

Model weights enter as an NNX (graphdef, state) pair split once, so each call is a
plain `jax.jit` of a pure function. The KV cache and the row state (penalty records,
last tokens) are donated and updated in place. The step's results leave the device as
one array. A step may be planned before the host has the previous step's tokens (async
scheduling): a decode row then carries a placeholder, which the step replaces with the
token its previous step sampled for that row, still on the device.

`_score` is the forward pass of one prompt chunk with logits at every token, for
prompt logprobs. `jit_step` and `jit_score` compile `_step` and `_score` for one model, on one
device or, given a `sharding.Layout`, for its mesh: weights and KV as its rules
say; the step's inputs and row state split over the data shards (each shard
runs its own batch); results replicated, so every process of a multi-host mesh
reads the same tokens. `forward` and `sharded_forward` (tests and benchmarks)
run one batch, the latter replicated over the whole pool.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.config import MAX_LOGPROBS
from jaxserve.device.adapters import AdapterBatch, AdapterSlots
from jaxserve.device.attention import AttentionMetadata
from jaxserve.device.kv_cache import KVCache
from jaxserve.device.sampling import (
    RowState,
    SamplingTensors,
    any_logit_bias,
    any_penalty,
    apply_logit_bias,
    apply_penalties,
    record_last,
    record_output,
    record_prompt,
    resolve_pending,
    sample,
    sample_from,
    token_logprobs,
)
from jaxserve.device.sharding import DATA, Layout, on_any_shard


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepInputs:
    """Everything one step needs from the host, in one pytree."""

    token_ids: jax.Array  # i32[num_tokens]
    positions: jax.Array  # i32[num_tokens]
    metadata: AttentionMetadata
    sampling: SamplingTensors  # rows = metadata.logits_indices
    adapters: jax.Array  # i32[num_tokens]: each token's adapter slot, 0 for none
    # after the rows' logits, a logit at each draft token (speculative decoding): the row
    # whose draft it is, and the counter of the token drawn there (the row's plus the
    # draft's place in it), so that token is drawn as decoding one at a time draws it
    draft_rows: jax.Array  # i32[num_draft_logits]; padding 0
    draft_counters: jax.Array  # i32[num_draft_logits]


def _forward(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    token_ids: jax.Array,  # i32[num_tokens]
    positions: jax.Array,  # i32[num_tokens]
    metadata: AttentionMetadata,
    adapters: AdapterBatch | None = None,
) -> tuple[jax.Array, KVCache]:  # f32[num_logits, vocab], cache
    """Logits at `metadata.logits_indices`, writing every token's K/V into the cache.
    A model is given `adapters` only when LoRA adapters are served.

    Its dots are traced at HIGHEST precision: XLA's DEFAULT multiplies f32 in TF32 on a
    GPU (an H200 served SmolLM2 f32 with logprobs 0.1-0.18 off the CPU's and 3 of 5 greedy
    answers apart), where PyTorch, and so transformers, multiplies f32 in f32. bf16
    operands and the CPU's f32 dots compute as before.
    """
    model = nnx.merge(graphdef, state)
    extra = () if adapters is None else (adapters,)
    with jax.default_matmul_precision("highest"):
        return model(token_ids, positions, kv_cache, metadata, *extra)


def _batch(slots: AdapterSlots | None, token_slots: jax.Array) -> AdapterBatch | None:
    return None if slots is None else AdapterBatch(slots, token_slots)


def _step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    row_state: RowState,
    inputs: StepInputs,
    slots: AdapterSlots | None = None,
) -> tuple[jax.Array, KVCache, RowState]:
    """One forward pass; sample the next token of every row and score it. `slots`: the
    LoRA adapters' slots, when adapters are served.

    Returns f32[num_rows + num_drafts, RESULT_WIDTH] results (laid out as
    `StepOutput.unpack` reads them; after the rows', the token drawn after each draft
    token, which the runner verifies the drafts by), the cache and the row state.

    A draft is kept while it equals the token drawn before it (results.py). With one draft
    token and no draft distribution, that is rejection sampling: a draft d is kept with
    the probability p(d) the model gives it, and a token drawn in its place is p's without
    d. Each token is drawn with the key decoding one at a time would draw it with, from
    logits of the same bits, so a seeded request gets the same tokens either way.
    """
    token_ids = resolve_pending(row_state, inputs.token_ids)
    logits, kv_cache = _forward(
        graphdef, state, kv_cache, token_ids, inputs.positions, inputs.metadata,
        _batch(slots, inputs.adapters),
    )
    params = inputs.sampling
    num_rows = params.temperature.shape[0]
    all_logits, logits = logits, logits[:num_rows]  # the rows', then the drafts'
    # a step without logit_bias leaves the logits alone: the biased copy costs every row
    biased = jax.lax.cond(
        any_logit_bias(params), apply_logit_bias, lambda lg, _: lg, logits, params
    )
    # only rows with a penalty read the penalty records: in a step without one they
    # are left alone (keeping them costs every row of the step)
    active = any_penalty(params)
    penalized, row_state = jax.lax.cond(
        active, _penalize, lambda lg, pn, *_: (lg, pn), biased, row_state, params, token_ids,
    )
    tokens = sample(penalized, params)
    row_state = jax.lax.cond(active, record_output, lambda pn, *_: pn, row_state, params, tokens)
    row_state = record_last(row_state, params, tokens)
    results = _results(logits, tokens, params.logprobs)
    if all_logits.shape[0] > num_rows:  # drafts come only with rows without penalties,
        # logit bias or logprobs (host/ngram.py)
        draws = params.at_rows(inputs.draft_rows, inputs.draft_counters).greedy_from(
            inputs.metadata.num_logits[0] - num_rows)
        after = sample_from(all_logits, num_rows, draws).astype(results.dtype)
        results = jnp.concatenate(
            [results, jnp.zeros((after.shape[0], results.shape[1])).at[:, 0].set(after)])
    return results, kv_cache, row_state


def _penalize(
    logits: jax.Array, row_state: RowState, params: SamplingTensors, token_ids: jax.Array
) -> tuple[jax.Array, RowState]:
    """Record this step's prompt tokens, then apply every row's penalties."""
    row_state = record_prompt(row_state, params, token_ids)
    return apply_penalties(logits, row_state, params), row_state


def _score(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    token_ids: jax.Array,  # i32[num_tokens]
    positions: jax.Array,  # i32[num_tokens]
    metadata: AttentionMetadata,  # logits_indices: every token
    targets: jax.Array,  # i32[num_tokens] the token that follows each one
    token_slots: jax.Array,  # i32[num_tokens] each token's adapter slot
    slots: AdapterSlots | None = None,
) -> tuple[jax.Array, KVCache]:
    """Prompt logprobs: each target's log-probability after the tokens before it.

    Returns f32[num_tokens, RESULT_WIDTH] (the `StepOutput.unpack` layout, targets as the
    tokens) and the cache, its K/V written as the step writes them.
    """
    logits, kv_cache = _forward(graphdef, state, kv_cache, token_ids, positions, metadata,
                                _batch(slots, token_slots))
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
        on_any_shard(jnp.any(logprobs >= 0)), token_logprobs, skip, logits, tokens,
        jnp.any(logprobs > 0),
    )
    # ids < 2**24 are exact in f32, so one array carries everything back
    return jnp.concatenate(
        [tokens[:, None].astype(jnp.float32), chosen[:, None], top_ids.astype(jnp.float32),
         top_logprobs],
        axis=1,
    )


def compiler_options() -> dict[str, str]:
    """What XLA is told when it compiles a step: on a CPU, f32 dots by Eigen, not YNNPACK.

    YNNPACK (jax 0.10's default for CPU dots) sums each output in one chain along K: at
    SmolLM2's massive activations (layer 12's down projection) its f32 dot lands 1.1e-2
    from the f64 product where torch's lands 1.1e-3, and the logits 0.6-1.6e-4 from
    transformers f32 (Eigen's: 0.4-0.6e-4; `bench/results/NOTES.md`, 2026-12-04).
    Eigen multiplies a transposed right side several times slower, so a tied head
    multiplies a transposed copy on that path (llm.py).
    """
    return {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else {}


def forward(*args, **kwargs):
    """`_forward` jitted (the graphdef static, the cache donated), for tests and benchmarks."""
    return _jitted_forward()(*args, **kwargs)


@functools.cache
def _jitted_forward() -> Callable:
    return jax.jit(_forward, static_argnums=0, donate_argnums=2,
                   compiler_options=compiler_options())


def jit_step(graphdef: nnx.GraphDef, state: nnx.State, layout: Layout | None = None) -> Callable:
    """`_step` jitted for this model: called as (weights, kv_cache, row_state, inputs,
    slots), `weights` the state's leaves (`jax.tree.leaves(state)`), `slots` the adapter
    slots (None when no adapters are served).

    The model's structure is bound here rather than passed at every call: hashing a
    GraphDef and flattening an nnx.State cost ~1.4 ms of host time a step.
    With `layout`, for its mesh: the inputs are the data shards' packed batches end
    to end and the row state the shards' rows end to end (both sharded over
    "data"); under `shard_map` each shard runs `_step` on its own batch, pages and
    rows' state, with page ids local to its pool. Results come back replicated,
    shard after shard.
    """
    fn = _bound(_step, graphdef, state)
    if layout is None:
        return jax.jit(fn, donate_argnums=(1, 2), compiler_options=compiler_options())
    return jax.jit(
        _per_data_shard(fn, layout, num_sharded_inputs=2, outputs=(_DATA, _KV, _DATA)),
        donate_argnums=(1, 2),
        compiler_options=compiler_options(),
        in_shardings=(jax.tree.leaves(layout.state), layout.kv_cache, layout.data, layout.data,
                      layout.adapters),
        out_shardings=(layout.replicated, layout.kv_cache, layout.data),
    )


def jit_score(graphdef: nnx.GraphDef, state: nnx.State, layout: Layout | None = None) -> Callable:
    """`_score` jitted for this model, as `jit_step`: (weights, kv_cache, token_ids,
    positions, metadata, targets, token_slots, slots); with `layout`, each data shard
    scores its own rows."""
    fn = _bound(_score, graphdef, state)
    if layout is None:
        return jax.jit(fn, donate_argnums=1, compiler_options=compiler_options())
    return jax.jit(
        _per_data_shard(fn, layout, num_sharded_inputs=5, outputs=(_DATA, _KV)),
        donate_argnums=1,
        compiler_options=compiler_options(),
        in_shardings=(jax.tree.leaves(layout.state), layout.kv_cache, *[layout.data] * 5,
                      layout.adapters),
        out_shardings=(layout.replicated, layout.kv_cache),
    )


def sharded_forward(layout: Layout) -> Callable:
    """`forward` jitted for `layout`'s mesh: the same arguments, logits replicated."""
    r = layout.replicated
    return jax.jit(
        _forward,
        static_argnums=0,
        donate_argnums=2,
        compiler_options=compiler_options(),
        in_shardings=(layout.state, layout.kv_cache, r, r, r),
        out_shardings=(r, layout.kv_cache),
    )


def _bound(fn: Callable, graphdef: nnx.GraphDef, state: nnx.State) -> Callable:
    """fn(graphdef, state, *args) as fn'(weights, *args), weights the state's leaves."""
    treedef = jax.tree.structure(state)

    def run(weights: list[jax.Array], *args):
        return fn(graphdef, jax.tree.unflatten(treedef, weights), *args)

    return run


_DATA = PartitionSpec(DATA)  # axis 0 split over the data shards
_KV = PartitionSpec(None, None, DATA)  # [layer, kv_head, page, ...]: pages per shard


def _per_data_shard(
    fn: Callable, layout: Layout, num_sharded_inputs: int, outputs: tuple
) -> Callable:
    """fn(weights, kv_cache, *inputs, slots) run by each data shard on its own part; the
    weights and the adapter slots (last) are whole on every data shard.

    Manual over "data" only: the weights' "model" sharding stays with the compiler. The
    pool and its scales are split by pages; an fp8 pool's calibration (per layer, head and
    channel) is whole on every data shard.
    """
    c = layout.kv_cache
    kv = KVCache(*(None if x is None else spec for x, spec in zip(
        (c.k, c.v, c.k_scale, c.v_scale, c.k_center, c.v_center, c.k_channel_scale,
         c.v_channel_scale), [_KV] * 4 + [PartitionSpec()] * 4)), k_transposed=c.k_transposed)
    return jax.shard_map(
        fn,
        mesh=layout.mesh,
        in_specs=(PartitionSpec(), kv, *[_DATA] * num_sharded_inputs, PartitionSpec()),
        out_specs=tuple(kv if spec is _KV else spec for spec in outputs),
        axis_names={DATA},
        check_vma=False,
    )
