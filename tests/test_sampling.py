"""On-device sampling: filters, temperature, per-row seeds, penalties and logprobs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import MAX_LOGIT_BIAS, MAX_LOGPROBS
from jaxserve.device import sampling
from jaxserve.device.sampling import (
    SamplingTensors,
    any_logit_bias,
    apply_logit_bias,
    apply_penalties,
    argmax,
    init_row_state,
    record_last,
    record_output,
    record_prompt,
    resolve_pending,
    token_logprobs,
    top_k,
)
from jaxserve.device.sampling import (
    sample as sample_eager,
)
from jaxserve.host.plan import pending_token


def rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, counters=None,
         presence=0.0, frequency=0.0, repetition=1.0, rows=None, num_tokens=1):
    def full(value, dtype):
        return np.full(n, value, dtype)

    return SamplingTensors(
        temperature=full(temperature, np.float32),
        top_k=full(top_k, np.int32),
        top_p=full(top_p, np.float32),
        min_p=full(min_p, np.float32),
        presence_penalty=full(presence, np.float32),
        frequency_penalty=full(frequency, np.float32),
        repetition_penalty=full(repetition, np.float32),
        seeds=np.asarray(seeds if seeds is not None else [0] * n, np.uint32),
        counters=np.asarray(counters if counters is not None else [0] * n, np.int32),
        rows=np.asarray(rows if rows is not None else range(n), np.int32),
        first_chunk=full(False, bool),
        samples=full(True, bool),
        prompt_rows=np.full(num_tokens, n, np.int32),
        logprobs=full(-1, np.int32),
        bias_ids=np.zeros((n, MAX_LOGIT_BIAS), np.int32),
        bias_values=np.zeros((n, MAX_LOGIT_BIAS), np.float32),
    )


# jitted once: run eagerly, each call traces its lax.cond branches anew (~0.7 s)
sample = jax.jit(sample_eager)
LOGITS = jax.random.normal(jax.random.PRNGKey(0), (4, 50)) * 3


def test_temperature_zero_is_argmax():
    assert np.array_equal(sample(LOGITS, rows(4, temperature=0)), jnp.argmax(LOGITS, -1))


@pytest.mark.parametrize("vocab", [1, 50, 128, 300, 49152])
def test_blocked_argmax_is_jnp_argmax(vocab):
    """Same first index on ties (within and across blocks), NaN, and all -inf rows."""
    x = np.array(jax.random.normal(jax.random.PRNGKey(vocab), (6, vocab)))
    x[1] = np.round(x[1])  # many ties at the maximum
    x[2, -1] = x[2, 0] = 9.0  # tie between the first and last block
    x[3] = -np.inf
    x[4, vocab // 2] = np.nan
    x[5, -1] = np.inf
    assert np.array_equal(argmax(jnp.asarray(x)), np.asarray(jnp.argmax(x, -1)))


def test_top_k_one_tiny_top_p_and_min_p_one_are_argmax():
    argmax = jnp.argmax(LOGITS, -1)
    assert np.array_equal(sample(LOGITS, rows(4, top_k=1)), argmax)
    assert np.array_equal(sample(LOGITS, rows(4, top_p=1e-6)), argmax)
    assert np.array_equal(sample(LOGITS, rows(4, min_p=1.0)), argmax)


def test_filters_never_leave_the_allowed_set():
    best3 = np.argsort(-np.asarray(LOGITS), -1)[:, :3]
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(40):
        got = np.asarray(sample(LOGITS, rows(4, top_k=3, seeds=[seed] * 4)))
        assert all(g in b for g, b in zip(got, best3))
        # top-p 0.7 keeps {0, 1}; min-p 0.25 keeps tokens with p >= 0.125: {0, 1, 2}
        assert int(sample(logits, rows(1, top_p=0.7, seeds=[seed]))[0]) in (0, 1)
        assert int(sample(logits, rows(1, min_p=0.25, seeds=[seed]))[0]) in (0, 1, 2)


def reference_keep(x: np.ndarray, k: int, p: float) -> np.ndarray:
    """The tokens top-k then top-p keep of one row, by a full sort in float64: the k most
    likely and those tied with the k-th, then, renormalized among those, each token whose
    more likely tokens hold less than p of the mass."""
    x = x.astype(np.float64)
    keep = x >= np.sort(x)[::-1][k - 1] if 0 < k < len(x) else np.ones(len(x), bool)
    if p >= 1:
        return keep
    w = np.where(keep, np.exp(x - x.max()), 0.0)
    greater = np.array([w[x > v].sum() for v in x])
    return keep & (greater < p * w.sum())


@pytest.mark.parametrize("path", ["candidates", "bisected"])
def test_top_k_and_top_p_keep_what_a_full_sort_keeps(path, monkeypatch):
    """The cut keeps the tokens a full sort keeps: ties at the k-th kept together, top-p
    renormalized after top-k, rows of each kind in one batch. Sought among the most likely
    tokens where it lies there (the bisection broken, to show it is not taken), or by
    bisection over the vocabulary (every row's cut beyond 4 candidates; a nearly flat row
    whose top-p keeps most of the vocabulary)."""
    rng = np.random.default_rng(3)
    vocab = 3000
    x = rng.standard_normal((8, vocab)).astype(np.float32) * 3
    x[1] = np.round(x[1])  # many ties, at every cut
    x[2, :40] = 10.0  # a tie group of 40
    settings = [(0, 0.9), (50, 1.0), (3, 1.0), (0, 0.5), (100, 0.9), (0, 0.8), (1, 1.0),
                (5000, 0.7)]
    if path == "candidates":  # each cut among the 256 most likely
        monkeypatch.setattr(sampling, "_bisected_cut",
                            lambda scaled, *_: jnp.full(scaled.shape[:1], jnp.nan))
    else:
        monkeypatch.setattr(sampling, "CUT_CANDIDATES", 4)
        x[3] *= 0.01  # nearly flat
        settings[5] = (0, 0.99)  # 724 tokens
    params = dataclasses.replace(rows(8), top_k=np.array([k for k, _ in settings], np.int32),
                                 top_p=np.array([p for _, p in settings], np.float32))
    # a fresh function: jit's cache would keep the other variant's trace
    cut = np.asarray(jax.jit(lambda x, params: sampling._cut(x, params))(jnp.asarray(x), params))
    for row, (k, p) in enumerate(settings):
        np.testing.assert_array_equal(x[row] >= cut[row], reference_keep(x[row], k, p),
                                      err_msg=f"row {row}: top_k {k}, top_p {p}")


def test_rows_from_n_on_are_greedy_and_unfiltered_and_skip_the_bisection(monkeypatch):
    """A step's padding drafts (rows from `n` on, zero logits) draw greedily: a top-p row's
    parameters there would find no cut among a flat row's candidates and send every row of
    the step to the bisection, which is broken here to show it is not taken."""
    monkeypatch.setattr(sampling, "_bisected_cut",
                        lambda scaled, *_: jnp.full(scaled.shape[:1], jnp.nan))
    monkeypatch.setattr(sampling, "CUT_CANDIDATES", 4)  # top-k 3's cut among them
    params = rows(4, temperature=0.8, top_k=3, top_p=0.9, min_p=0.1, seeds=[1, 2, 3, 4])
    padded = params.greedy_from(jnp.int32(2))
    np.testing.assert_array_equal(padded.temperature, np.float32([0.8, 0.8, 0, 0]))
    np.testing.assert_array_equal(padded.top_k, [3, 3, 0, 0])
    np.testing.assert_array_equal(padded.top_p, np.float32([0.9, 0.9, 1, 1]))
    logits = jnp.asarray(np.asarray(LOGITS).copy()).at[2:].set(0.0)
    got = jax.jit(lambda x, p: sampling.sample(x, p))(logits, padded)
    assert got[2:].tolist() == [0, 0]  # argmax of a flat row: its first token
    assert got[:2].tolist() == sample(LOGITS[:2], rows(2, 0.8, 3, 0.9, 0.1, [1, 2])).tolist()


@pytest.mark.parametrize("n", [12, 48, 3])  # 3 chunks of 4, 6 of 8, 3 of 1
def test_drafts_drawn_a_chunk_at_a_time_are_what_one_draw_gives(n):
    """`sample_from` draws rows [first, first + n) in chunks: each row the token that
    `sample` gives it over all n at once, whichever chunk holds it and whatever its
    chunk's other rows ask for (greedy, temperature, top-k, top-p, min-p)."""
    first, vocab = 5, 300
    logits = jax.random.normal(jax.random.PRNGKey(3), (first + n, vocab)) * 3
    kinds = [{"temperature": 0.0}, {"temperature": 0.9}, {"temperature": 0.7, "top_k": 5},
             {"temperature": 1.2, "top_p": 0.8}, {"temperature": 0.8, "min_p": 0.2}]
    each = [rows(1, seeds=[i], counters=[i + 2], **kinds[i % len(kinds)]) for i in range(n)]
    params = SamplingTensors(**{
        f.name: np.concatenate([getattr(r, f.name) for r in each])
        for f in dataclasses.fields(SamplingTensors)})
    got = jax.jit(lambda x, p: sampling.sample_from(x, first, p))(logits, params)
    assert got.tolist() == sample(logits[first:], params).tolist()
    assert len(set(got.tolist())) > 1


