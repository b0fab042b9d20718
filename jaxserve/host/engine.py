"""The engine loop: schedule → run the step → post-process → emit, on its own thread.

The engine holds no device state itself: a runner (the jitted model, or a fake
in tests) turns a step plan into accepted tokens. Post-processing walks the plan's
rows once: each accepted token is appended to its request record (which decides
whether it stops), the scheduler takes the row's results in, its output is pushed, and
a finished request is freed. The loop never waits on a consumer: the outputs of one
that falls behind are merged in its stream (see stream.py), never refused.

Async scheduling (`async_scheduling`, vLLM's name): step N+1 is planned and launched
before step N's results are read, so the host's work (post-processing N, planning and
packing N+1) runs while the device computes. A decode row then carries a placeholder
for the token step N samples, which the device fills in (`plan.pending_token`). The
costs: a request that stops (EOS, a stop string) at step N still has its row computed
in step N+1, its output dropped; and its row and pages return to the pool once step
N+1 has run, one step later than without.

Speculative decoding: a `Proposer`, if given (host/ngram.py's prompt lookup), drafts
tokens for each decoding request after every step; the scheduler plans them after the
request's last token and the runner returns the ones the model accepts, and the token
after the last of them. Drafts follow a step's tokens, so this plans each step after the
one before (no async scheduling).
"""

import asyncio
import dataclasses
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from jaxserve.checkpoint.adapter import Adapter
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import SamplingParams
from jaxserve.host import faults
from jaxserve.host.output_text import OutputText
from jaxserve.host.plan import StepPlan
from jaxserve.host.request import Request, check_logit_bias
from jaxserve.host.results import PendingStep, StepOutput, StepTime
from jaxserve.host.scheduler import Scheduler
from jaxserve.host.stream import OutputStream, RequestOutput, notify

log = logging.getLogger(__name__)

RATE_WINDOW_S = 30.0  # window of the measured admission rate (Little's law, Retry-After)


class EngineFailed(RuntimeError):
    """The engine's loop has stopped for good (a step raised, or hung past its limit)."""


class Runner(Protocol):
    def launch(self, plan: StepPlan) -> PendingStep:
        """Start `plan`'s step, whose output gives, per chunk of `plan`, in order, the
        tokens it accepted (none if it samples none). Steps run in launch order."""


@dataclass(frozen=True, slots=True)
class _Launched:
    """A step launched and not yet taken in."""

    plan: StepPlan
    pending: PendingStep
    started: float  # monotonic time of its launch (the watchdog's clock)
    request_ids: frozenset[str]


