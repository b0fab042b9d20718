"""Speculative decoding by prompt lookup: drafts, their verification, and the same tokens."""

import dataclasses
import json
import os
import random
import subprocess
import sys
import urllib.request

import numpy as np
import openai
import pytest
from fake_engine import make_engine, next_token
from hf_models import save_random_model
from serving import ROOT, running_server

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.cli import _speculative_config
from jaxserve.device import runner as runner_module
from jaxserve.device.batch import pack_step
from jaxserve.host import ngram
from jaxserve.host.buckets import draft_logits
from jaxserve.host.ngram import NgramProposer
from jaxserve.host.plan import Chunk
from jaxserve.host.request import Request
from jaxserve.host.results import RESULT_WIDTH, StepOutput

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
REPEATS = [5, 6, 7, 8, 9] * 4  # a prompt whose continuation the lookup drafts well


def request(tokens, params=GREEDY) -> Request:
    r = Request("r", tuple(tokens[:1]), params, seed=0)
    r.token_ids = list(tokens)
    return r


def brute_force(tokens, k, sizes):
    """The reference lookup: for the longest n first, the tokens after the latest earlier
    occurrence of the last n tokens."""
    for n in sizes:
        if n > len(tokens):
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tuple(tokens[start + n : start + n + k])
    return ()


def test_the_lookup_drafts_what_followed_the_latest_longest_match():
    proposer = NgramProposer(3, 2, 4)
    # "1 2 3" occurred twice; the latest is followed by 9 8 7 (not 4 5 6)
    assert proposer.propose(request([1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 8, 7, 0, 2, 3])) == (9, 8, 7)
    # a longer match wins over a later shorter one: "5 1 2 3" -> 4 4
    tokens = [5, 1, 2, 3, 4, 4, 7, 2, 3, 6, 5, 1, 2, 3]
    assert proposer.propose(request(tokens)) == (4, 4, 7)
    assert proposer.propose(request([1, 2, 3, 4])) == ()  # no earlier occurrence
    assert proposer.propose(request([7, 7])) == ()  # the suffix alone is not a match
    assert proposer.propose(request([7, 7, 7])) == (7,)  # only one token followed it


def test_the_index_grows_with_the_request_and_matches_a_brute_force_lookup(monkeypatch):
    monkeypatch.setattr(ngram, "ACCEPTANCE_FLOOR", -1.0)  # random tokens follow no draft
    rng = random.Random(0)
    for sizes in ((4, 3, 2), (1,)):
        proposer = NgramProposer(3, sizes[-1], sizes[0])
        for _ in range(30):
            tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
            r = request(tokens)
            for _ in range(40):  # tokens appended a few at a time, as accepted drafts are
                assert proposer.propose(r) == brute_force(r.token_ids, 3, sizes)
                r.token_ids += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, logprobs=1),
    SamplingParams(temperature=0.7, repetition_penalty=1.2),
    SamplingParams(temperature=0, presence_penalty=0.5),
    SamplingParams(temperature=0, logit_bias={3: 1.0}),
], ids=["logprobs", "repetition", "presence", "bias"])
def test_requests_with_logprobs_penalties_or_a_bias_get_no_drafts(params):
    assert NgramProposer(3, 2, 4).propose(request(REPEATS, params)) == ()
    for drafted in (GREEDY, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)):
        assert NgramProposer(3, 2, 4).propose(request(REPEATS, drafted)) == (5, 6, 7)


def test_a_request_whose_drafts_are_not_followed_drafts_only_to_probe():
    """A draft the model does not follow stops a request's drafts (its moving share of
    drafts followed falls below ACCEPTANCE_FLOOR) except one every PROBE_EVERY tokens; a
    followed probe starts them again; a request whose drafts are followed keeps drafting."""
    proposer = NgramProposer(3, 2, 4)
    r = request(REPEATS)
    assert proposer.propose(r) == (5, 6, 7)
    r.token_ids += [1]  # not the draft's 5
    drafts = []
    while len(r.token_ids) % ngram.PROBE_EVERY:
        drafts.append(proposer.propose(r))
        r.token_ids += [5]  # one token a step, as without drafts
    assert drafts == [()] * len(drafts) and len(drafts) >= 3
    probe = proposer.propose(r)
    assert probe
    r.token_ids += list(probe) + [probe[0]]  # followed: drafting again
    assert proposer.propose(r)
    followed = request(REPEATS)  # the model goes on repeating it
    for _ in range(10):
        draft, n = proposer.propose(followed), len(followed.token_ids)
        assert draft
        followed.token_ids += [REPEATS[i % 5] for i in range(n, n + len(draft) + 1)]


