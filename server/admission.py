"""The bounded waiting queue: how deep it may get, and when to come back.

Little's law sizes the queue: depth = wait budget × admission rate, measured
over the engine's recent admissions, with the batch size as a floor while the
rate is still unknown. Past the bound, or past the queued-token cap, a request
is refused at once with 429 and a Retry-After from the current drain rate.

One tenant may fill the queue only up to its share: an eighth of the places (at
least one) stays for the other tenants, so a script flooding the replica still
leaves them room to queue (as the scheduler's reserved rows leave them room to
run). A tenant with nothing queued may always queue what the bound allows.
"""

import math
from dataclasses import dataclass

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
        return max(self.min_queue, math.floor(self.wait_budget_s * admission_rate))

    def retry_after(self, queued: int, admission_rate: float) -> int:
        """Seconds until the queue has drained to make room, from 1 to 60."""
        if admission_rate <= 0:
            return 1
        return min(60, max(1, math.ceil(queued / admission_rate)))

    def tenant_share(self, bound: int) -> int:
        """Places of a queue of `bound` that one tenant may hold."""
        return bound - max(1, bound // 8) if bound > 1 else bound

    def admit(
        self,
        queued: int,
        queued_tokens: int,
        new: int,
        new_tokens: int,
        admission_rate: float,
        tenant_queued: int = 0,
    ) -> None:
        """Raise a 429 unless `new` requests of `new_tokens` prompt tokens fit the queue,
        `tenant_queued` of its `queued` requests being the same tenant's."""
        bound = self.bound(admission_rate)
        share = self.tenant_share(bound)
        reason = None
        if queued + new > bound:
            reason = f"the queue is full ({queued} waiting, bound {bound})"
        elif tenant_queued and tenant_queued + new > share:
            reason = (
                f"this tenant holds {tenant_queued} of the queue's {bound} places, and "
                f"{bound - share} are kept for other tenants"
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
