"""Iteration-level scheduling: every step, admit, plan chunks, pick the bucket (no jax).

Admission order: the most urgent priority class first; inside it, the tenant with
the fewest running sequences (fair share); first come, first served inside a
tenant. A request whose pages do not fit blocks those behind it rather than being
overtaken forever. While more than one tenant is active (has sent a request in the
last ACTIVE_WINDOW_S seconds), no tenant may hold more than max_batch −
reserved_rows rows: without preemption, a row kept free is what lets another
tenant's request start at the next step instead of after one of the flood's
requests ends. A tenant alone uses the whole batch. Prefill chunks take the token
budget left after the decodes in the same order (priority class, then the tenant with
fewer rows, then oldest), so a flood's backlog of admitted prompts does not hold back
another tenant's first token either.

Prefix caching: a new request reuses every leading full page of its prompt that
is already cached (for its cache salt) and prefills only the rest. At least one
prompt token is always computed, since the step needs logits to sample from, so
a prompt made only of cached full pages recomputes its last page into a private
one. Full pages are registered as cached content once their K/V are computed.

Data parallelism: with several data shards, each has its own page pool, its own
rows and its own token budget, and a sequence lives on one shard for its whole
life. A new request goes to the least-loaded shard that fits it: the fewest
tokens left to compute (counting the new request's uncached prompt, so a shard
holding its prefix gains), then the most free pages. Every shard's batch is
padded to one common bucket, since the shards run one step together.

One progress rule covers prefill, chunked prefill and decode: a request's
computed tokens catch up with its tokens. Each step a running request gets a
chunk of its not-yet-computed tokens; when the chunk reaches its last token, the
step samples the next one. A chunk counts as computed once planned, and the token it
samples as pending until the engine appends it (`advance`): so the next step can be
planned while this one runs (async scheduling), a decode of a pending token carrying a
placeholder (`plan.pending_token`) that the device fills in. A request whose pending
tokens reach its max_tokens, or that has finished, is planned no more. A decoding
request with draft tokens (speculative decoding) carries them after its last token, as
far as the token budget and its pages allow. Admission reserves the request's maximum
pages, ceil((prompt + max_tokens) / page_size), and never preempts a running request.

LoRA adapters: a request with an adapter is admitted only once its adapter has a device
slot, or can take one (`adapters.SlotTable`): like its pages, a slot it cannot get makes
it wait, and nobody overtakes it. A slot taken for another adapter is written before the
step (`StepPlan.adapter_loads`).

The scheduler owns the request records (`request.Request`); the plan it hands the
device side each step is plain data copied from them (`plan.StepPlan`).
"""

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from jaxserve.host.adapters import SlotTable
from jaxserve.host.buckets import BucketTable, draft_logits
from jaxserve.host.page_allocator import PageAllocator, page_keys
from jaxserve.host.plan import Chunk, StepPlan, pending_token
from jaxserve.host.request import Request, RequestRejected

ACTIVE_WINDOW_S = 30.0  # a tenant that sent a request this recently shares the batch


