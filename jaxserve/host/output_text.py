"""A request's generated text as released to its client, and the decision to stop.

Stop rules, in the OpenAI/vLLM sense: EOS (unless ignore_eos), stop token ids,
stop strings (trimmed exactly, even across token boundaries), and max_tokens;
none but max_tokens fires before min_tokens. Text is released only once it can
no longer turn out to be the start of a stop string.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxserve.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.config import SamplingParams


@dataclass
class OutputText:
    """The text of one request's generated tokens, fed one token at a time (the request
    record holds the tokens themselves)."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    num_generated: int = 0
    finish_reason: str | None = None  # "stop" or "length" once finished
    _detok: IncrementalDetokenizer = field(init=False)
    _pending: str = field(init=False, default="")  # decoded but held back
    # released pieces: appending to a str attribute copies it, O(length²) over an output
    _released: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)

    @property
    def text(self) -> str:
        """The released text: never contains (the start of) a stop string."""
        return "".join(self._released)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> str:
        """Take one generated token; return the text newly released to the client."""
        params = self.params
        self.num_generated += 1
        may_stop = self.num_generated > params.min_tokens
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        if may_stop and (is_eos or token_id in params.stop_token_ids):
            self.finish_reason = "stop"
            return self._release(self._pending + self._detok.flush())
        self._pending += self._detok.add(token_id)
        if may_stop and params.stop:
            cut = _first_stop(self._pending, params.stop)
            if cut is not None:
                self.finish_reason = "stop"
                return self._release(self._pending[:cut])
        if self.num_generated >= params.max_tokens:
            self.finish_reason = "length"
            return self._release(self._pending + self._detok.flush())
        keep = _partial_stop_suffix(self._pending, params.stop) if params.stop else 0
        return self._release(self._pending[: len(self._pending) - keep], keep)

    def _release(self, text: str, keep: int = 0) -> str:
        self._pending = self._pending[len(self._pending) - keep :] if keep else ""
        if text:
            self._released.append(text)
        return text


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in `text`, if any."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _partial_stop_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
