"""Draft tokens by prompt lookup: speculative decoding without a draft model (no jax).

vLLM's "ngram" method: a request's last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) are looked up among its earlier tokens, prompt and output alike,
and the tokens that followed their latest earlier occurrence are the draft. Text that
repeats what came before (code being edited, a quoted document, a list, a small model
looping under greedy decoding) is drafted well; other text finds no match and is
decoded as before. The step verifies every draft (runner.py): the model's tokens are the
same with drafts or without, made in fewer steps.

Requests without penalties, logit bias or logprobs get drafts, greedy or sampled: the
token after each draft is then drawn from the logits there as the row's own token is,
which the step does for drafts alone (step.py), and a draft is kept while it equals the
token drawn before it: for a sampled request, rejection sampling. Other requests decode
one token a step, as before.
"""

from dataclasses import dataclass, field

from jaxserve.config import SamplingParams
from jaxserve.host.request import Request


def takes_drafts(params: SamplingParams) -> bool:
    """Whether the step can verify drafts for a request sampled so: its next token must be
    drawn from the model's logits as they are (no penalties, which the tokens before it
    change, and no logit bias), and it must want no logprobs of them."""
    return (params.presence_penalty == 0 and params.frequency_penalty == 0
            and params.repetition_penalty == 1 and not params.logit_bias
            and params.logprobs is None)


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram of a request's tokens last started, for its tokens up to `end`:
    kept on the request, so a step indexes only the tokens it added."""

    starts: dict[tuple[int, ...], int] = field(default_factory=dict)
    end: int = 0  # n-grams ending before this position are indexed


class NgramProposer:
    """The engine's `Proposer`: up to `num_speculative_tokens` drafts a request a step."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.sizes = range(prompt_lookup_max, prompt_lookup_min - 1, -1)  # longest first

    def propose(self, request: Request) -> tuple[int, ...]:
        if not takes_drafts(request.params):
            return ()
        tokens = request.token_ids
        index = request.ngram_index
        if index is None:
            index = request.ngram_index = NgramIndex()
        last = len(tokens) - 1
        # every n-gram ending before the last token: each has a token after it, and the
        # suffix being looked up is not among them
        for end in range(index.end, last):
            for n in self.sizes:
                if n <= end + 1:
                    index.starts[tuple(tokens[end + 1 - n : end + 1])] = end + 1 - n
        index.end = max(index.end, last)
        for n in self.sizes:
            start = index.starts.get(tuple(tokens[-n:])) if n <= len(tokens) else None
            if start is not None:
                return tuple(tokens[start + n : start + n + self.k])
        return ()
