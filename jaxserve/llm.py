"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Prompts are generated in static batches of up to `max_batch`: one prefill of
every prompt, then one decode step per token until all have stopped. Each
sequence holds its own run of pages in the paged KV cache.
"""

import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.batch import Chunk, pack_step
from jaxserve.config import SamplingParams
from jaxserve.default_model import default_model_path
from jaxserve.kv_cache import init_kv_cache
from jaxserve.loader import load
from jaxserve.page_allocator import NULL_PAGE
from jaxserve.sequence import Sequence
from jaxserve.step import step


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """What one prompt produced."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class LLM:
    """A model, its tokenizer and a KV page pool, ready to generate."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        max_batch: int = 16,
        page_size: int = 16,
        num_pages: int = 1024,
        dtype: str = "float32",
    ):
        self.model_path = Path(model) if model is not None else default_model_path()
        module, self.tokenizer = load(self.model_path, jnp.dtype(dtype))
        self.config = module.config
        self.graphdef, self.state = nnx.split(module)
        self.max_batch = max_batch
        self.page_size = page_size
        self.kv_cache = init_kv_cache(
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            num_pages,
            page_size,
            jnp.dtype(dtype),
        )
        self._seed_rng = random.Random()

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | None = None,
    ) -> list[CompletionOutput]:
        """Complete each prompt (a string or a list of token ids)."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        outputs: list[CompletionOutput] = []
        for start in range(0, len(encoded), self.max_batch):
            group = encoded[start : start + self.max_batch]
            for prompt, seq in zip(prompts[start:], self._generate_batch(group, params)):
                outputs.append(
                    CompletionOutput(
                        prompt=prompt if isinstance(prompt, str) else None,
                        prompt_token_ids=seq.prompt_ids,
                        token_ids=seq.output_ids,
                        text=seq.text,
                        finish_reason=seq.finish_reason,
                    )
                )
        return outputs

    def _encode(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < self.config.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        return ids

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        eos = self.config.eos_token_ids or self.tokenizer.eos_token_ids
        seqs = [Sequence(p, params, self.tokenizer, eos) for p in prompts]
        seeds = [
            params.seed if params.seed is not None else self._seed_rng.getrandbits(31)
            for _ in prompts
        ]
        need = [-(-(len(p) + params.max_tokens) // self.page_size) for p in prompts]
        if sum(need) >= self.kv_cache.num_pages:
            raise ValueError(
                f"batch needs {sum(need)} KV pages, the pool has {self.kv_cache.num_pages - 1}"
            )
        first = np.cumsum([1] + need[:-1])  # page 0 is the null page
        pages = [list(range(f, f + n)) for f, n in zip(first, need)]
        max_pages = _next_power_of_two(max(need))
        num_seqs = _next_power_of_two(len(seqs))
        chunks = [
            self._chunk(seq.prompt_ids, 0, pg, params, seed)
            for seq, pg, seed in zip(seqs, pages, seeds)
        ]
        num_tokens = _next_power_of_two(sum(len(p) for p in prompts))
        while True:
            inputs = pack_step(chunks, self.page_size, num_tokens, num_seqs, max_pages)
            tokens, self.kv_cache = step(self.graphdef, self.state, self.kv_cache, inputs)
            tokens = jax.device_get(tokens)
            for seq, token in zip(seqs, tokens):
                if not seq.finished:
                    seq.append(int(token))
            if all(seq.finished for seq in seqs):
                return seqs
            # finished rows decode a dummy token into the null page; their output is ignored
            chunks = [
                Chunk([0], 0, [NULL_PAGE])
                if seq.finished
                else self._chunk(
                    [seq.output_ids[-1]], seq.num_tokens - 1, pg, params, seed, len(seq.output_ids)
                )
                for seq, pg, seed in zip(seqs, pages, seeds)
            ]
            num_tokens = num_seqs

    @staticmethod
    def _chunk(
        token_ids: list[int],
        start: int,
        pages: list[int],
        params: SamplingParams,
        seed: int,
        num_generated: int = 0,
    ) -> Chunk:
        return Chunk(
            token_ids,
            start,
            pages,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed,
            num_generated=num_generated,
        )