def test_a_bucket_verifies_the_drafts_its_tokens_hold_beyond_one_a_row():
    assert draft_logits((16, 16), 3) == 0  # a decode step computes no more logits
    assert draft_logits((64, 16), 3) == 48
    assert draft_logits((256, 16), 3) == 48
    assert draft_logits((32, 16), 3) == 16
    assert draft_logits((256, 1), 0) == 0


def test_the_step_takes_logits_at_each_rows_last_real_token_then_at_its_drafts():
    chunks = [
        Chunk((10, 11, 12), 5, (1,), is_prompt=False, row=0, num_speculative=2),
        Chunk((20, 21), 0, (2,), row=1),  # a prompt chunk
        Chunk((30, 31, 32, 33), 9, (3,), is_prompt=False, row=2, num_speculative=3),
    ]
    chunks[2].num_generated = 7
    inputs = pack_step(chunks, 16, 16, 4, 4, 4, num_draft_logits=6)
    assert inputs.metadata.logits_indices.tolist() == [0, 4, 5, 0, 1, 2, 6, 7, 8, 0]
    # each draft's row, and the counter its next token is drawn with: the row's, plus the
    # draft's place in the row (a decode's token after 7 generated is drawn with 7)
    assert inputs.draft_rows.tolist() == [0, 0, 2, 2, 2, 0]
    assert inputs.draft_counters.tolist() == [1, 2, 8, 9, 10, 0]
    # the logits computed: the rows' and the 5 real drafts' (the padding draft's are zeros)
    assert inputs.metadata.num_logits.tolist() == [4 + 5]
    assert pack_step(chunks[1:2], 16, 16, 4, 4, 4).metadata.num_logits is None
    with pytest.raises(ValueError, match="5 draft tokens exceed the step's 4"):
        pack_step(chunks, 16, 16, 4, 4, 4, num_draft_logits=4)


def test_verification_keeps_the_drafts_up_to_the_first_the_model_disagrees_with():
    sampled = np.zeros((4, RESULT_WIDTH), np.float32)
    sampled[:, 0], sampled[:, 1] = [7, 8, 9, 1], -0.5
    one = StepOutput.unpack(sampled, np.array([True, True, True, False]))
    out = one.verified([(7, 3, 4), (5, 6), (), (1, 2)], [(3, 4, 5), (6, 0), (), (2, 3)])
    assert out.accepted() == [[7, 3, 4, 5], [8], [9], []]
    assert out.logprobs[0].tolist() == [-0.5, 0, 0, 0]
    assert out.tokens.shape == out.logprobs.shape == (4, 4)


def test_drafts_are_cut_to_what_a_padded_bucket_verifies():
    """9 decoding rows pad to a bucket of 16: its tokens hold fewer drafts than the budget
    left them, so the last rows' drafts are cut, and the tokens stay the fake model's."""

    class Proposer:
        k = 3

        def propose(self, request):
            return (next_token(request.token_ids[-1]),) * 3

    engine, runner = make_engine(num_pages=128, max_batch=16, token_budget=32,
                                 max_model_len=64, proposer=Proposer())
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    streams = [engine.submit([10 + i], params) for i in range(9)]
    while engine.has_work():
        engine.step()
    for plan in runner.steps:
        assert sum(c.num_speculative for c in plan.chunks) <= draft_logits(plan.bucket, 3)
    # the budget left 23 drafts to 9 rows; a bucket of (32, 16) verifies 16
    assert any(plan.bucket == (32, 16) and len(plan.chunks) == 9
               and sum(c.num_speculative for c in plan.chunks) == 16 for plan in runner.steps)
    for start, stream in enumerate(streams, 10):
        tokens, reason = [], None
        while reason is None:
            item = stream.get(timeout=0)
            tokens, reason = tokens + list(item.token_ids), item.finish_reason
        expected = [next_token(start)]
        while len(expected) < 6:
            expected.append(next_token(expected[-1]))
        assert tokens == expected


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_gguf):
    path = tmp_path_factory.mktemp("speculative") / "model"
    save_random_model("llama-gqa-tied", path)
    Tokenizer.from_gguf(smollm2_gguf).save(path)
    return path


