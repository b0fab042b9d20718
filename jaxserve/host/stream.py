"""A bounded buffer of one request's outputs, between the engine thread and its consumer.

The engine only ever calls `push`, which never blocks: when the buffer is full it
returns False and the engine cancels that request alone. Consumers read with a
blocking `get` (threads) or `async for` (asyncio; the engine wakes the loop with
`call_soon_threadsafe`, once a step for all its streams: see `notify`). A consumer
that only wants the whole answer (a non-streaming request) is `lazy`: it is woken
when the answer is complete or the buffer half full, not for every token; each
output carries the time the engine emitted it, so latency is measured all the same.
"""

import asyncio
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens this step
    text: str  # new text released this step
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    num_prompt_tokens: int = 0
    logprobs: tuple[float, ...] | None = None  # of each new token, when asked for
    top_logprobs: tuple[dict[int, float], ...] | None = None  # alternatives per new token
    queue_seconds: float | None = None  # on the first token: arrival to admission
    # time.monotonic() when the engine emitted it (made and pushed in one go)
    time: float = field(default_factory=time.monotonic)
    # on the first token, when asked for: per prompt token (None for the first one)
    # its logprob after the tokens before it, and the alternatives there
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[dict[int, float] | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputStream:
    """Bounded FIFO of RequestOutput; the last item pushed has `finished` set."""

    def __init__(
        self,
        request_id: str,
        capacity: int = 64,
        loop: asyncio.AbstractEventLoop | None = None,
        lazy: bool = False,
    ):
        """With `loop`, an asyncio consumer on that loop reads it with `async for`;
        `lazy`, it is woken only for a final output or a half-full buffer."""
        self.request_id = request_id
        self.capacity = capacity
        self.lazy = lazy
        self._items: deque[RequestOutput] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._loop = loop
        self._async_ready = asyncio.Event() if loop is not None else None
        self._finished_read = False  # the consumer has taken the final item

    def push(self, item: RequestOutput, force: bool = False, wake: bool = True) -> bool:
        """Append without blocking; False if full (a final item may `force` its way in).

        With `wake` False an asyncio consumer is not woken: the caller calls `notify`.
        """
        with self._lock:
            if len(self._items) >= self.capacity and not force:
                return False
            self._items.append(item)
            self._ready.notify_all()
        if wake:
            notify([self])
        return True

    def __len__(self) -> int:
        return len(self._items)

    def _wants_wake(self) -> bool:
        if not self.lazy:
            return True
        with self._lock:
            items = self._items
            return bool(items) and (items[-1].finished or 2 * len(items) >= self.capacity)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Next item, waiting up to `timeout` seconds (TimeoutError after)."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"no output for {self.request_id} in {timeout}s")
            return self._items.popleft()

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            with self._lock:
                if self._finished_read:
                    raise StopAsyncIteration
                if self._items:
                    item = self._items.popleft()
                    self._finished_read = item.finished
                    return item
                self._async_ready.clear()
            await self._async_ready.wait()


def notify(streams: Iterable[OutputStream]) -> None:
    """Wake the asyncio consumers of `streams`, with one call per event loop.

    Each `call_soon_threadsafe` writes to the loop's self-pipe and takes the GIL;
    one a step rather than one per request keeps the engine thread's emit short.
    """
    by_loop = defaultdict(list)
    for stream in streams:
        if stream._loop is not None and stream._wants_wake():
            by_loop[stream._loop].append(stream._async_ready)
    for loop, events in by_loop.items():
        loop.call_soon_threadsafe(_set_all, events)


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
