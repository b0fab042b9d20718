"""Pack a step plan's chunks into the flat, padded host arrays the step takes.

Prefill, chunked prefill and decode are one case here: each row brings a chunk of
tokens starting at some position, and its pages must already cover them. Padding
tokens and rows point at the null page.
"""

from collections.abc import Sequence

import numpy as np

from jaxserve.attention import AttentionMetadata
from jaxserve.page_allocator import NULL_PAGE
from jaxserve.plan import Chunk
from jaxserve.sampling import SamplingTensors
from jaxserve.step import StepInputs


def pack_step(
    chunks: Sequence[Chunk],
    page_size: int,
    num_tokens: int,
    num_rows: int,
    max_pages: int,
    spare_row: int,
    attention_backend: str = "xla",
) -> StepInputs:
    """Host arrays for one step, padded to (num_tokens, num_rows); logits at each chunk's end.

    `spare_row` is the penalty row that padding rows (and chunks without a row) use.
    """
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_rows:
        raise ValueError(
            f"{len(chunks)} sequences with {total} tokens exceed the bucket "
            f"({num_rows} sequences, {num_tokens} tokens)"
        )
    pad_row = num_rows  # an extra, all-null row of the page table
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    seq_ids = np.full(num_tokens, pad_row, np.int32)
    slot_mapping = np.full(num_tokens, NULL_PAGE * page_size, np.int32)
    page_table = np.full((num_rows + 1, max_pages), NULL_PAGE, np.int32)
    cu_q_lens = np.zeros(num_rows + 2, np.int32)
    kv_lens = np.zeros(num_rows + 1, np.int32)
    logits_indices = np.zeros(num_rows, np.int32)
    prompt_rows = np.full(num_tokens, spare_row, np.int32)
    offset = 0
    for i, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        span = slice(offset, offset + n)
        pos = np.arange(chunk.start, chunk.start + n, dtype=np.int32)
        pages = np.asarray(chunk.pages, np.int32)
        if len(pages) > max_pages or (chunk.start + n + page_size - 1) // page_size > len(pages):
            raise ValueError(
                f"row {i}: {len(pages)} pages do not cover positions up to "
                f"{chunk.start + n} (page_size {page_size}, max_pages {max_pages})"
            )
        token_ids[span] = chunk.token_ids
        positions[span] = pos
        seq_ids[span] = i
        slot_mapping[span] = pages[pos // page_size] * page_size + pos % page_size
        page_table[i, : len(pages)] = pages
        if chunk.is_prompt and chunk.row is not None:
            prompt_rows[span] = chunk.row
        logits_indices[i] = offset + n - 1
        kv_lens[i] = chunk.start + n
        offset += n
        cu_q_lens[i + 1 :] = offset
    padding = [Chunk((), 1, (), samples=False)] * (num_rows - len(chunks))
    rows = list(chunks) + padding
    sampling = SamplingTensors(
        temperature=np.array([c.params.temperature for c in rows], np.float32),
        # past the vocabulary top_k keeps every token; the clamp keeps it within i32
        top_k=np.array([min(max(c.params.top_k, 0), 2**31 - 1) for c in rows], np.int32),
        top_p=np.array([c.params.top_p for c in rows], np.float32),
        min_p=np.array([c.params.min_p for c in rows], np.float32),
        presence_penalty=np.array([c.params.presence_penalty for c in rows], np.float32),
        frequency_penalty=np.array([c.params.frequency_penalty for c in rows], np.float32),
        repetition_penalty=np.array([c.params.repetition_penalty for c in rows], np.float32),
        seeds=np.array([c.seed for c in rows], np.uint32),
        counters=np.array([c.num_generated for c in rows], np.int32),
        rows=np.array([spare_row if c.row is None else c.row for c in rows], np.int32),
        first_chunk=np.array([c.first and c.row is not None for c in rows], bool),
        samples=np.array([c.samples and c.row is not None for c in rows], bool),
        prompt_rows=prompt_rows,
        logprobs=np.array(
            [-1 if c.params.logprobs is None else c.params.logprobs for c in rows], np.int32
        ),
    )
    metadata = AttentionMetadata(
        seq_ids, slot_mapping, page_table, cu_q_lens, kv_lens, logits_indices, attention_backend
    )
    return StepInputs(token_ids, positions, metadata, sampling)
