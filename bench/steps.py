"""Step plans made by hand, to time the runner on chosen shapes (no jax here)."""

from jaxserve.config import SamplingParams
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.plan import Chunk, StepPlan

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def fabricated_step(
    allocator: PageAllocator,
    bucket: tuple[int, int],
    num_rows: int,
    tokens_per_row: int,
    context: int,
    page_size: int,
    vocab_size: int,
) -> StepPlan:
    """`num_rows` requests, each computing its last `tokens_per_row` tokens up to position
    `context`, padded to `bucket`.

    Every row holds pages of its own from `allocator` (so attention reads distinct KV
    pages, as in serving); free them with `release`. One token a row is a decode (the
    request has one generated token), more is the last chunk of a prompt.
    """
    if not 1 <= tokens_per_row <= context:
        raise ValueError(f"need 1 <= tokens_per_row ({tokens_per_row}) <= context ({context})")
    chunks = []
    decode = tokens_per_row == 1
    for row in range(num_rows):
        request_id = f"bench-{row}"
        start = context - tokens_per_row
        tokens = tuple((row * 7919 + i) % vocab_size for i in range(start, context))
        pages = tuple(allocator.allocate(request_id, -(-context // page_size)))
        chunks.append(Chunk(
            tokens, start, pages, GREEDY, seed=row, num_generated=int(decode), row=row,
            is_prompt=not decode, first=start == 0, request_id=request_id,
        ))
    return StepPlan(0, tuple(chunks), bucket)


def release(allocator: PageAllocator, plan: StepPlan) -> None:
    """Give back the pages `fabricated_step` took."""
    for chunk in plan.chunks:
        allocator.free(chunk.request_id, chunk.pages)