class Proposer(Protocol):
    def propose(self, request: Request) -> tuple[int, ...]:
        """Draft tokens to follow `request`'s last token (empty: none this step)."""


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
        on_step: Callable[[StepPlan, StepTime], None] | None = None,
        debug_checks: bool = False,
        proposer: Proposer | None = None,
        async_scheduling: bool = False,
    ):
        if async_scheduling and proposer is not None:
            raise ValueError("async scheduling plans steps before their drafts are known: "
                             "it does not go with a proposer")
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        tokenizer.token_bytes()  # the detokenizers' table, built now, not in a step (~50 ms)
        self.eos_token_ids = eos_token_ids
        self.stream_capacity = stream_capacity
        self.on_step = on_step
        self.debug_checks = debug_checks
        self.proposer = proposer
        self.async_scheduling = async_scheduling
        self._launched: _Launched | None = None  # with async scheduling: the step in flight
        # (step, request id) of requests ended while that step computes their row: freed
        # once it has run
        self._deferred_frees: list[tuple[int, str]] = []
        # perf_counter from which the step in flight may be the last the device has: when
        # the step before it was read, or its own launch if none was in flight
        self._idle_from = 0.0
        self.requests: dict[str, Request] = {}  # submitted and not yet finished
        self._inbox: list[Request] = []
        self._cancels: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._seed_rng = random.Random()
        self._ids = 0
        self._admissions: deque[float] = deque()  # admission times within RATE_WINDOW_S
        self.failure: str | None = None  # why the loop stopped for good
        self._steps = 0  # steps run
        self._step_started: float | None = None  # monotonic start of the step under way
        # every request taken in, and every one ended, by finish reason: once idle the
        # two agree (a request never ended shows)
        self.num_admitted = 0
        self.num_finished: Counter[str] = Counter()
        self.num_draft_tokens = 0  # drafts verified by steps (speculative decoding)
        self.num_accepted_tokens = 0  # of which the model accepted

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
        adapter: Adapter | None = None,
    ) -> OutputStream:
        """Queue a request (checked at once: RequestRejected if it can never run;
        EngineFailed once the engine has failed), with a LoRA `adapter` if given.

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
            # a page computed under one adapter is never reused under another
            cache_salt if adapter is None else f"{cache_salt}\0{adapter.key}",
            adapter,
        )
        self._check(request)
        request.stream = OutputStream(request_id, self.stream_capacity, loop, lazy)
        request.output = OutputText(prompt_ids, params, self.tokenizer, self.eos_token_ids)
        with self._lock:
            if self.failure is not None:
                raise EngineFailed(self.failure)
            self.requests[request_id] = request
            self.num_admitted += 1
            self._inbox.append(request)
        self._wake.set()
        return request.stream

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestRejected if such a request could never run (what `submit` checks),
        without queueing anything."""
        self._check(Request("check", tuple(prompt_ids), params, seed=0))

    def _check(self, request: Request) -> None:
        check_logit_bias(request.params, self.tokenizer.vocab_size)
        self.scheduler.check(request)

    def cancel(self, request_id: str) -> None:
        """Stop a request; its pages are freed by the next iteration."""
        with self._lock:
            self._cancels.add(request_id)
        self._wake.set()

    # ---------------------------------------------------------------- the loop

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._inbox
                    or self._launched)

    def step(self) -> StepPlan:
        """One iteration: take in new and cancelled requests, schedule, launch, then take
        in a step's results (this one's, or with async scheduling the one before)."""
        start = time.perf_counter()
        self._take_inbox()
        plan = self.scheduler.schedule()
        now = time.monotonic()
        for request_id in plan.admitted:
            self.requests[request_id].admitted_time = now
            self._admissions.append(now)
        plan = self._set_up_sampling(plan)
        launched = None
        idle = 0.0  # async: host time the device spent with nothing to run (StepTime)
        if plan.chunks or plan.adapter_loads:
            self._steps += 1
            now = time.monotonic()
            if self._step_started is None:
                self._step_started = now
            faults.before_step(self._steps)
            if self._launched is not None and self._launched.pending.done():
                idle = time.perf_counter() - self._idle_from
            launched = _Launched(plan, self.runner.launch(plan), now,
                                 frozenset(c.request_id for c in plan.chunks))
            if self._launched is None:
                self._idle_from = time.perf_counter()
        if self.async_scheduling:
            launched, self._launched = self._launched, launched
        if launched is not None:
            self._take_in(launched, start, idle)
        return plan

    def _take_in(self, launched: _Launched, start: float, idle: float) -> None:
        """Wait for a launched step's results, post-process them, and free what waited on
        it; `idle`: the device's idle time this iteration, with async scheduling."""
        self._step_started = launched.started
        output = launched.pending.output()
        self._idle_from = time.perf_counter()
        self._step_started = None if self._launched is None else self._launched.started
        self._postprocess(launched.plan, output)
        step = launched.plan.step
        freeable = [r for s, r in self._deferred_frees if s <= step]
        self._deferred_frees = [(s, r) for s, r in self._deferred_frees if s > step]
        for request_id in freeable:
            self.scheduler.finish(request_id)
        if self.debug_checks:
            self.scheduler.check_invariants()
        if self.on_step is not None:
            seconds = time.perf_counter() - start
            device = output.device_seconds
            host = seconds - device
            self.on_step(launched.plan,
                         StepTime(host, device, idle if self.async_scheduling else host))

    def _postprocess(self, plan: StepPlan, output: StepOutput) -> None:
        """Each row once: append its accepted tokens, advance, emit, free if finished."""
        for request_id, scores in output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is None:  # ended while its step ran
                continue
            try:
                self._gather_prompt_logprobs(request, scores)
            except Exception:
                log.exception("request %s failed: ending it alone", request.request_id)
                self._isolate(request)
        streams = []
        now = time.monotonic()  # every row's output is emitted now
        for row, (chunk, accepted) in enumerate(zip(plan.chunks, output.accepted())):
            request = self.requests.get(chunk.request_id)
            if request is None:  # failed above
                continue
            try:
                faults.before_emit(request.request_id)
                appended = self._emit(request, output, row, accepted, now) if accepted else 0
                if chunk.num_speculative:
                    self.num_draft_tokens += chunk.num_speculative
                    self.num_accepted_tokens += max(0, len(accepted) - 1)
                self.scheduler.advance(request, chunk, appended)
                if request.finished:
                    self._free(request)
                elif self.proposer is not None and not request.in_prefill:
                    request.spec_token_ids = self.proposer.propose(request)
            except Exception:
                log.exception("request %s failed: ending it alone", request.request_id)
                self._isolate(request)
                continue
            if accepted:
                streams.append(request.stream)
        notify(streams)

    def _set_up_sampling(self, plan: StepPlan) -> StepPlan:
        """Each row's sampling set-up, one request at a time, before the batch is packed
        (where a failure would fail every row): a request whose set-up fails ends alone
        with an error and its chunk leaves the step. Its parameters were checked at
        submit, so today only the test hook fails here."""
        kept = []
        for chunk in plan.chunks:
            try:
                faults.before_sampling(chunk.request_id)
            except Exception:
                log.exception("request %s failed: ending it alone", chunk.request_id)
                self._isolate(self.requests[chunk.request_id])
                continue
            kept.append(chunk)
        if len(kept) == len(plan.chunks):
            return plan
        return dataclasses.replace(plan, chunks=tuple(kept))

    def _isolate(self, request: Request) -> None:
        """A fault while handling one request (detokenizing, stop checks, its stream) ends
        that request alone with an error; the step and every other request go on."""
        self._stop(request.request_id, "error")
        self._free(request)  # had it finished before the fault, it may not be freed yet

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        for request in inbox:
            self.scheduler.add(request)
        for request_id in cancels:
            self._stop(request_id, "abort")

    @staticmethod
    def _gather_prompt_logprobs(request: Request, scores: StepOutput) -> None:
        n = request.params.prompt_logprobs
        room = len(request.prompt_ids) - len(request.prompt_logprobs)  # the last has none
        for i in range(min(room, len(scores.tokens))):
            request.prompt_logprobs.append(float(scores.logprobs[i, 0]))
            ids, values = scores.top_ids[i, 0, :n], scores.top_logprobs[i, 0, :n]
            request.prompt_top_logprobs.append({int(t): float(v) for t, v in zip(ids, values)})

    def _emit(
        self, request: Request, output: StepOutput, row: int, accepted: list[int], now: float
    ) -> int:
        """Append the row's accepted tokens to `request` until one stops it, and push what
        they produced to its stream without waking the consumer (the caller does, for
        every stream at once). Returns how many tokens were appended."""
        first = request.num_generated == 0
        tokens, texts = [], []
        for token in accepted:
            tokens.append(token)
            texts.append(request.append(token))
            if request.finished:
                break
        logprobs = top = None
        n = request.params.logprobs
        if n is not None:
            k = len(tokens)
            logprobs = tuple(float(x) for x in output.logprobs[row, :k])
            top = tuple(
                {int(i): float(v) for i, v in zip(ids[:n], values[:n])}
                for ids, values in zip(output.top_ids[row, :k], output.top_logprobs[row, :k])
            )
        queue_seconds = request.admitted_time - request.arrival_time if first else None
        # positional (keywords cost ~0.15 us each, every row of every step)
        result = RequestOutput(request.request_id, tuple(tokens), "".join(texts),
                               request.finish_reason, len(request.prompt_ids), logprobs, top,
                               queue_seconds, now)
        if first and request.params.prompt_logprobs is not None:
            result.prompt_logprobs = tuple(request.prompt_logprobs)
            result.prompt_top_logprobs = tuple(request.prompt_top_logprobs)
        request.stream.push(result, wake=False)
        return len(tokens)

    def _stop(self, request_id: str, reason: str) -> None:
        """End a request that did not finish by itself: free it, tell its consumer."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        request.finish_reason = reason
        self._free(request)
        self._tell(request)

    def _free(self, request: Request) -> None:
        """Free a finished request's row and pages (once: it leaves `requests`); while a
        step in flight computes its row, once that step has run."""
        if self.requests.pop(request.request_id, None) is not None:
            self.num_finished[request.finish_reason] += 1
            launched = self._launched
            if launched is not None and request.request_id in launched.request_ids:
                self._deferred_frees.append((launched.plan.step, request.request_id))
            else:
                self.scheduler.finish(request.request_id)

    @staticmethod
    def _tell(request: Request) -> None:
        """A final, empty output carrying the reason a request was stopped."""
        final = RequestOutput(request.request_id, (), "", request.finish_reason,
                              len(request.prompt_ids))
        request.stream.push(final)

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

    def must_wait(self, tenant: str) -> tuple[list[Request], int]:
        """The waiting requests that the next step cannot admit (past the free rows or
        pages, or of a tenant at its row cap), and the rows it could still give new
        requests of `tenant`, within its cap (read from another thread: an estimate)."""
        scheduler = self.scheduler
        rows = sum(len(free) for free in scheduler.free_rows)
        pages = scheduler.num_pages_free + scheduler.num_pages_cached
        cap, held = scheduler.row_cap(), dict(scheduler.running_per_tenant)
        waiting = []
        for request in self.waiting_requests():
            need = scheduler.pages_needed(request)
            if rows and need <= pages and held.get(request.tenant, 0) < cap:
                rows, pages = rows - 1, pages - need
                held[request.tenant] = held.get(request.tenant, 0) + 1
            else:
                waiting.append(request)
        return waiting, max(0, min(rows, cap - held.get(tenant, 0)))

    def live_requests(self) -> list[LiveRequest]:
        now = time.monotonic()
        return [
            LiveRequest(
                r.request_id, r.tenant, r.priority, r.phase, len(r.pages), r.num_generated,
                now - r.arrival_time,
            )
            for r in list(self.requests.values())
        ]

    def oldest_waiting_age(self) -> float:
        """Seconds the longest-waiting queued request has waited (0 when none waits)."""
        waiting = self.waiting_requests()
        if not waiting:
            return 0.0
        return time.monotonic() - min(r.arrival_time for r in waiting)

    # ---------------------------------------------------------------- thread

    def start(self, step_timeout_s: float | None = None) -> None:
        """Run the loop on its own thread; with `step_timeout_s`, a watchdog fails the
        engine when one step runs longer (a hung device is never hidden)."""
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()
        if step_timeout_s is not None:
            threading.Thread(target=self._watch, args=(step_timeout_s,),
                             name="jaxserve-watchdog", daemon=True).start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the loop; a loop stuck in a hung step is left behind (a daemon thread)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stopping:
            if not self.has_work() and not self._cancels:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:
                log.exception("engine step failed: failing every live request")
                self._fail(f"engine step failed: {e!r}")
                return

    def _watch(self, timeout_s: float) -> None:
        while not self._stopping and self.failure is None:
            started = self._step_started
            if started is not None and time.monotonic() - started > timeout_s:
                log.critical("engine step running for over %.0f s: failing", timeout_s)
                self._fail(f"engine step hung for over {timeout_s:g} s")
                return
            time.sleep(min(0.25, timeout_s / 4))

    def _fail(self, reason: str) -> None:
        """Stop for good: refuse new requests and end every live one with an error."""
        with self._lock:
            self.failure = self.failure or reason  # the first cause is the one to tell
            self._stopping = True
        self._launched = None  # never taken in: what waited on it is freed now
        for request_id in list(self.requests):
            self._stop(request_id, "error")
        for _, request_id in self._deferred_frees:
            self.scheduler.finish(request_id)
        self._deferred_frees = []
