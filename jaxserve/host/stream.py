"""A buffer of one request's outputs, between the engine thread and its consumer.

The engine only ever calls `push`, which never blocks and never refuses: past
`capacity` unread outputs, each new one is merged into the last (one output carrying
several steps' tokens, text and logprobs), so a consumer that falls behind costs at
most the request's own output and is never cancelled for lagging (a server drops a
client that stops reading for good: see server/responses.py). Consumers read with a
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


@dataclass(slots=True)
class RequestOutput:
    """What one step (or several merged: `num_steps`) produced for one request.

    Not frozen, though nothing changes it once pushed: made for every row of every step,
    and a frozen dataclass's `__init__` costs ~6x (`plan.Chunk` says why)."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens this step
    text: str  # new text released this step
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    num_prompt_tokens: int = 0
    logprobs: tuple[float, ...] | None = None  # of each new token, when asked for
    top_logprobs: tuple[dict[int, float], ...] | None = None  # alternatives per new token
    queue_seconds: float | None = None  # on the first token: arrival to admission
    # time.monotonic() when the engine emitted it (made and pushed in one go); merged,
    # when it emitted the last of them
    time: float = field(default_factory=time.monotonic)
    # on the first token, when asked for: per prompt token (None for the first one)
    # its logprob after the tokens before it, and the alternatives there
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[dict[int, float] | None, ...] | None = None
    num_steps: int = 1  # the engine steps whose outputs this one carries

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Merged:
    """Consecutive non-final outputs of a lagging consumer, gathered into one (in lists,
    so each merge costs only the new output's size)."""

    finished = False  # a final output is never merged: it is the end, with its own time
    queue_seconds = None  # nor is the first

    def __init__(self, first: RequestOutput):
        self.first = first
        self.token_ids = list(first.token_ids)
        self.texts = [first.text]
        self.logprobs = None if first.logprobs is None else list(first.logprobs)
        self.top_logprobs = None if first.top_logprobs is None else list(first.top_logprobs)
        self.time = first.time
        self.num_steps = first.num_steps

    def add(self, item: RequestOutput) -> None:
        self.token_ids += item.token_ids
        self.texts.append(item.text)
        if self.logprobs is not None:
            self.logprobs += item.logprobs
        if self.top_logprobs is not None:
            self.top_logprobs += item.top_logprobs
        self.time = item.time
        self.num_steps += item.num_steps

    def output(self) -> RequestOutput:
        first = self.first
        return RequestOutput(
            first.request_id,
            tuple(self.token_ids),
            "".join(self.texts),
            num_prompt_tokens=first.num_prompt_tokens,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            top_logprobs=None if self.top_logprobs is None else tuple(self.top_logprobs),
            time=self.time,
            num_steps=self.num_steps,
        )


class OutputStream:
    """FIFO of RequestOutput; the last item pushed has `finished` set."""

    def __init__(
        self,
        request_id: str,
        capacity: int = 64,
        loop: asyncio.AbstractEventLoop | None = None,
        lazy: bool = False,
    ):
        """`capacity`: unread outputs kept apart before new ones merge into the last.
        With `loop`, an asyncio consumer on that loop reads it with `async for`;
        `lazy`, it is woken only for a final output or a half-full buffer."""
        self.request_id = request_id
        self.capacity = capacity
        self.lazy = lazy
        self._items: deque[RequestOutput | _Merged] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._loop = loop
        self._async_ready = asyncio.Event() if loop is not None else None
        self._finished_read = False  # the consumer has taken the final item
        self._blocked = 0  # threads waiting in `get`: only they need the condition notified

    def push(self, item: RequestOutput, wake: bool = True) -> None:
        """Append without blocking, or merge into the last unread output (see above).

        With `wake` False an asyncio consumer is not woken: the caller calls `notify`.
        """
        with self._lock:
            items = self._items
            tail = items[-1] if items else None
            merge = (
                not item.finished
                and tail is not None
                and tail.queue_seconds is None  # the first output keeps its own time: TTFT
                and (isinstance(tail, _Merged) or len(items) >= self.capacity)
            )
            if not merge:
                items.append(item)
            else:
                if not isinstance(tail, _Merged):
                    tail = items[-1] = _Merged(tail)
                tail.add(item)
            if self._blocked:
                self._ready.notify_all()
        if wake:
            notify([self])

    def __len__(self) -> int:
        return len(self._items)

    def _pop(self) -> RequestOutput:
        item = self._items.popleft()
        return item.output() if isinstance(item, _Merged) else item

    def _wants_wake(self) -> bool:
        if not self.lazy:
            return True
        with self._lock:
            items = self._items
            return bool(items) and (items[-1].finished or 2 * len(items) >= self.capacity)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Next item, waiting up to `timeout` seconds (TimeoutError after)."""
        with self._ready:
            self._blocked += 1
            try:
                if not self._ready.wait_for(lambda: self._items, timeout):
                    raise TimeoutError(f"no output for {self.request_id} in {timeout}s")
            finally:
                self._blocked -= 1
            return self._pop()

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            with self._lock:
                if self._finished_read:
                    raise StopAsyncIteration
                if self._items:
                    item = self._pop()
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
