"""The engine loop: schedule → run the step → post-process → emit, on its own thread.

The engine holds no device state itself: a runner (the jitted model, or a fake
in tests) turns a SchedulerOutput into sampled tokens. The loop never waits on a
consumer: a request whose output buffer is full is cancelled, alone.
"""

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from jaxserve.config import SamplingParams
from jaxserve.request import Request
from jaxserve.results import StepResults
from jaxserve.scheduler import Scheduler, SchedulerOutput
from jaxserve.sequence import Sequence as SequenceState
from jaxserve.stream import OutputStream, RequestOutput
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Runner(Protocol):
    def execute(self, out: SchedulerOutput) -> StepResults:
        """Per chunk of `out`, in order: its sampled token (ignored where it samples none)."""


@dataclass
class _Live:
    request: Request
    state: SequenceState
    stream: OutputStream
    first_token_time: float | None = None


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

    # ---------------------------------------------------------------- client side

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> OutputStream:
        """Queue a request (checked at once: RequestRejected if it can never run)."""
        with self._lock:
            self._ids += 1
            request_id = request_id or f"req-{self._ids}"
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(31)
        request = Request(request_id, tuple(prompt_ids), params, seed, time.monotonic())
        self.scheduler.check(request)
        stream = OutputStream(request_id, self.stream_capacity)
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
        if not out.chunks:
            return out
        start = time.perf_counter()
        results = self.runner.execute(out)
        sampled = {
            c.seq.request_id: row for row, c in enumerate(out.chunks) if c.samples
        }
        self.scheduler.update(
            out, {rid: int(results.tokens[row]) for rid, row in sampled.items()}
        )
        for request_id, row in sampled.items():
            self._emit(request_id, results, row)
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

    def _emit(self, request_id: str, results: StepResults, row: int) -> None:
        live = self.live[request_id]
        token = int(results.tokens[row])
        text = live.state.append(token)
        if live.first_token_time is None:
            live.first_token_time = time.monotonic()
        logprobs = top = None
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
        )
        if not live.stream.push(output, force=output.finished):
            log.warning("output buffer of %s is full: cancelling it", request_id)
            self._finish(request_id, "abort")
        elif output.finished:
            self._finish(request_id, None)

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
