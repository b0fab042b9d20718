"""The engine on real weights: batch invariance, chunked prefill, no compiles while serving."""

import random

import pytest
from hf_models import save_random_model

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.device import runner
from jaxserve.device.batch import pack_step
from jaxserve.device.runner import compile_count

PROMPT = "Write a short poem about the sea and the sky."
TARGET = "target"  # the request id of PROMPT in a batch
OTHERS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return",
    "List three colours:",
    "Once upon a time",
    "1, 2, 3, 4, 5,",
    "Translate to French: good morning",
    "What is the boiling point of water?",
    "Explain gravity in one sentence. " * 2,
    "The best way to learn is",
    "Bonjour, je m'appelle",
    "import numpy as np\n",
    "Q: Who wrote Hamlet?\nA:",
    "Roses are red,",
    "A B C D E F G",
]


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(smollm2_gguf, max_batch=16, num_pages=256, token_budget=256, debug_checks=True)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=1234, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_tokens_are_the_same_alone_and_in_a_batch_of_16(llm, params):
    alone = llm.generate([PROMPT], params)[0].token_ids
    assert tokens_in_a_batch_of_16(llm, params) == alone
    alloc = llm.scheduler.allocators[0]
    assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable


def test_the_batch_invariance_test_fails_on_a_corrupted_page_table(llm, monkeypatch):
    """The check above can fail: with two of the target row's pages swapped in the page
    table the step reads (its K/V still written where they belong), its tokens differ."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].token_ids
    corrupted = []

    def pack_with_swapped_pages(chunks, *args, **kwargs):
        inputs = pack_step(chunks, *args, **kwargs)
        for row, chunk in enumerate(chunks):
            if chunk.request_id == TARGET:
                assert len(chunk.pages) >= 2  # prompt and output span pages 0 and 1
                table = inputs.metadata.page_table
                table[row, [0, 1]] = table[row, [1, 0]]
                corrupted.append(row)
        return inputs

    monkeypatch.setattr(runner, "pack_step", pack_with_swapped_pages)
    assert tokens_in_a_batch_of_16(llm, params) != alone
    assert len(corrupted) == len(alone)  # every step the target ran: its prefill, 23 decodes


def tokens_in_a_batch_of_16(llm, params: SamplingParams) -> list[int]:
    """The tokens of PROMPT (request TARGET), run 8th of 16 with the 15 OTHERS."""
    others = SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=False)
    streams = [llm.engine.submit(llm.encode(p), others) for p in OTHERS[:7]]
    target = llm.engine.submit(llm.encode(PROMPT), params, request_id=TARGET)
    streams += [llm.engine.submit(llm.encode(p), others) for p in OTHERS[7:]]
    while llm.engine.has_work():
        llm.engine.step()
    batched, finished = [], False
    while not finished:
        item = target.get(timeout=0)
        batched += item.token_ids
        finished = item.finished
    return batched


def test_chunked_prefill_gives_the_same_tokens(llm, smollm2_gguf):
    long_prompt = " ".join(OTHERS) + PROMPT
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    whole = llm.generate([long_prompt], params)[0]
    assert len(whole.prompt_token_ids) > 100
    chunked_llm = LLM(smollm2_gguf, max_batch=4, num_pages=64, token_budget=16)
    chunked = chunked_llm.generate([long_prompt], params)[0]
    assert chunked.token_ids == whole.token_ids


@pytest.mark.slow
def test_no_compile_after_warmup_over_200_mixed_requests(tmp_path, smollm2_gguf):
    save_random_model("llama-gqa-tied", tmp_path / "model")
    Tokenizer.from_gguf(smollm2_gguf).save(tmp_path / "model")  # prompts are ids < 256
    rng = random.Random(0)
    llm = LLM(
        tmp_path / "model", max_batch=8, num_pages=128, page_size=8, token_budget=64,
        max_model_len=256, warmup=True, debug_checks=True,
    )
    before = compile_count()
    for _ in range(4):  # 4 waves of 50: prompts and outputs of many lengths
        prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 120))] for _ in range(50)]
        params = [
            SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.5, ignore_eos=True)
            for _ in prompts
        ]
        outs = llm.generate(prompts, params)
        assert all(o.finish_reason == "length" for o in outs)
    assert compile_count() == before
    assert llm.runner.compiles_after_warmup == 0


@pytest.mark.slow
def test_tpot_slo_caps_the_batch_from_warmup_step_times(tmp_path, smollm2_gguf):
    save_random_model("llama-gqa-tied", tmp_path / "model")
    Tokenizer.from_gguf(smollm2_gguf).save(tmp_path / "model")
    engine = {"max_batch": 4, "num_pages": 64, "page_size": 8, "token_budget": 8,
              "max_model_len": 128}
    generous = LLM(tmp_path / "model", warmup=True, tpot_slo_ms=60_000, **engine)
    assert generous.scheduler.max_batch == 4
    times = generous.runner.step_times
    assert set(times) == set(generous.runner.buckets.buckets())
    # a binding SLO lowers the batch: to one row when no bucket's step fits it
    tight = LLM(tmp_path / "model", warmup=True, tpot_slo_ms=1e-6, **engine)
    assert tight.scheduler.max_batch == 1
    # without a warm-up there are no step times to cap the batch by: said, not ignored
    with pytest.raises(ValueError, match="warmup=True"):
        LLM(tmp_path / "model", tpot_slo_ms=50, **engine)


def test_generate_outputs_longer_than_the_stream_buffer(tmp_path, smollm2_gguf):
    save_random_model("llama-gqa-tied", tmp_path / "model")
    Tokenizer.from_gguf(smollm2_gguf).save(tmp_path / "model")
    llm = LLM(tmp_path / "model", num_pages=64, page_size=8, max_model_len=256,
              stream_capacity=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9]], params)
    assert [len(o.token_ids) for o in outs] == [40, 40]
    assert all(o.finish_reason == "length" for o in outs)


def test_async_scheduling_gives_the_tokens_of_steps_planned_after_their_results(tiny_model):
    """With async scheduling each step is planned and launched before the previous one's
    tokens are read (a decode's token is filled in on the device): every request's output
    is the one it gets with steps planned after reading, across greedy and seeded rows,
    penalties, logit bias, logprobs, prompt logprobs, chunked prefills and rows that
    finish at different steps."""
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 3000) for _ in range(rng.randint(3, 40))]
               for _ in range(10)]
    kinds = [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.4, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.7, seed=5, top_k=20, logprobs=3,
                       ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((42, 100.0),)),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    engine = {"max_batch": 4, "num_pages": 64, "token_budget": 16, "debug_checks": True}
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(tiny_model, async_scheduling=async_scheduling, **engine)
        assert llm.engine.async_scheduling is async_scheduling
        outputs[async_scheduling] = [
            (o.token_ids, o.finish_reason, o.prompt_logprobs)
            for o in llm.generate(prompts, params)]
        alloc = llm.scheduler.allocators[0]
        assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable
    assert outputs[True] == outputs[False]
    assert outputs[True][5][0] == [42] * 8  # the biased row, decoded with placeholders
