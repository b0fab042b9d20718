"""The step's results as the host reads them (no jax): one array, unpacked once per step."""

from dataclasses import dataclass, field

import numpy as np

from jaxserve.config import MAX_LOGPROBS

# columns: token, its logprob, MAX_LOGPROBS alternative ids, their logprobs
RESULT_WIDTH = 2 + 2 * MAX_LOGPROBS


@dataclass(frozen=True, slots=True)
class StepResults:
    """Per row: the sampled token, its log-probability and the most likely alternatives."""

    tokens: np.ndarray  # i32[num_seqs]
    logprobs: np.ndarray  # f32[num_seqs]
    top_ids: np.ndarray  # i32[num_seqs, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[num_seqs, MAX_LOGPROBS]
    # request id -> one row per token of its prompt chunk this step: the prompt token
    # that follows it and that token's logprob (for requests asking prompt logprobs)
    prompt_logprobs: dict[str, "StepResults"] = field(default_factory=dict)

    @staticmethod
    def unpack(results: np.ndarray) -> "StepResults":
        """Split the step's f32[num_seqs, RESULT_WIDTH] array (ids are exact in f32)."""
        n = MAX_LOGPROBS
        return StepResults(
            results[:, 0].astype(np.int32),
            results[:, 1],
            results[:, 2 : 2 + n].astype(np.int32),
            results[:, 2 + n :],
        )