def test_frequencies_follow_softmax():
    n = 4000
    logits = jnp.repeat(jnp.log(jnp.array([[0.6, 0.3, 0.1]])), n, axis=0)
    draws = sample(logits, rows(n, seeds=range(n)))
    freq = np.bincount(np.asarray(draws), minlength=3) / n
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)


def test_draws_across_blocks_follow_the_weights_and_skip_masked_tokens():
    """The two-level inverse CDF over a vocabulary of several 256-token blocks."""
    n, vocab = 4000, 700
    probs = {3: 0.2, 255: 0.1, 256: 0.3, 699: 0.4}  # block edges and the padded tail
    logits = np.full((n, vocab), -np.inf, np.float32)
    for token, p in probs.items():
        logits[:, token] = np.log(p)
    draws = np.asarray(sample(jnp.asarray(logits), rows(n, seeds=range(n))))
    assert set(draws) <= set(probs)
    freq = {t: np.mean(draws == t) for t in probs}
    for token, p in probs.items():
        assert abs(freq[token] - p) < 0.03, freq


def test_seeded_rows_do_not_depend_on_their_neighbours():
    alone = sample(LOGITS[:1], rows(1, seeds=[7], counters=[3]))
    batched = sample(
        jnp.stack([LOGITS[1], LOGITS[0], LOGITS[2], LOGITS[3]]),
        rows(4, seeds=[1, 7, 2, 3], counters=[0, 3, 5, 9]),
    )
    assert int(batched[1]) == int(alone[0])


