"""Admission order on the scheduler alone: priority class, fair share, reserved rows."""

import time

from jaxserve.config import SamplingParams
from jaxserve.host.buckets import BucketTable
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.request import Request
from jaxserve.host.scheduler import ACTIVE_WINDOW_S, Scheduler

PARAMS = SamplingParams(max_tokens=4)


def scheduler(max_batch: int = 4, reserved_rows: int = 1) -> Scheduler:
    return Scheduler(
        [PageAllocator(64)], BucketTable.for_limits(max_batch, 16), 4, max_batch, 64,
        token_budget=16, reserved_rows=reserved_rows,
    )


def request(request_id: str, tenant: str, priority: int = 0, age: float = 0.0) -> Request:
    return Request(request_id, (1, 2, 3), PARAMS, 0, time.monotonic() - age, tenant, priority)


def admitted(s: Scheduler) -> tuple[str, ...]:
    return s.schedule().admitted


def test_the_interactive_class_goes_before_an_older_batch_request():
    s = scheduler(max_batch=1, reserved_rows=0)
    s.add(request("batch", "a", priority=1))
    s.add(request("chat", "b", priority=0))
    assert admitted(s) == ("chat",)


def test_the_tenant_with_fewer_rows_goes_before_an_older_request():
    s = scheduler(max_batch=4, reserved_rows=0)
    for i in range(3):
        s.add(request(f"a{i}", "a"))
    assert admitted(s) == ("a0", "a1", "a2")
    s.add(request("a3", "a"))
    s.add(request("b0", "b"))
    assert admitted(s) == ("b0",)  # the last row: b holds none, a holds three


def test_a_tenant_alone_fills_the_batch():
    s = scheduler(max_batch=4, reserved_rows=1)
    for i in range(5):
        s.add(request(f"a{i}", "a"))
    assert len(admitted(s)) == 4


def test_while_another_tenant_is_active_a_flood_leaves_the_reserved_row_free():
    s = scheduler(max_batch=4, reserved_rows=1)
    s.add(request("b0", "b"))
    assert admitted(s) == ("b0",)
    s.finish("b0")  # b is idle now, but active: it sent a request just now
    for i in range(6):
        s.add(request(f"a{i}", "a"))
    assert admitted(s) == ("a0", "a1", "a2")  # a's cap: 4 - 1 rows
    assert admitted(s) == ()
    s.add(request("b1", "b"))
    assert admitted(s) == ("b1",)  # the free row lets b start at once


def test_a_tenant_idle_past_the_window_no_longer_holds_a_row_back():
    s = scheduler(max_batch=4, reserved_rows=1)
    s.add(request("b0", "b", age=ACTIVE_WINDOW_S + 1))
    assert admitted(s) == ("b0",)
    s.finish("b0")
    for i in range(4):
        s.add(request(f"a{i}", "a"))
    assert len(admitted(s)) == 4


# ---------------------------------------------------------------- data shards


def sharded(num_shards: int = 2, max_batch: int = 2, num_pages: int = 64) -> Scheduler:
    return Scheduler(
        [PageAllocator(num_pages) for _ in range(num_shards)],
        BucketTable.for_limits(max_batch, 16), 4, max_batch, 64, token_budget=16,
    )


def run_prefill(s: Scheduler) -> None:
    """Steps (admitting first) until no running request is in prefill; samples are token 7."""
    while True:
        plan = s.schedule()
        for chunk in plan.chunks:
            request = s.running[chunk.request_id]
            if chunk.samples:
                request.append(7)
            s.advance(request, chunk, int(chunk.samples))
        if not any(r.in_prefill for r in s.running.values()):
            return


def test_requests_spread_over_the_data_shards_and_each_shard_is_one_bucket():
    s = sharded()
    for i in range(5):
        s.add(request(f"r{i}", "a"))
    out = s.schedule()
    assert out.admitted == ("r0", "r1", "r2", "r3")  # 2 rows on each of 2 shards
    shards = [s.running[r].shard for r in out.admitted]
    assert sorted(shards) == [0, 0, 1, 1]
    # each shard's batch is 2 rows of 3 prompt tokens: the shared bucket holds one shard
    assert out.bucket == s.buckets.choose(6, 2)
    assert {r.row for r in s.running.values() if r.shard == 1} == {0, 1}
    s.check_invariants()
    s.finish("r1")
    s.schedule()
    assert s.running["r4"].shard == shards[1]  # the shard with the free row
    s.check_invariants()


def test_the_least_loaded_shard_counts_the_prefix_it_already_holds():
    s = sharded()
    prompt = tuple(range(10, 19))  # 9 tokens: 2 full pages of 4 reusable
    s.add(Request("first", prompt, PARAMS, 0, time.monotonic(), "a"))
    run_prefill(s)  # "first" decodes on shard 0, its two full pages cached there
    assert s.running["first"].shard == 0
    s.add(Request("again", prompt, PARAMS, 0, time.monotonic(), "a"))
    s.schedule()
    # shard 0: 1 decode + 1 uncached token to compute; shard 1: 9 tokens
    assert s.running["again"].shard == 0
    assert s.running["again"].num_cached_tokens == 8
    s.check_invariants()


def test_a_request_waits_when_no_shard_has_its_pages():
    s = sharded(num_pages=5)  # 4 usable pages a shard: one 16-token request each
    for i in range(3):
        s.add(Request(f"r{i}", tuple(range(12)), PARAMS, 0, time.monotonic(), "a"))
    assert s.schedule().admitted == ("r0", "r1")
    assert [r.request_id for r in s.waiting] == ["r2"]
    s.finish("r0")
    assert s.schedule().admitted == ("r2",)
    s.check_invariants()
