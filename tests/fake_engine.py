"""An engine on a fake runner whose outputs can be computed by hand (no jax).

The fake model's next token is (last token of the chunk + 1) mod VOCAB, so a
prompt ending in token t continues t+1, t+2, …; token 0 is EOS.
"""

import numpy as np
import tokenizers

from jaxserve.buckets import BucketTable
from jaxserve.engine import Engine
from jaxserve.page_allocator import PageAllocator
from jaxserve.results import RESULT_WIDTH, StepResults
from jaxserve.scheduler import Scheduler, SchedulerOutput
from jaxserve.tokenizer import Tokenizer

VOCAB = 100
EOS = 0


def word_tokenizer() -> Tokenizer:
    """Token i is the word `w{i}`; words are separated by spaces."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return Tokenizer(backend, eos_token="w0")


class FakeRunner:
    """Records every step's plan and answers with last token + 1."""

    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> StepResults:
        self.steps.append(out)
        tokens = [(c.token_ids[-1] + 1) % VOCAB for c in out.chunks]
        packed = np.zeros((len(tokens), RESULT_WIDTH), np.float32)
        packed[:, 0] = tokens
        return StepResults.unpack(packed)


def make_engine(
    num_pages: int = 33,
    page_size: int = 4,
    max_batch: int = 4,
    token_budget: int = 16,
    max_model_len: int = 64,
    stream_capacity: int = 64,
    prefix_caching: bool = True,
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
    )
    engine = Engine(
        runner, scheduler, word_tokenizer(), (EOS,), stream_capacity, debug_checks=True
    )
    return engine, runner