def test_logit_bias_adds_to_its_rows_tokens_only():
    params = rows(3)
    ids, values = np.zeros((3, MAX_LOGIT_BIAS), np.int32), np.zeros((3, MAX_LOGIT_BIAS), np.float32)
    ids[0, :3], values[0, :3] = [4, 7, 10**6], [100.0, -2.5, 50.0]  # 10**6: past the vocab
    ids[2, :1], values[2, :1] = [4], [-100.0]
    params = SamplingTensors(**{
        **{f: getattr(params, f) for f in params.__dataclass_fields__},
        "bias_ids": ids, "bias_values": values,
    })
    logits = LOGITS[:3]
    got = np.asarray(apply_logit_bias(logits, params))
    want = np.asarray(logits).copy()
    want[0, 4] += 100.0
    want[0, 7] -= 2.5
    want[2, 4] -= 100.0
    np.testing.assert_array_equal(got, want)
    assert bool(any_logit_bias(params)) and not bool(any_logit_bias(rows(3)))


def test_penalties_follow_vllm_formulas():
    vocab = 6
    state = init_row_state(2, vocab)
    params = rows(2, presence=0.5, frequency=0.25, repetition=2.0, num_tokens=2)
    # row 0's prompt holds token 1; row 0 has generated token 2 twice
    params = SamplingTensors(**{
        **{f: getattr(params, f) for f in params.__dataclass_fields__},
        "first_chunk": np.array([True, True]),
        "prompt_rows": np.array([0, 2], np.int32),
    })
    state = record_prompt(state, params, jnp.array([1, 4]))
    for _ in range(2):
        state = record_output(state, params, jnp.array([2, 5]))
    logits = jnp.array([[1.0, 1.0, 1.0, -1.0, 1.0, 1.0]] * 2)
    got = np.asarray(apply_penalties(logits, state, params))
    # row 0: token 1 (prompt) 1/2; token 2 (output x2) 1/2 - 0.25*2 - 0.5
    np.testing.assert_allclose(got[0], [1.0, 0.5, 0.5 - 0.5 - 0.5, -1.0, 1.0, 1.0])
    # row 1: token 4 went to the spare row (2), token 5 generated twice
    np.testing.assert_allclose(got[1], [1.0, 1.0, 1.0, -1.0, 1.0, 0.5 - 0.5 - 0.5])


