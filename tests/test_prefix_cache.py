"""Prefix caching on SmolLM2: outputs equal those without it, in any order, under eviction."""

import random

import pytest

from jaxserve import LLM, SamplingParams

SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. Answer in one short sentence, "
    "and never invent facts you are unsure of.<|im_end|>\n<|im_start|>user\n"
)
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 3 + 4?",
    "What is the capital of France?",  # the same prompt twice: a fully cached prefix
    "Which planet is largest?",
    "Say hello in Spanish.",
]
PROMPTS = [SYSTEM + q + "<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = {"page_size": 4, "max_batch": 4, "token_budget": 64}


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    llm = LLM(smollm2_gguf, num_pages=128, prefix_caching=False, **ENGINE)
    return {p: out.token_ids for p, out in zip(PROMPTS, llm.generate(PROMPTS, PARAMS))}


@pytest.fixture(scope="module")
def cached_llm(smollm2_gguf):
    # 40 usable pages of 4 tokens: two or three sequences at a time, so cached pages
    # are evicted and recomputed as the orders below run
    return LLM(smollm2_gguf, num_pages=41, prefix_caching=True, debug_checks=True, **ENGINE)


def run_interleaved(llm: LLM, order: list[int], rng: random.Random) -> dict[str, list[int]]:
    streams, pending = {}, list(order)
    while pending or llm.engine.has_work():
        if pending and rng.random() < 0.5:
            i = pending.pop(0)
            streams[i] = llm.engine.submit(llm.encode(PROMPTS[i]), PARAMS)
        if llm.engine.has_work():
            llm.engine.step()
    results = {}
    for i, stream in streams.items():
        tokens, finished = [], False
        while not finished:
            item = stream.get(timeout=0)
            tokens += item.token_ids
            finished = item.finished
        results[PROMPTS[i]] = tokens
    return results


@pytest.mark.slow
def test_outputs_equal_the_uncached_ones_in_many_orders(cached_llm, reference):
    rng = random.Random(0)
    hits_before = cached_llm.scheduler.prefix_hits
    orders = [list(range(len(PROMPTS))), list(reversed(range(len(PROMPTS))))]
    orders += [rng.sample(range(len(PROMPTS)), len(PROMPTS)) for _ in range(2)]
    for order in orders:
        assert run_interleaved(cached_llm, order, rng) == reference
        for prompt, out in zip(PROMPTS, cached_llm.generate(PROMPTS, PARAMS)):
            assert out.token_ids == reference[prompt]
    scheduler, alloc = cached_llm.scheduler, cached_llm.scheduler.allocators[0]
    assert scheduler.prefix_hits > hits_before  # the cache was really used
    assert alloc.num_evictions > 0  # and ran out of room
    assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable
