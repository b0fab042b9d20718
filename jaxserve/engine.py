"""The engine loop: schedule → run the step → post-process → emit, on its own thread.

The engine holds no device state itself: a runner (the jitted model, or a fake
in tests) turns a SchedulerOutput into sampled tokens. The loop never waits on a
consumer: a request whose output buffer is full is cancelled, alone.
"""

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from jaxserve.config import SamplingParams
from jaxserve.request import Request
from jaxserve.results import StepResults
from jaxserve.scheduler import Scheduler, SchedulerOutput
from jaxserve.sequence import Sequence as SequenceState
from jaxserve.stream import OutputStream, RequestOutput, notify
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

RATE_WINDOW_S = 30.0  # window of the measured admission rate (Little's law, Retry-After)


class Runner(Protocol):
    def execute(self, out: SchedulerOutput) -> StepResults:
        """Per chunk of `out`, in order: its sampled token (ignored where it samples none)."""


@dataclass
class _Live:
    request: Request
    state: SequenceState
    stream: OutputStream
    admitted_time: float | None = None
    # prompt logprobs gathered chunk by chunk (requests asking for them); the first
    # prompt token has none
    prompt_logprobs: list[float | None] = field(default_factory=lambda: [None])
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One row of what the engine holds now, for operators (`/admin/requests`)."""

    request_id: str
    tenant: str
    priority: int
    phase: str  # queued, prefill or decode
    pages: int
    num_generated: int
    age_seconds: float


class Engine:
    """Continuous batching over a runner; thread-safe `submit` and `cancel`."""

    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        stream_capacity: int = 64,
        on_step: Callable[[SchedulerOutput, float], None] | None = None,
        debug_checks: bool = False,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.stream_capacity = stream_capacity
        self.on_step = on_step
        self.debug_checks = debug_checks
        self.live: dict[str, _Live] = {}
        self._inbox: list[Request] = []
        self._cancels: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._seed_rng = random.Random()
        self._ids = 0
        self._admissions: deque[float] = deque()  # admission times within RATE_WINDOW_S

    # ---------------------------------------------------------------- client side

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        tenant: str = "default",
        priority: int = 0,
        loop: asyncio.AbstractEventLoop | None = None,
        cache_salt: str = "",
        lazy: bool = False,
    ) -> OutputStream:
        """Queue a request (checked at once: RequestRejected if it can never run).

        Pass the asyncio `loop` of a consumer that reads the stream with `async for`,
        and `lazy` if it wants the whole answer rather than each token (see stream.py).
        """
        with self._lock:
            self._ids += 1
            request_id = request_id or f"req-{self._ids}"
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(31)
        seed %= 2**32  # the device's sampling key takes a u32: any int maps onto one
        request = Request(
            request_id,
            tuple(prompt_ids),
            params,
            seed,
            time.monotonic(),
            tenant,
            priority,
            cache_salt,
        )
        self.scheduler.check(request)
        stream = OutputStream(request_id, self.stream_capacity, loop, lazy)
        state = SequenceState(list(prompt_ids), params, self.tokenizer, self.eos_token_ids)
        with self._lock:
            self.live[request_id] = _Live(request, state, stream)
            self._inbox.append(request)
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> None:
        """Stop a request; its pages are freed by the next iteration."""
        with self._lock:
            self._cancels.add(request_id)
        self._wake.set()

    # ---------------------------------------------------------------- the loop

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._inbox)

    def step(self) -> SchedulerOutput:
        """One iteration: take in new and cancelled requests, schedule, run, emit."""
        self._take_inbox()
        out = self.scheduler.schedule()
        now = time.monotonic()
        for request_id in out.admitted:
            self.live[request_id].admitted_time = now
            self._admissions.append(now)
        if not out.chunks:
            return out
        start = time.perf_counter()
        results = self.runner.execute(out)
        sampled = {
            c.seq.request_id: row for row, c in enumerate(out.chunks) if c.samples
        }
        for request_id, rows in results.prompt_logprobs.items():
            self._gather_prompt_logprobs(request_id, rows)
        self.scheduler.update(
            out, {rid: int(results.tokens[row]) for rid, row in sampled.items()}
        )
        notify([self._emit(request_id, results, row) for request_id, row in sampled.items()])
        if self.debug_checks:
            self.scheduler.check_invariants()
        if self.on_step is not None:
            self.on_step(out, time.perf_counter() - start)
        return out

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        for request in inbox:
            self.scheduler.add(request)
        for request_id in cancels:
            self._finish(request_id, "abort")

    def _gather_prompt_logprobs(self, request_id: str, rows: StepResults) -> None:
        live = self.live[request_id]
        n = live.request.params.prompt_logprobs
        room = len(live.request.prompt_ids) - len(live.prompt_logprobs)  # the last has none
        for i in range(min(room, len(rows.tokens))):
            live.prompt_logprobs.append(float(rows.logprobs[i]))
            ids, values = rows.top_ids[i, :n], rows.top_logprobs[i, :n]
            live.prompt_top_logprobs.append({int(t): float(v) for t, v in zip(ids, values)})

    def _emit(self, request_id: str, results: StepResults, row: int) -> OutputStream:
        """Push the row's output to its stream without waking the consumer (the caller
        does, for every stream at once); the stream is returned for that."""
        live = self.live[request_id]
        token = int(results.tokens[row])
        first = not live.state.output_ids
        text = live.state.append(token)
        logprobs = top = None
        prompt = live.request.params.prompt_logprobs is not None
        n = live.request.params.logprobs
        if n is not None:
            logprobs = (float(results.logprobs[row]),)
            ids, values = results.top_ids[row, :n], results.top_logprobs[row, :n]
            top = ({int(i): float(v) for i, v in zip(ids, values)},)
        output = RequestOutput(
            request_id,
            (token,),
            text,
            live.state.finish_reason,
            len(live.request.prompt_ids),
            logprobs,
            top,
            queue_seconds=live.admitted_time - live.request.arrival_time if first else None,
            prompt_logprobs=tuple(live.prompt_logprobs) if first and prompt else None,
            prompt_top_logprobs=tuple(live.prompt_top_logprobs) if first and prompt else None,
        )
        if not live.stream.push(output, force=output.finished, wake=False):
            log.warning("output buffer of %s is full: cancelling it", request_id)
            self._finish(request_id, "abort")
        elif output.finished:
            self._finish(request_id, None)
        return live.stream

    def _finish(self, request_id: str, reason: str | None) -> None:
        """Free the request's pages; with a reason, tell its consumer it was stopped."""
        live = self.live.pop(request_id, None)
        if live is None:
            return
        self.scheduler.finish(request_id)
        if reason is not None:
            live.stream.push(
                RequestOutput(request_id, (), "", reason, len(live.request.prompt_ids)),
                force=True,
            )

    # ---------------------------------------------------------------- for operators

    def admission_rate(self) -> float:
        """Requests admitted per second over the last RATE_WINDOW_S seconds."""
        horizon = time.monotonic() - RATE_WINDOW_S
        while self._admissions and self._admissions[0] < horizon:
            self._admissions.popleft()
        return len(self._admissions) / RATE_WINDOW_S

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    def waiting_requests(self) -> list[Request]:
        """Requests not yet admitted: queued in the scheduler or not yet taken in."""
        return list(self.scheduler.waiting) + list(self._inbox)

    def live_requests(self) -> list[LiveRequest]:
        now = time.monotonic()
        running = self.scheduler.running
        rows = []
        for request_id, live in list(self.live.items()):
            seq = running.get(request_id)
            phase = "queued" if seq is None else "prefill" if seq.in_prefill else "decode"
            rows.append(
                LiveRequest(
                    request_id,
                    live.request.tenant,
                    live.request.priority,
                    phase,
                    len(seq.pages) if seq else 0,
                    len(live.state.output_ids),
                    now - live.request.arrival_time,
                )
            )
        return rows

    def oldest_waiting_age(self) -> float:
        """Seconds the longest-waiting queued request has waited (0 when none waits)."""
        waiting = self.waiting_requests()
        if not waiting:
            return 0.0
        return time.monotonic() - min(r.arrival_time for r in waiting)

    # ---------------------------------------------------------------- thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping:
            if not self.has_work() and not self._cancels:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:
                log.exception("engine step failed: failing every live request")
                for request_id in list(self.live):
                    self._finish(request_id, "error")
