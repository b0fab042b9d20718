"""The waiting queue's admission rule: Little's-law bound, token cap, tenant share."""

import pytest

from server.admission import QueuePolicy
from server.protocol import APIError

POLICY = QueuePolicy(max_queue=16, max_queued_tokens=1000)


def refusal(**kwargs) -> str | None:
    """The 429's message, or None when admitted."""
    args = {"queued": 0, "queued_tokens": 0, "new": 1, "new_tokens": 10, "admission_rate": 2.0}
    try:
        POLICY.admit(**{**args, **kwargs})
    except APIError as e:
        assert e.status == 429 and e.headers["Retry-After"].isdigit()
        assert e.body["error"]["code"] == "queue_full"
        return e.body["error"]["message"]
    return None


def test_the_bound_and_the_token_cap():
    assert refusal(queued=15) is None
    assert "the queue is full" in refusal(queued=16)
    assert "too many prompt tokens" in refusal(queued_tokens=995)


def test_one_tenant_leaves_an_eighth_of_the_queue_to_the_others():
    assert POLICY.tenant_share(16) == 14
    assert refusal(queued=13, tenant_queued=13) is None
    assert "kept for other tenants" in refusal(queued=14, tenant_queued=14)
    assert refusal(queued=14, tenant_queued=0) is None  # another tenant gets in
    assert "the queue is full" in refusal(queued=16, tenant_queued=2)


def test_a_tenant_with_nothing_queued_may_queue_a_large_request():
    assert refusal(new=16) is None  # n=16 fits an empty queue
    assert "kept for other tenants" in refusal(queued=1, new=14, tenant_queued=1)


@pytest.mark.parametrize("bound, share", [(1, 1), (2, 1), (8, 7), (16, 14), (100, 88)])
def test_tenant_share(bound, share):
    assert QueuePolicy().tenant_share(bound) == share
