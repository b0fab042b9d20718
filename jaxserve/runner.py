"""The device side of the engine: weights, the KV pool and the jitted step over buckets.

Every bucket is compiled at warm-up, with jax's persistent compilation cache so a
second start is fast. Backend compiles are counted through jax.monitoring; one
after warm-up means a shape escaped the bucket table, and is logged as an error.

Given a mesh, the weights, the KV pool and the step are laid out by
`sharding.Layout`; without one everything sits on the default device.
"""

import dataclasses
import logging
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.attention import select_backend
from jaxserve.batch import Chunk, pack_step
from jaxserve.buckets import BucketTable
from jaxserve.kv_cache import init_kv_cache
from jaxserve.page_allocator import NULL_PAGE
from jaxserve.results import StepResults
from jaxserve.sampling import init_penalty_state
from jaxserve.scheduler import SchedulerOutput
from jaxserve.sharding import Layout
from jaxserve.step import score, sharded_score, sharded_step, step

log = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compiles in this process (all threads)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count += 1


_COMPILES = CompileCounter()


def compile_count() -> int:
    """XLA backend compiles so far in this process."""
    return _COMPILES.count


def enable_compilation_cache(directory: str | Path) -> None:
    """Persist compiled executables under `directory` (every entry, however quick)."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class ModelRunner:
    """Runs scheduler outputs on the model; the engine's Runner."""

    def __init__(
        self,
        model: nnx.Module,
        buckets: BucketTable,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        num_slots: int,
        attention_backend: str | None = None,
        dtype: jnp.dtype = jnp.float32,
        mesh: jax.sharding.Mesh | None = None,
    ):
        cfg = model.config
        self.graphdef, self.state = nnx.split(model)
        self.buckets = buckets
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.backend = select_backend(attention_backend)
        kv_shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        self.layout = None if mesh is None else Layout.build(mesh, self.state, kv_shape)
        self.kv_cache = init_kv_cache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size, dtype,
            None if self.layout is None else self.layout.kv_cache.k,
        )
        self.spare_slot = num_slots
        self.penalties = init_penalty_state(num_slots, cfg.vocab_size)
        self._step, self._score = step, score
        if self.layout is not None:
            # a no-op for weights loaded into their shardings (loader.load with the mesh)
            self.state = jax.device_put(self.state, self.layout.state)
            self.penalties = jax.device_put(self.penalties, self.layout.replicated)
            self._step = sharded_step(self.layout)
            self._score = sharded_score(self.layout)
        self.step_times: dict[tuple[int, int], float] = {}  # bucket -> median seconds
        self.warm = False
        self.compiles_after_warmup = 0

    def execute(self, out: SchedulerOutput) -> StepResults:
        chunks = [
            Chunk(
                c.token_ids,
                c.start,
                c.seq.pages,
                c.seq.request.params,
                seed=c.seq.request.seed,
                num_generated=c.seq.num_generated,
                slot=c.seq.slot,
                is_prompt=c.seq.in_prefill,
                samples=c.samples,
                first=c.first,
            )
            for c in out.chunks
        ]
        # scored before the step, so the K/V the cache keeps are the step's own
        prompt = {
            c.seq.request_id: self._score_chunk(chunk, c.seq.request.prompt_ids)
            for c, chunk in zip(out.chunks, chunks)
            if c.seq.in_prefill and c.seq.request.params.prompt_logprobs is not None
        }
        results = self._run(chunks, out.bucket)
        return dataclasses.replace(results, prompt_logprobs=prompt) if prompt else results

    def _score_chunk(self, chunk: Chunk, prompt_ids: tuple[int, ...]) -> StepResults:
        """Prompt logprobs of a prefill chunk, one row per token (see `step.score`).

        The last prompt token has no prompt token after it: its row's target is 0.
        """
        n = len(chunk.token_ids)
        num_tokens, _ = self.buckets.choose(n, 1)
        inputs = pack_step(
            [chunk], self.page_size, num_tokens, 1, self.max_pages, self.spare_slot, self.backend
        )
        metadata = dataclasses.replace(
            inputs.metadata, logits_indices=np.arange(num_tokens, dtype=np.int32)
        )
        targets = np.zeros(num_tokens, np.int32)
        following = prompt_ids[chunk.start + 1 : chunk.start + n + 1]
        targets[: len(following)] = following
        before = _COMPILES.count
        results, self.kv_cache = self._score(
            self.graphdef, self.state, self.kv_cache, inputs.token_ids, inputs.positions,
            metadata, targets,
        )
        self._count_compiles(before, (num_tokens, 1))
        return StepResults.unpack(np.asarray(jax.device_get(results))[:n])

    def _run(self, chunks: list[Chunk], bucket: tuple[int, int]) -> StepResults:
        num_tokens, num_seqs = bucket
        inputs = pack_step(
            chunks,
            self.page_size,
            num_tokens,
            num_seqs,
            self.max_pages,
            self.spare_slot,
            self.backend,
        )
        before = _COMPILES.count
        results, self.kv_cache, self.penalties = self._step(
            self.graphdef, self.state, self.kv_cache, self.penalties, inputs
        )
        results = StepResults.unpack(np.asarray(jax.device_get(results)))
        self._count_compiles(before, bucket)
        return results

    def _count_compiles(self, before: int, bucket: tuple[int, int]) -> None:
        if self.warm and _COMPILES.count > before:
            self.compiles_after_warmup += _COMPILES.count - before
            log.error("compiled while serving: bucket %s (a shape outside the table)", bucket)

    def warmup(self, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Compile and time every bucket on dummy inputs that touch only the null page.

        The dummy rows sit at the end of the longest context, so the measured step
        times are the worst case that the TPOT bound needs. The prompt-logprob pass
        (`step.score`) is compiled for every token size too.
        """
        context = self.max_pages * self.page_size
        for num_tokens in self.buckets.token_sizes:
            start = context - num_tokens
            self._score_chunk(Chunk([0] * num_tokens, start, [NULL_PAGE] * self.max_pages), ())
        buckets = self.buckets.buckets()
        show = sys.stderr.isatty()
        for i, (num_tokens, num_seqs) in enumerate(buckets):
            n = num_tokens // num_seqs
            dummy = [Chunk([0] * n, context - n, [NULL_PAGE] * self.max_pages)] * num_seqs
            self._run(dummy, (num_tokens, num_seqs))  # compile
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self._run(dummy, (num_tokens, num_seqs))
                times.append(time.perf_counter() - start)
            self.step_times[(num_tokens, num_seqs)] = float(np.median(times))
            if show:
                print(
                    f"\rwarm-up: {i + 1}/{len(buckets)} buckets compiled",
                    end="" if i + 1 < len(buckets) else "\n",
                    file=sys.stderr,
                    flush=True,
                )
        self.warm = True
        return self.step_times

    def max_batch_under(self, tpot_slo_s: float, fraction: float = 0.6) -> int:
        """Largest row count whose slowest bucket stays under `fraction` of the TPOT SLO."""
        best = 0
        for seqs in self.buckets.seq_sizes:
            worst = max(t for (_, s), t in self.step_times.items() if s == seqs)
            if worst <= fraction * tpot_slo_s:
                best = seqs
        return best
