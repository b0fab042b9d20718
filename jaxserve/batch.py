"""Pack sequences' work for one step into the flat, padded host arrays the step takes.

Prefill, chunked prefill and decode are one case here: each sequence brings a
chunk of tokens starting at some position, and its pages must already cover
them. Padding tokens and rows point at the null page.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.attention import AttentionMetadata
from jaxserve.page_allocator import NULL_PAGE
from jaxserve.sampling import SamplingTensors
from jaxserve.step import StepInputs


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's tokens to compute this step."""

    token_ids: Sequence[int]
    start: int  # position of token_ids[0] in the sequence
    pages: Sequence[int]  # the sequence's pages, covering start + len(token_ids)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_generated: int = 0


def pack_step(
    chunks: Sequence[Chunk],
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    max_pages: int,
    attention_backend: str = "xla",
) -> StepInputs:
    """Host arrays for one step, padded to (num_tokens, num_seqs); logits at each chunk's end."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(
            f"{len(chunks)} sequences with {total} tokens exceed the bucket "
            f"({num_seqs} sequences, {num_tokens} tokens)"
        )
    pad_row = num_seqs  # an extra, all-null row of the page table
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    seq_ids = np.full(num_tokens, pad_row, np.int32)
    slot_mapping = np.full(num_tokens, NULL_PAGE * page_size, np.int32)
    page_table = np.full((num_seqs + 1, max_pages), NULL_PAGE, np.int32)
    cu_q_lens = np.zeros(num_seqs + 2, np.int32)
    kv_lens = np.zeros(num_seqs + 1, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    offset = 0
    for row, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        span = slice(offset, offset + n)
        pos = np.arange(chunk.start, chunk.start + n, dtype=np.int32)
        pages = np.asarray(chunk.pages, np.int32)
        if len(pages) > max_pages or (chunk.start + n + page_size - 1) // page_size > len(pages):
            raise ValueError(
                f"row {row}: {len(pages)} pages do not cover positions up to "
                f"{chunk.start + n} (page_size {page_size}, max_pages {max_pages})"
            )
        token_ids[span] = chunk.token_ids
        positions[span] = pos
        seq_ids[span] = row
        slot_mapping[span] = pages[pos // page_size] * page_size + pos % page_size
        page_table[row, : len(pages)] = pages
        logits_indices[row] = offset + n - 1
        kv_lens[row] = chunk.start + n
        offset += n
        cu_q_lens[row + 1 :] = offset
    padding = [Chunk((), 0, ())] * (num_seqs - len(chunks))
    rows = list(chunks) + padding
    sampling = SamplingTensors.from_rows(
        temperature=[c.temperature for c in rows],
        top_k=[c.top_k for c in rows],
        top_p=[c.top_p for c in rows],
        seeds=[c.seed for c in rows],
        counters=[c.num_generated for c in rows],
    )
    metadata = AttentionMetadata(
        seq_ids, slot_mapping, page_table, cu_q_lens, kv_lens, logits_indices, attention_backend
    )
    return StepInputs(token_ids, positions, metadata, sampling)