def test_logprobs_are_the_models_own():
    tokens = jnp.argmax(LOGITS, -1).astype(jnp.int32)
    chosen, top_ids, top_values = token_logprobs(LOGITS, tokens)
    ref = jax.nn.log_softmax(LOGITS, -1)
    np.testing.assert_allclose(chosen, ref[jnp.arange(4), tokens], rtol=1e-6)
    assert np.array_equal(top_ids[:, 0], tokens)
    assert np.all(np.diff(np.asarray(top_values), axis=1) <= 0)


@pytest.mark.parametrize("vocab", [50, 20 * 1024 + 1, 49152])
def test_blocked_top_k_is_lax_top_k(vocab):
    """Same values and indices, ties included (they resolve to the lower index)."""
    x = np.array(jax.random.normal(jax.random.PRNGKey(vocab), (4, vocab)))
    x[1] = np.round(x[1] * 2)  # many ties, across blocks
    x[2, :] = 1.0  # one value everywhere
    x[3, -5:] = 50.0  # the largest in the last, partial block
    want_values, want_ids = jax.lax.top_k(jnp.asarray(x), MAX_LOGPROBS)
    got_values, got_ids = jax.jit(top_k, static_argnums=1)(jnp.asarray(x), MAX_LOGPROBS)
    np.testing.assert_array_equal(got_values, want_values)
    np.testing.assert_array_equal(got_ids, want_ids)


def test_logprobs_match_log_softmax_at_full_vocabulary():
    logits = jax.random.normal(jax.random.PRNGKey(1), (3, 49152)) * 4
    tokens = jnp.array([0, 17, 49151], jnp.int32)
    chosen, top_ids, top_values = jax.jit(token_logprobs)(logits, tokens)
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(chosen, ref[np.arange(3), tokens], rtol=1e-5)
    ref_values, ref_ids = jax.lax.top_k(jnp.asarray(ref), MAX_LOGPROBS)
    np.testing.assert_array_equal(top_ids, ref_ids)
    np.testing.assert_allclose(top_values, ref_values, rtol=1e-5)


def test_a_placeholder_reads_its_rows_last_sampled_token():
    """Async scheduling: a step planned before the host had the previous step's tokens
    carries placeholders, which read the token each row last sampled on the device."""
    state = init_row_state(3, 8)
    params = rows(3)
    params = SamplingTensors(**{
        **{f: getattr(params, f) for f in params.__dataclass_fields__},
        "rows": np.array([0, 2, 1], np.int32),
        "samples": np.array([True, True, False]),  # row 1's chunk samples nothing
    })
    state = record_last(state, params, jnp.array([5, 7, 6]))
    np.testing.assert_array_equal(np.asarray(state.last_tokens), [5, 0, 7, 6])  # 3: spare
    tokens = jnp.array([pending_token(2), 3, pending_token(0), pending_token(1)])
    np.testing.assert_array_equal(np.asarray(resolve_pending(state, tokens)), [7, 3, 5, 0])
