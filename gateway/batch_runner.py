"""Runs the requests of batches in progress on spare capacity, earliest deadline first.

Every `poll_s`: batches past their deadline end `expired` (their running requests are
stopped), batches with nothing left to run are finalized, then pending requests start
while `spare(model)` allows. `send` answers 429, 503 (no capacity, replica not ready)
or 502 (replica unreachable) for a request that did not run: it goes back to pending
and its model pauses, doubling the pause while refusals go on. Any other answer is
the request's result. An exception while sending or storing one request fails that
request alone (error file) and the runner goes on.

On `stop()` the requests in flight are cancelled and go back to pending (an answer
that had not arrived is lost, never half-stored), so the next start runs them again.
A gateway that dies instead leaves them `running`; the next `BatchStore` open puts
them back to pending.
"""

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from gateway.batch_store import Batch, BatchRequest, BatchStore

log = logging.getLogger("jaxserve.gateway.batches")

Send = Callable[[str, dict], Awaitable[tuple[int, dict]]]
Spare = Callable[[str], int]

REFUSED = frozenset({429, 502, 503})  # not run: try again later
FIRST_PAUSE_S = 0.1  # a model's pause after a refusal, doubled while they go on...
LONGEST_PAUSE_S = 2.0  # ...up to this


class BatchRunner:
    def __init__(self, store: BatchStore, send: Send, spare: Spare, poll_s: float = 0.2):
        self._store = store
        self._send = send
        self._spare = spare  # must count this runner's in_flight(model)
        self._poll_s = poll_s
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        self._in_flight: Counter[str] = Counter()
        self._paused: dict[str, tuple[float, float]] = {}  # model: (until, pause), monotonic
        self._poller: asyncio.Task | None = None

    def in_flight(self, model: str) -> int:
        """Batch requests for `model` sent and not yet answered."""
        return self._in_flight[model]

    async def start(self) -> None:
        self._poller = asyncio.create_task(self._poll(), name="batch-runner")

    async def stop(self) -> None:
        """Stop polling and cancel the requests in flight: they go back to pending."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        stopped = dict(self._tasks)
        for task in stopped.values():
            task.cancel()
        await asyncio.gather(*stopped.values(), return_exceptions=True)
        for key in stopped:
            self._store.requeue(key)

    def cancel(self, batch_id: str, owner: str | None = None) -> Batch:
        """Cancel a batch (`owner`'s, when given): nothing more of it starts; it ends
        `cancelled` once its running requests have finished (at once when none is)."""
        batch = self._store.cancel(batch_id, owner)
        if batch.status == "cancelling" and not batch.counts.remaining:
            self._store.finalize(batch_id)
            batch = self._store.get_batch(batch_id)
        return batch

    async def _poll(self) -> None:
        while True:
            try:
                self._step()
            except Exception:
                log.exception("batch runner step failed; trying again")
            await asyncio.sleep(self._poll_s)

    def _step(self) -> None:
        for batch_id in self._store.due(time.time()):
            for key in self._store.expire(batch_id, time.time()):
                if key in self._tasks:
                    self._tasks[key].cancel()
        for batch_id in self._store.settled():
            self._store.finalize(batch_id)
        now = time.monotonic()
        for model in self._store.pending_models():
            if self._paused.get(model, (0.0, 0.0))[0] > now:
                continue
            budget = self._spare(model)
            if budget <= 0:
                continue
            for i, request in enumerate(self._store.pending(model, budget)):
                # spare counts in_flight, so it shrinks as requests start
                if i and self._spare(model) <= 0:
                    break
                if self._store.mark_running(request.key):
                    self._launch(request)

    def _launch(self, request: BatchRequest) -> None:
        self._in_flight[request.model] += 1
        task = asyncio.create_task(self._run(request))
        self._tasks[request.key] = task

        def forget(task: asyncio.Task) -> None:  # also when cancelled before it began
            self._in_flight[request.model] -= 1
            del self._tasks[request.key]
            if not task.cancelled() and task.exception() is not None:  # the store failed
                log.error("batch %s request %r stays running until the gateway restarts: %r",
                          request.batch_id, request.custom_id, task.exception())

        task.add_done_callback(forget)

    async def _run(self, request: BatchRequest) -> None:
        try:
            status, body = await self._send(request.url, request.body)
            if status in REFUSED:
                self._store.requeue(request.key)
                self._pause(request.model)
            else:
                self._paused.pop(request.model, None)
                self._store.mark_done(request.key, status, body)
        except Exception as e:
            log.exception("batch %s request %r failed", request.batch_id, request.custom_id)
            self._store.mark_failed(request.key, "batch_request_failed",
                                    f"{type(e).__name__}: {e}")

    def _pause(self, model: str) -> None:
        _, pause = self._paused.get(model, (0.0, FIRST_PAUSE_S / 2))
        pause = min(2 * pause, LONGEST_PAUSE_S)
        self._paused[model] = (time.monotonic() + pause, pause)
