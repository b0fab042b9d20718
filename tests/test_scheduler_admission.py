"""Admission order on the scheduler alone: priority class, fair share, reserved rows."""

import time

from jaxserve.buckets import BucketTable
from jaxserve.config import SamplingParams
from jaxserve.page_allocator import PageAllocator
from jaxserve.request import Request
from jaxserve.scheduler import ACTIVE_WINDOW_S, Scheduler

PARAMS = SamplingParams(max_tokens=4)


def scheduler(max_batch: int = 4, reserved_rows: int = 1) -> Scheduler:
    return Scheduler(
        PageAllocator(64), BucketTable.for_limits(max_batch, 16), 4, max_batch, 64,
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
