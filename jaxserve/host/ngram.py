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
one token a step, as before. A request whose drafts the model stops following (most of a
sampled request's, where text does not repeat) drafts only now and then, to probe: on a
CPU a draft token costs a large share of a decoded one at 16 rows.
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


# A request whose drafts the model has lately followed less than this drafts only to probe,
# once every PROBE_EVERY tokens. On a CPU a 16-row step is bound by its multiplies, so a
# draft token costs ~0.4 of a decoded one (a Zen 4: 16 rows of 1 and 4 tokens took 29.9
# and 65.3 ms); sampled requests (temperature 0.8, top-p 0.95) whose drafts were followed
# 24 % of the time made a c=16 run 0.73x as fast with drafts as without.
ACCEPTANCE_FLOOR = 0.5
PROBE_EVERY = 16
SMOOTHING = 0.25  # the weight of a step's share in the moving one


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram of a request's tokens last started, for its tokens up to `end`:
    kept on the request, so a step indexes only the tokens it added. Also how well its
    drafts have done: the last one, and a moving share of draft tokens that the model then
    generated (each draft's leading run that matched, over the tokens the step made)."""

    starts: dict[tuple[int, ...], int] = field(default_factory=dict)
    end: int = 0  # n-grams ending before this position are indexed
    draft: tuple[int, ...] = ()  # the last draft, to follow the token before position `at`
    at: int = 0
    acceptance: float = ACCEPTANCE_FLOOR  # a first draft the model does not follow stops it


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
        if index.draft and len(tokens) > index.at:  # what the model made where it was to go
            made = tokens[index.at : index.at + len(index.draft)]
            kept = next((i for i, (d, t) in enumerate(zip(index.draft, made)) if d != t),
                        len(made))
            index.acceptance += SMOOTHING * (kept / len(made) - index.acceptance)
            index.draft = ()
        if index.acceptance < ACCEPTANCE_FLOOR and len(tokens) % PROBE_EVERY:
            return ()
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
                index.draft = tuple(tokens[start + n : start + n + self.k])
                index.at = len(tokens)
                return index.draft
        return ()
