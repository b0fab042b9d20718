"""Fairness in steps: what the scheduler owes a tenant beside a flood (fake runner, exact).

While tenant A keeps its queue full and holds every row it may (all but the reserved
rows, since tenant B is active), a request from B that arrives between steps is
admitted at the next step, and its first token comes out of the step that ends its
prefill. Each step B's prefill gets the token budget left after the decodes, which
always go first, and after the prefills that go before it: only those of a tenant
holding no more rows than B, admitted earlier. So that step is computable:

    arrival step + ceil((tokens ahead + B's prompt) / (budget − decodes)) − 1

The wall-clock comparison, which on a CPU measures how a step's cost grows with its
rows as much as the scheduling, is bench/fairness.py.
"""

import itertools
import math

import pytest
from fake_engine import make_engine, next_token

from jaxserve.config import SamplingParams

BUDGET = 256  # tokens a step: the server's default
PAGE_SIZE = 16
MAX_MODEL_LEN = 4096
WARM_STEPS = 3  # steps A floods before B's request arrives
A_QUEUED = 4  # A's requests waiting beyond the rows it may hold
# A's requests: (prompt tokens, max_tokens) per flood shape. Decoding: every row of A
# decodes once the warm steps are over, and none ends before B's first token. Prefilling:
# A's rows only prefill (each ends at the step its prefill does), a backlog of 2,000
# tokens a row that B's prompt must not queue behind.
SHAPES = {"decoding": (8, 64), "prefilling": (2000, 1)}
B_MAX_TOKENS = 4


def reserved_rows(max_batch: int) -> int:
    """The server's default reserve (EngineConfig.reserved_rows None)."""
    return max(1, max_batch // 8)


def batch_for(a_rows: int) -> int:
    """The smallest max_batch whose default reserve leaves one tenant `a_rows` rows."""
    return next(m for m in itertools.count(a_rows + 1) if m - reserved_rows(m) == a_rows)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + i) % 97 + 1 for i in range(n)]  # never 0, the fake model's EOS


def expected_first_token_step(arrival: int, b_prompt: int, shape: str, a_rows: int) -> int:
    decodes = a_rows if shape == "decoding" else 0
    ahead = 0
    if shape == "prefilling" and a_rows == 1:
        # A holds one row, as B does: equal tenants, first come first served, so the
        # rest of A's one prefill (admitted at the first warm step) goes first
        ahead = SHAPES["prefilling"][0] - WARM_STEPS * BUDGET
    return arrival + math.ceil((ahead + b_prompt) / (BUDGET - decodes)) - 1


class Flood:
    """Tenant A: a closed loop of more requests than it may run (`A_QUEUED` more than its
    rows), topped up before every step, as many clients sending back to back."""

    def __init__(self, engine, shape: str, a_rows: int) -> None:
        self.engine = engine
        self.prompt_tokens, self.max_tokens = SHAPES[shape]
        self.in_flight = a_rows + A_QUEUED
        self.sent = 0

    def top_up(self) -> None:
        live = sum(r.tenant == "A" for r in self.engine.requests.values())
        for _ in range(self.in_flight - live):
            params = SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
            self.engine.submit(prompt(self.prompt_tokens, self.sent), params,
                               f"a{self.sent}", tenant="A")
            self.sent += 1

    def step(self):
        self.top_up()
        return self.engine.step()


def flooded_engine(shape: str, a_rows: int):
    """An engine where B is active and A, flooding, holds its `a_rows` rows."""
    max_batch = batch_for(a_rows)
    longest = max(SHAPES[shape][0] + SHAPES[shape][1], 2000 + B_MAX_TOKENS)
    num_pages = 1 + (a_rows + 2) * -(-longest // PAGE_SIZE)  # pages never bind
    engine, _ = make_engine(
        num_pages, PAGE_SIZE, max_batch, BUDGET, MAX_MODEL_LEN, stream_capacity=128,
        prefix_caching=False,  # cached prefixes would shorten prefills and blur the count
        reserved_rows=reserved_rows(max_batch),
    )
    earlier = engine.submit([5], SamplingParams(max_tokens=1), "b-earlier", tenant="B")
    engine.step()  # B has sent a request just now: it is active
    assert earlier.get(timeout=0).finish_reason == "length"
    flood = Flood(engine, shape, a_rows)
    for _ in range(WARM_STEPS):
        flood.step()
    running = list(engine.scheduler.running.values())
    assert [r.tenant for r in running] == ["A"] * a_rows  # every row A may hold
    assert all(r.in_prefill == (shape == "prefilling") for r in running)
    return engine, flood


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("a_rows", [1, 8, 63, 64])
@pytest.mark.parametrize("b_prompt", [1, 7, 256, 513, 2000])
def test_b_is_admitted_next_step_and_its_first_token_ends_its_prefill(shape, a_rows, b_prompt):
    engine, flood = flooded_engine(shape, a_rows)
    flood.top_up()
    arrival = engine.scheduler.step_index  # B arrives between steps
    ids = prompt(b_prompt, 50)
    stream = engine.submit(ids, SamplingParams(max_tokens=B_MAX_TOKENS, ignore_eos=True), "b",
                           tenant="B")
    plan = engine.step()
    assert plan.step == arrival and "b" in plan.admitted
    while not len(stream):
        assert plan.step < arrival + 100, "B's first token never came"
        plan = flood.step()
    assert plan.step == expected_first_token_step(arrival, b_prompt, shape, a_rows)
    (chunk,) = [c for c in plan.chunks if c.request_id == "b"]
    assert chunk.samples and chunk.start + len(chunk.token_ids) == b_prompt  # its prefill ends
    assert stream.get(timeout=0).token_ids == (next_token(ids[-1]),)


def test_a_tenant_new_to_the_window_waits_for_the_first_row_to_free():
    """The guarantee's premise: only while B is active does A leave the reserved rows
    free. A tenant alone uses the whole batch and nothing is preempted, so B's first
    request in ACTIVE_WINDOW_S waits until one of A's requests ends."""
    max_batch = 9
    engine, _ = make_engine(1 + 16 * 4, PAGE_SIZE, max_batch, BUDGET, MAX_MODEL_LEN,
                            stream_capacity=128, prefix_caching=False,
                            reserved_rows=reserved_rows(max_batch))
    for i in range(max_batch + A_QUEUED):  # the shortest, a0, ends at step 19: its 20th token
        engine.submit(prompt(8, i), SamplingParams(max_tokens=20 + i, ignore_eos=True), f"a{i}",
                      tenant="A")
    engine.step()
    assert engine.scheduler.running_per_tenant["A"] == max_batch  # alone: every row
    engine.submit(prompt(7), SamplingParams(max_tokens=1), "b", tenant="B")
    admitted = {}
    while "b" not in admitted:
        plan = engine.step()
        assert plan.step < 100, "B was never admitted"
        admitted.update(dict.fromkeys(plan.admitted, plan.step))
    assert admitted == {"b": 20}  # the step after a0 ended, and before A takes its row back


def test_an_interactive_prefill_goes_before_an_older_batch_prefill():
    engine, _ = make_engine(1 + 126 + 19, PAGE_SIZE, 2, BUDGET, MAX_MODEL_LEN, prefix_caching=False)
    params = SamplingParams(max_tokens=1)
    engine.submit(prompt(2000), params, "batch", tenant="A", priority=1)
    engine.step()  # the batch request's prefill has begun: 1,744 tokens left
    engine.submit(prompt(300), params, "chat", tenant="B", priority=0)
    plan = engine.step()
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("chat", BUDGET)]
