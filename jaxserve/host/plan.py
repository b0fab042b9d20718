"""One step's plan, as plain data: what the scheduler hands the device side (no jax).

The scheduler builds it from its request records and nothing in it points back at
them: the runner packs it into the step's arrays (`batch.pack_step`) and answers with
a `results.StepOutput`, row for row.

Prefill, chunked prefill and decode are one case: each row brings a chunk of tokens
starting at some position. A decode row may carry draft tokens after its last real
one (speculative decoding): the step computes them all, and the runner returns how many
of them the model accepts, plus the token it samples after the last accepted one.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.checkpoint.adapter import Adapter
from jaxserve.config import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def pending_token(row: int) -> int:
    """The token id that stands for row `row`'s token sampled by a step still in flight
    (async scheduling): the step reads that row's last sampled token in its place."""
    return -1 - row


@dataclass(slots=True)
class Chunk:
    """One row's work this step: tokens to compute from `start`, and how to sample after.

    Not frozen, though nothing changes it once made: a frozen dataclass's `__init__` sets
    each field through `object.__setattr__`, 1.3 us against 0.2 for these 15 fields, paid
    for every row of every step."""

    token_ids: Sequence[int]  # the tokens to compute, real ones then `num_speculative` drafts
    start: int  # position of token_ids[0] in the request
    pages: Sequence[int]  # the request's pages, covering start + len(token_ids)
    params: SamplingParams = GREEDY
    seed: int = 0
    num_generated: int = 0  # tokens the request has generated so far (the sampling key's counter)
    row: int | None = None  # the request's batch row (its penalty state); None: the spare row
    is_prompt: bool = True  # the tokens are prompt tokens (not yet counted as output)
    samples: bool = True  # the chunk reaches the request's last token: sample after it
    first: bool = True  # the request's first computed chunk: its penalty row starts clean
    request_id: str = ""
    shard: int = 0  # the data shard whose pages and rows the request holds
    num_speculative: int = 0  # trailing draft tokens, verified by the step
    # for prompt logprobs: the prompt token after each of this chunk's tokens (0 past the
    # prompt's end); None when the request asks for none
    score_targets: tuple[int, ...] | None = None
    adapter_slot: int = 0  # the device slot of the request's LoRA adapter; 0: none


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: its chunks (decodes first, then prefills) and the bucket they fill."""

    step: int
    chunks: tuple[Chunk, ...]
    bucket: tuple[int, int]  # (num_tokens, num_rows) of every shard's batch
    admitted: tuple[str, ...] = ()  # requests admitted for this step
    # LoRA adapters to write into device slots before the step: (slot, adapter)
    adapter_loads: tuple[tuple[int, Adapter], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
