"""On-device sampling, one row per sequence, with penalties and log-probabilities.

Rows draw from their own key, `fold_in(PRNGKey(seed), num_generated)`, so a
seeded request gives the same tokens whatever else shares its batch. Penalties
read a per-slot record of output-token counts and prompt tokens that lives on
the device and is updated inside the step (a slot is a stable batch position of
one running sequence).
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.config import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters, padded to the batch's row count."""

    temperature: jax.Array  # f32[num_seqs]; 0 = greedy
    top_k: jax.Array  # i32[num_seqs]; 0 = off
    top_p: jax.Array  # f32[num_seqs]; 1 = off
    min_p: jax.Array  # f32[num_seqs]; 0 = off
    presence_penalty: jax.Array  # f32[num_seqs]
    frequency_penalty: jax.Array  # f32[num_seqs]
    repetition_penalty: jax.Array  # f32[num_seqs]; 1 = off
    seeds: jax.Array  # u32[num_seqs]
    counters: jax.Array  # i32[num_seqs] tokens generated so far (the key's fold-in)
    slots: jax.Array  # i32[num_seqs] penalty slot of each row; padding -> the spare slot
    first_chunk: jax.Array  # bool[num_seqs] the row starts its sequence: clear its slot
    samples: jax.Array  # bool[num_seqs] the row's token counts as generated
    prompt_slots: jax.Array  # i32[num_tokens] slot of each prompt token; others -> spare


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class PenaltyState:
    """What the penalties need to know of each slot's sequence so far."""

    output_counts: jax.Array  # f32[num_slots + 1, vocab] generated-token counts
    prompt_mask: jax.Array  # bool[num_slots + 1, vocab] tokens present in the prompt


def init_penalty_state(num_slots: int, vocab_size: int) -> PenaltyState:
    """Zeroed state; the last slot is a spare that padding rows read and write."""
    shape = (num_slots + 1, vocab_size)
    return PenaltyState(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, bool))


def record_prompt(
    state: PenaltyState, params: SamplingTensors, token_ids: jax.Array
) -> PenaltyState:
    """Clear the slots of sequences that start now, then mark this step's prompt tokens."""
    spare = state.output_counts.shape[0] - 1
    cleared = jnp.where(params.first_chunk, params.slots, spare)
    counts = state.output_counts.at[cleared].set(0.0)
    mask = state.prompt_mask.at[cleared].set(False)
    return PenaltyState(counts, mask.at[params.prompt_slots, token_ids].set(True))


def record_output(
    state: PenaltyState, params: SamplingTensors, tokens: jax.Array
) -> PenaltyState:
    """Count each sampled token of rows that sample."""
    spare = state.output_counts.shape[0] - 1
    slots = jnp.where(params.samples, params.slots, spare)
    return PenaltyState(state.output_counts.at[slots, tokens].add(1.0), state.prompt_mask)


def apply_penalties(
    logits: jax.Array,  # f32[num_seqs, vocab]
    state: PenaltyState,
    params: SamplingTensors,
) -> jax.Array:
    """vLLM's penalties: repetition (prompt and output tokens), presence and frequency (output)."""
    counts = state.output_counts[params.slots]
    seen = state.prompt_mask[params.slots] | (counts > 0)
    rep = params.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return logits - params.presence_penalty[:, None] * (counts > 0)


def _top_k_top_p_keep(
    scaled: jax.Array,  # f32[num_seqs, vocab]
    params: SamplingTensors,
) -> jax.Array:  # bool[num_seqs, vocab]
    """Tokens inside each row's top-k and top-p (the smallest prefix whose mass reaches p)."""
    num_seqs, vocab = scaled.shape
    order = jnp.argsort(-scaled, axis=-1)  # descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    top_k = jnp.where(params.top_k > 0, params.top_k, vocab)
    keep = jnp.arange(vocab)[None, :] < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= jnp.cumsum(probs, axis=-1) - probs < params.top_p[:, None]  # top token stays
    return jnp.zeros_like(keep).at[jnp.arange(num_seqs)[:, None], order].set(keep)


def sample(
    logits: jax.Array,  # f32[num_seqs, vocab], penalties already applied
    params: SamplingTensors,
) -> jax.Array:  # i32[num_seqs]
    """The next token of every row.

    Sorting the vocabulary is the costly part, so it runs only when some row asks
    for top-k or top-p. Every row draws in vocabulary order with its own key, so a
    row's token does not depend on whether its neighbours needed the sort.
    """
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    filters = jnp.any((params.top_k > 0) & (params.top_k < vocab)) | jnp.any(params.top_p < 1)
    keep = jax.lax.cond(
        filters,
        _top_k_top_p_keep,
        lambda scaled, _: jnp.ones(scaled.shape, bool),
        scaled,
        params,
    )
    # min-p drops tokens below min_p x the most likely token's probability
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    keep &= probs >= params.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(
        params.seeds, params.counters
    )
    sampled = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf))
    return jnp.where(params.temperature > 0, sampled.astype(jnp.int32), greedy)


def token_logprobs(
    logits: jax.Array,  # f32[num_seqs, vocab], the model's raw logits
    tokens: jax.Array,  # i32[num_seqs]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probability of each chosen token and the MAX_LOGPROBS most likely alternatives.

    Returns (f32[num_seqs], i32[num_seqs, MAX_LOGPROBS], f32[num_seqs, MAX_LOGPROBS]).
    Like vLLM, these are the model's own probabilities, before penalties or filters.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_values
