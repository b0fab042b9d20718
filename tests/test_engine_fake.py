"""The engine loop, step by step, on a fake model (exact, no jax)."""

import threading
import time

import pytest
from fake_engine import EOS, VOCAB, make_engine, next_token

from jaxserve.config import SamplingParams
from jaxserve.host.engine import EngineFailed
from jaxserve.host.plan import pending_token
from jaxserve.host.request import RequestRejected


def drain(stream) -> tuple[list[int], str, str]:
    tokens, text, reason = [], "", None
    while reason is None:
        item = stream.get(timeout=0)
        tokens += item.token_ids
        text += item.text
        reason = item.finish_reason
    return tokens, text, reason


def plan(out) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(c.request_id, c.start, c.token_ids) for c in out.chunks]


def test_admission_chunks_pages_and_frees_step_by_step():
    engine, _ = make_engine(
        num_pages=9, page_size=4, max_batch=2, token_budget=8, prefix_caching=False
    )
    sched, alloc = engine.scheduler, engine.scheduler.allocators[0]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    a = engine.submit(list(range(10, 20)), params, "a")  # 10 prompt + 3 = 13 → 4 pages
    b = engine.submit([30, 31], params, "b")  # 5 → 2 pages
    c = engine.submit([40, 41, 42, 43, 44, 45], params, "c")  # 9 → 3 pages

    out = engine.step()  # a and b admitted (batch of 2); a's prefill is chunked at 8
    assert out.admitted == ("a", "b")
    assert plan(out) == [("a", 0, tuple(range(10, 18)))]
    assert out.bucket == (8, 1)
    assert sched.running["a"].pages == (1, 2, 3, 4) and sched.running["b"].pages == (5, 6)
    assert alloc.num_free == 2 and [r.request_id for r in sched.waiting] == ["c"]

    out = engine.step()  # a finishes its prefill (2 tokens) and samples; b prefills in full
    assert plan(out) == [("a", 8, (18, 19)), ("b", 0, (30, 31))]
    assert out.bucket == (4, 2)

    out = engine.step()  # both decode
    assert plan(out) == [("a", 10, (20,)), ("b", 2, (32,))]
    out = engine.step()
    assert plan(out) == [("a", 11, (21,)), ("b", 3, (33,))]
    # both sampled their third token: finished, pages freed at once
    assert sched.running == {} and alloc.num_free == 8

    out = engine.step()  # c is admitted now that pages are free
    assert out.admitted == ("c",) and plan(out) == [("c", 0, (40, 41, 42, 43, 44, 45))]
    assert sched.running["c"].pages == (6, 5, 4)  # reused pages, last freed first

    assert drain(a)[0] == [20, 21, 22] and drain(b)[0] == [32, 33, 34]
    while engine.has_work():
        engine.step()
    tokens, text, reason = drain(c)
    # words join with spaces, so the first generated word follows the prompt's last one
    assert (tokens, text, reason) == ([46, 47, 48], " w46 w47 w48", "length")
    assert alloc.num_free == alloc.num_usable


def test_eos_stops_and_decodes_run_before_prefills():
    engine, _ = make_engine(max_batch=4, token_budget=4)
    s1 = engine.submit([97, 98], SamplingParams(max_tokens=10))  # 98 → 99 → 0 (EOS)
    engine.step()  # s1 prefill, samples 99
    s2 = engine.submit([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=2, ignore_eos=True))
    out = engine.step()
    # s1's decode goes first; s2's prefill takes the rest of the budget (3 of 6 tokens)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [
        ("req-1", 1),
        ("req-2", 3),
    ]
    while engine.has_work():
        engine.step()
    assert drain(s1) == ([99, EOS], " w99", "stop")
    assert drain(s2)[0] == [11, 12]


