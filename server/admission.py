"""The bounded waiting queue: how deep it may get, and when to come back.

Only requests that must wait count: a request that the next step will admit (a free
row and its pages are there) is not queued in any sense a client feels, so a
closed-loop client that keeps `--max-batch` requests in flight is never refused.

Little's law sizes the queue: depth = wait budget × admission rate. The rate is the
engine's, measured over its recent admissions; until there is one, it is estimated
from the warm-up's step times (a full batch of rows, each generating a typical answer).
The depth never falls below the batch size. Past the bound, or past the queued-token
cap, a request is refused at once with 429, a message giving the estimated wait, and a
Retry-After from the drain rate.

Tenants: while another tenant has requests queued or running, one tenant may hold all
but an eighth of the queue's places (at least one), so a script flooding the replica
leaves the others room to queue, as the scheduler's reserved rows leave them room to
run. A tenant alone may use every place. A tenant with nothing queued may also use that
eighth beyond the bound, so a newcomer is not refused because a lone flood filled the
queue before it came.
"""

import math
from dataclasses import dataclass

from jaxserve.planner import queue_bound
from server.protocol import APIError


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    max_queue: int | None = None  # fixed bound; None: from the wait budget
    wait_budget_s: float = 5.0
    min_queue: int = 16  # floor of the Little's-law bound (the batch size)
    max_queued_tokens: int = 65536  # prompt tokens waiting for admission

    def bound(self, admission_rate: float) -> int:
        if self.max_queue is not None:
            return self.max_queue
        return max(self.min_queue, queue_bound(self.wait_budget_s, admission_rate))

    def retry_after(self, queued: int, admission_rate: float) -> int:
        """Seconds until the queue has drained to make room, from 1 to 60."""
        if admission_rate <= 0:
            return 1
        return min(60, max(1, math.ceil(queued / admission_rate)))

    @staticmethod
    def reserve(bound: int) -> int:
        """Places of a queue of `bound` kept for tenants other than a flooding one."""
        return max(1, bound // 8) if bound > 1 else 0

    def tenant_share(self, bound: int) -> int:
        """Places of a queue of `bound` that one tenant may hold while others are live."""
        return bound - self.reserve(bound)

    def admit(
        self,
        queued: int,
        queued_tokens: int,
        new: int,
        new_tokens: int,
        admission_rate: float,
        tenant_queued: int = 0,
        shared: bool = False,
    ) -> None:
        """Raise a 429 unless `new` requests of `new_tokens` prompt tokens may queue.

        `queued` requests (`queued_tokens` prompt tokens) must wait now, `tenant_queued`
        of them the same tenant's; `shared`: another tenant has requests queued or
        running. `admission_rate` is requests admitted per second (measured or estimated).
        """
        bound = self.bound(admission_rate)
        limit = bound + (self.reserve(bound) if not tenant_queued else 0)
        reason = None
        if queued + new > limit:
            reason = f"the queue is full ({queued} requests must wait, bound {bound}"
            if self.max_queue is None and admission_rate > 0:
                wait = (queued + new) / admission_rate
                reason += (
                    f": an estimated wait of {wait:.1f}s at {admission_rate:.2f} admissions/s, "
                    f"past the {self.wait_budget_s:g}s budget"
                )
            reason += ")"
        elif shared and tenant_queued and tenant_queued + new > self.tenant_share(bound):
            reason = (
                f"this tenant holds {tenant_queued} of the queue's {bound} places, and "
                f"{self.reserve(bound)} are kept for other tenants"
            )
        elif queued_tokens + new_tokens > self.max_queued_tokens:
            reason = (
                f"too many prompt tokens queued ({queued_tokens} + {new_tokens} > "
                f"{self.max_queued_tokens})"
            )
        if reason is not None:
            retry = self.retry_after(queued, admission_rate)
            raise APIError(
                429,
                f"server overloaded: {reason}; retry in {retry}s",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            )