@dataclass
class Scheduler:
    """Waiting queue, running batch and page reservations, over one or more data shards.

    `max_batch` and `token_budget` are per shard; pass one allocator per shard.
    """

    allocators: list[PageAllocator]
    buckets: BucketTable
    page_size: int
    max_batch: int
    max_model_len: int
    token_budget: int = 512
    prefix_caching: bool = True
    reserved_rows: int = 0  # rows no tenant may take while others are active
    adapter_slots: SlotTable | None = None  # LoRA adapters' device slots, when served
    num_speculative_tokens: int = 0  # drafts a request may carry a step (0: none)
    waiting: deque[Request] = field(default_factory=deque)
    running: dict[str, Request] = field(default_factory=dict)  # in admission order
    step_index: int = 0
    free_rows: list[list[int]] = field(init=False)  # per shard
    running_per_tenant: Counter = field(default_factory=Counter)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found cached
    last_arrival: dict[str, float] = field(default_factory=dict)  # tenant -> arrival_time

    def __post_init__(self) -> None:
        if self.token_budget < self.max_batch:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be at least max_batch "
                f"({self.max_batch}): every running request decodes one token a step"
            )
        self.buckets.choose(self.token_budget, self.max_batch)  # the table must hold a full step
        # pop() gives 0 first
        self.free_rows = [list(range(self.max_batch - 1, -1, -1)) for _ in self.allocators]

    @property
    def num_shards(self) -> int:
        return len(self.allocators)

    @property
    def num_pages_usable(self) -> int:
        return sum(a.num_usable for a in self.allocators)

    @property
    def num_pages_free(self) -> int:
        return sum(a.num_free for a in self.allocators)

    @property
    def num_pages_cached(self) -> int:
        return sum(a.num_cached for a in self.allocators)

    @property
    def num_pages_used(self) -> int:
        return sum(a.num_used for a in self.allocators)

    def pages_needed(self, request: Request) -> int:
        return -(-request.max_total_tokens // self.page_size)

    def check(self, request: Request) -> None:
        """Raise RequestRejected if `request` could never be admitted: the one check of a
        request's length, for the offline API and the server alike."""
        length, limit = len(request.prompt_ids), self.max_model_len
        if length >= limit:
            raise RequestRejected(
                f"prompt has {length} tokens; the model's context is {limit}",
                "prompt", "context_length_exceeded",
            )
        if request.max_total_tokens > limit:
            raise RequestRejected(
                f"prompt ({length} tokens) + max_tokens ({request.params.max_tokens}) = "
                f"{request.max_total_tokens} exceeds the model's context of {limit} tokens",
                "max_tokens", "context_length_exceeded",
            )
        if request.adapter is not None and self.adapter_slots is None:
            raise RequestRejected("this engine serves no LoRA adapters", "model")
        pool = self.allocators[0].num_usable
        if self.pages_needed(request) > pool:
            raise RequestRejected(
                f"request needs {self.pages_needed(request)} KV pages, the pool has {pool}"
                + (" per data shard" if self.num_shards > 1 else ""),
                "max_tokens",
            )

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)
        horizon = request.arrival_time - ACTIVE_WINDOW_S
        active = {t: a for t, a in self.last_arrival.items() if a >= horizon}
        active[request.tenant] = max(active.get(request.tenant, 0.0), request.arrival_time)
        self.last_arrival = active  # one assignment: readers on other threads see either

    def finish(self, request_id: str) -> None:
        """Drop a finished or cancelled request, freeing its pages and row at once."""
        request = self.running.pop(request_id, None)
        if request is not None:
            self.allocators[request.shard].free(request_id, request.pages)
            self.free_rows[request.shard].append(request.row)
            self.running_per_tenant[request.tenant] -= 1
            if request.adapter is not None:
                self.adapter_slots.release(request.adapter)
            return
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan this step's chunks under each shard's token budget."""
        admitted, loads = self._admit()
        chunks = []
        widest = (0, 0)  # (tokens, rows) of the fullest shard
        for shard in range(self.num_shards):
            mine = self._plan(shard)
            chunks += mine
            tokens = sum(len(c.token_ids) for c in mine)
            widest = (max(widest[0], tokens), max(widest[1], len(mine)))
        bucket = self.buckets.choose(*widest) if chunks else (0, 0)
        self._fit_drafts(chunks, bucket)
        plan = StepPlan(self.step_index, tuple(chunks), bucket, admitted, loads)
        self.step_index += 1
        return plan

    def _plan(self, shard: int) -> list[Chunk]:
        """One shard's chunks: every decode (with what drafts the budget leaves room for),
        then prefill chunks in the budget, in admission's order (see the module docstring)."""
        decoding, prefilling = [], []
        for r in self.running.values():
            if (r.shard == shard and not r.finished
                    and r.num_generated + r.num_pending < r.params.max_tokens):
                (prefilling if r.in_prefill else decoding).append(r)
        budget = self.token_budget - len(decoding)  # a decode's own token comes first
        chunks = []
        for request in decoding:  # decodes first: they must not wait on prefills
            drafts = request.spec_token_ids
            if drafts:  # they fit the budget and the request's pages (its maximum length)
                room = request.max_total_tokens - request.num_tokens
                drafts = drafts[: max(0, min(budget, room))]
                budget -= len(drafts)
            chunks.append(self._chunk(request, 1, drafts))
        # a stable sort: oldest first among equals
        prefilling.sort(key=lambda r: (r.priority, self.running_per_tenant[r.tenant]))
        for request in prefilling:
            if budget <= 0:
                break
            n = min(request.num_tokens - request.num_computed, budget)
            chunks.append(self._chunk(request, n))
            budget -= n
        return chunks

    def row_cap(self) -> int:
        """Rows one tenant may hold now: all of them unless other tenants are active.
        Reads only, so the server's thread may ask too."""
        horizon = time.monotonic() - ACTIVE_WINDOW_S
        rows = self.max_batch * self.num_shards
        if sum(a >= horizon for a in list(self.last_arrival.values())) < 2:
            return rows
        return max(1, rows - self.reserved_rows)

    def next_waiting(self) -> Request | None:
        """The request admission takes next (see the module docstring)."""
        best, best_key = None, None
        seen_tenants = set()
        cap = self.row_cap()
        for request in self.waiting:  # oldest first: each tenant's first request competes
            if request.tenant in seen_tenants:
                continue
            seen_tenants.add(request.tenant)
            if self.running_per_tenant[request.tenant] >= cap:
                continue
            key = (request.priority, self.running_per_tenant[request.tenant])
            if best_key is None or key < best_key:
                best, best_key = request, key
        return best

    def _admit(self) -> tuple[tuple[str, ...], tuple]:
        """Admit what fits; the ids admitted and the adapters to write into slots."""
        admitted, loads = [], []
        while self.waiting:
            request = self.next_waiting()
            if request is None:  # every waiting tenant is at its row cap
                break
            adapter = request.adapter
            placed = None
            if adapter is None or self.adapter_slots.can_place(adapter):
                placed = self._place(request)
            if placed is None:
                break  # it waits for pages, a row or a slot; nobody overtakes it
            shard, cached = placed
            allocator = self.allocators[shard]
            self.waiting.remove(request)
            self.running_per_tenant[request.tenant] += 1
            allocator.share(request.request_id, cached)
            need = self.pages_needed(request) - len(cached)
            num_cached = len(cached) * self.page_size
            self.prefix_queries += len(request.prompt_ids)
            self.prefix_hits += num_cached
            # the pages are fixed for its life: a tuple, which the plan can share as is
            request.pages = tuple(cached + allocator.allocate(request.request_id, need))
            request.shard, request.row = shard, self.free_rows[shard].pop()
            request.num_computed = request.num_cached_tokens = num_cached
            request.num_registered_pages = len(cached)
            if adapter is not None:
                request.adapter_slot, swap = self.adapter_slots.acquire(adapter)
                if swap:
                    loads.append((request.adapter_slot, adapter))
            self.running[request.request_id] = request
            admitted.append(request.request_id)
        return tuple(admitted), tuple(loads)

    def _place(self, request: Request) -> tuple[int, list[int]] | None:
        """The least-loaded shard with a free row and the pages for `request`, and the
        cached prefix pages it reuses there; None if no shard fits it now."""
        best, best_key = None, None
        for shard, allocator in enumerate(self.allocators):
            if not self.free_rows[shard]:
                continue
            cached = self._cached_prefix(request, allocator)
            allocator.share(request.request_id, cached)  # held: the check cannot evict them
            fits = allocator.can_allocate(self.pages_needed(request) - len(cached))
            allocator.free(request.request_id, cached)
            if not fits:
                continue
            backlog = sum(
                r.num_tokens - r.num_computed for r in self.running.values() if r.shard == shard
            )
            uncached = len(request.prompt_ids) - len(cached) * self.page_size
            key = (backlog + uncached, -allocator.num_free)
            if best_key is None or key < best_key:
                best, best_key = (shard, cached), key
        return best

    def _cached_prefix(self, request: Request, allocator: PageAllocator) -> list[int]:
        """Cached pages of the request's leading full prompt pages, leaving one token to run."""
        # The repetition penalty needs every prompt token in the step's inputs, and
        # prompt logprobs need every prompt token's logits.
        params = request.params
        if not self.prefix_caching or params.repetition_penalty != 1.0 or (
            params.prompt_logprobs is not None
        ):
            return []
        usable = (len(request.prompt_ids) - 1) // self.page_size
        keys = page_keys(request.prompt_ids[: usable * self.page_size], self.page_size,
                         request.cache_salt)
        return allocator.match_prefix(keys)

    def _fit_drafts(self, chunks: list[Chunk], bucket: tuple[int, int]) -> None:
        """Cut each shard's drafts, last rows first, to what a step of `bucket` verifies
        (`buckets.draft_logits`): where the bucket pads the rows, their padding takes
        some of the tokens' room. A cut draft only costs its row a step."""
        room = draft_logits(bucket, self.num_speculative_tokens)
        for shard in range(self.num_shards):
            drafted = [c for c in chunks if c.shard == shard and c.num_speculative]
            excess = sum(c.num_speculative for c in drafted) - room
            for chunk in reversed(drafted):
                if excess <= 0:
                    break
                cut = min(excess, chunk.num_speculative)
                chunk.token_ids = chunk.token_ids[: len(chunk.token_ids) - cut]
                chunk.num_speculative -= cut
                excess -= cut

    @staticmethod
    def _chunk(request: Request, n: int, drafts: tuple[int, ...] = ()) -> Chunk:
        """The plain-data row for `request`'s next `n` tokens (and `drafts` after them),
        counted as computed from now on (see the module docstring)."""
        start = request.num_computed
        end = start + n
        prompt = request.in_prefill
        targets = None
        if prompt and request.params.prompt_logprobs is not None:
            following = request.prompt_ids[start + 1 : end + 1]
            targets = following + (0,) * (n - len(following))  # none after the last
        tokens = tuple(request.token_ids[start:end])
        if len(tokens) < n:  # a decode of the token a step in flight samples
            tokens = (pending_token(request.row),)
        samples = end == request.num_tokens
        chunk = Chunk(  # positional: keywords cost ~0.4 us more a row, every step
            tokens + drafts,  # token_ids
            start,
            request.pages,
            request.params,
            request.seed,
            request.num_generated + request.num_pending,  # num_generated
            request.row,
            prompt,  # is_prompt
            samples,
            start == request.num_cached_tokens,  # first
            request.request_id,
            request.shard,
            len(drafts),  # num_speculative
            targets,  # score_targets
            request.adapter_slot,
        )
        request.num_computed = end
        request.num_pending += samples
        return chunk

    def advance(self, request: Request, chunk: Chunk, num_appended: int) -> None:
        """Take in `chunk`'s results, after the engine appended `num_appended` of the
        step's tokens to `request`: its sampled token is no longer pending, and the drafts
        accepted (every token appended but the one sampled after them) count as computed."""
        request.num_pending -= chunk.samples
        if chunk.num_speculative:
            request.num_computed += max(0, num_appended - 1)
        if self.prefix_caching:
            self._register_full_pages(request)

    def _register_full_pages(self, request: Request) -> None:
        """Record each newly completed full page as cached content, for later requests."""
        # the tokens of pages a step in flight computes are known: their reader's step
        # comes after it
        full = min(request.num_computed, len(request.token_ids)) // self.page_size
        if full <= request.num_registered_pages:
            return
        done, size = request.num_registered_pages, self.page_size
        if done and request.last_page_key is None:  # pages shared from the cache at admission
            request.last_page_key = page_keys(request.token_ids[: done * size], size,
                                              request.cache_salt)[-1]
        # only the new pages are hashed, chained from the last key: hashing the whole
        # sequence again each time a page fills cost O(length²)
        keys = page_keys(request.token_ids[done * size : full * size], size, request.cache_salt,
                         request.last_page_key)
        for page, key in zip(request.pages[done:full], keys):
            self.allocators[request.shard].register(page, key)
        request.num_registered_pages, request.last_page_key = full, keys[-1]

    def check_invariants(self) -> None:
        """Assert the page books balance: each page owned once, by the sequence holding it."""
        for shard, alloc in enumerate(self.allocators):
            mine = [r for r in self.running.values() if r.shard == shard]
            private = [page for r in mine for page in r.pages[r.num_registered_pages :]]
            if len(private) != len(set(private)):
                raise AssertionError("a private page is owned by two requests")
            held = set()
            for r in mine:
                if len(set(r.pages)) != len(r.pages):
                    raise AssertionError(f"{r.request_id} holds a page twice")
                for page in r.pages:
                    if r.request_id not in alloc.owners_of(page):
                        raise AssertionError(f"page {page} of {r.request_id} is not booked to it")
                    held.add(page)
            if alloc.num_free + alloc.num_cached + len(held) != alloc.num_usable:
                raise AssertionError(
                    f"shard {shard}: {alloc.num_free} free + {alloc.num_cached} cached + "
                    f"{len(held)} held != {alloc.num_usable} pages"
                )
            if len(mine) + len(self.free_rows[shard]) != self.max_batch:
                raise AssertionError(f"shard {shard}: running requests and free rows do not add up")
