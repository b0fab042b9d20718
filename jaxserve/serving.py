"""What a server may ask of a running engine, and nothing more.

`EngineClient` is the narrow face of an `LLM` that the HTTP server sees: encode and
check a prompt, submit and cancel a request, read the queue for admission, list the
live requests, and read the gauges for /metrics. The server never reaches the
scheduler, runner or page allocator behind it, so they can change without it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.checkpoint.adapter import Adapter
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import SamplingParams
from jaxserve.host.engine import EngineFailed, LiveRequest
from jaxserve.host.plan import StepPlan
from jaxserve.host.results import StepTime
from jaxserve.host.stream import OutputStream

__all__ = ["EngineClient", "EngineFailed", "EngineStats", "QueueStats"]

if TYPE_CHECKING:  # the server imports this module before jax has loaded
    from jaxserve.llm import LLM


@dataclass(frozen=True, slots=True)
class QueueStats:
    """The queue as one tenant's admission sees it (read from another thread: an estimate)."""

    must_wait: int  # waiting requests that the next step cannot admit
    must_wait_prompt_tokens: int
    tenant_must_wait: int  # of them, the asking tenant's
    shared: bool  # another tenant has a live request
    admission_rate: float  # admissions a second: measured, else estimated from the warm-up
    free_rows: int  # rows the next step could still give the asking tenant's new requests


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's gauges and counters, read when /metrics is scraped."""

    running: int
    waiting: int
    oldest_waiting_seconds: float
    pages_usable: int
    pages_free: int
    pages_used: int  # held by live requests
    pages_cached: int  # held by no one, kept for the prefix cache (evictable)
    prefix_cache_queries: int
    prefix_cache_hits: int
    compiles_after_warmup: int
    requests_admitted: int  # taken in by the engine
    requests_finished: dict[str, int]  # ended by the engine, by finish reason
    output_streams: int  # requests' output buffers still allocated (any left once idle leaked)
    adapters_loaded: int = 0  # LoRA adapters served (in host memory)
    adapter_slots_used: int = 0  # device slots holding one
    adapter_swaps: int = 0  # adapters written into a device slot
    spec_decode_draft_tokens: int = 0  # draft tokens verified (speculative decoding)
    spec_decode_accepted_tokens: int = 0  # of which accepted