def test_request_submitted_while_8_decode_starts_prefill_next_step():
    engine, _ = make_engine(num_pages=65, page_size=16, max_batch=16, token_budget=32)
    for i in range(8):
        engine.submit([10 + i], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 8
    late = engine.submit([50, 51, 52], SamplingParams(max_tokens=2, ignore_eos=True), "late")
    out = engine.step()
    assert ("late", 0, (50, 51, 52)) in plan(out)
    assert out.step == 3 and out.admitted == ("late",)
    del late


def test_cancel_frees_pages_by_the_next_step_and_ends_the_stream():
    engine, _ = make_engine()
    stream = engine.submit([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), "x")
    engine.step()
    assert engine.scheduler.allocators[0].num_used == 6  # ceil(23 / 4)
    engine.cancel("x")
    engine.step()
    assert engine.scheduler.allocators[0].num_used == 0
    assert drain(stream)[2] == "abort"


def test_a_consumer_that_falls_behind_loses_nothing_and_cancels_nothing():
    """Past its buffer's capacity a request's outputs merge (stream.py): the engine
    never waits for a consumer, nor cancels one that lags; it finishes and is freed."""
    engine, _ = make_engine(stream_capacity=2)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    slow = engine.submit([1], params, "slow")
    fast = engine.submit([2], params, "fast")
    fast_outputs = []
    while engine.has_work():
        engine.step()
        while len(fast):
            fast_outputs.append(fast.get(timeout=0))
    assert [len(o.token_ids) for o in fast_outputs] == [1] * 20  # read as it came
    items = [slow.get(timeout=0) for _ in range(len(slow))]
    # the first output, the other 18 merged, the final one
    assert [len(o.token_ids) for o in items] == [1, 18, 1]
    assert [o.num_steps for o in items] == [1, 18, 1]
    assert items[-1].finish_reason == "length"
    tokens = [t for o in items for t in o.token_ids]
    assert tokens == [next_token(t) for t in [1, *tokens[:-1]]]
    assert "".join(o.text for o in items) == "".join(f" w{t}" for t in tokens)
    alloc = engine.scheduler.allocators[0]
    assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable


def test_requests_that_can_never_fit_are_rejected_at_once():
    engine, _ = make_engine(num_pages=9, max_model_len=64)
    with pytest.raises(RequestRejected, match="exceeds the model's context of 64"):
        engine.submit(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="needs 10 KV pages, the pool has 8"):
        engine.submit(list(range(30)), SamplingParams(max_tokens=10))
    assert not engine.has_work()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_mix_of_finish_cancel_reject_returns_every_page(async_scheduling):
    import random

    rng = random.Random(0)
    engine, _ = make_engine(num_pages=41, page_size=4, max_batch=6, token_budget=12,
                            async_scheduling=async_scheduling)
    streams = []
    for _ in range(400):
        if rng.random() < 0.3:
            prompt = [rng.randrange(1, 100) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5)
            try:
                streams.append(engine.submit(prompt, params))
            except RequestRejected:
                pass
        if streams and rng.random() < 0.1:
            engine.cancel(rng.choice(streams).request_id)
        engine.step()  # debug_checks: the page books are verified after every step
    while engine.has_work():
        engine.step()
    alloc = engine.scheduler.allocators[0]
    assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable
    assert not engine.requests
    for stream in streams:
        assert drain(stream)[2] in ("stop", "length", "abort")


def test_a_cached_prefix_is_reused_and_only_the_rest_is_prefilled():
    engine, runner = make_engine(num_pages=33, page_size=4, max_batch=4, token_budget=16)
    system = list(range(10, 22))  # 3 full pages
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = engine.submit(system + [50, 51], params, "first")
    while engine.has_work():
        engine.step()
    pages_of_first = runner.steps[0].chunks[0].pages
    second = engine.submit(system + [60], params, "second")
    out = engine.step()
    seq = engine.scheduler.running["second"]
    assert seq.pages[:3] == pages_of_first[:3]  # the system prompt's pages, shared
    assert plan(out) == [("second", 12, (60,))]  # only the question is prefilled
    assert engine.scheduler.prefix_hits == 12
    while engine.has_work():
        engine.step()
    assert drain(first)[0] == [52, 53] and drain(second)[0] == [61, 62]

    # a prompt of cached full pages only: its last page is recomputed (logits needed)
    third = engine.submit(system, params, "third")
    out = engine.step()
    assert plan(out) == [("third", 8, (18, 19, 20, 21))]
    while engine.has_work():
        engine.step()
    assert drain(third)[0] == [22, 23]
    alloc = engine.scheduler.allocators[0]
    assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable


def test_cache_salt_keeps_tenants_apart():
    engine, _ = make_engine(page_size=4)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = list(range(10, 19))
    for request_id, salt, reused in [("a", "A", 0), ("a2", "A", 8), ("b", "B", 0)]:
        engine.submit(prompt, params, request_id, tenant=salt, cache_salt=salt)
        out = engine.step()
        assert plan(out)[0][1] == reused, request_id
        while engine.has_work():
            engine.step()


class Drafts:
    """Proposes k drafts: the fake model's own next tokens, but wrong at the indices
    `wrong_at` (so the step accepts the drafts before the first wrong one)."""

    def __init__(self, k: int, wrong_at: tuple[int, ...] = ()) -> None:
        self.k, self.wrong_at = k, wrong_at

    def propose(self, request) -> tuple[int, ...]:
        drafts, last = [], request.token_ids[-1]
        for i in range(self.k):
            last = next_token(last)
            drafts.append((last + 50) % VOCAB if i in self.wrong_at else last)
        return tuple(drafts)


def generate(prompts, params, proposer=None, page_size=4):
    engine, runner = make_engine(page_size=page_size, proposer=proposer)
    streams = [engine.submit(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    alloc = engine.scheduler.allocators[0]
    assert alloc.num_free + alloc.num_cached == alloc.num_usable and not engine.requests
    for plan in runner.steps:  # drafts never run past the pages reserved for the request
        assert all(c.start + len(c.token_ids) <= len(c.pages) * page_size for c in plan.chunks)
    return [drain(s) for s in streams], runner.steps


def test_rows_of_k_tokens_accept_drafts_and_give_the_same_tokens_in_fewer_steps():
    prompts = [[5, 6], [20], [40, 41, 42]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want, plain_steps = generate(prompts, params)
    good, good_steps = generate(prompts, params, Drafts(2))
    half, half_steps = generate(prompts, params, Drafts(2, wrong_at=(1,)))
    none, none_steps = generate(prompts, params, Drafts(2, wrong_at=(0,)))
    assert good == half == none == want
    assert all(r[2] == "length" and len(r[0]) == 10 for r in good)
    # 3 tokens a step with good drafts, 2 with the second wrong, 1 with both
    assert len(good_steps) < len(half_steps) < len(none_steps) == len(plain_steps)
    rows = [c for plan in good_steps for c in plan.chunks if c.num_speculative]
    assert rows and all(len(c.token_ids) == 1 + c.num_speculative for c in rows)
    assert max(c.num_speculative for c in rows) == 2


def test_a_stop_among_accepted_drafts_drops_the_tokens_after_it():
    # 97 -> 98 -> 99 -> 0 (EOS): the row [98, 99, 0] accepts 99, 0 and samples 1 after
    # them; EOS ends the request, 1 is dropped
    (result,), _ = generate([[96, 97]], SamplingParams(max_tokens=10), Drafts(2))
    assert result == ([98, 99, EOS], " w98 w99", "stop")
    # max_tokens cuts the accepted tokens too, and drafts stop at the reserved pages
    (result,), _ = generate([[5]], SamplingParams(max_tokens=4, ignore_eos=True), Drafts(3))
    assert result[0] == [6, 7, 8, 9] and result[2] == "length"


def _drain(stream) -> list:
    items = []
    while len(stream):
        items.append(stream.get(timeout=0))
    return items


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_step_fails_the_engine_and_every_request_once(async_scheduling):
    engine, runner = make_engine(async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    streams = [engine.submit([5, 6, 7], params) for _ in range(3)]
    engine.step()

    def broken(plan):
        raise RuntimeError("device lost")

    runner.execute = broken
    engine.start(step_timeout_s=30)
    deadline = time.monotonic() + 5
    while engine.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.stop()
    assert "device lost" in engine.failure
    for stream in streams:
        assert _drain(stream)[-1].finish_reason == "error"
    sched = engine.scheduler  # every page returned (a full one may stay cached)
    assert sched.num_pages_free + sched.num_pages_cached == sched.num_pages_usable
    with pytest.raises(EngineFailed):
        engine.submit([5], params)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_watchdog_fails_a_step_that_hangs(async_scheduling):
    engine, runner = make_engine(async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    stream = engine.submit([5, 6, 7], params)
    hang = threading.Event()
    runner.execute = lambda plan: hang.wait() or None
    engine.start(step_timeout_s=0.2)
    deadline = time.monotonic() + 5
    while engine.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.failure is not None and "hung" in engine.failure
    assert _drain(stream)[-1].finish_reason == "error"
    hang.set()
    engine.stop()


# ---------------------------------------------------------------- async scheduling


def run_mix(async_scheduling: bool, seed: int = 0) -> tuple[list, list]:
    """A random mix of prompts (some stop at EOS, some at max_tokens or a stop string),
    prefix-shared, submitted over the first steps; every output and every plan."""
    import random

    rng = random.Random(seed)
    engine, runner = make_engine(num_pages=41, page_size=4, max_batch=6, token_budget=12,
                                 async_scheduling=async_scheduling)
    system = [30, 31, 32, 33, 34, 35, 36, 37]
    streams = []
    for i in range(40):
        start = rng.choice([[], system])
        prompt = start + [rng.randrange(1, 100) for _ in range(rng.randint(1, 12))]
        stop = ("w99",) if rng.random() < 0.2 else ()
        params = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.3,
                                stop=stop)
        streams.append(engine.submit(prompt, params, f"r{i}"))
        if rng.random() < 0.5:
            engine.step()
    while engine.has_work():
        engine.step()
    alloc = engine.scheduler.allocators[0]
    assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable
    assert not engine.requests and sum(engine.num_finished.values()) == 40
    return [drain(s) for s in streams], runner.steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_scheduling_gives_every_request_the_same_output(seed):
    """Steps planned before the previous one's tokens are read (placeholders filled in on
    the device) give the same tokens, text and finish reasons as steps planned after."""
    sync_outputs, _ = run_mix(False, seed)
    async_outputs, steps = run_mix(True, seed)
    assert async_outputs == sync_outputs
    placeholders = [t for p in steps for c in p.chunks for t in c.token_ids if t < 0]
    assert placeholders  # the mix did decode while a step was in flight


def test_with_async_scheduling_a_stopped_row_runs_once_more_and_frees_a_step_later():
    engine, runner = make_engine(async_scheduling=True)
    alloc = engine.scheduler.allocators[0]
    stream = engine.submit([97, 98], SamplingParams(max_tokens=10), "eos")  # 99, then EOS
    engine.step()  # the prefill is launched; nothing is read yet
    assert len(stream) == 0
    out = engine.step()  # 99's decode is launched before 99 is read, as a placeholder
    assert plan(out) == [("eos", 2, (pending_token(0),))]
    assert _drain(stream)[0].token_ids == (99,)  # then the prefill's results were read
    engine.step()  # EOS is read, while the step in flight computes the row once more
    assert engine.scheduler.running and not engine.requests
    assert _drain(stream)[0].finish_reason == "stop"
    engine.step()  # that step is read, its token dropped: the pages are free
    assert not engine.has_work() and alloc.num_used == 0
    assert len(runner.steps) == 3  # the prefill, 99's decode, EOS's decode (wasted)


def test_with_async_scheduling_a_request_at_max_tokens_is_planned_no_more():
    engine, runner = make_engine(async_scheduling=True)
    alloc = engine.scheduler.allocators[0]
    stream = engine.submit([5], SamplingParams(max_tokens=2, ignore_eos=True), "two")
    while engine.has_work():
        engine.step()
    assert len(runner.steps) == 2  # the prefill and one decode: no wasted row
    assert drain(stream)[0] == [6, 7] and alloc.num_used == 0


def test_with_async_scheduling_a_cancel_frees_pages_once_the_step_in_flight_ran():
    engine, runner = make_engine(async_scheduling=True)
    alloc = engine.scheduler.allocators[0]
    stream = engine.submit([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), "x")
    engine.step()
    engine.step()
    engine.cancel("x")
    engine.step()  # the step in flight is read; the request is planned no more
    assert alloc.num_used == 0 and not engine.has_work()
    assert len(runner.steps) == 2 and drain(stream)[2] == "abort"
