"""On-device sampling, one row per sequence: greedy, temperature, top-k, top-p, seeded.

Each row draws from its own key, `fold_in(PRNGKey(seed), num_generated)`, so a
seeded request gives the same tokens whatever else shares its batch.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters, padded to the batch's row count."""

    temperature: jax.Array  # f32[num_seqs]; 0 = greedy
    top_k: jax.Array  # i32[num_seqs]; 0 = off
    top_p: jax.Array  # f32[num_seqs]; 1 = off
    seeds: jax.Array  # u32[num_seqs]
    counters: jax.Array  # i32[num_seqs] tokens generated so far (the key's fold-in)

    @staticmethod
    def from_rows(
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        seeds: list[int],
        counters: list[int],
    ) -> "SamplingTensors":
        return SamplingTensors(
            temperature=np.asarray(temperature, np.float32),
            top_k=np.asarray([max(k, 0) for k in top_k], np.int32),
            top_p=np.asarray(top_p, np.float32),
            seeds=np.asarray(seeds, np.uint32),
            counters=np.asarray(counters, np.int32),
        )


def sample(
    logits: jax.Array,  # f32[num_seqs, vocab]
    params: SamplingTensors,
) -> jax.Array:  # i32[num_seqs]
    """The next token of every row."""
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    top_k = jnp.where(params.top_k > 0, params.top_k, vocab)
    keep = rank < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < params.top_p[:, None]
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(
        params.seeds, params.counters
    )
    choice = jax.vmap(jax.random.categorical)(keys, filtered)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(params.temperature > 0, sampled, greedy)