class EngineClient:
    """An LLM's engine as the server uses it (thread-safe; the engine runs on its own
    thread between `start` and `stop`)."""

    def __init__(self, llm: LLM, typical_output_tokens: int):
        self._llm = llm
        self._engine = llm.engine
        self._scheduler = llm.scheduler
        self._runner = llm.runner
        self._estimated_rate = self._warmup_admission_rate(typical_output_tokens)
        self._streams: weakref.WeakSet[OutputStream] = weakref.WeakSet()  # still referenced

    @property
    def tokenizer(self) -> Tokenizer:
        return self._llm.tokenizer

    @property
    def model_path(self) -> Path:
        return self._llm.model_path

    @property
    def max_model_len(self) -> int:
        return self._scheduler.max_model_len

    @property
    def dtype(self) -> str:
        """What the weights and activations are served in (`--dtype auto` resolved)."""
        return self._llm.dtype.name

    @property
    def weight_dtype(self) -> str:
        """How the projections are stored (`--weight-dtype` resolved)."""
        return self._llm.weight_dtype

    @property
    def linear(self) -> str:
        """How the projections multiply: the linear backend and what it multiplies by."""
        return f"{self._llm.linear_backend}, activations {self._llm.linear_activations}"

    @property
    def weight_bytes(self) -> int:
        return self._llm.weight_bytes

    @property
    def kv_dtype(self) -> str:
        """How KV pages are stored (`--kv-dtype` resolved: f32, bf16, int8 or fp8)."""
        return self._llm.kv_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self._llm.kv_bytes_per_token

    @property
    def num_buckets(self) -> int:
        """Step shapes compiled at start-up."""
        return len(self._runner.buckets.buckets())

    # ---------------------------------------------------------------- requests

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's ids (RequestRejected when empty or out of the vocabulary)."""
        return self._llm.encode(prompt)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """RequestRejected if such a request could never run; queues nothing."""
        self._engine.check(prompt_ids, params)

    def submit(  # EngineFailed once the engine has failed
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tenant: str,
        priority: int,
        loop: asyncio.AbstractEventLoop,
        lazy: bool,
        cache_salt: str = "",
        adapter: Adapter | None = None,
    ) -> OutputStream:
        stream = self._engine.submit(
            prompt_ids, params, tenant=tenant, priority=priority, loop=loop, lazy=lazy,
            cache_salt=cache_salt, adapter=adapter,
        )
        self._streams.add(stream)
        return stream

    def cancel(self, request_id: str) -> None:
        self._engine.cancel(request_id)

    # ---------------------------------------------------------------- LoRA adapters

    def adapters(self) -> list[Adapter]:
        """The LoRA adapters served, by name."""
        registry = self._llm.adapters
        return [] if registry is None else sorted(registry.adapters.values(),
                                                  key=lambda a: a.name)

    def adapter(self, name: str) -> Adapter | None:
        """The served adapter called `name`, or None."""
        return None if self._llm.adapters is None else self._llm.adapters.get(name)

    def load_adapter(self, name: str, path: str) -> Adapter:
        """Read and serve an adapter (blocking: disk); AdapterError if it cannot be."""
        return self._llm.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (KeyError if it is not served)."""
        self._llm.adapters.unload(name)

    def cancel_all(self) -> None:
        for request_id in list(self._engine.requests):
            self._engine.cancel(request_id)

    def num_live(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._engine.requests)

    def live_requests(self) -> list[LiveRequest]:
        return self._engine.live_requests()

    # ---------------------------------------------------------------- admission, gauges

    def queue_stats(self, tenant: str) -> QueueStats:
        waiting, free_rows = self._engine.must_wait(tenant)
        live = list(self._engine.requests.values())
        return QueueStats(
            len(waiting),
            sum(len(r.prompt_ids) for r in waiting),
            sum(r.tenant == tenant for r in waiting),
            any(r.tenant != tenant for r in live),
            self._engine.admission_rate() or self._estimated_rate,
            free_rows,
        )

    def _warmup_admission_rate(self, output_tokens: int) -> float:
        """Admissions a second before any are measured: a full batch of decode rows, at
        the warm-up's step time for it, each generating `output_tokens`."""
        rows = self._scheduler.max_batch
        step_s = self._runner.step_times.get(self._runner.buckets.choose(rows, rows))
        if not step_s:
            return 0.0
        return self._scheduler.num_shards * rows / (step_s * output_tokens)

    def stats(self) -> EngineStats:
        s = self._scheduler
        return EngineStats(
            len(s.running),
            self._engine.num_waiting(),
            self._engine.oldest_waiting_age(),
            s.num_pages_usable,
            s.num_pages_free,
            s.num_pages_used,
            s.num_pages_cached,
            s.prefix_queries,
            s.prefix_hits,
            self._runner.compiles_after_warmup,
            self._engine.num_admitted,
            dict(self._engine.num_finished),  # one C-level copy: safe beside the engine thread
            len(self._streams),
            0 if self._llm.adapters is None else len(self._llm.adapters.adapters),
            0 if s.adapter_slots is None else len(s.adapter_slots.holder),
            0 if s.adapter_slots is None else s.adapter_slots.swaps,
            self._engine.num_draft_tokens,
            self._engine.num_accepted_tokens,
        )

    # ---------------------------------------------------------------- thread

    @property
    def failure(self) -> str | None:
        """Why the engine stopped for good (a step raised or hung); None while it runs."""
        return self._engine.failure

    def start(
        self,
        on_step: Callable[[StepPlan, StepTime], None] | None = None,
        step_timeout_s: float | None = None,
    ) -> float:
        """Run the engine; a step running past `step_timeout_s` (default: 10 times the
        slowest warm-up step, at least 30 s) fails it. Returns the limit."""
        if step_timeout_s is None:
            step_timeout_s = max(30.0, 10 * max(self._runner.step_times.values(), default=0))
        self._engine.on_step = on_step
        self._engine.start(step_timeout_s)
        return step_timeout_s

    def stop(self) -> None:
        self._engine.stop()
        if self._runner.channel is not None:  # release the other processes
            self._runner.channel.stop()
