"""Iteration-level scheduling: every step, admit, plan chunks, pick the bucket (no jax).

Admission order: the most urgent priority class first; inside it, the tenant with
the fewest running sequences (fair share, so one tenant's flood cannot take every
row); first come, first served inside a tenant. A request whose pages do not fit
blocks those behind it rather than being overtaken forever.

One progress rule covers prefill, chunked prefill and decode: a sequence's
computed tokens catch up with its tokens. Each step a running sequence gets a
chunk of its not-yet-computed tokens; when the chunk reaches its last token, the
step samples the next one. Admission reserves the request's maximum pages,
ceil((prompt + max_tokens) / page_size), and never preempts a running sequence.
"""

from collections import Counter, deque
from dataclasses import dataclass, field

from jaxserve.buckets import BucketTable
from jaxserve.page_allocator import PageAllocator
from jaxserve.request import Request, RequestRejected


@dataclass
class RunningSequence:
    """A request admitted to the batch: its pages and how far its KV has been computed."""

    request: Request
    pages: list[int]
    slot: int  # stable batch position while running (indexes per-sequence device state)
    token_ids: list[int]  # prompt, then every token sampled so far
    num_computed: int = 0  # tokens whose K/V are in the cache
    admitted_step: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.request.prompt_ids)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one running sequence to compute this step."""

    seq: RunningSequence
    start: int  # position of token_ids[0]
    token_ids: tuple[int, ...]

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so the step samples its next."""
        return self.start + len(self.token_ids) == len(self.seq.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan: the chunks (decodes first, then prefills) and the bucket they fill."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    bucket: tuple[int, int]  # (num_tokens, num_seqs)
    admitted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class Scheduler:
    """Waiting queue, running batch and page reservations."""

    allocator: PageAllocator
    buckets: BucketTable
    page_size: int
    max_batch: int
    max_model_len: int
    token_budget: int = 512
    waiting: deque[Request] = field(default_factory=deque)
    running: dict[str, RunningSequence] = field(default_factory=dict)  # in admission order
    step_index: int = 0
    free_slots: list[int] = field(init=False)
    running_per_tenant: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.token_budget < self.max_batch:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be at least max_batch "
                f"({self.max_batch}): every running sequence decodes one token a step"
            )
        self.buckets.choose(self.token_budget, self.max_batch)  # the table must hold a full step
        self.free_slots = list(range(self.max_batch - 1, -1, -1))  # pop() gives 0 first

    def pages_needed(self, request: Request) -> int:
        return -(-request.max_total_tokens // self.page_size)

    def check(self, request: Request) -> None:
        """Raise RequestRejected if `request` could never be admitted."""
        if request.max_total_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                f"({request.params.max_tokens}) = {request.max_total_tokens} exceeds the "
                f"model's context of {self.max_model_len} tokens"
            )
        if self.pages_needed(request) > self.allocator.num_usable:
            raise RequestRejected(
                f"request needs {self.pages_needed(request)} KV pages, the pool has "
                f"{self.allocator.num_usable}"
            )

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    def finish(self, request_id: str) -> None:
        """Drop a finished or cancelled request, freeing its pages at once."""
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self.allocator.free(request_id, seq.pages)
            self.free_slots.append(seq.slot)
            self.running_per_tenant[seq.request.tenant] -= 1
            return
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)

    def schedule(self) -> SchedulerOutput:
        """Admit what fits, then plan this step's chunks under the token budget."""
        admitted = self._admit()
        budget = self.token_budget
        chunks = []
        for seq in self.running.values():  # decodes first: they must not wait on prefills
            if not seq.in_prefill:
                chunks.append(self._chunk(seq, 1))
                budget -= 1
        for seq in self.running.values():  # then prefill chunks, oldest first
            if seq.in_prefill and budget > 0:
                n = min(len(seq.token_ids) - seq.num_computed, budget)
                chunks.append(self._chunk(seq, n))
                budget -= n
        num_tokens = sum(len(c.token_ids) for c in chunks)
        bucket = self.buckets.choose(num_tokens, len(chunks)) if chunks else (0, 0)
        out = SchedulerOutput(self.step_index, tuple(chunks), bucket, admitted)
        self.step_index += 1
        return out

    def next_waiting(self) -> Request | None:
        """The request admission takes next (see the module docstring)."""
        best, best_key = None, None
        seen_tenants = set()
        for request in self.waiting:  # oldest first: each tenant's first request competes
            if request.tenant in seen_tenants:
                continue
            seen_tenants.add(request.tenant)
            key = (request.priority, self.running_per_tenant[request.tenant])
            if best_key is None or key < best_key:
                best, best_key = request, key
        return best

    def _admit(self) -> tuple[str, ...]:
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            request = self.next_waiting()
            need = self.pages_needed(request)
            if not self.allocator.can_allocate(need):
                break  # it waits for pages; nobody overtakes it
            self.waiting.remove(request)
            self.running_per_tenant[request.tenant] += 1
            pages = self.allocator.allocate(request.request_id, need)
            self.running[request.request_id] = RunningSequence(
                request,
                pages,
                self.free_slots.pop(),
                list(request.prompt_ids),
                admitted_step=self.step_index,
            )
            admitted.append(request.request_id)
        return tuple(admitted)

    @staticmethod
    def _chunk(seq: RunningSequence, n: int) -> ScheduledChunk:
        start = seq.num_computed
        return ScheduledChunk(seq, start, tuple(seq.token_ids[start : start + n]))

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance computed counts and append each sampled token (by request id)."""
        for chunk in out.chunks:
            chunk.seq.num_computed += len(chunk.token_ids)
            if chunk.samples and chunk.seq.request_id in sampled:
                chunk.seq.token_ids.append(sampled[chunk.seq.request_id])

    def check_invariants(self) -> None:
        """Assert the page books balance: each page owned once, by the sequence holding it."""
        held = [page for seq in self.running.values() for page in seq.pages]
        if len(held) != len(set(held)):
            raise AssertionError("a page is owned by two sequences")
        for seq in self.running.values():
            for page in seq.pages:
                if self.allocator.owner_of(page) != seq.request_id:
                    raise AssertionError(f"page {page} of {seq.request_id} is not booked to it")
        if self.allocator.num_free + len(held) != self.allocator.num_usable:
            raise AssertionError(
                f"{self.allocator.num_free} free + {len(held)} held != "
                f"{self.allocator.num_usable} pages"
            )
