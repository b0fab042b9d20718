"""The waiting queue's admission rule: Little's-law bound, token cap, tenant share."""

import re

import pytest

from server.admission import QueuePolicy
from server.protocol import APIError

POLICY = QueuePolicy(max_queue=16, max_queued_tokens=1000)


def refusal(policy: QueuePolicy = POLICY, **kwargs) -> str | None:
    """The 429's message, or None when admitted."""
    args = {"queued": 0, "queued_tokens": 0, "new": 1, "new_tokens": 10, "admission_rate": 2.0}
    try:
        policy.admit(**{**args, **kwargs})
    except APIError as e:
        assert e.status == 429 and e.headers["Retry-After"].isdigit()
        assert e.body["error"]["code"] == "queue_full"
        return e.body["error"]["message"]
    return None


def test_the_bound_and_the_token_cap():
    assert refusal(queued=15, tenant_queued=1) is None
    assert "the queue is full" in refusal(queued=16, tenant_queued=1)
    assert "too many prompt tokens" in refusal(queued_tokens=995)


def test_a_tenant_with_nothing_queued_may_use_the_reserve_beyond_the_bound():
    # a lone flood filled the 16 places: a newcomer still gets one of the 2 kept back
    assert refusal(queued=16, tenant_queued=0) is None
    assert refusal(queued=17, tenant_queued=0) is None
    assert "the queue is full" in refusal(queued=18, tenant_queued=0)


def test_one_tenant_leaves_an_eighth_of_the_queue_while_another_is_live():
    assert POLICY.tenant_share(16) == 14
    assert refusal(queued=13, tenant_queued=13, shared=True) is None
    assert "kept for other tenants" in refusal(queued=14, tenant_queued=14, shared=True)
    assert refusal(queued=14, tenant_queued=14, shared=False) is None  # alone: every place
    assert refusal(queued=14, tenant_queued=0, shared=True) is None  # another tenant gets in


def test_a_tenant_with_nothing_queued_may_queue_a_large_request():
    assert refusal(new=16) is None  # n=16 fits an empty queue
    assert "kept for other tenants" in refusal(queued=1, new=14, tenant_queued=1, shared=True)


def test_the_budget_bound_gives_its_estimated_wait():
    policy = QueuePolicy(wait_budget_s=5.0, min_queue=4)
    # 2 admissions/s over a 5 s budget: 10 requests may wait
    assert refusal(policy, queued=9, tenant_queued=1) is None
    message = refusal(policy, queued=10, tenant_queued=1)
    wait = float(re.search(r"an estimated wait of ([\d.]+)s", message)[1])
    assert wait == pytest.approx(5.5) and "past the 5s budget" in message


@pytest.mark.parametrize("bound, share", [(1, 1), (2, 1), (8, 7), (16, 14), (100, 88)])
def test_tenant_share(bound, share):
    assert QueuePolicy().tenant_share(bound) == share
