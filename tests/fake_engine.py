"""An engine on a fake runner whose outputs can be computed by hand (no jax).

The fake model's next token is (last token of the chunk + 1) mod VOCAB, so a
prompt ending in token t continues t+1, t+2, …; token 0 is EOS.
"""

import functools

import numpy as np
import tokenizers

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.host.buckets import BucketTable
from jaxserve.host.engine import Engine
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.plan import StepPlan
from jaxserve.host.results import RESULT_WIDTH, PendingStep, StepOutput
from jaxserve.host.scheduler import Scheduler

VOCAB = 100
EOS = 0


def word_tokenizer() -> Tokenizer:
    """Token i is the word `w{i}`; words are separated by spaces."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return Tokenizer(backend, eos_token="w0")


def next_token(token: int) -> int:
    return (token + 1) % VOCAB


class FakeRunner:
    """Records every step's plan and answers with last token + 1; a row with draft tokens
    accepts each draft the fake model agrees with (draft = previous token + 1), up to the
    first it does not, then samples after the last accepted one, as a verifying step would.
    A step runs when its results are read (steps are read in launch order); a placeholder
    token (async scheduling) reads its row's last sampled token, as the device does."""

    def __init__(self) -> None:
        self.steps: list[StepPlan] = []
        self.last: dict[int, int] = {}  # row -> its last sampled token

    def launch(self, plan: StepPlan) -> PendingStep:
        self.steps.append(plan)
        return PendingStep(functools.partial(self.execute, plan))

    def execute(self, plan: StepPlan) -> StepOutput:
        rows = []
        for c in plan.chunks:
            real = len(c.token_ids) - c.num_speculative
            last = c.token_ids[real - 1]
            accepted = [next_token(self.last[-1 - last] if last < 0 else last)]
            for draft in c.token_ids[real:]:
                if draft != accepted[-1]:
                    break
                accepted.append(next_token(draft))
            rows.append(accepted if c.samples else [])
            if c.samples:
                self.last[c.row] = accepted[-1]
        k = max([1, *map(len, rows)])
        packed = np.zeros((len(rows), RESULT_WIDTH), np.float32)
        one = StepOutput.unpack(packed)
        tokens = np.zeros((len(rows), k), np.int32)
        for i, accepted in enumerate(rows):
            tokens[i, : len(accepted)] = accepted
        return StepOutput(
            tokens, np.array([len(a) for a in rows], np.int32),
            np.repeat(one.logprobs, k, axis=1), np.repeat(one.top_ids, k, axis=1),
            np.repeat(one.top_logprobs, k, axis=1),
        )


def make_engine(
    num_pages: int = 33,
    page_size: int = 4,
    max_batch: int = 4,
    token_budget: int = 16,
    max_model_len: int = 64,
    stream_capacity: int = 64,
    prefix_caching: bool = True,
    proposer=None,
    reserved_rows: int = 0,
    async_scheduling: bool = False,
) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner()
    scheduler = Scheduler(
        [PageAllocator(num_pages)],
        BucketTable.for_limits(max_batch, token_budget),
        page_size,
        max_batch,
        max_model_len,
        token_budget,
        prefix_caching,
        reserved_rows,
        num_speculative_tokens=0 if proposer is None else proposer.k,
    )
    engine = Engine(
        runner, scheduler, word_tokenizer(), (EOS,), stream_capacity, debug_checks=True,
        proposer=proposer, async_scheduling=async_scheduling,
    )
    return engine, runner
