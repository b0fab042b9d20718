"""What a step returns to the host (no jax): per row, the tokens it accepted and their
logprobs, unpacked once per step from the step's one results array.

A row accepts nothing (a prefill chunk that does not reach its last token), one token
(the one sampled after its last token), or, with draft tokens, the drafts the model
agrees with and the token sampled after the last of them: up to k = 1 + drafts.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.config import MAX_LOGPROBS

# columns of the step's results array: token, its logprob, MAX_LOGPROBS alternative ids,
# their logprobs
RESULT_WIDTH = 2 + 2 * MAX_LOGPROBS


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Per row, its accepted tokens (the first num_accepted[row] of tokens[row]), each with
    its log-probability and the most likely alternatives."""

    tokens: np.ndarray  # i32[num_rows, k]
    num_accepted: np.ndarray  # i32[num_rows]
    logprobs: np.ndarray  # f32[num_rows, k]
    top_ids: np.ndarray  # i32[num_rows, k, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[num_rows, k, MAX_LOGPROBS]
    # request id -> one row per token of its prompt chunk this step: the prompt token
    # that follows it and that token's logprob (for requests asking prompt logprobs)
    prompt_logprobs: dict[str, "StepOutput"] = field(default_factory=dict)
    # seconds the host waited on the device for this step's results (0: no device)
    device_seconds: float = 0.0

    def accepted(self) -> list[list[int]]:
        """Every row's accepted tokens, converted in one go (slicing the arrays row by row
        costs ~0.25 us a row, which a 256-row step pays on the host)."""
        if self.tokens.shape[1] == 1:  # no drafts: half the time of slicing each row
            return [[t] if n else [] for t, n in zip(self.tokens[:, 0].tolist(),
                                                     self.num_accepted.tolist())]
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.num_accepted.tolist())]

    @staticmethod
    def unpack(results: np.ndarray, samples: np.ndarray | None = None) -> "StepOutput":
        """One token a row from the step's f32[num_rows, RESULT_WIDTH] array (ids are exact
        in f32); `samples` (bool[num_rows]) says which rows accepted theirs (default all)."""
        n = MAX_LOGPROBS
        num_rows = results.shape[0]
        accepted = np.ones(num_rows, np.int32) if samples is None else samples.astype(np.int32)
        return StepOutput(
            results[:, 0:1].astype(np.int32),
            accepted,
            results[:, 1:2],
            results[:, None, 2 : 2 + n].astype(np.int32),
            results[:, None, 2 + n :],
        )

    def verified(self, drafts: list[Sequence[int]], after: list[Sequence[int]]) -> "StepOutput":
        """Verification of each row's `drafts`, given `after`, the token the step drew after
        each of them: a row keeps its sampled token, then each draft that equals the
        token drawn before it and the token drawn after that draft, so its tokens are
        those that decoding one at a time would give (step.py's `_step`). Tokens past
        the first have no logprobs (rows with drafts ask for none)."""
        k = 1 + max(map(len, drafts), default=0)
        tokens = np.zeros((len(drafts), k), np.int32)
        tokens[:, 0] = self.tokens[:, 0]
        accepted = self.num_accepted.copy()
        for row, (draft, model) in enumerate(zip(drafts, after)):
            n = 0
            while n < len(draft) and accepted[row] and draft[n] == tokens[row, n]:
                tokens[row, n + 1] = model[n]
                n += 1
            accepted[row] += n

        def widened(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros((len(a), k - 1, *a.shape[2:]), a.dtype)], 1)

        return StepOutput(tokens, accepted, widened(self.logprobs), widened(self.top_ids),
                          widened(self.top_logprobs), self.prompt_logprobs, self.device_seconds)


@dataclass(frozen=True, slots=True)
class PendingStep:
    """A launched step: `output()` waits for its results; `done()` says, without waiting,
    whether the device has finished it."""

    output: Callable[[], StepOutput]
    done: Callable[[], bool] = lambda: True


@dataclass(frozen=True, slots=True)
class StepTime:
    """Where one engine iteration's time went: waiting on the device, and everything else
    (take in, schedule, pack, transfer, unpack, post-process, emit), which on a GPU is
    most of a small model's step. `device_idle_seconds` bounds from above how long the
    device had nothing to run meanwhile: all of the host's time when each step is planned
    after the one before is read; with async scheduling only the host time before a
    launch that found the step before already finished."""

    host_seconds: float
    device_seconds: float
    device_idle_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.host_seconds + self.device_seconds
