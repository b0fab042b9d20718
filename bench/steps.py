"""Scheduler outputs made by hand, to time the runner on chosen shapes (no jax here)."""

from jaxserve.config import SamplingParams
from jaxserve.page_allocator import PageAllocator
from jaxserve.request import Request
from jaxserve.scheduler import RunningSequence, ScheduledChunk, SchedulerOutput

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def fabricated_step(
    allocator: PageAllocator,
    bucket: tuple[int, int],
    num_rows: int,
    tokens_per_row: int,
    context: int,
    page_size: int,
    vocab_size: int,
) -> SchedulerOutput:
    """`num_rows` sequences, each computing its last `tokens_per_row` tokens up to position
    `context`, padded to `bucket`.

    Every row holds pages of its own from `allocator` (so attention reads distinct KV
    pages, as in serving); free them with `release`. One token a row is a decode (the
    sequence has one generated token), more is the last chunk of a prompt.
    """
    if not 1 <= tokens_per_row <= context:
        raise ValueError(f"need 1 <= tokens_per_row ({tokens_per_row}) <= context ({context})")
    chunks = []
    for row in range(num_rows):
        request_id = f"bench-{row}"
        tokens = [(row * 7919 + i) % vocab_size for i in range(context)]
        prompt = tokens[:-1] if tokens_per_row == 1 else tokens
        pages = allocator.allocate(request_id, -(-context // page_size))
        request = Request(request_id, tuple(prompt), GREEDY, seed=row)
        start = context - tokens_per_row
        seq = RunningSequence(request, pages, row, tokens, num_computed=start)
        chunks.append(ScheduledChunk(seq, start, tuple(tokens[start:])))
    return SchedulerOutput(0, tuple(chunks), bucket)


def release(allocator: PageAllocator, out: SchedulerOutput) -> None:
    """Give back the pages `fabricated_step` took."""
    for chunk in out.chunks:
        allocator.free(chunk.seq.request_id, chunk.seq.pages)
