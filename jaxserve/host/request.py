"""One record per request, from submission to its end (no jax).

What the client asked for, where the request runs (its shard, batch row and pages), how
far its KV has been computed, the tokens it holds and the text released to its client:
one mutable record that the scheduler owns. The engine appends each sampled token once
(`append`, which also decides whether to stop), and the scheduler frees its pages once.
The step plan handed to the device side is plain data copied from it (`plan.Chunk`).
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxserve.checkpoint.adapter import Adapter
from jaxserve.config import SamplingParams
from jaxserve.host.output_text import OutputText
from jaxserve.host.stream import OutputStream

if TYPE_CHECKING:
    from jaxserve.host.ngram import NgramIndex


@dataclass(eq=False)
class Request:
    """One prompt to complete; `seed` is always set (drawn at submission if not given)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    arrival_time: float = 0.0
    tenant: str = "default"
    priority: int = 0  # lower runs first (0 = interactive, 1 = batch)
    cache_salt: str = ""  # prefix-cache key space: the tenant when tenants are isolated
    adapter: Adapter | None = None  # the LoRA adapter it runs with; None: the base model
    # where it runs, from admission on (the scheduler's)
    shard: int = 0  # the data shard holding its pages and its row
    row: int | None = None  # its batch row (indexes per-row device state); None: waiting
    adapter_slot: int = 0  # the device slot holding its adapter, from admission on
    pages: tuple[int, ...] = ()  # reserved at admission for its maximum length
    num_computed: int = 0  # tokens whose K/V are in the cache, or computed by a planned step
    # tokens sampled by planned steps whose results the engine has not read yet (async
    # scheduling: up to 2, the step in flight's and the one just planned)
    num_pending: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    num_registered_pages: int = 0  # leading full pages recorded as cached content
    last_page_key: bytes | None = None  # the key of the last of them, once one is computed
    token_ids: list[int] = field(init=False)  # the prompt, then every token generated
    spec_token_ids: tuple[int, ...] = ()  # draft tokens for the next step to verify
    ngram_index: "NgramIndex | None" = None  # the n-gram proposer's, once it drafts
    # its client's side (the engine's)
    output: OutputText | None = None  # released text and the stop decision
    stream: OutputStream | None = None
    admitted_time: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    # prompt logprobs gathered chunk by chunk (requests asking for them); the first
    # prompt token has none
    prompt_logprobs: list[float | None] = field(default_factory=lambda: [None])
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        """Its tokens, those sampled by steps in flight included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def phase(self) -> str:
        """queued, prefill, decode or finished."""
        if self.finish_reason is not None:
            return "finished"
        if self.row is None:
            return "queued"
        return "prefill" if self.in_prefill else "decode"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> str:
        """Take one generated token; return the text it releases to the client. Sets
        `finish_reason` when the token ends the request (EOS, a stop, max_tokens)."""
        self.token_ids.append(token_id)
        if self.output is None:  # no client text (scheduler tests): max_tokens alone stops
            if self.num_generated >= self.params.max_tokens:
                self.finish_reason = "length"
            return ""
        text = self.output.append(token_id)
        self.finish_reason = self.output.finish_reason
        return text


class RequestRejected(ValueError):
    """A request that can never be served: an empty or out-of-vocabulary prompt, or one
    too long for the model or the page pool. `param` names the request field at fault
    and `code` the OpenAI error code, for the server's 400."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Raise RequestRejected unless every logit_bias token is in the vocabulary."""
    outside = [t for t, _ in params.logit_bias if t >= vocab_size]
    if outside:
        raise RequestRejected(
            f"logit_bias token ids must be in [0, {vocab_size}), got {outside[0]}",
            "logit_bias",
        )


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """Raise RequestRejected unless `ids` is a non-empty prompt of in-vocabulary tokens."""
    if not ids:
        raise RequestRejected("prompt must not be empty")
    if any(not 0 <= t < vocab_size for t in ids):
        raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})")
