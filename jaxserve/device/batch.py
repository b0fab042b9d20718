"""Pack a step plan's chunks into the flat, padded host arrays the step takes.

Prefill, chunked prefill and decode are one case here: each row brings a chunk of
tokens starting at some position, and its pages must already cover them. Padding
tokens and rows point at the null page.
"""

from collections.abc import Sequence
from itertools import chain

import numpy as np

from jaxserve.config import MAX_LOGIT_BIAS
from jaxserve.device.attention import AttentionMetadata
from jaxserve.device.sampling import SamplingTensors
from jaxserve.device.step import StepInputs
from jaxserve.host.page_allocator import NULL_PAGE
from jaxserve.host.plan import Chunk


def pack_step(
    chunks: Sequence[Chunk],
    page_size: int,
    num_tokens: int,
    num_rows: int,
    max_pages: int,
    spare_row: int,
    attention_backend: str = "xla",
    num_draft_logits: int = 0,
) -> StepInputs:
    """Host arrays for one step, padded to (num_tokens, num_rows); logits at each chunk's
    end, or, for a chunk with drafts, at its last real token, and then at each draft in
    `num_draft_logits` more rows (buckets.draft_logits), the chunks' drafts in order.

    `spare_row` is the penalty row that padding rows (and chunks without a row) use.
    """
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_rows:
        raise ValueError(
            f"{len(chunks)} sequences with {total} tokens exceed the bucket "
            f"({num_rows} sequences, {num_tokens} tokens)"
        )
    pad_row = num_rows  # an extra, all-null row of the page table
    n = len(chunks)
    # one numpy call a field, not a few per chunk: at 256 decode rows the host has ~1 ms
    lens = np.fromiter((len(c.token_ids) for c in chunks), np.int32, n)
    starts = np.fromiter((c.start for c in chunks), np.int32, n)
    num_pages = np.fromiter((len(c.pages) for c in chunks), np.int32, n)
    ends = starts + lens
    short = (num_pages > max_pages) | ((ends + page_size - 1) // page_size > num_pages)
    if short.any():
        i = int(np.argmax(short))
        raise ValueError(
            f"row {i}: {num_pages[i]} pages do not cover positions up to {ends[i]} "
            f"(page_size {page_size}, max_pages {max_pages})"
        )
    offsets = np.cumsum(lens) - lens  # each chunk's first token in the batch
    page_table = np.full((num_rows + 1, max_pages), NULL_PAGE, np.int32)
    # a C-level chain, not a generator: ~1,800 pages at 256 rows, 37 against 52 us
    flat_pages = np.fromiter(chain.from_iterable([c.pages for c in chunks]), np.int32,
                             int(num_pages.sum()))
    page_rows = np.repeat(np.arange(n, dtype=np.int32), num_pages)
    page_table[page_rows, np.arange(len(flat_pages)) - np.repeat(np.cumsum(num_pages) - num_pages,
                                                                   num_pages)] = flat_pages
    token_ids = np.zeros(num_tokens, np.int32)
    token_ids[:total] = np.fromiter(chain.from_iterable([c.token_ids for c in chunks]),
                                    np.int32, total)
    seq_ids = np.full(num_tokens, pad_row, np.int32)
    seq_ids[:total] = np.repeat(np.arange(n, dtype=np.int32), lens)
    positions = np.zeros(num_tokens, np.int32)
    positions[:total] = np.arange(total, dtype=np.int32) + np.repeat(starts - offsets, lens)
    slot_mapping = np.full(num_tokens, NULL_PAGE * page_size, np.int32)
    live = positions[:total]
    slot_mapping[:total] = page_table[seq_ids[:total], live // page_size] * page_size + (
        live % page_size
    )
    cu_q_lens = np.full(num_rows + 2, total, np.int32)
    cu_q_lens[: n + 1] = np.concatenate([[0], np.cumsum(lens)])
    kv_lens = np.zeros(num_rows + 1, np.int32)
    kv_lens[:n] = ends
    drafts = np.fromiter((c.num_speculative for c in chunks), np.int32, n)
    num_drafts = int(drafts.sum())
    if num_drafts > num_draft_logits:
        raise ValueError(f"{num_drafts} draft tokens exceed the step's {num_draft_logits} "
                         "draft logits")
    logits_indices = np.zeros(num_rows + num_draft_logits, np.int32)
    logits_indices[:n] = offsets + lens - 1 - drafts
    if num_drafts:  # each draft's own token, in the chunks' order
        first = np.repeat(offsets + lens - drafts - (np.cumsum(drafts) - drafts), drafts)
        logits_indices[num_rows : num_rows + num_drafts] = first + np.arange(num_drafts)
    is_prompt = np.zeros(num_rows + 1, np.int32)  # the attention's (kv_lens' rows)
    is_prompt[:n] = np.fromiter((c.is_prompt for c in chunks), np.int32, n)
    prompt_rows = np.full(num_tokens, spare_row, np.int32)
    adapters = np.zeros(num_tokens, np.int32)
    for chunk, offset, length in zip(chunks, offsets.tolist(), lens.tolist()):
        if chunk.is_prompt and chunk.row is not None:
            prompt_rows[offset : offset + length] = chunk.row
        if chunk.adapter_slot:
            adapters[offset : offset + length] = chunk.adapter_slot
    bias_ids = np.zeros((num_rows, MAX_LOGIT_BIAS), np.int32)
    bias_values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    for i, chunk in enumerate(chunks):
        if chunk.params.logit_bias:
            ids, values = zip(*chunk.params.logit_bias)
            bias_ids[i, : len(ids)] = ids
            bias_values[i, : len(ids)] = values
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
        bias_ids=bias_ids,
        bias_values=bias_values,
    )
    metadata = AttentionMetadata(
        seq_ids, slot_mapping, page_table, cu_q_lens, kv_lens, logits_indices, attention_backend,
        is_prompt,
        np.array([num_rows + num_drafts], np.int32) if num_draft_logits else None,
    )
    draft_rows = np.zeros(num_draft_logits, np.int32)
    draft_rows[:num_drafts] = np.repeat(np.arange(n, dtype=np.int32), drafts)
    draft_counters = np.zeros(num_draft_logits, np.int32)
    # a row's token is drawn with its counter, the one after its i-th draft with i more
    draft_counters[:num_drafts] = sampling.counters[draft_rows[:num_drafts]] + (
        np.arange(num_drafts) - np.repeat(np.cumsum(drafts) - drafts, drafts) + 1)
    return StepInputs(token_ids, positions, metadata, sampling, adapters, draft_rows,
                      draft_counters)