def engine_pair(path, **kw):
    sizes = dict(num_pages=96, page_size=8, max_model_len=128, max_batch=4, debug_checks=True,
                 **kw)
    return LLM(path, **sizes), LLM(path, num_speculative_tokens=3, **sizes)


@pytest.fixture(scope="module")
def pair(tiny_path):
    return engine_pair(tiny_path)


def test_greedy_tokens_are_the_same_in_fewer_steps(pair):
    plain, spec = pair
    prompts = [REPEATS, [40, 41, 42] * 3, [3] * 12, list(range(100, 130))]
    s0, p0 = spec.engine._steps, plain.engine._steps
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    got = [o.token_ids for o in spec.generate(prompts, GREEDY)]
    assert got == want
    assert spec.engine.num_accepted_tokens > 0
    assert spec.engine._steps - s0 < plain.engine._steps - p0
    alloc = spec.scheduler.allocators[0]
    assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable


SAMPLED = [SamplingParams(max_tokens=24, temperature=t, seed=seed, ignore_eos=True, **filters)
           for seed, (t, filters) in enumerate([
               (0.3, {}), (0.8, {}), (0.6, {"top_k": 3}), (0.9, {"top_p": 0.7}),
               (1.0, {"min_p": 0.2}), (0.5, {"top_k": 8, "top_p": 0.9}), (0.7, {})])]


def test_seeded_tokens_are_the_same_in_fewer_steps(pair):
    """Sampled requests verify their drafts by the tokens the step draws after them (with
    the keys decoding one at a time uses), so each seeded request gets its tokens without
    drafts, at every temperature and filter, and some of their drafts are kept."""
    plain, spec = pair
    prompts = [REPEATS, [40, 41, 42] * 3, [3] * 12, REPEATS, [7, 8] * 6, [40, 41, 42] * 3,
               list(range(100, 130))]
    accepted = spec.engine.num_accepted_tokens
    want = [o.token_ids for o in plain.generate(prompts, SAMPLED)]
    got = [o.token_ids for o in spec.generate(prompts, SAMPLED)]
    assert got == want
    assert spec.engine.num_accepted_tokens > accepted


def test_the_seeded_check_fails_where_drafts_draw_with_their_rows_key(pair, monkeypatch):
    """The comparison above can fail: tokens after drafts drawn with the row's own counter
    (one key for every draft of a row) are other tokens."""
    plain, spec = pair
    prompts, params = [REPEATS, [40, 41, 42] * 3, [3] * 12], SAMPLED[:3]
    want = [o.token_ids for o in plain.generate(prompts, params)]

    def one_key(*args, **kwargs):
        inputs = pack_step(*args, **kwargs)
        inputs.draft_counters[:] = inputs.sampling.counters[inputs.draft_rows]
        return inputs

    monkeypatch.setattr(runner_module, "pack_step", one_key)
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got != want


def test_requests_without_drafts_keep_their_tokens_beside_drafted_ones(pair):
    plain, spec = pair
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)]
    prompts = [REPEATS] * 4
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(got[3].token_ids) == 5  # accepted drafts past max_tokens are dropped


def test_the_check_fails_where_every_draft_is_taken_unverified(pair, monkeypatch):
    """The comparison above can fail: a step that accepts every draft (no verification)
    gives other tokens."""
    plain, spec = pair
    want = plain.generate([REPEATS, [40, 41, 42] * 3], GREEDY)

    verified = StepOutput.verified

    def accept_all(self, drafts, after):  # each draft taken, then the model's token after it
        out = verified(self, drafts, after)
        tokens = out.tokens.copy()
        for row, (draft, model) in enumerate(zip(drafts, after)):
            if draft:
                tokens[row, : len(draft) + 1] = [*draft, model[-1]]
        taken = [1 + len(d) if n else 0 for d, n in zip(drafts, self.num_accepted)]
        return dataclasses.replace(out, tokens=tokens, num_accepted=np.array(taken, np.int32))

    monkeypatch.setattr(StepOutput, "verified", accept_all)
    got = spec.generate([REPEATS, [40, 41, 42] * 3], GREEDY)
    assert [o.token_ids for o in got] != [o.token_ids for o in want]


