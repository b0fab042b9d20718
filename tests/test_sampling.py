"""On-device sampling: filters, temperature and per-row seeds."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling import SamplingTensors, sample


def rows(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, counter=0):
    return SamplingTensors.from_rows(
        [temperature] * n, [top_k] * n, [top_p] * n, [seed] * n, [counter] * n
    )


LOGITS = jax.random.normal(jax.random.PRNGKey(0), (4, 50)) * 3


def test_temperature_zero_is_argmax():
    assert np.array_equal(sample(LOGITS, rows(4, temperature=0)), jnp.argmax(LOGITS, -1))


def test_top_k_one_and_tiny_top_p_are_argmax():
    assert np.array_equal(sample(LOGITS, rows(4, top_k=1)), jnp.argmax(LOGITS, -1))
    assert np.array_equal(sample(LOGITS, rows(4, top_p=1e-6)), jnp.argmax(LOGITS, -1))


def test_top_k_never_leaves_the_k_best():
    best3 = np.argsort(-np.asarray(LOGITS), -1)[:, :3]
    for seed in range(50):
        got = np.asarray(sample(LOGITS, rows(4, top_k=3, seed=seed)))
        assert all(g in b for g, b in zip(got, best3))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(sample(logits, rows(1, top_p=0.7, seed=s))[0]) for s in range(200)}
    assert seen == {0, 1}


def test_frequencies_follow_softmax():
    logits = jnp.log(jnp.array([[0.6, 0.3, 0.1]]))
    n = 4000
    params = SamplingTensors.from_rows([1.0] * n, [0] * n, [1.0] * n, list(range(n)), [0] * n)
    draws = sample(jnp.repeat(logits, n, axis=0), params)
    freq = np.bincount(np.asarray(draws), minlength=3) / n
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)


def test_seeded_rows_do_not_depend_on_their_neighbours():
    alone = sample(LOGITS[:1], rows(1, seed=7, counter=3))
    params = SamplingTensors.from_rows([1.0] * 4, [0] * 4, [1.0] * 4, [1, 7, 2, 3], [0, 3, 5, 9])
    batched = sample(jnp.stack([LOGITS[1], LOGITS[0], LOGITS[2], LOGITS[3]]), params)
    assert int(batched[1]) == int(alone[0])