@pytest.mark.slow
def test_smollm2_tokens_are_the_same_with_drafts(smollm2_gguf):
    """The real model on 16 prompts at once, greedy, then seeded: prompt tokens, mixed
    prefill and decode steps and drafts verified in one batch give the tokens of decoding
    one at a time."""
    prompts = ["List the days of the week: Monday, Tuesday,", "def add(a, b):\n    return",
               "1, 2, 3, 4, 5,", "The quick brown fox jumps over the lazy dog. " * 3,
               "A B C D E F G", "Roses are red,", "Once upon a time", "Q: Who wrote Hamlet?\nA:"]
    prompts *= 2
    plain, spec = engine_pair(smollm2_gguf)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=48, temperature=0.7, top_p=0.95, seed=i,
                             ignore_eos=True) for i in range(16)]
    for params in (greedy, seeded):
        accepted = spec.engine.num_accepted_tokens
        want = [o.token_ids for o in plain.generate(prompts, params)]
        got = [o.token_ids for o in spec.generate(prompts, params)]
        assert got == want
        assert spec.engine.num_accepted_tokens > accepted


@pytest.mark.slow
def test_a_server_with_drafts_streams_the_tokens_of_one_without(tiny_model):
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    prompt = "one two three four one two three four one two three"
    offline = LLM(tiny_model, max_model_len=512)
    want = offline.tokenizer.decode(
        offline.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0,
                                                  ignore_eos=True))[0].token_ids)
    with running_server(tiny_model, "--max-batch", "4", "--token-budget", "32",
                        "--speculative-config", config) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        stream = client.completions.create(model=client.models.list().data[0].id,
                                           prompt=prompt, max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("jaxserve:spec_decode")}
    drafted = counts["jaxserve:spec_decode_num_draft_tokens_total"]
    assert 0 < counts["jaxserve:spec_decode_num_accepted_tokens_total"] <= drafted


def test_the_config_is_read_as_vllm_reads_it():
    def sizes(**given):
        config = _speculative_config(json.dumps({"method": "ngram", **given}))
        return config["prompt_lookup_min"], config["prompt_lookup_max"]

    assert sizes(num_speculative_tokens=3) == (5, 5)
    assert sizes(num_speculative_tokens=3, prompt_lookup_max=4) == (4, 4)
    assert sizes(num_speculative_tokens=3, prompt_lookup_min=2) == (2, 2)
    assert sizes(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4) == (2, 4)


@pytest.mark.parametrize("config, error", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "prompt lookup"),
    ('{"method": "ngram"}', "num_speculative_tokens required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "positive integers"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "got draft_model"),
    ("ngram", "not JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, '
     '"prompt_lookup_max": 4}', "prompt_lookup_min (5) <= prompt_lookup_max (4)"),
])
def test_a_bad_speculative_config_is_refused_before_the_model_loads(config, error):
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--speculative-config",
                          config], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and error in out.stderr, out.stderr


DATA_PARALLEL = """
import json, sys
from jaxserve import LLM, SamplingParams
path, prompts = sys.argv[1], json.loads(sys.argv[2])
sizes = dict(num_pages=96, page_size=8, max_model_len=128, max_batch=4, weight_dtype="f32")
params = [SamplingParams(max_tokens=24, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
          for i in range(len(prompts))]  # greedy and seeded
alone = LLM(path, **sizes).generate(prompts, params)
spec = LLM(path, dp=2, num_speculative_tokens=3, **sizes)
got = spec.generate(prompts, params)
print(json.dumps({"same": [o.token_ids for o in got] == [o.token_ids for o in alone],
                  "accepted": spec.engine.num_accepted_tokens}))
"""


@pytest.mark.slow
def test_two_data_shards_verify_their_own_drafts(tiny_path):
    """Each shard's rows and drafts sit in its own part of the step's results."""
    prompts = [REPEATS, [40, 41, 42] * 3, [3] * 12, list(range(100, 130)), [7, 8] * 6]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", DATA_PARALLEL, str(tiny_path),
                          json.dumps(prompts)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"] and result["accepted"] > 0
